"""Deterministic simulation of the real worker session and host engine over a simulated
broker, with a history checker for the model's invariants (``docs/model.md``).

One *schedule* is a seed. From it a random but reproducible sequence of steps
drives the real code:

* the worker: a real :class:`WorkerSession` on a real
  :class:`SqliteJournalStore` (a file in a temporary directory), with a
  simulated adapter (``sim.effect``) that keeps its own record per key (as
  ``files.publish`` does: a lookup that finds nothing fences the key) and
  counts every call and every effect;
* the host: the real :class:`WorkflowEngine` and its ledger, persisted as
  the ledger's JSON (a host crash keeps only that), sealing every request
  and opening and applying every reply;
* the broker: a queue of requests redelivered until acked (in any order),
  a queue of replies applied in any order; a request may be delivered again
  after its ack (a duplicate) and a reply may be lost;
* faults: the worker dies at one of its kill points (``worker.*``, raised
  from the daemon's own kill-point hooks) or between two deliveries and is
  restarted on the same file under a new fence (sessions restored, the
  outbox published again); or it is *paused* and a second worker takes the
  scope over under a newer fence, then the paused one wakes up and handles a
  delivery (it must commit and publish nothing); the host dies between any
  two steps and comes back from its ledger (new session, every key not
  terminal reconciled).

After the faulty part, the schedule settles: no more faults, every request
delivered, every key reconciled until the ledger holds it terminal. The
checker then holds the history to the model's invariants: at most one
effect per key and one inverse effect; no effect without a durable
admission (the adapter reads the journal when it is called); no inverse
effect unless the original succeeded; the adapter called at most once per
key (recovery never calls it again); nothing committed or published by a
superseded worker; every key terminal, the ledger equal to the journal, and
``succeeded`` exactly when the effect happened.

Steps are taken one at a time (the event loop runs each to its end before
the next is chosen), so a seed replays the same schedule:
``python -m tests.sim.run --seed N``. What this does not cover: two
handlings of one worker interleaved (the key lock serialises a key's), a
crash at an await other than the kill points and the moments between
steps, and the AMQP client itself (the crash matrix and the broker tests
run the real broker).
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from octo_common import messages
from octo_common.errors import DuplicateFrame, OctoError, WorkerRequestRejected
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import TERMINAL_KINDS, Failed, FailureCode, StateKind, Succeeded
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep
from octo_worker.adapters.contract import (
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
    WorkerAdapterRegistry,
)
from octo_worker.session.session import WorkerSession, WorkerSessionLimits
from octo_worker.store import SqliteJournalStore
from octo_worker.testing.kit import SimulatedCrash, _CrashHooks

TOOL: Final = "sim.effect"
KEYS: Final = 2
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=1000, max_compensations=1000)
STEPS: Final = [WorkflowStep(f"step-{i}", f"effect {i}") for i in range(KEYS)]
KILL_POINTS: Final = (
    "worker.after_admission_commit",
    "worker.after_ack",
    "worker.after_effect",
    "worker.before_reply",
    "worker.after_reply",
)
NOT_HAPPENED: Final = Failed("not performed", FailureCode.NOT_HAPPENED)
INVERSE: Final = ToolPayload.json({"undo": True})
REFUSED: Final = Failed("the effect failed")
# How many faulty steps a schedule takes before it settles, and the faults' bounds.
FAULTY_STEPS: Final = 40
SETTLE_STEPS: Final = 400


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """structlog silenced while schedules run, its configuration restored after."""
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        logger_factory=structlog.ReturnLoggerFactory(),
        cache_logger_on_first_use=False,
    )
    try:
        yield
    finally:
        structlog.configure(**saved)


class _Allow:
    """The host's grant and action verifiers: every compensation of this scope."""

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        return None

    def verify_compensation_action(self, action: Any) -> None:
        return None


class Violation(AssertionError):
    """An invariant of the model broken by a schedule."""


class SimAdapter(BaseWorkerAdapter):
    """``sim.effect``: one effect per call unless its own record says otherwise.

    Its record per key (``done``, ``failed``, ``refused`` by a lookup) lives
    outside the worker, as an external system's would: it survives worker
    crashes. Each call checks the admission it acts on is durable.
    """

    tool = TOOL

    def __init__(self, rng: random.Random, durable: Callable[[str], Awaitable[Any]]) -> None:
        self.rng = rng
        self.durable = durable  # operation key -> the journal's record (None: none)
        self.records: dict[str, Any] = {}
        self.crecords: dict[str, Any] = {}
        self.effects: Counter[str] = Counter()
        self.ceffects: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.ccalls: Counter[str] = Counter()
        self.violations: list[str] = []

    def invocation_safety(self) -> InvocationSafety | None:
        return InvocationSafety.READ_ONLY

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> bool:
        return True

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        key = request.operation_key
        self.calls[key] += 1
        record = await self.durable(key)
        if record is None or record.state.kind is not StateKind.PENDING:
            self.violations.append(f"dispatch of {key} without a durable pending admission")
        if key not in self.records:
            if self.rng.random() < 0.8:
                self.effects[key] += 1
                self.records[key] = Succeeded(ToolPayload.json({"done": key[:12]}))
            else:
                self.records[key] = REFUSED
        return self.records[key]

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return self.records.setdefault(request.operation_key, NOT_HAPPENED)

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        key = request.binding.operation_key
        self.ccalls[key] += 1
        record = await self.durable(key)
        if (
            record is None
            or record.state.kind is not StateKind.SUCCEEDED
            or record.compensation is None
            or self.effects[key] != 1
        ):
            self.violations.append(f"compensation of {key} without a succeeded original")
        if key not in self.crecords:
            self.ceffects[key] += 1
            self.crecords[key] = Succeeded(ToolPayload.json({"undone": key[:12]}))
        return self.crecords[key]

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        return self.crecords.setdefault(request.operation_key, NOT_HAPPENED)


@dataclass
class Request:
    """A request the host published: redelivered until the worker acks it."""

    id: int
    frame: bytes
    kind: RequestKind
    body: Any
    key: str
    session_id: str
    acked: bool = False


@dataclass
class Reply:
    frame: bytes
    correlation_id: str | None
    session_id: str


class Delivery:
    """One delivery of a request, as the session settles it."""

    def __init__(self, sim: Sim, request: Request, worker: Worker) -> None:
        self.sim, self.request, self.worker = sim, request, worker

    async def ack(self) -> None:
        if self.worker.alive:
            self.request.acked = True

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        if not self.worker.alive:
            return
        self.sim.published(self.worker, Reply(frame, correlation_id, self.request.session_id))

    async def dead_letter(self, reason: str) -> None:
        if self.worker.alive:
            self.request.acked = True
            self.sim.history.append(f"dead-lettered {self.request.kind} {reason}")

    async def requeue(self) -> None:
        return None


@dataclass(eq=False)
class Worker:
    """One worker incarnation: its store, fence and sessions."""

    store: SqliteJournalStore
    lease: Any
    sessions: dict[str, WorkerSession]
    alive: bool = True
    fenced_at: int | None = None  # the journal revision when a newer fence was reserved


@dataclass
class Host:
    """One host incarnation: the ledger it loaded, its session, its requests."""

    ledger: WorkflowOperationLedger
    auth: SessionAuthenticator
    unsent: set[str] = field(default_factory=set)
    cunsent: set[str] = field(default_factory=set)
    requests: dict[str, Request] = field(default_factory=dict)


class Sim:
    """One schedule (see the module docstring)."""

    def __init__(self, seed: int, directory: Path, *, faults: bool = True) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.directory = directory
        self.faults = faults
        self.scope = f"sim-{seed}"
        self.scope_key = ScopeKey.from_bytes(self.rng.randbytes(32))
        self.keyring = StorageKeyring("sim", self.rng.randbytes(32))
        self.engine = WorkflowEngine()
        self.plan: WorkflowPlan = self.engine.plan(STEPS)
        self.durable_ledger = WorkflowOperationLedger(self.plan.fingerprint).to_json()
        self.adapter = SimAdapter(self.rng, self._journal_record)
        self.registry = WorkerAdapterRegistry()
        self.registry.register(TOOL, self.adapter)
        self.hooks = _CrashHooks()  # the daemon's kill points, raising SimulatedCrash
        self.limits = WorkerSessionLimits(per_tool=1000, per_session=1000)
        self.to_worker: list[Request] = []
        self.to_host: list[Reply] = []
        self.history: list[str] = []
        self.keys: list[str] = []
        self.next_id = 0
        self.budget = Counter[str]()
        self.worker: Worker | None = None
        self.paused: Worker | None = None
        self.host: Host | None = None
        self.violations: list[str] = []

    # -- the journal, as the adapter and the checker read it ---------------------------

    async def _journal_record(self, key: str) -> Any:
        assert self.worker is not None
        rows = await self.worker.store.load_records(self.scope, [key])
        row = rows.get(key)
        return None if row is None else row[0]

    # -- worker ------------------------------------------------------------------------

    def _new_store(self) -> SqliteJournalStore:
        return SqliteJournalStore(self.directory / "journal.sqlite3", self.keyring)

    async def start_worker(self) -> None:
        store = self._new_store()
        lease = await store.reserve_fence(self.scope)
        sessions: dict[str, WorkerSession] = {}
        for session_id, persisted in (await store.load_sessions(self.scope)).items():
            if persisted.status == "closed":
                continue
            sessions[session_id] = await WorkerSession.restore(
                persisted,
                scope_key=self.scope_key,
                scope=self.scope,
                store=store,
                lease=lease,
                adapters=self.registry,
                limits=self.limits,
                hooks=self.hooks,
            )
        self.worker = Worker(store, lease, sessions)
        # The outbox is published again (identical bytes; the host drops a duplicate).
        for entry in await store.load_outbox(self.scope):
            self.to_host.append(Reply(entry.frame, entry.correlation_id, entry.session_id))
        self.history.append(f"worker started, fence {lease.token}")

    async def crash_worker(self) -> None:
        assert self.worker is not None
        self.worker.alive = False
        await self.worker.store.close()
        self.history.append("worker killed")
        await self.start_worker()

    async def take_over(self) -> None:
        """A second worker takes the scope under a newer fence; the first is paused."""
        assert self.worker is not None
        paused = self.worker
        await self.start_worker()
        paused.fenced_at = await self.worker.store.head_revision(self.scope)  # type: ignore[union-attr]
        self.paused = paused
        self.history.append("paused worker fenced out by a new one")

    async def wake_paused(self) -> None:
        """The paused worker handles a delivery: nothing of it may land or be published."""
        paused = self.paused
        assert paused is not None and self.worker is not None
        self.paused = None
        pending = [r for r in self.to_worker if not r.acked]
        if pending:
            request = self.rng.choice(pending)
            before = await self.worker.store.head_revision(self.scope)
            replies = len(self.to_host)
            session = paused.sessions.get(request.session_id)
            if session is not None:
                delivery = Delivery(self, request, paused)
                try:
                    await session.handle(request.frame, paused.store, delivery)
                except SimulatedCrash:
                    pass
                if await self.worker.store.head_revision(self.scope) != before:
                    self.violations.append("a fenced-out worker committed")
                if len(self.to_host) != replies:
                    self.violations.append("a fenced-out worker published")
        paused.alive = False
        await paused.store.close()
        self.history.append("paused worker woke up and stopped")

    def published(self, worker: Worker, reply: Reply) -> None:
        if worker.fenced_at is not None:
            self.violations.append("a fenced-out worker published a reply")
        self.to_host.append(reply)

    async def deliver(self, request: Request, point: str | None) -> None:
        worker = self.worker
        assert worker is not None
        session = worker.sessions.get(request.session_id)
        if session is None:
            request.acked = True  # an unknown session's frame is dead-lettered
            return
        self.hooks.point = point
        try:
            await session.handle(request.frame, worker.store, Delivery(self, request, worker))
        except SimulatedCrash:
            self.history.append(f"worker died at {point} ({request.kind} {request.key[:10]})")
            self.hooks.point = None
            await self.crash_worker()
            return
        self.hooks.point = None
        self.history.append(f"delivered {request.kind} {request.key[:10]}")

    # -- host --------------------------------------------------------------------------

    async def start_host(self) -> None:
        """A host incarnation: the durable ledger, a new session, opened at the worker."""
        assert self.worker is not None
        ledger = WorkflowOperationLedger.from_json(self.durable_ledger)
        session_id = f"s-{self.rng.getrandbits(64):016x}"
        nonce = self.rng.randbytes(32)
        key = SessionKey.derive(self.scope_key, self.scope, session_id, nonce)
        host = SessionAuthenticator(session_id, key, SessionRole.HOST)
        reply_to = "octo.v5.reply.sim"
        opening = host.seal(
            messages.OpenSession(CapabilityManifest(session_id, [GRANT]), reply_to=reply_to)
        )
        session = await WorkerSession.open(
            SessionAuthenticator(session_id, key, SessionRole.WORKER),
            opening,
            scope=self.scope,
            key_nonce=nonce,
            reply_to=reply_to,
            store=self.worker.store,
            lease=self.worker.lease,
            adapters=self.registry,
            limits=self.limits,
            hooks=self.hooks,
        )
        self.worker.sessions[session_id] = session
        self.host = Host(ledger, host)
        self.history.append(f"host started, session {session_id}")

    def persist(self, ledger: WorkflowOperationLedger) -> None:
        self.durable_ledger = ledger.to_json()
        assert self.host is not None
        self.host.ledger = ledger

    def publish(self, kind: RequestKind, key: str, outbound: Any) -> None:
        assert self.host is not None
        self.next_id += 1
        request = Request(
            self.next_id,
            outbound.frame,
            kind,
            outbound.request,
            key,
            self.host.auth.session_id,
        )
        self.host.requests[outbound.request.request_id] = request
        self.to_worker.append(request)
        self.history.append(f"host sent {kind} {key[:10]}")

    def record(self, index: int) -> None:
        assert self.host is not None
        candidate = self.host.ledger.copy()
        data = canonical_operation_input_bytes(self.payload(index))
        key = self.engine.record_derived_operation(
            self.plan, candidate, STEPS[index].id, TOOL, data, self.rng.randbytes(16)
        )
        self.persist(candidate)
        self.keys.append(key)
        self.host.unsent.add(key)
        self.history.append(f"host recorded {key[:10]}")

    def payload(self, index: int) -> ToolPayload:
        return ToolPayload.json({"n": index})

    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.next_id + 1}-{self.rng.getrandbits(32):08x}"

    def dispatch(self, key: str) -> None:
        assert self.host is not None
        self.host.unsent.discard(key)
        index = self.keys.index(key)
        outbound = self.engine.prepare_authenticated_operation_dispatch(
            self.plan,
            self.host.ledger,
            key,
            self.payload(index),
            self.request_id("d"),
            self.host.auth,
        )
        self.publish(RequestKind.DISPATCH, key, outbound)

    def reconcile(self, key: str) -> None:
        assert self.host is not None
        index = self.keys.index(key)
        data = canonical_operation_input_bytes(self.payload(index))
        outbound = self.engine.prepare_authenticated_operation_reconciliation(
            self.plan, self.host.ledger, key, data, self.request_id("r"), self.host.auth
        )
        self.publish(RequestKind.RECONCILE, key, outbound)

    def target(self, key: str) -> WorkflowCompensationTarget:
        return WorkflowCompensationTarget(
            key, WorkflowCompensationPolicy(self.scope, GRANT), GRANT, _Allow(), _Allow()
        )

    def record_compensation(self, key: str) -> None:
        assert self.host is not None
        candidate = self.host.ledger.copy()
        data = canonical_operation_input_bytes(INVERSE)
        self.engine.record_derived_compensation_with_action_verifier(
            self.plan, candidate, self.target(key), data, self.rng.randbytes(16)
        )
        self.persist(candidate)
        self.host.cunsent.add(key)
        self.history.append(f"host recorded the compensation of {key[:10]}")

    def compensate(self, key: str) -> None:
        """Sent under a fresh approval (one use)."""
        host = self.host
        assert host is not None
        host.cunsent.discard(key)
        data = canonical_operation_input_bytes(INVERSE)
        target = self.target(key)
        approval = self.engine.approve_compensation(self.plan, host.ledger, target, data, host.auth)
        outbound = self.engine.prepare_authenticated_operation_compensation(
            self.plan,
            host.ledger,
            target,
            WorkflowCompensationDispatch(self.request_id("c"), INVERSE),
            approval,
            host.auth,
        )
        self.publish(RequestKind.COMPENSATE, key, outbound)

    def reconcile_compensation(self, key: str) -> None:
        assert self.host is not None
        outbound = self.engine.prepare_authenticated_compensation_reconciliation(
            self.plan, self.host.ledger, key, self.request_id("k"), self.host.auth
        )
        self.publish(RequestKind.RECONCILE_COMPENSATION, key, outbound)

    def apply(self, reply: Reply) -> None:
        """The host opens and applies a reply, persists, then acks (removes) it."""
        host = self.host
        assert host is not None
        self.to_host.remove(reply)
        if reply.session_id != host.auth.session_id:
            self.history.append("reply of an earlier session dead-lettered")
            return
        request = host.requests.get(str(reply.correlation_id))
        if request is None:
            self.history.append("reply to nothing dropped")
            return
        candidate = host.ledger.copy()
        try:
            state = self.engine.apply_reply(
                request.kind, self.plan, candidate, request.body, host.auth, reply.frame
            )
        except DuplicateFrame:
            self.history.append("duplicate reply dropped")
            return
        except WorkerRequestRejected as refused:
            code = refused.rejection_code
            op = candidate.operation(request.key)
            if code == "unknown_operation" and op is not None and op.state == StateKind.PENDING:
                host.unsent.add(request.key)  # never admitted: the same key again
            if (
                code == "unknown_compensation"
                and op is not None
                and op.compensation is not None
                and op.compensation.state == StateKind.PENDING
            ):
                host.cunsent.add(request.key)  # never admitted: sent again, a new approval
            self.history.append(f"refused {request.kind} {request.key[:10]}: {code}")
            return
        except OctoError as exc:
            self.history.append(f"reply not applied ({exc.code})")
            return
        self.persist(candidate)
        self.history.append(f"host applied {request.kind} {request.key[:10]}: {state.kind}")

    async def crash_host(self) -> None:
        self.history.append("host killed")
        await self.start_host()

    # -- the schedule ------------------------------------------------------------------

    def pending_keys(self) -> list[str]:
        """Keys whose operation is not terminal."""
        assert self.host is not None
        found = []
        for key in self.keys:
            op = self.host.ledger.operation(key)
            if op is not None and op.state not in TERMINAL_KINDS:
                found.append(key)
        return found

    def pending_compensations(self) -> list[str]:
        """Keys whose compensation is recorded and not terminal."""
        assert self.host is not None
        found = []
        for key in self.keys:
            op = self.host.ledger.operation(key)
            comp = None if op is None else op.compensation
            if comp is not None and comp.state not in TERMINAL_KINDS:
                found.append(key)
        return found

    def compensable(self) -> list[str]:
        """Succeeded keys without a compensation (the first key is compensated)."""
        assert self.host is not None
        op = self.host.ledger.operation(self.keys[0]) if self.keys else None
        if op is not None and op.state == StateKind.SUCCEEDED and op.compensation is None:
            return [self.keys[0]]
        return []

    def unsettled(self) -> bool:
        return bool(
            self.pending_keys()
            or self.pending_compensations()
            or self.compensable()
            or len(self.keys) < KEYS
        )

    async def step(self, faulty: bool) -> bool:
        """One step chosen by the seed; False when nothing is left to do."""
        assert self.host is not None
        rng = self.rng
        choices: list[tuple[str, Callable[[], Awaitable[None] | None]]] = []
        if len(self.keys) < KEYS:
            choices.append(("record", lambda: self.record(len(self.keys))))
        for key in sorted(self.host.unsent):
            choices.append(("dispatch", lambda key=key: self.dispatch(key)))
        for key in self.compensable():
            choices.append(("record compensation", lambda key=key: self.record_compensation(key)))
        for key in sorted(self.host.cunsent):
            choices.append(("compensate", lambda key=key: self.compensate(key)))
        unacked = [r for r in self.to_worker if not r.acked]
        for request in unacked:
            choices += [("deliver", lambda r=request: self.deliver(r, None))] * 3
            if faulty and self.budget["worker_crash"] < 2:
                point = rng.choice(KILL_POINTS)
                choices.append(("crash", lambda r=request, p=point: self._crashing(r, p)))
        for reply in list(self.to_host):
            choices += [("apply", lambda r=reply: self.apply(r))] * 3
            if faulty and self.budget["lost"] < 1:
                choices.append(("lose", lambda r=reply: self._lose(r)))
        waiting = not unacked and not self.to_host
        for key in self.pending_keys():
            if key not in self.host.unsent and (waiting or faulty):
                choices.append(("reconcile", lambda key=key: self.reconcile(key)))
        for key in self.pending_compensations():
            if key not in self.host.cunsent and (waiting or faulty):
                choices.append(
                    ("reconcile compensation", lambda key=key: self.reconcile_compensation(key))
                )
        if faulty:
            acked = [r for r in self.to_worker if r.acked]
            if acked and self.budget["dup"] < 2:
                choices.append(("duplicate", lambda: self._duplicate(rng.choice(acked))))
            if self.budget["host_crash"] < 1:
                choices.append(("host crash", self._host_crash))
            if self.budget["worker_crash"] < 2:
                choices.append(("worker crash", self._worker_crash))
            if self.paused is None and self.budget["takeover"] < 1:
                choices.append(("takeover", self._takeover))
        if self.paused is not None:
            choices.append(("wake", self.wake_paused))
        if not choices:
            return False
        if not faulty and not self.unsettled() and not unacked and not self.to_host:
            return False
        _name, action = rng.choice(choices)
        outcome = action()
        if outcome is not None:
            await outcome
        return True

    async def _crashing(self, request: Request, point: str) -> None:
        self.budget["worker_crash"] += 1
        await self.deliver(request, point)

    def _lose(self, reply: Reply) -> None:
        self.budget["lost"] += 1
        self.to_host.remove(reply)
        self.history.append("reply lost")

    def _duplicate(self, request: Request) -> None:
        self.budget["dup"] += 1
        self.next_id += 1
        copy = Request(
            self.next_id,
            request.frame,
            request.kind,
            request.body,
            request.key,
            request.session_id,
        )
        self.to_worker.append(copy)
        self.history.append(f"duplicate of {request.kind} {request.key[:10]}")

    async def _host_crash(self) -> None:
        self.budget["host_crash"] += 1
        await self.crash_host()

    async def _worker_crash(self) -> None:
        self.budget["worker_crash"] += 1
        await self.crash_worker()

    async def _takeover(self) -> None:
        self.budget["takeover"] += 1
        await self.take_over()

    async def run(self) -> None:
        """The whole schedule, then the checks; raises :class:`Violation`."""
        await self.start_worker()
        await self.start_host()
        try:
            for _ in range(FAULTY_STEPS if self.faults else 0):
                if not await self.step(faulty=True):
                    break
            if self.paused is not None:
                await self.wake_paused()
            for _ in range(SETTLE_STEPS):
                if not self.unsettled() and not self.to_host:
                    break
                if not await self.step(faulty=False):
                    break
            await self.check()
        finally:
            for worker in (self.worker, self.paused):
                if worker is not None:
                    await worker.store.close()

    async def check(self) -> None:
        """The model's invariants over what happened."""
        adapter = self.adapter
        problems = list(self.violations) + list(adapter.violations)
        assert self.host is not None
        for key in self.keys:
            if adapter.effects[key] > 1:
                problems.append(f"{key[:10]}: {adapter.effects[key]} effects")
            if adapter.ceffects[key] > 1:
                problems.append(f"{key[:10]}: {adapter.ceffects[key]} inverse effects")
            if adapter.calls[key] > 1:
                problems.append(f"{key[:10]}: the adapter was called {adapter.calls[key]} times")
            op = self.host.ledger.operation(key)
            record = await self._journal_record(key)
            if op is None or op.state not in TERMINAL_KINDS:
                problems.append(f"{key[:10]}: not terminal after settling ({op and op.state})")
                continue
            if record is None or record.state.kind != op.state:
                problems.append(f"{key[:10]}: ledger {op.state}, journal {record and record.state}")
            done = adapter.effects[key] == 1
            if (op.state == StateKind.SUCCEEDED) != done:
                problems.append(f"{key[:10]}: ledger {op.state} but {adapter.effects[key]} effects")
            if adapter.ccalls[key] > 1:
                problems.append(f"{key[:10]}: the inverse was called {adapter.ccalls[key]} times")
            comp = op.compensation
            if comp is None:
                if adapter.ceffects[key]:
                    problems.append(f"{key[:10]}: an inverse effect the ledger does not know")
                continue
            if comp.state not in TERMINAL_KINDS:
                problems.append(f"{key[:10]}: compensation not terminal ({comp.state})")
            elif record is None or record.compensation is None:
                problems.append(f"{key[:10]}: compensation {comp.state} unknown to the journal")
            elif record.compensation.state.kind != comp.state:
                problems.append(
                    f"{key[:10]}: compensation {comp.state}, journal {record.compensation.state}"
                )
            elif (comp.state == StateKind.SUCCEEDED) != (adapter.ceffects[key] == 1):
                problems.append(
                    f"{key[:10]}: compensation {comp.state}, inverse effects "
                    f"{adapter.ceffects[key]}"
                )
        if len(self.keys) != KEYS:
            problems.append(f"only {len(self.keys)} keys recorded")
        if problems:
            raise Violation(
                f"seed {self.seed}: "
                + "; ".join(problems)
                + "\nhistory:\n  "
                + "\n  ".join(self.history)
            )


async def run_schedule(seed: int, directory: Path, *, faults: bool = True) -> Sim:
    """Run the schedule of ``seed`` in ``directory`` (its own journal file)."""
    sim = Sim(seed, directory, faults=faults)
    await sim.run()
    return sim


def new_seed() -> int:
    return secrets.randbits(48)
