"""Two worker processes serving one scope from one PostgreSQL journal, and a host.

Shared by ``tests/faults/test_failover.py`` and ``bench/failover.py``. Real
processes, the real broker on 127.0.0.1:5672 and the real PostgreSQL test
database:

* :class:`FailoverEnv` writes one ``worker.toml`` per worker (its own state
  directory; the same scope key, storage key, PostgreSQL schema, and the
  same ``files.publish`` directory and effect log) and the host's ledger;
* each worker is ``tests/faults/_worker_main.py`` (the daemon as ``run``
  runs it) started through the crash matrix's :class:`Launcher`; the first
  one to consume is the scope's single active consumer, the others stand by;
* :func:`dispatch_all` sends N ``files.publish`` operations of one run at
  once from a :class:`HostClient` in this process; :func:`recover` settles
  what a failover left ambiguous; :func:`check_effects` asserts exactly one
  effect per succeeded key and none for the others, with the journal in
  PostgreSQL agreeing with the ledger key by key.

Keys and the PostgreSQL password stay in files and on the runners' stdin,
never on a command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import TERMINAL_KINDS, FailureCode, StateKind, WorkerOperationState
from octo_common.transport import reply_queue, worker_queue
from octo_host.client import HostClient, HostRun, RecoverySummary
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import RetryPolicy, WorkflowPlan, WorkflowStep
from octo_host.store import SqliteLedgerStore, ledger_record_key
from octo_worker.adapters.files import read_effect_log
from octo_worker.config import load_config
from octo_worker.storage.configured import configured_store
from tests.postgres import PostgresSchema

from .conftest import URL, _write_private

TOOL: Final = "files.publish"
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=1024)
RUN_NAME: Final = "failover-run"


def manifest() -> CapabilityManifest:
    return CapabilityManifest("manifest", [GRANT])


def steps(count: int, retry: RetryPolicy | None = None) -> list[WorkflowStep]:
    return [WorkflowStep(f"publish-{i}", f"publish file {i}", retry) for i in range(count)]


def payload(index: int, tag: str) -> ToolPayload:
    return ToolPayload.json({"name": f"file-{index}.txt", "content": f"{tag}:{index}"})


@dataclass
class FailoverEnv:
    """The files of N workers sharing one scope, journal and publish directory."""

    root: Path
    place: PostgresSchema
    scope: str
    scope_key_bytes: bytes
    host_storage_key: bytes
    configs: list[Path]
    host_ids: list[str] = field(default_factory=list)

    @classmethod
    def create(
        cls, root: Path, place: PostgresSchema, *, workers: int = 2, heartbeat: int = 2
    ) -> FailoverEnv:
        scope = f"t-failover-{uuid.uuid4().hex[:12]}"
        scope_key = secrets.token_bytes(32)
        keys = root / "keys"
        _write_private(keys / "scope.key", scope_key)
        _write_private(keys / "storage.key", secrets.token_bytes(32).hex().encode())
        shared = root / "shared"
        shared.mkdir(parents=True, exist_ok=True)
        configs = []
        for index in range(workers):
            base = root / f"worker-{index}"
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
            config = base / "worker.toml"
            config.write_text(
                f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 2.0
log_level = "warning"

[broker]
url = "{URL}"
connect_timeout_seconds = 3.0
publish_timeout_seconds = 5.0
reconnect_initial_seconds = 0.1
heartbeat_seconds = {heartbeat}

[storage]
url = "{place.url}"
password_file = "{place.password_file}"
schema = "{place.schema}"
key = {{ id = "worker-k1", key_file = "{keys / "storage.key"}" }}

[[scopes]]
name = "{scope}"
key_file = "{keys / "scope.key"}"
max_concurrency = 64

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "{shared / "published"}"
effect_log = "{shared / "effects.log"}"
""",
                encoding="utf-8",
            )
            configs.append(config)
        return cls(root, place, scope, scope_key, secrets.token_bytes(32), configs)

    @property
    def scope_key(self) -> ScopeKey:
        return ScopeKey.from_bytes(self.scope_key_bytes)

    @property
    def effect_log(self) -> Path:
        return self.root / "shared" / "effects.log"

    @property
    def published(self) -> Path:
        return self.root / "shared" / "published" / self.scope

    def host_store(self) -> SqliteLedgerStore:
        return SqliteLedgerStore(
            self.root / "host" / "ledger.sqlite3", StorageKeyring("host-k1", self.host_storage_key)
        )

    def client(self, *, reply_timeout: float = 3.0) -> HostClient:
        host_id = f"t-failover-host-{uuid.uuid4().hex[:12]}"
        self.host_ids.append(host_id)
        return HostClient(
            URL,
            host_id=host_id,
            scope_keys={self.scope: self.scope_key},
            store=self.host_store(),
            reply_timeout=reply_timeout,
            publish_timeout=5.0,
            max_attempts=6,
            backoff_initial=0.05,
            backoff_max=0.5,
        )

    def effects(self) -> int:
        return len(read_effect_log(self.effect_log))

    async def fence(self) -> int:
        """The scope's fence in the shared journal (how many owners reserved it)."""
        store = configured_store(load_config(self.configs[0]), read_only=True)
        try:
            return (await store.scope_metadata(self.scope)).fence
        finally:
            await store.close()

    async def delete_queues(self) -> None:
        from octo_host.amqp import connect

        connection = await connect(URL, timeout=3.0, name="octo-test-failover-cleanup")
        try:
            channel = await connection.channel()
            for name in [worker_queue(self.scope), *(reply_queue(h) for h in self.host_ids)]:
                with contextlib.suppress(Exception):
                    await channel.queue_delete(name)
        finally:
            await connection.close()


async def record_run(
    client: HostClient,
    count: int,
    tag: str,
    *,
    name: str = RUN_NAME,
    first: int = 0,
    retry: RetryPolicy | None = None,
) -> tuple[WorkflowPlan, HostRun, list[str]]:
    """Run ``name``: ``count`` publish operations of files ``first``.. (one step each,
    with ``retry`` as the steps' retry policy), recorded."""
    plan = client.engine.plan(steps(count, retry))
    run = await client.load_run(name, plan)
    keys = [
        await client.record_operation(
            run, f"publish-{i}", TOOL, payload(first + i, tag), f"{tag}:{first + i}".encode()
        )
        for i in range(count)
    ]
    return plan, run, keys


async def dispatch_all(
    client: HostClient,
    env: FailoverEnv,
    run: HostRun,
    keys: list[str],
    tag: str,
    *,
    first: int = 0,
) -> list[WorkerOperationState | BaseException]:
    """Every key dispatched at once in one session; an exception is kept as the result."""
    session = await client.open_session(env.scope, manifest())
    results: list[Any] = await asyncio.gather(
        *(
            client.dispatch(session, run, key, payload(first + i, tag))
            for i, key in enumerate(keys)
        ),
        return_exceptions=True,
    )
    return results


async def recover(
    client: HostClient,
    env: FailoverEnv,
    plan: WorkflowPlan,
    keys: list[str],
    tag: str,
    *,
    name: str = RUN_NAME,
    first: int = 0,
) -> RecoverySummary:
    return await client.recover(
        name,
        plan,
        env.scope,
        manifest(),
        inputs={key: payload(first + i, tag) for i, key in enumerate(keys)},
    )


async def read_ledger(env: FailoverEnv, name: str = RUN_NAME) -> WorkflowOperationLedger:
    store = env.host_store()
    try:
        record = await store.load(ledger_record_key(name))
    finally:
        await store.close()
    assert record is not None
    return WorkflowOperationLedger.from_json(record.payload)


async def check_effects(
    env: FailoverEnv, keys: list[str], *, name: str = RUN_NAME, first: int = 0
) -> Counter[StateKind]:
    """Per logical step (its first key, then each retry that replaced a failed attempt):
    every attempt terminal, exactly one effect per succeeded attempt and none
    otherwise, only attempts proven not to have happened replaced; the shared
    journal agrees with the ledger. Returns the counts of the steps' final states."""
    ledger = await read_ledger(env, name)
    chains = {key: [op.operation_key for op in ledger.attempts(key)] for key in keys}
    every = [attempt for chain in chains.values() for attempt in chain]
    assert sorted(every) == sorted(op.operation_key for op in ledger.operations)
    effects = read_effect_log(env.effect_log)
    publishes = Counter(e["operation_key"] for e in effects if e["effect"] == "publish")
    store = configured_store(load_config(env.configs[0]), read_only=True)
    try:
        journal = await store.load_records(env.scope, every)
    finally:
        await store.close()
    states: Counter[StateKind] = Counter()
    for index, key in enumerate(keys):
        chain = chains[key]
        final = ledger.operation(chain[-1])
        assert final is not None
        states[final.state] += 1
        for attempt_key in chain:
            operation = ledger.operation(attempt_key)
            assert operation is not None
            state = operation.state
            assert state in TERMINAL_KINDS, (index, state)
            if attempt_key != chain[-1]:
                assert (state, operation.failure) == (StateKind.FAILED, FailureCode.NOT_HAPPENED)
            expected = 1 if state == StateKind.SUCCEEDED else 0
            assert publishes[attempt_key] == expected, (index, state, publishes[attempt_key])
            row = journal[attempt_key]
            assert row is not None, (index, "the ledger settled a key the journal lacks")
            assert row[0].state.kind == state, (index, row[0].state.kind, state)
        succeeded = final.state == StateKind.SUCCEEDED
        assert (env.published / f"file-{first + index}.txt").exists() == succeeded, index
    return states


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
