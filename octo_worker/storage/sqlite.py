"""The worker's SQLite journal store: ``SqliteJournalStore``.

What it owns
------------
One SQLite database holds the journals of many tenant scopes. Per scope there
is one **head** (``heads`` row ``worker-journal``/scope: scope revision,
fence, and the digest of every row the scope holds, sealed with the storage
key: ``scope_head``) and any number of **rows** (``items``) in the namespaces
``worker-journal`` (operation key → ``JournalRow``), ``worker-session``
(session id → state document), ``worker-session-open`` (session id → opening
document) and ``worker-outbox`` (message id → outbox document). Every row is a
keyed storage envelope (``octo_common.records.seal_record``) tagged under
(row namespace, scope) at the revision of the commit that last wrote it; with
a data keyring its document is encrypted first. On load the store
checks the floor rule against the head, opens the envelope, decrypts, and
checks that the document names the row's scope and item.

Commits (fence, head revision, each row's base revision, new revision,
COMMIT, then the anchor) run inside one ``BEGIN IMMEDIATE`` transaction.
**Group commit** (``octo_common.runtime.groupcommit``): the writer
thread applies every waiting change set in ONE transaction and ONE fsync,
each under its own ``SAVEPOINT`` so a change set that fails its checks is
rolled back alone; what each gets is decided by ``changes.CommitBatch``
(chained session commits included). The public API, row opening and
operator work are ``base.JournalStoreBase``'s.

Threads
-------
aiosqlite runs each statement as its own hand-off into its thread and has no
public way to run a whole function there; hand-offs, not fsync, dominate the
cost of a commit on this kind of machine. So the store owns two dedicated
threads (a ``SimpleQueue`` in, ``call_soon_threadsafe`` out: half the cost of
``run_in_executor``) running the stdlib ``sqlite3`` module: a writer (all
writes, fence reservations, schema, anchor) and a reader (loads, which WAL
lets run beside a commit's fsync). Every transaction is ONE call into its
thread; concurrent loads also share one call and one read snapshot.
Connections never leave their thread. The writer thread's side is
``sqlite_writer.JournalWriter``, the reader thread's
``sqlite_reader.JournalReader``; this module is the event-loop side: the
backend primitives of ``JournalStoreBase`` handed to their threads, batched
reads, the rollback anchor's explicit initialisation, and closing.

What it must never do
---------------------
Interpret documents beyond their location fields, decide protocol outcomes
(a scope whose rows are not its head's included: ``base`` and ``scope_head``
decide),
log or raise with keys, payloads, documents or frames, or let a caller's
cancellation leave a submitted commit's outcome unknown.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from octo_common.errors import StorageBackendError
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_common.runtime.sqlite import DatabaseThread, run_each
from octo_worker.storage.base import JournalStoreBase, Pruned, Resealed, StoreStats
from octo_worker.storage.changesets import Outcomes, PendingCommit, Row
from octo_worker.storage.interface import ScopeMetadata
from octo_worker.storage.scope_head import ScopeSnapshot
from octo_worker.storage.sqlite_heads import check_store_heads, read_scope_snapshot
from octo_worker.storage.sqlite_reader import JournalReader
from octo_worker.storage.sqlite_rows import (
    KEYED_ITEMS_SCHEMA_VERSION,
    backend_error,
    connect_read_only,
    guarded,
)
from octo_worker.storage.sqlite_writer import JournalWriter

__all__ = ["SqliteJournalStore", "StoreStats"]

T = TypeVar("T")


class SqliteJournalStore(JournalStoreBase):
    """The journal in one SQLite file; the public API is ``JournalStoreBase``'s.

    ``SqliteJournalStore(path, keyring, *, anchor_path=None, data_keyring=None,
    group_commit=True, read_only=False)`` does no I/O; the first awaited call
    opens the database (created 0o600, WAL) and checks the rollback anchor.
    With ``group_commit=False`` every change set gets its own transaction (for
    benchmarks). Keyrings are used by reference, so a rotation done on them
    takes effect at the next commit.

    ``read_only=True`` (the operator's inspection verbs, beside a running
    daemon) never writes the database: no database or directory is created,
    no schema migration runs (an older schema is read as it is, a newer one
    refused), the anchor is checked but never rewritten, every write call
    raises ``StorageBackendError``, and its connections open the file
    read-only (so closing one never checkpoints a WAL a crashed daemon left
    behind). SQLite may still create the ``-wal``/``-shm`` side files of a
    journal whose daemon is stopped.

    ``maintenance=True`` (``prune`` and ``reseal`` beside a running daemon)
    may rewrite or delete rows but never moves a head: the anchor is checked
    at the open and never written (the daemon replaces that file after each
    commit), and ``commit``, ``reserve_fence`` and ``initialize_anchor``
    raise ``StorageBackendError``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keyring: StorageKeyring,
        *,
        anchor_path: str | os.PathLike[str] | None = None,
        data_keyring: StorageKeyring | None = None,
        group_commit: bool = True,
        on_batch: Callable[[int], None] | None = None,
        read_only: bool = False,
        maintenance: bool = False,
    ) -> None:
        super().__init__(
            keyring,
            data_keyring,
            group_commit=group_commit,
            on_batch=on_batch,
            read_only=read_only,
            maintenance=maintenance,
        )
        self._path = Path(os.fspath(path))
        self._anchor_path = None if anchor_path is None else Path(os.fspath(anchor_path))
        self._writer_thread: DatabaseThread[Callable[[], Any]] = DatabaseThread(
            "octo-journal-writer", run_each
        )
        self._reader_thread: DatabaseThread[Callable[[], Any]] = DatabaseThread(
            "octo-journal-reader", run_each
        )
        # The two threads' sides: each owns its connection and runs only there.
        self._writer = JournalWriter(
            self._path,
            self._anchor_path,
            keyring,
            data_keyring,
            read_only=read_only,
            maintenance=maintenance,
            live=self._live,
        )
        self._reader = JournalReader(
            self._path, self._anchor_path, self._writer, read_only=read_only
        )
        # Event-loop state.
        self._open_lock = asyncio.Lock()
        # The reader thread runs one batch of reads at a time; ``_reader_scheduled``
        # means a start is on the loop's ready queue (it collects every read
        # asked for in the same loop iteration), ``_reader_busy`` that a batch
        # is in the thread. ``_reads_idle`` is set while neither holds.
        self._read_queue: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._reader_scheduled = False
        self._reader_busy = False
        self._reads_idle = asyncio.Event()
        self._reads_idle.set()

    def __repr__(self) -> str:
        return f"SqliteJournalStore(path={os.fspath(self._path)!r})"

    async def initialize_anchor(self) -> None:
        """Write the anchor file from the current database (explicit operator step).

        A configured anchor that is missing or malformed fails every open;
        this is the one way to (re)create it. Call it before any
        other method of this store instance.
        """
        if self._anchor_path is None:
            raise ValueError("this store has no anchor_path")
        if self._opened:
            raise ValueError("initialize_anchor must run before the store is opened")
        self._check_committing()
        await self._open(check_anchor=False)

    async def close(self) -> None:
        """Finish queued commits, close both connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._commits.idle.wait()
        await self._reads_idle.wait()
        try:
            for thread, close_connection in (
                (self._writer_thread, self._writer.close),
                (self._reader_thread, self._reader.close),
            ):
                last = thread.close(functools.partial(guarded, close_connection))
                if last is not None:
                    await last
        finally:
            self._writer_thread.close()
            self._reader_thread.close()

    # JournalStoreBase's primitives ----------------------------------------------------------

    async def _ensure_open(self) -> None:
        await self._open(check_anchor=True)

    async def _open(self, *, check_anchor: bool) -> None:
        if self._opened:
            return
        if self._closed:
            raise StorageBackendError("store is closed")
        async with self._open_lock:
            if self._opened:  # another task opened it while this one waited
                return  # type: ignore[unreachable]
            await self._writer_thread.submit(
                lambda: guarded(lambda: self._writer.open(check_anchor))
            )
            await self._reader_thread.submit(lambda: guarded(self._reader.open))
            # A read-only look at a journal not migrated yet reads its items in clear.
            self._items.plain = self._writer.schema_found < KEYED_ITEMS_SCHEMA_VERSION
            self._opened = True

    async def _reserve(self, scope: str) -> int:
        return await self._write_call(lambda: self._writer.reserve(scope))

    def _run_batch(self, batch: list[PendingCommit], done: Callable[[Outcomes], None]) -> None:
        def finished(outcome: tuple[bool, Any]) -> None:
            ok, value = outcome
            # ``apply_batch`` returns every change set's outcome; only a defect
            # in it fails the whole batch.
            done(value if ok else [backend_error(value) for _ in batch])

        self._writer_thread.call(functools.partial(self._writer.apply_batch, batch), finished)

    async def _rows(self, scope: str, namespace: str, items: Sequence[str] | None) -> list[Row]:
        return await self._read_call(lambda: self._reader.read_items(scope, namespace, items))

    async def _outbox_rows(self, scope: str, session: str) -> tuple[list[Row], bool]:
        return await self._read_call(lambda: self._reader.read_outbox(scope, session))

    async def _session_rows(
        self, scope: str, keep: Sequence[str] | None
    ) -> tuple[list[Row], list[Row], list[Row]]:
        return await self._read_call(lambda: self._reader.read_sessions(scope, keep))

    async def _prunable_rows(self, scope: str, cutoff: float) -> list[tuple[Row, Any, Any]]:
        return await self._read_call(lambda: self._reader.read_prunable(scope, cutoff))

    async def _row_batch(self, scope: str, after: int) -> list[tuple[int, str, Row]]:
        return await self._read_call(functools.partial(self._reader.read_batch, scope, after))

    async def _head(self, scope: str) -> int:
        return await self._read_call(lambda: self._reader.read_head(scope))

    async def _scope_names(self, *, stored: bool = False) -> list[str]:
        return await self._read_call(lambda: self._reader.read_scopes(stored=stored))

    async def _metadata(self, scope: str) -> ScopeMetadata:
        return await self._read_call(lambda: self._reader.read_metadata(scope))

    async def _integrity(self) -> list[str]:
        """``PRAGMA integrity_check``: ``["ok"]`` when the database is healthy."""
        return await self._read_call(self._reader.integrity)

    async def _scope_snapshot(self, scope: str) -> ScopeSnapshot:
        # On a connection and thread of its own: O(rows of the scope), which
        # the reader thread's loads of other scopes must not wait behind.
        if not self._opened:
            await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        anchor = self._writer.anchor  # as last written: never newer than the snapshot
        read = functools.partial(self._read_scope_snapshot, scope, anchor)
        return await asyncio.to_thread(guarded, read)

    def _read_scope_snapshot(
        self, scope: str, anchor: Mapping[StorageRecordKey, int]
    ) -> ScopeSnapshot:
        connection = connect_read_only(self._path)
        try:
            connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
            connection.execute("BEGIN")
            return read_scope_snapshot(connection, scope, anchor, self._keyring)
        finally:
            connection.close()

    async def _store_check(self) -> int:
        if self._closed:
            raise StorageBackendError("store is closed")
        return await asyncio.to_thread(guarded, self._read_store_check)

    def _read_store_check(self) -> int:
        connection = connect_read_only(self._path)
        try:
            connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
            connection.execute("BEGIN")
            return check_store_heads(connection, self._keyring)
        finally:
            connection.close()

    async def _reseal_head(self, scope: str) -> bool:
        return await self._write_call(lambda: self._writer.reseal_head(scope))

    async def _prune_rows(self, scope: str, victims: Sequence[Pruned]) -> int:
        return await self._write_call(lambda: self._writer.prune_rows(scope, victims))

    async def _replace_envelopes(self, scope: str, changes: Sequence[Resealed]) -> int:
        return await self._write_call(functools.partial(self._writer.replace_envelopes, changes))

    async def _mark_closed_rows(self, scope: str, ids: Sequence[str]) -> None:
        await self._write_call(lambda: self._writer.mark_closed(scope, ids))

    # Hand-offs to the threads -----------------------------------------------------------------

    async def _write_call(self, function: Callable[[], T]) -> T:
        self._check_writable()
        await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        return cast(T, await self._writer_thread.submit(lambda: guarded(function)))

    async def _read_call(self, function: Callable[[], T]) -> T:
        """Run ``function`` in the reader thread; concurrent reads share one hand-off."""
        if not self._opened:
            await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._read_queue.append((function, future))
        if not (self._reader_scheduled or self._reader_busy):
            self._reader_scheduled = True
            self._reads_idle.clear()
            loop.call_soon(self._start_reads)
        return cast(T, await future)

    def _start_reads(self) -> None:
        """Hand every waiting read to the reader thread at once."""
        self._reader_scheduled = False
        if self._reader_busy:
            return
        if not self._read_queue:
            self._reads_idle.set()
            return
        batch, self._read_queue = self._read_queue, []
        functions = [function for function, _future in batch]
        self._reader_busy = True
        self._reader_thread.call(
            functools.partial(self._reader.run_reads, functions),
            functools.partial(self._reads_done, batch),
        )

    def _reads_done(
        self,
        batch: Sequence[tuple[Callable[[], Any], asyncio.Future[Any]]],
        outcome: tuple[bool, Any],
    ) -> None:
        self._reader_busy = False
        ok, value = outcome
        # ``run_reads`` keeps every read's outcome apart; only a defect in it
        # fails the whole batch.
        outcomes = value if ok else [(False, backend_error(value)) for _ in batch]
        try:
            for (_function, future), (read_ok, result) in zip(batch, outcomes, strict=True):
                if future.done():  # its caller was cancelled
                    continue
                if read_ok:
                    future.set_result(result)
                else:
                    future.set_exception(result)
        finally:
            # Reads queued meanwhile go at once: they already waited one batch.
            self._start_reads()
