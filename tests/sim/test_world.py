"""The simulation's deaths are a SIGKILL's (``tests/sim/world.py``): a process killed at
a boundary gets nothing past it, what it did before stays done, and its leftover code
is buried without reaching anything; the loop (``tests/sim/loop.py``) runs timers in
virtual time and reports a schedule that would wait for ever."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from octo_common.records import StorageKeyring
from octo_worker.store import SqliteJournalStore
from octo_worker.testing.kit import SimulatedCrash

from .loop import Stuck, new_loop
from .world import Boundaries, Process, bury, drop_connections, simulated_store

SCOPE = "scope"


@pytest.fixture
def journal() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="octo-sim-") as tmp:
        yield Path(tmp) / "journal.sqlite3"


def simulate(test: Callable[[], Awaitable[None]]) -> None:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(test())


def store(journal: Path, boundaries: Boundaries, process: Process) -> SqliteJournalStore:
    keyring = StorageKeyring("sim", bytes(range(32)))
    return simulated_store(SqliteJournalStore(journal, keyring), boundaries, process)


@pytest.mark.parametrize(("place", "landed"), [("before", False), ("after", True)])
def test_a_death_at_a_journal_write_keeps_exactly_what_was_durable(
    journal: Path, place: str, landed: bool
) -> None:
    async def test() -> None:
        history: list[str] = []
        boundaries = Boundaries(history)
        first = Process("worker 1")
        opened = store(journal, boundaries, first)
        await opened.load_sessions(SCOPE)  # opened: the next write is the reservation
        boundaries.arm(1, f"{place} journal write")
        finished, token = await boundaries.run_as(first, opened.reserve_fence(SCOPE))
        assert (finished, token) == (False, None)  # the caller never heard back
        assert first.dead and boundaries.deaths == {f"{place} journal write": 1}
        assert history == [f"worker 1 killed at boundary {first.passed} ({place} journal write)"]
        await bury(first)
        assert all(task.done() for task in first.leftovers)
        drop_connections(opened)
        second = Process("worker 2")
        restarted = store(journal, boundaries, second)
        lease = await restarted.reserve_fence(SCOPE)
        # The killed reservation holds fence 1 exactly when it committed.
        assert lease.token == (2 if landed else 1)
        await restarted.close()

    simulate(test)


def test_a_dead_process_passes_no_boundary_and_a_buried_one_raises() -> None:
    async def test() -> None:
        boundaries = Boundaries([])
        process = Process("worker")
        reached: list[str] = []

        async def acts() -> None:
            await boundaries.gate(process, "before an ack")
            reached.append("acked")
            await boundaries.gate(process, "before a publish")
            reached.append("published")

        boundaries.arm(2)
        finished, _ = await boundaries.run_as(process, acts())
        assert not finished and reached == ["acked"]
        assert not boundaries.passing(process, "before a publish")
        await bury(process)
        with pytest.raises(SimulatedCrash):
            boundaries.passing(process, "before a publish")
        assert reached == ["acked"]

    simulate(test)


def test_timers_run_in_virtual_time_and_a_wait_for_nothing_is_stuck() -> None:
    async def sleeps() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.sleep(3600)
        return loop.time() - start

    with asyncio.Runner(loop_factory=new_loop) as runner:
        assert runner.run(sleeps()) == 3600

    async def waits_for_nothing() -> None:
        await asyncio.get_running_loop().create_future()

    runner = asyncio.Runner(loop_factory=new_loop)
    with pytest.raises(Stuck):
        runner.run(waits_for_nothing())
    runner.close()  # the stuck task cancelled: a cancelled wait is ready at once
