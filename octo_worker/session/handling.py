"""One handling of one delivered frame by a session: its delivery, its bookkeeping, its steps.

Owns:

* :class:`Delivery`, what the daemon hands ``WorkerSession.handle`` (W§12.4);
* :class:`Handling`, one call of ``handle``: the delivery (settled at most
  once), the records loaded for the request's key, what a reply names
  (request id, operation and compensation key) and whether an effectful
  adapter ran;
* the steps a locked section hands back to the driver once the session lock
  is released: :class:`Reply`, :class:`Ack`, :class:`DeadLetter`,
  :class:`Requeue` (the end of a handling) and :class:`AdapterStep` (an
  adapter call, then more decisions under the lock);
* :func:`key_lock`, the per-(store, scope, operation key) lock (W§10.5).

It must never decide a protocol outcome, hold a key or a payload in a log
field, or settle a delivery twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

from octo_common.errors import OctoError
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.documents import SessionStatus
from octo_worker.storage.interface import WorkerSessionStore

if TYPE_CHECKING:
    from octo_common.authorizer import SessionAuthorizer
    from octo_worker.session.request_kinds import KeyedKind

__all__ = [
    "Ack",
    "AdapterStep",
    "DeadLetter",
    "Delivery",
    "FinalStep",
    "Handled",
    "Handling",
    "Reply",
    "Requeue",
    "Step",
    "key_lock",
]


class Delivery(Protocol):
    """One broker delivery, as the daemon hands it to ``handle`` (W§12.4).

    ``reply`` publishes a frame to the session's reply queue (recorded at
    ``open_session``) and returns once the broker confirmed it; it raises on
    a failed publish. ``dead_letter`` takes an error code as reason. A
    delivery MAY also provide ``async requeue()`` (reject with requeue),
    used when a poisoned handling could not publish its refusal (W§10.9).
    ``handle`` settles a delivery at most once.
    """

    async def ack(self) -> None: ...

    async def reply(self, frame: bytes, correlation_id: str | None) -> None: ...

    async def dead_letter(self, reason: str) -> None: ...


class Handled(NamedTuple):
    """What a session is once it handled a delivery: what the daemon decides on next."""

    status: SessionStatus
    # A commit of the session failed since it was opened or restored.
    commit_failed: bool


# Key locks (W§10.5) ---------------------------------------------------------


class _KeyLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


# (id(store), scope, operation key) -> lock. Shared by every session of a
# scope on one store; an entry lives only while some handling holds or waits
# for it (each holder keeps the store alive, so the id cannot be reused).
KEY_LOCKS: dict[tuple[int, str, str], _KeyLock] = {}


@contextlib.asynccontextmanager
async def key_lock(store: object, scope: str, key: str) -> AsyncIterator[None]:
    """Hold the lock of (``store``, ``scope``, operation ``key``) for the block."""
    name = (id(store), scope, key)
    entry = KEY_LOCKS.get(name)
    if entry is None:
        entry = KEY_LOCKS[name] = _KeyLock()
    entry.users += 1
    try:
        async with entry.lock:
            yield
    finally:
        entry.users -= 1
        if entry.users == 0:
            del KEY_LOCKS[name]


# One handling ---------------------------------------------------------------


@dataclass
class Handling:
    """One call of ``handle``: the delivery, what was loaded, what the reply names."""

    delivery: Delivery
    store: WorkerSessionStore
    log: Any
    records: dict[str, tuple[WorkerOperationRecord, int] | None] | None = None
    load_error: OctoError | None = None
    request_id: str | None = None
    operation_key: str | None = None
    compensation_key: str | None = None
    # The request's message type ("" until named) and, for a keyed request,
    # its row of the kind table.
    kind: str = ""
    keyed: KeyedKind | None = None
    # The authorizer that issued this handling's token (it validates the result).
    authorizer: SessionAuthorizer | None = None
    adapter_ran: bool = False
    # A refusal of this handling in a poisoned session was committed (or its
    # commit failed): never a second one.
    refused_poisoned: bool = False
    settled: bool = False
    acked: bool = False
    # The last commit in flight when this handling began: an ack or a
    # dead-letter that commits nothing waits for it (see ``_settle_after``).
    barrier: asyncio.Future[int | OctoError] | None = None

    def name_request(
        self,
        kind: str,
        request_id: str,
        operation_key: str | None = None,
        compensation_key: str | None = None,
    ) -> None:
        self.kind = kind
        self.request_id = request_id
        self.operation_key = operation_key
        self.compensation_key = compensation_key
        self.log = self.log.bind(
            request=request_id,
            operation_key=operation_key,
            compensation_key=compensation_key,
        )

    async def ack(self) -> bool:
        """Ack the delivery unless it is settled; True if this call acked it."""
        if self.settled:
            return False
        self.settled = True
        try:
            await self.delivery.ack()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The broker redelivers an unacked frame; the window and the journal
            # resolve the redelivery, so a lost ack is safe.
            self.log.warning("delivery_ack_failed", error=type(exc).__name__)
            return False
        self.acked = True
        return True

    async def dead_letter(self, reason: str) -> None:
        if self.settled:
            return
        self.settled = True
        try:
            await self.delivery.dead_letter(reason)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.warning("delivery_dead_letter_failed", reason=reason, error=type(exc).__name__)

    async def requeue(self) -> None:
        if self.settled:
            return
        requeue = getattr(self.delivery, "requeue", None)
        if requeue is None:
            # Left unsettled: the broker redelivers when the channel closes.
            return
        self.settled = True
        try:
            await requeue()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.warning("delivery_requeue_failed", error=type(exc).__name__)

    async def publish(self, frame: bytes, correlation_id: str | None) -> bool:
        try:
            await self.delivery.reply(frame, correlation_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.log.warning("reply_publish_failed", error=type(exc).__name__)
            return False
        return True


# What a locked section asks the driver to do once the session lock is released.


@dataclass(frozen=True, slots=True)
class Reply:
    """Publish ``frame``, then ack (or requeue when the publish fails)."""

    frame: bytes = field(repr=False)
    correlation_id: str | None
    # The message id of the frame's outbox row (every reply is committed first).
    outbox_id: str | None = None
    # A request_rejected; what the reply says of the request's operation key
    # (True: pending or running, False: terminal, None: nothing).
    refused: bool = False
    unresolved: bool | None = None


@dataclass(frozen=True, slots=True)
class Ack:
    """Ack without a reply (once the commits this handling rests on landed)."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Dead-letter with ``reason`` (once the commits this handling rests on landed)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Requeue:
    """Hand the delivery back to the broker."""


FinalStep: TypeAlias = Reply | Ack | DeadLetter | Requeue


@dataclass(frozen=True, slots=True)
class AdapterStep:
    """Run an adapter method outside the session lock, then ``after`` under it."""

    call: Callable[[float], Awaitable[Any]]  # gets the deadline (event-loop time)
    after: Callable[[Any, BaseException | None], Awaitable[FinalStep]]
    tool: str
    method: str  # the adapter method, for hooks
    ack_first: bool
    deadline: float
    returns: type[Any] | tuple[type[Any], ...]
    # The ack before the call acks an admission (dispatch, compensate): the
    # adapter's run makes a failed commit of this handling indeterminate.
    admission: bool = True
    # The method may have an effect (invoke, dispatch, compensate).
    effect: bool = True


Step: TypeAlias = FinalStep | AdapterStep
