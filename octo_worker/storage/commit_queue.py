"""Group commit on the event loop, for every journal backend.

Owns :class:`CommitQueue`: concurrent ``commit`` calls are queued; while no
transaction is under way the whole queue (or, without group commit, its
oldest change set) goes to the backend as one batch, which the backend runs
as ONE transaction and answers with one outcome per change set, in order.
Change sets submitted meanwhile go together in the next batch. A lone
caller goes at once (no batching delay). Each caller awaits its own
outcome, and a submitted change set is shielded from its caller's
cancellation: the batch still carries it and the queue skips only the
cancelled caller's window. Also owns :class:`StoreStats`, its counters.

It must never decide an outcome (the backend and ``changes.CommitBatch``
do), run two batches of one store at once, or leave a submitted change
set without an outcome.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

import msgspec

from octo_common.errors import OctoError
from octo_worker.storage.changes import PendingCommit, RowWrite

__all__ = ["BatchRunner", "CommitQueue", "StoreStats"]

Outcomes = Sequence[int | OctoError]
BatchRunner = Callable[[list[PendingCommit], Callable[[Outcomes], None]], None]
"""Starts one batch's transaction; calls the callback on the loop with its outcomes."""


class StoreStats(msgspec.Struct, frozen=True):
    """Counters for observability: a snapshot, not a live view."""

    transactions: int
    change_sets: int
    committed_change_sets: int
    failed_change_sets: int
    largest_batch: int
    rows_opened: int = 0
    """Rows loaded, authenticated and decrypted (every load of every namespace)."""


class CommitQueue:
    """The commit queue of one store (see the module docstring).

    ``run`` starts a batch and, on the loop, hands its outcomes to the
    callback it is given (exactly once); ``on_batch`` is told the size of
    every transaction (metrics).
    """

    def __init__(
        self,
        run: BatchRunner,
        *,
        group_commit: bool = True,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._run = run
        self._group_commit = group_commit
        self._on_batch = on_batch
        self._queue: list[PendingCommit] = []
        # ``_scheduled``: a start is on the loop's ready queue (it collects
        # every change set submitted in the same loop iteration); ``_busy``:
        # a batch is with the backend. ``idle`` is set while neither holds.
        self._scheduled = False
        self._busy = False
        self.idle = asyncio.Event()
        self.idle.set()
        self._transactions = 0
        self._change_sets = 0
        self._committed = 0
        self._failed = 0
        self._largest_batch = 0

    @property
    def stats(self) -> StoreStats:
        return StoreStats(
            self._transactions,
            self._change_sets,
            self._committed,
            self._failed,
            self._largest_batch,
        )

    async def submit(
        self,
        scope: str,
        token: int,
        writes: tuple[RowWrite, ...],
        new_sessions: tuple[str, ...],
        outbox_delete: tuple[str, ...],
    ) -> int:
        """Queue one change set; its new revision, or its error raised."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int | OctoError] = loop.create_future()
        self._queue.append(PendingCommit(scope, token, writes, new_sessions, outbox_delete, future))
        self._change_sets += 1
        if not (self._scheduled or self._busy):
            self._scheduled = True
            self.idle.clear()
            loop.call_soon(self._start)
        # Shielded by construction, as ``asyncio.shield`` would do but one
        # callback hop cheaper: the change set now belongs to the queue, and
        # ``future`` is only this caller's window on its outcome. Cancelling
        # the caller cancels that window, never the commit.
        outcome = await future
        if isinstance(outcome, OctoError):
            raise outcome
        return outcome

    def _start(self) -> None:
        """Hand the queued change sets to the backend: all of them, or the oldest."""
        self._scheduled = False
        if self._busy:
            return
        if not self._queue:
            self.idle.set()
            return
        if self._group_commit:
            batch, self._queue = self._queue, []
        else:
            batch = [self._queue.pop(0)]
        self._busy = True
        self._run(batch, functools.partial(self._done, batch))

    def _done(self, batch: Sequence[PendingCommit], outcomes: Outcomes) -> None:
        self._busy = False
        try:
            self._release(batch, outcomes)
        finally:
            # Change sets queued during this batch go at once, together.
            self._start()

    def _release(self, batch: Sequence[PendingCommit], outcomes: Outcomes) -> None:
        self._transactions += 1
        self._largest_batch = max(self._largest_batch, len(batch))
        if self._on_batch is not None:
            self._on_batch(len(batch))
        for pending, outcome in zip(batch, outcomes, strict=True):
            if pending.future.done():  # its caller was cancelled
                continue
            if isinstance(outcome, OctoError):
                self._failed += 1
            else:
                self._committed += 1
            pending.future.set_result(outcome)
