"""The ``octo-host`` command: drive and inspect workflow runs from the shell.

Verbs: ``keys generate``, ``ledger show|init-anchor``, ``dispatch``,
``reconcile``, ``compensate``, ``recover``, ``resolve`` and ``audit show``.
Every verb takes ``--config PATH`` (default ``/etc/octo/host.toml``, see
:mod:`octo_host.config`) and ``--json`` (one JSON document on stdout).

Exit codes: 0 ok (for the verbs that talk to a worker: the operation or
compensation is ``succeeded``); 1 refused, not found, or the observed state
is not ``succeeded`` (failed, cancelled, or still pending after every
attempt); 2 usage or configuration error; 3 the broker is unreachable (or
no worker queue exists for the scope); 4 the ledger database is unusable.

Payloads (``--payload``, ``--original``) are given inline or as ``@FILE``;
their format is the configured grant's: JSON for ``format = "json"`` (strict
parse), the text as is for ``format = "text"``. The ledger keeps only
fingerprints, so the verbs that resend an input take it again and check it
against the recorded fingerprint. ``recover --inputs FILE`` reads
``{"operations": {KEY: input}, "compensations": {KEY: {"inverse": input,
"original": input}}}`` (inputs as JSON values: objects for JSON tools,
strings for text tools).

``dispatch`` derives the ``op-`` key from plan, step, tool, input and nonce
(default nonce ``RUN/STEP``), so repeating the same command after a crash
finds the recorded key and settles it instead of creating another.
``compensate`` resumes a recorded, unfinished compensation with the same
inverse (fresh approval) and refuses any other second compensation.
``resolve`` is :func:`octo_host.audit.resolve_operation` (an ``op-`` key
decides an operation, a ``cmp-`` key a compensation): no frame is sent.

One command at a time per ledger: the broker verbs and ``resolve`` hold an
exclusive lock on ``<database>.lock``, because two processes of one host id
would share the reply queue and take each other's replies.

This module owns argument parsing, output and the exit status. It must never
print a traceback, a key, a payload, worker failure text or an operator's
reason outside ``audit show``; errors are one line on stderr. It does not
import :mod:`octo_worker`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import getpass
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from octo_common.codec import parse_json
from octo_common.digest import plan_fingerprint
from octo_common.errors import (
    CompensationAlreadyRecorded,
    OctoError,
    StorageError,
    UnknownOperation,
    UnknownTool,
    WorkerRequestRejected,
)
from octo_common.ids import is_token
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
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
    print_table,
    printable,
    quiet_logging,
    run_command,
)
from octo_common.states import TERMINAL_KINDS, Failed, StateKind, Succeeded
from octo_common.transport import PublishFailed, PublishReturned
from octo_host.amqp import BrokerUnavailable
from octo_host.audit import ResolutionRefused, load_audit, resolve_operation
from octo_host.client import HostClient, HostRun, HostSession
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.config import (
    DEFAULT_CONFIG,
    ConfiguredActionVerifier,
    ConfiguredGrantVerifier,
    HostConfig,
    InvalidConfiguration,
    load_config,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep
from octo_host.storage.postgres import PostgresLedgerStore, redacted_url
from octo_host.store import (
    AuthenticatedStore,
    SqliteLedgerStore,
    initialise_anchor,
    ledger_record_key,
)

__all__ = [
    "EXIT_BROKER",
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "main",
]

PROG: Final = "octo-host"


_KEY_BYTES: Final = 32
_SCOPE_HELP: Final = "tenant scope (default: the only [[scopes]] entry)"
_MAX_PAYLOAD_FILE_BYTES: Final = 4 * 1024 * 1024


# Logging ------------------------------------------------------------------------------


def _configure_logging(verbose: bool) -> None:
    """Quiet by default (errors are reported as one line); ``--verbose``: JSON on stderr."""
    quiet_logging()
    if not verbose:
        return
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            drop_exception_text,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


# Argument parsing --------------------------------------------------------------------------


def _token_arg(text: str) -> str:
    if not is_token(text):
        raise argparse.ArgumentTypeError(f"{printable(text)!r} is not a token ([a-z0-9._-])")
    return text


def _common() -> OneLineParser:
    common = OneLineParser(add_help=False)
    common.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="PATH",
        help=f"host configuration (default {DEFAULT_CONFIG})",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    common.add_argument(
        "--verbose", action="store_true", help="log JSON lines on stderr (ids and states only)"
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = OneLineParser(
        prog=PROG,
        description="Drive and inspect Octo workflow runs (the host side).",
        epilog="Exit status: 0 ok, 1 refused / not found / not succeeded, 2 usage or "
        "configuration error, 3 broker unreachable, 4 storage error.",
    )
    verbs = parser.add_subparsers(
        dest="verb", metavar="VERB", required=True, parser_class=OneLineParser
    )

    keys = verbs.add_parser("keys", help="key files")
    key_verbs = keys.add_subparsers(
        dest="keys_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    generate = key_verbs.add_parser(
        "generate", parents=[common], help="write a new random 32-byte key file (mode 0600)"
    )
    which = generate.add_mutually_exclusive_group(required=True)
    which.add_argument("--scope", type=_token_arg, metavar="S", help="a scope key: DIR/S.key")
    which.add_argument(
        "--storage", type=_token_arg, metavar="ID", help="a storage key: DIR/storage-ID.key"
    )
    generate.add_argument("--out", required=True, metavar="DIR", help="directory (0700)")
    generate.set_defaults(handler=cmd_keys_generate)

    ledger = verbs.add_parser("ledger", help="the run ledgers")
    ledger_verbs = ledger.add_subparsers(
        dest="ledger_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    show = ledger_verbs.add_parser("show", parents=[common], help="one run's ledger (no inputs)")
    show.add_argument("run", type=_token_arg, metavar="RUN")
    show.add_argument("--plan", type=_token_arg, metavar="NAME", help="check against this plan")
    show.set_defaults(handler=cmd_ledger_show)
    anchor = ledger_verbs.add_parser(
        "init-anchor", parents=[common], help="create the rollback anchor file (ledger.anchor)"
    )
    anchor.add_argument("--force", action="store_true", help="replace an existing anchor")
    anchor.set_defaults(handler=cmd_ledger_init_anchor)

    dispatch = verbs.add_parser(
        "dispatch", parents=[common], help="record an operation and dispatch it"
    )
    dispatch.add_argument("run", type=_token_arg, metavar="RUN")
    dispatch.add_argument("--plan", type=_token_arg, required=True, metavar="NAME")
    dispatch.add_argument("--step", required=True, metavar="STEP")
    dispatch.add_argument("--tool", type=_token_arg, required=True, metavar="TOOL")
    dispatch.add_argument("--scope", type=_token_arg, metavar="S", help=_SCOPE_HELP)
    dispatch.add_argument("--payload", required=True, metavar="JSON|@FILE")
    dispatch.add_argument(
        "--nonce", metavar="TEXT", help="key nonce (default RUN/STEP: the same command, same key)"
    )
    dispatch.set_defaults(handler=cmd_dispatch)

    reconcile = verbs.add_parser(
        "reconcile", parents=[common], help="ask the worker for a recorded operation's state"
    )
    reconcile.add_argument("run", type=_token_arg, metavar="RUN")
    reconcile.add_argument("key", type=_token_arg, metavar="KEY")
    reconcile.add_argument("--scope", type=_token_arg, metavar="S", help=_SCOPE_HELP)
    reconcile.add_argument(
        "--payload", required=True, metavar="JSON|@FILE", help="the operation's input"
    )
    reconcile.add_argument("--plan", type=_token_arg, metavar="NAME")
    reconcile.set_defaults(handler=cmd_reconcile)

    compensate = verbs.add_parser(
        "compensate", parents=[common], help="record and send the one compensation"
    )
    compensate.add_argument("run", type=_token_arg, metavar="RUN")
    compensate.add_argument("key", type=_token_arg, metavar="KEY")
    compensate.add_argument("--scope", type=_token_arg, metavar="S", help=_SCOPE_HELP)
    compensate.add_argument(
        "--payload", required=True, metavar="JSON|@FILE", help="the inverse input"
    )
    compensate.add_argument("--nonce", required=True, metavar="TEXT")
    compensate.add_argument(
        "--original",
        metavar="JSON|@FILE",
        help="the original operation's input (needed when [[actions]] match fields)",
    )
    compensate.add_argument("--plan", type=_token_arg, metavar="NAME")
    compensate.set_defaults(handler=cmd_compensate)

    recover = verbs.add_parser(
        "recover", parents=[common], help="reconcile every unfinished key of a run"
    )
    recover.add_argument("run", type=_token_arg, metavar="RUN")
    recover.add_argument("--scope", type=_token_arg, metavar="S", help=_SCOPE_HELP)
    recover.add_argument(
        "--inputs",
        metavar="FILE",
        help='JSON: {"operations": {KEY: input}, "compensations": {KEY: '
        '{"inverse": input, "original": input}}}',
    )
    recover.add_argument("--plan", type=_token_arg, metavar="NAME")
    recover.set_defaults(handler=cmd_recover)

    resolve = verbs.add_parser(
        "resolve",
        parents=[common],
        help="an operator's audited decision for a stuck operation or compensation",
    )
    resolve.add_argument("run", type=_token_arg, metavar="RUN")
    resolve.add_argument(
        "key", type=_token_arg, metavar="KEY", help="an operation key, or a compensation's cmp- key"
    )
    resolve.add_argument(
        "--state", required=True, choices=["succeeded", "failed", "cancelled"], metavar="STATE"
    )
    resolve.add_argument("--reason", required=True, metavar="TEXT")
    resolve.add_argument("--operator", metavar="NAME", help="default: $USER")
    resolve.add_argument("--plan", type=_token_arg, metavar="NAME")
    resolve.set_defaults(handler=cmd_resolve)

    audit = verbs.add_parser("audit", help="operator decisions")
    audit_verbs = audit.add_subparsers(
        dest="audit_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    ashow = audit_verbs.add_parser("show", parents=[common], help="a run's audit entries")
    ashow.add_argument("run", type=_token_arg, metavar="RUN")
    ashow.set_defaults(handler=cmd_audit_show)
    return parser


# Entry point -------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``octo-host`` command; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    out = Output(PROG, "--json" in arguments, sys.stdout, sys.stderr)

    def body() -> int:
        try:
            args = build_parser().parse_args(arguments)
        except SystemExit as exit_:  # --help
            return exit_.code if isinstance(exit_.code, int) else EXIT_OK
        out.json_mode = bool(getattr(args, "json", False))
        _configure_logging(bool(getattr(args, "verbose", False)))
        handler: Callable[[argparse.Namespace, Output], int] = args.handler
        return handler(args, out)

    return run_command(out, body, _report)


def _report(error: Exception) -> Failure | None:
    """How an Octo error ends a host command (None: an internal error)."""
    if isinstance(error, InvalidConfiguration):
        return (EXIT_USAGE, str(error), error.code)
    if isinstance(error, PublishReturned):
        where = f"no worker queue {error.routing_key} (is a worker serving the scope?)"
        return (EXIT_BROKER, f"{error.code}: {where}", error.code)
    if isinstance(error, BrokerUnavailable | PublishFailed):
        return (EXIT_BROKER, f"broker: {error.code}: {error}", error.code)
    if isinstance(error, StorageError):
        return (EXIT_STORAGE, f"ledger storage: {error.code}: {error}", error.code)
    if isinstance(error, OctoError):
        return (EXIT_CHECK_FAILED, f"refused: {error.code}: {error}", error.code)
    return None


# Shared helpers ------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> HostConfig:
    return load_config(args.config)


def _scope(config: HostConfig, given: str | None) -> str:
    """``--scope``, or the one configured scope when there is exactly one."""
    if given is not None:
        return given
    if len(config.scopes) == 1:
        return config.scopes[0].name
    raise CliError(
        EXIT_USAGE, f"--scope: required ({len(config.scopes)} scopes are configured)", "usage"
    )


def _read_argument(text: str, option: str) -> str:
    """``@FILE`` → the file's UTF-8 text; anything else is the value itself."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:])
    try:
        with path.open("rb") as handle:
            data = handle.read(_MAX_PAYLOAD_FILE_BYTES + 1)
    except OSError as exc:
        raise CliError(
            EXIT_USAGE, f"{option}: cannot read {path} ({exc.strerror})", "usage"
        ) from None
    if len(data) > _MAX_PAYLOAD_FILE_BYTES:
        raise CliError(EXIT_USAGE, f"{option}: {path} is too large", "usage")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(EXIT_USAGE, f"{option}: {path} is not UTF-8", "usage") from None


def _payload_from_value(fmt: str, value: Any, option: str) -> ToolPayload:
    try:
        payload = ToolPayload.text(value) if fmt == "text" else ToolPayload.json(value)
        payload.validate_for(fmt)
    except (OctoError, TypeError, ValueError) as exc:
        code = getattr(exc, "code", "invalid")
        raise CliError(
            EXIT_USAGE, f"{option}: not a valid {fmt} payload ({code})", "usage"
        ) from None
    return payload


def _payload(fmt: str, text: str, option: str) -> ToolPayload:
    """The payload of an option in the grant's format (never echoed in errors)."""
    raw = _read_argument(text, option)
    if fmt == "text":
        return _payload_from_value("text", raw, option)
    try:
        value = parse_json(raw)
    except OctoError as exc:
        raise CliError(EXIT_USAGE, f"{option}: not valid JSON ({exc.code})", "usage") from None
    return _payload_from_value("json", value, option)


def _plan(config: HostConfig, engine: WorkflowEngine, name: str) -> WorkflowPlan:
    entry = config.plan(name)
    if entry is None:
        raise CliError(EXIT_USAGE, f"--plan: no [[plans]] entry named {name!r}", "usage")
    return engine.plan([WorkflowStep(step.id, step.source) for step in entry.steps])


def _plan_name(config: HostConfig, fingerprint: str) -> str | None:
    for entry in config.plans:
        steps = [WorkflowStep(step.id, step.source) for step in entry.steps]
        if plan_fingerprint(steps) == fingerprint:
            return entry.name
    return None


def _plan_for(
    config: HostConfig, engine: WorkflowEngine, ledger: WorkflowOperationLedger, name: str | None
) -> WorkflowPlan:
    """``--plan`` if given, else the configured plan whose fingerprint the ledger holds."""
    if name is None:
        name = _plan_name(config, ledger.plan_fingerprint)
        if name is None:
            raise CliError(
                EXIT_USAGE,
                f"plans: no [[plans]] entry has the run's plan fingerprint "
                f"{ledger.plan_fingerprint} (was the plan changed?)",
                "plan_mismatch",
            )
    plan = _plan(config, engine, name)
    engine.validate_operation_ledger(plan, ledger)
    return plan


@contextlib.contextmanager
def _ledger_lock(config: HostConfig) -> Iterator[None]:
    """One broker or resolve command at a time per ledger database."""
    database = config.database_path
    lock_path = database.with_name(database.name + ".lock")
    try:
        database.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise CliError(
            EXIT_STORAGE, f"ledger lock {lock_path}: {exc.strerror}", "storage_backend_error"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CliError(
                EXIT_CHECK_FAILED,
                f"another octo-host command holds {lock_path}; try again when it ends",
                "busy",
            ) from None
        yield
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def _store(
    config: HostConfig, *, create: bool
) -> AsyncIterator[SqliteLedgerStore | PostgresLedgerStore]:
    keyring = config.storage_keyring()  # configuration problems first
    store: SqliteLedgerStore | PostgresLedgerStore
    if config.storage.url is not None:  # [storage] url: the ledger in PostgreSQL (D13)
        path: Path | str = redacted_url(config.storage.url)
        store = PostgresLedgerStore(
            config.storage.url,
            keyring,
            password_file=config.storage_password_path,
            schema=config.storage.schema,
        )
    else:
        path = config.database_path
        if not create and not path.exists():
            raise CliError(
                EXIT_CHECK_FAILED,
                f"ledger database {path} does not exist (nothing recorded yet)",
                "not_found",
            )
        store = SqliteLedgerStore(path, keyring, anchor_path=config.anchor_path)
    try:
        try:
            await store.integrity_check()  # opens the database, checks the anchor
        except StorageError as error:
            hint = ""
            if error.code == "rollback_anchor_missing":
                hint = f" (create it with: {PROG} ledger init-anchor)"
            raise CliError(
                EXIT_STORAGE, f"ledger {path}: cannot open: {error.code}: {error}{hint}", error.code
            ) from None
        yield store
    finally:
        with contextlib.suppress(Exception):
            await store.close()


async def _stored_ledger(store: AuthenticatedStore, run: str) -> WorkflowOperationLedger:
    record = await store.load(ledger_record_key(run))
    if record is None:
        raise CliError(EXIT_CHECK_FAILED, f"run {run} has no ledger", "not_found")
    return WorkflowOperationLedger.from_json(record.payload)


async def _with_client(
    config: HostConfig, scope: str, body: Callable[[HostClient], Awaitable[Any]]
) -> Any:
    """Run ``body`` with a started client (lock, store and connection closed after)."""
    scope_key = config.scope_key(scope)
    url = config.broker_url()
    with _ledger_lock(config):
        async with _store(config, create=True) as store:
            broker = config.broker
            client = HostClient(
                url,
                host_id=config.host.host_id,
                scope_keys={scope: scope_key},
                store=store,
                reply_timeout=broker.reply_timeout_seconds,
                publish_timeout=min(broker.publish_timeout_seconds, broker.connect_timeout_seconds),
                max_attempts=broker.max_attempts,
                backoff_initial=broker.backoff_initial_seconds,
                backoff_max=broker.backoff_max_seconds,
            )
            try:
                await client.start()
            except BrokerUnavailable as error:
                raise CliError(
                    EXIT_BROKER,
                    f"broker {config.redacted_broker_url()} unreachable: {error.reason}",
                    error.code,
                ) from None
            try:
                # The publish timeout governs publishes; the connect timeout only the start.
                client.publish_timeout = broker.publish_timeout_seconds
                return await body(client)
            finally:
                await client.close()


async def _close_quietly(client: HostClient, session: HostSession) -> None:
    with contextlib.suppress(OctoError):
        await client.close_session(session)


def _grant_format(config: HostConfig, scope: str, tool: str) -> str:
    grant = config.grant(scope, tool)
    if grant is None:
        raise CliError(
            EXIT_USAGE, f"grants: scope {scope!r} has no grant of tool {tool!r}", "usage"
        )
    return grant.format


def _state_detail(state: Any) -> dict[str, Any]:
    """An observed state without content: a payload and failure text become sizes."""
    detail: dict[str, Any] = {"state": state.kind.value}
    if isinstance(state, Succeeded):
        payload = state.payload
        size = (
            len(str(payload.value).encode("utf-8", "surrogatepass"))
            if payload.format == "text"
            else len(payload.value_bytes())
        )
        detail["payload"] = {"format": payload.format, "bytes": size}
    elif isinstance(state, Failed):
        detail["message_bytes"] = len(state.message.encode("utf-8", "surrogatepass"))
    return detail


def _state_text(detail: Mapping[str, Any]) -> str:
    text = str(detail["state"])
    payload = detail.get("payload")
    if payload is not None:
        text += f" (output: {payload['format']}, {payload['bytes']} bytes)"
    if "message_bytes" in detail:
        text += f" (failure text withheld: {detail['message_bytes']} bytes)"
    return text


def _operation_doc(operation: WorkflowOperation) -> dict[str, Any]:
    compensation = operation.compensation
    return {
        "step": operation.step_id,
        "tool": operation.tool,
        "operation_key": operation.operation_key,
        "input_fingerprint": operation.input_fingerprint,
        "state": operation.state.value,
        "compensation": None
        if compensation is None
        else {
            "compensation_key": compensation.compensation_key,
            "state": compensation.state.value,
            "tenant_scope": compensation.tenant_scope,
            "grant_fingerprint": compensation.grant_fingerprint,
            "input_fingerprint": compensation.input_fingerprint,
        },
    }


def _finish(
    out: Output, document: dict[str, Any], lines: list[str], state: StateKind, what: str
) -> int:
    """Print a verb's result; exit 0 only when ``state`` is ``succeeded``."""
    ok = state == StateKind.SUCCEEDED
    document = {"ok": ok, **document}
    for text in lines:
        out.line(text)
    out.document(document)
    if ok:
        return EXIT_OK
    if state in TERMINAL_KINDS:
        out.error(f"{what} ended {state.value}")
    else:
        out.error(f"{what} is still {state.value}; run {PROG} recover later")
    return EXIT_CHECK_FAILED


# keys --------------------------------------------------------------------------------------------


def cmd_keys_generate(args: argparse.Namespace, out: Output) -> int:
    name = f"{args.scope}.key" if args.scope is not None else f"storage-{args.storage}.key"
    if name in (".key", "..key") or name.startswith("."):
        raise CliError(EXIT_USAGE, f"{name!r} is not a usable file name", "usage")
    directory = Path(args.out)
    try:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
            os.chmod(directory, 0o700)
        elif not directory.is_dir():
            raise CliError(EXIT_USAGE, f"--out: {directory} is not a directory", "usage")
    except OSError as exc:
        raise CliError(EXIT_STORAGE, f"--out: {directory}: {exc.strerror}", "io") from None
    path = directory / name
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise CliError(
            EXIT_CHECK_FAILED, f"{path} already exists; refusing to overwrite a key", "exists"
        ) from None
    except OSError as exc:
        raise CliError(EXIT_STORAGE, f"{path}: {exc.strerror}", "io") from None
    try:
        os.fchmod(fd, 0o600)
        content = (secrets.token_bytes(_KEY_BYTES).hex() + "\n").encode("ascii")
        os.write(fd, content)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise CliError(EXIT_STORAGE, f"{path}: {exc.strerror}", "io") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    kind = "scope" if args.scope is not None else "storage"
    out.line(str(path))
    out.document({"ok": True, "kind": kind, "path": str(path)})
    return EXIT_OK


# ledger ------------------------------------------------------------------------------------------


def cmd_ledger_show(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def load() -> tuple[WorkflowOperationLedger, str | None]:
        async with _store(config, create=False) as store:
            ledger = await _stored_ledger(store, args.run)
        if args.plan is not None:
            _plan_for(config, WorkflowEngine(), ledger, args.plan)
            return ledger, args.plan
        return ledger, _plan_name(config, ledger.plan_fingerprint)

    ledger, plan_name = asyncio.run(load())
    operations = [_operation_doc(op) for op in ledger.operations]
    out.line(f"run:              {args.run}")
    out.line(f"format version:   {ledger.format_version}")
    out.line(f"revision:         {ledger.revision}")
    out.line(f"plan fingerprint: {ledger.plan_fingerprint}")
    out.line(f"plan:             {plan_name or '(not among [[plans]])'}")
    if operations:
        rows = [["STEP", "TOOL", "KEY", "STATE", "COMPENSATION", "COMP. STATE"]]
        for op in operations:
            compensation = op["compensation"]
            rows.append(
                [
                    op["step"],
                    op["tool"],
                    op["operation_key"],
                    op["state"],
                    "-" if compensation is None else compensation["compensation_key"],
                    "-" if compensation is None else compensation["state"],
                ]
            )
        out.line()
        print_table(rows, out)
    else:
        out.line("no operations")
    out.document(
        {
            "ok": True,
            "run": args.run,
            "format_version": ledger.format_version,
            "revision": ledger.revision,
            "plan_fingerprint": ledger.plan_fingerprint,
            "plan": plan_name,
            "operations": operations,
        }
    )
    return EXIT_OK


def cmd_ledger_init_anchor(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    anchor = config.anchor_path
    if anchor is None:
        raise CliError(EXIT_USAGE, "ledger.anchor is not configured", "invalid_configuration")
    if anchor.exists() and not args.force:
        raise CliError(
            EXIT_CHECK_FAILED, f"{anchor} already exists (--force replaces it)", "exists"
        )
    anchor.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    initialise_anchor(anchor, overwrite=args.force)
    out.line(f"created {anchor}")
    out.document({"ok": True, "anchor": str(anchor)})
    return EXIT_OK


# dispatch / reconcile ----------------------------------------------------------------------------


def cmd_dispatch(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    scope, tool, step = _scope(config, args.scope), args.tool, args.step
    payload = _payload(_grant_format(config, scope, tool), args.payload, "--payload")
    manifest = config.manifest(scope)
    nonce_text = args.nonce if args.nonce is not None else f"{args.run}/{step}"
    nonce = nonce_text.encode("utf-8")

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind]:
        plan = _plan(config, client.engine, args.plan)
        run = await client.load_run(args.run, plan)
        data = canonical_operation_input_bytes(payload)
        key = client.engine.derive_operation_key(plan, step, tool, data, nonce)
        recorded = run.operation(key) is None
        if recorded:
            await client.record_operation(run, step, tool, payload, nonce, scope=scope)
        session = await client.open_session(scope, manifest)
        try:
            state = await client.dispatch(session, run, key, payload)
        finally:
            await _close_quietly(client, session)
        return _operation_result(run, key, state, recorded), state.kind

    document, state = asyncio.run(_with_client(config, scope, body))
    return _finish(
        out, document, _result_lines(document), state, f"operation {document['operation_key']}"
    )


def _operation_result(run: HostRun, key: str, state: Any, recorded: bool | None) -> dict[str, Any]:
    operation = run.operation(key)
    assert operation is not None
    document: dict[str, Any] = {
        "run": run.name,
        "operation_key": key,
        "step": operation.step_id,
        "tool": operation.tool,
        "observed": _state_detail(state),
        "ledger_state": operation.state.value,
        "revision": run.revision,
    }
    if recorded is not None:
        document["newly_recorded"] = recorded
    return document


def _result_lines(document: Mapping[str, Any]) -> list[str]:
    lines = [
        f"run:            {document['run']}",
        f"operation key:  {document['operation_key']}",
        f"step / tool:    {document['step']} / {document['tool']}",
        f"observed:       {_state_text(document['observed'])}",
        f"ledger state:   {document['ledger_state']}",
        f"revision:       {document['revision']}",
    ]
    if "compensation_key" in document:
        lines.insert(2, f"compensation:   {document['compensation_key']}")
    return lines


async def _load_recorded(
    client: HostClient, config: HostConfig, run_name: str, plan_name: str | None
) -> HostRun:
    ledger = await _stored_ledger(client.store, run_name)
    plan = _plan_for(config, client.engine, ledger, plan_name)
    return await client.load_run(run_name, plan)


def _recorded_operation(run: HostRun, key: str) -> WorkflowOperation:
    operation = run.operation(key)
    if operation is None:
        raise UnknownOperation(key)
    return operation


def cmd_reconcile(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    scope = _scope(config, args.scope)
    manifest = config.manifest(scope)

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind]:
        run = await _load_recorded(client, config, args.run, args.plan)
        operation = _recorded_operation(run, args.key)
        payload = _payload(_grant_format(config, scope, operation.tool), args.payload, "--payload")
        operation.verify_input(canonical_operation_input_bytes(payload))
        session = await client.open_session(scope, manifest)
        try:
            state = await client.reconcile(session, run, args.key, payload)
        except WorkerRequestRejected as error:
            if error.rejection_code != "unknown_operation":
                raise
            raise CliError(
                EXIT_CHECK_FAILED,
                f"the worker never admitted {args.key}; send it with: {PROG} recover "
                f"{args.run} --scope {scope} --inputs FILE (or dispatch it again)",
                "unknown_operation",
            ) from None
        finally:
            await _close_quietly(client, session)
        return _operation_result(run, args.key, state, None), state.kind

    document, state = asyncio.run(_with_client(config, scope, body))
    return _finish(out, document, _result_lines(document), state, f"operation {args.key}")


# compensate --------------------------------------------------------------------------------------


def _target(
    config: HostConfig, scope: str, operation: WorkflowOperation, original: ToolPayload | None
) -> WorkflowCompensationTarget:
    grant = config.grant(scope, operation.tool)
    if grant is None:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"grants: scope {scope!r} has no grant of tool {operation.tool!r}; "
            "it cannot be compensated",
            "compensation_not_granted",
        )
    policy = WorkflowCompensationPolicy(scope, grant)
    return WorkflowCompensationTarget(
        operation.operation_key,
        policy,
        grant,
        ConfiguredGrantVerifier(config),
        ConfiguredActionVerifier(config, original),
    )


def cmd_compensate(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    scope = _scope(config, args.scope)
    manifest = config.manifest(scope)
    nonce = args.nonce.encode("utf-8")

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind]:
        run = await _load_recorded(client, config, args.run, args.plan)
        operation = _recorded_operation(run, args.key)
        fmt = _grant_format(config, scope, operation.tool)
        inverse = _payload(fmt, args.payload, "--payload")
        original = None if args.original is None else _payload(fmt, args.original, "--original")
        rule = config.action(operation.tool)
        if rule is not None and rule.match and original is None:
            raise CliError(
                EXIT_USAGE,
                f"--original: required for {operation.tool} (its [[actions]] entry matches "
                f"{', '.join(rule.match)} against the original input)",
                "usage",
            )
        target = _target(config, scope, operation, original)
        existing = operation.compensation
        if existing is None:
            compensation_key = await client.record_compensation(run, target, inverse, nonce)
        elif existing.state not in TERMINAL_KINDS and existing.matches_input(
            canonical_operation_input_bytes(inverse)
        ):
            # The recorded intent, resumed under a fresh approval (same key and input).
            compensation_key = existing.compensation_key
        else:
            raise CompensationAlreadyRecorded(args.key)
        session = await client.open_session(scope, manifest)
        try:
            state = await client.compensate(
                session,
                run,
                target,
                WorkflowCompensationDispatch(f"c-{secrets.token_hex(8)}", inverse),
            )
        finally:
            await _close_quietly(client, session)
        document = _operation_result(run, args.key, state, None)
        settled = run.operation(args.key)
        assert settled is not None and settled.compensation is not None
        document["compensation_key"] = compensation_key
        document["compensation_state"] = settled.compensation.state.value
        return document, state.kind

    document, state = asyncio.run(_with_client(config, scope, body))
    lines = _result_lines(document)
    lines.append(f"compensation state: {document['compensation_state']}")
    return _finish(out, document, lines, state, f"compensation {document['compensation_key']}")


# recover -----------------------------------------------------------------------------------------


def _read_inputs(path: str | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    if path is None:
        return {}, {}
    raw = _read_argument("@" + path, "--inputs")
    try:
        document = parse_json(raw)
    except OctoError as exc:
        raise CliError(EXIT_USAGE, f"--inputs: not valid JSON ({exc.code})", "usage") from None
    if not isinstance(document, dict) or set(document) - {"operations", "compensations"}:
        raise CliError(
            EXIT_USAGE,
            '--inputs: expected an object with "operations" and/or "compensations"',
            "usage",
        )
    operations = document.get("operations", {})
    compensations = document.get("compensations", {})
    if not isinstance(operations, dict) or not isinstance(compensations, dict):
        raise CliError(EXIT_USAGE, "--inputs: operations and compensations are objects", "usage")
    for key, entry in compensations.items():
        if (
            not isinstance(entry, dict)
            or "inverse" not in entry
            or set(entry) - {"inverse", "original"}
        ):
            raise CliError(
                EXIT_USAGE,
                f'--inputs: compensations.{printable(key)}: expected {{"inverse", "original"}}',
                "usage",
            )
    return operations, compensations


def cmd_recover(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    scope = _scope(config, args.scope)
    manifest = config.manifest(scope)
    raw_operations, raw_compensations = _read_inputs(args.inputs)

    async def body(client: HostClient) -> dict[str, Any]:
        ledger = await _stored_ledger(client.store, args.run)
        plan = _plan_for(config, client.engine, ledger, args.plan)
        inputs: dict[str, ToolPayload] = {}
        compensations: dict[str, tuple[WorkflowCompensationTarget, ToolPayload]] = {}
        refused: dict[str, str] = {}
        for key, value in raw_operations.items():
            operation = ledger.operation(key)
            if operation is None:
                raise CliError(
                    EXIT_USAGE,
                    f"--inputs: operations: {printable(key)} is not in the run",
                    "usage",
                )
            try:
                fmt = _grant_format(config, scope, operation.tool)
            except CliError:  # this key's grant is gone: the others go on
                refused[key] = UnknownTool.code  # what the worker would answer
                continue
            inputs[key] = _payload_from_value(fmt, value, f"--inputs operations.{key}")
        for key, entry in raw_compensations.items():
            operation = ledger.operation(key)
            if operation is None:
                raise CliError(
                    EXIT_USAGE,
                    f"--inputs: compensations: {printable(key)} is not in the run",
                    "usage",
                )
            named = (
                key if operation.compensation is None else operation.compensation.compensation_key
            )
            try:
                fmt = _grant_format(config, scope, operation.tool)
            except CliError:
                refused[named] = UnknownTool.code
                continue
            inverse = _payload_from_value(fmt, entry["inverse"], f"--inputs compensations.{key}")
            original = (
                None
                if "original" not in entry
                else _payload_from_value(fmt, entry["original"], f"--inputs compensations.{key}")
            )
            try:
                target = _target(config, scope, operation, original)
            except (CliError, OctoError) as error:  # e.g. compensation revoked (max 0)
                refused[named] = error.code
                continue
            compensations[key] = (target, inverse)
        summary = await client.recover(
            args.run, plan, scope, manifest, inputs=inputs, compensations=compensations
        )
        await _close_quietly(client, summary.session)
        # A key refused here was left out of recover(), which lists it unresolved.
        errors = {**refused, **summary.errors}
        return {
            "run": args.run,
            "revision": summary.run.revision,
            "operations": {k: v.value for k, v in summary.operations.items()},
            "compensations": {k: v.value for k, v in summary.compensations.items()},
            "reconciled": list(summary.reconciled),
            "unresolved": list(dict.fromkeys(summary.unresolved)),
            "errors": errors,
        }

    document = asyncio.run(_with_client(config, scope, body))
    ok = not document["unresolved"]
    document = {"ok": ok, **document}
    out.line(f"run:       {document['run']}")
    out.line(f"revision:  {document['revision']}")
    rows = [["KEY", "STATE", "COMPENSATION", "RECONCILED"]]
    for key, state in document["operations"].items():
        rows.append(
            [
                key,
                state,
                document["compensations"].get(key, "-"),
                "yes" if key in document["reconciled"] else "no",
            ]
        )
    if len(rows) > 1:
        print_table(rows, out)
    elif not document["unresolved"]:
        out.line("no operations")
    out.document(document)
    for key in document["unresolved"]:
        out.line(f"unresolved: {key}: {document['errors'].get(key, 'no input given')}")
    for key, code in document["errors"].items():
        if key not in document["unresolved"]:
            out.line(f"failed:    {key}: {code}")
    if not ok:
        unresolved = document["unresolved"]
        hint = (
            "give their inputs with --inputs, or reconcile / resolve them"
            if any(key not in document["errors"] for key in unresolved)
            else "see the reasons above"
        )
        out.error(
            f"{len(unresolved)} key(s) unresolved: " + ", ".join(unresolved[:5]) + f" ({hint})"
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK


# resolve / audit ---------------------------------------------------------------------------------


def _login_name() -> str:
    """``$USER`` (then ``$LOGNAME`` and the password database), or empty."""
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (OSError, KeyError):
        return ""


def cmd_resolve(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)
    operator = args.operator if args.operator is not None else _login_name()
    if not operator:
        raise CliError(EXIT_USAGE, "--operator: no name given and $USER is not set", "usage")

    async def resolve() -> dict[str, Any]:
        with _ledger_lock(config):
            async with _store(config, create=False) as store:
                plan = None
                if args.plan is not None:
                    ledger = await _stored_ledger(store, args.run)
                    plan = _plan_for(config, WorkflowEngine(), ledger, args.plan)
                try:
                    entry = await resolve_operation(
                        store,
                        args.run,
                        args.key,
                        args.state,
                        operator=operator,
                        reason=args.reason,
                        plan=plan,
                    )
                except ResolutionRefused as error:
                    raise CliError(EXIT_CHECK_FAILED, str(error), error.code) from None
        return {
            "run": entry.run,
            "operation_key": entry.key,
            "from": entry.from_state.value,
            "to": entry.to_state.value,
            "operator": entry.operator,
            "time": entry.time,
            "ledger_revision": entry.ledger_revision,
        }

    document = asyncio.run(resolve())
    out.line(
        f"{document['operation_key']}: {document['from']} -> {document['to']} "
        f"(ledger revision {document['ledger_revision']}; audited as {printable(operator)})"
    )
    out.document({"ok": True, **document})
    return EXIT_OK


def cmd_audit_show(args: argparse.Namespace, out: Output) -> int:
    config = _config(args)

    async def load() -> list[dict[str, Any]]:
        async with _store(config, create=False) as store:
            audited = await load_audit(store, args.run)
        return [
            {
                "run": item.entry.run,
                "operation_key": item.entry.key,
                "from": item.entry.from_state.value,
                "to": item.entry.to_state.value,
                "operator": item.entry.operator,
                "reason": item.entry.reason,
                "time": item.entry.time,
                "ledger_revision": item.entry.ledger_revision,
                "ledger_agrees": item.ledger_agrees,
            }
            for item in audited
        ]

    entries = asyncio.run(load())
    if not entries:
        out.line(f"no operator decisions for run {args.run}")
    for entry in entries:
        agrees = "" if entry["ledger_agrees"] else "  [NOT IN LEDGER]"
        out.line(
            f"{entry['time']}  {entry['operation_key']}  {entry['from']} -> {entry['to']}  "
            f"revision {entry['ledger_revision']}  by {printable(entry['operator'])}{agrees}"
        )
        out.line(f"    reason: {printable(entry['reason'], 1024)}")
    out.document({"ok": True, "run": args.run, "entries": entries})
    return EXIT_OK
