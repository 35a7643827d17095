"""Group commit on the event loop (octo_common.runtime.groupcommit), with a backend in memory.

The stores of both sides run their batches through this one queue: the
worker's journal (SQLite, PostgreSQL) and the host's ledger (SQLite,
PostgreSQL). Their own tests run it against the real databases; these pin
the queue's rules: who goes together, in which order, what a cancelled
caller or a failed backend leaves behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from octo_common.runtime.groupcommit import GroupCommit


class Backend:
    """Holds each batch until the test releases it; answers each item with item * 10."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.pending: list[tuple[list[int], Callable[[Sequence[int]], None]]] = []

    def start(self, batch: list[int], done: Callable[[Sequence[int]], None]) -> None:
        self.batches.append(batch)
        self.pending.append((batch, done))

    def release(self) -> None:
        batch, done = self.pending.pop(0)
        done([item * 10 for item in batch])


async def _turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_lone_item_goes_at_once_and_gets_its_outcome() -> None:
    backend = Backend()
    queue: GroupCommit[int, int] = GroupCommit(backend.start)
    future = queue.submit(1)
    await _turn()
    assert backend.batches == [[1]]
    assert not queue.idle.is_set()
    backend.release()
    assert await future == 10
    await _turn()
    assert queue.idle.is_set()


async def test_items_submitted_while_a_batch_runs_go_together_in_the_next() -> None:
    backend = Backend()
    queue: GroupCommit[int, int] = GroupCommit(backend.start)
    first = queue.submit(1)
    await _turn()
    later = [queue.submit(n) for n in (2, 3, 4)]
    await _turn()
    assert backend.batches == [[1]]  # one batch with the backend at a time
    backend.release()
    await _turn()
    assert backend.batches == [[1], [2, 3, 4]]
    backend.release()
    assert [await future for future in [first, *later]] == [10, 20, 30, 40]
    assert (queue.transactions, queue.submitted, queue.batched, queue.largest_batch) == (2, 4, 4, 3)


async def test_items_of_one_loop_iteration_share_the_first_batch() -> None:
    backend = Backend()
    queue: GroupCommit[int, int] = GroupCommit(backend.start)
    futures = [queue.submit(n) for n in range(5)]
    await _turn()
    assert backend.batches == [[0, 1, 2, 3, 4]]
    backend.release()
    assert [await f for f in futures] == [0, 10, 20, 30, 40]


@pytest.mark.parametrize(
    ("group", "max_batch", "sizes"), [(False, None, [1] * 5), (True, 2, [2, 2, 1])]
)
async def test_without_grouping_or_with_a_bound_batches_stay_small(
    group: bool, max_batch: int | None, sizes: list[int]
) -> None:
    backend = Backend()
    seen: list[int] = []
    queue: GroupCommit[int, int] = GroupCommit(
        backend.start, group=group, max_batch=max_batch, on_batch=seen.append
    )
    futures = [queue.submit(n) for n in range(5)]
    for _ in sizes:
        await _turn()
        backend.release()
    assert [await f for f in futures] == [0, 10, 20, 30, 40]
    assert [len(batch) for batch in backend.batches] == sizes
    assert seen == sizes
    assert [n for batch in backend.batches for n in batch] == list(range(5))  # in order


async def test_a_cancelled_caller_leaves_its_item_in_the_batch() -> None:
    backend = Backend()
    queue: GroupCommit[int, int] = GroupCommit(backend.start)
    waiter = asyncio.ensure_future(asyncio.shield(queue.submit(1)))
    mine = queue.submit(2)
    other = queue.submit(3)
    mine.cancel()
    await _turn()
    assert backend.batches == [[1, 2, 3]]  # the cancelled caller's item still goes
    backend.release()
    assert await waiter == 10 and await other == 30
    assert mine.cancelled()


async def test_a_coroutine_backend_runs_each_batch_in_a_task() -> None:
    started: list[list[int]] = []
    gate = asyncio.Event()

    async def run(batch: list[int]) -> list[int]:
        started.append(batch)
        await gate.wait()
        return [item + 1 for item in batch]

    queue = GroupCommit.running(run, lambda item, exc: -item)
    first = queue.submit(1)
    await _turn()
    rest = [queue.submit(2), queue.submit(3)]
    await _turn()
    assert started == [[1]]
    gate.set()
    assert [await f for f in [first, *rest]] == [2, 3, 4]
    assert started == [[1], [2, 3]]


async def test_a_failing_backend_fails_its_batch_and_the_queue_goes_on() -> None:
    calls: list[list[int]] = []

    async def run(batch: list[int]) -> list[str]:
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("defect")
        return [f"ok {item}" for item in batch]

    queue = GroupCommit.running(run, lambda item, exc: f"failed {item}: {type(exc).__name__}")
    first = queue.submit(1)
    assert await first == "failed 1: RuntimeError"
    assert await queue.submit(2) == "ok 2"


async def test_a_cancelled_backend_task_fails_its_batch_and_everything_queued() -> None:
    gate = asyncio.Event()
    tasks: list[asyncio.Task[object]] = []

    async def run(batch: list[int]) -> list[str]:
        task = asyncio.current_task()
        assert task is not None
        tasks.append(task)
        await gate.wait()
        return ["ok"] * len(batch)

    queue = GroupCommit.running(run, lambda item, exc: f"{item}: {type(exc).__name__}")
    first = queue.submit(1)
    await _turn()
    queued = queue.submit(2)
    tasks[0].cancel()
    assert await first == "1: CancelledError"
    assert await queued == "2: CancelledError"
    await _turn()
    assert queue.idle.is_set() and len(tasks) == 1  # nothing left to run


def test_a_batch_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_batch"):
        GroupCommit(lambda batch, done: None, max_batch=0)
