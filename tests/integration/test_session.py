"""WorkerSession scenarios.

Every scenario drives a real ``WorkerSession`` with frames sealed by a real
host-role authenticator, against the real ``SqliteJournalStore`` on a
tmp_path file, the real ``files.publish`` adapter (its effect log counts
effects) and small in-test adapters (adapters are plug-ins, so a test adapter
is a real part). The only stand-in is the broker delivery, recorded in
memory; faults are injected at the store boundary by a wrapper around the
real store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing

from octo_common.codec import decode_struct
from octo_common.errors import (
    AdapterFailed,
    AdapterIndeterminate,
    FencingTokenRejected,
    InvalidFrameHeaders,
    InvalidJournalLease,
    MissingAdapter,
    RequiresWorkerAuthenticator,
    SerializationError,
    SessionReplay,
    StorageBackendError,
    UnexpectedOpeningMessage,
    ZeroPerToolReconciliationLimit,
    ZeroSessionReconciliationLimit,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    Cancel,
    CloseSession,
    CompensateOperation,
    CompensationReconcileRequest,
    CompensationResult,
    DispatchOperation,
    Invoke,
    OpenSession,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationResult,
    ReconcileCompensation,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    Result,
    ToolInvocation,
    ToolResult,
    WorkerCancellationRequest,
    WorkerMessage,
)
from octo_common.payload import ToolPayload
from octo_common.peek import peek_operation_key
from octo_common.records import StorageKeyring
from octo_common.states import Failed, Pending, Running, StateKind, Succeeded
from octo_worker.adapters.contract import (
    AdapterContext,
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
    WorkerAdapterRegistry,
    adapter_deadline,
)
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.hooks import NO_HOOKS, WorkerHooks
from octo_worker.journal import WorkerOperationRecord
from octo_worker.session import WorkerSession, WorkerSessionLimits
from octo_worker.session import session as session_module
from octo_worker.storage import documents
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import SqliteJournalStore, WorkerCommit, WorkerJournalLease

from .journal_backends import JournalDatabase

SCOPE = "tenant-release"
SESSION = "session-1"
REPLY_TO = "octo.v5.reply.host-1"
SCOPE_KEY = bytes(range(1, 33))
NONCE = bytes(range(100, 132))
PUBLISH = "files.publish"
SCRIPTED = "test.op"
BARE = "test.bare"
MISDECLARED = "test.misdeclared"
STORAGE_KEY = bytes([7]) * 32


# Parts ------------------------------------------------------------------------


class RecordingDelivery:
    """The broker delivery as ``handle`` sees it: records every call in order."""

    def __init__(self, *, fail_reply: bool = False) -> None:
        self.events: list[tuple[str, str | None]] = []
        self.frames: list[bytes] = []
        self.fail_reply = fail_reply
        self.opened: list[WorkerMessage] | None = None

    async def ack(self) -> None:
        self.events.append(("ack", None))

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        if self.fail_reply:
            self.events.append(("reply_failed", correlation_id))
            raise ConnectionError("publish not confirmed")
        self.frames.append(frame)
        self.events.append(("reply", correlation_id))

    async def dead_letter(self, reason: str) -> None:
        self.events.append(("dead_letter", reason))

    async def requeue(self) -> None:
        self.events.append(("requeue", None))

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]


class FaultyStore:
    """The real store behind a fault-injecting boundary (commit and fence faults).

    ``fail_commits`` holds 1-based commit numbers that raise
    ``StorageBackendError`` instead of committing; ``fence_commits`` raise
    ``FencingTokenRejected`` (another worker's fence); ``stale_commits`` commit
    for real but report a non-advancing revision; ``fail_loads`` makes
    ``load_records`` fail.
    """

    def __init__(self, inner: JournalStoreBase) -> None:
        self.inner = inner
        self.commits: list[WorkerCommit] = []
        self.fail_commits: set[int] = set()
        self.fence_commits: set[int] = set()
        self.stale_commits: set[int] = set()
        self.fail_loads = False

    async def load_records(
        self, scope: str, keys: list[str]
    ) -> dict[str, tuple[WorkerOperationRecord, int] | None]:
        if self.fail_loads:
            raise StorageBackendError("injected load failure")
        return await self.inner.load_records(scope, keys)

    async def head_revision(self, scope: str) -> int:
        return await self.inner.head_revision(scope)

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int:
        self.commits.append(changes)
        number = len(self.commits)
        if number in self.fail_commits:
            raise StorageBackendError("injected commit failure")
        if number in self.fence_commits:
            raise FencingTokenRejected(lease.token + 1, lease.token)
        revision = await self.inner.commit(scope, lease, changes)
        if number in self.stale_commits:
            return 1
        return revision


@dataclass
class ScriptedAdapter(BaseWorkerAdapter):
    """An in-test plug-in whose outcomes each test chooses."""

    safety: InvocationSafety | None = InvocationSafety.READ_ONLY
    contract: DurableOperationContract | None = DurableOperationContract.RECONCILIATION
    dispatch_outcome: Any = field(default_factory=lambda: Succeeded(ToolPayload.json({"ok": 1})))
    compensate_outcome: Any = field(
        default_factory=lambda: Succeeded(ToolPayload.json({"undone": 1}))
    )
    reconcile_outcome: Any = field(default_factory=Running)
    # What the lookup of a compensation by its key observes.
    lookup_outcome: Any = field(default_factory=Running)
    invoke_outcome: Any = field(default_factory=lambda: ToolPayload.json({"sum": 3}))
    gate: asyncio.Event | None = None
    calls: list[str] = field(default_factory=list)
    contexts: list[AdapterContext] = field(default_factory=list)
    observer: Callable[[], None] | None = None

    def invocation_safety(self) -> InvocationSafety | None:
        return self.safety

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return self.contract

    async def _outcome(self, name: str, outcome: Any, context: AdapterContext) -> Any:
        self.calls.append(name)
        self.contexts.append(context)
        if self.observer is not None:
            self.observer()
        if self.gate is not None:
            await self.gate.wait()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def invoke(self, request: Any, grant: Any, context: AdapterContext) -> Any:
        return await self._outcome("invoke", self.invoke_outcome, context)

    async def dispatch_operation(self, request: Any, grant: Any, context: AdapterContext) -> Any:
        return await self._outcome("dispatch", self.dispatch_outcome, context)

    async def compensate_operation(self, request: Any, grant: Any, context: AdapterContext) -> Any:
        return await self._outcome("compensate", self.compensate_outcome, context)

    async def reconcile_operation(self, request: Any, grant: Any, context: AdapterContext) -> Any:
        return await self._outcome("reconcile", self.reconcile_outcome, context)

    async def reconcile_compensation(
        self, request: Any, grant: Any, context: AdapterContext
    ) -> Any:
        return await self._outcome("lookup", self.lookup_outcome, context)


class ConfigurableRegistry(WorkerAdapterRegistry):
    """A registry whose configuration can drop a tool after the session opened."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: set[str] = set()

    def get(self, tool: str) -> Any:
        return None if tool in self.hidden else super().get(tool)


def publish_grant(**limits: int) -> CapabilityGrant:
    base = {"max_calls": 8, "max_input_bytes": 1024, "max_output_bytes": 1024}
    base.update(limits)
    return CapabilityGrant(PUBLISH, "json", **base)  # type: ignore[arg-type]


def scripted_grant(**limits: int) -> CapabilityGrant:
    base = {"max_calls": 8, "max_input_bytes": 128, "max_output_bytes": 128}
    base.update(limits)
    return CapabilityGrant(SCRIPTED, "json", **base)  # type: ignore[arg-type]


def session_key(session_id: str = SESSION, nonce: bytes = NONCE) -> SessionKey:
    return SessionKey.derive(ScopeKey.from_bytes(SCOPE_KEY), SCOPE, session_id, nonce)


def new_store(path: Path) -> SqliteJournalStore:
    return SqliteJournalStore(path, StorageKeyring("k1", STORAGE_KEY))


@dataclass
class World:
    """One opened session with its host peer, store, adapters and effect log."""

    tmp_path: Path
    real_store: JournalStoreBase
    store: FaultyStore
    lease: WorkerJournalLease
    adapters: ConfigurableRegistry
    files: FilesPublishAdapter
    scripted: ScriptedAdapter
    host: SessionAuthenticator
    session: WorkerSession
    opening_frame: bytes
    counter: int = 0
    # The journal database of a world opened on one (``journal_db``); else its file.
    database: JournalDatabase | None = None

    def new_store(self) -> JournalStoreBase:
        """Another store object on this world's journal (a restart, a reload)."""
        if self.database is None:
            return new_store(self.tmp_path / "journal.db")
        return self.database.store(StorageKeyring("k1", STORAGE_KEY))

    def next_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    async def deliver(self, frame: bytes, delivery: RecordingDelivery | None = None) -> Delivery:
        delivery = delivery or RecordingDelivery()
        await self.session.handle(frame, self.store, delivery)
        return delivery

    async def send(self, message: WorkerMessage) -> Delivery:
        return await self.deliver(self.host.seal(message))

    def answers(self, delivery: RecordingDelivery) -> list[WorkerMessage]:
        # The host opens each reply once (a second open is a DuplicateFrame).
        if delivery.opened is None:
            delivery.opened = [self.host.open(frame) for frame in delivery.frames]
        return delivery.opened

    def answer(self, delivery: RecordingDelivery) -> WorkerMessage:
        answers = self.answers(delivery)
        assert len(answers) == 1, delivery.events
        return answers[0]

    def effects(self) -> list[dict[str, Any]]:
        return read_effect_log(self.files.effect_log)

    async def record(self, key: str) -> WorkerOperationRecord | None:
        loaded = await self.real_store.load_records(SCOPE, [key])
        entry = loaded[key]
        return None if entry is None else entry[0]

    # Frame builders ---------------------------------------------------------

    def dispatch(
        self,
        key: str,
        payload: ToolPayload,
        *,
        tool: str = PUBLISH,
        request_id: str | None = None,
    ) -> DispatchOperation:
        return DispatchOperation(
            OperationDispatchRequest(
                SESSION, request_id or self.next_id("dispatch"), tool, key, payload
            )
        )

    def reconcile(self, key: str, *, tool: str = PUBLISH) -> ReconcileOperation:
        return ReconcileOperation(
            OperationReconcileRequest(SESSION, self.next_id("reconcile"), tool, key)
        )

    def compensate(
        self,
        key: str,
        compensation_key: str,
        payload: ToolPayload,
        grant: CapabilityGrant,
        *,
        tenant: str = SCOPE,
        tool: str = PUBLISH,
    ) -> CompensateOperation:
        binding = OperationCompensationBinding(
            tool, key, compensation_key, tenant, grant.compensation_fingerprint()
        )
        return CompensateOperation(
            OperationCompensationRequest(SESSION, self.next_id("compensate"), binding, payload)
        )

    def reconcile_compensation(
        self,
        key: str,
        compensation_key: str,
        grant: CapabilityGrant,
        *,
        tenant: str = SCOPE,
        tool: str = PUBLISH,
    ) -> ReconcileCompensation:
        return ReconcileCompensation(
            CompensationReconcileRequest(
                SESSION,
                self.next_id("lookup"),
                tool,
                key,
                compensation_key,
                tenant,
                grant.compensation_fingerprint(),
            )
        )

    def invoke(self, payload: ToolPayload, *, tool: str = SCRIPTED) -> Invoke:
        return Invoke(ToolInvocation(SESSION, self.next_id("invoke"), tool, payload))


Delivery = RecordingDelivery


async def open_world(
    tmp_path: Path,
    grants: list[CapabilityGrant] | None = None,
    *,
    limits: WorkerSessionLimits | None = None,
    scripted: ScriptedAdapter | None = None,
    store_path: Path | None = None,
    extra: dict[str, Any] | None = None,
    database: JournalDatabase | None = None,
    hooks: WorkerHooks = NO_HOOKS,
) -> World:
    real_store: JournalStoreBase = (
        new_store(store_path or tmp_path / "journal.db")
        if database is None
        else database.store(StorageKeyring("k1", STORAGE_KEY))
    )
    store = FaultyStore(real_store)
    lease = await real_store.reserve_fence(SCOPE)
    files = FilesPublishAdapter(tmp_path / "published", tmp_path / "effects.log")
    scripted = scripted or ScriptedAdapter()
    adapters = ConfigurableRegistry()
    adapters.register(PUBLISH, files)
    adapters.register(SCRIPTED, scripted)
    adapters.register(BARE, BaseWorkerAdapter())
    for tool, extra_adapter in (extra or {}).items():
        adapters.register(tool, extra_adapter)
    key = session_key()
    host = SessionAuthenticator(SESSION, key, SessionRole.HOST)
    worker = SessionAuthenticator(SESSION, key, SessionRole.WORKER)
    manifest = CapabilityManifest(SESSION, grants or [publish_grant(), scripted_grant()])
    opening_frame = host.seal(OpenSession(manifest, reply_to=REPLY_TO))
    session = await WorkerSession.open(
        worker,
        opening_frame,
        scope=SCOPE,
        key_nonce=NONCE,
        reply_to=REPLY_TO,
        store=store,
        lease=lease,
        adapters=adapters,
        limits=limits or WorkerSessionLimits(),
        hooks=hooks,
    )
    return World(
        tmp_path,
        real_store,
        store,
        lease,
        adapters,
        files,
        scripted,
        host,
        session,
        opening_frame,
        database=database,
    )


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = await open_world(tmp_path)
    yield w
    w.files.close()
    await w.real_store.close()


def publish_payload(name: str = "release.txt", content: str = "v1") -> ToolPayload:
    return ToolPayload.json({"name": name, "content": content})


def rejection_code(message: WorkerMessage) -> str:
    assert isinstance(message, RequestRejected), message
    return message.code


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def commits_since(world: World, start: int) -> list[WorkerCommit]:
    return world.store.commits[start:]


# Limits -------------------------------------------------------------------------


def test_limits_default_and_zero_checks() -> None:
    assert WorkerSessionLimits() == WorkerSessionLimits(16, 64)
    with pytest.raises(ZeroPerToolReconciliationLimit):
        WorkerSessionLimits(per_tool=0, per_session=0)  # per-tool is checked first
    with pytest.raises(ZeroSessionReconciliationLimit):
        WorkerSessionLimits(per_tool=1, per_session=0)


# Opening ---------------------------------------------------------------


async def test_open_commits_both_documents_once_and_never_a_key(tmp_path: Path) -> None:
    w = await open_world(tmp_path)
    try:
        assert len(w.store.commits) == 1
        sessions = await w.real_store.load_sessions(SCOPE)
        persisted = sessions[SESSION]
        assert persisted.status == "open"
        key = session_key().expose()
        for document in (persisted.opening, persisted.state):
            assert key.hex().encode() not in document
            assert key not in document
            assert SCOPE_KEY.hex().encode() not in document
        assert NONCE.hex().encode() in persisted.opening
        assert REPLY_TO.encode() in persisted.opening
        assert w.session.status == "open"
        assert w.session.reply_to == REPLY_TO
    finally:
        w.files.close()
        await w.real_store.close()


async def test_open_refusals_in_step_order(tmp_path: Path) -> None:
    store = new_store(tmp_path / "journal.db")
    lease = await store.reserve_fence(SCOPE)
    adapters = WorkerAdapterRegistry()
    adapters.register(SCRIPTED, ScriptedAdapter())
    key = session_key()
    host = SessionAuthenticator(SESSION, key, SessionRole.HOST)
    manifest = CapabilityManifest(SESSION, [scripted_grant()])
    frame = host.seal(OpenSession(manifest, reply_to=REPLY_TO))

    async def attempt(authenticator: SessionAuthenticator, data: bytes, **kw: Any) -> None:
        args: dict[str, Any] = {
            "scope": SCOPE,
            "key_nonce": NONCE,
            "reply_to": REPLY_TO,
            "store": store,
            "lease": lease,
            "adapters": adapters,
            "limits": WorkerSessionLimits(),
        }
        args.update(kw)
        await WorkerSession.open(authenticator, data, **args)

    with pytest.raises(RequiresWorkerAuthenticator):
        await attempt(SessionAuthenticator(SESSION, key, SessionRole.HOST), frame)
    with pytest.raises(UnexpectedOpeningMessage):
        await attempt(
            SessionAuthenticator(SESSION, key, SessionRole.WORKER),
            host.seal(CloseSession(SESSION)),
        )
    missing = CapabilityManifest(SESSION, [scripted_grant(), publish_grant()])
    with pytest.raises(MissingAdapter) as excinfo:
        await attempt(
            SessionAuthenticator(SESSION, key, SessionRole.WORKER),
            host.seal(OpenSession(missing, reply_to=REPLY_TO)),
        )
    assert excinfo.value.tool == PUBLISH
    with pytest.raises(InvalidJournalLease):
        await attempt(SessionAuthenticator(SESSION, key, SessionRole.WORKER), frame, lease=1)
    with pytest.raises(InvalidFrameHeaders):
        await attempt(SessionAuthenticator(SESSION, key, SessionRole.WORKER), frame, reply_to="")
    assert await store.load_sessions(SCOPE) == {}

    await attempt(SessionAuthenticator(SESSION, key, SessionRole.WORKER), frame)
    # Example 24: an open_session with a fresh nonce for an id the scope has.
    fresh = bytes(32 * [9])
    fresh_key = session_key(nonce=fresh)
    fresh_host = SessionAuthenticator(SESSION, fresh_key, SessionRole.HOST)
    with pytest.raises(SessionReplay):
        await attempt(
            SessionAuthenticator(SESSION, fresh_key, SessionRole.WORKER),
            fresh_host.seal(OpenSession(manifest, reply_to=REPLY_TO)),
            key_nonce=fresh,
        )
    assert list(await store.load_sessions(SCOPE)) == [SESSION]
    await store.close()


# Dispatch -----------------------------------


async def test_example_14_dispatch_runs_once_then_existing(world: World) -> None:
    start = len(world.store.commits)
    first = await world.send(world.dispatch("op-release-42", publish_payload()))
    answer = world.answer(first)
    assert isinstance(answer, OperationResult)
    assert answer.result.request_id == "dispatch-1"
    assert isinstance(answer.result.status, Succeeded)
    # Admission commit (pending row), then observation commit (row + reply).
    admission, observation = commits_since(world, start)
    assert admission.journal is not None
    assert isinstance(admission.journal.rows["op-release-42"].record.state, Pending)
    assert admission.outbox_insert == []
    assert observation.journal is not None
    assert isinstance(observation.journal.rows["op-release-42"].record.state, Succeeded)
    assert len(observation.outbox_insert) == 1
    assert first.events == [("ack", None), ("reply", "dispatch-1")]
    assert len(world.effects()) == 1

    start = len(world.store.commits)
    again = await world.send(world.dispatch("op-release-42", publish_payload()))
    answer = world.answer(again)
    assert isinstance(answer, OperationResult)
    assert answer.result.request_id == "dispatch-2"
    assert isinstance(answer.result.status, Succeeded)
    (respond,) = commits_since(world, start)
    assert respond.journal is None  # no journal change
    assert again.events == [("reply", "dispatch-2"), ("ack", None)]
    assert len(world.effects()) == 1
    assert world.session.calls_for(PUBLISH) == 2
    record = await world.record("op-release-42")
    assert record is not None and isinstance(record.state, Succeeded)


async def test_dispatch_acks_after_admission_commit_before_adapter(world: World) -> None:
    delivery = RecordingDelivery()
    seen: list[tuple[list[str], int]] = []
    world.scripted.observer = lambda: seen.append((list(delivery.kinds), len(world.store.commits)))
    before = len(world.store.commits)
    await world.deliver(
        world.host.seal(world.dispatch("op-1", ToolPayload.json({"a": 1}), tool=SCRIPTED)),
        delivery,
    )
    assert seen == [(["ack"], before + 1)]
    assert delivery.kinds == ["ack", "reply"]


async def test_redelivered_frame_is_answered_from_the_journal(world: World) -> None:
    frame = world.host.seal(world.dispatch("op-7", publish_payload("seven.txt")))
    await world.deliver(frame)
    calls = world.session.calls_for(PUBLISH)
    start = len(world.store.commits)
    redelivered = await world.deliver(frame)
    answer = world.answer(redelivered)
    assert isinstance(answer, OperationResult)
    assert answer.result.request_id == "dispatch-1"  # the duplicate's own request id
    assert isinstance(answer.result.status, Succeeded)
    assert world.session.calls_for(PUBLISH) == calls  # no budget
    assert len(world.effects()) == 1  # no adapter
    (commit,) = commits_since(world, start)  # session state + outbox only
    assert commit.journal is None and len(commit.outbox_insert) == 1
    assert redelivered.kinds == ["reply", "ack"]


async def test_duplicate_of_a_refused_dispatch_is_refused_from_the_journal(world: World) -> None:
    too_big = ToolPayload.json({"x": "y" * 200})
    frame = world.host.seal(world.dispatch("op-never", too_big, tool=SCRIPTED))
    first = await world.deliver(frame)
    assert rejection_code(world.answer(first)) == "input_too_large"
    duplicate = await world.deliver(frame)
    assert rejection_code(world.answer(duplicate)) == "unknown_operation"
    assert world.session.calls_for(SCRIPTED) == 0
    assert world.scripted.calls == []


async def test_duplicate_reconcile_and_compensate_answer_the_stored_state(tmp_path: Path) -> None:
    grant = scripted_grant(max_compensations=1)
    w = await open_world(tmp_path, [publish_grant(), grant])
    try:
        await w.send(w.dispatch("op-d", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        w.scripted.reconcile_outcome = Succeeded(ToolPayload.json({"ok": 1}))
        reconcile = w.host.seal(w.reconcile("op-d", tool=SCRIPTED))
        await w.deliver(reconcile)
        again = await w.deliver(reconcile)
        answer = w.answer(again)
        assert isinstance(answer, ReconciledOperation)
        assert answer.result.status == Succeeded(ToolPayload.json({"ok": 1}))
        assert w.session.reconciliations() == (1, {SCRIPTED: 1})

        undo = ToolPayload.json({"undo": 1})
        compensate = w.host.seal(w.compensate("op-d", "cmp-d", undo, grant, tool=SCRIPTED))
        await w.deliver(compensate)
        start = len(w.store.commits)
        duplicate = await w.deliver(compensate)
        answer2 = w.answer(duplicate)
        assert isinstance(answer2, CompensationResult)
        assert answer2.result.status == Succeeded(ToolPayload.json({"undone": 1}))
        (commit,) = commits_since(w, start)
        assert commit.journal is None
        assert w.scripted.calls == ["dispatch", "reconcile", "compensate"]
        assert w.session.compensations_for(SCRIPTED) == 1
    finally:
        w.files.close()
        await w.real_store.close()


async def test_every_adapter_call_gets_its_scope_session_key_and_deadline(tmp_path: Path) -> None:
    # The context names the scope whose journal admitted the request, the
    # session, the scope-qualified idempotency key of the call's kind, and the
    # event-loop time at which the call is cut (the scripted tool's deadline).
    grant = scripted_grant(max_compensations=1)
    w = await open_world(tmp_path, [publish_grant(), grant])
    try:
        loop = asyncio.get_running_loop()
        deadline = adapter_deadline(w.scripted)
        started = loop.time()
        await w.send(w.invoke(ToolPayload.json({"a": 1})))
        await w.send(w.dispatch("op-d", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        await w.send(w.reconcile("op-d", tool=SCRIPTED))
        undo = ToolPayload.json({"undo": 1})
        await w.send(w.compensate("op-d", "cmp-d", undo, grant, tool=SCRIPTED))
        await w.send(w.reconcile_compensation("op-d", "cmp-d", grant, tool=SCRIPTED))
        finished = loop.time()

        assert w.scripted.calls == ["invoke", "dispatch", "reconcile", "compensate", "lookup"]
        invoke, dispatch, reconcile, compensate, lookup = w.scripted.contexts
        assert invoke == AdapterContext.for_invoke(SCOPE, SESSION, "invoke-1", invoke.deadline)
        assert dispatch == AdapterContext.for_operation(SCOPE, SESSION, "op-d", dispatch.deadline)
        assert reconcile.idempotency_key == dispatch.idempotency_key
        assert compensate == AdapterContext.for_compensation(
            SCOPE, SESSION, "cmp-d", compensate.deadline
        )
        # The lookup of the compensation names it by the compensation's key.
        assert lookup.idempotency_key == compensate.idempotency_key
        assert (lookup.scope, lookup.session_id) == (SCOPE, SESSION)
        for context in w.scripted.contexts:
            assert started + deadline <= context.deadline <= finished + deadline
    finally:
        w.files.close()
        await w.real_store.close()


async def test_logs_never_carry_payloads_or_failure_text(world: World) -> None:
    world.scripted.dispatch_outcome = Failed("hidden-failure-text")
    with structlog.testing.capture_logs() as logs:
        await world.send(world.dispatch("op-log", publish_payload("log.txt", "secret-content")))
        await world.send(
            world.dispatch("op-log2", ToolPayload.json({"secret": "inner-secret"}), tool=SCRIPTED)
        )
        world.scripted.dispatch_outcome = AdapterFailed("adapter-private-text")
        await world.send(world.dispatch("op-log3", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    text = repr(logs)
    assert "op-log" in text  # ids are logged
    for secret in ("secret-content", "inner-secret", "hidden-failure-text", "adapter-private"):
        assert secret not in text
    assert session_key().expose().hex() not in text


async def test_example_17_indeterminate_then_pending_operation(world: World) -> None:
    world.scripted.dispatch_outcome = AdapterIndeterminate("timeout")
    first = await world.send(world.dispatch("op-9", ToolPayload.json({"x": 1}), tool=SCRIPTED))
    assert rejection_code(world.answer(first)) == "indeterminate_operation"
    rejected = world.answer(first)
    assert isinstance(rejected, RequestRejected) and rejected.operation_key == "op-9"
    record = await world.record("op-9")
    assert record is not None and isinstance(record.state, Pending)
    assert world.session.status == "open"

    world.scripted.dispatch_outcome = AdapterFailed("boom")
    second = await world.send(world.dispatch("op-10", ToolPayload.json({"x": 1}), tool=SCRIPTED))
    assert rejection_code(world.answer(second)) == "adapter_error"
    assert world.session.status == "open"

    replay = await world.send(world.dispatch("op-9", ToolPayload.json({"x": 1}), tool=SCRIPTED))
    assert rejection_code(world.answer(replay)) == "pending_operation"
    assert world.scripted.calls == ["dispatch", "dispatch"]
    assert world.session.calls_for(SCRIPTED) == 3  # the replay spent a call again
    assert replay.kinds == ["reply", "ack"]


class ScrapedAtReply(RecordingDelivery):
    """Reads the scope's oldest-unresolved gauge as each reply is published: what a
    scrape shows once the host can see the answer."""

    def __init__(self, metrics: WorkerMetrics, *, fail_reply: bool = False) -> None:
        super().__init__(fail_reply=fail_reply)
        self.metrics = metrics
        self.ages: list[float] = []

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        self.ages.append(self.metrics.oldest_pending_age_of(SCOPE))
        await super().reply(frame, correlation_id)


async def test_a_key_answered_terminal_is_off_the_unresolved_gauge_before_its_reply_leaves(
    tmp_path: Path,
) -> None:
    metrics = WorkerMetrics()
    w = await open_world(tmp_path, hooks=metrics)
    try:
        for key, confirmed in (("op-seen", True), ("op-unconfirmed", False)):
            w.scripted.dispatch_outcome = AdapterIndeterminate("lost")
            lost = await w.send(w.dispatch(key, ToolPayload.json({"x": 1}), tool=SCRIPTED))
            assert rejection_code(w.answer(lost)) == "indeterminate_operation"
            assert metrics.oldest_pending_age_of(SCOPE) > 0

            w.scripted.reconcile_outcome = Running()
            still = ScrapedAtReply(metrics)
            await w.deliver(w.host.seal(w.reconcile(key, tool=SCRIPTED)), still)
            assert still.kinds == ["reply", "ack"] and still.ages[0] > 0

            w.scripted.reconcile_outcome = Failed("never published")
            settled = ScrapedAtReply(metrics, fail_reply=not confirmed)
            await w.deliver(w.host.seal(w.reconcile(key, tool=SCRIPTED)), settled)
            record = await w.record(key)
            assert record is not None and isinstance(record.state, Failed)
            # The journal holds the key terminal: the gauge says so before the reply
            # is published (the host cannot see the answer while the key still
            # counts), and whether or not the broker confirms it, as a restart would.
            expected = ["reply", "ack"] if confirmed else ["reply_failed", "requeue"]
            assert settled.kinds == expected
            assert settled.ages == [0.0]
            assert metrics.oldest_pending_age_of(SCOPE) == 0.0
    finally:
        w.files.close()
        await w.real_store.close()


async def test_pending_duplicate_frame_answers_pending_operation(world: World) -> None:
    world.scripted.dispatch_outcome = AdapterIndeterminate("lost")
    frame = world.host.seal(world.dispatch("op-11", ToolPayload.json({"x": 1}), tool=SCRIPTED))
    await world.deliver(frame)
    duplicate = await world.deliver(frame)
    assert rejection_code(world.answer(duplicate)) == "pending_operation"
    assert world.scripted.calls == ["dispatch"]


async def test_changed_input_or_tool_for_a_key_is_refused(world: World) -> None:
    await world.send(world.dispatch("op-id", publish_payload("id.txt")))
    changed_input = await world.send(world.dispatch("op-id", publish_payload("id.txt", "v2")))
    assert rejection_code(world.answer(changed_input)) == "operation_identity_mismatch"
    changed_tool = await world.send(
        world.dispatch("op-id", publish_payload("id.txt"), tool=SCRIPTED)
    )
    assert rejection_code(world.answer(changed_tool)) == "operation_identity_mismatch"
    assert len(world.effects()) == 1
    assert world.scripted.calls == []


class MisDeclared(BaseWorkerAdapter):
    """Declarations that are not the enums: an author's False, a bare string."""

    def __init__(self) -> None:
        self.calls = 0

    def invocation_safety(self) -> Any:
        return False  # meant as "not safe"

    def durable_operation_contract(self) -> Any:
        return "reconciliation"  # the value, not DurableOperationContract

    async def invoke(self, request: Any, grant: Any, context: Any) -> Any:
        self.calls += 1
        return ToolPayload.json({})

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.calls += 1
        return Succeeded(ToolPayload.json({}))


async def test_a_declaration_that_is_not_the_enum_is_no_declaration(tmp_path: Path) -> None:
    grants = [CapabilityGrant(MISDECLARED, "json", max_calls=4)]
    adapter = MisDeclared()
    w = await open_world(tmp_path, grants, extra={MISDECLARED: adapter})
    try:
        invoke = await w.send(w.invoke(ToolPayload.json({"a": 1}), tool=MISDECLARED))
        assert rejection_code(w.answer(invoke)) == "invocation_safety_not_declared"
        dispatch = await w.send(w.dispatch("op-mis", ToolPayload.json({"a": 1}), tool=MISDECLARED))
        assert rejection_code(w.answer(dispatch)) == "durable_operation_contract_not_declared"
        assert adapter.calls == 0
    finally:
        w.files.close()
        await w.real_store.close()


async def test_example_21_adapter_without_declarations(tmp_path: Path) -> None:
    grants = [CapabilityGrant(BARE, "json", max_calls=4)]
    w = await open_world(tmp_path, grants)
    try:
        invoke = await w.send(w.invoke(ToolPayload.json({"a": 1}), tool=BARE))
        assert rejection_code(w.answer(invoke)) == "invocation_safety_not_declared"
        dispatch = await w.send(w.dispatch("op-bare", ToolPayload.json({"a": 1}), tool=BARE))
        assert rejection_code(w.answer(dispatch)) == "durable_operation_contract_not_declared"
        assert await w.record("op-bare") is None
        assert w.session.calls_for(BARE) == 2  # both calls were spent
    finally:
        w.files.close()
        await w.real_store.close()


async def test_unregistered_adapter_is_refused_after_spending(tmp_path: Path) -> None:
    w = await open_world(tmp_path)
    try:
        # The registry loses the tool after open (a reload with another config).
        w.adapters.hidden.add(SCRIPTED)
        refused = await w.send(w.dispatch("op-m", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        assert rejection_code(w.answer(refused)) == "missing_adapter"
        assert w.session.calls_for(SCRIPTED) == 1
    finally:
        w.files.close()
        await w.real_store.close()


async def test_authorization_error_spends_nothing(world: World) -> None:
    too_big = ToolPayload.json({"x": "y" * 200})
    refused = await world.send(world.dispatch("op-big", too_big, tool=SCRIPTED))
    assert rejection_code(world.answer(refused)) == "input_too_large"
    assert world.session.calls_for(SCRIPTED) == 0
    assert await world.record("op-big") is None


async def test_observation_violating_the_grant_is_indeterminate_protocol(world: World) -> None:
    world.scripted.dispatch_outcome = Succeeded(ToolPayload.json({"big": "z" * 300}))
    refused = await world.send(world.dispatch("op-o", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    rejected = world.answer(refused)
    assert rejection_code(rejected) == "indeterminate_operation"
    record = await world.record("op-o")
    assert record is not None and isinstance(record.state, Pending)
    assert world.session.status == "open"


# Reconciliation --------------------------------------


async def test_example_18_reconciliation_budgets_and_revisions(tmp_path: Path) -> None:
    w = await open_world(tmp_path, limits=WorkerSessionLimits(per_tool=1, per_session=64))
    try:
        w.scripted.dispatch_outcome = AdapterIndeterminate("lost")
        await w.send(w.dispatch("op-r", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        unknown = await w.send(w.reconcile("op-unknown", tool=SCRIPTED))
        assert rejection_code(w.answer(unknown)) == "unknown_operation"
        assert w.session.reconciliations() == (0, {})

        head = await w.real_store.head_revision(SCOPE)
        first = await w.send(w.reconcile("op-r", tool=SCRIPTED))
        answer = w.answer(first)
        assert isinstance(answer, ReconciledOperation)
        assert isinstance(answer.result.status, Running)
        assert await w.real_store.head_revision(SCOPE) > head
        assert first.kinds == ["reply", "ack"]  # acked only after the publish

        second = await w.send(w.reconcile("op-r", tool=SCRIPTED))
        assert rejection_code(w.answer(second)) == "reconciliation_budget_exhausted"
        assert w.scripted.calls == ["dispatch", "reconcile"]
    finally:
        w.files.close()
        await w.real_store.close()


async def test_reconciling_running_twice_advances_the_revision_each_time(world: World) -> None:
    world.scripted.dispatch_outcome = Running()
    await world.send(world.dispatch("op-run", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    revisions = []
    for _ in range(2):
        start = len(world.store.commits)
        delivery = await world.send(world.reconcile("op-run", tool=SCRIPTED))
        assert isinstance(world.answer(delivery), ReconciledOperation)
        (commit,) = commits_since(world, start)
        assert commit.journal is not None and "op-run" in commit.journal.rows  # always included
        revisions.append(await world.real_store.head_revision(SCOPE))
    assert revisions[1] > revisions[0]
    assert world.session.reconciliations() == (2, {SCRIPTED: 2})


async def test_session_reconciliation_budget_is_checked_first(tmp_path: Path) -> None:
    w = await open_world(tmp_path, limits=WorkerSessionLimits(per_tool=2, per_session=1))
    try:
        w.scripted.dispatch_outcome = Running()
        await w.send(w.dispatch("op-s", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        await w.send(w.reconcile("op-s", tool=SCRIPTED))
        refused = await w.send(w.reconcile("op-s", tool=SCRIPTED))
        assert rejection_code(w.answer(refused)) == "reconciliation_session_budget_exhausted"
    finally:
        w.files.close()
        await w.real_store.close()


async def test_contradictory_terminal_refused_identical_terminal_idempotent(world: World) -> None:
    await world.send(world.dispatch("op-t", publish_payload("t.txt")))
    succeeded = await world.record("op-t")
    assert succeeded is not None and isinstance(succeeded.state, Succeeded)

    # files.publish reports the same success: identical terminal is accepted.
    same = await world.send(world.reconcile("op-t"))
    answer = world.answer(same)
    assert isinstance(answer, ReconciledOperation) and answer.result.status == succeeded.state

    world.scripted.dispatch_outcome = Succeeded(ToolPayload.json({"v": 1}))
    await world.send(world.dispatch("op-u", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    world.scripted.reconcile_outcome = Failed("gone")
    contradictory = await world.send(world.reconcile("op-u", tool=SCRIPTED))
    assert rejection_code(world.answer(contradictory)) == "invalid_worker_operation_transition"
    record = await world.record("op-u")
    assert record is not None and isinstance(record.state, Succeeded)
    assert world.session.status == "open"


async def test_reconcile_adapter_error_keeps_the_budget_spent(world: World) -> None:
    world.scripted.dispatch_outcome = Running()
    await world.send(world.dispatch("op-e", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    world.scripted.reconcile_outcome = AdapterIndeterminate("slow")
    refused = await world.send(world.reconcile("op-e", tool=SCRIPTED))
    assert rejection_code(world.answer(refused)) == "adapter_error"
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})


# Compensation -------------------------------------------


async def test_compensation_runs_once_only_after_success(tmp_path: Path) -> None:
    grant = publish_grant(max_compensations=3)
    w = await open_world(tmp_path, [grant, scripted_grant()])
    try:
        undo = ToolPayload.json({"undo": "publish", "name": "c.txt"})
        await w.send(w.dispatch("op-c", publish_payload("c.txt")))
        start = len(w.store.commits)
        first = await w.send(w.compensate("op-c", "cmp-op-c-undo", undo, grant))
        answer = w.answer(first)
        assert isinstance(answer, CompensationResult)
        assert isinstance(answer.result.status, Succeeded)
        assert answer.result.compensation_key == "cmp-op-c-undo"
        assert answer.result.grant_fingerprint == grant.compensation_fingerprint()
        assert len(commits_since(w, start)) == 2  # admission, observation
        assert [e["effect"] for e in w.effects()] == ["publish", "remove"]
        record = await w.record("op-c")
        assert record is not None and record.compensation is not None
        assert isinstance(record.compensation.state, Succeeded)

        # Same identity under a new request id: Existing, no second removal.
        again = await w.send(w.compensate("op-c", "cmp-op-c-undo", undo, grant))
        assert isinstance(w.answer(again), CompensationResult)
        # A second cmp- key for the original is refused by the journal.
        other = await w.send(w.compensate("op-c", "cmp-op-c-other", undo, grant))
        assert rejection_code(w.answer(other)) == "compensation_identity_mismatch"
        changed = ToolPayload.json({"undo": "publish", "name": "d.txt"})
        changed_input = await w.send(w.compensate("op-c", "cmp-op-c-undo", changed, grant))
        assert rejection_code(w.answer(changed_input)) == "compensation_identity_mismatch"
        assert len(w.effects()) == 2
        # Each identity went with the row of the request id that admitted it,
        # not into the state document; read back, the state is the same.
        persisted = (await w.real_store.load_sessions(SCOPE))[SESSION]
        assert b"cmp-op-c-undo" not in persisted.state
        stored = documents.read_session(persisted, SCOPE)
        state = w.session._state.authorizer.export_state()
        assert sorted(stored.admitted.values()) == list(state.compensation_identities)
        assert stored.authorizer == state
    finally:
        w.files.close()
        await w.real_store.close()


async def test_example_19_compensation_before_success_then_other_tenant(tmp_path: Path) -> None:
    grant = scripted_grant(max_compensations=1)
    w = await open_world(tmp_path, [publish_grant(), grant])
    try:
        w.scripted.dispatch_outcome = Running()
        await w.send(w.dispatch("op-p", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        undo = ToolPayload.json({"undo": 1})
        early = await w.send(w.compensate("op-p", "cmp-op-p", undo, grant, tool=SCRIPTED))
        assert rejection_code(w.answer(early)) == "compensation_requires_succeeded_operation"
        assert w.session.compensations_for(SCRIPTED) == 1  # budget spent
        other = await w.send(
            w.compensate("op-p", "cmp-op-p", undo, grant, tenant="tenant-other", tool=SCRIPTED)
        )
        assert rejection_code(w.answer(other)) == "compensation_budget_exhausted"
        assert w.scripted.calls == ["dispatch"]
    finally:
        w.files.close()
        await w.real_store.close()


async def test_changed_grant_fingerprint_or_scope_is_refused(tmp_path: Path) -> None:
    grant = scripted_grant(max_compensations=3)
    w = await open_world(tmp_path, [publish_grant(), grant])
    try:
        await w.send(w.dispatch("op-g", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        undo = ToolPayload.json({"undo": 1})
        stale = grant.with_compensation_limit(2)  # another fingerprint
        refused = await w.send(w.compensate("op-g", "cmp-g", undo, stale, tool=SCRIPTED))
        assert rejection_code(w.answer(refused)) == "compensation_grant_mismatch"
        scoped = await w.send(
            w.compensate("op-g", "cmp-g", undo, grant, tenant="tenant-other", tool=SCRIPTED)
        )
        assert rejection_code(w.answer(scoped)) == "operation_journal_scope_mismatch"
        assert w.scripted.calls == ["dispatch"]
    finally:
        w.files.close()
        await w.real_store.close()


async def test_compensation_indeterminate_then_pending_compensation(tmp_path: Path) -> None:
    grant = scripted_grant(max_compensations=1)
    w = await open_world(tmp_path, [publish_grant(), grant])
    try:
        await w.send(w.dispatch("op-q", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        w.scripted.compensate_outcome = AdapterIndeterminate("lost")
        undo = ToolPayload.json({"undo": 1})
        first = await w.send(w.compensate("op-q", "cmp-q", undo, grant, tool=SCRIPTED))
        rejected = w.answer(first)
        assert rejection_code(rejected) == "indeterminate_compensation"
        assert isinstance(rejected, RequestRejected)
        assert (rejected.operation_key, rejected.compensation_key) == ("op-q", "cmp-q")
        replay = await w.send(w.compensate("op-q", "cmp-q", undo, grant, tool=SCRIPTED))
        assert rejection_code(w.answer(replay)) == "pending_compensation"
        assert w.scripted.calls == ["dispatch", "compensate"]
    finally:
        w.files.close()
        await w.real_store.close()


# Invoke ---------------------------------------------------------------------


async def test_invoke_answers_result_after_a_session_commit(world: World) -> None:
    start = len(world.store.commits)
    delivery = await world.send(world.invoke(ToolPayload.json({"a": 1})))
    answer = world.answer(delivery)
    assert isinstance(answer, Result)
    assert answer.result == ToolResult(SESSION, "invoke-1", ToolPayload.json({"sum": 3}))
    session_only, respond = commits_since(world, start)
    assert session_only.journal is None and session_only.outbox_insert == []
    assert len(respond.outbox_insert) == 1
    assert delivery.kinds == ["ack", "reply"]


async def test_example_20_invoke_output_too_large(world: World) -> None:
    world.scripted.invoke_outcome = ToolPayload.json({"big": "x" * 300})
    delivery = await world.send(world.invoke(ToolPayload.json({"a": 1})))
    assert rejection_code(world.answer(delivery)) == "output_too_large"
    assert world.scripted.calls == ["invoke"]
    assert world.session.calls_for(SCRIPTED) == 1


async def test_duplicate_invoke_is_acked_and_dropped(world: World) -> None:
    frame = world.host.seal(world.invoke(ToolPayload.json({"a": 1})))
    await world.deliver(frame)
    start = len(world.store.commits)
    duplicate = await world.deliver(frame)
    assert duplicate.events == [("ack", None)]
    assert world.scripted.calls == ["invoke"]
    assert commits_since(world, start) == []


# Other message types ---------------------------------------------------


async def test_example_23_cancel_is_unsupported(world: World) -> None:
    request = WorkerCancellationRequest(SESSION, "cancel-1", "invoke-9", SCRIPTED)
    delivery = await world.send(Cancel(request))
    rejected = world.answer(delivery)
    assert isinstance(rejected, RequestRejected)
    assert (rejected.code, rejected.request_id) == ("unsupported_message", "cancel-1")
    assert delivery.events == [("reply", "cancel-1"), ("ack", None)]


async def test_example_24_close_then_every_frame_is_session_closed(world: World) -> None:
    start = len(world.store.commits)
    closed = await world.send(CloseSession(SESSION))
    assert closed.events == [("ack", None)]
    assert len(commits_since(world, start)) == 1
    assert world.session.status == "closed"
    persisted = (await world.real_store.load_sessions(SCOPE))[SESSION]
    assert persisted.status == "closed"

    start = len(world.store.commits)
    later = await world.send(world.dispatch("op-late", publish_payload()))
    assert later.events == [("dead_letter", "session_closed")]
    reopened = await world.deliver(world.opening_frame)
    assert reopened.events == [("dead_letter", "session_closed")]
    assert commits_since(world, start) == []
    assert world.effects() == []


async def test_example_24_opening_frames_in_an_open_session(world: World) -> None:
    redelivered = await world.deliver(world.opening_frame)
    assert redelivered.events == [("ack", None)]  # a duplicate: acked and dropped

    start = len(world.store.commits)
    manifest = CapabilityManifest(SESSION, [publish_grant()])
    replay = await world.send(OpenSession(manifest, reply_to=REPLY_TO))
    assert replay.events == [("dead_letter", "session_replay")]
    assert len(commits_since(world, start)) == 1  # the window bit is durable first


async def test_worker_to_host_message_is_unexpected(world: World) -> None:
    start = len(world.store.commits)
    delivery = await world.send(Result(ToolResult(SESSION, "r-1", ToolPayload.json({"a": 1}))))
    assert delivery.events == [("dead_letter", "unexpected_message")]
    assert len(commits_since(world, start)) == 1


async def test_unauthenticated_frame_is_dead_lettered_without_state_change(world: World) -> None:
    frame = world.host.seal(world.dispatch("op-x", publish_payload()))
    tampered = frame.replace(b"release.txt", b"releasf.txt")
    start = len(world.store.commits)
    delivery = await world.deliver(tampered)
    assert delivery.events == [("dead_letter", "invalid_authentication_tag")]
    assert commits_since(world, start) == []
    # The authentic frame is still accepted afterwards.
    accepted = await world.deliver(frame)
    assert isinstance(world.answer(accepted), OperationResult)


# Poisoning --------------------------------------------


async def test_example_15_admission_commit_fails(world: World) -> None:
    world.store.fail_commits = {len(world.store.commits) + 1}
    delivery = await world.send(world.dispatch("op-f", publish_payload("f.txt")))
    rejected = world.answer(delivery)
    assert rejection_code(rejected) == "journal_persistence_failed"
    assert delivery.kinds == ["reply", "ack"]  # acked after the confirmed publish
    assert await world.record("op-f") is None
    assert world.effects() == []
    assert world.session.status == "poisoned"
    assert world.session.calls_for(PUBLISH) == 0  # memory back at the durable point
    # The refusal was committed before its publish: its
    # sequence and the status poisoned are durable, no journal change with it.
    refusal = world.store.commits[-1]
    assert refusal.journal is None and len(refusal.outbox_insert) == 1
    assert (await world.real_store.load_sessions(SCOPE))[SESSION].status == "poisoned"


async def test_a_commit_refused_by_another_workers_fence_publishes_and_commits_nothing(
    world: World,
) -> None:
    # The admission commit meets another worker's fence. The session
    # is superseded: no refusal is committed or published (the new owner
    # answers), the delivery goes back to the broker, and it stays silent.
    start = len(world.store.commits)
    world.store.fence_commits = {start + 1}
    delivery = await world.send(world.dispatch("op-fenced", publish_payload("x.txt")))
    assert delivery.kinds == ["requeue"] and delivery.frames == []
    assert len(commits_since(world, start)) == 1  # the refused one, nothing after it
    assert world.session.status == "poisoned" and world.session.commit_failed
    assert await world.record("op-fenced") is None
    assert world.effects() == []
    # Every later frame of the session is given back unanswered as well.
    later = await world.send(world.dispatch("op-later", publish_payload("y.txt")))
    assert later.kinds == ["requeue"] and later.frames == []
    assert len(commits_since(world, start)) == 1


async def test_example_16_observation_commit_fails(world: World) -> None:
    world.store.fail_commits = {len(world.store.commits) + 2}
    delivery = await world.send(world.dispatch("op-g", publish_payload("g.txt")))
    rejected = world.answer(delivery)
    assert rejection_code(rejected) == "indeterminate_operation"
    assert delivery.kinds == ["ack", "reply"]
    assert len(world.effects()) == 1
    record = await world.record("op-g")
    assert record is not None and isinstance(record.state, Pending)
    assert world.session.status == "poisoned"

    start = len(world.store.commits)
    later = await world.send(world.dispatch("op-h", publish_payload("h.txt")))
    assert rejection_code(world.answer(later)) == "session_poisoned"
    duplicate = await world.deliver(world.host.seal(world.reconcile("op-g")))
    assert rejection_code(world.answer(duplicate)) == "session_poisoned"
    # Each refusal is committed before its publish, and nothing else is: no
    # journal change, the refusal in the outbox.
    refusals = commits_since(world, start)
    assert [(c.journal, len(c.outbox_insert)) for c in refusals] == [(None, 1), (None, 1)]
    assert len(world.effects()) == 1


async def test_non_advancing_revision_poisons(world: World) -> None:
    world.store.stale_commits = {len(world.store.commits) + 1}
    delivery = await world.send(world.invoke(ToolPayload.json({"a": 1})))
    assert world.session.status == "poisoned"
    assert world.scripted.calls == []
    # The stale commit did land: the refusal's commit, built on the state the
    # session believes durable, conflicts. The refusal is published all the
    # same, best-effort and uncommitted, then the delivery acked; the
    # scope's reload persists the session's counter past its sequence.
    assert delivery.kinds == ["reply", "ack"]
    assert rejection_code(world.answer(delivery)) == "invalid_journal_revision"
    assert world.store.commits[-1].outbox_insert != []


async def test_a_poisoning_refusal_whose_commit_fails_too_is_published_best_effort(
    world: World,
) -> None:
    first = len(world.store.commits) + 1
    world.store.fail_commits = {first, first + 1}  # the admission, then the refusal
    delivery = await world.send(world.dispatch("op-z", publish_payload("z.txt")))
    assert delivery.kinds == ["reply", "ack"]
    assert rejection_code(world.answer(delivery)) == "journal_persistence_failed"
    assert world.session.status == "poisoned"
    assert world.effects() == []
    # The session is not recorded poisoned yet: the daemon's reload does that.
    assert (await world.real_store.load_sessions(SCOPE))[SESSION].status == "open"


async def test_refusal_commit_failure_after_the_adapter_is_indeterminate(world: World) -> None:
    world.scripted.dispatch_outcome = AdapterFailed("boom")
    world.store.fail_commits = {len(world.store.commits) + 2}
    delivery = await world.send(world.dispatch("op-i", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    assert rejection_code(world.answer(delivery)) == "indeterminate_operation"
    assert world.scripted.calls == ["dispatch"]


async def test_reconcile_commit_failure_is_not_indeterminate(world: World) -> None:
    world.scripted.dispatch_outcome = Running()
    await world.send(world.dispatch("op-k", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    world.store.fail_commits = {len(world.store.commits) + 1}
    delivery = await world.send(world.reconcile("op-k", tool=SCRIPTED))
    assert rejection_code(world.answer(delivery)) == "journal_persistence_failed"
    assert world.session.reconciliations() == (0, {})  # restored


async def test_handler_in_flight_when_the_session_is_poisoned(world: World) -> None:
    gate = asyncio.Event()
    world.scripted.gate = gate
    in_flight = RecordingDelivery()
    frame = world.host.seal(world.dispatch("op-a", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    task = asyncio.create_task(world.session.handle(frame, world.store, in_flight))
    await wait_until(lambda: world.scripted.calls == ["dispatch"])
    world.store.fail_commits = {len(world.store.commits) + 1}
    poisoning = await world.send(world.dispatch("op-b", publish_payload("b.txt")))
    assert rejection_code(world.answer(poisoning)) == "journal_persistence_failed"
    commits = len(world.store.commits)
    gate.set()
    await task
    # The adapter ran once; its session records nothing more of it and says
    # so, in a refusal committed (sequence, status) before its publish.
    assert rejection_code(world.answer(in_flight)) == "session_poisoned"
    assert in_flight.kinds == ["ack", "reply"]
    (refusal,) = commits_since(world, commits)
    assert refusal.journal is None and len(refusal.outbox_insert) == 1
    record = await world.record("op-a")
    assert record is not None and isinstance(record.state, Pending)
    assert world.scripted.calls == ["dispatch"]


async def test_closing_a_poisoned_session_while_its_handler_runs_keeps_its_success(
    world: World,
) -> None:
    gate = asyncio.Event()
    world.scripted.gate = gate
    in_flight = RecordingDelivery()
    frame = world.host.seal(world.dispatch("op-a", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    task = asyncio.create_task(world.session.handle(frame, world.store, in_flight))
    await wait_until(lambda: world.scripted.calls == ["dispatch"])
    world.store.fail_commits = {len(world.store.commits) + 1}
    poisoning = await world.send(world.dispatch("op-b", publish_payload("b.txt")))
    assert rejection_code(world.answer(poisoning)) == "journal_persistence_failed"
    closing = await world.send(CloseSession(SESSION))
    assert closing.events == [("ack", None)]
    assert world.session.status == "closed"

    gate.set()
    await task

    # A closed session's running handlers finish and send their replies:
    # the success is recorded, and the reply is the recorded state.
    answer = world.answer(in_flight)
    assert isinstance(answer, OperationResult), answer
    assert answer.result.status == Succeeded(ToolPayload.json({"ok": 1}))
    record = await world.record("op-a")
    assert record is not None and record.state == answer.result.status
    assert in_flight.kinds == ["ack", "reply"]
    assert (await world.real_store.load_sessions(SCOPE))[SESSION].status == "closed"
    assert world.scripted.calls == ["dispatch"]


async def test_poison_refusal_publish_failure_requeues(world: World) -> None:
    world.store.fail_commits = {len(world.store.commits) + 1}
    delivery = RecordingDelivery(fail_reply=True)
    await world.deliver(world.host.seal(world.invoke(ToolPayload.json({"a": 1}))), delivery)
    assert delivery.kinds == ["reply_failed", "requeue"]
    assert world.session.status == "poisoned"


async def test_close_session_commit_failure_poisons_and_requeues(world: World) -> None:
    world.store.fail_commits = {len(world.store.commits) + 1}
    delivery = await world.send(CloseSession(SESSION))
    assert delivery.events == [("requeue", None)]
    assert world.session.status == "poisoned"
    # close_session still closes a poisoned session.
    closing = await world.send(CloseSession(SESSION))
    assert closing.events == [("ack", None)]
    assert str(world.session.status) == "closed"


# Load errors ---------------------------------------------------------


async def test_load_error_is_refused_without_poisoning(world: World) -> None:
    world.store.fail_loads = True
    delivery = await world.send(world.dispatch("op-l", publish_payload("l.txt")))
    assert rejection_code(world.answer(delivery)) == "storage_backend_error"
    assert world.session.status == "open"
    assert world.effects() == []
    world.store.fail_loads = False
    retried = await world.send(world.dispatch("op-l", publish_payload("l.txt")))
    assert isinstance(world.answer(retried), OperationResult)


# Concurrency ------------------------------------------------------------------


async def test_concurrent_deliveries_of_one_key_run_the_adapter_once(world: World) -> None:
    gate = asyncio.Event()
    world.scripted.gate = gate
    payload = ToolPayload.json({"a": 1})
    first = world.host.seal(world.dispatch("op-cc", payload, tool=SCRIPTED))
    second = world.host.seal(world.dispatch("op-cc", payload, tool=SCRIPTED))
    d1, d2, d3 = RecordingDelivery(), RecordingDelivery(), RecordingDelivery()
    tasks = [
        asyncio.create_task(world.session.handle(first, world.store, d1)),
        asyncio.create_task(world.session.handle(second, world.store, d2)),
        asyncio.create_task(world.session.handle(first, world.store, d3)),
    ]
    await wait_until(lambda: len(world.scripted.calls) >= 1)
    await asyncio.sleep(0.05)  # the other two are parked on the key lock
    assert world.scripted.calls == ["dispatch"]
    gate.set()
    await asyncio.gather(*tasks)
    assert world.scripted.calls == ["dispatch"]
    for delivery in (d1, d2, d3):
        answer = world.answer(delivery)
        assert isinstance(answer, OperationResult)
        assert isinstance(answer.result.status, Succeeded)
    assert session_module.KEY_LOCKS == {}


async def test_different_keys_run_concurrently(world: World) -> None:
    gate = asyncio.Event()
    world.scripted.gate = gate
    frames = [
        world.host.seal(world.dispatch(f"op-par-{i}", ToolPayload.json({"i": i}), tool=SCRIPTED))
        for i in range(3)
    ]
    deliveries = [RecordingDelivery() for _ in frames]
    tasks = [
        asyncio.create_task(world.session.handle(f, world.store, d))
        for f, d in zip(frames, deliveries, strict=True)
    ]
    await wait_until(lambda: len(world.scripted.calls) == 3)
    assert world.scripted.calls == ["dispatch"] * 3  # all three adapters in flight
    gate.set()
    await asyncio.gather(*tasks)
    assert all(isinstance(world.answer(d), OperationResult) for d in deliveries)


# Outbox and documents -------------------------------------------------------------------


async def test_confirmed_replies_are_deleted_inside_the_next_commit(world: World) -> None:
    first = await world.send(world.invoke(ToolPayload.json({"a": 1})))
    (reply_frame,) = first.frames
    outbox = await world.real_store.load_outbox(SCOPE)
    assert [entry.frame for entry in outbox] == [reply_frame]
    assert outbox[0].reply_to == REPLY_TO and outbox[0].correlation_id == "invoke-1"
    commits_before = len(world.store.commits)
    await world.send(world.invoke(ToolPayload.json({"a": 2})))
    next_commit = world.store.commits[commits_before]
    assert next_commit.outbox_delete == [outbox[0].message_id]
    remaining = await world.real_store.load_outbox(SCOPE)
    assert outbox[0].message_id not in [entry.message_id for entry in remaining]


async def test_release_confirmed_deletes_the_rows_in_an_outbox_only_commit(world: World) -> None:
    await world.send(world.invoke(ToolPayload.json({"a": 1})))
    (entry,) = await world.real_store.load_outbox(SCOPE)
    # The reply was published and confirmed; no further frame comes (the
    # session idles, or is closed): its next commit never happens.
    commits_before = len(world.store.commits)
    assert await world.session.release_confirmed(world.store) == 1
    (release,) = world.store.commits[commits_before:]
    assert release.outbox_delete == [entry.message_id]
    assert release.sessions == {} and release.journal is None and release.outbox_insert == []
    assert await world.real_store.load_outbox(SCOPE) == []
    assert world.session.highest_revision == await world.real_store.head_revision(SCOPE)
    # Nothing is left to release, and the next commit deletes nothing.
    assert await world.session.release_confirmed(world.store) == 0
    assert len(world.store.commits) == commits_before + 1
    await world.send(world.invoke(ToolPayload.json({"a": 2})))
    assert world.store.commits[commits_before + 1].outbox_delete == []


async def test_each_committed_state_document_is_the_durable_point(world: World) -> None:
    # The snapshot a failed commit goes back to is exactly what the last
    # successful commit wrote: admission, then observation.
    start = len(world.store.commits)
    await world.send(world.dispatch("key-durable", publish_payload(), tool=SCRIPTED))
    commits = commits_since(world, start)
    assert len(commits) == 2
    for commit in commits:
        state = decode_struct(commit.sessions[SESSION].state, documents.StateDocumentV2)
        assert state.authorizer.calls_by_tool == {SCRIPTED: 1}
    admitted, observed = (
        decode_struct(c.sessions[SESSION].state, documents.StateDocumentV2) for c in commits
    )
    # One retained id: its row goes with the admission, the observation only
    # sets its completed bit in the fixed-size state.
    assert (admitted.authorizer.retained, int(admitted.authorizer.completed, 16)) == (1, 0)
    assert (observed.authorizer.retained, int(observed.authorizer.completed, 16)) == (1, 1)
    request_id = world.session._state.authorizer.retained_ids(0)[0]
    assert [c.sessions[SESSION].requests for c in commits] == [((0, request_id, None),), ()]
    durable = world.session._commits._durable
    assert durable.authorizer.retained == observed.authorizer.retained
    assert durable.authorizer.completed == int(observed.authorizer.completed, 16)
    assert durable.authorizer.calls_by_tool == observed.authorizer.calls_by_tool
    assert (durable.total, dict(durable.by_tool)) == (0, {})
    persisted = (await world.real_store.load_sessions(SCOPE))[SESSION]
    assert persisted.state == commits[-1].sessions[SESSION].state
    assert len(persisted.requests) == 1


async def test_state_document_is_strict(world: World) -> None:
    persisted = (await world.real_store.load_sessions(SCOPE))[SESSION]
    decode_struct(persisted.state, documents.StateDocumentV2)  # the written form decodes
    tampered = persisted.state.replace(b'"status":"open"', b'"status":"open","extra":1')
    with pytest.raises(SerializationError):
        decode_struct(tampered, documents.StateDocumentV2)
    duplicated = persisted.state.replace(b'"status":"open"', b'"status":"open","status":"open"')
    with pytest.raises(SerializationError):
        decode_struct(duplicated, documents.StateDocumentV2)


async def test_commit_count_per_handling_matches_the_cadence(world: World) -> None:
    async def count(message: WorkerMessage) -> int:
        start = len(world.store.commits)
        await world.send(message)
        return len(world.store.commits) - start

    payload = ToolPayload.json({"a": 1})
    assert await count(world.dispatch("op-n", payload, tool=SCRIPTED)) == 2  # admit + observe
    assert await count(world.dispatch("op-n", payload, tool=SCRIPTED)) == 1  # respond
    assert await count(world.reconcile("op-n", tool=SCRIPTED)) == 1  # respond
    assert await count(world.invoke(payload)) == 2  # session-only + respond
    assert await count(world.reconcile("op-none", tool=SCRIPTED)) == 1  # refuse
    assert await count(CloseSession(SESSION)) == 1  # session-only


def test_state_kind_strings_are_wire_spellings() -> None:
    # The session logs state kinds with str(); they must be the wire words.
    assert str(StateKind.SUCCEEDED) == "succeeded"


def _strict_peek(frame: bytes) -> str | None:
    """The key lock's choice by the strict parser alone (the reference)."""
    from octo_common.codec import parse_json
    from octo_common.errors import OctoError as _OctoError
    from octo_common.ids import is_token

    try:
        tree = parse_json(frame)
    except _OctoError:
        return None
    message = tree.get("message") if isinstance(tree, dict) else None
    if not isinstance(message, dict) or message.get("type") not in (
        "dispatch_operation",
        "compensate_operation",
        "reconcile_operation",
        "reconcile_compensation",
    ):
        return None
    request = message.get("request")
    key = request.get("operation_key") if isinstance(request, dict) else None
    return key if isinstance(key, str) and is_token(key) else None


@pytest.mark.parametrize(
    "frame",
    [
        b'{"sequence":1,"message":{"type":"dispatch_operation","request":{"session_id":"s",'
        b'"operation_key":"op-1","payload":{"format":"json","value":{"a":[1,2,{"b":null}]}}}},'
        b'"auth_tag":"00"}',
        b'{"message":{"type":"compensate_operation","request":{"operation_key":"op-2"}}}',
        b'{"message":{"type":"reconcile_operation","request":{"operation_key":"op-3"}}}',
        b'{"message":{"type":"reconcile_compensation","request":{"operation_key":"op-3c"}}}',
        b'{ "message" : { "type" : "dispatch_operation" , "request" : {"operation_key":"op-4"}}}',
        b'{"message":{"type":"dispatch_operation","request":{"operation_key":"a",'
        b'"operation_key":"op-5"}}}',
        b'{"message":{"type":"dispatch_operation","request":{"operation_key":"NOT A TOKEN"}}}',
        b'{"message":{"type":"dispatch_operation","request":{"operation_key":7}}}',
        b'{"message":{"type":"dispatch_operation","request":[]}}',
        b'{"message":{"type":"dispatch_operation"}}',
        b'{"message":{"type":"invoke","invocation":{"request_id":"r"}}}',
        b'{"message":{"type":"dispatch_operation","request":{"operation_key":"op-6",'
        b'"big":123456789012345678901234567890}}}',
        b'{"message":{"type":"dispatch_operation","request":{"operation_key":"op-7"}}',
        b"[]",
        b"",
        b"\xff\xfe",
    ],
)
def test_the_key_lock_peek_agrees_with_the_strict_parse(frame: bytes) -> None:
    assert peek_operation_key(frame) == _strict_peek(frame)
