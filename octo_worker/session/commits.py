"""The commits of one worker session, in the order they were built.

:class:`SessionCommits` submits each commit of a session (its state
document and the request rows of the request ids retained since the
previous commit, with the journal rows and the outbox row of the handling
that built it), settles them strictly in build order, and keeps what the
session needs to know about them: the revision of its state row, the highest scope
revision seen, the outbox rows confirmed since (deleted inside the
next commit, never in one of their own), and the first failure.

While a commit is in flight the session lock is released, so the next
handling builds its own commit; with a store that chains session commits
(``chains_session_commits``) it is submitted at once on top of the one in
flight and the two share a transaction; with any other store commits go one
at a time. A failed commit poisons the session in memory: its budgets,
request ids and counters go back to the last durable point (the session
does that, through the callables it hands over), and every commit built on the failed
one fails with it.

It must never decide what a frame gets, publish anything, or let a
caller's cancellation leave memory out of step with what the store holds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from octo_common.authorizer import AuthorizerCheckpoint, CompensationIdentity
from octo_common.errors import (
    FencingTokenRejected,
    InvalidJournalRevision,
    OctoError,
    StorageBackendError,
)
from octo_worker.hooks import WorkerHooks
from octo_worker.journal import JournalChangeset
from octo_worker.session.rules import POISONED
from octo_worker.session.state import SessionState
from octo_worker.storage.documents import state_document
from octo_worker.storage.interface import (
    OutboxEntry,
    RequestRow,
    SessionDocuments,
    WorkerCommit,
    WorkerJournalLease,
    WorkerSessionStore,
    next_commit_link,
)

__all__ = ["CommitFailed", "DurablePoint", "SessionCommits"]


@dataclass(frozen=True, slots=True)
class DurablePoint:
    """What a failed commit restores in memory: budgets, request ids, counters.

    ``authorizer`` counts the retained request ids (their rows are the
    store's); it never holds them, so taking a point costs the same whatever
    their number.
    """

    authorizer: AuthorizerCheckpoint
    total: int
    by_tool: Mapping[str, int]


class CommitFailed(Exception):
    """A commit failed; the session is already poisoned in memory."""

    def __init__(self, error: OctoError) -> None:
        super().__init__(error.code)
        self.error = error


@dataclass(eq=False)
class _InFlight:
    """One submitted commit of a session, until it is applied to memory."""

    task: asyncio.Future[int]
    started: float  # time.perf_counter() at submission
    link: int | None
    point: DurablePoint
    deletes: list[str]
    # Request rows the store holds once this commit landed.
    rows: int
    # Resolved (in build order) with the revision or the failure.
    settled: asyncio.Future[int | OctoError]


def _chains(store: object) -> bool:
    """Whether ``store`` takes chained session commits (``SessionDocuments.after``)."""
    return getattr(store, "chains_session_commits", False) is True


class SessionCommits:
    """The commit pipeline of one session (see the module docstring)."""

    def __init__(
        self,
        *,
        state: SessionState,
        lease: WorkerJournalLease,
        lock: asyncio.Lock,
        hooks: WorkerHooks,
        log: Any,
        state_revision: int,
        highest_revision: int,
        request_rows: int,
    ) -> None:
        # The session's state: what a commit writes and a failure restores.
        self._state = state
        self._scope = state.scope
        self._session_id = state.session_id
        self._lease = lease
        self._lock = lock
        self._hooks = hooks
        self._log = log
        self.state_revision = state_revision
        self.highest_revision = highest_revision
        self._durable = self.durable_point()
        # Request rows the store holds as of the durable point, and as of the
        # last commit built: each commit inserts the rows of the request ids
        # retained since the one before it (so its cost never depends on how
        # many the session retains). A state read in format 1 has none yet:
        # its first commit inserts them all.
        self._durable_rows = request_rows
        self._rows_built = request_rows
        # Outbox rows whose publish the broker confirmed, deleted in the next commit.
        self.confirmed: list[str] = []
        # Commits submitted and not yet applied to memory, oldest first.
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        # Set from a failed commit until nothing is in flight any more (every
        # commit settled meanwhile fails with it); failures so far, the last.
        self._broken: OctoError | None = None
        self.failures = 0
        self._last_failure: OctoError | None = None
        # A commit was refused by another writer's fence: this worker
        # no longer owns the scope and seals nothing more for this session.
        self.superseded = False

    def opened(self, revision: int, point: DurablePoint) -> None:
        """The session's opening commit landed at ``revision``."""
        self.state_revision = revision
        self.highest_revision = revision
        self._durable = point
        self._durable_rows = self._rows_built = point.authorizer.retained

    def confirm(self, message_id: str) -> None:
        if message_id not in self.confirmed:
            self.confirmed.append(message_id)

    # -- the session's state as a commit writes it, and back after a failure -----------

    def durable_point(self) -> DurablePoint:
        """The session's budgets, request ids and counters now."""
        state = self._state
        return DurablePoint(
            authorizer=state.authorizer.checkpoint(),
            total=state.reconciliations_total,
            by_tool=dict(state.reconciliations_by_tool),
        )

    def state_document(self, point: DurablePoint | None = None) -> bytes:
        """The state document a commit writes.

        Status and authenticator are read now; budgets, the count of retained
        request ids and reconciliation counters come from ``point`` (default:
        taken now).
        """
        if point is None:
            point = self.durable_point()
        state = self._state
        return state_document(
            state.scope,
            state.session_id,
            state.status,
            state.authenticator.export_state(),
            point.authorizer,
            point.total,
            point.by_tool,
        )

    def _retained_rows(self, start: int) -> list[tuple[str, CompensationIdentity | None]]:
        """The retained request ids from ``start`` on, each with the identity it admitted."""
        return self._state.authorizer.retained_rows(start)

    def _go_back(self, point: DurablePoint) -> None:
        """Back to ``point``, poisoned (a commit failed)."""
        state = self._state
        state.authorizer = state.authorizer.rewound(point.authorizer)
        state.reconciliations_total = point.total
        state.reconciliations_by_tool = dict(point.by_tool)
        state.status = POISONED

    def _mark_poisoned(self) -> None:
        self._state.status = POISONED

    @property
    def broken(self) -> bool:
        """A commit failed and commits built on it are still in flight (they fail too)."""
        return self._broken is not None

    def last_in_flight(self) -> asyncio.Future[int | OctoError] | None:
        return self._in_flight[-1].settled if self._in_flight else None

    async def commit_now(self, store: WorkerSessionStore, changes: WorkerCommit) -> int:
        """One commit awaited in place (opening, outbox release), reported to the hooks."""
        started = time.perf_counter()
        try:
            revision = await store.commit(self._scope, self._lease, changes)
        except OctoError as exc:
            self._hooks.on_commit_failed(self._scope, exc)
            raise
        self._hooks.after_commit(self._scope, time.perf_counter() - started)
        return revision

    async def release_confirmed(self, store: WorkerSessionStore) -> int:
        """Delete the confirmed outbox rows now, in an outbox-only commit, under the lock.

        Returns the number of rows deleted (0, without a commit, when none is
        confirmed or a commit failed meanwhile: a poisoned session commits
        nothing more). A failed commit is raised; the rows stay noted.
        """
        async with self._lock:
            failures = self.failures
            if await self.drain_locked():
                raise asyncio.CancelledError()
            if self.failures != failures or not self.confirmed:
                return 0
            deletes = list(self.confirmed)
            revision = await self.commit_now(store, WorkerCommit(outbox_delete=deletes))
            failure = self.revision_error(revision)
            if failure is not None:
                raise failure
            self.highest_revision = revision
            for done in deletes:
                with contextlib.suppress(ValueError):
                    self.confirmed.remove(done)
            return len(deletes)

    async def commit_locked(
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
        flight the lock is released (see the module docstring). Commits
        settle in the order they were built; each caller still waits for its
        own durability.

        Raises :class:`CommitFailed` after poisoning the session in memory:
        the state goes back to the point of the last commit that succeeded,
        and every commit built after the failed one fails with it.
        """
        cancelled = False
        failure: OctoError | None = None
        chains = _chains(store)
        if self._in_flight and not chains:
            # A store that cannot chain: one commit at a time, as built. If the
            # one waited for fails, this one was built on it and fails too (its
            # changes went with the failure's return to the durable point).
            failures = self.failures
            cancelled = await self.drain_locked()
            if self.failures != failures:
                failure = self._last_failure
        elif self._broken is not None:
            # A commit in flight has failed: this one would be built on it.
            # The changes made for it go back to the durable point as well.
            failure = self._broken
            self._back_to_durable()
        if failure is not None:
            if cancelled:
                raise asyncio.CancelledError()
            raise CommitFailed(failure)
        deletes = self.confirmed
        point = self.durable_point()
        start, rows = self._rows_built, point.authorizer.retained
        requests = tuple(
            RequestRow(position, request_id, compensation)
            for position, (request_id, compensation) in enumerate(
                self._retained_rows(start)[: rows - start], start
            )
        )
        if chains:
            link: int | None = next_commit_link()
            after = self._in_flight[-1].link if self._in_flight else None
        else:
            link = after = None
        documents = SessionDocuments(
            state=self.state_document(point),
            base_revision=None if after is not None else self.state_revision,
            link=link,
            after=after,
            requests=requests,
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
            point=point,
            deletes=deletes,
            rows=rows,
            settled=asyncio.get_running_loop().create_future(),
        )
        self._in_flight.append(commit)
        # Only a commit now in flight carries these deletes and request rows.
        self.confirmed = []
        self._rows_built = rows
        commit.task.add_done_callback(self._settle)
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
            raise CommitFailed(outcome)
        if cancelled:
            raise asyncio.CancelledError()
        return outcome

    async def wait_turn_locked(
        self, store: WorkerSessionStore
    ) -> asyncio.Future[int | OctoError] | None:
        """With a store that cannot chain, start only once no commit is in flight.

        Such a session then behaves exactly as one holding its lock through
        each commit: a handling reads the state (``poisoned`` included) as the
        last commit left it. Nothing is changed yet, so a cancellation here
        stops at once. Returns the last commit still in flight (what an ack or
        a dead-letter that commits nothing rests on), or None.
        """
        if not _chains(store):
            while self._in_flight:
                await asyncio.wait({self._in_flight[-1].settled})
        return self._in_flight[-1].settled if self._in_flight else None

    async def drain_locked(self) -> bool:
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

    def revision_error(self, revision: object) -> InvalidJournalRevision | None:
        """A commit must return an int above every revision seen so far."""
        if isinstance(revision, bool) or not isinstance(revision, int):
            return InvalidJournalRevision(self.highest_revision + 1, -1)
        if revision <= self.highest_revision:
            return InvalidJournalRevision(self.highest_revision + 1, revision)
        return None

    async def _reacquire(self) -> bool:
        """Take the session lock back, whatever happens; True if cancelled meanwhile."""
        cancelled = False
        while True:
            try:
                await self._lock.acquire()
                return cancelled
            except asyncio.CancelledError:
                cancelled = True

    def _settle(self, _task: object = None) -> None:
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
                    failure = self.revision_error(revision)
            if failure is not None:
                if isinstance(failure, FencingTokenRejected):
                    self.superseded = True
                # Its rows stay noted; a later commit (or the reload) deletes them.
                self.confirmed[:0] = [m for m in commit.deletes if m not in self.confirmed]
                if self._broken is None:
                    self._broken = self._last_failure = failure
                    self.failures += 1
                    self._poison_in_memory(failure)
                else:
                    self._mark_poisoned()
                commit.settled.set_result(failure)
            else:
                self.highest_revision = revision
                self.state_revision = revision
                self._durable = commit.point
                self._durable_rows = commit.rows
                commit.settled.set_result(revision)
        if not self._in_flight:
            self._broken = None

    def _poison_in_memory(self, failure: OctoError) -> None:
        """Back to the last durable point, then ``poisoned``.

        Budgets, request ids and reconciliation counters go back to the
        point of the last successful commit. The authenticator is kept as it
        is: its outbound counter only ever moves forward, so a sequence
        sealed for a frame that was never committed is not reused for the
        refusal (no sequence is ever sealed twice), and the window bits it
        gained belong to frames that a poisoned session answers
        ``session_poisoned`` whether or not they count as duplicates. The
        daemon's reload restores the durable window from the store.
        """
        self._back_to_durable()
        self._log.error("session_poisoned", code=failure.code)

    def _back_to_durable(self) -> None:
        """Memory back to the last durable point; the next commit inserts the
        request rows retained since that point."""
        self._go_back(self._durable)
        self._rows_built = self._durable_rows
