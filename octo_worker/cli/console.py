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
import os
import signal
from pathlib import Path
from typing import Any

from octo_common.runtime.output import EXIT_OK, EXIT_USAGE, CliError, OneLineParser, Output
from octo_worker.cli.common import config_of, run_event_loop
from octo_worker.console.security import (
    ConsoleSessions,
    check_bind,
    generate_token,
    parse_listen,
)
from octo_worker.console.serve import (
    DEFAULT_LISTEN,
    metrics_source,
    start_site,
    tls_of,
    token_of,
)

__all__ = ["cmd_console", "cmd_console_token", "register"]

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
    console.add_argument(
        "--tls-cert", metavar="PATH", help="serve HTTPS with this certificate (PEM)"
    )
    console.add_argument(
        "--tls-key", metavar="PATH", help="the certificate's private key (PEM, mode 0600)"
    )
    console.add_argument(
        "--behind-proxy",
        action="store_true",
        help="a reverse proxy serves the console over HTTPS (docs/operations.md)",
    )
    console.set_defaults(handler=cmd_console)
    token = verbs.add_parser(
        "console-token",
        parents=[common],
        help="write a new random console access token to a new 0600 file",
    )
    token.add_argument("path", metavar="PATH", help="the token file to create (never replaced)")
    token.set_defaults(handler=cmd_console_token)


def cmd_console_token(args: argparse.Namespace, out: Output) -> int:
    """Create ``PATH`` (mode 0600, refused if it exists) holding a 256-bit token."""
    path = Path(args.path)
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise CliError(EXIT_USAGE, f"{path} exists: a token file is never replaced") from None
    except OSError as exc:
        raise CliError(EXIT_USAGE, f"cannot create {path} ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(generate_token() + "\n")
    out.line(f"console token: written to {path} (mode 0600)")
    out.document({"ok": True, "path": str(path)})
    return EXIT_OK


def cmd_console(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    address = parse_listen(args.listen, "--listen")
    token = token_of(config, args.token_file)
    tls = tls_of(config, args.tls_cert, args.tls_key)
    check_bind(
        address,
        allow_remote=args.allow_remote or config.console.allow_remote,
        token_configured=token is not None,
        tls=tls is not None,
        behind_proxy=args.behind_proxy or config.console.behind_proxy,
    )
    # The web stack loads only when a console is served.
    from octo_worker.console.app import ConsoleSettings

    settings = ConsoleSettings(
        config,
        args.config,
        metrics_source(config),
        token,
        sessions=ConsoleSessions(config.console.session_minutes * 60.0),
    )

    async def serve() -> str:
        runner, url = await start_site(settings, address, tls)
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
