"""One authenticated worker session and its effect ordering.

A :class:`WorkerSession` owns, for one session of one tenant scope: the
worker-role authenticator (replay window, outbound sequence), the
``SessionAuthorizer`` (budgets, request ids, compensation identities), the
reconciliation counters and the session status (``open``, ``closed``,
``poisoned``). ``handle`` turns one delivered frame into exactly the commits,
adapter calls, replies, acks and dead-letters the protocol prescribes:

* every frame ``open()`` accepted is made durable (window, budgets) before the
  delivery is acked, dead-lettered or answered and before any effectful
  adapter method runs; a reply is committed to the outbox with the state
  document recording its sequence before it is published;
* ``store.commit`` is called exactly once per admission, observation,
  respond, refuse or session-only commit, and confirmed outbox rows are
  deleted only inside such a commit, never in one of their own;
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
  durable point, and the refusal naming the failure is committed (the
  status ``poisoned`` and the refusal's sequence with it) before it is
  published, so no sequence is ever published that a session restored
  after a crash could seal again; the daemon then reloads the scope.

A session owns its parts: its state (:mod:`octo_worker.session.state`),
its decisions, which say purely what each frame gets, as steps
(:mod:`octo_worker.session.decisions`, :mod:`octo_worker.session.steps`),
and its commit pipeline (:mod:`octo_worker.session.commits`); the status
rules are :mod:`octo_worker.session.rules`. This module builds sessions
(``open``, ``restore``) and is the one driver of a handling: the key lock,
the load, the decisions' commit steps under the session lock, the ack, the
adapter call outside it, the reply.

It persists through the store and publishes through the delivery;
it must never send anything that was not committed first, never run an
adapter twice for one admission, never put keys, payloads, failure messages
or adapter text in a document, a log line or a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any, Final

import structlog

from octo_common.authorizer import SessionAuthorizer
from octo_common.errors import (
    AdapterFailed,
    InvalidFrameHeaders,
    InvalidJournalLease,
    InvalidJournalRevision,
    InvalidKeyNonce,
    MissingAdapter,
    OctoError,
    ReplyQueueNotAllowed,
    RequiresWorkerAuthenticator,
    SessionPoisoned,
    StorageBackendError,
    UnexpectedOpeningMessage,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.ids import validate_token
from octo_common.limits import KEY_NONCE_BYTES
from octo_common.messages import OpenSession
from octo_common.peek import peek_operation_key
from octo_worker.adapters.contract import WorkerAdapterRegistry, call_adapter_with_deadline
from octo_worker.hooks import NO_HOOKS, WorkerHooks
from octo_worker.session.commits import CommitFailed, SessionCommits
from octo_worker.session.decisions import SessionDecisions, WorkerSessionLimits, reply_unresolved
from octo_worker.session.rules import CLOSED, CLOSED_REASON, OPEN, POISONED, refused_delivery
from octo_worker.session.state import SessionState
from octo_worker.session.steps import (
    Ack,
    AdapterStep,
    Commit,
    DeadLetter,
    Delivery,
    Drain,
    FinalStep,
    Handled,
    Handling,
    Reply,
    Step,
)
from octo_worker.storage.documents import (
    SessionStatus,
    opening_document,
    read_session,
)
from octo_worker.storage.interface import (
    PersistedSession,
    SessionDocuments,
    WorkerCommit,
    WorkerJournalLease,
    WorkerSessionStore,
)

__all__ = [
    "Delivery",
    "Handled",
    "SessionStatus",
    "WorkerSession",
    "WorkerSessionLimits",
    "WorkerSessionStore",
    "call_adapter_reporting",
    "reply_unresolved",
]

_log = structlog.get_logger("octo.worker.session")


class WorkerSession:
    """One authenticated session of one tenant scope."""

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
        request_rows: int,
        lease: WorkerJournalLease,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks,
    ) -> None:
        # Built only by ``open`` and ``restore``.
        self._state = SessionState(
            scope=scope,
            session_id=session_id,
            key_nonce=key_nonce,
            reply_to=reply_to,
            manifest=manifest,
            authenticator=authenticator,
            authorizer=authorizer,
            status=status,
            reconciliations_total=reconciliations_total,
            reconciliations_by_tool=dict(reconciliations_by_tool),
        )
        # What the daemon routes and replies by, fixed for the session's life
        # (plain attributes: reading them calls nothing). ``reply_to`` is the
        # queue recorded at ``open_session``: every reply goes there.
        self.scope: Final = scope
        self.session_id: Final = session_id
        self.key_nonce: Final = key_nonce
        self.reply_to: Final = reply_to
        self._hooks = hooks
        self._lock = asyncio.Lock()
        self._log = _log.bind(scope=scope, session=session_id)
        self._commits = SessionCommits(
            state=self._state,
            lease=lease,
            lock=self._lock,
            hooks=hooks,
            log=self._log,
            state_revision=state_revision,
            highest_revision=highest_revision,
            request_rows=request_rows,
        )
        self._decisions = SessionDecisions(
            self._state, commits=self._commits, adapters=adapters, limits=limits
        )

    def __repr__(self) -> str:
        return (
            f"WorkerSession(scope={self._state.scope!r}, session_id={self._state.session_id!r}, "
            f"status={self._state.status!r})"
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
        allowed_reply_queues: AbstractSet[str] = frozenset(),
    ) -> WorkerSession:
        """Open a session from its authenticated ``open_session`` frame.

        Runs steps 1–8 in order and raises the failing step's error; the
        daemon dead-letters with its code. No reply is ever sent. The
        delivery's ``reply_to`` becomes the session's one reply queue only
        when it is the queue sealed into the frame, or (for a frame that
        seals none) one of ``allowed_reply_queues``: a copy of the frame
        republished with a queue of someone else's is ``ReplyQueueNotAllowed``.
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
            # Every reply of the session goes to this queue.
            raise InvalidFrameHeaders()
        bound = message.reply_to
        if reply_to != bound and (bound is not None or reply_to not in allowed_reply_queues):
            raise ReplyQueueNotAllowed()
        if message.payload_codec is not None:
            # Every later frame of the session, both ways, is an envelope.
            authenticator.use_payload_codec()
        session = cls(
            scope=scope,
            session_id=authenticator.session_id,
            key_nonce=key_nonce,
            reply_to=reply_to,
            manifest=manifest,
            authenticator=authenticator,
            authorizer=authorizer,
            status=OPEN,
            reconciliations_total=0,
            reconciliations_by_tool={},
            state_revision=0,
            highest_revision=0,
            request_rows=0,
            lease=lease,
            adapters=adapters,
            limits=limits,
            hooks=hooks,
        )
        point = session._commits.durable_point()
        documents = SessionDocuments(
            state=session._commits.state_document(point),
            opening=opening_document(
                scope,
                session.session_id,
                key_nonce,
                reply_to,
                session.manifest,
                message.payload_codec,
            ),
            base_revision=None,
        )
        revision = await session._commits.commit_now(
            store, WorkerCommit(sessions={session.session_id: documents})
        )
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise InvalidJournalRevision(1, revision)
        session._commits.opened(revision, point)
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
        """Rebuild a session from its persisted documents.

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
        if stored.payload_codec is not None:
            authenticator.use_payload_codec()
        authorizer = SessionAuthorizer.restore(
            stored.manifest, stored.authorizer, admitted=stored.admitted
        )
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
            request_rows=stored.request_rows,
            lease=lease,
            adapters=adapters,
            limits=limits,
            hooks=hooks,
        )
        session._log.info("session_restored", status=stored.status, revision=persisted.revision)
        return session

    # -- read-only views -----------------------------------------------------------

    @property
    def status(self) -> SessionStatus:
        return self._state.status

    @property
    def manifest(self) -> CapabilityManifest:
        return self._state.manifest

    @property
    def highest_revision(self) -> int:
        """The highest scope revision this session's commits returned."""
        return self._commits.highest_revision

    @property
    def commit_failed(self) -> bool:
        """Whether a commit of this session failed since it was opened or restored:
        its scope is reloaded under a fresh fence."""
        return self._commits.failures > 0

    def calls_for(self, tool: str) -> int:
        return self._state.authorizer.calls_for(tool)

    def compensations_for(self, tool: str) -> int:
        return self._state.authorizer.compensations_for(tool)

    def reconciliations(self) -> tuple[int, dict[str, int]]:
        """(session total, per tool) reconciliations spent."""
        return self._state.reconciliations_total, dict(self._state.reconciliations_by_tool)

    def confirm_published(self, message_id: str) -> None:
        """Note an outbox row whose (re)publish the broker confirmed.

        It is deleted inside this session's next commit, never in a commit
        of its own.
        """
        self._commits.confirm(message_id)

    async def release_confirmed(self, store: WorkerSessionStore) -> int:
        """Delete this session's confirmed outbox rows now, in a commit of their own.

        They otherwise go in the session's next commit, and
        a closed session never makes one, nor does an idle or abandoned one:
        its last replies would stay in the outbox and be republished at every
        start, for ever. Deletions may be batched freely; this is one
        outbox-only commit (the session state is not written), taken under the
        session lock. The daemon calls it for sessions whose rows it has just
        republished and for closed ones, never for a session poisoned in memory
        (it commits nothing more; its scope is reloaded).

        Returns the number of rows deleted (0, without a commit, when none is
        confirmed). A failed commit is raised; the rows stay noted.
        """
        return await self._commits.release_confirmed(store)

    @property
    def next_outgoing(self) -> int:
        """The sequence this session would seal next (in memory: best-effort refusals
        included)."""
        return self._state.authenticator.export_state().next_outgoing

    async def persist_poisoned(self, store: WorkerSessionStore, *, reserve: int = 0) -> int:
        """Record this (restored) session as ``poisoned``, its outbound counter at least
        ``reserve`` (so no sequence it may have published is sealed again).

        ``reserve``: the next sequence of the session as it was in memory before
        the reload, past every refusal it published best-effort without a commit.
        One session-only commit, unless the store holds it ``closed`` (a close
        committed first: it stays closed and answers nothing more) or
        ``poisoned`` already with nothing to reserve. Its error propagates to
        the daemon.
        """
        async with self._lock:
            if self._state.status == CLOSED:
                return self._commits.highest_revision
            if self._state.status == POISONED and reserve <= self.next_outgoing:
                return self._commits.highest_revision
            self._state.authenticator.reserve_outgoing(reserve)
            self._state.status = POISONED
            try:
                return await self._commits.commit_locked(store)
            except CommitFailed as failed:
                raise failed.error from None

    # -- handling ------------------------------------------------------------------

    async def handle(
        self,
        frame: bytes,
        store: WorkerSessionStore,
        delivery: Delivery,
        *,
        opening: bool = False,
        nonce_matches: bool = True,
    ) -> Handled:
        """Handle one delivered frame. Raises only ``CancelledError``, and the error of a
        failed dead-letter of a delivery the session refuses outright.

        ``opening``: the frame is an ``open_session``; ``nonce_matches``: the
        delivery names the session's own key nonce. A delivery the session
        does not take (``rules.refused_delivery``) is dead-lettered with its
        reason, its frame unopened.

        Protocol, adapter and storage failures become replies, dead-letters or
        poisoning. The delivery is settled at most once: acked after the
        admission (or session-state) commit and before the adapter for
        ``dispatch_operation``/``compensate_operation``/``invoke`` and
        ``close_session``; after the reply's publish confirm for answers from
        the journal, refusals and the lookups (``reconcile_operation``,
        ``reconcile_compensation``); dead-lettered for frames that do not
        authenticate. ``store`` must be the same object for
        every session of the scope: key locks are shared per store object.
        Returns what the session is once it handled the frame (``Handled``: its
        status, whether a commit of it failed), which the daemon decides on.
        """
        refused = refused_delivery(self._state.status, opening, nonce_matches)
        if refused is not None:
            await delivery.dead_letter(refused)
        else:
            await self._handle_frame(frame, store, delivery)
        return Handled(self._state.status, self._commits.failures > 0)

    async def _handle_frame(
        self, frame: bytes, store: WorkerSessionStore, delivery: Delivery
    ) -> None:
        run = Handling(delivery=delivery, store=store, log=self._log)
        try:
            if self._state.status == CLOSED:
                # A closed session opens nothing and changes nothing. The close may still
                # be in flight: the frame is dropped only once it is durable.
                run.barrier = self._commits.last_in_flight()
                await self._finish(DeadLetter(CLOSED_REASON), run)
                return
            if self._state.authenticator.payload_codec:
                # Out of its envelope first: the key is read from the frame.
                try:
                    frame = self._state.authenticator.unwrap(frame)
                except OctoError as exc:
                    run.log.info("frame_refused", code=exc.code)
                    await self._finish(DeadLetter(exc.code), run)
                    return
            key = peek_operation_key(frame)
            if key is None:
                await self._handle(frame, run)
                return
            async with key_lock(store, self._state.scope, key):
                try:
                    run.records = await store.load_records(self._state.scope, [key])
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
            await _requeue(run)

    async def _handle(self, frame: bytes, run: Handling) -> None:
        """The one driver: the decisions' steps run in order, the lock held but for the
        adapter call (and for each commit while it is in flight)."""
        async with self._lock:
            run.barrier = await self._commits.wait_turn_locked(run.store)
            step = await self._run_locked(self._decisions.answer(frame, run), run)
        while isinstance(step, AdapterStep):
            if step.ack_first:
                await self._ack_before_adapter(step, run)
            run.adapter_ran = run.adapter_ran or step.admission
            result, error = await call_adapter_reporting(step, self._state.scope, self._hooks)
            async with self._lock:
                await self._commits.wait_turn_locked(run.store)
                if self._state.status == POISONED:
                    # Another handling's commit failed while this adapter ran: the
                    # session records nothing more for requests; the host
                    # reconciles in a new session.
                    after: Step = self._decisions.refuse_poisoned(run, SessionPoisoned())
                else:
                    after = step.after(result, error)
                step = await self._run_locked(after, run)
        await self._finish(step, run)

    async def _run_locked(self, step: Step, run: Handling) -> FinalStep | AdapterStep:
        """Run the commits (and drains) the decisions ask for, lock held, until a step
        that needs the lock released: an adapter call or the end of the handling."""
        while True:
            if isinstance(step, Commit):
                try:
                    revision = await self._commits.commit_locked(
                        run.store, journal=step.journal, outbox=step.outbox
                    )
                except CommitFailed as failed:
                    step = step.failed(failed.error)
                else:
                    step = step.then(revision)
            elif isinstance(step, Drain):
                if await self._commits.drain_locked():
                    raise asyncio.CancelledError()
                step = step.then()
            else:
                return step

    async def _ack_before_adapter(self, step: AdapterStep, run: Handling) -> None:
        key = run.operation_key
        if not step.admission or key is None:
            await _ack(run)
            return
        hooks = self._hooks
        hooks.after_admission_commit(self._state.scope, run.kind, key)
        if await _ack(run):
            hooks.after_ack(self._state.scope, run.kind, key)

    async def _finish(self, step: FinalStep, run: Handling) -> None:
        if isinstance(step, Reply):
            hooks = self._hooks
            hooks.before_reply(self._state.scope, run.kind, run.operation_key, step.unresolved)
            published = await _publish(run, step.frame, step.correlation_id)
            if published:
                hooks.after_reply(
                    self._state.scope, run.kind, run.operation_key, step.refused, run.acked
                )
                if step.outbox_id is not None:
                    self.confirm_published(step.outbox_id)
                await _ack(run)
            else:
                hooks.on_reply_failed(self._state.scope, run.kind)
                # The reply stays in the outbox and is republished after a restart.
                await _requeue(run)
        elif not await self._settle_after(run):
            await _requeue(run)
        elif isinstance(step, Ack):
            await _ack(run)
        elif isinstance(step, DeadLetter):
            await _dead_letter(run, step.reason)
        else:
            await _requeue(run)

    async def _settle_after(self, run: Handling) -> bool:
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


# Helpers --------------------------------------------------------------------


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


async def _ack(run: Handling) -> bool:
    """Ack the delivery unless it is settled; True if this call acked it."""
    if run.settled:
        return False
    run.settled = True
    try:
        await run.delivery.ack()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        # The broker redelivers an unacked frame; the window and the journal
        # resolve the redelivery, so a lost ack is safe.
        run.log.warning("delivery_ack_failed", error=type(exc).__name__)
        return False
    run.acked = True
    return True


async def _dead_letter(run: Handling, reason: str) -> None:
    if run.settled:
        return
    run.settled = True
    try:
        await run.delivery.dead_letter(reason)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.log.warning("delivery_dead_letter_failed", reason=reason, error=type(exc).__name__)


async def _requeue(run: Handling) -> None:
    if run.settled:
        return
    requeue = getattr(run.delivery, "requeue", None)
    if requeue is None:
        # Left unsettled: the broker redelivers when the channel closes.
        return
    run.settled = True
    try:
        await requeue()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.log.warning("delivery_requeue_failed", error=type(exc).__name__)


async def _publish(run: Handling, frame: bytes, correlation_id: str | None) -> bool:
    try:
        await run.delivery.reply(frame, correlation_id)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        run.log.warning("reply_publish_failed", error=type(exc).__name__)
        return False
    return True


def _check_lease(lease: object) -> None:
    # Only a store-issued lease (token >= 1) is a lease.
    if not isinstance(lease, WorkerJournalLease) or lease.token < 1:
        raise InvalidJournalLease()


async def call_adapter_reporting(
    step: AdapterStep, scope: str, hooks: WorkerHooks
) -> tuple[Any, BaseException | None]:
    """The step's adapter call (``call_adapter_with_deadline``), told to the hooks.

    Returns (result, error). ``after_adapter_call`` gets the outcome (``ok``,
    the code of the adapter error the failure became, or ``cancelled`` when
    the worker is stopping) and the call's duration; ``after_effect`` runs
    once a method that may have an effect returned, whatever it returned. A
    result that is not one of ``step.returns`` is the error ``AdapterFailed``.
    Only ``asyncio.CancelledError`` is raised.
    """
    started = time.perf_counter()
    outcome = "ok"
    try:
        result = await call_adapter_with_deadline(step.call, deadline_seconds=step.deadline)
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
        hooks.after_adapter_call(
            scope, step.tool, step.method, outcome, time.perf_counter() - started
        )
    if step.effect:
        hooks.after_effect(scope, step.tool, step.method)
    if not isinstance(result, step.returns):
        return None, AdapterFailed("unexpected result type")
    return result, None
