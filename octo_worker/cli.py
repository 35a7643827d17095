"""The ``octo-worker`` command: run the daemon and operate what it keeps.

Verbs: ``run``, ``check``, ``topology declare|show``, ``journal
list|show|verify|init-anchor|prune|reseal``, ``adapters list``, ``dlq
list|show|drop`` and ``console`` (``octo_worker.console``). Every
verb takes ``--config PATH`` (default ``/etc/octo/worker.toml``) and ``--json``
(one JSON document on stdout, for scripts).

Exit codes: 0 ok, 1 a check failed or a thing was not found, 2 usage or
configuration error, 3 the broker is unreachable (or refused a topology
change), 4 the journal database is unusable.

This module owns argument parsing, the process's logging set-up and the
operator views of the journal and the dead-letter queue. It must never print
a traceback, a key, a frame body (unless ``--body`` asks for one), a payload,
or adapter text: errors are one line on stderr naming the problem, journal
payloads are shown as format and byte count, and log processors drop
exception text (the daemon logs error codes).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import re
import sys
import time
import urllib.parse
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar

import aiormq
import structlog
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, AbstractQueue

from octo_common.errors import (
    MissingAdapter,
    OctoError,
    StorageError,
)
from octo_common.ids import is_token
from octo_common.payload import ToolPayload
from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
    Failure,
    OneLineParser,
    Output,
    drop_exception_text,
    one_line,
    print_table,
    printable,
    quiet_logging,
    run_command,
)
from octo_common.states import Failed, Succeeded
from octo_common.transport import (
    DEAD_OVERFLOW,
    DEAD_POLICY_NAME,
    DEAD_QUEUE,
    HEADER_KEY_NONCE,
    HEADER_REASON,
    HEADER_SCOPE,
    HEADER_SESSION,
    WORKER_POLICY_NAME,
    worker_queue,
)
from octo_worker.adapters import (
    ADAPTER_ENTRY_POINT_GROUP,
    effective_adapter_deadline,
    load_adapters,
)
from octo_worker.config import (
    InvalidConfiguration,
    WorkerConfig,
    load_config,
    load_scope_key,
)
from octo_worker.journal import WorkerOperationRecord
from octo_worker.store import PruneReport, ResealReport, SqliteJournalStore
from octo_worker.topology import (
    TopologyError,
    TopologyReport,
    connect,
    declare_topology,
    describe_topology,
    open_confirm_channel,
)

__all__ = [
    "DEFAULT_CONFIG",
    "EXIT_BROKER",
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "configure_logging",
    "main",
]

DEFAULT_CONFIG: Final = "/etc/octo/worker.toml"
PROG: Final = "octo-worker"
T = TypeVar("T")


# A broker probe from the command line should answer fast even when the
# configured connect timeout is generous.
_PROBE_TIMEOUT_SECONDS: Final = 5.0


# Logging -----------------------------------------------------------------------------

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


def run_event_loop(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """Run ``main`` to completion on the configured event loop (``[worker] event_loop``).

    ``auto`` takes uvloop when it is importable (about a fifth less CPU per
    delivery on the machines measured, see README) and asyncio otherwise;
    ``uvloop`` insists on it; ``asyncio`` is the standard library loop.
    """
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                main.close()
                raise CliError(
                    EXIT_USAGE,
                    "worker.event_loop: uvloop is not installed",
                    "invalid_configuration",
                ) from None
        else:
            result: T = uvloop.run(main)
            return result
    return asyncio.run(main)


def configure_logging(level: str = "info", log_format: str = "json") -> None:
    """Configure structlog once for this process: JSON (or console) lines on stderr.

    Timestamps are ISO 8601 UTC; every line has a level. Library loggers
    (aio-pika, aiormq) go through the stdlib at WARNING and above, rendered
    the same way, without tracebacks.
    """
    renderer: Any
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


# Argument parsing ------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _delivery_limit(text: str) -> int:
    value = _positive_int(text)
    if value > 2**31 - 1:
        raise argparse.ArgumentTypeError("must be at most 2147483647")
    return value


_DURATION = re.compile(r"([1-9][0-9]{0,8})([smhdw])")
_UNIT_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> int:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` → seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (a number and one of s, m, h, d, w: 30d, 12h)"
        )
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _common() -> OneLineParser:
    common = OneLineParser(add_help=False)
    common.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="PATH",
        help=f"worker configuration (default {DEFAULT_CONFIG})",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = OneLineParser(
        prog=PROG,
        description="Run and operate the Octo worker daemon.",
        epilog="Exit status: 0 ok, 1 check failed or not found, 2 usage or configuration "
        "error, 3 broker unreachable, 4 storage error.",
    )
    verbs = parser.add_subparsers(
        dest="verb", metavar="VERB", required=True, parser_class=OneLineParser
    )

    run = verbs.add_parser("run", parents=[common], help="run the daemon (systemd: Type=notify)")
    run.set_defaults(handler=cmd_run)

    check = verbs.add_parser(
        "check", parents=[common], help="validate config, keys, journal, broker and adapters"
    )
    check.set_defaults(handler=cmd_check)

    topology = verbs.add_parser("topology", help="broker exchanges, queues and policy")
    topology_verbs = topology.add_subparsers(
        dest="topology_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    declare = topology_verbs.add_parser(
        "declare", parents=[common], help="declare the configured scopes' topology and policy"
    )
    declare.add_argument(
        "--delivery-limit",
        type=_delivery_limit,
        default=None,
        metavar="N",
        help="policy delivery limit (default: [broker] delivery_limit)",
    )
    declare.add_argument(
        "--host-id",
        action="append",
        default=[],
        metavar="ID",
        help="also declare the reply queue octo.v5.reply.ID (repeatable)",
    )
    declare.add_argument(
        "--skip-policy",
        action="store_true",
        help="declare queues only; the policy comes from rabbitmq-definitions.json",
    )
    declare.set_defaults(handler=cmd_topology_declare)
    show = topology_verbs.add_parser(
        "show", parents=[common], help="message and consumer counts of the queues"
    )
    show.add_argument("--host-id", action="append", default=[], metavar="ID")
    show.set_defaults(handler=cmd_topology_show)

    journal = verbs.add_parser("journal", help="inspect the journal database")
    journal_verbs = journal.add_subparsers(
        dest="journal_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    jlist = journal_verbs.add_parser("list", parents=[common], help="list journal rows")
    jlist.add_argument("--scope", metavar="S")
    jlist.set_defaults(handler=cmd_journal_list)
    jshow = journal_verbs.add_parser("show", parents=[common], help="show one journal row")
    jshow.add_argument(
        "key", metavar="KEY", help="operation key (op-...) or compensation key (cmp-...)"
    )
    jshow.add_argument("--scope", metavar="S")
    jshow.set_defaults(handler=cmd_journal_show)
    verify = journal_verbs.add_parser(
        "verify", parents=[common], help="integrity check and authenticate every row"
    )
    verify.set_defaults(handler=cmd_journal_verify)
    prune = journal_verbs.add_parser(
        "prune",
        parents=[common],
        help="remove terminal rows not written for DURATION (never pending or running)",
    )
    prune.add_argument(
        "--older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="age of the last write: 30d, 12h, 45m, 90s, 2w",
    )
    prune.add_argument("--scope", metavar="S", help="only this scope (default: every scope)")
    prune.set_defaults(handler=cmd_journal_prune)
    reseal = journal_verbs.add_parser(
        "reseal",
        parents=[common],
        help="re-seal rows an old storage or data key sealed, with the active keys",
    )
    reseal.add_argument("--scope", metavar="S", help="only this scope (default: every scope)")
    reseal.set_defaults(handler=cmd_journal_reseal)
    anchor = journal_verbs.add_parser(
        "init-anchor",
        parents=[common],
        help="create the rollback anchor file from the database (storage.anchor)",
    )
    anchor.add_argument(
        "--force",
        action="store_true",
        help="replace an existing anchor (after restoring a backup on purpose)",
    )
    anchor.set_defaults(handler=cmd_journal_init_anchor)

    adapters = verbs.add_parser("adapters", help="installed adapter plug-ins")
    adapter_verbs = adapters.add_subparsers(
        dest="adapters_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    alist = adapter_verbs.add_parser(
        "list", parents=[common], help=f"entry points of {ADAPTER_ENTRY_POINT_GROUP}"
    )
    alist.set_defaults(handler=cmd_adapters_list)

    dlq = verbs.add_parser("dlq", help=f"inspect and drain {DEAD_QUEUE}")
    dlq_verbs = dlq.add_subparsers(
        dest="dlq_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    dlist = dlq_verbs.add_parser("list", parents=[common], help="list dead-lettered frames")
    dlist.add_argument("--limit", type=_positive_int, default=50, metavar="N")
    dlist.add_argument("--body", action="store_true", help="also print each frame body")
    dlist.set_defaults(handler=cmd_dlq_list)
    dshow = dlq_verbs.add_parser("show", parents=[common], help="show the frame at position N")
    dshow.add_argument("position", type=_positive_int, metavar="N")
    dshow.add_argument("--body", action="store_true", help="also print the frame body")
    dshow.add_argument("--message-id", metavar="ID", help="refuse unless N has this message id")
    dshow.set_defaults(handler=cmd_dlq_show)
    ddrop = dlq_verbs.add_parser(
        "drop", parents=[common], help="remove the frame with --message-id ID (or --all)"
    )
    ddrop.add_argument(
        "position", type=_positive_int, nargs="?", metavar="N", help="also check its position"
    )
    ddrop.add_argument("--message-id", metavar="ID", help="the message id of the frame to remove")
    ddrop.add_argument("--all", action="store_true", help="remove every dead-lettered frame")
    ddrop.set_defaults(handler=cmd_dlq_drop)

    from octo_worker.console.verb import add_console_verb

    add_console_verb(verbs, common)
    return parser


# Entry point ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``octo-worker`` command; returns the exit status."""
    stdout, stderr = sys.stdout, sys.stderr
    json_mode = "--json" in (sys.argv[1:] if argv is None else argv)
    out = Output(PROG, json_mode, stdout, stderr)

    def body() -> int:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit_:  # --help / --version
            return exit_.code if isinstance(exit_.code, int) else EXIT_OK
        out.json_mode = bool(getattr(args, "json", False))
        if args.handler is not cmd_run:
            quiet_logging()
        handler: Callable[[argparse.Namespace, Output], int] = args.handler
        return handler(args, out)

    return run_command(out, body, _report)


def _report(error: Exception) -> Failure | None:
    """How an Octo error ends a worker command (None: an internal error)."""
    if isinstance(error, InvalidConfiguration):
        return (EXIT_USAGE, str(error), error.code)
    if isinstance(error, StorageError):
        return (EXIT_STORAGE, f"journal storage: {error}", error.code)
    if isinstance(error, OctoError):
        return (EXIT_USAGE, str(error), error.code)
    return None


def _config(args: argparse.Namespace) -> WorkerConfig:
    return load_config(args.config)


# run -------------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace, out: Output) -> int:
    # Only `run` needs the daemon (sessions, adapters' runtime); the operator
    # verbs stay quick to start without it.
    from octo_worker.daemon import WorkerDaemon
    from octo_worker.metrics import WorkerMetrics

    config = _config(args)
    configure_logging(config.worker.log_level, config.worker.log_format)
    log = structlog.get_logger("octo.worker.cli")
    metrics = WorkerMetrics()
    listen = config.metrics.listen
    if listen is not None:
        try:
            metrics.serve(listen)
        except OSError as error:
            raise CliError(
                EXIT_USAGE,
                f"metrics.listen: cannot listen on {listen} ({error.strerror or 'error'})",
                "invalid_configuration",
            ) from None
        log.info("metrics_listening", listen=listen)
    daemon = WorkerDaemon(config, metrics=metrics)
    from octo_worker.console.verb import run_with_console  # [console] listen: off by default

    try:
        run_event_loop(run_with_console(daemon, config, args.config), config.worker.event_loop)
    except InvalidConfiguration as error:
        raise CliError(EXIT_USAGE, str(error), error.code) from None
    except StorageError as error:
        raise CliError(EXIT_STORAGE, f"journal storage: {error}", error.code) from None
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
    return EXIT_OK


# check -----------------------------------------------------------------------------------------


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
        loaded.append(_config(args))
        return str(Path(args.config))

    if record("config", EXIT_USAGE, probe_config):
        config = loaded[0]
        for index, scope in enumerate(config.scopes):
            record(
                f"scope key {scope.name}",
                EXIT_USAGE,
                functools.partial(_probe_scope_key, config, index, scope.key_file),
            )
        storage_ok = record("storage keys", EXIT_USAGE, lambda: _probe_storage_keys(config))
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


def _probe_storage_keys(config: WorkerConfig) -> str:
    config.storage_keyring()  # reads and checks every key file, active and read keys
    encrypted = config.data_keyring() is not None
    active = config.storage.key.id if config.storage.key is not None else "?"
    text = f"active key {active}, {len(config.storage.read_keys)} read key(s)"
    return text + (", data encryption on" if encrypted else "")


def _probe_password(config: WorkerConfig) -> str:
    config.broker_url()
    return "readable"


def _adapter_options(config: WorkerConfig) -> dict[str, dict[str, Any]]:
    # The daemon resolves option values starting with "./" against the state
    # directory; the check and the listing load adapters exactly the same way.
    def value(item: Any) -> Any:
        if isinstance(item, str) and item.startswith("./"):
            return str(config.state_path(item[2:]))
        return item

    return {
        name: {key: value(item) for key, item in options.items()}
        for name, options in config.adapters.options.items()
    }


def _load_enabled(config: WorkerConfig) -> Any:
    enabled = list(config.adapters.enabled)
    try:
        return load_adapters(enabled, options=_adapter_options(config))
    except MissingAdapter as error:
        raise CliError(
            EXIT_USAGE,
            f"adapters.enabled: {error.code}: {error} is not an installed "
            f"{ADAPTER_ENTRY_POINT_GROUP} entry point",
            error.code,
        ) from None
    except OctoError as error:
        raise CliError(EXIT_USAGE, f"adapters.enabled: {error.code}: {error}", error.code) from None


def _probe_adapters(config: WorkerConfig) -> str:
    registry = _load_enabled(config)
    tools = registry.tools()
    return ", ".join(tools) + " loaded" if tools else "none enabled"


def _creatable(directory: Path) -> str:
    """Whether ``run`` can create the journal in ``directory`` (as this user)."""
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CliError(
            EXIT_STORAGE,
            f"cannot create {directory}: {ancestor} is not a directory",
            "storage_backend_error",
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CliError(
            EXIT_STORAGE,
            f"cannot create the journal in {directory}: {ancestor} is not writable by this user",
            "storage_backend_error",
        )
    return "run creates it" if ancestor == directory else f"run creates it and {directory}"


async def _probe_journal(config: WorkerConfig) -> str:
    path = config.journal_path
    anchor = config.anchor_path
    if anchor is not None and not anchor.exists():
        raise CliError(
            EXIT_STORAGE,
            f"storage.anchor: {anchor} does not exist; the daemon refuses to open the journal "
            f"without it (create it with: {PROG} journal init-anchor)",
            "rollback_anchor_missing",
        )
    if not path.exists():
        return f"{path} not created yet ({_creatable(path.parent)})"
    async with _store(config) as store:
        problems = await store.integrity_check()
        if problems != ["ok"]:
            raise CliError(
                EXIT_STORAGE,
                f"{path}: integrity_check: {'; '.join(problems[:3])}",
                "storage_backend_error",
            )
        scopes = await store.scopes()
        for scope in scopes:
            await store.head_revision(scope)  # checks the rollback anchor too
    return f"{path} integrity ok, {len(scopes)} scope(s)"


async def _probe_broker(config: WorkerConfig) -> str:
    async with _broker(config) as connection:
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


# Broker and store helpers --------------------------------------------------------------------


def _vhost(url: str) -> str:
    path = urllib.parse.urlsplit(url).path
    return urllib.parse.unquote(path[1:]) if len(path) > 1 else "/"


@contextlib.asynccontextmanager
async def _broker(config: WorkerConfig) -> AsyncIterator[AbstractConnection]:
    url = config.broker_url()
    timeout = min(config.broker.connect_timeout_seconds, _PROBE_TIMEOUT_SECONDS)
    try:
        connection = await connect(url, timeout=timeout, name="octo-worker-cli")
    except TopologyError as error:
        raise CliError(
            EXIT_BROKER,
            f"broker {config.redacted_broker_url()} unreachable: {error.reason}",
            error.code,
        ) from None
    try:
        yield connection
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(connection.close(), timeout=5.0)


@contextlib.asynccontextmanager
async def _store(
    config: WorkerConfig, *, maintenance: bool = False
) -> AsyncIterator[SqliteJournalStore]:
    """The journal, read-only, or for maintenance (rows only, never a revision):
    beside a running daemon neither may migrate the schema or rewrite the
    anchor file the daemon replaces after each commit."""
    path = config.journal_path
    if not path.exists():
        raise CliError(
            EXIT_CHECK_FAILED,
            f"journal database {path} does not exist (the daemon creates it when it starts)",
            "not_found",
        )
    store = SqliteJournalStore(
        path,
        config.storage_keyring(),
        anchor_path=config.anchor_path,
        data_keyring=config.data_keyring(),
        read_only=not maintenance,
        maintenance=maintenance,
    )
    try:
        try:
            await store.scopes()  # opens the database (and checks the anchor)
        except OctoError as error:
            hint = ""
            if error.code == "rollback_anchor_missing":
                hint = f" (create it with: {PROG} journal init-anchor)"
            raise CliError(
                EXIT_STORAGE,
                f"journal {path}: cannot open: {error.code}: {error}{hint}",
                error.code,
            ) from None
        yield store
    finally:
        with contextlib.suppress(Exception):
            await store.close()


# topology ----------------------------------------------------------------------------------------


def cmd_topology_declare(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    limit = None if args.skip_policy else (args.delivery_limit or config.broker.delivery_limit)
    if limit is not None and not 1 <= limit <= 2**31 - 1:
        # Only reachable through the configuration (the option is checked by argparse).
        raise CliError(
            EXIT_USAGE,
            "broker.delivery_limit: must be between 1 and 2147483647",
            "invalid_configuration",
        )
    report = asyncio.run(_declare(config, list(args.host_id), limit))
    via, dead_via = report.policy_applied_via, report.dead_letter_policy_applied_via
    broker = config.broker
    dead_bound = (
        f"max-length={broker.dead_letter_max_length} "
        f"max-length-bytes={broker.dead_letter_max_bytes} overflow={DEAD_OVERFLOW}"
    )
    for queue in report.queues:
        out.line(f"declared {queue}")
    if limit is None:
        out.line("policy: not applied (--skip-policy)")
        out.line("dead-letter policy: not applied (--skip-policy)")
    else:
        out.line(f"policy: {WORKER_POLICY_NAME} delivery-limit={limit} applied via {via}")
        out.line(f"dead-letter policy: {DEAD_POLICY_NAME} {dead_bound} applied via {dead_via}")
    out.document(
        {
            "ok": True,
            "queues": list(report.queues),
            "policy": None
            if limit is None
            else {"name": WORKER_POLICY_NAME, "delivery_limit": limit, "applied_via": via},
            "dead_letter_policy": None
            if limit is None
            else {
                "name": DEAD_POLICY_NAME,
                "max_length": broker.dead_letter_max_length,
                "max_length_bytes": broker.dead_letter_max_bytes,
                "overflow": DEAD_OVERFLOW,
                "applied_via": dead_via,
            },
        }
    )
    return EXIT_OK


async def _declare(config: WorkerConfig, host_ids: list[str], limit: int | None) -> TopologyReport:
    _check_tokens("--host-id", host_ids)
    async with _broker(config) as connection:
        channel = await open_confirm_channel(connection)
        try:
            report = await declare_topology(
                channel,
                [scope.name for scope in config.scopes],
                host_ids=host_ids,
                delivery_limit=limit,
                dead_letter_max_length=config.broker.dead_letter_max_length,
                dead_letter_max_bytes=config.broker.dead_letter_max_bytes,
                vhost=_vhost(config.broker.url),
            )
        except TopologyError as error:
            raise CliError(EXIT_BROKER, f"topology: {error.reason}", error.code) from None
    return report


def _check_tokens(option: str, values: Iterable[str]) -> None:
    for value in values:
        if not is_token(value):
            raise CliError(EXIT_USAGE, f"{option}: {printable(value)!r} is not a token", "usage")


def cmd_topology_show(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    statuses = asyncio.run(_describe(config, list(args.host_id)))
    rows = [["QUEUE", "EXISTS", "MESSAGES", "CONSUMERS"]]
    for status in statuses:
        rows.append(
            [
                status.name,
                "yes" if status.exists else "no",
                "-" if status.messages is None else str(status.messages),
                "-" if status.consumers is None else str(status.consumers),
            ]
        )
    print_table(rows, out)
    out.document(
        {
            "ok": True,
            "queues": [
                {
                    "name": s.name,
                    "exists": s.exists,
                    "messages": s.messages,
                    "consumers": s.consumers,
                }
                for s in statuses
            ],
        }
    )
    return EXIT_OK


async def _describe(config: WorkerConfig, host_ids: list[str]) -> list[Any]:
    _check_tokens("--host-id", host_ids)
    async with _broker(config) as connection:
        channel = await connection.channel()
        return await describe_topology(
            channel, [scope.name for scope in config.scopes], host_ids=host_ids
        )


# journal ---------------------------------------------------------------------------------------


def _state_text(state: Any) -> str:
    return str(getattr(state, "kind", "?"))


def _payload_size(payload: ToolPayload) -> int:
    if payload.format == "text":
        return len(str(payload.value).encode("utf-8", "surrogatepass"))
    return len(payload.value_bytes())


def _state_detail(state: Any) -> dict[str, Any]:
    """A state without its content: payloads and failure text become sizes."""
    detail: dict[str, Any] = {"state": _state_text(state)}
    if isinstance(state, Succeeded):
        detail["payload"] = {
            "format": state.payload.format,
            "bytes": _payload_size(state.payload),
        }
    elif isinstance(state, Failed):
        detail["message_bytes"] = len(state.message.encode("utf-8", "surrogatepass"))
    return detail


def _record_summary(scope: str, record: WorkerOperationRecord, revision: int) -> dict[str, Any]:
    compensation = record.compensation
    return {
        "scope": scope,
        "operation_key": record.operation_key,
        "tool": record.tool,
        "state": _state_text(record.state),
        "compensation_state": None if compensation is None else _state_text(compensation.state),
        "revision": revision,
    }


async def _scopes_of(store: SqliteJournalStore, wanted: str | None) -> list[str]:
    scopes = await store.scopes()
    if wanted is None:
        return scopes
    if wanted not in scopes:
        raise CliError(
            EXIT_CHECK_FAILED, f"scope {printable(wanted)!r} has no journal", "not_found"
        )
    return [wanted]


def _each_scope(
    config: WorkerConfig,
    wanted: str | None,
    action: Callable[[SqliteJournalStore, str], Awaitable[PruneReport | ResealReport]],
) -> dict[str, dict[str, int]]:
    """``action`` on every scope of the journal (or ``wanted``): its report per scope."""

    async def run() -> dict[str, dict[str, int]]:
        async with _store(config, maintenance=True) as store:
            reports: dict[str, dict[str, int]] = {}
            for scope in await _scopes_of(store, wanted):
                try:
                    report = await action(store, scope)
                except OctoError as error:
                    raise _storage_failure(f"scope {scope}", error) from None
                reports[scope] = dict(report._asdict())
            return reports

    return asyncio.run(run())


def _storage_failure(where: str, error: OctoError) -> CliError:
    return CliError(EXIT_STORAGE, f"{where}: {error.code}: {error}", error.code)


def cmd_journal_list(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def collect() -> list[dict[str, Any]]:
        async with _store(config) as store:
            summaries: list[dict[str, Any]] = []
            for scope in await _scopes_of(store, args.scope):
                try:
                    records = await store.list_records(scope)
                except OctoError as error:
                    raise _storage_failure(f"scope {scope}", error) from None
                summaries.extend(_record_summary(scope, r, rev) for r, rev in records)
            return summaries

    summaries = asyncio.run(collect())
    rows = [["SCOPE", "KEY", "TOOL", "STATE", "COMPENSATION", "REVISION"]]
    for item in summaries:
        rows.append(
            [
                item["scope"],
                item["operation_key"],
                item["tool"],
                item["state"],
                item["compensation_state"] or "-",
                str(item["revision"]),
            ]
        )
    if summaries:
        print_table(rows, out)
    else:
        out.line("no journal rows")
    out.document({"ok": True, "records": summaries})
    return EXIT_OK


def cmd_journal_show(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    _check_tokens("KEY", [args.key])

    async def find() -> list[dict[str, Any]]:
        async with _store(config) as store:
            found: list[dict[str, Any]] = []
            for scope in await _scopes_of(store, args.scope):
                try:
                    if args.key.startswith("cmp-"):
                        # A compensation lives in the row of the operation it undoes.
                        rows = await store.list_records(scope)
                        entries = [
                            (record, revision)
                            for record, revision in rows
                            if record.compensation is not None
                            and record.compensation.compensation_key == args.key
                        ]
                    else:
                        loaded = await store.load_records(scope, [args.key])
                        entry = loaded.get(args.key)
                        entries = [] if entry is None else [entry]
                except OctoError as error:
                    raise _storage_failure(f"scope {scope}", error) from None
                found.extend(_record_detail(scope, *entry) for entry in entries)
            return found

    found = asyncio.run(find())
    if not found:
        raise CliError(EXIT_CHECK_FAILED, f"no journal row for {args.key}", "not_found")
    for index, item in enumerate(found):
        if index:
            out.line()
        for line in _detail_lines(item):
            out.line(line)
    out.document({"ok": True, "records": found})
    return EXIT_OK


def _record_detail(scope: str, record: WorkerOperationRecord, revision: int) -> dict[str, Any]:
    compensation = record.compensation
    return {
        "scope": scope,
        "operation_key": record.operation_key,
        "tool": record.tool,
        "input_fingerprint": record.input_fingerprint,
        "revision": revision,
        **_state_detail(record.state),
        "compensation": None
        if compensation is None
        else {
            "compensation_key": compensation.compensation_key,
            "input_fingerprint": compensation.input_fingerprint,
            "grant_fingerprint": compensation.grant_fingerprint,
            **_state_detail(compensation.state),
        },
    }


def _state_line(detail: Mapping[str, Any]) -> str:
    text = str(detail["state"])
    payload = detail.get("payload")
    if payload is not None:
        text += f" (payload: {payload['format']}, {payload['bytes']} bytes)"
    if "message_bytes" in detail:
        text += f" (failure message: {detail['message_bytes']} bytes)"
    return text


def _detail_lines(item: Mapping[str, Any]) -> list[str]:
    lines = [
        f"scope:              {item['scope']}",
        f"operation key:      {item['operation_key']}",
        f"tool:               {item['tool']}",
        f"input fingerprint:  {item['input_fingerprint']}",
        f"state:              {_state_line(item)}",
        f"revision:           {item['revision']}",
    ]
    compensation = item["compensation"]
    if compensation is None:
        lines.append("compensation:       none")
    else:
        lines += [
            f"compensation key:   {compensation['compensation_key']}",
            f"  input fingerprint {compensation['input_fingerprint']}",
            f"  grant fingerprint {compensation['grant_fingerprint']}",
            f"  state             {_state_line(compensation)}",
        ]
    return lines


_VERIFY_STEPS: Final = ("head", "journal rows", "sessions", "outbox rows")


def cmd_journal_verify(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def verify() -> tuple[list[str], dict[str, dict[str, int]], str | None]:
        async with _store(config) as store:
            problems = await store.integrity_check()
            counts: dict[str, dict[str, int]] = {}
            first: str | None = None
            if problems != ["ok"]:
                first = "integrity_check: " + "; ".join(problems[:3])
            for scope in await store.scopes():
                scope_counts = counts.setdefault(scope, {})
                try:
                    scope_counts["revision"] = await store.head_revision(scope)
                    scope_counts["journal_rows"] = len(await store.list_records(scope))
                    scope_counts["sessions"] = len(await store.load_sessions(scope))
                    scope_counts["outbox_rows"] = len(await store.load_outbox(scope))
                except OctoError as error:
                    # Each reader opens (authenticates) every row it returns;
                    # the first bad row stops this scope, not the others.
                    step = _VERIFY_STEPS[len(scope_counts)]
                    if first is None:
                        first = f"scope {scope}: {step}: {error.code}: {error}"
            return problems, counts, first

    problems, counts, first = asyncio.run(verify())
    out.line(f"integrity_check: {'ok' if problems == ['ok'] else 'FAIL'}")
    for scope, scope_counts in counts.items():
        parts = ", ".join(
            f"{name.replace('_', ' ')} {value}" for name, value in scope_counts.items()
        )
        out.line(f"scope {scope}: {parts}")
    totals = {
        name: sum(c.get(name, 0) for c in counts.values())
        for name in ("journal_rows", "sessions", "outbox_rows")
    }
    out.line(
        f"verified {totals['journal_rows']} journal row(s), {totals['sessions']} session(s), "
        f"{totals['outbox_rows']} outbox row(s) in {len(counts)} scope(s)"
    )
    out.document(
        {
            "ok": first is None,
            "integrity_check": problems,
            "scopes": counts,
            "totals": totals,
            "first_failure": first,
        }
    )
    if first is not None:
        out.line(f"FAIL: {first}")
        out.error(f"journal verify failed: {first}")
        return EXIT_CHECK_FAILED
    return EXIT_OK


def cmd_journal_prune(args: argparse.Namespace, out: Output) -> int:
    """Remove old terminal rows; the store chooses them (W§9: never pending/running).

    A pruned operation key is forgotten: a frame that names it later is
    admitted as new. Prune only keys whose host runs are finished.
    """
    config = _config(args)
    older_than = float(args.older_than)
    reports = _each_scope(config, args.scope, lambda store, scope: store.prune(scope, older_than))
    for scope, report in reports.items():
        out.line(
            f"scope {scope}: removed {report['removed']} row(s); kept {report['kept']} old "
            "row(s) that are not terminal (pending, running, or an open compensation)"
        )
    removed = sum(report["removed"] for report in reports.values())
    out.line(f"removed {removed} journal row(s) older than {args.older_than} s")
    out.document(
        {
            "ok": True,
            "older_than_seconds": args.older_than,
            "scopes": reports,
            "removed": removed,
        }
    )
    return EXIT_OK


def cmd_journal_reseal(args: argparse.Namespace, out: Output) -> int:
    """Re-seal every row an old key sealed (key rotation, step 4 in OPERATIONS.md).

    Revisions do not move: safe while the daemon runs.
    """
    config = _config(args)
    reports = _each_scope(config, args.scope, lambda store, scope: store.reseal(scope))
    for scope, report in reports.items():
        out.line(
            f"scope {scope}: re-sealed {report['resealed']} row(s); "
            f"{report['current']} already under the active key(s)"
        )
    resealed = sum(report["resealed"] for report in reports.values())
    out.line(f"re-sealed {resealed} row(s) with storage key {config.storage_keyring().active_id}")
    out.document({"ok": True, "scopes": reports, "resealed": resealed})
    return EXIT_OK


def cmd_journal_init_anchor(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    anchor = config.anchor_path
    if anchor is None:
        raise CliError(EXIT_USAGE, "storage.anchor is not configured", "invalid_configuration")
    if anchor.exists() and not args.force:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"{anchor} already exists; --force re-anchors to the database as it is now, "
            "which accepts any rollback that happened (only after restoring a backup on purpose)",
            "exists",
        )

    async def initialize() -> dict[str, int]:
        store = SqliteJournalStore(
            config.journal_path,
            config.storage_keyring(),
            anchor_path=anchor,
            data_keyring=config.data_keyring(),
        )
        try:
            await store.initialize_anchor()
            return {scope: await store.head_revision(scope) for scope in await store.scopes()}
        except OctoError as error:
            raise _storage_failure(f"journal {config.journal_path}", error) from None
        finally:
            with contextlib.suppress(Exception):
                await store.close()

    heads = asyncio.run(initialize())
    out.line(f"anchored {len(heads)} scope(s) in {anchor}")
    for scope, revision in heads.items():
        out.line(f"  {scope}: revision {revision}")
    out.document({"ok": True, "anchor": str(anchor), "scopes": heads})
    return EXIT_OK


# adapters ------------------------------------------------------------------------------------


def cmd_adapters_list(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    enabled = list(config.adapters.enabled)
    installed: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=ADAPTER_ENTRY_POINT_GROUP):
        installed.setdefault(entry.name, entry)  # the first on the path wins, as in loading
    missing = [name for name in enabled if name not in installed]
    registry = _load_enabled(config) if not missing else None
    items: list[dict[str, Any]] = []
    for name in sorted(set(installed) | set(enabled)):
        found = installed.get(name)
        item: dict[str, Any] = {
            "name": name,
            "installed": found is not None,
            "enabled": name in enabled,
            "entry_point": None if found is None else found.value,
            "distribution": None if found is None or found.dist is None else found.dist.name,
        }
        adapter = None if registry is None else registry.get(name)
        if adapter is not None:
            safety = adapter.invocation_safety()
            contract = adapter.durable_operation_contract()
            item.update(
                {
                    "tool": getattr(adapter, "tool", None) or name,
                    "invocation_safety": None if safety is None else str(safety),
                    "durable_operation_contract": None if contract is None else str(contract),
                    "deadline_seconds": effective_adapter_deadline(
                        adapter, config.adapters.deadline_seconds
                    ),
                }
            )
        items.append(item)
    rows = [["ADAPTER", "ENABLED", "INSTALLED", "CONTRACT", "SAFETY", "DEADLINE"]]
    for item in items:
        rows.append(
            [
                item["name"],
                "yes" if item["enabled"] else "no",
                "yes" if item["installed"] else "NO",
                str(item.get("durable_operation_contract") or "-"),
                str(item.get("invocation_safety") or "-"),
                f"{item['deadline_seconds']:g}s" if "deadline_seconds" in item else "-",
            ]
        )
    print_table(rows, out)
    out.document({"ok": not missing, "adapters": items})
    if missing:
        out.error(
            f"enabled adapter(s) not installed: {', '.join(missing)} "
            f"(no {ADAPTER_ENTRY_POINT_GROUP} entry point)"
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK


# dlq -----------------------------------------------------------------------------------------


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    return printable(value, 128)


def _death_reason(headers: Mapping[str, Any]) -> str | None:
    """Why the broker itself dead-lettered a frame (delivery limit, rejection)."""
    first = headers.get("x-first-death-reason")
    if first is not None:
        return printable(first, 64)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        reason = deaths[0].get("reason")
        if reason is not None:
            return printable(reason, 64)
    return None


def _dead_letter_entry(
    position: int, message: AbstractIncomingMessage, body: bool
) -> dict[str, Any]:
    headers: Mapping[str, Any] = message.headers or {}
    reason = _header(headers, HEADER_REASON)
    broker_reason = _death_reason(headers)
    entry: dict[str, Any] = {
        "position": position,
        "reason": reason or (f"broker:{broker_reason}" if broker_reason else None),
        "scope": _header(headers, HEADER_SCOPE),
        "session": _header(headers, HEADER_SESSION),
        "key_nonce_present": HEADER_KEY_NONCE in headers,
        "message_id": None if message.message_id is None else printable(message.message_id, 128),
        "correlation_id": None
        if message.correlation_id is None
        else printable(message.correlation_id, 128),
        "routing_key": None if message.routing_key is None else printable(message.routing_key),
        "size": len(message.body),
        "delivery_count": headers.get("x-delivery-count")
        if isinstance(headers.get("x-delivery-count"), int)
        else None,
    }
    if body:
        entry["body_base64"] = base64.b64encode(message.body).decode("ascii")
        entry["body_text"] = message.body.decode("utf-8", "backslashreplace")
    return entry


async def _dead_queue(connection: AbstractConnection) -> AbstractQueue:
    channel = await connection.channel(publisher_confirms=False)
    try:
        return await channel.declare_queue(DEAD_QUEUE, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"queue {DEAD_QUEUE} does not exist (run: {PROG} topology declare)",
            "not_found",
        ) from None


# How much of the dead-letter queue one inspection may hold at once.
_MAX_HELD_MESSAGES: Final = 10_000
_MAX_HELD_BYTES: Final = 256 * 1024 * 1024


@dataclass
class _Held:
    """Messages of the dead-letter queue, held unacknowledged on one channel."""

    messages: list[AbstractIncomingMessage]
    complete: bool  # False: the queue is larger than one inspection may hold
    total: int

    def entries(self, count: int, body: bool) -> list[dict[str, Any]]:
        return [_dead_letter_entry(i + 1, m, body) for i, m in enumerate(self.messages[:count])]


@contextlib.asynccontextmanager
async def _holding(config: WorkerConfig) -> AsyncIterator[_Held]:
    """Hold the whole queue (bounded), then requeue every message not acked.

    A quorum queue puts a requeued message at its tail, so inspecting only
    the first N would rotate the queue and change every position. Holding
    everything and requeuing it in delivery order keeps the order (and the
    positions) as they were; only a queue beyond the bounds is rotated, and
    the listing says so. Nothing is lost: a message is only removed by an
    explicit ack (``drop``).
    """
    async with _broker(config) as connection:
        queue = await _dead_queue(connection)
        total = int(queue.declaration_result.message_count or 0)
        held = _Held([], True, total)
        size = 0
        try:
            while True:
                if len(held.messages) >= _MAX_HELD_MESSAGES or size >= _MAX_HELD_BYTES:
                    held.complete = False
                    break
                message = await queue.get(no_ack=False, fail=False, timeout=10)
                if message is None:
                    break
                held.messages.append(message)
                size += len(message.body)
            yield held
        finally:
            try:
                for message in held.messages:
                    await message.reject(requeue=True)
            except (aiormq.exceptions.AMQPError, ConnectionError):
                # The channel is gone: the broker requeues every unacked message itself.
                pass


def _rotation_note(held: _Held, out: Output) -> None:
    if not held.complete:
        out.line(
            f"note: {DEAD_QUEUE} is larger than one inspection holds "
            f"({_MAX_HELD_MESSAGES} messages / {_MAX_HELD_BYTES // (1024 * 1024)} MiB); "
            "the inspected messages moved to its tail"
        )


def _entry_line(entry: Mapping[str, Any]) -> str:
    return (
        f"{entry['position']:>4}  reason={entry['reason'] or '-'}  scope={entry['scope'] or '-'}  "
        f"session={entry['session'] or '-'}  message_id={entry['message_id'] or '-'}  "
        f"size={entry['size']}"
    )


def _print_body(entry: Mapping[str, Any], out: Output) -> None:
    if "body_text" in entry:
        out.line("      body: " + printable(entry["body_text"], 1 << 20))


def cmd_dlq_list(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def peek() -> tuple[_Held, list[dict[str, Any]]]:
        async with _holding(config) as held:
            return held, held.entries(args.limit, args.body)

    held, entries = asyncio.run(peek())
    total = max(held.total, len(held.messages))
    out.line(f"{DEAD_QUEUE}: {total} message(s); showing {len(entries)}")
    for entry in entries:
        out.line(_entry_line(entry))
        _print_body(entry, out)
    _rotation_note(held, out)
    out.document(
        {
            "ok": True,
            "queue": DEAD_QUEUE,
            "messages": total,
            "order_kept": held.complete,
            "entries": entries,
        }
    )
    return EXIT_OK


def _chosen(held: _Held, position: int, message_id: str | None) -> AbstractIncomingMessage:
    messages = held.messages
    if len(messages) < position:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"no message at position {position} ({DEAD_QUEUE} holds {len(messages)})",
            "not_found",
        )
    chosen = messages[position - 1]
    if message_id is not None and chosen.message_id != message_id:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"the message at position {position} does not have message id "
            f"{printable(message_id, 64)} (the queue changed; list it again)",
            "not_found",
        )
    return chosen


def _by_message_id(held: _Held, message_id: str) -> tuple[int, AbstractIncomingMessage]:
    for position, message in enumerate(held.messages, start=1):
        if message.message_id == message_id:
            return position, message
    raise CliError(
        EXIT_CHECK_FAILED,
        f"no message with message id {printable(message_id, 64)} in {DEAD_QUEUE}"
        f" (of {len(held.messages)} looked at)",
        "not_found",
    )


def cmd_dlq_show(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def show() -> dict[str, Any]:
        async with _holding(config) as held:
            chosen = _chosen(held, args.position, args.message_id)
            return _dead_letter_entry(args.position, chosen, args.body)

    entry = asyncio.run(show())
    for name, value in entry.items():
        if name in ("body_base64", "body_text"):
            continue
        out.line(f"{name + ':':<18} {'-' if value is None else value}")
    _print_body(entry, out)
    out.document({"ok": True, "entry": entry})
    return EXIT_OK


def cmd_dlq_drop(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def drop_all() -> int:
        async with _broker(config) as connection:
            queue = await _dead_queue(connection)
            result = await queue.purge()
            return int(getattr(result, "message_count", 0) or 0)

    async def drop_one(message_id: str) -> dict[str, Any]:
        async with _holding(config) as held:
            if args.position is not None:
                position = args.position
                chosen = _chosen(held, position, message_id)
            else:
                position, chosen = _by_message_id(held, message_id)
            entry = _dead_letter_entry(position, chosen, False)
            await chosen.ack()
            held.messages.remove(chosen)  # everything else is requeued
            return entry

    if args.all:
        if args.message_id is not None or args.position is not None:
            raise CliError(EXIT_USAGE, "--all takes no position and no --message-id", "usage")
        dropped = asyncio.run(drop_all())
        out.line(f"dropped {dropped} message(s) from {DEAD_QUEUE}")
        out.document({"ok": True, "dropped": dropped})
        return EXIT_OK
    if args.message_id is None:
        # The broker may requeue the held messages in another order, so a
        # position alone could name another frame by now.
        raise CliError(
            EXIT_USAGE,
            "dlq drop needs --message-id ID (from dlq list or show) or --all",
            "usage",
        )
    entry = asyncio.run(drop_one(args.message_id))
    out.line(f"dropped: {_entry_line(entry).strip()}")
    out.document({"ok": True, "dropped": 1, "entry": entry})
    return EXIT_OK
