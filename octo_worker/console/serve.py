"""Serving the console: for ``octo-worker console`` and beside the daemon.

``start_site`` binds the console's aiohttp application; ``token_of`` loads
the configured access token; ``metrics_source`` picks the standalone live
view's source; ``run_with_console`` runs the daemon with the console in its
event loop when ``[console] listen`` is set (off by default). The bind
address and the token are checked before a socket is opened; a failure is a
configuration error (exit 2). The verb itself is ``octo_worker.cli.console``.

This module never prints or logs the access token, and serves nothing but
``octo_worker.console.app``.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import TYPE_CHECKING, Final

import structlog

from octo_common.runtime.tls import TlsSettings
from octo_worker.config import InvalidConfiguration, WorkerConfig
from octo_worker.console.security import (
    AccessToken,
    BindAddress,
    ConsoleSessions,
    check_bind,
    load_token,
    parse_listen,
)

if TYPE_CHECKING:  # the web stack loads only when a console is served
    from aiohttp import web

    from octo_worker.console.app import ConsoleSettings
    from octo_worker.console.live import LiveSource
    from octo_worker.daemon.daemon import WorkerDaemon

__all__ = [
    "DEFAULT_LISTEN",
    "metrics_source",
    "run_with_console",
    "start_site",
    "tls_of",
    "token_of",
]

DEFAULT_LISTEN: Final = "127.0.0.1:9465"


def token_of(config: WorkerConfig, override: str | None) -> AccessToken | None:
    if override is not None:
        return load_token(Path(override), "--token-file")
    configured = config.console.token_file
    if configured is None:
        return None
    where = "console.token_file"
    return load_token(config.path(configured, where), where)


def metrics_source(config: WorkerConfig) -> LiveSource:
    from octo_worker.console.live import ScrapeSource, UnavailableSource

    listen = config.metrics.listen
    if listen is None:
        return UnavailableSource(
            "no live source: the daemon's [metrics] listen is not configured "
            "(or serve the console from the daemon with [console] listen)"
        )
    return ScrapeSource(listen)


def tls_of(config: WorkerConfig, cert: str | None, key: str | None) -> TlsSettings | None:
    """The console's TLS: ``--tls-cert``/``--tls-key`` over ``[console.tls]`` (None: plain HTTP)."""
    if cert is not None or key is not None:
        return TlsSettings(
            where="--tls-cert/--tls-key",
            cert_file=None if cert is None else Path(cert),
            key_file=None if key is None else Path(key),
        )
    return config.tls_settings(config.console.tls, "console.tls")


async def start_site(
    settings: ConsoleSettings, address: BindAddress, tls: TlsSettings | None = None
) -> tuple[web.AppRunner, str]:
    from aiohttp import web

    from octo_worker.console.app import build_app

    # A stop waits at most this long for pages still being gathered.
    runner = web.AppRunner(
        build_app(settings), access_log=None, handle_signals=False, shutdown_timeout=3.0
    )
    await runner.setup()
    try:
        context = None if tls is None else tls.server_context()
    except InvalidConfiguration:
        await runner.cleanup()
        raise
    site = web.TCPSite(runner, address.host, address.port, reuse_address=True, ssl_context=context)
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
    return runner, bound.url("http" if tls is None else "https")


async def run_with_console(daemon: WorkerDaemon, config: WorkerConfig, config_path: str) -> None:
    """``daemon.run`` with the console served in the same loop when ``[console] listen``
    is set; the live view then reads the daemon's own metrics in process."""
    listen = config.console.listen
    if listen is None:
        await daemon.run(install_signal_handlers=True)
        return
    address = parse_listen(listen, "console.listen")
    token = token_of(config, None)
    tls = tls_of(config, None, None)
    check_bind(
        address,
        allow_remote=config.console.allow_remote,
        token_configured=token is not None,
        tls=tls is not None,
        behind_proxy=config.console.behind_proxy,
    )
    from octo_worker.console.app import ConsoleSettings
    from octo_worker.console.live import RegistrySource

    settings = ConsoleSettings(
        config,
        config_path,
        RegistrySource(daemon.metrics.registry),
        token,
        served_by_daemon=True,
        sessions=ConsoleSessions(config.console.session_minutes * 60.0),
    )
    runner, url = await start_site(settings, address, tls)
    structlog.get_logger("octo.worker.console").info("console_listening", url=url)
    try:
        await daemon.run(install_signal_handlers=True)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()
