"""``octo-worker console``: serve the read-only web console until SIGINT/SIGTERM.

Loopback by default (``--listen``); a non-loopback address needs
``--allow-remote`` and an access-token file (``octo_worker.console.security``).
The pages, and serving them, are ``octo_worker.console``; this module owns
the verb's options and its one line (or ``--json`` document) naming the URL.
It never prints the access token.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from octo_common.runtime.output import EXIT_OK, OneLineParser, Output
from octo_worker.cli.common import config_of, run_event_loop
from octo_worker.console.security import check_bind, parse_listen
from octo_worker.console.serve import DEFAULT_LISTEN, metrics_source, start_site, token_of

__all__ = ["cmd_console", "register"]

Verbs = Any  # argparse's sub-parsers action


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``console`` to the verbs."""
    console = verbs.add_parser(
        "console",
        parents=[common],
        help="serve the read-only web console (loopback by default)",
    )
    console.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"address to serve on (default {DEFAULT_LISTEN}; port 0 picks a free one)",
    )
    console.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback address (needs --token-file or console.token_file)",
    )
    console.add_argument(
        "--token-file",
        metavar="PATH",
        help="access-token file (mode 0600; default console.token_file)",
    )
    console.set_defaults(handler=cmd_console)


def cmd_console(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    address = parse_listen(args.listen, "--listen")
    token = token_of(config, args.token_file)
    check_bind(
        address,
        allow_remote=args.allow_remote or config.console.allow_remote,
        token_configured=token is not None,
    )
    # The web stack loads only when a console is served.
    from octo_worker.console.app import ConsoleSettings

    settings = ConsoleSettings(config, args.config, metrics_source(config), token)

    async def serve() -> str:
        runner, url = await start_site(settings, address)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        out.line(f"console: {url} (read-only; Ctrl-C stops it)")
        out.document({"ok": True, "url": url, "token_required": token is not None})
        out.stdout.flush()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
        return url

    run_event_loop(serve(), config.worker.event_loop)
    return EXIT_OK
