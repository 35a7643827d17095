"""The simulation's I/O boundaries: where a simulated worker process may die.

A real worker reaches the outside world only through its journal (one
transaction per hand-off to the store's database threads), the broker (an
ack, a published reply, a dead letter) and its plug-in (a call to the
adapter). The simulation routes each of these through :class:`Boundaries`,
which counts them per process and, when the schedule says so, *kills* the
process at one of them, as a SIGKILL would:

* the process stops there: the hand-off it was making never completes (its
  future is never resolved), so no later line of that process runs and
  nothing more of it reaches the journal, the broker or the adapter;
* a boundary is passed twice, before the I/O and after it, so a death
  falls either before a transaction, an ack, a publish or an effect (it did
  not happen) or after it (it happened; the process never learnt so);
* its SQLite connections are closed without a transaction open (each
  transaction is one synchronous call here, so none is ever open at a
  boundary) and its memory is dropped; the next incarnation opens the same
  file and recovers from what the journal holds.

:class:`InlineDatabaseThread` stands in for the store's two database threads:
it runs each hand-off at once on the event loop's thread and hands the
outcome back one loop iteration later (as the real thread does, never inside
the caller's call), so a schedule is deterministic and cheap: no thread, no
wake-up through the selector.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from octo_common.errors import StorageBackendError
from octo_common.runtime.sqlite import DatabaseThread, Outcome, run_each
from octo_worker.daemon.faults import FaultHooks
from octo_worker.storage.sqlite_rows import guarded
from octo_worker.store import SqliteJournalStore
from octo_worker.testing.kit import SimulatedCrash

T = TypeVar("T")

# The boundaries a worker process passes in a schedule, by name (a dead letter's,
# "before a dead letter" and "after a dead letter", only on a malformed delivery).
PLACES: Final = tuple(
    f"{side} {what}"
    for what in (
        "journal write",
        "journal read",
        "an ack",
        "a publish",
        "the effect",
        "a lookup",
        "the inverse",
        "an inverse lookup",
    )
    for side in ("before", "after")
)


def _new_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class Process:
    """One simulated process: alive until :meth:`Boundaries.kill`; its boundaries counted."""

    name: str
    crashable: bool = True  # False: never killed by a countdown (a fenced-out worker)
    dead: bool = False
    buried: bool = False  # after the kill: its leftover code unwinds, every boundary raises
    passed: int = 0  # boundaries passed so far
    death: asyncio.Future[None] = field(default_factory=_new_future)
    leftovers: list[asyncio.Future[Any]] = field(default_factory=list)  # tasks it left behind
    # The hand-offs it was making when it died: failed when it is buried, so that
    # nothing waits on them for ever.
    withheld: list[Callable[[], None]] = field(default_factory=list)


class Boundaries:
    """Counts every I/O boundary of the live processes; kills one at its countdown's end.

    ``arm(n)`` makes the next crashable process to pass ``n`` more boundaries
    die at the n-th; ``arm(n, place)`` counts only the boundaries named ``place``
    (``"before journal write"``, ``"after the effect"``, ...). ``history``
    receives one line per death, ``deaths`` counts them by where they fell.
    """

    def __init__(self, history: list[str]) -> None:
        self.history = history
        self.countdown: int | None = None
        self.place: str | None = None  # None: every boundary counts down
        self.deaths: Counter[str] = Counter()

    def arm(self, boundaries: int, place: str | None = None) -> None:
        self.countdown = boundaries
        self.place = place

    def disarm(self) -> None:
        self.countdown = None

    def passing(self, process: Process, what: str) -> bool:
        """Pass one boundary; False when ``process`` is dead (the caller must stop there).

        A buried process (its leftover code unwinding after the kill) raises
        :class:`SimulatedCrash` instead: it must get nowhere.
        """
        if process.buried:
            raise SimulatedCrash(what)
        if process.dead:
            return False
        process.passed += 1
        if process.crashable and self.countdown is not None and self.place in (None, what):
            self.countdown -= 1
            if self.countdown <= 0:
                self.countdown = None
                self.kill(process, what)
                return False
        return True

    def kill(self, process: Process, what: str, *, counted: bool = True) -> None:
        process.dead = True
        if counted:
            self.deaths[what] += 1
        if not process.death.done():
            process.death.set_result(None)
        self.history.append(f"{process.name} killed at boundary {process.passed} ({what})")

    async def run_as(self, process: Process, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
        """Run ``awaitable`` as ``process``: ``(True, result)``, or ``(False, None)`` when
        the process died meanwhile (its task left where it stopped, for :func:`bury`)."""
        task = asyncio.ensure_future(awaitable)
        await asyncio.wait({task, process.death}, return_when=asyncio.FIRST_COMPLETED)
        if process.dead:
            process.leftovers.append(task)
            return False, None
        return True, task.result()

    async def gate(self, process: Process, what: str) -> None:
        """An awaitable boundary: never returns once ``process`` is dead."""
        if not self.passing(process, what):
            await _forever()


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


async def bury(process: Process) -> None:
    """After a kill: the process's leftover tasks cancelled and run to their end (every
    boundary they reach raises :class:`SimulatedCrash`), so nothing of it is left on
    the loop."""
    process.buried = True
    tasks = process.leftovers
    loop = asyncio.get_running_loop()
    for fail in process.withheld:
        loop.call_soon(fail)
    for task in tasks:
        task.cancel()
    for _ in range(1000):
        if all(task.done() for task in tasks):
            break
        await asyncio.sleep(0)
    for task in tasks:
        if not task.done():
            raise AssertionError(f"{process.name}: a task outlived its process")
        if not task.cancelled():
            task.exception()  # retrieved: it ended where it was killed


class InlineDatabaseThread(DatabaseThread[Callable[[], Any]]):
    """A store's database thread, run inline; every hand-off is two boundaries."""

    def __init__(self, boundaries: Boundaries, process: Process, what: str) -> None:
        super().__init__(f"sim {what}", run_each)
        self._boundaries = boundaries
        self._process = process
        self._what = what

    def call(self, work: Callable[[], Any], callback: Callable[[Outcome], None]) -> None:
        if self._closed:
            raise StorageBackendError("store is closed")
        loop = asyncio.get_running_loop()
        if not self._boundaries.passing(self._process, f"before {self._what}"):
            self._withhold(callback)  # died before the transaction: it never happens
            return
        (outcome,) = run_each([work])
        if not self._boundaries.passing(self._process, f"after {self._what}"):
            self._withhold(callback)  # died after it: durable, the process never learns so
            return
        loop.call_soon(callback, outcome)

    def _withhold(self, callback: Callable[[Outcome], None]) -> None:
        crash = SimulatedCrash(self._what)
        self._process.withheld.append(lambda: callback((False, crash)))

    def close(self, last: Callable[[], Any] | None = None) -> asyncio.Future[Any] | None:
        if self._closed:
            return None
        future = None if last is None else self.submit(last)
        self._closed = True
        return future

    async def wait_closed(self, timeout: float = 30.0) -> None:
        return None


def simulated_store(
    store: SqliteJournalStore, boundaries: Boundaries, process: Process
) -> SqliteJournalStore:
    """``store`` with its database threads run inline as ``process``."""
    store._writer_thread = InlineDatabaseThread(boundaries, process, "journal write")
    store._reader_thread = InlineDatabaseThread(boundaries, process, "journal read")
    return store


def drop_connections(store: SqliteJournalStore) -> None:
    """What a SIGKILL leaves of a store: its connections closed, no transaction open."""
    for side in (store._writer, store._reader):
        guarded(side.close)


class KillPointHooks(FaultHooks):
    """The daemon's kill points for one process: each is a boundary too, and the
    process dies at the one named by ``target[0]`` (then cleared) or at its countdown.

    A hook cannot wait, so the death raises :class:`SimulatedCrash` there
    (a ``BaseException``: no handler of the worker's takes it for a failure);
    whatever of the process runs on reaches only boundaries that never return.
    """

    def __init__(self, boundaries: Boundaries, process: Process, target: list[str | None]) -> None:
        self._boundaries = boundaries
        self._process = process
        self._target = target
        self._reach = self._point

    def _point(self, point: str, settle: float = 0.0) -> None:
        if self._target[0] == point and not self._process.dead:
            self._target[0] = None
            self._boundaries.kill(self._process, point)
        if not self._boundaries.passing(self._process, point):
            raise SimulatedCrash(point)


def ignore_leftovers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: a killed process's leftovers are no error."""
    if isinstance(context.get("exception"), SimulatedCrash):
        return
    loop.default_exception_handler(context)
