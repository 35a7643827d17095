"""What a verb of ``octo-host`` works in: configuration, plans, the ledger store, the client.

This module owns loading the configuration and choosing the scope, finding a
run's plan, the one-command-per-ledger lock, opening the ledger store
(SQLite, or PostgreSQL with ``[storage] url``), and running a body with a
started client that is closed after it.

It must never print (the verbs do) or leave a store, a lock or a client open.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Final

from octo_common.digest import plan_fingerprint
from octo_common.errors import OctoError, StorageError, UnknownOperation
from octo_common.payload import ToolPayload
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
    broker_unreachable,
)
from octo_host.amqp import BrokerUnavailable
from octo_host.client import HostClient, HostRun, HostSession
from octo_host.compensation import WorkflowCompensationPolicy, WorkflowCompensationTarget
from octo_host.config import (
    ConfiguredActionVerifier,
    ConfiguredGrantVerifier,
    HostConfig,
    load_config,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan
from octo_host.storage.postgres import PostgresLedgerStore, redacted_url
from octo_host.store import (
    LEDGER_NAMESPACE,
    AuthenticatedStore,
    SqliteLedgerStore,
    ledger_record_key,
)

__all__ = [
    "PROG",
    "close_quietly",
    "compensation_target",
    "config_of",
    "grant_format",
    "ledger_lock",
    "load_recorded",
    "open_store",
    "plan_for",
    "plan_name",
    "plan_named",
    "recorded_operation",
    "scope_of",
    "stored_ledger",
    "with_client",
]

PROG: Final = "octo-host"


def config_of(args: argparse.Namespace) -> HostConfig:
    return load_config(args.config)


def scope_of(config: HostConfig, given: str | None) -> str:
    """``--scope``, or the one configured scope when there is exactly one."""
    if given is not None:
        return given
    if len(config.scopes) == 1:
        return config.scopes[0].name
    raise CliError(
        EXIT_USAGE, f"--scope: required ({len(config.scopes)} scopes are configured)", "usage"
    )


def plan_named(config: HostConfig, engine: WorkflowEngine, name: str) -> WorkflowPlan:
    entry = config.plan(name)
    if entry is None:
        raise CliError(EXIT_USAGE, f"--plan: no [[plans]] entry named {name!r}", "usage")
    return engine.plan([step.step() for step in entry.steps])


def plan_name(config: HostConfig, fingerprint: str) -> str | None:
    for entry in config.plans:
        steps = [step.step() for step in entry.steps]
        if plan_fingerprint(steps) == fingerprint:
            return entry.name
    return None


def plan_for(
    config: HostConfig, engine: WorkflowEngine, ledger: WorkflowOperationLedger, name: str | None
) -> WorkflowPlan:
    """``--plan`` if given, else the configured plan whose fingerprint the ledger holds."""
    if name is None:
        name = plan_name(config, ledger.plan_fingerprint)
        if name is None:
            raise CliError(
                EXIT_USAGE,
                f"plans: no [[plans]] entry has the run's plan fingerprint "
                f"{ledger.plan_fingerprint} (was the plan changed?)",
                "plan_mismatch",
            )
    plan = plan_named(config, engine, name)
    engine.validate_operation_ledger(plan, ledger)
    return plan


@contextlib.contextmanager
def ledger_lock(config: HostConfig) -> Iterator[None]:
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
async def open_store(
    config: HostConfig, *, create: bool
) -> AsyncIterator[SqliteLedgerStore | PostgresLedgerStore]:
    path: Path | str
    if config.storage.url is not None:  # [storage] url: the ledger in PostgreSQL
        path = redacted_url(config.storage.url)
    else:
        path = config.database_path
        if not create and not path.exists():
            config.storage_keyring()  # configuration problems first
            raise CliError(
                EXIT_CHECK_FAILED,
                f"ledger database {path} does not exist (nothing recorded yet)",
                "not_found",
            )
    store = config.ledger_store()
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


async def stored_ledger(store: AuthenticatedStore, run: str) -> WorkflowOperationLedger:
    record = await store.load(ledger_record_key(run))
    if record is None:
        raise CliError(EXIT_CHECK_FAILED, f"run {run} has no ledger", "not_found")
    return WorkflowOperationLedger.from_json(record.payload)


async def with_client(
    config: HostConfig, scope: str, body: Callable[[HostClient], Awaitable[Any]]
) -> Any:
    """Run ``body`` with a started client (lock, store and connection closed after)."""
    scope_key = config.scope_key(scope)
    url = config.broker_url()
    with ledger_lock(config):
        async with open_store(config, create=True) as store:
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
                broker_tls=config.broker_tls(broker),
            )
            try:
                await client.start()
            except BrokerUnavailable as error:
                raise broker_unreachable(
                    config.redacted_broker_url(), error.reason, error.code
                ) from None
            try:
                # The publish timeout governs publishes; the connect timeout only the start.
                client.publish_timeout = broker.publish_timeout_seconds
                return await body(client)
            finally:
                await client.close()


async def close_quietly(client: HostClient, session: HostSession) -> None:
    with contextlib.suppress(OctoError):
        await client.close_session(session)


def grant_format(config: HostConfig, scope: str, tool: str) -> str:
    grant = config.grant(scope, tool)
    if grant is None:
        raise CliError(
            EXIT_USAGE, f"grants: scope {scope!r} has no grant of tool {tool!r}", "usage"
        )
    return grant.format


async def runs_holding(store: AuthenticatedStore, key: str) -> list[str]:
    """Every run whose ledger holds ``key`` (an operation key or a ``cmp-`` key)."""
    found = []
    for run in await store.names(LEDGER_NAMESPACE):
        ledger = await stored_ledger(store, run)
        if ledger.operation(key) is not None or ledger.compensated_operation(key) is not None:
            found.append(run)
    return found


async def run_of(store: AuthenticatedStore, given: str | None, key: str) -> str:
    """``RUN`` when given, else the one run whose ledger holds ``key``."""
    if given is not None:
        return given
    runs = await runs_holding(store, key)
    if not runs:
        raise CliError(EXIT_CHECK_FAILED, f"no run's ledger holds {key}", "not_found")
    if len(runs) > 1:
        raise CliError(
            EXIT_USAGE, f"{key} is in several runs ({', '.join(runs)}): name one", "usage"
        )
    return runs[0]


async def load_recorded(
    client: HostClient, config: HostConfig, run_name: str, plan_name: str | None
) -> HostRun:
    ledger = await stored_ledger(client.store, run_name)
    plan = plan_for(config, client.engine, ledger, plan_name)
    return await client.load_run(run_name, plan)


def recorded_operation(run: HostRun, key: str) -> WorkflowOperation:
    operation = run.operation(key)
    if operation is None:
        raise UnknownOperation(key)
    return operation


def compensation_target(
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
