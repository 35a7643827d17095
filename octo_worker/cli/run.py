"""``octo-worker run`` and ``check``: the daemon, and the checks of what it needs to start.

``run`` configures the process's logging (JSON lines on stderr, no
exception text), serves the metrics endpoint when configured, and runs the
daemon (with the console beside it when ``[console] listen`` is set) until
SIGTERM. ``check`` reports, one line each, what ``run`` would refuse
before it reaches the broker, in the order ``run`` meets it
(:mod:`octo_worker.daemon.startup` holds the rules both apply): the configuration
and its event loop, the metrics and console listen addresses, each key
file, the adapters, the state directory and the journal (read-only:
schema, anchor, every configured scope against its sealed head, its
sessions as a start reads them); then the broker.

It must never print a key, a password or a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiormq
import structlog

from octo_common.errors import OctoError, StorageError
from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_SUPERSEDED,
    EXIT_USAGE,
    CliError,
    Output,
    drop_exception_text,
    one_line,
)
from octo_common.runtime.postgres import read_password_file
from octo_common.transport import worker_queue
from octo_worker.cli.adapters import load_enabled
from octo_worker.cli.common import (
    PROG,
    Verbs,
    broker_connection,
    config_of,
    event_loop_refusal,
    journal_store,
    run_event_loop,
    uvloop_installed,
)
from octo_worker.config import InvalidConfiguration, WorkerConfig, load_scope_key
from octo_worker.daemon.startup import (
    bind_refusal,
    creatable,
    listen_address,
    served_by_octo_worker,
    state_directories,
)
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.configured import configured_store

__all__ = ["cmd_check", "cmd_run", "configure_logging", "register", "serve"]


_LEVELS: Final = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class _LibraryLogFormatter(logging.Formatter):
    """Library (stdlib) log records as one JSON line, without exception text."""

    def format(self, record: logging.LogRecord) -> str:
        document = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage()[:300],
        }
        if record.exc_info and record.exc_info[0] is not None:
            document["error_type"] = record.exc_info[0].__name__
        return json.dumps(document, separators=(",", ":"))


def configure_logging(level: str = "info", log_format: str = "auto") -> None:
    """Configure structlog once for this process: JSON or human-readable lines on stderr.

    ``log_format`` ``"auto"`` is human-readable when stderr is a terminal,
    JSON otherwise. Timestamps are ISO 8601 UTC; every line has a level. Library loggers
    (aio-pika, aiormq) go through the stdlib at WARNING and above, rendered
    the same way, without tracebacks.
    """
    renderer: Any
    if log_format == "auto":
        log_format = "console" if sys.stderr.isatty() else "json"
    if log_format == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    else:
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            drop_exception_text,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LibraryLogFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(max(logging.WARNING, _LEVELS.get(level, logging.INFO)))


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``run`` and ``check`` to the verbs."""
    run = verbs.add_parser("run", parents=[common], help="run the daemon (systemd: Type=notify)")
    run.set_defaults(handler=cmd_run)

    check = verbs.add_parser(
        "check", parents=[common], help="validate config, keys, journal, broker and adapters"
    )
    check.set_defaults(handler=cmd_check)


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    configure_logging(config.worker.log_level, config.worker.log_format)
    return serve(config, args.config)


def serve(config: WorkerConfig, config_path: str) -> int:
    """Run the daemon of ``config`` (logging already configured) until it stops.

    Serves the metrics endpoint and the console when configured; every way
    the start can fail becomes a :class:`CliError`.
    """
    # Only `run` and `dev` need the daemon (sessions, adapters' runtime); the
    # operator verbs stay quick to start without it.
    from octo_worker.daemon.daemon import WorkerDaemon
    from octo_worker.daemon.metrics import WorkerMetrics

    log = structlog.get_logger("octo.worker.cli")
    metrics = WorkerMetrics()
    listen = config.metrics.listen
    if listen is not None:
        try:
            metrics.serve(listen)
        except OSError as error:
            raise _metrics_refusal(listen, error) from None
        log.info("metrics_listening", listen=listen)
    daemon = WorkerDaemon(config, metrics=metrics)
    from octo_worker.console.serve import run_with_console  # [console] listen: off by default

    try:
        run_event_loop(run_with_console(daemon, config, config_path), config.worker.event_loop)
    except InvalidConfiguration as error:
        raise CliError(EXIT_USAGE, str(error), error.code) from None
    except StorageError as error:
        raise CliError(
            EXIT_STORAGE, f"journal storage: {error.code}: {error}", error.code
        ) from None
    except OctoError as error:
        raise CliError(EXIT_USAGE, f"start-up failed: {error}", error.code) from None
    except OSError as error:
        # The state directory or journal file cannot be created or opened.
        where = f" ({error.filename})" if error.filename else ""
        raise CliError(
            EXIT_STORAGE,
            f"start-up failed: {error.strerror or type(error).__name__}{where}",
            "storage_backend_error",
        ) from None
    if daemon.superseded:
        # Not a clean stop: a supervisor restarts it, and it comes back as a
        # standby of the worker that holds the fences now.
        raise CliError(
            EXIT_SUPERSEDED,
            "stopped: another worker holds the fence of every scope",
            "fencing_token_rejected",
        )
    return EXIT_OK


def _metrics_refusal(listen: str, error: OSError) -> CliError:
    return CliError(
        EXIT_USAGE,
        f"metrics.listen: cannot listen on {listen} ({error.strerror or type(error).__name__})",
        "invalid_configuration",
    )


@dataclass
class _Check:
    name: str
    ok: bool
    detail: str
    status: int


def cmd_check(args: argparse.Namespace, out: Output) -> int:
    checks: list[_Check] = []

    def record(name: str, status: int, probe: Callable[[], str]) -> bool:
        try:
            detail = probe()
        except CliError as error:
            checks.append(_Check(name, False, error.message, error.status))
            return False
        except InvalidConfiguration as error:
            checks.append(_Check(name, False, str(error), EXIT_USAGE))
            return False
        except OctoError as error:
            checks.append(_Check(name, False, f"{error.code}: {error}", status))
            return False
        except OSError as error:
            where = f" ({error.filename})" if error.filename else ""
            reason = error.strerror or type(error).__name__
            checks.append(_Check(name, False, f"{reason}{where}", status))
            return False
        checks.append(_Check(name, True, detail, EXIT_OK))
        return True

    loaded: list[WorkerConfig] = []

    def probe_config() -> str:
        config = config_of(args)
        if config.worker.event_loop == "uvloop" and not uvloop_installed():
            raise event_loop_refusal()
        loaded.append(config)
        return str(Path(args.config))

    if record("config", EXIT_USAGE, probe_config):
        config = loaded[0]
        # In the order run meets them, so the first failure is run's refusal.
        if config.metrics.listen is not None:
            record("metrics", EXIT_USAGE, lambda: _probe_metrics(config))
        if config.console.listen is not None:
            record("console", EXIT_USAGE, lambda: _probe_console(config))
        for index, scope in enumerate(config.scopes):
            record(
                f"scope key {scope.name}",
                EXIT_USAGE,
                functools.partial(_probe_scope_key, config, index, scope.key_file),
            )
        storage_ok = record("storage keys", EXIT_USAGE, lambda: _probe_storage_keys(config))
        record("key roles", EXIT_USAGE, lambda: _probe_key_roles(config))
        if config.broker.password_file is not None:
            record("broker password file", EXIT_USAGE, lambda: _probe_password(config))
        record("adapters", EXIT_USAGE, lambda: _probe_adapters(config))
        if storage_ok:
            record("journal", EXIT_STORAGE, lambda: asyncio.run(_probe_journal(config)))
        else:
            checks.append(_Check("journal", False, "skipped: storage keys unusable", EXIT_USAGE))
        record("broker", EXIT_BROKER, lambda: asyncio.run(_probe_broker(config)))
    failed = [check for check in checks if not check.ok]
    for check in checks:
        out.line(f"{check.name}: {'ok' if check.ok else 'FAIL'}: {one_line(check.detail)}")
    out.document(
        {
            "ok": not failed,
            "checks": [
                {"name": c.name, "ok": c.ok, "detail": one_line(c.detail), "exit_status": c.status}
                for c in checks
            ],
        }
    )
    if failed:
        first = failed[0]
        out.error(f"check failed: {first.name}: {first.detail}")
        return first.status
    return EXIT_OK


def _probe_scope_key(config: WorkerConfig, index: int, key_file: str) -> str:
    where = f"scopes[{index}].key_file"
    path = config.path(key_file, where)
    load_scope_key(path, where)
    return str(path)


def _probe_key_roles(config: WorkerConfig) -> str:
    config.check_key_roles()
    return "each key serves one role"


def _probe_storage_keys(config: WorkerConfig) -> str:
    config.storage_keyring()  # reads and checks every key file, active and read keys
    encrypted = config.data_keyring() is not None
    active = config.storage.key.id if config.storage.key is not None else "?"
    text = f"active key {active}, {len(config.storage.read_keys)} read key(s)"
    return text + (", data encryption on" if encrypted else "")


def _probe_password(config: WorkerConfig) -> str:
    config.broker_url()
    return "readable"


def _probe_adapters(config: WorkerConfig) -> str:
    registry = load_enabled(config)
    tools = registry.tools()
    return ", ".join(tools) + " loaded" if tools else "none enabled"


async def _probe_journal(config: WorkerConfig) -> str:
    """What the daemon's start reads, read-only: the rules of ``run``'s start up to the broker."""
    if config.shared_journal:
        return await _probe_shared_journal(config)
    path = config.journal_path
    anchor = config.anchor_path
    if anchor is not None and not anchor.exists():
        raise CliError(
            EXIT_STORAGE,
            f"storage.anchor: {anchor} does not exist; the daemon refuses to open the journal "
            f"without it (create it with: {PROG} journal init-anchor)",
            "rollback_anchor_missing",
        )
    state_directories(config)  # a missing state directory whose parent is missing too
    if not path.exists():
        return f"{path} not created yet ({creatable(path.parent)})"
    async with journal_store(config) as store:
        problems = await store.integrity_check()
        if problems != ["ok"]:
            raise CliError(
                EXIT_STORAGE,
                f"{path}: integrity_check: {'; '.join(problems[:3])}",
                "storage_backend_error",
            )
        rows, sessions = await _probe_scopes(config, store)
    return (
        f"{path} integrity ok; {len(config.scopes)} scope(s) match their sealed heads "
        f"({rows} row(s), {sessions} session(s) to restore)"
    )


async def _probe_scopes(config: WorkerConfig, store: JournalStoreBase) -> tuple[int, int]:
    """Each configured scope as a start (or a takeover) checks and reads it: rows, sessions."""
    rows = sessions = 0
    for scope in config.scopes:
        try:
            # What reserving the scope's fence checks, then what loading it reads.
            checked = await store.verify_scope(scope.name)
            persisted = (await store.load_scope(scope.name)).sessions
        except OctoError as error:
            raise CliError(
                EXIT_STORAGE, f"scope {scope.name}: {error.code}: {error}", error.code
            ) from None
        rows += checked.rows
        sessions += len(persisted)
    return rows, sessions


async def _probe_shared_journal(config: WorkerConfig) -> str:
    """The PostgreSQL journal: reachable with the password file, schema current,
    every configured scope matching its sealed head, as a takeover would find it."""
    where = config.journal_location()
    password_file = config.storage_password_path
    if password_file is not None:
        read_password_file(password_file)  # its own failure first (never its content)
    store = configured_store(config, read_only=True)
    try:
        try:
            problems = await store.integrity_check()
        except OctoError as error:
            if "does not exist" in str(error):
                return f"postgresql {where}: reachable, schema not created yet (run creates it)"
            raise CliError(
                EXIT_STORAGE, f"postgresql {where}: {error.code}: {error}", error.code
            ) from None
        if problems != ["ok"]:
            raise CliError(
                EXIT_STORAGE,
                f"postgresql {where}: {'; '.join(problems[:3])}",
                "storage_backend_error",
            )
        rows, sessions = await _probe_scopes(config, store)
    finally:
        await store.close()
    return (
        f"postgresql {where} schema ok, shared by failover workers; {len(config.scopes)} "
        f"scope(s) match their sealed heads ({rows} row(s), {sessions} session(s) to restore)"
    )


def _probe_metrics(config: WorkerConfig) -> str:
    listen = config.metrics.listen
    assert listen is not None
    return _probe_listen(config, listen, lambda error: _metrics_refusal(listen, error))


def _probe_console(config: WorkerConfig) -> str:
    from octo_worker.console.security import check_bind, parse_listen
    from octo_worker.console.serve import tls_of, token_of

    listen = config.console.listen
    assert listen is not None
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
    if tls is not None:
        tls.server_context()  # the certificate and key load, the key file is private

    def refusal(error: OSError) -> CliError:
        return CliError(
            EXIT_USAGE,
            f"console: cannot listen on {address.host}:{address.port} "
            f"({error.strerror or type(error).__name__})",
            "invalid_configuration",
        )

    return _probe_listen(config, listen, refusal)


def _probe_listen(config: WorkerConfig, listen: str, refusal: Callable[[OSError], CliError]) -> str:
    host, port = listen_address(listen)
    error = bind_refusal(host, port)
    if error is None:
        return f"{listen} free"
    from octo_worker.console.live import scrape_url

    metrics = config.metrics.listen
    if metrics is not None and served_by_octo_worker(
        scrape_url(metrics), [scope.name for scope in config.scopes]
    ):
        # The running daemon of this configuration: a restart frees it.
        return f"{listen} held by the running octo-worker of these scopes (a restart frees it)"
    raise refusal(error)


async def _probe_broker(config: WorkerConfig) -> str:
    async with broker_connection(config) as connection:
        channel = await connection.channel()
        declared = 0
        for scope in config.scopes:
            try:
                await channel.declare_queue(worker_queue(scope.name), passive=True)
                declared += 1
            except aiormq.exceptions.ChannelNotFoundEntity:
                # Not declared yet (the daemon declares it); the broker closed the channel.
                channel = await connection.channel()
    return (
        f"{config.redacted_broker_url()} reachable; "
        f"{declared}/{len(config.scopes)} scope queue(s) declared"
    )
