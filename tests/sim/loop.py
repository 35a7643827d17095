"""The simulation's event loop: virtual time, no I/O, and a stuck schedule reported.

A schedule's code never touches a socket or a thread (the stores' database
threads run inline, ``tests/sim/world.py``), so the loop's selector has
nothing to wait for. :class:`SimLoop` replaces it with :class:`VirtualSelector`:
a wait for ``timeout`` seconds moves the loop's clock on by that much at once
(``asyncio.sleep`` and every timer fire without a real delay, in the same
order), and a wait with nothing ready and no timer, which on a real loop
would hang for ever, raises :class:`Stuck` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable
from typing import Any


class Stuck(RuntimeError):
    """Nothing is ready, no timer is due, and nothing can wake the loop."""


class VirtualSelector(selectors.BaseSelector):
    """A selector with no I/O: its ``select`` advances the virtual clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self._map: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._map[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._map.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stuck("the schedule is stuck: every task waits and no timer is due")
        if timeout > 0:
            self.now += timeout
        return []

    def get_map(self) -> dict[int, selectors.SelectorKey]:  # type: ignore[override]
        return self._map

    def close(self) -> None:
        self._map.clear()


class InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor: ``asyncio.to_thread`` runs its function at once,
    on the loop's thread (its outcome still reaches the caller a loop step later).
    A ``ThreadPoolExecutor`` only because the loop accepts no other; it never starts
    a thread."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


class SimLoop(asyncio.SelectorEventLoop):
    """An event loop on :class:`VirtualSelector`, its ``time()`` the virtual clock,
    with no thread behind ``asyncio.to_thread``."""

    def __init__(self) -> None:
        self._virtual = VirtualSelector()
        super().__init__(self._virtual)
        self.set_default_executor(InlineExecutor())

    def time(self) -> float:
        return self._virtual.now

    async def shutdown_default_executor(self) -> None:
        return None  # nothing runs in it after its submit returns


def new_loop() -> asyncio.AbstractEventLoop:
    return SimLoop()
