"""Named rows read together: one statement for many concurrent callers.

At 64 operations in flight every admission reads its key's row first; on
PostgreSQL each read is a round trip. Callers that ask for rows of the same
scope and namespace before the statement goes out share it (the same way
change sets share a group commit), and each keeps only the rows it named.
A read that joins a batch starts no earlier than its call, so it sees every
commit that returned before it was made. A failed statement fails every
caller of its batch; nothing is retried here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from octo_common.errors import StorageBackendError
from octo_worker.storage.changesets import Row

Fetch = Callable[[str, str, list[str]], Awaitable[list[Row]]]


class RowReads:
    """The batches of named-row reads waiting to go out, by (scope, namespace)."""

    def __init__(self, fetch: Fetch, tasks: set[asyncio.Task[Any]]) -> None:
        self._fetch = fetch
        self._tasks = tasks  # the store waits for these before it closes its pool
        self._waiting: dict[tuple[str, str], tuple[set[str], list[asyncio.Future[list[Row]]]]] = {}

    async def rows(self, scope: str, namespace: str, items: set[str]) -> list[Row]:
        """The rows of ``items`` (a row per item found, none for an item absent)."""
        future: asyncio.Future[list[Row]] = asyncio.get_running_loop().create_future()
        batch = self._waiting.get((scope, namespace))
        if batch is None:
            batch = self._waiting[(scope, namespace)] = (set(), [])
            task = asyncio.ensure_future(self._run(scope, namespace))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        batch[0].update(items)
        batch[1].append(future)
        rows = await future
        return [row for row in rows if row.item in items]

    async def _run(self, scope: str, namespace: str) -> None:
        await asyncio.sleep(0)  # the callers of this turn of the loop join first
        items, waiters = self._waiting.pop((scope, namespace))
        try:
            rows = await self._fetch(scope, namespace, sorted(items))
        except BaseException as exc:
            failure = exc if isinstance(exc, Exception) else StorageBackendError("load: cancelled")
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(failure)
                    waiter.exception()  # marked read: a caller may be gone (cancelled)
            if not isinstance(exc, Exception):
                raise
            return
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(rows)
