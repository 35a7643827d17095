"""The host ledger store on SQLite: ``SqliteRecordBackend`` and ``SqliteLedgerStore``.

This module owns one SQLite database of records (WAL, ``synchronous=FULL``,
0o600 files, forward schema migrations), its database thread with group
commit, and ``SqliteLedgerStore``, an ``AuthenticatedStore`` over the
backend. The store head and the rollback anchor are
:mod:`octo_host.storage.sqlite_head`, asked at open, on every load and
around every commit.

It must never log, return or raise key material, payload bytes or bound SQL
values, decide a write otherwise than :mod:`octo_host.storage.contract`
does, or let a caller proceed on a commit whose anchor write failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from octo_common.errors import (
    FencingRequired,
    FencingTokenExhausted,
    OctoError,
    StorageBackendError,
)
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS, SQLITE_MAX_INTEGER
from octo_common.records import (
    Conflict,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
)
from octo_common.runtime.groupcommit import GroupCommit, resolve_outcome
from octo_common.runtime.logs import library_logger
from octo_common.runtime.sqlite import (
    DatabaseThread,
    Outcome,
    check_database_files,
    copy_error,
    migrate_schema,
    prepare_database_files,
    roll_back,
)
from octo_host.storage.authenticated import AuthenticatedStore
from octo_host.storage.contract import (
    Head,
    ManyWrite,
    SwapBackend,
    cas_decision,
    check_key,
    check_many,
    check_token,
    establish_decision,
    fenced_check,
    head_from_row,
)
from octo_host.storage.sqlite_head import HEAD_MIGRATION, RollbackGuard

__all__ = ["SqliteLedgerStore", "SqliteRecordBackend"]

_SINGLE_ITEM = ""  # a single record is its head plus the item ""

_T = TypeVar("_T")

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE heads (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            revision INTEGER NOT NULL CHECK (revision >= 0),
            fence INTEGER NOT NULL CHECK (fence >= 0),
            PRIMARY KEY (namespace, name)
        )
        """,
        """
        CREATE TABLE items (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            item TEXT NOT NULL,
            revision INTEGER NOT NULL,
            envelope BLOB NOT NULL,
            PRIMARY KEY (namespace, name, item),
            FOREIGN KEY (namespace, name) REFERENCES heads (namespace, name)
        )
        """,
    ),
    HEAD_MIGRATION,
)
"""Forward migrations: entry ``i`` moves the schema from version ``i`` to ``i + 1``."""

# One statement, so one snapshot. Head and item are read independently so
# that an item without its head (a deleted head row) is still seen.
_SELECT_RECORD = """
    SELECT
      (SELECT revision FROM heads WHERE namespace = :namespace AND name = :name),
      (SELECT fence FROM heads WHERE namespace = :namespace AND name = :name),
      (SELECT revision FROM items WHERE namespace = :namespace AND name = :name AND item = :item),
      (SELECT envelope FROM items WHERE namespace = :namespace AND name = :name AND item = :item)
"""
# A load also reads the store head's revision, in the same snapshot.
_SELECT_RECORD_AND_STORE = """
    SELECT
      (SELECT revision FROM heads WHERE namespace = :namespace AND name = :name),
      (SELECT fence FROM heads WHERE namespace = :namespace AND name = :name),
      (SELECT revision FROM items WHERE namespace = :namespace AND name = :name AND item = :item),
      (SELECT envelope FROM items WHERE namespace = :namespace AND name = :name AND item = :item),
      (SELECT revision FROM store_head WHERE id = 1)
"""


def _sqlite_detail(operation: str, exc: sqlite3.Error) -> str:
    # The SQLite error name is stable and never contains bound values.
    name = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
    return f"{operation}: {name}"


def _prepare_files(database: Path) -> None:
    """Directory 0o700 when created (warn if group/other-readable), db files 0o600."""
    loose = prepare_database_files(database)
    if loose is not None:
        library_logger(__name__).warning(
            "storage_directory_not_private", directory=str(database.parent), mode=oct(loose)
        )


class _Work:
    """One submitted backend operation, run in the database thread."""

    __slots__ = ("function", "operation", "write")

    def __init__(
        self, operation: str, function: Callable[[sqlite3.Connection], Any], write: bool
    ) -> None:
        self.operation = operation
        self.function = function
        self.write = write


_CLOSE = "close"


class SqliteRecordBackend(SwapBackend):
    """The semantics of ``VolatileMemoryStore`` with the state in one SQLite database.

    No I/O in the constructor: the first awaited call creates the directory
    (0o700) and the database (0o600, WAL, ``synchronous=FULL``, busy timeout
    5 s, ``foreign_keys=ON``), migrates the schema forward and checks the
    rollback anchor.

    One dedicated thread owns the connection and runs every operation in
    submission order: an event loop's operations queue for group commit
    (``octo_common.runtime.groupcommit``) and go to the thread a batch at a
    time. Writes (CAS, fence reservation, fence establishment) that are
    waiting together share one ``BEGIN IMMEDIATE`` transaction and one
    fsync (group commit): each caller gets the outcome it would
    have had alone, because a write is decided against the state its
    predecessors left and a refused write changes nothing. A database error
    fails every write of that transaction (nothing of it is committed); any
    other failure of one write is undone to its savepoint and fails that write
    only. Submissions, the thread's start and ``close`` are ordered by one
    lock, so event loops in several threads may share a backend. A submitted
    operation completes or fails even if its caller is cancelled.

    Every write transaction that changes a record also moves the database's
    store head (its revision and the digest of every record, sealed with the
    keyring an ``AuthenticatedStore`` binds: :meth:`bind_keyring`) in O(1),
    and, with an anchor configured, writes the fixed-size anchor file once
    after the ``COMMIT`` and before any caller of that transaction is
    released (:mod:`octo_host.storage.sqlite_head`). The open checks the
    head against the anchor and recomputes its digest over the rows.

    Revisions and fences stop at 2^63 - 1 (SQLite ``INTEGER``). Use one
    backend object per database when an anchor is configured: the anchor is
    kept in memory from the open.
    """

    ceiling = SQLITE_MAX_INTEGER

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        anchor_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self._path = Path(os.fspath(path)).absolute()
        anchor = None if anchor_path is None else Path(os.fspath(anchor_path)).absolute()
        # Owned by the database thread.
        self._guard = RollbackGuard(anchor)
        self._db: sqlite3.Connection | None = None
        # Submissions, the thread's start and close() are ordered by the thread's lock.
        self._thread: DatabaseThread[list[_Work]] = DatabaseThread(
            "octo-ledger-sqlite", self._run_jobs
        )
        # Each event loop's group-commit queue in front of the thread.
        self._groups: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, GroupCommit[_Work, Outcome]
        ] = weakref.WeakKeyDictionary()
        self._closing = False
        self._transactions = 0
        self._batched_writes = 0

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def group_commit_stats(self) -> tuple[int, int]:
        """(write transactions committed or attempted, writes they carried)."""
        return self._transactions, self._batched_writes

    def __repr__(self) -> str:
        return f"SqliteRecordBackend(path={str(self._path)!r})"

    def bind_keyring(self, keyring: StorageKeyring) -> None:
        """Seal the store head with ``keyring`` and refuse a head it cannot authenticate.

        ``AuthenticatedStore`` calls it when it is built over this backend. A
        backend never bound keeps its head unsealed; one bound keyring only
        (``ValueError`` for another).
        """
        if not isinstance(keyring, StorageKeyring):
            raise TypeError("keyring must be a StorageKeyring")
        self._guard.bind(keyring)

    # Submitting (event loop) ------------------------------------------------

    def _submit(
        self, operation: str, function: Callable[[sqlite3.Connection], _T], *, write: bool
    ) -> asyncio.Future[_T]:
        if self._closing or self._thread.closed:
            raise StorageBackendError("store is closed")
        loop = asyncio.get_running_loop()
        group = self._groups.get(loop)
        if group is None:
            group = self._groups[loop] = GroupCommit(self._start_batch, settle=resolve_outcome)
        return group.submit(_Work(operation, function, write))

    def _start_batch(self, batch: list[_Work], done: Callable[[Sequence[Outcome]], None]) -> None:
        """Hand one loop's batch to the thread as one job (its outcomes come back together)."""

        def finished(outcome: Outcome) -> None:
            ok, value = outcome
            done(value if ok else [(False, value) for _ in batch])

        try:
            self._thread.call(batch, finished)
        except StorageBackendError as exc:
            if self._thread.closed:
                done([(False, copy_error(exc)) for _ in batch])
            else:
                done([(False, StorageBackendError(f"{w.operation}: {exc.detail}")) for w in batch])

    # The database thread ------------------------------------------------------

    def _run_jobs(self, jobs: list[list[_Work]]) -> list[Outcome]:
        """The jobs the thread drained (a batch of one loop each), run in order as one
        batch; each job's outcome is the list of its operations' outcomes."""
        outcomes = _own_errors(self._run_batch([work for job in jobs for work in job]))
        results: list[Outcome] = []
        start = 0
        for job in jobs:
            results.append((True, outcomes[start : start + len(job)]))
            start += len(job)
        return results

    def _run_batch(self, batch: list[_Work]) -> list[Outcome]:
        """Run one drained batch in order: waiting writes share one transaction."""
        try:
            return self._run_batch_in_order(batch)
        except BaseException as exc:  # a defect here must not strand every later caller
            if any(work.operation == _CLOSE for work in batch) and self._db is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
                self._db = None
            return [
                (False, StorageBackendError(f"{work.operation}: {type(exc).__name__}"))
                for work in batch
            ]

    def _run_batch_in_order(self, batch: list[_Work]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        writes: list[_Work] = []
        for work in batch:
            if work.write:
                writes.append(work)
            else:
                outcomes.extend(self._write_group(writes))
                writes = []
                outcomes.append(self._read(work))
        outcomes.extend(self._write_group(writes))
        return outcomes

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = self._open()
        return self._db

    def _read(self, work: _Work) -> Outcome:
        try:
            if work.operation == _CLOSE:
                connection, self._db = self._db, None
                if connection is not None:
                    connection.close()
                return (True, None)
            return (True, work.function(self._connection()))
        except BaseException as exc:  # delivered to the awaiting caller
            return (False, _translated(work.operation, exc))

    def _write_group(self, writes: list[_Work]) -> list[Outcome]:
        """One transaction for ``writes``; per-write refusals, all-or-nothing commit."""
        if not writes:
            return []
        self._transactions += 1
        self._batched_writes += len(writes)
        guard = self._guard
        guard.begin()
        results: list[Outcome] = []
        try:
            connection = self._connection()
            connection.execute("BEGIN IMMEDIATE")
            try:
                for work in writes:
                    results.append(_isolated(work, connection, guard))
                guard.seal(connection)  # the store head moves with the writes, once
                connection.execute("COMMIT")
            except BaseException:
                roll_back(connection)
                raise
        except BaseException as exc:
            return [(False, _translated(work.operation, exc)) for work in writes]
        failure = guard.committed()
        if failure is not None:
            # The database holds the commit, but the callers must not proceed.
            results = [
                (False, StorageBackendError(failure)) if ok and _wrote(value) else (ok, value)
                for ok, value in results
            ]
        return results

    # Opening (database thread) -------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        # Before creating anything: a configured anchor must already exist.
        anchor = self._guard.read_anchor()
        try:
            _prepare_files(self._path)
        except OSError as exc:
            raise StorageBackendError(f"open: {exc.strerror}") from exc
        connection = sqlite3.connect(self._path, isolation_level=None)
        try:
            busy_ms = int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)
            connection.execute(f"PRAGMA busy_timeout = {busy_ms}")
            row = connection.execute("PRAGMA journal_mode = WAL").fetchone()
            if row is None or str(row[0]).lower() != "wal":
                raise StorageBackendError("open: WAL journal mode unavailable")
            connection.execute("PRAGMA synchronous = FULL")
            connection.execute("PRAGMA foreign_keys = ON")
            # The head migration's row is sealed "to be built" in its own
            # transaction (``RollbackGuard.seal_unbuilt``).
            migrate_schema(
                connection, (_MIGRATIONS[0], (*_MIGRATIONS[1], self._guard.seal_unbuilt))
            )
            check_database_files(self._path)
            self._guard.open(connection, anchor)
        except BaseException:
            connection.close()
            raise
        return connection

    # Contract (the compare-and-swap entry points: SwapBackend) --------------

    async def load(self, key: StorageRecordKey) -> StorageSnapshot:
        key = check_key(key)

        def body(connection: sqlite3.Connection) -> StorageSnapshot:
            row = connection.execute(  # one statement: one snapshot
                _SELECT_RECORD_AND_STORE,
                {"namespace": key.namespace, "name": key.name, "item": _SINGLE_ITEM},
            ).fetchone()
            head = head_from_row(row[:4])
            self._guard.check_load(key, head, row[4])
            return StorageSnapshot(head.record, head.floor)

        return await self._submit("load", body, write=False)

    async def _swap(
        self,
        operation: str,
        key: StorageRecordKey,
        expected: int | None,
        replacement: StoredRecord,
        token: int | None,
        opener: Callable[[StorageSnapshot], None] | None,
    ) -> Stored | Conflict:
        if not isinstance(replacement.data, bytes):
            raise TypeError("replacement data must be bytes")

        def transaction(connection: sqlite3.Connection) -> Stored | Conflict:
            head = _read_head(connection, key)
            if opener is not None:
                self._guard.check_record(key, head, in_write=True)
                opener(StorageSnapshot(head.record, head.floor))
            if token is None:
                if head.fence != 0:
                    raise FencingRequired(head.fence)
            else:
                fenced_check(head.fence, token)
            if opener is None:  # with an opener the anchor was checked before it
                self._guard.check_record(key, head, in_write=True)
            actual = None if head.record is None else head.record.revision
            conflict = cas_decision(actual, head.floor, expected, replacement, self.ceiling)
            if conflict is not None:
                return conflict
            return self._write_record(connection, key, actual, replacement)

        return await self._submit(operation, transaction, write=True)

    async def compare_and_swap_many_opened(
        self, writes: Sequence[ManyWrite]
    ) -> list[Stored | Conflict | None]:
        """Several unfenced CAS of distinct keys in one transaction: all or none.

        Each write is ``(key, expected, replacement, opener)``, decided as
        :meth:`compare_and_swap_opened` decides it. Every record is read,
        opened and decided before any is written. A refusal (raised) writes
        nothing. When any write is in conflict, nothing is written and the
        result holds its ``Conflict``, and None for the others; otherwise it
        holds one ``Stored`` per write, in order. The writes share the
        transaction (and the fsync) of any other write waiting with them.
        """
        checked = check_many(writes)
        for _, _, replacement, _ in checked:
            if not isinstance(replacement.data, bytes):
                raise TypeError("replacement data must be bytes")

        def transaction(connection: sqlite3.Connection) -> list[Stored | Conflict | None]:
            decisions: list[Conflict | None] = []
            for key, expected, replacement, opener in checked:
                head = _read_head(connection, key)
                self._guard.check_record(key, head, in_write=True)
                opener(StorageSnapshot(head.record, head.floor))
                if head.fence != 0:
                    raise FencingRequired(head.fence)
                actual = None if head.record is None else head.record.revision
                decisions.append(
                    cas_decision(actual, head.floor, expected, replacement, self.ceiling)
                )
            if any(decision is not None for decision in decisions):
                return list(decisions)
            # A decided write replaces exactly its expected revision.
            return [
                self._write_record(connection, key, expected, replacement)
                for key, expected, replacement, _ in checked
            ]

        if not checked:
            return []
        return await self._submit("compare_and_swap_many", transaction, write=True)

    def _write_record(
        self,
        connection: sqlite3.Connection,
        key: StorageRecordKey,
        previous: int | None,
        replacement: StoredRecord,
    ) -> Stored:
        """Write a decided replacement of revision ``previous`` (None: a create), database
        thread, inside the transaction; the store head follows before ``COMMIT``."""
        connection.execute(
            "INSERT INTO heads (namespace, name, revision, fence) VALUES (?, ?, ?, 0) "
            "ON CONFLICT (namespace, name) DO UPDATE SET revision = excluded.revision",
            (key.namespace, key.name, replacement.revision),
        )
        connection.execute(
            "INSERT INTO items (namespace, name, item, revision, envelope) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace, name, item) DO UPDATE "
            "SET revision = excluded.revision, envelope = excluded.envelope",
            (key.namespace, key.name, _SINGLE_ITEM, replacement.revision, replacement.data),
        )
        self._guard.wrote(key, previous, replacement.revision)
        return Stored(replacement.revision)

    async def current_fence(self, key: StorageRecordKey) -> int:
        key = check_key(key)
        return await self._submit(
            "current_fence", lambda connection: _read_head(connection, key).fence, write=False
        )

    async def reserve_fence(self, key: StorageRecordKey) -> int:
        key = check_key(key)

        def transaction(connection: sqlite3.Connection) -> int:
            current = _read_head(connection, key).fence
            if current >= self.ceiling:
                raise FencingTokenExhausted()
            _store_fence(connection, key, current + 1)
            return current + 1

        return await self._submit("reserve_fence", transaction, write=True)

    async def establish_fence(self, key: StorageRecordKey, token: int) -> None:
        key = check_key(key)
        token = check_token(token)
        establish_decision(0, token, self.ceiling)  # token 0 / overflow before any I/O

        def transaction(connection: sqlite3.Connection) -> None:
            current = _read_head(connection, key).fence
            if establish_decision(current, token, self.ceiling):
                _store_fence(connection, key, token)

        await self._submit("establish_fence", transaction, write=True)

    async def record_names(self, namespace: str) -> list[str]:
        """The names of the records of ``namespace`` that hold a value, sorted
        (unauthenticated: where to look, never a decision)."""

        def body(connection: sqlite3.Connection) -> list[str]:
            rows = connection.execute(
                "SELECT DISTINCT name FROM items WHERE namespace = ? ORDER BY name", (namespace,)
            ).fetchall()
            return [str(row[0]) for row in rows]

        return await self._submit("record_names", body, write=False)

    async def integrity_check(self) -> list[str]:
        """``PRAGMA integrity_check``: ``["ok"]`` for a sound database."""

        def body(connection: sqlite3.Connection) -> list[str]:
            rows = connection.execute("PRAGMA integrity_check").fetchall()
            return [str(row[0]) for row in rows]

        return await self._submit("integrity_check", body, write=False)

    async def close(self) -> None:
        """Close the connection after every operation already submitted; idempotent.

        Every call, the first or a later one, returns once the database thread
        has run the work submitted before the first call, closed the
        connection and exited. Calls made after it raise ``StorageBackendError``.
        With several event loops sharing the backend, the work another loop
        queued and had not yet handed to the thread when it closed fails with
        ``StorageBackendError`` as well.
        """
        self._closing = True
        group = self._groups.get(asyncio.get_running_loop())
        if group is not None:
            await group.idle.wait()  # this loop's work submitted before goes first
        last = self._thread.close([_Work(_CLOSE, lambda connection: None, False)])
        if last is not None:
            await asyncio.shield(last)
        await self._thread.wait_closed()


def _own_errors(outcomes: list[Outcome]) -> list[Outcome]:
    """``outcomes`` with each caller's error its own instance (a failed transaction
    fails its writes with one), so tracebacks do not mix."""
    seen: set[int] = set()
    owned: list[Outcome] = []
    for ok, value in outcomes:
        delivered = value
        if not ok and isinstance(value, OctoError):
            if id(value) in seen:
                delivered = copy_error(value)
            seen.add(id(value))
        owned.append((ok, delivered))
    return owned


def _wrote(value: object) -> bool:
    """Whether a write's outcome stored something (one ``Stored``, or a list with one)."""
    if isinstance(value, list):
        return any(isinstance(item, Stored) for item in value)
    return isinstance(value, Stored)


def _isolated(work: _Work, connection: sqlite3.Connection, guard: RollbackGuard) -> Outcome:
    """One write of a group inside its own savepoint.

    A refusal (``OctoError``) is decided before the write changes anything; any
    other failure of this write alone (a defect) is undone back to the
    savepoint, with its share of the store head's changes, and reported to
    this caller only. A database error fails the whole group (raised).
    """
    mark = guard.mark()
    connection.execute("SAVEPOINT octo_write")
    try:
        value = work.function(connection)
    except OctoError as exc:
        connection.execute("RELEASE octo_write")
        return (False, exc)
    except sqlite3.Error:
        raise
    except Exception as exc:
        connection.execute("ROLLBACK TO octo_write")
        connection.execute("RELEASE octo_write")
        guard.undo_to(mark)
        return (False, _translated(work.operation, exc))
    connection.execute("RELEASE octo_write")
    return (True, value)


def _translated(operation: str, exc: BaseException) -> BaseException:
    """The error a caller sees for ``exc`` raised by ``operation`` in the thread.

    Protocol errors pass through; database and OS errors, and anything else (a
    defect), become a fresh ``StorageBackendError`` naming only the class.
    """
    if isinstance(exc, OctoError):
        return exc
    if isinstance(exc, sqlite3.Error):
        return StorageBackendError(_sqlite_detail(operation, exc))
    if isinstance(exc, OSError):
        return StorageBackendError(f"{operation}: {exc.strerror}")
    return StorageBackendError(f"{operation}: {type(exc).__name__}")


def _read_head(connection: sqlite3.Connection, key: StorageRecordKey) -> Head:
    row = connection.execute(
        _SELECT_RECORD, {"namespace": key.namespace, "name": key.name, "item": _SINGLE_ITEM}
    ).fetchone()
    return head_from_row(row)


def _store_fence(connection: sqlite3.Connection, key: StorageRecordKey, fence: int) -> None:
    connection.execute(
        "INSERT INTO heads (namespace, name, revision, fence) VALUES (?, ?, 0, ?) "
        "ON CONFLICT (namespace, name) DO UPDATE SET fence = excluded.fence",
        (key.namespace, key.name, fence),
    )


class SqliteLedgerStore(AuthenticatedStore):
    """The host ledger store: an ``AuthenticatedStore`` over a ``SqliteRecordBackend``.

    ``SqliteLedgerStore(path, keyring, anchor_path=a)`` behaves exactly as
    ``AuthenticatedStore(SqliteRecordBackend(path, anchor_path=a), keyring)``.

    No I/O in the constructor; the first awaited call opens the database and
    checks the anchor. ``close()`` is idempotent. Ledger records live at
    ``ledger_record_key(run)``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        keyring: StorageKeyring,
        *,
        anchor_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self._sqlite = SqliteRecordBackend(path, anchor_path=anchor_path)
        super().__init__(self._sqlite, keyring)

    async def integrity_check(self) -> list[str]:
        """``PRAGMA integrity_check`` of the database: ``["ok"]`` when sound."""
        return await self._sqlite.integrity_check()
