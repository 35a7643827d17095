"""``AdapterKit``: an adapter plug-in run through a real ``WorkerSession``.

The kit opens a real :class:`~octo_worker.session.WorkerSession` on a real
:class:`~octo_worker.store.SqliteJournalStore` in a directory of the caller's
(a temporary one in tests), with the plug-in registered for its tool, and
plays the host: it seals each request with the session's host-role
authenticator, delivers it to ``WorkerSession.handle`` as the daemon would,
and opens the reply. No broker is involved; the delivery is recorded in
memory (acked, replied, dead-lettered).

What it drives is what the daemon drives: admission committed before the
adapter runs, a duplicate answered from the journal, a compensation
authorized against the grant and the journal, both lookups. Every
call the worker makes to the plug-in goes through :class:`CountingAdapter`,
so a test can say how many real calls a scenario cost (``kit.calls``).
A lookup is asked (and must agree with what the journal holds: a lookup
that reports another output than the dispatch returned is refused,
``invalid_worker_operation_transition``, which the kit shows as the daemon
would), except for a key the plug-in never acted on: an input or options
refusal before any effect ends the key ``failed`` with the code
``input_refused`` / ``options_refused`` and the refusal's text (msgspec's
"Expected `int`, got `str` - at `$.cents`" for a ``FunctionAdapter``), and a
lookup of it is answered from the journal. The plug-in's own exception of
any other refusal is the cause of the ``WorkerRequestRejected`` the kit
raises, and ``kit.last_error``.

A simulated crash (:meth:`AdapterKit.dispatch_crashing`,
:meth:`AdapterKit.compensate_crashing`) stops the handling at one of the
worker's kill points (``KILL_POINTS``, the ones ``OCTO_FAULT`` kills the
daemon at) by raising :class:`SimulatedCrash` from the worker's hooks, then
restarts: the store is closed and opened again on the same file under a new
fence, the session restored from the journal, and a delivery the
crash left unacked is delivered again, as the broker would. Reconciliation
then goes through the plug-in's lookups, exactly as after a real restart.

It must never reach into the journal to decide an outcome, call the plug-in
other than through the worker, or be used by the daemon: it is for tests.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from octo_common import messages
from octo_common.errors import WorkerRequestRejected
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.runtime.faults import FAULT_POINTS
from octo_common.states import OperationStatus
from octo_worker.adapters.contract import (
    WorkerAdapter,
    WorkerAdapterRegistry,
    load_adapters,
    lookup_miss_fences_key,
)
from octo_worker.daemon.faults import FaultHooks
from octo_worker.session.session import WorkerSession, WorkerSessionLimits
from octo_worker.store import SqliteJournalStore

__all__ = [
    "KILL_POINTS",
    "AdapterKit",
    "CountingAdapter",
    "KitDelivery",
    "SimulatedCrash",
]

KILL_POINTS: Final = (
    "worker.after_admission_commit",
    "worker.after_ack",
    "worker.after_effect",
    "worker.before_reply",
    "worker.after_reply",
)
"""The worker's kill points (``octo_worker.daemon.faults``), in the order a dispatch or a
compensation reaches them (the compensation-only points of ``FAULT_POINTS`` are
accepted too)."""

_REPLY_TO: Final = "octo.v5.reply.adapter-kit"


class SimulatedCrash(BaseException):
    """Raised by the kit's hooks at the chosen kill point: the worker "dies" there.

    A ``BaseException``, so no handler of the worker's treats it as a failure
    to answer: the handling stops where it is, as a killed process would.
    """

    def __init__(self, point: str) -> None:
        super().__init__(point)
        self.point = point


class _CrashHooks(FaultHooks):
    """The daemon's kill points (``FaultHooks``), raising :class:`SimulatedCrash` at
    ``point`` (None: never) instead of killing the process."""

    def __init__(self) -> None:
        self.point: str | None = None
        self._reach = self._crash

    def _crash(self, point: str, settle: float = 0.0) -> None:
        if self.point == point:
            self.point = None
            raise SimulatedCrash(point)


class CountingAdapter:
    """The plug-in, with every call the worker makes to it counted by method name.

    ``calls["dispatch_operation"]`` is the number of times the worker asked
    the plug-in to perform the effect; the declarations are passed through.
    ``raised`` keeps each exception a call raised, with the method's name, as
    the plug-in raised it (the worker sends only its code): a test reads the
    real message there, "Expected `int`, got `str` - at `$.cents`".
    """

    def __init__(self, inner: WorkerAdapter) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()
        self.raised: list[tuple[str, BaseException]] = []
        self.tool = getattr(inner, "tool", None)
        deadline = getattr(inner, "deadline_seconds", None)
        if deadline is not None:
            self.deadline_seconds = deadline

    async def _called(self, method: str, call: Awaitable[Any]) -> Any:
        self.calls[method] += 1
        try:
            return await call
        except Exception as exc:
            self.raised.append((method, exc))
            raise

    def invocation_safety(self) -> Any:
        return self.inner.invocation_safety()

    def durable_operation_contract(self) -> Any:
        return self.inner.durable_operation_contract()

    def lookup_miss_fences_key(self) -> bool:
        return lookup_miss_fences_key(self.inner)

    async def invoke(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._called("invoke", self.inner.invoke(request, grant, context))

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._called(
            "dispatch_operation", self.inner.dispatch_operation(request, grant, context)
        )

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._called(
            "compensate_operation", self.inner.compensate_operation(request, grant, context)
        )

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._called(
            "reconcile_operation", self.inner.reconcile_operation(request, grant, context)
        )

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._called(
            "reconcile_compensation", self.inner.reconcile_compensation(request, grant, context)
        )


@dataclass
class KitDelivery:
    """One delivery as the worker settled it: ``events`` in order, replies opened."""

    events: list[str] = field(default_factory=list)
    frames: list[bytes] = field(default_factory=list)
    replies: list[messages.WorkerMessage] = field(default_factory=list)

    async def ack(self) -> None:
        self.events.append("ack")

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        self.frames.append(frame)
        self.events.append("reply")

    async def dead_letter(self, reason: str) -> None:
        self.events.append(f"dead_letter:{reason}")

    async def requeue(self) -> None:
        self.events.append("requeue")

    @property
    def settled(self) -> bool:
        """Acked or dead-lettered: the broker would not deliver it again."""
        return any(event == "ack" or event.startswith("dead_letter") for event in self.events)


class AdapterKit:
    """One plug-in, one journal, one session (see the module docstring).

    Use ``async with AdapterKit(adapter, directory) as kit:``; ``adapter`` is
    the configured plug-in (``AdapterKit.load(tool, directory, **options)``
    loads it through its ``octo.adapters`` entry point, as the daemon does).
    ``grant`` defaults to a JSON grant of the adapter's tool with room for
    many calls and compensations.
    """

    def __init__(
        self,
        adapter: WorkerAdapter,
        directory: str | Path,
        *,
        tool: str | None = None,
        grant: CapabilityGrant | None = None,
        scope: str = "kit-scope",
        limits: WorkerSessionLimits | None = None,
    ) -> None:
        name = tool or getattr(adapter, "tool", None)
        if not isinstance(name, str):
            raise TypeError("name the tool: the adapter has no tool attribute")
        self.tool = name
        self.adapter = CountingAdapter(adapter)
        self.grant = grant or CapabilityGrant(name, "json", max_calls=1000, max_compensations=1000)
        self.scope = scope
        self.directory = Path(directory)
        self._limits = limits or WorkerSessionLimits(per_tool=1000, per_session=1000)
        self._registry = WorkerAdapterRegistry()
        self._registry.register(name, self.adapter)
        self._hooks = _CrashHooks()
        self._scope_key = ScopeKey.from_bytes(secrets.token_bytes(32))
        self._keyring = StorageKeyring("kit", secrets.token_bytes(32))
        self._store: SqliteJournalStore | None = None
        self._session: WorkerSession | None = None
        self._host: SessionAuthenticator | None = None
        self._compensation_keys: dict[str, str] = {}
        self._counter = 0
        self.restarts = 0

    @classmethod
    def load(cls, tool: str, directory: str | Path, **options: Any) -> AdapterKit:
        """A kit for the plug-in the ``octo.adapters`` entry point ``tool`` names,
        loaded exactly as the daemon loads it (``load_adapters``, ``options``)."""
        registry = load_adapters([tool], options={tool: options})
        adapter = registry.get(tool)
        assert adapter is not None
        return cls(adapter, directory, tool=tool)

    @property
    def calls(self) -> Counter[str]:
        """The plug-in's real calls so far, by method name."""
        return self.adapter.calls

    @property
    def journal(self) -> Path:
        return self.directory / "journal.sqlite3"

    async def __aenter__(self) -> AdapterKit:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the journal and one session (its ``open_session`` committed)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        store = self._store = SqliteJournalStore(self.journal, self._keyring)
        lease = await store.reserve_fence(self.scope)
        session_id = f"s-{secrets.token_hex(8)}"
        nonce = secrets.token_bytes(32)
        key = SessionKey.derive(self._scope_key, self.scope, session_id, nonce)
        self._host = SessionAuthenticator(session_id, key, SessionRole.HOST)
        worker = SessionAuthenticator(session_id, key, SessionRole.WORKER)
        opening = self._host.seal(
            messages.OpenSession(CapabilityManifest(session_id, (self.grant,)), reply_to=_REPLY_TO)
        )
        self._session = await WorkerSession.open(
            worker,
            opening,
            scope=self.scope,
            key_nonce=nonce,
            reply_to=_REPLY_TO,
            store=store,
            lease=lease,
            adapters=self._registry,
            limits=self._limits,
            hooks=self._hooks,
        )

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def restart(self) -> None:
        """The worker process starts again: the store reopened on the same file under a
        new fence, the session restored from what the journal holds."""
        session = self._live()
        await self.close()
        store = self._store = SqliteJournalStore(self.journal, self._keyring)
        lease = await store.reserve_fence(self.scope)
        persisted = await store.load_sessions(self.scope)
        self._session = await WorkerSession.restore(
            persisted[session.session_id],
            scope_key=self._scope_key,
            scope=self.scope,
            store=store,
            lease=lease,
            adapters=self._registry,
            limits=self._limits,
            hooks=self._hooks,
        )
        self.restarts += 1

    # -- keys and frames -----------------------------------------------------------------

    def new_key(self) -> str:
        """A fresh operation key (the host derives them; any token will do here)."""
        return f"op-{secrets.token_hex(32)}"

    def compensation_key(self, operation_key: str) -> str:
        """The one ``cmp-`` key of ``operation_key``'s compensation in this kit."""
        return self._compensation_keys.setdefault(operation_key, f"cmp-{secrets.token_hex(32)}")

    def _request_id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def _live(self) -> WorkerSession:
        if self._session is None or self._store is None:
            raise RuntimeError("the kit is not started (async with AdapterKit(...))")
        return self._session

    def _binding(self, operation_key: str) -> messages.OperationCompensationBinding:
        return messages.OperationCompensationBinding(
            self.tool,
            operation_key,
            self.compensation_key(operation_key),
            self.scope,
            self.grant.compensation_fingerprint(),
        )

    def dispatch_frame(self, operation_key: str, payload: ToolPayload) -> bytes:
        session = self._live()
        request = messages.OperationDispatchRequest(
            session.session_id, self._request_id("d"), self.tool, operation_key, payload
        )
        return self._seal(messages.DispatchOperation(request))

    def compensate_frame(self, operation_key: str, inverse: ToolPayload) -> bytes:
        session = self._live()
        request = messages.OperationCompensationRequest(
            session.session_id, self._request_id("c"), self._binding(operation_key), inverse
        )
        return self._seal(messages.CompensateOperation(request))

    def reconcile_frame(self, operation_key: str) -> bytes:
        session = self._live()
        request = messages.OperationReconcileRequest(
            session.session_id, self._request_id("r"), self.tool, operation_key
        )
        return self._seal(messages.ReconcileOperation(request))

    def reconcile_compensation_frame(self, operation_key: str) -> bytes:
        session = self._live()
        binding = self._binding(operation_key)
        request = messages.CompensationReconcileRequest(
            session.session_id,
            self._request_id("k"),
            binding.tool,
            binding.operation_key,
            binding.compensation_key,
            binding.tenant_scope,
            binding.grant_fingerprint,
        )
        return self._seal(messages.ReconcileCompensation(request))

    def _seal(self, message: messages.WorkerMessage) -> bytes:
        assert self._host is not None
        return self._host.seal(message)

    # -- delivering ----------------------------------------------------------------------

    async def deliver(self, frame: bytes) -> KitDelivery:
        """Hand one frame to the session as the daemon would; the replies opened."""
        session = self._live()
        assert self._store is not None and self._host is not None
        delivery = KitDelivery()
        try:
            await session.handle(frame, self._store, delivery)
        finally:
            delivery.replies.extend(self._host.open(reply) for reply in delivery.frames)
        return delivery

    async def _answer(self, frame: bytes) -> OperationStatus:
        before = len(self.adapter.raised)
        delivery = await self.deliver(frame)
        if len(delivery.replies) != 1:
            raise AssertionError(f"expected one reply, the worker did: {delivery.events}")
        try:
            return status_of(delivery.replies[0])
        except WorkerRequestRejected as refused:
            raised = self.adapter.raised[before:]
            if raised:
                # The plug-in's own exception, with its text, as the cause.
                raise refused from raised[-1][1]
            raise

    @property
    def last_error(self) -> BaseException | None:
        """The last exception the plug-in raised (its own text), or None."""
        return self.adapter.raised[-1][1] if self.adapter.raised else None

    async def dispatch(self, payload: ToolPayload, key: str | None = None) -> OperationStatus:
        """``dispatch_operation`` of ``key`` (a fresh one by default); the reply's status.

        A refusal raises ``WorkerRequestRejected`` (its ``rejection_code``).
        """
        return await self._answer(self.dispatch_frame(key or self.new_key(), payload))

    async def compensate(self, operation_key: str, inverse: ToolPayload) -> OperationStatus:
        """``compensate_operation`` of the one compensation of ``operation_key``."""
        return await self._answer(self.compensate_frame(operation_key, inverse))

    async def reconcile(self, operation_key: str) -> OperationStatus:
        """``reconcile_operation``: the journal's answer, or the plug-in's lookup."""
        return await self._answer(self.reconcile_frame(operation_key))

    async def reconcile_compensation(self, operation_key: str) -> OperationStatus:
        """``reconcile_compensation``: the journal's answer, or the plug-in's lookup."""
        return await self._answer(self.reconcile_compensation_frame(operation_key))

    # -- crashes -------------------------------------------------------------------------

    async def dispatch_crashing(
        self, payload: ToolPayload, at: str, key: str | None = None
    ) -> CrashReport:
        """Deliver a ``dispatch_operation`` that kills the worker at kill point ``at``,
        restart, and deliver it again if the crash left it unacked. Returns the key,
        whether the point was reached, and what the redelivery answered."""
        key = key or self.new_key()
        return await self._crashing(self.dispatch_frame(key, payload), at, key)

    async def compensate_crashing(
        self, operation_key: str, inverse: ToolPayload, at: str
    ) -> CrashReport:
        """As :meth:`dispatch_crashing`, for the compensation of ``operation_key``."""
        frame = self.compensate_frame(operation_key, inverse)
        return await self._crashing(frame, at, operation_key)

    async def _crashing(self, frame: bytes, at: str, key: str) -> CrashReport:
        if at not in FAULT_POINTS or not at.startswith("worker."):
            raise ValueError(f"not a worker kill point: {at!r} (KILL_POINTS)")
        self._hooks.point = at
        delivery = KitDelivery()
        reached = False
        try:
            await self._deliver_to(frame, delivery)
        except SimulatedCrash:
            reached = True
        finally:
            self._hooks.point = None
        if not reached:
            return CrashReport(key, at, False, delivery, None)
        await self.restart()
        again = None if delivery.settled else await self.deliver(frame)
        return CrashReport(key, at, True, delivery, again)

    async def _deliver_to(self, frame: bytes, delivery: KitDelivery) -> None:
        session = self._live()
        assert self._store is not None
        await session.handle(frame, self._store, delivery)


@dataclass(frozen=True)
class CrashReport:
    """What one simulated crash did.

    ``reached``: the handling got to the kill point (an adapter that raised
    skips ``worker.after_effect``). ``before``: the delivery up to the crash.
    ``redelivered``: the broker's second delivery of an unacked frame to the
    restarted worker (None when the crash came after its ack).
    """

    key: str
    point: str
    reached: bool
    before: KitDelivery
    redelivered: KitDelivery | None


def status_of(reply: messages.WorkerMessage) -> OperationStatus:
    """The status a reply carries; a ``request_rejected`` raises ``WorkerRequestRejected``."""
    if isinstance(reply, messages.RequestRejected):
        raise WorkerRequestRejected(reply)
    if isinstance(
        reply,
        messages.OperationResult
        | messages.CompensationResult
        | messages.ReconciledOperation
        | messages.ReconciledCompensation,
    ):
        status: OperationStatus = reply.result.status
        return status
    raise AssertionError(f"not an operation reply: {type(reply).__name__}")


def counts(calls: Mapping[str, int]) -> dict[str, int]:
    """``calls`` without the methods never called (for readable assertions)."""
    return {name: number for name, number in calls.items() if number}
