"""Group commit on the event loop: how every store of both sides batches its writes.

Owns :class:`GroupCommit`. ``submit(item)`` queues one item (a change set,
a compare-and-swap) and returns the caller's window on its outcome. While
no batch is with the backend, the queued items (all of them, at most
``max_batch``, or only the oldest without grouping) go to the backend as
one batch, which it runs as ONE transaction and answers with one outcome
per item, in order. Items submitted meanwhile go together in the next
batch; a lone item goes in the same loop iteration (no batching delay).

The backend is started one of two ways: ``GroupCommit(start)``, where
``start(batch, done)`` begins the batch (in a thread, say) and calls
``done(outcomes)`` once on the loop; or ``GroupCommit.running(run, failed)``,
where ``run(batch)`` is a coroutine returning the outcomes (its exception,
its cancellation, become ``failed(item, error)`` for every item, and a
cancellation fails what is queued too: nobody would run it).

A submitted item belongs to the queue: cancelling its caller cancels only
the caller's window (its future), never the item, and the outcome is then
dropped. The helper never decides an outcome (the backend does), never runs
two batches of one queue at once, and never leaves a submitted item without
an outcome. One event loop: the loop of the first submission.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["GroupCommit", "resolve_outcome"]

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """One store's group-commit queue (see the module docstring).

    ``on_batch(n)`` is told the number of items of every batch whose
    outcomes were handed out (metrics, progress of readers waiting for the
    writes before them). ``settle(future, outcome)`` resolves a caller's
    window from its outcome (default: the outcome is the result; a store
    whose outcomes carry errors may raise them there instead).
    """

    def __init__(
        self,
        start: Callable[[list[T], Callable[[Sequence[R]], None]], None],
        *,
        group: bool = True,
        max_batch: int | None = None,
        on_batch: Callable[[int], None] | None = None,
        settle: Callable[[asyncio.Future[Any], R], None] | None = None,
    ) -> None:
        if max_batch is not None and max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._start_batch = start
        self._limit = (max_batch if max_batch is not None else 0) if group else 1
        self._on_batch = on_batch
        self._settle = settle
        self._queue: list[tuple[T, asyncio.Future[Any]]] = []
        # ``_scheduled``: a start is on the loop's ready queue (it collects
        # every item submitted in the same loop iteration); ``_busy``: a batch
        # is with the backend. ``idle`` is set while neither holds.
        self._scheduled = False
        self._busy = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.transactions = 0
        """Batches handed to the backend."""
        self.submitted = 0
        """Items submitted."""
        self.batched = 0
        """Items the batches handed to the backend carried."""
        self.largest_batch = 0

    @classmethod
    def running(
        cls,
        run: Callable[[list[T]], Coroutine[Any, Any, Sequence[R]]],
        failed: Callable[[T, BaseException], R],
        *,
        group: bool = True,
        max_batch: int | None = None,
        on_batch: Callable[[int], None] | None = None,
        settle: Callable[[asyncio.Future[Any], R], None] | None = None,
        name: str | None = None,
    ) -> GroupCommit[T, R]:
        """A queue whose batches are coroutines ``run(batch)``, each in a task of its own."""
        queue: GroupCommit[T, R]

        def start(batch: list[T], done: Callable[[Sequence[R]], None]) -> None:
            task: asyncio.Task[Sequence[R]] = asyncio.get_running_loop().create_task(
                run(batch), name=name
            )
            task.add_done_callback(functools.partial(finish, batch, done))

        def finish(
            batch: list[T], done: Callable[[Sequence[R]], None], task: asyncio.Task[Sequence[R]]
        ) -> None:
            if task.cancelled():
                # The loop is going away: nobody will run what is queued either.
                error = asyncio.CancelledError()
                queue._abandon(lambda item: failed(item, error))
                done([failed(item, error) for item in batch])
                return
            exc = task.exception()
            if exc is not None:  # a defect of the backend must not strand its callers
                done([failed(item, exc) for item in batch])
                return
            done(task.result())

        queue = cls(start, group=group, max_batch=max_batch, on_batch=on_batch, settle=settle)
        return queue

    def submit(self, item: T) -> asyncio.Future[Any]:
        """Queue ``item``; the returned future (the caller's window) gets its outcome."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((item, future))
        self.submitted += 1
        if not (self._scheduled or self._busy):
            self._scheduled = True
            self.idle.clear()
            loop.call_soon(self._start)
        return future

    def _start(self) -> None:
        """Hand the queued items to the backend: all of them, or as many as allowed."""
        self._scheduled = False
        if self._busy:
            return
        if not self._queue:
            self.idle.set()
            return
        if self._limit and len(self._queue) > self._limit:
            taken = self._queue[: self._limit]
            del self._queue[: self._limit]
        else:
            taken, self._queue = self._queue, []
        self._busy = True
        self.transactions += 1
        self.batched += len(taken)
        self.largest_batch = max(self.largest_batch, len(taken))
        self._start_batch([item for item, _ in taken], functools.partial(self._done, taken))

    def _done(self, taken: list[tuple[T, asyncio.Future[Any]]], outcomes: Sequence[R]) -> None:
        self._busy = False
        try:
            self._release(taken, outcomes)
        finally:
            # Items queued during this batch go at once, together.
            self._start()

    def _release(self, taken: list[tuple[T, asyncio.Future[Any]]], outcomes: Sequence[R]) -> None:
        if self._on_batch is not None:
            self._on_batch(len(taken))
        settle = self._settle
        for (_, future), outcome in zip(taken, outcomes, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if settle is None:
                future.set_result(outcome)
            else:
                settle(future, outcome)

    def _abandon(self, outcome_of: Callable[[T], R]) -> None:
        """Give every queued item ``outcome_of(item)``: nothing will run them."""
        left, self._queue = self._queue, []
        if left:
            self._release(left, [outcome_of(item) for item, _ in left])


def resolve_outcome(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    """Resolve ``future`` from an ``(ok, value)`` outcome: the value, or the exception
    raised there (a ``settle`` for stores whose outcomes carry their errors)."""
    if future.done():  # its awaiting task was cancelled; the work still ran
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)
