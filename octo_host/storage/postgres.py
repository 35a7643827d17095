"""The host ledger store on PostgreSQL.

This module owns:

* ``PostgresRecordBackend``: the backend contract (``contract``) with exactly the
  semantics of ``VolatileMemoryStore``, the state in three tables (``heads``, ``items``,
  ``schema_version``) of one PostgreSQL schema, reached with asyncpg;
* ``PostgresLedgerStore``: the host ledger store, an ``AuthenticatedStore``
  over it, the counterpart of ``SqliteLedgerStore``.

Several host processes, on several machines, may share one ledger database.
Compare-and-swap on each run's record is the only arbiter between
them: every write transaction first locks the head rows of the records it
touches, in key order, and decides each write against that locked state;
the write statement then checks the caller's expected revision, the item's
revision and the fence again in SQL. So of two hosts that record an intent
for the same step of one run, the second always meets a ``WriteConflict``,
whatever the batching, and their transactions never deadlock each other.

Rollback anchor: not supported. A local anchor file holds what one
process committed and cannot follow the commits of the other hosts that
share the database, so it would refuse their progress or miss a rollback.
``PostgresLedgerStore`` takes no anchor and the host configuration refuses
``[storage] url`` together with ``[ledger] anchor``. Protection against a
database restored from an old backup is the database's own (point-in-time
recovery, replicas, ``synchronous_commit``); within the database the floor
rule still refuses a record older than its head. It keeps a sealed store
head like the SQLite ledger's (``postgres_head``): moved by every write
transaction under its row lock (so every host's commits are serialised on
that row, one lock per group-commit batch), checked against every record
at each open, so a record deleted, or put back to an older sealed version
together with its head row, is refused at the next open; its digest set to
NULL is refused unless the migration's sealed record says it is still to be
built.

This module never logs, returns or raises key material, payload bytes,
passwords or bound SQL values: a database failure is a
``StorageBackendError`` naming the operation, the exception class and the
SQLSTATE only. The URL never carries a password (``password_file``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias, TypeVar

import asyncpg

from octo_common.errors import (
    FencingRequired,
    FencingTokenExhausted,
    OctoError,
    StorageBackendError,
)
from octo_common.records import (
    Conflict,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
)
from octo_common.runtime.groupcommit import GroupCommit, resolve_outcome
from octo_common.runtime.postgres import (
    Connection,
    PoolSettings,
    PostgresMigrationStep,
    bound_loop,
    check_schema,
    migrate_schema,
    postgres_error,
    read_password_file,
    redacted_url,
    wait_for_close,
)
from octo_host.storage.authenticated import AuthenticatedStore
from octo_host.storage.contract import (
    Head,
    ManyWrite,
    Opener,
    SwapBackend,
    cas_decision,
    check_key,
    check_many,
    check_token,
    establish_decision,
    fenced_check,
    head_from_row,
)
from octo_host.storage.postgres_head import Change, PostgresHeadGuard
from octo_host.storage.postgres_sql import MIGRATIONS, SCHEMA_VERSION, statements

__all__ = [
    "DEFAULT_SCHEMA",
    "POSTGRES_MAX_BIGINT",
    "PostgresLedgerStore",
    "PostgresRecordBackend",
    "read_password_file",
    "redacted_url",
]

DEFAULT_SCHEMA = "octo_ledger"
POSTGRES_MAX_BIGINT = 2**63 - 1
"""The ceiling of revisions and fences (``BIGINT``), as SQLite's ``INTEGER``."""

MAX_WRITES_PER_TRANSACTION = 256
_DEADLOCK_RETRIES = 3
_T = TypeVar("_T")
_Connection: TypeAlias = Connection


# Errors ------------------------------------------------------------------------------


class _GuardRefused(Exception):
    """A write statement's SQL check refused what the locked state allowed."""


def _translated(operation: str, exc: BaseException) -> OctoError:
    """What a caller sees for ``exc``: protocol errors as they are, else a fresh
    ``StorageBackendError`` naming the class (and SQLSTATE), never a message."""
    if isinstance(exc, _GuardRefused):
        return StorageBackendError(f"{operation}: a record changed under its lock")
    return postgres_error(operation, exc)


# The write queue ------------------------------------------------------------------------

_View = dict[StorageRecordKey, Head]
"""The locked state of the records of one transaction, as its writes leave it."""

_Statement = tuple[str, tuple[Any, ...], int]
"""One guarded statement: SQL, arguments, and the one value it must return."""

_Decide = Callable[[_View], tuple[Any, list[_Statement]]]
"""Decides one write against the view: its outcome and its statements.

It raises to refuse (nothing written), and changes the view only when it
returns statements."""


class _Write:
    """One submitted write, waiting for its transaction."""

    __slots__ = ("decide", "keys", "operation")

    def __init__(self, operation: str, keys: tuple[StorageRecordKey, ...], decide: _Decide) -> None:
        self.operation = operation
        self.keys = keys
        self.decide = decide


_Outcome: TypeAlias = tuple[bool, Any]
"""A write's outcome: (True, its value) or (False, the error its caller raises)."""


def _cancelled(write: _Write, _error: BaseException) -> _Outcome:
    return (False, StorageBackendError(f"{write.operation}: cancelled"))


def _failed(write: _Write, error: BaseException) -> _Outcome:
    return (False, _translated(write.operation, error))


class PostgresRecordBackend(SwapBackend):
    """The semantics of ``VolatileMemoryStore`` with the state in a PostgreSQL schema.

    No I/O in the constructor: the first awaited call connects (a pool of at
    most ``max_connections``), creates the schema when it is absent and
    migrates it forward under an advisory lock, so hosts that open one
    database together migrate it once. A schema newer than this code is
    refused. ``password_file`` is read at each new connection (a rotated
    password is picked up); the URL must not hold one.

    Writes (CAS, fence reservation, fence establishment) that wait together
    share one transaction and one commit (group commit): each caller
    gets the outcome it would have had alone, because its write is decided
    against the state its predecessors left and re-checked in SQL, and a
    refused write changes nothing. A database error fails every write of
    that transaction (nothing of it is committed); a deadlock reported by
    the server is retried whole; any other failure of one caller's check
    fails that caller only. Reads wait for the writes submitted before them,
    so one backend object's operations take effect in submission order. A
    submitted write completes or fails even if its caller is cancelled.
    Sessions ask for ``synchronous_commit = on`` (a commit returns once its
    WAL is flushed) and end a transaction idle for
    ``idle_transaction_timeout`` seconds, so a paused host cannot hold
    the locks of other hosts' runs for long.

    One event loop: the first call binds the backend to its loop; a call
    from another loop is refused. Revisions and fences stop at 2^63 - 1.
    No rollback anchor (see the module docstring).
    """

    ceiling = POSTGRES_MAX_BIGINT

    def __init__(
        self,
        url: str,
        *,
        password_file: str | os.PathLike[str] | None = None,
        schema: str = DEFAULT_SCHEMA,
        max_connections: int = 4,
        connect_timeout: float = 10.0,
        command_timeout: float = 30.0,
        idle_transaction_timeout: float = 10.0,
    ) -> None:
        timeouts = (connect_timeout, command_timeout, idle_transaction_timeout)
        self._connecting = PoolSettings(
            url, password_file, max_connections, timeouts, min_connections=1
        )
        self._url = self._connecting.url
        self._schema = check_schema(schema)
        self._command_timeout = command_timeout
        self._sql = statements(self._schema)
        self._guard = PostgresHeadGuard(self._schema, POSTGRES_MAX_BIGINT)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: asyncpg.Pool | None = None
        self._open_lock: asyncio.Lock | None = None
        # Writes that wait together share one transaction (at most
        # MAX_WRITES_PER_TRANSACTION), one batch at a time; created on the loop.
        self._writes: GroupCommit[_Write, _Outcome] | None = None
        self._submitted = 0  # writes submitted so far
        self._finished = 0  # writes whose transaction has ended
        self._progress: asyncio.Event | None = None
        self._closed = False
        self._closing: asyncio.Future[None] | None = None

    @property
    def schema(self) -> str:
        """The PostgreSQL schema that holds the tables."""
        return self._schema

    @property
    def group_commit_stats(self) -> tuple[int, int]:
        """(write transactions committed or attempted, writes they carried)."""
        writes = self._writes
        return (0, 0) if writes is None else (writes.transactions, writes.batched)

    def bind_keyring(self, keyring: StorageKeyring) -> None:
        """Seal the store head with ``keyring`` and refuse a head it cannot authenticate
        (``AuthenticatedStore`` calls it); a backend never bound keeps it unsealed."""
        if not isinstance(keyring, StorageKeyring):
            raise TypeError("keyring must be a StorageKeyring")
        self._guard.bind(keyring)

    def __repr__(self) -> str:
        return f"PostgresRecordBackend(url={redacted_url(self._url)!r}, schema={self._schema!r})"

    # Connecting ------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = bound_loop(self._loop, "backend")
        if self._loop is None:
            self._loop, self._open_lock, self._progress = loop, asyncio.Lock(), asyncio.Event()
        return loop

    async def _ready(self, operation: str, *, writer: bool = False) -> asyncpg.Pool:
        """The pool, opening it (and migrating the schema) on first use.

        Refused once ``close`` was called, except for the writer task, which
        still runs the writes submitted before that.
        """
        if self._closed and not writer:
            raise StorageBackendError("store is closed")
        self._bind_loop()
        pool = self._pool
        if pool is not None:
            return pool
        assert self._open_lock is not None
        async with self._open_lock:
            if self._pool is None:
                try:
                    self._pool = await self._open()
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    raise _translated(f"{operation}: open", exc) from None
            return self._pool

    async def _open(self) -> asyncpg.Pool:
        async def migrate(connection: Connection) -> None:
            # One opener at a time per schema, across every host of the database.
            sealed: tuple[PostgresMigrationStep, ...] = (
                *MIGRATIONS[-1],
                self._guard.migration_step(),
            )
            await migrate_schema(
                connection, self._schema, (*MIGRATIONS[:-1], sealed), f"octo-ledger:{self._schema}"
            )
            await self._guard.open(connection)  # the store head against every record

        return await self._connecting.open("octo-host-ledger", migrate)

    # Reads ---------------------------------------------------------------------------

    async def _read(self, operation: str, body: Callable[[_Connection], Awaitable[_T]]) -> _T:
        pool = await self._ready(operation)
        await self._after_writes_submitted_so_far()
        try:
            async with pool.acquire() as connection:
                return await body(connection)
        except (OctoError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise _translated(operation, exc) from None

    async def _after_writes_submitted_so_far(self) -> None:
        target = self._submitted
        while self._finished < target:
            assert self._progress is not None
            await self._progress.wait()

    async def _select_head(self, connection: _Connection, key: StorageRecordKey) -> Head:
        row = await connection.fetchrow(self._sql["select_record"], key.namespace, key.name)
        if row is None:
            raise StorageBackendError("load: no row")
        return head_from_row(tuple(row))

    async def load(self, key: StorageRecordKey) -> StorageSnapshot:
        key = check_key(key)

        async def body(connection: _Connection) -> StorageSnapshot:
            head = await self._select_head(connection, key)
            return StorageSnapshot(head.record, head.floor)

        return await self._read("load", body)

    async def record_names(self, namespace: str) -> list[str]:
        """The names of the records of ``namespace`` that hold a value, sorted
        (unauthenticated: where to look, never a decision)."""

        async def body(connection: _Connection) -> list[str]:
            rows = await connection.fetch(self._sql["select_names"], namespace)
            return [str(row[0]) for row in rows]

        return await self._read("record_names", body)

    async def current_fence(self, key: StorageRecordKey) -> int:
        key = check_key(key)

        async def body(connection: _Connection) -> int:
            return (await self._select_head(connection, key)).fence

        return await self._read("current_fence", body)

    async def integrity_check(self) -> list[str]:
        """``["ok"]`` once the server answers and the schema is at the supported version.

        PostgreSQL has no per-database integrity pragma: pages are the
        server's (data checksums, ``amcheck``), and every record is still
        fully opened on each load and before each write.
        """

        async def body(connection: _Connection) -> list[str]:
            version = await connection.fetchval(self._sql["select_version"])
            if version != SCHEMA_VERSION:
                return [f"schema version {version} is not {SCHEMA_VERSION}"]
            return ["ok"]

        return await self._read("integrity_check", body)

    # Writes --------------------------------------------------------------------------

    def _submit(
        self, operation: str, keys: tuple[StorageRecordKey, ...], decide: _Decide
    ) -> asyncio.Future[Any]:
        """Queue one write; the future gets its value or raises its error. Once
        queued it runs (or fails) even if the caller is cancelled."""
        if self._closed:
            raise StorageBackendError("store is closed")
        self._bind_loop()
        writes = self._writes
        if writes is None:
            writes = self._writes = GroupCommit.running(
                self._run_writes,
                _cancelled,
                max_batch=MAX_WRITES_PER_TRANSACTION,
                on_batch=self._writes_finished,
                settle=resolve_outcome,
                name="octo-ledger-postgres",
            )
        self._submitted += 1
        return writes.submit(_Write(operation, keys, decide))

    async def _run_writes(self, batch: list[_Write]) -> list[_Outcome]:
        """One transaction for ``batch``; a defect here fails the batch, never later callers."""
        try:
            return await self._run_batch(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            return [_failed(write, exc) for write in batch]

    def _writes_finished(self, count: int) -> None:
        """``count`` more writes have an outcome: the reads waiting for them go on."""
        self._finished += count
        assert self._progress is not None
        self._progress.set()
        self._progress = asyncio.Event()

    async def _run_batch(self, batch: list[_Write]) -> list[_Outcome]:
        try:
            pool = await self._ready(batch[0].operation, writer=True)
        except OctoError as exc:
            return [_failed(write, exc) for write in batch]
        for attempt in range(_DEADLOCK_RETRIES + 1):
            try:
                async with pool.acquire() as connection:
                    return await self._transaction(connection, batch)
            except asyncpg.exceptions.DeadlockDetectedError:
                if attempt == _DEADLOCK_RETRIES:
                    raise
                # Rolled back whole: nothing of it was committed, so it runs again.
        raise AssertionError("unreachable")

    async def _transaction(self, connection: _Connection, batch: list[_Write]) -> list[_Outcome]:
        keys = sorted({key for write in batch for key in write.keys})
        namespaces = [key.namespace for key in keys]
        names = [key.name for key in keys]
        results: list[_Outcome] = []
        changes: list[Change] = []
        async with connection.transaction():
            view: _View = {}
            for row in await connection.fetch(self._sql["lock_heads"], namespaces, names):
                key = StorageRecordKey(row[0], row[1])
                view[key] = head_from_row((row[2], row[3], None, None))
            for row in await connection.fetch(self._sql["select_items"], namespaces, names):
                key = StorageRecordKey(row[0], row[1])
                head = view[key]
                view[key] = head_from_row((head.floor, head.fence, row[2], row[3]))
            if len(view) != len(keys):
                raise StorageBackendError("write: a head row was not locked")
            for write in batch:
                try:
                    value, statements = write.decide(view)
                except Exception as exc:  # refused, or a defect in this caller's check
                    results.append(_failed(write, exc))
                    continue
                for sql, arguments, expected in statements:
                    if await connection.fetchval(sql, *arguments) != expected:
                        raise _GuardRefused()
                    if sql == self._sql["write_record"]:
                        namespace, name, new, _, _, old = arguments[:6]
                        changes.append((StorageRecordKey(namespace, name), old, new))
                results.append((True, value))
            await self._guard.seal(connection, changes)  # the store head, last lock taken
        return results

    # Contract (the compare-and-swap entry points: SwapBackend) -----------------------

    def _record_statement(
        self,
        key: StorageRecordKey,
        expected: int | None,
        replacement: StoredRecord,
        fence: int,
    ) -> _Statement:
        arguments = (
            key.namespace,
            key.name,
            replacement.revision,
            expected or 0,
            fence,
            expected,
            replacement.data,
        )
        return (self._sql["write_record"], arguments, replacement.revision)

    async def _swap(
        self,
        operation: str,
        key: StorageRecordKey,
        expected: int | None,
        replacement: StoredRecord,
        token: int | None,
        opener: Opener | None,
    ) -> Stored | Conflict:
        if not isinstance(replacement.data, bytes):
            raise TypeError("replacement data must be bytes")

        def decide(view: _View) -> tuple[Stored | Conflict, list[_Statement]]:
            head = view[key]
            if opener is not None:
                opener(StorageSnapshot(head.record, head.floor))
            if token is None:
                if head.fence != 0:
                    raise FencingRequired(head.fence)
            else:
                fenced_check(head.fence, token)
            actual = None if head.record is None else head.record.revision
            conflict = cas_decision(actual, head.floor, expected, replacement, self.ceiling)
            if conflict is not None:
                return conflict, []
            statement = self._record_statement(key, expected, replacement, head.fence)
            view[key] = Head(replacement.revision, head.fence, replacement)
            return Stored(replacement.revision), [statement]

        result: Stored | Conflict = await self._submit(operation, (key,), decide)
        return result

    async def compare_and_swap_many_opened(
        self, writes: Sequence[ManyWrite]
    ) -> list[Stored | Conflict | None]:
        """Several unfenced CAS of distinct keys in one transaction: all or none.

        Decided as ``SqliteRecordBackend.compare_and_swap_many_opened``: every
        record is opened and decided before any is written; a refusal writes
        nothing; a conflict writes nothing and is reported in its place (None
        for the others); otherwise one ``Stored`` per write, in order.
        """
        checked = check_many(writes)
        for _, _, replacement, _ in checked:
            if not isinstance(replacement.data, bytes):
                raise TypeError("replacement data must be bytes")
        if not checked:
            return []

        def decide(view: _View) -> tuple[list[Stored | Conflict | None], list[_Statement]]:
            decisions: list[Conflict | None] = []
            for key, expected, replacement, opener in checked:
                head = view[key]
                opener(StorageSnapshot(head.record, head.floor))
                if head.fence != 0:
                    raise FencingRequired(head.fence)
                actual = None if head.record is None else head.record.revision
                decisions.append(
                    cas_decision(actual, head.floor, expected, replacement, self.ceiling)
                )
            if any(decision is not None for decision in decisions):
                return list(decisions), []
            statements = []
            for key, expected, replacement, _ in checked:
                statements.append(self._record_statement(key, expected, replacement, 0))
                view[key] = Head(replacement.revision, 0, replacement)
            return [Stored(replacement.revision) for _, _, replacement, _ in checked], statements

        keys = tuple(key for key, _, _, _ in checked)
        result: list[Stored | Conflict | None] = await self._submit(
            "compare_and_swap_many", keys, decide
        )
        return result

    async def reserve_fence(self, key: StorageRecordKey) -> int:
        key = check_key(key)

        def decide(view: _View) -> tuple[int, list[_Statement]]:
            head = view[key]
            if head.fence >= self.ceiling:
                raise FencingTokenExhausted()
            token = head.fence + 1
            statement = (
                self._sql["reserve_fence"],
                (key.namespace, key.name, self.ceiling),
                token,
            )
            view[key] = Head(head.floor, token, head.record)
            return token, [statement]

        token: int = await self._submit("reserve_fence", (key,), decide)
        return token

    async def establish_fence(self, key: StorageRecordKey, token: int) -> None:
        key = check_key(key)
        token = check_token(token)
        establish_decision(0, token, self.ceiling)  # token 0 / overflow before any I/O

        def decide(view: _View) -> tuple[None, list[_Statement]]:
            head = view[key]
            if not establish_decision(head.fence, token, self.ceiling):
                return None, []
            view[key] = Head(head.floor, token, head.record)
            return None, [(self._sql["establish_fence"], (key.namespace, key.name, token), token)]

        await self._submit("establish_fence", (key,), decide)

    # Closing ---------------------------------------------------------------------------

    async def close(self) -> None:
        """Finish the writes already submitted, then close the pool; idempotent.

        Every call returns once the writes submitted before the first call
        have ended and the connections are closed; calls made after it raise
        ``StorageBackendError``.
        """
        self._closed = True
        if self._loop is None:
            return  # never used: nothing to release
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shut_down())
        await asyncio.shield(self._closing)

    async def _shut_down(self) -> None:
        if self._writes is not None:
            await self._writes.idle.wait()
        assert self._open_lock is not None
        async with self._open_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            await wait_for_close(pool, self._command_timeout)


class PostgresLedgerStore(AuthenticatedStore):
    """The host ledger store on PostgreSQL: an ``AuthenticatedStore`` over a
    ``PostgresRecordBackend``, the counterpart of ``SqliteLedgerStore``.

    ``PostgresLedgerStore(url, keyring, password_file=p)`` behaves exactly as
    ``AuthenticatedStore(PostgresRecordBackend(url, password_file=p), keyring)``.
    Several processes may open stores on one database: compare-and-swap on
    each record decides between them. There is no rollback anchor (see the
    module docstring); ``url`` must not contain a password.

    No I/O in the constructor; the first awaited call connects and migrates
    the schema. ``close()`` is idempotent. Ledger records live at
    ``ledger_record_key(run)``.
    """

    def __init__(
        self,
        url: str,
        keyring: StorageKeyring,
        *,
        password_file: str | os.PathLike[str] | None = None,
        schema: str = DEFAULT_SCHEMA,
        max_connections: int = 4,
        connect_timeout: float = 10.0,
        command_timeout: float = 30.0,
        idle_transaction_timeout: float = 10.0,
    ) -> None:
        self._postgres = PostgresRecordBackend(
            url,
            password_file=password_file,
            schema=schema,
            max_connections=max_connections,
            connect_timeout=connect_timeout,
            command_timeout=command_timeout,
            idle_transaction_timeout=idle_transaction_timeout,
        )
        super().__init__(self._postgres, keyring)

    async def integrity_check(self) -> list[str]:
        """Connects, migrates, and reports ``["ok"]`` when the schema is current."""
        return await self._postgres.integrity_check()
