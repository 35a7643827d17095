"""Deterministic simulation of the real worker session and host engine over a simulated
broker, with a history checker for the model's invariants (``docs/model.md``).

One *schedule* is a seed. From it a random but reproducible sequence of steps
drives the real code:

* the worker: a real :class:`WorkerSession` on a real
  :class:`SqliteJournalStore` (a file in a temporary directory, its
  database threads run inline), with a simulated adapter (``sim.effect``,
  ``tests/sim/external.py``) over an external system that keeps its own
  record per key (as ``files.publish`` does: a lookup that finds nothing
  fences the key) and counts every call and every effect;
* the host: the real :class:`WorkflowEngine` and its ledger, persisted as
  the ledger's JSON (a host crash keeps only that), sealing every request
  and opening and applying every reply;
* the broker: a queue of requests redelivered until acked (in any order),
  a queue of replies applied in any order; a request may be delivered again
  after its ack (a duplicate) and a reply may be lost;
* faults: the worker process dies (``tests/sim/world.py``) at any I/O
  boundary it passes (before or after each journal transaction, ack,
  publish and adapter call, counted down from a point the seed picks,
  while handling a delivery, opening a session or recovering), at one of
  its kill points (``worker.*``, the daemon's own kill-point hooks) or
  between two steps, and is restarted on the same file under a new fence
  (sessions restored, the outbox published again); or it is *paused* and a
  second worker takes the scope over under a newer fence, then the paused
  one wakes up and handles a delivery (it must commit and publish nothing);
  the host dies between any two steps or while applying a reply (before or
  after its ledger write, the reply left unacked) and comes back from its
  ledger (new session, every key not terminal reconciled).

A death is a SIGKILL's: the process's hand-off in flight never completes and
none of its code reaches the outside world again; its SQLite connections
are dropped with no transaction open; the next process recovers from the
journal alone.

After the faulty part, the schedule settles: no more faults (bar one kill
among the compensations, which come late), every request delivered, every
key reconciled until the ledger holds it terminal. The checker then holds
the history to the model's invariants: at most one effect per key and one
inverse effect; no effect without a durable admission (the external system
reads the journal when it is called); no inverse effect unless the original
succeeded; the adapter called at most once per key (recovery never calls it
again); nothing committed or published by a superseded worker; every key
terminal, the ledger equal to the journal, and ``succeeded`` exactly when
the effect happened.

Steps are taken one at a time on an event loop with virtual time and no I/O
(``tests/sim/loop.py``: a schedule that would wait for ever fails as stuck),
so a seed replays the same schedule: ``python -m tests.sim.run --seed N``.
What this does not cover: two handlings of one worker interleaved (the key
lock serialises a key's), and the AMQP client itself (the crash matrix and
the broker tests run the real broker).
"""

from __future__ import annotations

import asyncio
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
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.session.session import WorkerSession, WorkerSessionLimits
from octo_worker.store import SqliteJournalStore

from .external import TOOL, External, SimAdapter
from .world import (
    PLACES,
    Boundaries,
    KillPointHooks,
    Process,
    bury,
    drop_connections,
    ignore_leftovers,
    simulated_store,
)

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
# The kill points and boundaries a compensation reaches besides those.
COMPENSATION_KILL_POINTS: Final = (
    "worker.after_compensation_admission_commit",
    "worker.after_compensation_effect",
)
COMPENSATION_PLACES: Final = tuple(place for place in PLACES if "inverse" in place)
COMPENSATION_KINDS: Final = (RequestKind.COMPENSATE, RequestKind.RECONCILE_COMPENSATION)
INVERSE: Final = ToolPayload.json({"undo": True})
# How many faulty steps a schedule takes before it settles, and the faults' bounds.
FAULTY_STEPS: Final = 40
SETTLE_STEPS: Final = 400
WORKER_CRASHES: Final = 3  # deaths of the live worker per schedule
COUNTDOWN: Final = 30  # a death armed at a boundary 1 .. COUNTDOWN - 1 ahead


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
        self.gate = sim.boundaries.gate

    async def ack(self) -> None:
        await self.gate(self.worker.process, "before an ack")
        self.request.acked = True
        await self.gate(self.worker.process, "after an ack")

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        await self.gate(self.worker.process, "before a publish")
        self.sim.published(self.worker, Reply(frame, correlation_id, self.request.session_id))
        await self.gate(self.worker.process, "after a publish")

    async def dead_letter(self, reason: str) -> None:
        await self.gate(self.worker.process, "before a dead letter")
        self.request.acked = True
        self.sim.history.append(f"dead-lettered {self.request.kind} {reason}")
        await self.gate(self.worker.process, "after a dead letter")

    async def requeue(self) -> None:
        return None


@dataclass(eq=False)
class Worker:
    """One worker incarnation: its process, store, fence and sessions."""

    process: Process
    store: SqliteJournalStore
    lease: Any = None
    sessions: dict[str, WorkerSession] = field(default_factory=dict)
    registry: WorkerAdapterRegistry = field(default_factory=WorkerAdapterRegistry)
    hooks: KillPointHooks | None = None
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
        self.external = External(self.rng, self._journal_record)
        self.history: list[str] = []
        self.boundaries = Boundaries(self.history)
        self.kill_point: list[str | None] = [None]  # the kill point the live worker dies at
        self.incarnations = 0
        self.observer: SqliteJournalStore | None = None
        self.limits = WorkerSessionLimits(per_tool=1000, per_session=1000)
        self.to_worker: list[Request] = []
        self.to_host: list[Reply] = []
        self.keys: list[str] = []
        self.next_id = 0
        self.budget = Counter[str]()
        self.worker: Worker | None = None
        self.paused: Worker | None = None
        self.host: Host | None = None
        self.violations: list[str] = []

    # -- the journal, as the adapter and the checker read it ---------------------------

    async def _journal_record(self, key: str) -> Any:
        rows = await self.observed().load_records(self.scope, [key])
        row = rows.get(key)
        return None if row is None else row[0]

    # -- worker ------------------------------------------------------------------------

    def _new_store(self, process: Process) -> SqliteJournalStore:
        store = SqliteJournalStore(self.directory / "journal.sqlite3", self.keyring)
        return simulated_store(store, self.boundaries, process)

    def observed(self) -> SqliteJournalStore:
        """The checker's own view of the journal (a store no worker process uses)."""
        if self.observer is None:
            self.observer = self._new_store(Process("observer", crashable=False))
        return self.observer

    async def start_worker(self, *, crashable: bool = True) -> None:
        """A new worker process on the journal; started again while it dies starting."""
        while True:
            self.incarnations += 1
            process = Process(f"worker {self.incarnations}", crashable=crashable)
            worker = Worker(process, self._new_store(process))
            worker.hooks = KillPointHooks(self.boundaries, process, self.kill_point)
            worker.registry.register(TOOL, SimAdapter(self.external, self.boundaries, process))
            started, _ = await self.boundaries.run_as(process, self._boot(worker))
            if started:
                self.worker = worker
                return
            await self.bury(worker)

    async def _boot(self, worker: Worker) -> None:
        """Fence, restore the sessions, publish the outbox again (recovery)."""
        store = worker.store
        worker.lease = await store.reserve_fence(self.scope)
        for session_id, persisted in (await store.load_sessions(self.scope)).items():
            if persisted.status == "closed":
                continue
            worker.sessions[session_id] = await WorkerSession.restore(
                persisted,
                scope_key=self.scope_key,
                scope=self.scope,
                store=store,
                lease=worker.lease,
                adapters=worker.registry,
                limits=self.limits,
                hooks=worker.hooks,
            )
        # The outbox is published again (identical bytes; the host drops a duplicate).
        for entry in await store.load_outbox(self.scope):
            await self.boundaries.gate(worker.process, "before a publish")
            self.to_host.append(Reply(entry.frame, entry.correlation_id, entry.session_id))
            await self.boundaries.gate(worker.process, "after a publish")
        self.history.append(f"{worker.process.name} started, fence {worker.lease.token}")

    async def bury(self, worker: Worker) -> None:
        """What a SIGKILL leaves: nothing of the process runs on; its connections dropped."""
        await bury(worker.process)
        drop_connections(worker.store)

    async def crash_worker(self) -> None:
        """The live worker killed between two steps, then started again."""
        assert self.worker is not None
        self.boundaries.kill(self.worker.process, "between steps")
        await self.bury(self.worker)
        await self.start_worker()

    async def take_over(self) -> None:
        """A second worker takes the scope under a newer fence; the first is paused."""
        assert self.worker is not None
        paused = self.worker
        paused.process.crashable = False  # the countdown is for the live worker
        await self.start_worker()
        paused.fenced_at = await self.observed().head_revision(self.scope)
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
            before = await self.observed().head_revision(self.scope)
            replies = len(self.to_host)
            session = paused.sessions.get(request.session_id)
            if session is not None:
                delivery = Delivery(self, request, paused)
                handling = session.handle(request.frame, paused.store, delivery)
                await self.boundaries.run_as(paused.process, handling)
                if await self.observed().head_revision(self.scope) != before:
                    self.violations.append("a fenced-out worker committed")
                if len(self.to_host) != replies:
                    self.violations.append("a fenced-out worker published")
        self.boundaries.kill(paused.process, "after waking up fenced out", counted=False)
        await self.bury(paused)

    def published(self, worker: Worker, reply: Reply) -> None:
        if worker.fenced_at is not None:
            self.violations.append("a fenced-out worker published a reply")
        self.to_host.append(reply)

    async def deliver(self, request: Request, point: str | None = None) -> None:
        """The live worker handles one delivery (dying at kill point ``point``, if any)."""
        worker = self.worker
        assert worker is not None
        session = worker.sessions.get(request.session_id)
        if session is None:
            request.acked = True  # an unknown session's frame is dead-lettered
            return
        self.kill_point[0] = point
        handling = session.handle(request.frame, worker.store, Delivery(self, request, worker))
        handled, _ = await self.boundaries.run_as(worker.process, handling)
        self.kill_point[0] = None
        if not handled:
            self.history.append(f"... while handling {request.kind} {request.key[:10]}")
            await self.bury(worker)
            await self.start_worker()
            return
        self.history.append(f"delivered {request.kind} {request.key[:10]}")

    # -- host --------------------------------------------------------------------------

    async def start_host(self) -> None:
        """A host incarnation: the durable ledger, a new session, opened at the worker
        (opened again under a new session while the worker dies opening it)."""
        ledger = WorkflowOperationLedger.from_json(self.durable_ledger)
        while True:
            worker = self.worker
            assert worker is not None
            session_id = f"s-{self.rng.getrandbits(64):016x}"
            nonce = self.rng.randbytes(32)
            key = SessionKey.derive(self.scope_key, self.scope, session_id, nonce)
            host = SessionAuthenticator(session_id, key, SessionRole.HOST)
            reply_to = "octo.v5.reply.sim"
            opening = host.seal(
                messages.OpenSession(CapabilityManifest(session_id, [GRANT]), reply_to=reply_to)
            )
            opened, session = await self.boundaries.run_as(
                worker.process,
                WorkerSession.open(
                    SessionAuthenticator(session_id, key, SessionRole.WORKER),
                    opening,
                    scope=self.scope,
                    key_nonce=nonce,
                    reply_to=reply_to,
                    store=worker.store,
                    lease=worker.lease,
                    adapters=worker.registry,
                    limits=self.limits,
                    hooks=worker.hooks,
                ),
            )
            if opened:
                assert session is not None
                break
            self.history.append(f"... while opening session {session_id}")
            await self.bury(worker)
            await self.start_worker()
        worker.sessions[session_id] = session
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

    def apply(self, reply: Reply, *, ack: bool = True, persist: bool = True) -> None:
        """The host opens and applies a reply, persists, then acks (removes) it."""
        self._apply(reply, persist)
        if ack:
            self.to_host.remove(reply)

    def _apply(self, reply: Reply, persist: bool) -> None:
        host = self.host
        assert host is not None
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
        if persist:
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
            choices += [("deliver", lambda r=request: self.deliver(r))] * 3
            if faulty and self.budget["worker_crash"] < WORKER_CRASHES:
                point = rng.choice(KILL_POINTS)
                choices.append(("crash", lambda r=request, p=point: self._crashing(r, p)))
                choices.append(("die", lambda r=request: self._dying(r)))
            if (
                self.faults
                and request.kind in COMPENSATION_KINDS
                and self.budget["compensation_crash"] < 1
            ):
                # Compensations come late in a schedule: one death among them, settled or not.
                point = rng.choice(COMPENSATION_KILL_POINTS)
                choices.append(
                    ("crash", lambda r=request, p=point: self._crashing(r, p, "compensation_crash"))
                )
                choices.append(("die", lambda r=request: self._dying_compensating(r)))
        for reply in list(self.to_host):
            choices += [("apply", lambda r=reply: self.apply(r))] * 3
            if faulty and self.budget["lost"] < 1:
                choices.append(("lose", lambda r=reply: self._lose(r)))
            if faulty and self.budget["host_crash"] < 1:
                choices.append(("host dies applying", lambda r=reply: self._host_dies(r)))
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
            # Offered at one faulty step in four: a death between steps is the same,
            # seen from outside, as one after the last boundary, so most of the
            # budget goes to deaths inside a handling.
            if self.budget["worker_crash"] < WORKER_CRASHES and rng.random() < 0.25:
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

    async def _crashing(self, request: Request, point: str, budget: str = "worker_crash") -> None:
        self.budget[budget] += 1
        await self.deliver(request, point)

    async def _dying(self, request: Request) -> None:
        """Deliver with the live worker set to die at a boundary a few ahead (in this
        handling, or a later step's if this one ends first)."""
        self.budget["worker_crash"] += 1
        self.arm()
        await self.deliver(request)

    async def _dying_compensating(self, request: Request) -> None:
        """Deliver with the live worker set to die at the next inverse or inverse lookup."""
        self.budget["compensation_crash"] += 1
        self.boundaries.arm(1, self.rng.choice(COMPENSATION_PLACES))
        await self.deliver(request)

    def arm(self) -> None:
        """The live worker set to die at a boundary ahead: any of the next few, or
        (half the time, so that every kind is reached) the next one or two of a kind."""
        if self.rng.random() < 0.5:
            self.boundaries.arm(self.rng.randrange(1, COUNTDOWN))
        else:
            self.boundaries.arm(self.rng.randrange(1, 3), self.rng.choice(PLACES))

    async def _host_dies(self, reply: Reply) -> None:
        """The host applies a reply and dies before its ack (half the time before the
        ledger write): the reply stays queued."""
        self.budget["host_crash"] += 1
        self.apply(reply, ack=False, persist=self.rng.random() < 0.5)
        await self.crash_host()

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
        """Killed between steps; half the time it dies again while recovering."""
        self.budget["worker_crash"] += 1
        if self.budget["worker_crash"] < WORKER_CRASHES and self.rng.random() < 0.5:
            self.budget["worker_crash"] += 1
            self.arm()
        await self.crash_worker()

    async def _takeover(self) -> None:
        self.budget["takeover"] += 1
        await self.take_over()

    async def run(self) -> None:
        """The whole schedule, then the checks; raises :class:`Violation`."""
        asyncio.get_running_loop().set_exception_handler(ignore_leftovers)
        await self.start_worker()
        await self.start_host()
        try:
            for _ in range(FAULTY_STEPS if self.faults else 0):
                if not await self.step(faulty=True):
                    break
            self.boundaries.disarm()
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
            if self.observer is not None:
                await self.observer.close()

    async def check(self) -> None:
        """The model's invariants over what happened."""
        adapter = self.external
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
            raise Violation(self.report("; ".join(problems)))

    def report(self, problem: str) -> str:
        """A failure with its seed and the schedule's history."""
        return f"seed {self.seed}: {problem}\nhistory:\n  " + "\n  ".join(self.history)


async def run_schedule(seed: int, directory: Path, *, faults: bool = True) -> Sim:
    """Run the schedule of ``seed`` in ``directory`` (its own journal file)."""
    sim = Sim(seed, directory, faults=faults)
    await sim.run()
    return sim


def new_seed() -> int:
    return secrets.randbits(48)
