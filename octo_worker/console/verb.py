"""``octo-worker console`` and the daemon's optional console beside its metrics.

``add_console_verb`` registers the verb on the ``octo-worker`` parser;
``cmd_console`` serves the pages until SIGINT/SIGTERM; ``run_with_console``
runs the daemon with the console in its event loop when ``[console] listen``
is set (off by default). Both check the bind address and the token before a
socket is opened, and fail as a configuration error (exit 2).

This module never prints or logs the access token, and serves nothing but
``octo_worker.console.app``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog

from octo_common.runtime.output import EXIT_OK, Output
from octo_worker.cli.common import config_of, run_event_loop
from octo_worker.config import InvalidConfiguration, WorkerConfig
from octo_worker.console.security import (
    AccessToken,
    BindAddress,
    check_bind,
    load_token,
    parse_listen,
)

if TYPE_CHECKING:  # the web stack loads only when a console is served
    from aiohttp import web

    from octo_worker.console.app import ConsoleSettings
    from octo_worker.console.live import LiveSource
    from octo_worker.daemon import WorkerDaemon

__all__ = ["DEFAULT_LISTEN", "add_console_verb", "cmd_console", "run_with_console"]

DEFAULT_LISTEN: Final = "127.0.0.1:9465"


def add_console_verb(verbs: Any, common: argparse.ArgumentParser) -> None:
    """``octo-worker console`` on the verb subparsers of ``octo-worker``."""
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


def _token(config: WorkerConfig, override: str | None) -> AccessToken | None:
    if override is not None:
        return load_token(Path(override), "--token-file")
    configured = config.console.token_file
    if configured is None:
        return None
    where = "console.token_file"
    return load_token(config.path(configured, where), where)


def _metrics_source(config: WorkerConfig) -> LiveSource:
    from octo_worker.console.live import ScrapeSource, UnavailableSource

    listen = config.metrics.listen
    if listen is None:
        return UnavailableSource(
            "no live source: the daemon's [metrics] listen is not configured "
            "(or serve the console from the daemon with [console] listen)"
        )
    return ScrapeSource(listen)


async def _start_site(settings: ConsoleSettings, address: BindAddress) -> tuple[web.AppRunner, str]:
    from aiohttp import web

    from octo_worker.console.app import build_app

    # A stop waits at most this long for pages still being gathered.
    runner = web.AppRunner(
        build_app(settings), access_log=None, handle_signals=False, shutdown_timeout=3.0
    )
    await runner.setup()
    site = web.TCPSite(runner, address.host, address.port, reuse_address=True)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        hint = ""
        if error.errno == errno.EADDRINUSE and not settings.served_by_daemon:
            hint = "; a daemon with [console] listen may serve the console there already"
        raise InvalidConfiguration(
            f"console: cannot listen on {address.host}:{address.port} "
            f"({error.strerror or type(error).__name__}){hint}"
        ) from None
    # Port 0 asks the kernel for a free port: report the one it chose.
    port = int(runner.addresses[0][1]) if runner.addresses else address.port
    bound = BindAddress(address.host, port)
    return runner, bound.url()


def cmd_console(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    address = parse_listen(args.listen, "--listen")
    token = _token(config, args.token_file)
    check_bind(
        address,
        allow_remote=args.allow_remote or config.console.allow_remote,
        token_configured=token is not None,
    )
    from octo_worker.console.app import ConsoleSettings

    settings = ConsoleSettings(config, args.config, _metrics_source(config), token)

    async def serve() -> str:
        runner, url = await _start_site(settings, address)
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


async def run_with_console(daemon: WorkerDaemon, config: WorkerConfig, config_path: str) -> None:
    """``daemon.run`` with the console served in the same loop when ``[console] listen``
    is set; the live view then reads the daemon's own metrics in process."""
    listen = config.console.listen
    if listen is None:
        await daemon.run(install_signal_handlers=True)
        return
    address = parse_listen(listen, "console.listen")
    token = _token(config, None)
    check_bind(
        address, allow_remote=config.console.allow_remote, token_configured=token is not None
    )
    from octo_worker.console.app import ConsoleSettings
    from octo_worker.console.live import RegistrySource

    settings = ConsoleSettings(
        config,
        config_path,
        RegistrySource(daemon.metrics.registry),
        token,
        served_by_daemon=True,
    )
    runner, url = await _start_site(settings, address)
    structlog.get_logger("octo.worker.console").info("console_listening", url=url)
    try:
        await daemon.run(install_signal_handlers=True)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
