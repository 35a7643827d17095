"""One authenticated worker session and its effect ordering (W§10, D4–D6, D9).

A :class:`WorkerSession` owns, for one session of one tenant scope: the
worker-role authenticator (replay window, outbound sequence), the
``SessionAuthorizer`` (budgets, request ids, compensation identities), the
reconciliation counters and the session status (``open``, ``closed``,
``poisoned``). ``handle`` turns one delivered frame into exactly the commits,
adapter calls, replies, acks and dead-letters that W§10.5–10.9 prescribe:

* every frame ``open()`` accepted is made durable (window, budgets) before the
  delivery is acked, dead-lettered or answered and before any effectful
  adapter method runs (S1); a reply is committed to the outbox with the state
  document recording its sequence before it is published (S3);
* ``store.commit`` is called exactly once per admission, observation,
  respond, refuse or session-only commit, and confirmed outbox rows are
  deleted only inside such a commit (PROTOCOL.md §2.4 "Commit cadence");
* work on one operation key is serialised by a key lock shared by every
  session of the scope on the same store; session state is changed only
  under the session lock, which is never held while waiting for a key lock,
  an adapter or a commit's fsync;
* a session's commits are built in order and settle in that order; with a
  store that chains them (``SqliteJournalStore``), the next commit is
  submitted while the previous one is in flight, on top of it, so concurrent
  handlings of one session share transactions (each still waits for its own
  durability before it acks, runs an adapter or publishes);
* a failed commit poisons the session: its memory goes back to the last
  durable point and a refusal is published best-effort (W§10.9 steps 1–2;
  the daemon runs steps 3–5).

This module persists through the store and publishes through the delivery;
it must never send anything that was not committed first (except the
best-effort refusals of a poisoned session), never run an adapter twice for
one admission, never put keys, payloads, failure messages or adapter text in
a document, a log line or a refusal.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeAlias

import structlog

from octo_common.authorizer import (
    AuthorizedInvocation,
    AuthorizedOperationCompensation,
    AuthorizedOperationInvocation,
    AuthorizedOperationReconciliation,
    AuthorizerState,
    SessionAuthorizer,
)
from octo_common.digest import message_id, worker_input_fingerprint
from octo_common.errors import (
    AdapterError,
    AdapterFailed,
    AdapterIndeterminate,
    DuplicateFrame,
    DurableOperationContractNotDeclared,
    FencingTokenRejected,
    IndeterminateCompensation,
    IndeterminateOperation,
    InvalidFrameHeaders,
    InvalidJournalLease,
    InvalidJournalRevision,
    InvalidKeyNonce,
    InvocationSafetyNotDeclared,
    JournalPersistenceFailed,
    MissingAdapter,
    OctoError,
    PendingCompensation,
    PendingOperation,
    ReconciliationBudgetExhausted,
    ReconciliationSessionBudgetExhausted,
    RequiresWorkerAuthenticator,
    SessionPoisoned,
    SessionReplay,
    StorageBackendError,
    UnexpectedMessage,
    UnexpectedOpeningMessage,
    UnsupportedMessage,
    ZeroPerToolReconciliationLimit,
    ZeroSessionReconciliationLimit,
)
from octo_common.frames import (
    ScopeKey,
    SessionAuthenticator,
    SessionKey,
    SessionRole,
)
from octo_common.grants import CapabilityManifest
from octo_common.ids import validate_token
from octo_common.limits import KEY_NONCE_BYTES
from octo_common.messages import (
    Cancel,
    CloseSession,
    CompensateOperation,
    CompensationResult,
    DispatchOperation,
    Invoke,
    OpenSession,
    OperationCompensationResult,
    OperationReconcileResult,
    OperationResult,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    Result,
    ToolResult,
    WorkerMessage,
    message_type,
)
from octo_common.payload import ToolPayload
from octo_common.peek import peek_operation_key
from octo_common.states import TERMINAL_KINDS, Cancelled, Failed, Pending, Running, Succeeded
from octo_worker.adapters import (
    AdapterContext,
    DurableOperationContract,
    InvocationSafety,
    WorkerAdapterRegistry,
    call_adapter_with_deadline,
)
from octo_worker.hooks import NO_HOOKS, WorkerHooks
from octo_worker.journal import (
    Existing,
    JournalChangeset,
    WorkerOperationJournal,
    WorkerOperationRecord,
)
from octo_worker.storage.documents import (
    SessionStatus,
    opening_document,
    read_session,
    state_document,
)
from octo_worker.storage.interface import (
    OutboxEntry,
    PersistedSession,
    SessionDocuments,
    WorkerCommit,
    WorkerJournalLease,
    WorkerSessionStore,
    next_commit_link,
)

__all__ = [
    "Delivery",
    "SessionStatus",
    "WorkerSession",
    "WorkerSessionLimits",
    "WorkerSessionStore",
]

_OPEN: SessionStatus = "open"
_CLOSED: SessionStatus = "closed"
_POISONED: SessionStatus = "poisoned"

_KEYED_TYPES = frozenset({"dispatch_operation", "compensate_operation", "reconcile_operation"})
_REQUEST_TYPES = frozenset(
    {"invoke", "dispatch_operation", "compensate_operation", "reconcile_operation", "cancel"}
)
_STATUS_TYPES = (Running, Succeeded, Failed, Cancelled)

_log = structlog.get_logger("octo.worker.session")


# Limits ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSessionLimits:
    """Reconciliation budgets of one session (W§10.1)."""

    per_tool: int = 16
    per_session: int = 64

    def __post_init__(self) -> None:
        # The per-tool limit is checked first (W§10.1).
        if _not_positive(self.per_tool):
            raise ZeroPerToolReconciliationLimit()
        if _not_positive(self.per_session):
            raise ZeroSessionReconciliationLimit()


def _not_positive(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


# Collaborators --------------------------------------------------------------


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


# Key locks (W§10.5) ---------------------------------------------------------


class _KeyLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


# (id(store), scope, operation key) -> lock. Shared by every session of a
# scope on one store; an entry lives only while some handling holds or waits
# for it (each holder keeps the store alive, so the id cannot be reused).
_KEY_LOCKS: dict[tuple[int, str, str], _KeyLock] = {}


@contextlib.asynccontextmanager
async def _key_lock(store: object, scope: str, key: str) -> AsyncIterator[None]:
    name = (id(store), scope, key)
    entry = _KEY_LOCKS.get(name)
    if entry is None:
        entry = _KEY_LOCKS[name] = _KeyLock()
    entry.users += 1
    try:
        async with entry.lock:
            yield
    finally:
        entry.users -= 1
        if entry.users == 0:
            del _KEY_LOCKS[name]


# Per-handling bookkeeping ----------------------------------------------------


@dataclass(eq=False)
class _InFlight:
    """One submitted commit of a session, until it is applied to memory."""

    task: asyncio.Future[int]
    started: float  # time.perf_counter() at submission
    link: int | None
    snapshot: _Snapshot
    deletes: list[str]
    # Resolved (in build order) with the revision or the failure.
    settled: asyncio.Future[int | OctoError]


def _chains(store: object) -> bool:
    """Whether ``store`` takes chained session commits (``SessionDocuments.after``)."""
    return getattr(store, "chains_session_commits", False) is True


class _CommitFailed(Exception):
    """Internal: a commit failed; the session is already poisoned in memory."""

    def __init__(self, error: OctoError) -> None:
        super().__init__(error.code)
        self.error = error


@dataclass
class _Run:
    """One call of ``handle``: the delivery, what was loaded, what the reply names."""

    delivery: Delivery
    store: WorkerSessionStore
    log: Any
    records: dict[str, tuple[WorkerOperationRecord, int] | None] | None = None
    load_error: OctoError | None = None
    request_id: str | None = None
    operation_key: str | None = None
    compensation_key: str | None = None
    kind: str = ""
    adapter_ran: bool = False
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


# What a locked section asks the caller to do once the session lock is released.


@dataclass(frozen=True)
class _Reply:
    frame: bytes = field(repr=False)
    correlation_id: str | None
    # The message id of the frame's outbox row; None for best-effort refusals
    # (nothing committed).
    outbox_id: str | None = None
    # A request_rejected; what the reply says of the request's operation key
    # (True: pending or running, False: terminal, None: nothing).
    refused: bool = False
    unresolved: bool | None = None


@dataclass(frozen=True)
class _Ack:
    pass


@dataclass(frozen=True)
class _DeadLetter:
    reason: str


@dataclass(frozen=True)
class _Requeue:
    pass


_Final: TypeAlias = _Reply | _Ack | _DeadLetter | _Requeue


@dataclass(frozen=True)
class _AdapterStep:
    """Run an adapter method outside the session lock, then ``after`` under it."""

    call: Callable[[float], Awaitable[Any]]  # gets the deadline (event-loop time)
    after: Callable[[Any, BaseException | None], Awaitable[_Final]]
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


_Step: TypeAlias = _Final | _AdapterStep


@dataclass(frozen=True)
class _Snapshot:
    """The last durable point: restored in memory when a commit fails."""

    authorizer: AuthorizerState
    total: int
    by_tool: Mapping[str, int] = field(default_factory=dict)


# The session ----------------------------------------------------------------


class WorkerSession:
    """One authenticated session of one tenant scope (W§10)."""

    def __init__(
        self,
        *,
        scope: str,
        session_id: str,
        key_nonce: bytes,
        reply_to: str,
        manifest: CapabilityManifest,
        authenticator: SessionAuthenticator,
        authorizer: SessionAuthorizer,
        status: SessionStatus,
        reconciliations_total: int,
        reconciliations_by_tool: Mapping[str, int],
        state_revision: int,
        highest_revision: int,
        lease: WorkerJournalLease,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks,
    ) -> None:
        # Built only by ``open`` and ``restore``.
        self._scope = scope
        self._session_id = session_id
        self._key_nonce = key_nonce
        self._reply_to = reply_to
        self._manifest = manifest
        self._authenticator = authenticator
        self._authorizer = authorizer
        self._status: SessionStatus = status
        self._reconciliations_total = reconciliations_total
        self._reconciliations_by_tool: dict[str, int] = dict(reconciliations_by_tool)
        self._state_revision = state_revision
        self._highest_revision = highest_revision
        self._lease = lease
        self._adapters = adapters
        self._limits = limits
        self._hooks = hooks
        self._lock = asyncio.Lock()
        self._confirmed: list[str] = []
        # Commits submitted and not yet applied to memory, oldest first; the
        # first failure (the session is poisoned from then on).
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        # Set from a failed commit until nothing is in flight any more (every
        # commit settled meanwhile fails with it); failures so far, the last.
        self._broken: OctoError | None = None
        self._failures = 0
        self._last_failure: OctoError | None = None
        self._best_effort_high = 0
        # A commit was refused by another writer's fence (W§11.3): this worker
        # no longer owns the scope and seals nothing more for this session.
        self._superseded = False
        self._durable = self._snapshot()
        self._log = _log.bind(scope=scope, session=session_id)

    def __repr__(self) -> str:
        return (
            f"WorkerSession(scope={self._scope!r}, session_id={self._session_id!r}, "
            f"status={self._status!r})"
        )

    # -- construction ----------------------------------------------------------

    @classmethod
    async def open(
        cls,
        authenticator: SessionAuthenticator,
        opening_frame: bytes,
        *,
        scope: str,
        key_nonce: bytes,
        reply_to: str,
        store: WorkerSessionStore,
        lease: WorkerJournalLease,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks = NO_HOOKS,
    ) -> WorkerSession:
        """Open a session from its authenticated ``open_session`` frame (W§10.4).

        Runs steps 1–8 in order and raises the failing step's error; the
        daemon dead-letters with its code. No reply is ever sent.
        """
        if authenticator.role != SessionRole.WORKER:
            raise RequiresWorkerAuthenticator()
        message = authenticator.open(opening_frame)
        if not isinstance(message, OpenSession):
            raise UnexpectedOpeningMessage()
        manifest = message.manifest
        authorizer = SessionAuthorizer(manifest)
        for grant in manifest.grants:
            if adapters.get(grant.tool) is None:
                raise MissingAdapter(grant.tool)
        _check_lease(lease)
        validate_token("tenant scope", scope)
        if not isinstance(key_nonce, bytes) or len(key_nonce) != KEY_NONCE_BYTES:
            raise InvalidKeyNonce()
        if not isinstance(reply_to, str) or not reply_to:
            # Every reply of the session goes to this queue (W§12.1).
            raise InvalidFrameHeaders()
        session = cls(
            scope=scope,
            session_id=authenticator.session_id,
            key_nonce=key_nonce,
            reply_to=reply_to,
            manifest=manifest,
            authenticator=authenticator,
            authorizer=authorizer,
            status=_OPEN,
            reconciliations_total=0,
            reconciliations_by_tool={},
            state_revision=0,
            highest_revision=0,
            lease=lease,
            adapters=adapters,
            limits=limits,
            hooks=hooks,
        )
        pending = session._snapshot()
        documents = SessionDocuments(
            state=session._state_document(pending),
            opening=session._opening_document(),
            base_revision=None,
        )
        revision = await session._commit_now(
            store, WorkerCommit(sessions={session.session_id: documents})
        )
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise InvalidJournalRevision(1, revision)
        session._state_revision = revision
        session._highest_revision = revision
        session._durable = pending
        session._log.info("session_opened", revision=revision, grants=len(manifest.grants))
        return session

    @classmethod
    async def restore(
        cls,
        persisted: PersistedSession,
        *,
        scope_key: ScopeKey,
        scope: str,
        store: WorkerSessionStore,
        lease: WorkerJournalLease,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks = NO_HOOKS,
    ) -> WorkerSession:
        """Rebuild a session from its persisted documents (W§10.9–10.10).

        The key is re-derived from ``scope_key`` and the persisted nonce; the
        highest seen scope revision starts at the store's head revision.
        """
        _check_lease(lease)
        stored = read_session(persisted, scope)
        session_id = persisted.session_id
        key = SessionKey.derive(scope_key, scope, session_id, stored.key_nonce)
        authenticator = SessionAuthenticator.restore(
            session_id, key, SessionRole.WORKER, stored.authenticator
        )
        authorizer = SessionAuthorizer.restore(stored.manifest, stored.authorizer)
        head = await store.head_revision(scope)
        session = cls(
            scope=scope,
            session_id=session_id,
            key_nonce=stored.key_nonce,
            reply_to=stored.reply_to,
            manifest=stored.manifest,
            authenticator=authenticator,
            authorizer=authorizer,
            status=stored.status,
            reconciliations_total=stored.reconciliations_total,
            reconciliations_by_tool=stored.reconciliations_by_tool,
            state_revision=persisted.revision,
            highest_revision=max(head, persisted.revision),
            lease=lease,
            adapters=adapters,
            limits=limits,
            hooks=hooks,
        )
        session._log.info("session_restored", status=stored.status, revision=persisted.revision)
        return session

    # -- read-only views -----------------------------------------------------------

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def status(self) -> SessionStatus:
        return self._status

    @property
    def reply_to(self) -> str:
        """The reply queue recorded at ``open_session``: every reply goes there."""
        return self._reply_to

    @property
    def key_nonce(self) -> bytes:
        return self._key_nonce

    @property
    def manifest(self) -> CapabilityManifest:
        return self._manifest

    @property
    def highest_revision(self) -> int:
        """The highest scope revision this session's commits returned (W§10.1)."""
        return self._highest_revision

    @property
    def best_effort_sequence_high(self) -> int:
        """Highest outbound sequence sealed without a commit (0 when none).

        The daemon's first commit under a new fence persists ``next_outgoing``
        past it (W§10.11 rule 2): see :meth:`persist_poisoned`.
        """
        return self._best_effort_high

    def calls_for(self, tool: str) -> int:
        return self._authorizer.calls_for(tool)

    def compensations_for(self, tool: str) -> int:
        return self._authorizer.compensations_for(tool)

    def reconciliations(self) -> tuple[int, dict[str, int]]:
        """(session total, per tool) reconciliations spent."""
        return self._reconciliations_total, dict(self._reconciliations_by_tool)

    def confirm_published(self, message_id: str) -> None:
        """Note an outbox row whose (re)publish the broker confirmed.

        It is deleted inside this session's next commit, never in a commit
        of its own (PROTOCOL.md §2.4).
        """
        if message_id not in self._confirmed:
            self._confirmed.append(message_id)

    async def release_confirmed(self, store: WorkerSessionStore) -> int:
        """Delete this session's confirmed outbox rows now, in a commit of their own.

        They otherwise go in the session's next commit (PROTOCOL.md §2.4), and
        a closed session never makes one, nor does an idle or abandoned one:
        its last replies would stay in the outbox and be republished at every
        start, for ever. W§11.4 lets deletions be batched freely; this is one
        outbox-only commit (the session state is not written), taken under the
        session lock. The daemon calls it for sessions whose rows it has just
        republished and for closed ones, never for a session poisoned in memory
        (W§10.9: it commits nothing more; its scope is reloaded).

        Returns the number of rows deleted (0, without a commit, when none is
        confirmed). A failed commit is raised; the rows stay noted.
        """
        async with self._lock:
            failures = self._failures
            if await self._drain_locked():
                raise asyncio.CancelledError()
            if self._failures != failures or not self._confirmed:
                # A commit that failed meanwhile poisoned the session: it
                # commits nothing more (W§10.9); the daemon reloads the scope.
                return 0
            deletes = list(self._confirmed)
            revision = await self._commit_now(store, WorkerCommit(outbox_delete=deletes))
            failure = self._revision_error(revision)
            if failure is not None:
                raise failure
            self._highest_revision = revision
            for done in deletes:
                with contextlib.suppress(ValueError):
                    self._confirmed.remove(done)
            return len(deletes)

    async def persist_poisoned(self, store: WorkerSessionStore, *, sealed_through: int = 0) -> int:
        """Record this (restored) session as ``poisoned`` (W§10.9 step 4, §10.11 rule 2).

        ``sealed_through`` is the replaced session's
        :attr:`best_effort_sequence_high`; ``next_outgoing`` is persisted past
        it. One session-only commit; its error propagates to the daemon.
        """
        async with self._lock:
            if self._status == _CLOSED:
                # Closed meanwhile (a close_session committed first): it stays
                # closed, and answers nothing more.
                return self._highest_revision
            self._authenticator.reserve_outgoing(sealed_through + 1)
            self._status = _POISONED
            try:
                return await self._commit_locked(store)
            except _CommitFailed as failed:
                raise failed.error from None

    # -- handling ------------------------------------------------------------------

    async def handle(self, frame: bytes, store: WorkerSessionStore, delivery: Delivery) -> None:
        """Handle one delivered frame (W§10.5–10.9). Raises only ``CancelledError``.

        Protocol, adapter and storage failures become replies, dead-letters or
        poisoning. The delivery is settled at most once: acked after the
        admission (or session-state) commit and before the adapter for
        ``dispatch_operation``/``compensate_operation``/``invoke`` and
        ``close_session``; after the reply's publish confirm for answers from
        the journal, refusals and ``reconcile_operation``; dead-lettered for
        frames that do not authenticate. ``store`` must be the same object for
        every session of the scope: key locks are shared per store object.
        """
        run = _Run(delivery=delivery, store=store, log=self._log)
        try:
            if self._status == _CLOSED:
                # W§10.11 rule 9: no open(), no state change. The close may still
                # be in flight: the frame is dropped only once it is durable.
                run.barrier = self._last_in_flight()
                await self._finish(_DeadLetter("session_closed"), run)
                return
            key = peek_operation_key(frame)
            if key is None:
                await self._handle(frame, run)
                return
            async with _key_lock(store, self._scope, key):
                try:
                    run.records = await store.load_records(self._scope, [key])
                except asyncio.CancelledError:
                    raise
                except OctoError as exc:
                    run.load_error = exc
                except Exception as exc:
                    run.load_error = StorageBackendError(type(exc).__name__)
                await self._handle(frame, run)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A defect, never a protocol answer: leave the frame to the broker.
            run.log.error("session_handle_failed", error=type(exc).__name__)
            await run.requeue()

    async def _handle(self, frame: bytes, run: _Run) -> None:
        async with self._lock:
            await self._wait_turn_locked(run.store)
            run.barrier = self._last_in_flight()
            step = await self._prologue_locked(frame, run)
        while isinstance(step, _AdapterStep):
            if step.ack_first:
                await self._ack_before_adapter(step, run)
            run.adapter_ran = run.adapter_ran or step.admission
            result, error = await self._call_adapter(step)
            async with self._lock:
                await self._wait_turn_locked(run.store)
                if self._status == _POISONED:
                    # Another handling's commit failed while this adapter ran: the
                    # session commits nothing more for requests (W§10.9); the host
                    # reconciles in a new session.
                    step = self._refuse_best_effort(run, SessionPoisoned())
                else:
                    step = await step.after(result, error)
        await self._finish(step, run)

    async def _ack_before_adapter(self, step: _AdapterStep, run: _Run) -> None:
        key = run.operation_key
        if not step.admission or key is None:
            await run.ack()
            return
        hooks = self._hooks
        hooks.after_admission_commit(self._scope, run.kind, key)
        if await run.ack():
            hooks.after_ack(self._scope, run.kind, key)

    async def _call_adapter(self, step: _AdapterStep) -> tuple[Any, BaseException | None]:
        return await call_adapter_reporting(
            step.call,
            deadline_seconds=step.deadline,
            returns=step.returns,
            scope=self._scope,
            tool=step.tool,
            method=step.method,
            effect=step.effect,
            hooks=self._hooks,
        )

    async def _finish(self, step: _Final, run: _Run) -> None:
        if isinstance(step, _Reply):
            hooks = self._hooks
            hooks.before_reply(self._scope, run.kind)
            published = await run.publish(step.frame, step.correlation_id)
            if published:
                hooks.after_reply(
                    self._scope,
                    run.kind,
                    run.operation_key,
                    step.refused,
                    step.unresolved,
                    run.acked,
                )
                if step.outbox_id is not None:
                    self.confirm_published(step.outbox_id)
                await run.ack()
            else:
                hooks.on_reply_failed(self._scope, run.kind)
                # The reply stays in the outbox and is republished after a restart.
                await run.requeue()
        elif not await self._settle_after(run):
            await run.requeue()
        elif isinstance(step, _Ack):
            await run.ack()
        elif isinstance(step, _DeadLetter):
            await run.dead_letter(step.reason)
        else:
            await run.requeue()

    def _last_in_flight(self) -> asyncio.Future[int | OctoError] | None:
        return self._in_flight[-1].settled if self._in_flight else None

    async def _settle_after(self, run: _Run) -> bool:
        """Whether the commits in flight when ``run`` began have landed (S1).

        An ack or a dead-letter that commits nothing may rest on state that
        only a commit still in flight makes durable: the window bit of a
        frame dropped as a duplicate, the close of a session whose frames
        are dropped as ``session_closed``. It waits for that commit; if the
        commit failed (the session is poisoned), the delivery is requeued
        instead, so the frame is not lost. A handling that committed itself
        finds these settled already: commits settle in build order.
        """
        barrier = run.barrier
        if barrier is None or run.settled:
            return True
        if not barrier.done():
            await asyncio.wait({barrier})  # never cancels the shared future
        return not barrier.cancelled() and isinstance(barrier.result(), int)

    async def _prologue_locked(self, frame: bytes, run: _Run) -> _Step:
        if self._status == _CLOSED:
            return _DeadLetter("session_closed")
        duplicate = False
        try:
            message: WorkerMessage = self._authenticator.open(frame)
        except DuplicateFrame as dup:
            message = dup.message
            duplicate = True
        except OctoError as exc:
            run.log.info("frame_refused", code=exc.code)
            return _DeadLetter(exc.code)
        kind = message_type(message)
        run.log = run.log.bind(type=kind, duplicate=duplicate)
        if self._status == _POISONED:
            return await self._poisoned_locked(message, kind, run)
        if duplicate:
            return await self._duplicate_locked(message, run)
        if isinstance(message, Invoke):
            return await self._invoke_locked(message, run)
        if isinstance(message, DispatchOperation):
            return await self._dispatch_locked(message, run)
        if isinstance(message, CompensateOperation):
            return await self._compensate_locked(message, run)
        if isinstance(message, ReconcileOperation):
            return await self._reconcile_locked(message, run)
        if isinstance(message, CloseSession):
            return await self._close_locked(run)
        if isinstance(message, Cancel):
            run.name_request("cancel", message.request.cancellation_id)
            return await self._refuse_locked(run, UnsupportedMessage("cancel"))
        if isinstance(message, OpenSession):
            return await self._session_only_then_dead_letter(run, SessionReplay(self._session_id))
        return await self._session_only_then_dead_letter(run, UnexpectedMessage(kind))

    # -- poisoned sessions and duplicates (W§10.7, W§10.9, §10.11 rule 3) -------------

    async def _poisoned_locked(self, message: WorkerMessage, kind: str, run: _Run) -> _Step:
        if isinstance(message, CloseSession):
            return await self._close_locked(run)
        if kind not in _REQUEST_TYPES:
            return _Ack()
        self._name_any_request(message, run)
        return self._refuse_best_effort(run, SessionPoisoned())

    def _refuse_best_effort(self, run: _Run, error: OctoError) -> _Final:
        """W§10.11 rule 3: refuse in a poisoned session, sealed and published without a commit."""
        if self._superseded:
            return _Requeue()  # see _poisoned_answer_locked
        frame = self._seal_best_effort(run, error)
        # Nothing to publish: there is no answer to wait for, so drop the frame.
        if frame is None:
            return _Ack()
        return _Reply(frame, run.request_id, None, True, _refusal_unresolved(error.code))

    def _name_any_request(self, message: WorkerMessage, run: _Run) -> None:
        if isinstance(message, Invoke):
            run.name_request("invoke", message.invocation.request_id)
        elif isinstance(message, DispatchOperation):
            run.name_request(
                "dispatch_operation", message.request.request_id, message.request.operation_key
            )
        elif isinstance(message, CompensateOperation):
            request = message.request
            run.name_request(
                "compensate_operation",
                request.request_id,
                request.operation_key,
                request.compensation_key,
            )
        elif isinstance(message, ReconcileOperation):
            run.name_request(
                "reconcile_operation", message.request.request_id, message.request.operation_key
            )
        elif isinstance(message, Cancel):
            run.name_request("cancel", message.request.cancellation_id)

    async def _duplicate_locked(self, message: WorkerMessage, run: _Run) -> _Step:
        # D5: no authorization, no budget, no adapter, no journal change.
        if isinstance(message, DispatchOperation):
            request = message.request
            run.name_request("dispatch_operation", request.request_id, request.operation_key)
            journal = self._journal_or_none(run)
            if journal is None:
                return await self._refuse_load_error(run)
            try:
                existing = journal.lookup_operation(request, self._manifest.grant(request.tool))
                if isinstance(existing.state, Pending):
                    raise PendingOperation(request.operation_key)
                answer: WorkerMessage = OperationResult(
                    OperationReconcileResult(
                        self._session_id,
                        request.request_id,
                        request.tool,
                        request.operation_key,
                        existing.state,
                    )
                )
            except OctoError as exc:
                return await self._refuse_locked(run, exc)
            return await self._respond_locked(run, answer)
        if isinstance(message, CompensateOperation):
            comp = message.request
            run.name_request(
                "compensate_operation", comp.request_id, comp.operation_key, comp.compensation_key
            )
            journal = self._journal_or_none(run)
            if journal is None:
                return await self._refuse_load_error(run)
            try:
                existing = journal.lookup_compensation(comp, self._manifest.grant(comp.tool))
                if isinstance(existing.state, Pending):
                    raise PendingCompensation(comp.operation_key)
                answer = CompensationResult(
                    OperationCompensationResult(
                        self._session_id, comp.request_id, comp.binding, existing.state
                    )
                )
            except OctoError as exc:
                return await self._refuse_locked(run, exc)
            return await self._respond_locked(run, answer)
        if isinstance(message, ReconcileOperation):
            rec = message.request
            run.name_request("reconcile_operation", rec.request_id, rec.operation_key)
            journal = self._journal_or_none(run)
            if journal is None:
                return await self._refuse_load_error(run)
            try:
                existing = journal.lookup_reconciliation(rec, self._manifest.grant(rec.tool))
                if isinstance(existing.state, Pending):
                    raise PendingOperation(rec.operation_key)
                answer = ReconciledOperation(
                    OperationReconcileResult(
                        self._session_id,
                        rec.request_id,
                        rec.tool,
                        rec.operation_key,
                        existing.state,
                    )
                )
            except OctoError as exc:
                return await self._refuse_locked(run, exc)
            return await self._respond_locked(run, answer)
        run.log.info("duplicate_dropped")
        return _Ack()

    # -- per message type (W§10.6) -------------------------------------------------

    async def _invoke_locked(self, message: Invoke, run: _Run) -> _Step:
        invocation = message.invocation
        run.name_request("invoke", invocation.request_id)
        try:
            auth = self._authorizer.authorize(invocation)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        tool = invocation.tool
        adapter = self._adapters.get(tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(tool))
        if _declaration(adapter.invocation_safety, InvocationSafety) is None:
            return await self._refuse_locked(run, InvocationSafetyNotDeclared(tool))
        try:
            await self._commit_locked(run.store)
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        grant = auth.grant

        async def after(result: Any, error: BaseException | None) -> _Final:
            return await self._after_invoke_locked(run, auth, result, error)

        return _AdapterStep(
            call=lambda deadline: adapter.invoke(
                invocation,
                grant,
                AdapterContext.for_invoke(
                    self._scope, self._session_id, invocation.request_id, deadline
                ),
            ),
            after=after,
            tool=tool,
            method="invoke",
            ack_first=True,
            deadline=self._adapters.deadline_for(tool),
            returns=ToolPayload,
            admission=False,
        )

    async def _after_invoke_locked(
        self, run: _Run, auth: AuthorizedInvocation, payload: Any, error: BaseException | None
    ) -> _Final:
        tool = auth.request.tool
        if error is not None:
            return await self._refuse_locked(run, AdapterError(tool, _adapter_code(error)))
        if not isinstance(payload, ToolPayload):
            return await self._refuse_locked(run, AdapterError(tool, AdapterFailed.code))
        try:
            result = ToolResult(self._session_id, auth.request.request_id, payload)
            self._authorizer.validate_result(auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        return await self._respond_locked(run, Result(result))

    async def _dispatch_locked(self, message: DispatchOperation, run: _Run) -> _Step:
        request = message.request
        key = request.operation_key
        run.name_request("dispatch_operation", request.request_id, key)
        try:
            auth = self._authorizer.authorize_operation(request)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log = run.log.bind(input_fingerprint=worker_input_fingerprint(request.payload))
        adapter = self._adapters.get(request.tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(request.tool))
        if _declaration(adapter.durable_operation_contract, DurableOperationContract) is None:
            return await self._refuse_locked(run, DurableOperationContractNotDeclared(request.tool))
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            admission = journal.admit(auth)
            if isinstance(admission, Existing):
                if isinstance(admission.state, Pending):
                    raise PendingOperation(key)
                result = OperationReconcileResult(
                    self._session_id, request.request_id, request.tool, key, admission.state
                )
                self._authorizer.validate_operation_result(auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        if isinstance(admission, Existing):
            run.log.info("dispatch_existing", state=str(admission.state.kind))
            return await self._respond_locked(run, OperationResult(result))
        try:
            revision = await self._commit_locked(run.store, journal=journal.changeset())
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        journal.rebase(revision)
        run.log.info("dispatch_admitted", revision=revision)
        grant = auth.grant

        async def after(status: Any, error: BaseException | None) -> _Final:
            return await self._after_dispatch_locked(run, auth, journal, status, error)

        return _AdapterStep(
            call=lambda deadline: adapter.dispatch_operation(
                request,
                grant,
                AdapterContext.for_operation(
                    self._scope, self._session_id, request.operation_key, deadline
                ),
            ),
            after=after,
            tool=request.tool,
            method="dispatch_operation",
            ack_first=True,
            deadline=self._adapters.deadline_for(request.tool),
            returns=_STATUS_TYPES,
        )

    async def _after_dispatch_locked(
        self,
        run: _Run,
        auth: AuthorizedOperationInvocation,
        journal: WorkerOperationJournal,
        status: Any,
        error: BaseException | None,
    ) -> _Final:
        request = auth.request
        key = request.operation_key
        if error is not None:
            if isinstance(error, AdapterIndeterminate):
                return await self._refuse_locked(run, IndeterminateOperation(key, "adapter"))
            return await self._refuse_locked(run, AdapterError(request.tool, _adapter_code(error)))
        # Built only when refused: this is the hot path of every dispatch.
        if not isinstance(status, _STATUS_TYPES):
            return await self._refuse_locked(run, IndeterminateOperation(key, "protocol"))
        try:
            journal.observe(auth, status)
        except OctoError:
            return await self._refuse_locked(run, IndeterminateOperation(key, "protocol"))
        try:
            result = OperationReconcileResult(
                self._session_id, request.request_id, request.tool, key, status
            )
            self._authorizer.validate_operation_result(auth, result)
            frame = self._authenticator.seal(OperationResult(result))
        except OctoError:
            # The observation is dropped: the refusal commits no journal change.
            return await self._refuse_locked(run, IndeterminateOperation(key, "protocol"))
        run.log.info("dispatch_observed", state=str(status.kind))
        return await self._commit_reply_locked(
            run, frame, journal.changeset(), unresolved=status.kind not in TERMINAL_KINDS
        )

    async def _compensate_locked(self, message: CompensateOperation, run: _Run) -> _Step:
        request = message.request
        key = request.operation_key
        run.name_request("compensate_operation", request.request_id, key, request.compensation_key)
        run.log = run.log.bind(grant_fingerprint=request.grant_fingerprint)
        try:
            auth = self._authorizer.authorize_compensation(request)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log = run.log.bind(input_fingerprint=auth.identity.input_fingerprint)
        adapter = self._adapters.get(request.tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(request.tool))
        if _declaration(adapter.durable_operation_contract, DurableOperationContract) is None:
            return await self._refuse_locked(run, DurableOperationContractNotDeclared(request.tool))
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            admission = journal.admit_compensation(auth)
            if isinstance(admission, Existing):
                if isinstance(admission.state, Pending):
                    raise PendingCompensation(key)
                result = OperationCompensationResult(
                    self._session_id, request.request_id, request.binding, admission.state
                )
                self._authorizer.validate_compensation_result(auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        if isinstance(admission, Existing):
            run.log.info("compensation_existing", state=str(admission.state.kind))
            return await self._respond_locked(run, CompensationResult(result))
        try:
            revision = await self._commit_locked(run.store, journal=journal.changeset())
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        journal.rebase(revision)
        run.log.info("compensation_admitted", revision=revision)
        grant = auth.grant

        async def after(status: Any, error: BaseException | None) -> _Final:
            return await self._after_compensate_locked(run, auth, journal, status, error)

        return _AdapterStep(
            call=lambda deadline: adapter.compensate_operation(
                request,
                grant,
                AdapterContext.for_compensation(
                    self._scope, self._session_id, request.compensation_key, deadline
                ),
            ),
            after=after,
            tool=request.tool,
            method="compensate_operation",
            ack_first=True,
            deadline=self._adapters.deadline_for(request.tool),
            returns=_STATUS_TYPES,
        )

    async def _after_compensate_locked(
        self,
        run: _Run,
        auth: AuthorizedOperationCompensation,
        journal: WorkerOperationJournal,
        status: Any,
        error: BaseException | None,
    ) -> _Final:
        request = auth.request
        key = request.operation_key
        cmp_key = request.compensation_key
        if error is not None:
            if isinstance(error, AdapterIndeterminate):
                return await self._refuse_locked(
                    run, IndeterminateCompensation(key, cmp_key, "adapter")
                )
            return await self._refuse_locked(run, AdapterError(request.tool, _adapter_code(error)))
        # Built only when refused, as for dispatch.
        if not isinstance(status, _STATUS_TYPES):
            return await self._refuse_locked(
                run, IndeterminateCompensation(key, cmp_key, "protocol")
            )
        try:
            journal.observe_compensation(auth, status)
        except OctoError:
            return await self._refuse_locked(
                run, IndeterminateCompensation(key, cmp_key, "protocol")
            )
        try:
            result = OperationCompensationResult(
                self._session_id, request.request_id, request.binding, status
            )
            self._authorizer.validate_compensation_result(auth, result)
            frame = self._authenticator.seal(CompensationResult(result))
        except OctoError:
            return await self._refuse_locked(
                run, IndeterminateCompensation(key, cmp_key, "protocol")
            )
        run.log.info("compensation_observed", state=str(status.kind))
        return await self._commit_reply_locked(
            run, frame, journal.changeset(), unresolved=status.kind not in TERMINAL_KINDS
        )

    async def _reconcile_locked(self, message: ReconcileOperation, run: _Run) -> _Step:
        request = message.request
        tool = request.tool
        run.name_request("reconcile_operation", request.request_id, request.operation_key)
        try:
            auth = self._authorizer.authorize_reconciliation(request)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            journal.validate_reconciliation(auth)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        # Session total first, then per tool (W§10.6 reconcile step 3).
        if self._reconciliations_total >= self._limits.per_session:
            return await self._refuse_locked(
                run, ReconciliationSessionBudgetExhausted(self._limits.per_session)
            )
        if self._reconciliations_by_tool.get(tool, 0) >= self._limits.per_tool:
            return await self._refuse_locked(
                run, ReconciliationBudgetExhausted(tool, self._limits.per_tool)
            )
        self._reconciliations_total += 1
        self._reconciliations_by_tool[tool] = self._reconciliations_by_tool.get(tool, 0) + 1
        adapter = self._adapters.get(tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(tool))
        grant = auth.grant

        async def after(status: Any, error: BaseException | None) -> _Final:
            return await self._after_reconcile_locked(run, auth, journal, status, error)

        # A status lookup has no effect: it may run before anything is committed
        # (S1), and the delivery is acked only after the answer is published.
        return _AdapterStep(
            call=lambda deadline: adapter.reconcile_operation(
                request,
                grant,
                AdapterContext.for_operation(
                    self._scope, self._session_id, request.operation_key, deadline
                ),
            ),
            after=after,
            tool=tool,
            method="reconcile_operation",
            ack_first=False,
            deadline=self._adapters.deadline_for(tool),
            returns=_STATUS_TYPES,
            admission=False,
            effect=False,
        )

    async def _after_reconcile_locked(
        self,
        run: _Run,
        auth: AuthorizedOperationReconciliation,
        journal: WorkerOperationJournal,
        status: Any,
        error: BaseException | None,
    ) -> _Final:
        request = auth.request
        if error is not None:
            return await self._refuse_locked(run, AdapterError(request.tool, _adapter_code(error)))
        if not isinstance(status, _STATUS_TYPES):
            return await self._refuse_locked(run, AdapterError(request.tool, AdapterFailed.code))
        try:
            journal.observe_reconciliation(auth, status)
            result = OperationReconcileResult(
                self._session_id, request.request_id, request.tool, request.operation_key, status
            )
            self._authorizer.validate_reconciliation_result(auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log.info("reconciled", state=str(status.kind))
        return await self._respond_locked(run, ReconciledOperation(result), journal.changeset())

    async def _close_locked(self, run: _Run) -> _Step:
        previous = self._status
        self._status = _CLOSED
        try:
            await self._commit_locked(run.store)
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        run.log.info("session_closed", previous=previous)
        return _Ack()

    async def _session_only_then_dead_letter(self, run: _Run, error: OctoError) -> _Step:
        # S1: the window bit is durable before the frame is dead-lettered.
        try:
            await self._commit_locked(run.store)
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        run.log.info("frame_dead_lettered", code=error.code)
        return _DeadLetter(error.code)

    # -- refuse / respond (W§10.5, W§10.8) ----------------------------------------

    async def _refuse_locked(self, run: _Run, error: OctoError) -> _Final:
        """refuse(error): seal a ``request_rejected``, commit it with the state, publish."""
        run.log.info("request_refused", code=error.code)
        assert run.request_id is not None
        try:
            frame = self._authenticator.seal(self._rejection(run, error))
        except OctoError as exc:
            # Nothing can be sent; the frame is still made durable before the ack (S1).
            run.log.warning("refusal_seal_failed", code=exc.code)
            try:
                await self._commit_locked(run.store)
            except _CommitFailed as failed:
                return self._poisoned_answer_locked(run, failed.error)
            return _Ack()
        return await self._commit_reply_locked(
            run, frame, None, refused=True, unresolved=_refusal_unresolved(error.code)
        )

    async def _refuse_load_error(self, run: _Run) -> _Final:
        # W§10.11 rule 7: a load error is refused with its code; nothing poisons.
        assert run.load_error is not None
        return await self._refuse_locked(run, run.load_error)

    async def _respond_locked(
        self, run: _Run, message: WorkerMessage, changes: JournalChangeset | None = None
    ) -> _Final:
        """respond(message, changes): seal, commit changes + state + outbox, publish."""
        try:
            frame = self._authenticator.seal(message)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        return await self._commit_reply_locked(
            run, frame, changes, unresolved=reply_unresolved(message)
        )

    async def _commit_reply_locked(
        self,
        run: _Run,
        frame: bytes,
        changes: JournalChangeset | None,
        *,
        refused: bool = False,
        unresolved: bool | None = None,
    ) -> _Final:
        entry = OutboxEntry(
            message_id=message_id(frame),
            session_id=self._session_id,
            reply_to=self._reply_to,
            correlation_id=run.request_id,
            frame=frame,
            revision=0,
        )
        try:
            await self._commit_locked(run.store, journal=changes, outbox=entry)
        except _CommitFailed as failed:
            return self._poisoned_answer_locked(run, failed.error)
        return _Reply(frame, run.request_id, entry.message_id, refused, unresolved)

    def _rejection(self, run: _Run, error: OctoError) -> RequestRejected:
        assert run.request_id is not None
        return RequestRejected(
            self._session_id,
            run.request_id,
            error.code,
            run.operation_key,
            run.compensation_key,
        )

    # -- commits and poisoning (W§10.1, W§10.9) ------------------------------------

    async def _commit_now(self, store: WorkerSessionStore, changes: WorkerCommit) -> int:
        """One commit awaited in place (opening, outbox release), reported to the hooks."""
        started = time.perf_counter()
        try:
            revision = await store.commit(self._scope, self._lease, changes)
        except OctoError as exc:
            self._hooks.on_commit_failed(self._scope, exc)
            raise
        self._hooks.after_commit(self._scope, time.perf_counter() - started)
        return revision

    async def _commit_locked(
        self,
        store: WorkerSessionStore,
        *,
        journal: JournalChangeset | None = None,
        outbox: OutboxEntry | None = None,
    ) -> int:
        """One commit of the session state (plus journal rows and an outbox row).

        Called with the session lock held; returns with it held again. The
        state document is built now, from the state as it is, so a commit
        carries every change made under the lock before it. While it is in
        flight the lock is released: the next handling builds its own commit
        and, when the store can chain (``SqliteJournalStore``), submits it at
        once on top of this one (``SessionDocuments.link``/``after``), so that
        concurrent handlings of one session share an fsync instead of queueing
        for one each. Commits settle in the order they were built; each
        caller still waits for its own durability.

        Raises ``_CommitFailed`` after poisoning the session in memory: the
        state goes back to the snapshot of the last commit that succeeded,
        and every commit built after the failed one fails with it.
        """
        cancelled = False
        failure: OctoError | None = None
        chains = _chains(store)
        if self._in_flight and not chains:
            # A store that cannot chain: one commit at a time, as built. If the
            # one waited for fails, this one was built on it and fails too (its
            # changes went with the failure's return to the durable point).
            failures = self._failures
            cancelled = await self._drain_locked()
            if self._failures != failures:
                failure = self._last_failure
        elif self._broken is not None:
            # A commit in flight has failed: this one would be built on it.
            # The changes made for it go back to the durable point as well.
            failure = self._broken
            self._back_to_durable()
        if failure is not None:
            if cancelled:
                raise asyncio.CancelledError()
            raise _CommitFailed(failure)
        deletes, self._confirmed = self._confirmed, []
        pending = self._snapshot()
        if chains:
            link: int | None = next_commit_link()
            after = self._in_flight[-1].link if self._in_flight else None
        else:
            link = after = None
        documents = SessionDocuments(
            state=self._state_document(pending),
            base_revision=None if after is not None else self._state_revision,
            link=link,
            after=after,
        )
        changes = WorkerCommit(
            journal=journal if journal else None,
            sessions={self._session_id: documents},
            outbox_insert=[outbox] if outbox is not None else [],
            outbox_delete=deletes,
        )
        commit = _InFlight(
            task=asyncio.ensure_future(store.commit(self._scope, self._lease, changes)),
            started=time.perf_counter(),
            link=link,
            snapshot=pending,
            deletes=deletes,
            settled=asyncio.get_running_loop().create_future(),
        )
        self._in_flight.append(commit)
        commit.task.add_done_callback(self._settle_commits)
        self._lock.release()
        try:
            while not commit.settled.done():
                try:
                    await asyncio.shield(commit.settled)
                except asyncio.CancelledError:
                    # The commit goes on (the store shields it) and settles
                    # this session's memory when it ends; wait for that, then stop.
                    cancelled = True
        finally:
            cancelled = await self._reacquire() or cancelled
        outcome = commit.settled.result()
        if isinstance(outcome, OctoError):
            if cancelled:
                raise asyncio.CancelledError()
            raise _CommitFailed(outcome)
        if cancelled:
            raise asyncio.CancelledError()
        return outcome

    async def _wait_turn_locked(self, store: WorkerSessionStore) -> None:
        """With a store that cannot chain, start only once no commit is in flight.

        Such a session then behaves exactly as one holding its lock through
        each commit: a handling reads the state (``poisoned`` included) as the
        last commit left it. Nothing is changed yet, so a cancellation here
        stops at once.
        """
        if not _chains(store):
            while self._in_flight:
                await asyncio.wait({self._in_flight[-1].settled})

    async def _reacquire(self) -> bool:
        """Take the session lock back, whatever happens; True if cancelled meanwhile."""
        cancelled = False
        while True:
            try:
                await self._lock.acquire()
                return cancelled
            except asyncio.CancelledError:
                cancelled = True

    async def _drain_locked(self) -> bool:
        """Wait (lock held, so nothing new is built) until no commit is in flight.

        Waits on through a cancellation, as a commit's caller does, so memory
        matches the disk before the caller stops; returns True if cancelled.
        """
        cancelled = False
        while self._in_flight:
            try:
                await asyncio.wait({self._in_flight[-1].settled})
            except asyncio.CancelledError:
                cancelled = True
        return cancelled

    def _settle_commits(self, _task: object = None) -> None:
        """Apply finished commits to memory, strictly in the order they were built."""
        while self._in_flight and self._in_flight[0].task.done():
            commit = self._in_flight.popleft()
            task = commit.task
            # Once one fails, so does every commit built on it (all those in
            # flight behind it); a commit built later starts afresh.
            failure: OctoError | None = self._broken
            revision = 0
            if task.cancelled():
                failure = failure or StorageBackendError("commit cancelled")
            elif (exc := task.exception()) is not None:
                if isinstance(exc, OctoError):
                    self._hooks.on_commit_failed(self._scope, exc)
                failure = failure or (
                    exc if isinstance(exc, OctoError) else StorageBackendError(type(exc).__name__)
                )
            else:
                self._hooks.after_commit(self._scope, time.perf_counter() - commit.started)
                if failure is None:
                    revision = task.result()
                    failure = self._revision_error(revision)
            if failure is not None:
                if isinstance(failure, FencingTokenRejected):
                    self._superseded = True
                # Its rows stay noted; a later commit (or the reload) deletes them.
                self._confirmed[:0] = [m for m in commit.deletes if m not in self._confirmed]
                if self._broken is None:
                    self._broken = self._last_failure = failure
                    self._failures += 1
                    self._poison_in_memory(failure)
                else:
                    self._status = _POISONED  # whatever a failed commit had set
                commit.settled.set_result(failure)
            else:
                self._highest_revision = revision
                self._state_revision = revision
                self._durable = commit.snapshot
                commit.settled.set_result(revision)
        if not self._in_flight:
            self._broken = None

    def _revision_error(self, revision: object) -> InvalidJournalRevision | None:
        """W§10.1: a commit must return an int above every revision seen so far."""
        if isinstance(revision, bool) or not isinstance(revision, int):
            return InvalidJournalRevision(self._highest_revision + 1, -1)
        if revision <= self._highest_revision:
            return InvalidJournalRevision(self._highest_revision + 1, revision)
        return None

    def _poison_in_memory(self, failure: OctoError) -> None:
        """W§10.9 step 1: back to the last durable point, then ``poisoned``.

        Budgets, request ids and reconciliation counters go back to the
        snapshot of the last successful commit. The authenticator is kept as
        it is: its outbound counter only ever moves forward, so a sequence
        sealed for a frame that was never committed is not reused for the
        refusal (the property W§10.11 rule 2 protects), and the window bits it
        gained belong to frames that a poisoned session answers
        ``session_poisoned`` whether or not they count as duplicates. The
        daemon's reload restores the durable window from the store.
        """
        self._back_to_durable()
        self._log.error("session_poisoned", code=failure.code)

    def _back_to_durable(self) -> None:
        durable = self._durable
        self._authorizer = SessionAuthorizer.restore(self._manifest, durable.authorizer)
        self._reconciliations_total = durable.total
        self._reconciliations_by_tool = dict(durable.by_tool)
        self._status = _POISONED

    def _poisoned_answer_locked(self, run: _Run, failure: OctoError) -> _Final:
        """W§10.9 step 2: a best-effort refusal with the failure's code, no commit.

        Not once superseded (a fence rejection, W§11.3: fail closed): the new
        owner restores the session from the store and seals from the stored
        outbound sequence, so a refusal sealed here would share its sequence
        number with the new owner's next frame, and the host would drop that
        frame as a duplicate. The delivery goes back to the broker unacked
        (the new owner answers it), or, acked already, gets no answer: the
        host times out and reconciles.
        """
        if run.request_id is None or self._superseded:
            return _Requeue()
        error = self._poison_refusal(run, failure)
        frame = self._seal_best_effort(run, error)
        if frame is None:
            return _Requeue()
        return _Reply(frame, run.request_id, None, True, _refusal_unresolved(error.code))

    @staticmethod
    def _poison_refusal(run: _Run, failure: OctoError) -> OctoError:
        revision = isinstance(failure, InvalidJournalRevision)
        if run.adapter_ran and run.kind == "dispatch_operation" and run.operation_key is not None:
            cause = "invalid_journal_revision" if revision else "journal"
            return IndeterminateOperation(run.operation_key, cause)
        if (
            run.adapter_ran
            and run.kind == "compensate_operation"
            and run.operation_key is not None
            and run.compensation_key is not None
        ):
            cause = "invalid_journal_revision" if revision else "journal"
            return IndeterminateCompensation(run.operation_key, run.compensation_key, cause)
        if revision:
            return failure
        return JournalPersistenceFailed(failure.code)

    def _seal_best_effort(self, run: _Run, error: OctoError) -> bytes | None:
        try:
            frame = self._authenticator.seal(self._rejection(run, error))
        except OctoError as exc:
            run.log.warning("refusal_seal_failed", code=exc.code)
            return None
        sequence = self._authenticator.export_state().next_outgoing - 1
        self._best_effort_high = max(self._best_effort_high, sequence)
        run.log.info("request_refused_best_effort", code=error.code, sequence=sequence)
        return frame

    # -- state -------------------------------------------------------------------

    def _snapshot(self) -> _Snapshot:
        return _Snapshot(
            authorizer=self._authorizer.export_state(),
            total=self._reconciliations_total,
            by_tool=dict(self._reconciliations_by_tool),
        )

    def _opening_document(self) -> bytes:
        return opening_document(
            self._scope, self._session_id, self._key_nonce, self._reply_to, self._manifest
        )

    def _state_document(self, snapshot: _Snapshot | None = None) -> bytes:
        """The state document (W§10.3) that a commit writes.

        Status and authenticator are read now; budgets, request ids and
        reconciliation counters come from ``snapshot`` (default: taken now).
        """
        if snapshot is None:
            snapshot = self._snapshot()
        return state_document(
            self._scope,
            self._session_id,
            self._status,
            self._authenticator.export_state(),
            snapshot.authorizer,
            snapshot.total,
            snapshot.by_tool,
        )

    def _journal_or_none(self, run: _Run) -> WorkerOperationJournal | None:
        if run.load_error is not None or run.records is None:
            if run.load_error is None:
                run.load_error = StorageBackendError("records were not loaded")
            return None
        try:
            return WorkerOperationJournal(self._scope, run.records)
        except OctoError as exc:
            run.load_error = exc
            return None


# Helpers --------------------------------------------------------------------


def _check_lease(lease: object) -> None:
    # W§10.11 rule 8: only a store-issued lease (token >= 1) is a lease.
    if not isinstance(lease, WorkerJournalLease) or lease.token < 1:
        raise InvalidJournalLease()


def _declaration(method: Callable[[], object], kind: type[enum.Enum]) -> object | None:
    """The adapter's declaration, or None: one that cannot be read, or that is not
    a member of ``kind`` (``False``, ``""``, another enum), is no declaration."""
    try:
        value = method()
    except Exception:
        return None
    return value if isinstance(value, kind) else None


def _adapter_code(error: BaseException) -> str:
    if isinstance(error, OctoError):
        return error.code
    return AdapterFailed.code


async def call_adapter_reporting(
    call: Callable[[float], Awaitable[Any]],
    *,
    deadline_seconds: float,
    returns: type[Any] | tuple[type[Any], ...],
    scope: str,
    tool: str,
    method: str,
    effect: bool,
    hooks: WorkerHooks,
) -> tuple[Any, BaseException | None]:
    """One adapter call (``call_adapter_with_deadline``), told to the hooks; (result, error).

    ``after_adapter_call`` gets the outcome (``ok``, the code of the adapter
    error the failure became, or ``cancelled`` when the worker is stopping)
    and the call's duration; ``after_effect`` runs once a method that may
    have an effect (``effect``) returned, whatever it returned. A result that
    is not a ``returns`` is the error ``AdapterFailed``. Only
    ``asyncio.CancelledError`` is raised.
    """
    started = time.perf_counter()
    outcome = "ok"
    try:
        result = await call_adapter_with_deadline(call, deadline_seconds=deadline_seconds)
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except OctoError as exc:
        outcome = exc.code
        return None, exc
    except Exception as exc:  # call_adapter_with_deadline maps every adapter failure
        outcome = AdapterFailed.code
        return None, exc
    finally:
        hooks.after_adapter_call(scope, tool, method, outcome, time.perf_counter() - started)
    if effect:
        hooks.after_effect(scope, tool, method)
    if not isinstance(result, returns):
        return None, AdapterFailed("unexpected result type")
    return result, None


# Refusals that say the journal holds the key pending (D5, W§10.6).
_PENDING_CODES: Final = frozenset({PendingOperation.code, PendingCompensation.code})


def reply_unresolved(message: WorkerMessage) -> bool | None:
    """What a reply says of its request's operation key, for the hooks.

    True: still unresolved (a status ``running``, or a refusal saying the
    journal holds the key pending, which is how a key a crash left pending
    shows up after a restart); False: resolved (a terminal status); None:
    nothing (any other refusal, any other message).
    """
    if isinstance(message, RequestRejected):
        return _refusal_unresolved(message.code)
    if isinstance(message, OperationResult | ReconciledOperation | CompensationResult):
        return message.result.status.kind not in TERMINAL_KINDS
    return None


def _refusal_unresolved(code: str) -> bool | None:
    return True if code in _PENDING_CODES else None
