"""The SIGKILL crash scenario, shared by the crash matrix and the soak run.

Real processes, the real broker on 127.0.0.1:5672 and real SQLite files:

* the worker is ``tests/faults/_worker_main.py`` in its own process
  (``files.publish`` with its fsynced effect log), started with ``OCTO_FAULT``
  for the crashing incarnation and without it for the restart;
* the host is a :class:`HostClient` in this process (worker faults) or
  ``tests/faults/_host_main.py`` in its own process (the host fault), after
  which a fresh ``HostClient`` here recovers the run.

One scenario (:func:`run_scenario`): three publish operations with distinct
file names, dispatched one after another or all at once, then the
compensation of the first one. The armed process dies by its own SIGKILL at
the chosen point and count (:data:`ALL_POINTS`: the generic worker points and
the host's ledger commit and its reply applied but not yet persisted, each
reached once per request, and the compensation
points, reached once per run: the host's compensation intent, the worker's
compensation admission commit and its inverse effect); the worker is
restarted without the fault on the same files; ``recover`` reconciles the
run; the compensation is finished if the crash came before it.
:func:`check_outcome` then asserts what must hold after any crash: every
operation and every compensation is terminal (none left pending or
running), the effect log holds at most one publish and one removal per
key (exactly one where the ledger says ``succeeded``), and the worker
journal and the host ledger agree key by key; after a host killed with a
reply applied but not persisted, that reply is still in its queue (never
acked).

Interpreters are started ahead of time (:class:`Launcher`): a runner imports
everything, prints ``loaded`` and waits for its arguments on stdin, so a
restart costs the daemon's start, not Python's.

Nothing here edits protocol state by hand; keys and payloads stay in this
process and in the runners' stdin (never on a command line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import pytest

from octo_common.digest import adapter_idempotency_key
from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import TERMINAL_KINDS, FailureCode, StateKind, Succeeded
from octo_common.transport import reply_queue, worker_queue
from octo_host.client import HostClient, HostRun, RecoverySummary
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import RetryPolicy, WorkflowPlan, WorkflowStep
from octo_host.store import SqliteLedgerStore, ledger_record_key
from octo_worker.adapters.files import read_effect_log
from octo_worker.config import load_config
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.configured import configured_store
from tests.postgres import PostgresSchema
from tests.timing import scaled

URL: Final = "amqp://127.0.0.1:5672/"
TOOL: Final = "files.publish"
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=16, max_compensations=1)
KEYS_PER_RUN: Final = 3
# The steps' retry policy, on in every crash run: an attempt a crash cut before its
# effect (proven not to have happened by files.publish's lookup) is replaced by
# the next one under a new key, so every logical step ends succeeded.
RETRY_ATTEMPTS: Final = 3
RETRY: Final = RetryPolicy(attempts=RETRY_ATTEMPTS, backoff_seconds=0.05)
STEPS: Final = [
    WorkflowStep(f"publish-{i}", f"publish file {i}", RETRY) for i in range(KEYS_PER_RUN)
]
RUN_NAME: Final = "crash-run"
HERE: Final = Path(__file__).resolve().parent
WORKER_MAIN: Final = HERE / "_worker_main.py"
HOST_MAIN: Final = HERE / "_host_main.py"
WORKER_POINTS: Final = (
    "worker.after_admission_commit",
    "worker.after_ack",
    "worker.after_effect",
    "worker.before_reply",
    "worker.after_reply",
)
# Reached by the compensation of the first key only (once per scenario).
COMPENSATION_POINTS: Final = (
    "worker.after_compensation_admission_commit",
    "worker.after_compensation_effect",
    "host.after_compensation_intent",
)
HOST_POINT: Final = "host.after_ledger_commit"
# Reached once per reply the host applies (3 dispatches + 1 compensation).
REPLY_POINT: Final = "host.after_reply_applied"
HOST_POINTS: Final = (HOST_POINT, REPLY_POINT, "host.after_compensation_intent")
ALL_POINTS: Final = (*WORKER_POINTS, HOST_POINT, REPLY_POINT, *COMPENSATION_POINTS)
# Keyed requests of one undisturbed scenario (3 dispatches + 1 compensation):
# every generic worker point and the host points are reached once per request.
REQUESTS_PER_RUN: Final = KEYS_PER_RUN + 1


def reaches_per_run(point: str) -> int:
    """How many times an undisturbed scenario reaches ``point`` (the counts that kill)."""
    return 1 if point in COMPENSATION_POINTS else REQUESTS_PER_RUN


DEATH_TIMEOUT: Final = 15.0
SETTLE_TIMEOUT: Final = 30.0


def manifest() -> CapabilityManifest:
    return CapabilityManifest("manifest", [GRANT])


def publish_payload(index: int, tag: str) -> ToolPayload:
    return ToolPayload.json({"name": f"file-{index}.txt", "content": f"{tag}:{index}"})


def undo_payload(index: int) -> ToolPayload:
    return ToolPayload.json({"undo": "publish", "name": f"file-{index}.txt"})


class _AllowGrant:
    """Grant verifier: exactly this scope and GRANT."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        assert tenant_scope == self.tenant and grant == GRANT


class _AllowUndo:
    """Action verifier: only the inverse of the first file's publish."""

    def __init__(self, allowed_input: bytes) -> None:
        self.allowed_input = allowed_input

    def verify_compensation_action(self, action: Any) -> None:
        assert action.compensation_input == self.allowed_input


def compensation_target(scope: str, operation_key: str) -> WorkflowCompensationTarget:
    inverse = canonical_operation_input_bytes(undo_payload(0))
    return WorkflowCompensationTarget(
        operation_key,
        WorkflowCompensationPolicy(scope, GRANT),
        GRANT,
        _AllowGrant(scope),
        _AllowUndo(inverse),
    )


def _write_private(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
    return path


# Files of one run ---------------------------------------------------------------------


@dataclass
class CrashEnv:
    """One run's worker files, host ledger and broker names."""

    root: Path
    scope: str
    scope_key_bytes: bytes
    host_storage_key: bytes
    config_path: Path
    url: str = URL
    host_ids: list[str] = field(default_factory=list)

    @classmethod
    def create(
        cls, root: Path, url: str = URL, *, postgres: PostgresSchema | None = None
    ) -> CrashEnv:
        """The run's files; with ``postgres`` the journal is in that schema."""
        scope = f"t-crash-{uuid.uuid4().hex[:12]}"
        scope_key = secrets.token_bytes(32)
        base = root / "worker"
        _write_private(base / "keys" / "scope.key", scope_key)
        _write_private(base / "keys" / "storage.key", secrets.token_bytes(32).hex().encode())
        config_path = base / "worker.toml"
        config_path.write_text(
            f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 2.0
log_level = "warning"

[broker]
url = "{url}"
connect_timeout_seconds = 3.0
publish_timeout_seconds = 5.0
reconnect_initial_seconds = 0.1
reconnect_max_seconds = 1.0

[storage]
{_journal(postgres)}
key = {{ id = "worker-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{scope}"
key_file = "keys/scope.key"

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
""",
            encoding="utf-8",
        )
        return cls(root, scope, scope_key, secrets.token_bytes(32), config_path, url)

    @property
    def scope_key(self) -> ScopeKey:
        return ScopeKey.from_bytes(self.scope_key_bytes)

    @property
    def scope_key_file(self) -> Path:
        return self.root / "worker" / "keys" / "scope.key"

    @property
    def state_dir(self) -> Path:
        return self.root / "worker" / "state"

    @property
    def effect_log(self) -> Path:
        return self.state_dir / "effects.log"

    @property
    def published(self) -> Path:
        """``files.publish``'s files of this run's scope (a directory per scope)."""
        return self.state_dir / "published" / self.scope

    @property
    def ledger_path(self) -> Path:
        return self.root / "host" / "ledger.sqlite3"

    def host_store(self) -> SqliteLedgerStore:
        return SqliteLedgerStore(self.ledger_path, StorageKeyring("host-k1", self.host_storage_key))

    def new_host_id(self) -> str:
        host_id = f"t-crash-host-{uuid.uuid4().hex[:12]}"
        self.host_ids.append(host_id)
        return host_id

    def queues(self) -> list[str]:
        return [worker_queue(self.scope), *(reply_queue(h) for h in self.host_ids)]


def _journal(postgres: PostgresSchema | None) -> str:
    """The ``[storage]`` lines that place the journal: a SQLite file or a PostgreSQL schema."""
    if postgres is None:
        return 'journal = "journal.sqlite3"'
    return (
        f'url = "{postgres.url}"\npassword_file = "{postgres.password_file}"\n'
        f'schema = "{postgres.schema}"'
    )


# Pre-started interpreters -------------------------------------------------------------


class Runner:
    """One runner process (worker or host) we started; stderr goes to a file."""

    def __init__(self, process: subprocess.Popen[bytes], kind: str, fault: str | None, err: Path):
        self.process = process
        self.kind = kind
        self.fault = fault
        self.err_path = err

    @property
    def pid(self) -> int:
        return self.process.pid

    def _stdout(self) -> IO[bytes]:
        assert self.process.stdout is not None
        return self.process.stdout

    async def read_line(self, timeout: float) -> str:
        line = await asyncio.wait_for(asyncio.to_thread(self._stdout().readline), timeout)
        return line.decode("utf-8", "replace").strip()

    async def expect(self, word: str, timeout: float = scaled(20.0)) -> None:
        line = await self.read_line(timeout)
        if line != word:
            raise AssertionError(f"{self.kind} runner said {line!r}, not {word!r}: {self.stderr()}")

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text.encode("utf-8") + b"\n")
        self.process.stdin.flush()

    async def wait_exit(self, timeout: float) -> int:
        return await asyncio.wait_for(asyncio.to_thread(self.process.wait), timeout)

    def stderr(self) -> str:
        try:
            return self.err_path.read_text("utf-8", "replace")[-3000:]
        except FileNotFoundError:
            return ""

    async def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (a clean stop), then SIGKILL if it does not stop in time."""
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return await self.wait_exit(timeout)
        except TimeoutError:
            self.process.kill()
            return await self.wait_exit(5.0)

    def kill_now(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5.0)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class Launcher:
    """Starts runner interpreters ahead of time, one spare per (kind, fault)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._spares: dict[tuple[str, str | None], list[Runner]] = {}
        self._started: list[Runner] = []
        self._count = 0

    def _spawn(self, kind: str, fault: str | None) -> Runner:
        self._count += 1
        env = {k: v for k, v in os.environ.items() if k != "OCTO_FAULT"}
        if fault is not None:
            env["OCTO_FAULT"] = fault
        script = WORKER_MAIN if kind == "worker" else HOST_MAIN
        err = self.log_dir / f"{kind}-{self._count}.err"
        with open(err, "wb") as err_file:
            process = subprocess.Popen(  # fixed argv, no shell
                [sys.executable, str(script), "--stdin"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err_file,
                env=env,
            )
        runner = Runner(process, kind, fault, err)
        self._started.append(runner)
        return runner

    def prewarm(self, kind: str, fault: str | None) -> None:
        spares = self._spares.setdefault((kind, fault), [])
        if not spares:
            spares.append(self._spawn(kind, fault))

    async def take(self, kind: str, fault: str | None) -> Runner:
        """A runner that has imported everything and waits for its arguments."""
        spares = self._spares.get((kind, fault))
        runner = spares.pop() if spares else self._spawn(kind, fault)
        if fault is None and kind == "worker":
            self.prewarm(kind, None)  # the next restart is ready before it is needed
        await runner.expect("loaded")
        return runner

    def close(self) -> None:
        for runner in self._started:
            with contextlib.suppress(Exception):
                runner.kill_now()
        self._started.clear()
        self._spares.clear()


async def start_worker(launcher: Launcher, env: CrashEnv, fault: str | None) -> Runner:
    runner = await launcher.take("worker", fault)
    runner.send(str(env.config_path))
    return runner


# The scenario ------------------------------------------------------------------------------


@dataclass
class Case:
    """One crash: where, at which count, and the host's dispatch pattern."""

    point: str
    count: int
    concurrent: bool = False
    # Worker faults: the host process "restarts" too (its call is abandoned and a
    # new HostClient recovers) instead of letting its own timeouts reconcile.
    restart_host: bool = False

    @property
    def fault(self) -> str:
        return f"{self.point}@{self.count}"

    @property
    def host_fault(self) -> bool:
        """The host process is the one armed (else the worker)."""
        return self.point in HOST_POINTS

    @property
    def runner_kind(self) -> str:
        return "host" if self.host_fault else "worker"

    def __str__(self) -> str:
        mode = "concurrent" if self.concurrent else "sequential"
        host = "/host-restart" if self.restart_host and not self.host_fault else ""
        return f"{self.point}@{self.count}/{mode}{host}"


@dataclass
class Outcome:
    """What one run did, for the checks and the soak summary."""

    case: Case
    keys: list[str]
    states: dict[str, StateKind]
    compensation: StateKind | None
    flow_error: str | None
    seconds: float
    summary: RecoverySummary | None = None
    env: CrashEnv | None = None
    ledger: WorkflowOperationLedger | None = None


async def _record_operations(
    client: HostClient, plan: WorkflowPlan, tag: str
) -> tuple[HostRun, list[str]]:
    """The run's three publish operations, recorded and persisted."""
    run = await client.load_run(RUN_NAME, plan)
    keys = [
        await client.record_operation(
            run, STEPS[i].id, TOOL, publish_payload(i, tag), f"{tag}:{i}".encode()
        )
        for i in range(KEYS_PER_RUN)
    ]
    return run, keys


async def _dispatch_and_compensate(
    client: HostClient, env: CrashEnv, run: HostRun, keys: list[str], case: Case, tag: str
) -> None:
    session = await client.open_session(env.scope, manifest())
    if case.concurrent:
        states = await asyncio.gather(
            *(
                client.dispatch(session, run, key, publish_payload(i, tag))
                for i, key in enumerate(keys)
            )
        )
    else:
        states = [
            await client.dispatch(session, run, key, publish_payload(i, tag))
            for i, key in enumerate(keys)
        ]
    if isinstance(states[0], Succeeded):
        await _compensate_first(client, env, run, keys[0], session, tag)


async def _compensate_first(
    client: HostClient, env: CrashEnv, run: HostRun, key: str, session: Any, tag: str
) -> None:
    target = compensation_target(env.scope, key)
    await client.record_compensation(run, target, undo_payload(0), f"{tag}:undo".encode())
    await client.compensate(
        session, run, target, WorkflowCompensationDispatch(f"c-{tag}", undo_payload(0))
    )


def host_client(env: CrashEnv, host_id: str, **settings: Any) -> HostClient:
    """A client of ``env``'s scope and ledger; ``settings`` override the crash runs' timings."""
    timings: dict[str, Any] = {
        # The worker restarts within half a second; a request it acked before
        # dying is never answered, and this is how long the host waits for it.
        "reply_timeout": 1.0,
        "publish_timeout": 5.0,
        "max_attempts": 4,
        "backoff_initial": 0.05,
        "backoff_max": 0.5,
    }
    return HostClient(
        env.url,
        host_id=host_id,
        scope_keys={env.scope: env.scope_key},
        store=env.host_store(),
        **(timings | settings),
    )


async def _recover_and_finish(
    client: HostClient, env: CrashEnv, plan: WorkflowPlan, keys: list[str], tag: str
) -> RecoverySummary:
    """The client's recovery of the run, then the compensation if the crash came before it."""
    inverse = undo_payload(0)
    # A compensation applies to the first step's succeeded attempt, whichever it is.
    before = await client.load_run(RUN_NAME, plan)
    attempts = [op.operation_key for op in before.ledger.attempts(keys[0])]
    summary = await client.recover(
        RUN_NAME,
        plan,
        env.scope,
        manifest(),
        inputs={key: publish_payload(i, tag) for i, key in enumerate(keys)},
        compensations={key: (compensation_target(env.scope, key), inverse) for key in attempts},
    )
    run = summary.run
    first = run.ledger.attempts(keys[0])[-1]
    if first.state == StateKind.SUCCEEDED and first.compensation is None:
        await _compensate_first(client, env, run, first.operation_key, summary.session, tag)
    return summary


async def run_scenario(
    launcher: Launcher, root: Path, case: Case, *, postgres: PostgresSchema | None = None
) -> Outcome:
    """One crash run (:func:`play_scenario`), checked (:func:`check_outcome`), queues deleted."""
    outcome = await play_scenario(launcher, root, case, postgres=postgres)
    assert outcome.env is not None and outcome.ledger is not None
    try:
        await check_outcome(outcome.env, outcome, outcome.ledger)
        if case.point == REPLY_POINT:
            # The host died between applying a reply and persisting it: the
            # reply was never acked, so its queue still holds it (a copy for
            # the operator; a host restarted under the same id is handed it).
            dead = reply_queue(outcome.env.host_ids[0])
            assert await queue_depth(dead, outcome.env.url) >= 1, (case, "the reply was acked")
    finally:
        await delete_queues(outcome.env)
    return outcome


async def play_scenario(
    launcher: Launcher, root: Path, case: Case, *, postgres: PostgresSchema | None = None
) -> Outcome:
    """One crash run: arm, crash, restart clean, recover, finish; nothing checked but the kill.

    With ``postgres`` the worker's journal is in that PostgreSQL schema."""
    started = time.perf_counter()
    env = CrashEnv.create(root, postgres=postgres)
    tag = uuid.uuid4().hex[:8]
    flow_error: str | None = None
    host_fault = case.host_fault
    worker = await start_worker(launcher, env, None if host_fault else case.fault)
    restarted: Runner | None = None
    client: HostClient | None = None
    try:
        await worker.expect("ready")
        if host_fault:
            keys = await _crash_host(launcher, env, case, tag)
            client = host_client(env, env.new_host_id())
            await client.start()
            plan = client.engine.plan(STEPS)
        else:
            client = host_client(env, env.new_host_id())
            await client.start()
            plan = client.engine.plan(STEPS)
            run, keys = await _record_operations(client, plan, tag)
            flow = asyncio.ensure_future(
                _dispatch_and_compensate(client, env, run, keys, case, tag)
            )
            death = asyncio.ensure_future(worker.wait_exit(DEATH_TIMEOUT))
            await asyncio.wait({flow, death}, return_when=asyncio.FIRST_COMPLETED)
            if flow.done() and not death.done():
                # Undisturbed so far: the kill may follow the last reply.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(death), 3.0)
            if not death.done():
                flow.cancel()
                raise AssertionError(f"{case}: the worker never reached its fault point")
            returncode = death.result()
            assert returncode == -signal.SIGKILL, (returncode, worker.stderr())
            assert f"SIGKILL at {case.point}" in worker.stderr()
            restarted = await start_worker(launcher, env, None)
            if case.restart_host:
                # The host gives up its call and restarts: a new client recovers.
                flow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    # Otherwise its own timeouts lead to reconciliation.
                    await asyncio.wait_for(flow, SETTLE_TIMEOUT)
                except Exception as exc:
                    flow_error = type(exc).__name__
            if case.restart_host:
                await client.close()
                await client.store.close()
                client = host_client(env, env.new_host_id())
                await client.start()
                plan = client.engine.plan(STEPS)
        summary = await asyncio.wait_for(
            _recover_and_finish(client, env, plan, keys, tag), SETTLE_TIMEOUT
        )
    finally:
        if client is not None:
            await client.close()
            await client.store.close()
        for runner in (worker, restarted):
            if runner is not None:
                await runner.stop()
    stored = await read_ledger(env)
    states = {}
    compensation: StateKind | None = None
    for key in keys:
        # A logical step's outcome is its last attempt's (a retry replaces a failed one).
        attempts = stored.attempts(key)
        assert attempts, f"{case}: a dispatched key is missing from the ledger"
        operation = attempts[-1]
        states[key] = operation.state
        if key == keys[0] and operation.compensation is not None:
            compensation = operation.compensation.state
    return Outcome(
        case,
        keys,
        states,
        compensation,
        flow_error,
        time.perf_counter() - started,
        summary,
        env,
        stored,
    )


def host_arguments(env: CrashEnv, tag: str, steps: list[WorkflowStep], **more: Any) -> str:
    """The host runner's one line of arguments (``_host_main.py``): ``env``'s broker,
    scope and ledger, a new host id, ``steps`` with the retry policy's attempts."""
    arguments = {
        "url": env.url,
        "host_id": env.new_host_id(),
        "scope": env.scope,
        "scope_key_file": str(env.scope_key_file),
        "ledger": str(env.ledger_path),
        "storage_key": env.host_storage_key.hex(),
        "steps": [[s.id, s.source] for s in steps],
        "retry_attempts": RETRY_ATTEMPTS,
        "run": RUN_NAME,
        "tool": TOOL,
        "tag": tag,
        "concurrent": False,
    }
    return json.dumps(arguments | more)


async def _crash_host(launcher: Launcher, env: CrashEnv, case: Case, tag: str) -> list[str]:
    """The host process records, persists, and dies before one of its publishes."""
    host = await launcher.take("host", case.fault)
    host.send(host_arguments(env, tag, STEPS, concurrent=case.concurrent))
    keys_line = await host.read_line(20.0)
    assert keys_line.startswith("RECORDED "), (keys_line, host.stderr())
    keys = keys_line.split()[1:]
    returncode = await host.wait_exit(DEATH_TIMEOUT)
    assert returncode == -signal.SIGKILL, (returncode, host.stderr())
    assert f"SIGKILL at {case.point}" in host.stderr()
    return keys


# Checks ------------------------------------------------------------------------------------


async def read_ledger(env: CrashEnv, run_name: str = RUN_NAME) -> WorkflowOperationLedger:
    store = env.host_store()
    try:
        record = await store.load(ledger_record_key(run_name))
    finally:
        await store.close()
    assert record is not None
    return WorkflowOperationLedger.from_json(record.payload)


async def read_journal(env: CrashEnv, keys: list[str]) -> dict[str, WorkerOperationRecord | None]:
    store = configured_store(load_config(env.config_path), read_only=True)
    try:
        rows = await store.load_records(env.scope, keys)
    finally:
        await store.close()
    return {key: None if row is None else row[0] for key, row in rows.items()}


async def check_outcome(env: CrashEnv, outcome: Outcome, ledger: WorkflowOperationLedger) -> None:
    """The invariants after any crash (see the module docstring), per logical step:
    its attempts (the first key, then each retry that replaced a failed one)."""
    case, keys = outcome.case, outcome.keys
    errors = None if outcome.summary is None else outcome.summary.errors
    effects = read_effect_log(env.effect_log)
    publishes = Counter(e["operation_key"] for e in effects if e["effect"] == "publish")
    removals = Counter(e["operation_key"] for e in effects if e["effect"] == "remove")
    chains = {key: [op.operation_key for op in ledger.attempts(key)] for key in keys}
    every = [attempt for chain in chains.values() for attempt in chain]
    # Every operation of the ledger is an attempt of one of the run's steps.
    assert sorted(every) == sorted(op.operation_key for op in ledger.operations), case
    assert set(publishes) <= set(every) and set(removals) <= set(every), case
    journal = await read_journal(env, every)
    for index, key in enumerate(keys):
        chain = chains[key]
        final = ledger.operation(chain[-1])
        assert final is not None
        # Exactly once: every step ends succeeded (the adapter refuses none of these
        # inputs), with one publication over all its attempts.
        assert final.state == StateKind.SUCCEEDED, (case, index, final.state, final.failure, errors)
        assert len(chain) <= RETRY_ATTEMPTS, (case, index, chain)
        assert sum(publishes[attempt] for attempt in chain) == 1, (case, index, "effects")
        for attempt_key in chain[:-1]:
            # Only an attempt proven not to have happened is ever replaced.
            replaced = ledger.operation(attempt_key)
            assert replaced is not None and replaced.state == StateKind.FAILED, (case, index)
            assert replaced.failure == FailureCode.NOT_HAPPENED, (case, index, replaced.failure)
        for attempt_key in chain:
            operation = ledger.operation(attempt_key)
            assert operation is not None
            state = operation.state
            # Known and settled: recover leaves no operation pending or running
            # (files.publish looks an effect up by its key).
            assert state in TERMINAL_KINDS, (case, index, state, errors)
            assert publishes[attempt_key] <= 1, (case, index, "published twice")
            # Exactly one effect line per succeeded key, however the host learned
            # it: a publication cut off between its link and its log line is
            # finished (line written once) by the repeated dispatch or by the
            # reconciliation that reports it.
            assert publishes[attempt_key] == (1 if state == StateKind.SUCCEEDED else 0), (
                case,
                index,
                state,
                publishes[attempt_key],
                _adapter_record(env, attempt_key),
                (env.published / f"file-{index}.txt").exists(),
            )
            record = journal[attempt_key]
            assert record is not None, (case, index, "ledger settled a key the journal lacks")
            assert record.state.kind == state, (case, index, record.state.kind, state)
            compensation = operation.compensation
            assert removals[attempt_key] <= 1, (case, index, "compensated twice")
            if compensation is None:
                assert removals[attempt_key] == 0, (case, index)
                assert record.compensation is None, (case, index)
                continue
            # Compensation applies to the succeeded attempt only.
            assert attempt_key == chain[-1], (case, index, "compensated a replaced attempt")
            # Every compensation ends known, none is left pending: files.publish
            # looks a removal up by its compensation key and recover asks it.
            # A worker never re-runs an admitted compensation, so one a
            # crash cut short is settled by that lookup, whether its removal ran
            # (after_effect: its missing log line written once) or not
            # (after_admission_commit, after_ack: refused for good); one the worker
            # never admitted is sent again.
            assert compensation.state in TERMINAL_KINDS, (case, index, compensation.state)
            done = compensation.state == StateKind.SUCCEEDED
            assert removals[attempt_key] == (1 if done else 0), (case, index, compensation.state)
            assert record.compensation is not None, (case, index)
            assert record.compensation.compensation_key == compensation.compensation_key
            assert record.compensation.state.kind == compensation.state, (case, index)
    # The run ends known: the first step's inverse was recorded on its succeeded attempt.
    first = ledger.operation(chains[keys[0]][-1])
    assert first is not None
    if first.state == StateKind.SUCCEEDED:
        assert first.compensation is not None, (case, "the compensation was never recorded")
    for index, key in enumerate(keys):
        exists = (env.published / f"file-{index}.txt").exists()
        kept = ledger.operation(chains[key][-1])
        assert kept is not None
        removed = removals[kept.operation_key] == 1
        assert exists == (kept.state == StateKind.SUCCEEDED and not removed), (case, index)


def _adapter_record(env: CrashEnv, key: str) -> str | None:
    """The files.publish adapter's own record state for ``key`` (diagnostics only)."""
    name = f"pub.{adapter_idempotency_key(env.scope, 'operation', key)}.json"
    try:
        document = json.loads((env.state_dir / "published" / ".octo-publish" / name).read_bytes())
    except FileNotFoundError:
        return None
    return str(document.get("state"))


async def queue_depth(name: str, url: str = URL) -> int:
    """Messages ready in queue ``name`` (a passive declare: it must exist)."""
    from octo_host.amqp import connect

    connection = await connect(url, timeout=3.0, name="octo-test-depth")
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, passive=True)
        count = queue.declaration_result.message_count
        return int(count or 0)
    finally:
        await connection.close()


async def delete_queues(env: CrashEnv) -> None:
    from octo_host.amqp import connect

    connection = await connect(env.url, timeout=3.0, name="octo-test-crash-cleanup")
    try:
        channel = await connection.channel()
        for name in env.queues():
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
    finally:
        await connection.close()


# Fixtures ------------------------------------------------------------------------------------


def broker_reachable() -> bool:
    import socket

    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", 5672), 1.0):
        return True
    return False


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    if not broker_reachable():
        pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    found = Launcher(tmp_path_factory.mktemp("runners"))
    yield found
    found.close()
