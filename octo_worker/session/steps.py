"""What a session's decisions hand its driver: one handling's record and the steps.

Owns:

* :class:`Delivery`, what the daemon hands ``WorkerSession.handle``, and
  :class:`Handled`, what ``handle`` returns;
* :class:`Handling`, one call of ``handle``: the delivery and the store it
  acts through, the records loaded for the request's key, what a reply
  names (request id, operation and compensation key), whether an effectful
  adapter ran, and how the delivery was settled;
* the steps the decisions return and the driver runs: :class:`Commit` and
  :class:`Drain` (under the session lock, then decide on), :class:`AdapterStep`
  (an adapter call outside the lock, then decide on), and the ends of a
  handling: :class:`Reply`, :class:`Ack`, :class:`DeadLetter`, :class:`Requeue`.

Values only: no I/O. It must never decide a protocol outcome or hold a key
or a payload in a field its repr shows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias

from octo_common.errors import OctoError
from octo_worker.journal import JournalChangeset, WorkerOperationRecord
from octo_worker.storage.documents import SessionStatus
from octo_worker.storage.interface import OutboxEntry, WorkerSessionStore

if TYPE_CHECKING:
    from octo_common.authorizer import SessionAuthorizer
    from octo_worker.session.request_kinds import KeyedKind

__all__ = [
    "Ack",
    "AdapterStep",
    "Commit",
    "DeadLetter",
    "Delivery",
    "Drain",
    "FinalStep",
    "Handled",
    "Handling",
    "Reply",
    "Requeue",
    "Step",
]


class Delivery(Protocol):
    """One broker delivery, as the daemon hands it to ``handle``.

    ``reply`` publishes a frame to the session's reply queue (recorded at
    ``open_session``) and returns once the broker confirmed it; it raises on
    a failed publish. ``dead_letter`` takes an error code as reason. A
    delivery MAY also provide ``async requeue()`` (reject with requeue),
    used when a poisoned handling could not publish its refusal.
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
    # The last commit in flight when this handling began (an asyncio future of
    # its revision or failure): an ack or a dead-letter that commits nothing
    # waits for it.
    barrier: Any = None

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


# The ends of a handling: what the driver does once the session lock is released.


@dataclass(frozen=True, slots=True)
class Reply:
    """Publish ``frame``, then ack (or requeue when the publish fails)."""

    frame: bytes = field(repr=False)
    correlation_id: str | None
    # The message id of the frame's outbox row (None: published uncommitted).
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


# The steps that decide on: the driver runs each and hands the outcome back.


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the session state as it stands, with ``journal`` rows and an ``outbox`` row.

    The driver runs it under the session lock; ``then`` gets the revision,
    ``failed`` the failure (the session is poisoned in memory by then).
    """

    then: Callable[[int], Step]
    failed: Callable[[OctoError], Step]
    journal: JournalChangeset | None = None
    outbox: OutboxEntry | None = None


@dataclass(frozen=True, slots=True)
class Drain:
    """Wait, lock held, until no commit of the session is in flight; then ``then``."""

    then: Callable[[], Step]


@dataclass(frozen=True, slots=True)
class AdapterStep:
    """Run an adapter method outside the session lock, then ``after`` under it."""

    call: Callable[[float], Awaitable[Any]]  # gets the deadline (event-loop time)
    after: Callable[[Any, BaseException | None], Any]  # -> Step
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


Step: TypeAlias = FinalStep | Commit | Drain | AdapterStep
