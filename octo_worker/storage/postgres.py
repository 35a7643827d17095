"""The worker's journal store on PostgreSQL: ``PostgresJournalStore``.

What it owns
------------
The journal of many tenant scopes in two tables of one PostgreSQL schema
(``postgres_sql``: ``heads``, ``items``, ``schema_version``), reached with
asyncpg, with exactly the rows, envelopes, revisions, fences, outbox and
operator views of the SQLite journal (``base.JournalStoreBase`` holds the
public API both share; ``changes.CommitBatch`` decides every commit), so
that several worker daemons on several machines can serve one scope in
turn: the broker's single active consumer picks the owner, and the
fence decides between an owner and the one it superseded.

* **Fences**: the scope's head is created sealed at fence 1, or
  read under its row lock, its seal verified, and its fence raised by ONE
  ``UPDATE`` that compares the fence and revision it read in SQL and stores
  the head resealed (the seal needs the storage key, which only this process
  holds, so the new fence is sealed here; the compare-and-swap is what keeps
  two reservations from ever getting the same fence). The revision read is
  the commit baseline. Then the whole scope is checked against its head
  (``base.JournalStoreBase.verify_scope``).
* **Group commit**: the change sets waiting together run in ONE
  transaction (one WAL flush): the heads of their scopes are locked first
  (``FOR UPDATE``, in name order), then each change set is decided by
  ``CommitBatch`` against the locked head (fence, baseline, chained
  session commits) and written by ONE statement that compares every row's
  revision with its base in SQL and writes all of its rows or none (so no
  savepoint is needed: a refused change set changed nothing; the scope's
  digest is moved by its writes before the statement, so only a change
  set whose deletions could empty the digest, which an honest head never
  allows, runs inside a savepoint), then the heads advance, resealed with
  their moved digests (``scope_head``). A superseded owner's commit meets
  the new fence under the lock: ``FencingTokenRejected``, nothing written.
  A batch of several change sets of one scope that all commit is written
  by one statement for the whole batch instead (``postgres_batch``: each
  row once, at its last revision); whatever that path cannot decide
  exactly rolls the transaction back and runs it change set by change set.
* **Reads**: one statement each, the head read beside the rows in that
  statement's snapshot (the floor rule); no read sets a baseline.

Store head and rollback anchor: every fence reservation and commit batch
moves the schema's store head (``store_head``, ``postgres_heads``) in its
transaction, so a scope deleted or put back whole is refused at its next
check. With ``anchor_path`` (a file on storage every worker of the journal
mounts, ``store_anchor``), the store head revision is anchored after each
such commit, by whichever worker made it, and checked before every
snapshot: the whole schema restored from an older copy is refused too.
Without it, that protection is the database's own (point-in-time
recovery, replicas, ``synchronous_commit``). Within the database the floor
rule still refuses a row newer than its head.

What it must never do
---------------------
Decide an outcome itself (``CommitBatch`` does), log or raise with keys,
documents, frames, passwords or bound SQL values (a database failure is a
``StorageBackendError`` naming the operation, class and SQLSTATE), or let a
caller's cancellation leave a submitted commit's outcome unknown.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import asyncpg

from octo_common.errors import (
    FencingTokenExhausted,
    OctoError,
    RevisionExhausted,
    RollbackDetected,
    StorageBackendError,
)
from octo_common.records import StorageKeyring
from octo_common.runtime import postgres as runtime_postgres
from octo_common.runtime.postgres import (
    Connection,
    PoolSettings,
    postgres_error,
    redacted_url,
    schema_version,
    wait_for_close,
)
from octo_common.runtime.sqlite import copy_error
from octo_common.setdigest import SetDigest
from octo_worker.storage.base import JournalStoreBase, Pruned, Resealed
from octo_worker.storage.changes import (
    CommitBatch,
    Outcomes,
    PendingCommit,
    Row,
    RowWrite,
    SessionTails,
    closed_sessions,
)
from octo_worker.storage.documents import (
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
)
from octo_worker.storage.interface import ScopeMetadata
from octo_worker.storage.postgres_batch import (
    SlowPath,
    advance_heads,
    lock_head,
    see_locked_heads,
    write_batch,
    write_rows,
)
from octo_worker.storage.postgres_heads import (
    StoreHeads,
    reseal_store_head,
)
from octo_worker.storage.postgres_reads import RowReads
from octo_worker.storage.postgres_rekey import SCHEMA_VERSION, migrate, reseal_written_at
from octo_worker.storage.postgres_sql import DEFAULT_SCHEMA, statements
from octo_worker.storage.scope_head import (
    DigestChanges,
    ScopeHead,
    ScopeSnapshot,
    digest_and_index,
)
from octo_worker.storage.sealing import checked_rows

__all__ = ["DEFAULT_SCHEMA", "POSTGRES_MAX_BIGINT", "PostgresJournalStore"]

POSTGRES_MAX_BIGINT = 2**63 - 1
"""The ceiling of revisions and fences (``BIGINT``), as SQLite's ``INTEGER``."""

# A transaction the server ends as a deadlock or a serialization failure
# committed nothing: it runs again, whole, this many times.
_RETRIES = 3
_T = TypeVar("_T")


class _GuardRefused(Exception):
    """A statement's SQL check refused what the locked state allowed."""


class _Again(Exception):
    """Another worker changed what this transaction read first: run it again."""


class _Refused(Exception):
    """A change set refused after its statement wrote rows: its savepoint undoes them."""

    def __init__(self, error: OctoError) -> None:
        super().__init__(error.code)
        self.error = error


class _Tampered(Exception):
    """A row a change set replaced was not the loaded scope's: the transaction fails."""

    def __init__(self, error: RollbackDetected) -> None:
        super().__init__(error.code)
        self.error = error


class PostgresJournalStore(JournalStoreBase):
    """The journal in a PostgreSQL schema; the public API is ``JournalStoreBase``'s.

    ``PostgresJournalStore(url, keyring, *, password_file=None,
    schema="octo_journal", data_keyring=None, ...)`` does no I/O; the first
    awaited call connects (a pool of at most ``max_connections``), creates
    the schema when it is absent and migrates it forward under an advisory
    lock (workers that open one database together migrate it once). A
    schema newer than this code is refused. ``url`` must not hold a
    password (``password_file``, read at each new connection).

    ``read_only=True`` (the inspection verbs, beside running daemons): no
    schema is created or migrated (a missing one is refused), every session
    is ``default_transaction_read_only``, and every write call raises
    ``StorageBackendError`` before any I/O. ``maintenance=True`` (``prune``
    and ``reseal``): rows only, never a head (``commit`` and
    ``reserve_fence`` raise); each maintenance write holds its scope's head
    lock, so it never lands between a commit's reads and writes.

    Sessions commit with ``synchronous_commit = on``; a transaction idle (or
    stuck, ``postgres_batch.lock_head``) for ``idle_transaction_timeout``
    seconds is ended, so a paused worker holds a head lock no longer. One event loop:
    the first call binds the store to its loop. Revisions and fences stop
    at 2^63 - 1. ``anchor_path``: the shared rollback anchor file (see the module
    docstring; :meth:`initialize_anchor` writes it first).
    """

    def __init__(
        self,
        url: str,
        keyring: StorageKeyring,
        *,
        schema: str = DEFAULT_SCHEMA,
        data_keyring: StorageKeyring | None = None,
        password_file: str | os.PathLike[str] | None = None,
        anchor_path: str | os.PathLike[str] | None = None,
        group_commit: bool = True,
        on_batch: Callable[[int], None] | None = None,
        read_only: bool = False,
        maintenance: bool = False,
        max_connections: int = 4,
        connect_timeout: float = 10.0,
        command_timeout: float = 30.0,
        idle_transaction_timeout: float = 5.0,
    ) -> None:
        super().__init__(
            keyring,
            data_keyring,
            group_commit=group_commit,
            on_batch=on_batch,
            read_only=read_only,
            maintenance=maintenance,
        )
        self._schema = runtime_postgres.check_schema(schema)
        self._sql = statements(self._schema)
        self._store = StoreHeads(self._schema, keyring, anchor_path, SCHEMA_VERSION)
        # A journal's pool has two connections at least: the writer and a reader.
        timeouts = (connect_timeout, command_timeout, idle_transaction_timeout)
        self._connecting = PoolSettings(
            url, password_file, max_connections, timeouts, min_connections=2
        )
        self._url = self._connecting.url
        self._idle = idle_transaction_timeout
        self._command_timeout = command_timeout
        self._pool: asyncpg.Pool | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open_lock: asyncio.Lock | None = None
        # One write transaction at a time (batches, fences, maintenance), so
        # this instance's baselines and tails move in its own order.
        self._write_lock: asyncio.Lock | None = None
        self._writes: set[asyncio.Task[Any]] = set()
        # Commit baselines per scope: set by reserve and commits.
        self._baselines: dict[str, int] = {}
        self._session_tails = SessionTails()
        self._reads = RowReads(self._fetch_items, self._writes)

    @property
    def schema(self) -> str:
        """The PostgreSQL schema that holds the tables."""
        return self._schema

    def __repr__(self) -> str:
        return f"PostgresJournalStore(url={redacted_url(self._url)!r}, schema={self._schema!r})"

    # Opening and closing --------------------------------------------------------------------

    def _bind_loop(self) -> None:
        loop = runtime_postgres.bound_loop(self._loop, "store")
        if self._loop is None:
            self._loop, self._open_lock, self._write_lock = loop, asyncio.Lock(), asyncio.Lock()

    async def _ensure_open(self) -> None:
        self._bind_loop()
        if self._closed:
            raise StorageBackendError("store is closed")
        if self._pool is not None:
            return
        assert self._open_lock is not None
        async with self._open_lock:
            if self._pool is None:  # not opened by another task while this one waited
                try:
                    self._pool = await self._open()
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    raise postgres_error("open", exc) from None
            self._opened = True

    async def _open(self) -> asyncpg.Pool:
        async def prepare(connection: Connection) -> None:
            if not self._read_only:
                keyrings = (self._keyring, self._data_keyring)
                await migrate(connection, self._schema, keyrings, rotated=not self._maintenance)
                return
            version = await schema_version(connection, self._schema)
            if version is None:
                raise StorageBackendError("open: the journal schema does not exist")
            if version != SCHEMA_VERSION:
                raise StorageBackendError(f"open: schema version {version} is not {SCHEMA_VERSION}")

        return await self._connecting.open(
            "octo-worker-journal", prepare, read_only=self._read_only
        )

    async def close(self) -> None:
        """Finish queued commits, then close the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._commits.idle.wait()
        while self._writes:
            await asyncio.wait(list(self._writes))
        pool, self._pool = self._pool, None
        if pool is not None:
            await wait_for_close(pool, self._command_timeout)
        self._session_tails.clear()

    # Running statements ---------------------------------------------------------------------

    def _ready_pool(self) -> asyncpg.Pool:
        pool = self._pool
        if pool is None:
            raise StorageBackendError("store is closed")
        return pool

    async def _read(self, operation: str, body: Callable[[Connection], Awaitable[_T]]) -> _T:
        await self._ensure_open()
        try:
            async with self._ready_pool().acquire() as connection:
                return await body(connection)
        except (OctoError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise postgres_error(operation, exc) from None

    async def _write(
        self,
        operation: str,
        body: Callable[[Connection], Awaitable[_T]],
        *,
        queued: bool = False,
    ) -> _T:
        """``body`` in one transaction, the only write of this store under way; a
        deadlock or serialization failure runs it again, whole.

        ``queued``: a batch of the commit queue, submitted before ``close`` was
        called (it still runs: its callers wait for it).
        """
        if not queued:
            self._check_writable()
            await self._ensure_open()
        assert self._write_lock is not None
        async with self._write_lock:
            for attempt in range(_RETRIES + 1):
                try:
                    async with (
                        self._ready_pool().acquire() as connection,
                        connection.transaction(),
                    ):
                        return await body(connection)
                except (
                    asyncpg.exceptions.DeadlockDetectedError,
                    asyncpg.exceptions.SerializationError,
                    _Again,
                ) as exc:
                    if attempt == _RETRIES:
                        raise postgres_error(operation, exc) from None
                except (OctoError, asyncio.CancelledError):
                    raise
                except _Tampered as tampered:
                    raise tampered.error from None
                except _GuardRefused:
                    raise StorageBackendError(
                        f"{operation}: a row changed under its lock"
                    ) from None
                except Exception as exc:
                    raise postgres_error(operation, exc) from None
        raise AssertionError("unreachable")

    # Fences and commits -------------------------------------------------------------------

    async def _reserve(self, scope: str) -> int:
        sealer = self._sealer

        async def body(connection: Connection) -> tuple[int, int]:
            row = await lock_head(connection, self._ready_pool(), self._sql, scope, self._idle)
            if row is False:  # a stale holder was ended: run the reservation again
                raise _Again()
            if row is None:
                head = sealer.seal_head(ScopeHead.empty(scope).with_fence(1))
                created = await connection.fetchval(
                    self._sql["create_head"], scope, *head.row()[2:]
                )
                if created is None:  # another worker created it meanwhile
                    raise _Again()
                await self._store.move(connection, [(None, head)])
                return head.revision, head.fence
            head = ScopeHead.from_row(scope, tuple(row))
            sealer.verify_head(head)
            if head.fence >= POSTGRES_MAX_BIGINT:
                raise FencingTokenExhausted()
            raised = sealer.seal_head(head.with_fence(head.fence + 1))
            key_id, tag = raised.row()[4:]
            moved = await connection.fetchval(
                self._sql["raise_fence"],
                scope,
                raised.fence,
                key_id,
                tag,
                head.fence,
                head.revision,
            )
            if moved != raised.fence:
                raise _GuardRefused()
            await self._store.move(connection, [(head, raised)])
            return raised.revision, raised.fence

        revision, fence = await self._write("reserve_fence", body)
        await self._store.anchor_moved()
        self._baselines[scope] = revision
        return fence

    async def _reseal_head(self, scope: str) -> bool:
        sealer = self._sealer

        async def body(connection: Connection) -> bool:
            row = await connection.fetchrow(self._sql["lock_head"], scope)
            resealed = False
            if row is not None:
                head = ScopeHead.from_row(scope, tuple(row))
                if head.key_id != sealer.keyring.active_id:
                    sealer.verify_head(head)
                    await self._store_head(connection, sealer.seal_head(head))
                    resealed = True
            await reseal_written_at(connection, f'"{self._schema}"', sealer.keyring, scope)
            return await reseal_store_head(connection, self._schema, sealer.keyring) or resealed

        return await self._write("reseal", body)

    async def _store_head(self, connection: Connection, head: ScopeHead) -> None:
        """Write ``head`` (sealed) at the revision and fence it has, under its lock."""
        revision, fence, count, digest, key_id, tag = head.row()
        moved = await connection.fetchval(
            self._sql["reseal_head"], head.scope, revision, fence, count, digest, key_id, tag
        )
        if moved != 1:
            raise _GuardRefused()

    async def _scope_snapshot(self, scope: str) -> ScopeSnapshot:
        """The head and every row triple of the scope in one repeatable-read snapshot;
        the digest recomputed off the event loop; the store head checked first."""
        anchored = await self._store.anchored()  # before the snapshot: never newer

        async def body(connection: Connection) -> tuple[ScopeHead | None, list[Any], Any]:
            async with connection.transaction(isolation="repeatable_read", readonly=True):
                await self._store.check(connection, anchored)
                row = await connection.fetchrow(self._sql["select_head_row"], scope)
                rows = await connection.fetch(self._sql["select_scope_rows"], scope)
                written = await connection.fetch(self._sql["select_written_tags"], scope)
            head = None if row is None else ScopeHead.from_row(scope, tuple(row))
            return head, [tuple(found) for found in rows], frozenset(map(tuple, written))

        head, rows, written = await self._read("verify_scope", body)
        computed, index = await asyncio.to_thread(digest_and_index, scope, rows, len(rows))
        revision = 0 if head is None else head.revision
        index.revision = revision
        return ScopeSnapshot(head, computed, revision, computed.count, 0, index, written)

    async def _store_check(self) -> int:
        check = functools.partial(self._store.verify, anchored=await self._store.anchored())
        return await self._read("verify_store", check)

    async def initialize_anchor(self) -> int:
        """Write the anchor file from the store head as it is now (explicit operator step:
        a configured anchor that is missing fails every check until then)."""
        return await self._read("init_anchor", self._store.initialize_anchor)

    def _run_batch(self, batch: list[PendingCommit], done: Callable[[Outcomes], None]) -> None:
        assert self._loop is not None
        task = self._loop.create_task(self._commit_batch(batch), name="octo-journal-commit")
        self._writes.add(task)

        def finished(task: asyncio.Task[list[int | OctoError]]) -> None:
            self._writes.discard(task)
            if task.cancelled():
                outcomes: Outcomes = [
                    StorageBackendError("commit: cancelled") for _ in range(len(batch))
                ]
            else:
                failure = task.exception()
                if failure is not None:
                    # A defect here must not strand the batch's callers.
                    outcomes = [postgres_error("commit", failure) for _ in batch]
                else:
                    outcomes = task.result()
            done(outcomes)

        task.add_done_callback(finished)

    async def _commit_batch(self, batch: list[PendingCommit]) -> list[int | OctoError]:
        """One transaction for ``batch`` (retried whole on a deadlock); every outcome.
        Several change sets try one statement first (``postgres_batch``), else
        the transaction runs again one change set at a time."""
        decisions: list[CommitBatch] = []
        batched = [len(batch) > 1]

        def decision_record(baselines: dict[str, int]) -> CommitBatch:
            return CommitBatch(
                batch,
                baselines,
                self._session_tails,
                POSTGRES_MAX_BIGINT,
                verify_head=self._sealer.verify_head,
                live=self._live,
            )

        async def body(connection: Connection) -> list[int | OctoError]:
            # A fresh decision record per attempt: a failed attempt left nothing.
            decision = decision_record(self._baselines)
            decisions.append(decision)
            if batched[0]:
                try:
                    await self._apply(
                        connection, decision, dry=decision_record(dict(self._baselines))
                    )
                except SlowPath:
                    batched[0] = False
                    raise _Again() from None
            else:
                await self._apply(connection, decision)
            return decision.outcomes

        try:
            await self._write("commit", body, queued=True)
        except OctoError as exc:
            if not decisions:  # failed before its transaction began
                return [copy_error(exc) for _ in batch]
            return decisions[-1].fail_all(exc)
        try:
            await self._store.anchor_moved()
        except OctoError as exc:  # committed all the same: nothing may chain on it
            return decisions[-1].fail_all(exc, committed=True)
        return decisions[-1].finish()

    async def _apply(
        self, connection: Connection, decisions: CommitBatch, *, dry: CommitBatch | None = None
    ) -> None:
        """The commit checks and writes of every change set of the batch, inside its transaction
        (with ``dry``, the batch's copy of the decisions: in one statement, or ``SlowPath``)."""
        scopes = sorted({pending.scope for pending in decisions.batch})
        await see_locked_heads(connection, self._sql["lock_heads"], scopes, decisions, dry)
        now = time.time()
        if dry is not None:
            await write_batch(
                connection, self._sql["write_change_set"], decisions, dry, self._sealer, now
            )
        for pending in () if dry is not None else decisions.batch:
            try:
                revision, digest = await self._apply_one(connection, pending, decisions, now)
            except OctoError as exc:
                decisions.refused(pending, exc)
                continue
            decisions.committed_one(pending, revision, digest)
        if not await advance_heads(connection, self._sql["advance_heads"], decisions, self._sealer):
            raise _GuardRefused()
        await self._store.move(connection, decisions.head_moves())

    async def _apply_one(
        self, connection: Connection, pending: PendingCommit, decisions: CommitBatch, now: float
    ) -> tuple[int, SetDigest]:
        """The commit checks and writes of one change set: its revision and the scope's digest
        moved by its rows (O(rows it changes))."""
        scope = pending.scope
        writes, revision = decisions.check(pending)  # steps 1-2
        for write in writes:
            if write.after is not None:  # a broken chain
                actual = await self._current(connection, scope, write)
                raise decisions.conflict(pending, write, actual)
        if revision is None:  # step 4, after step 3's verdict
            for write in writes:
                actual = await self._current(connection, scope, write)
                if actual != write.base_revision:
                    raise decisions.conflict(pending, write, actual)
            raise RevisionExhausted()
        moves = DigestChanges()
        for write in writes:
            moves.wrote(write.namespace, write.item, write.base_revision, revision)
        # What the writes do to the digest is known before they run (the
        # statement checks each base): a digest they cannot move refuses the
        # change set with nothing written. Deletions are known after it; only
        # when they could empty the digest does the change set need a savepoint.
        written = decisions.moved_digest(pending, moves)
        if written.count >= len(pending.outbox_delete):
            return revision, await self._write_rows(
                connection, pending, decisions, writes, revision, now, moves
            )
        try:
            async with connection.transaction():  # a savepoint
                digest = await self._write_rows(
                    connection, pending, decisions, writes, revision, now, moves
                )
        except _Refused as refused:
            raise refused.error from None
        return revision, digest

    async def _write_rows(
        self,
        connection: Connection,
        pending: PendingCommit,
        decisions: CommitBatch,
        writes: tuple[RowWrite, ...],
        revision: int,
        now: float,
        moves: DigestChanges,
    ) -> SetDigest:
        """Step 3 and the writes, in one statement; the digest moved by them."""
        scope = pending.scope
        rows = [
            (w, w.base_revision, revision, self._sealer.seal(scope, w, revision)) for w in writes
        ]
        refused_at, actual, written, _, deleted_items, deleted_revisions = await write_rows(
            connection,
            self._sql["write_change_set"],
            scope,
            now,
            rows,
            closed_sessions(writes),
            list(pending.outbox_delete),
            self._sealer.keyring,
        )
        if refused_at is not None:  # step 3: nothing of this change set was written
            write = writes[int(refused_at) - 1]
            raise decisions.conflict(pending, write, None if actual is None else int(actual))
        if written != len(writes):
            raise _GuardRefused()
        for item, old in zip(deleted_items or (), deleted_revisions or (), strict=True):
            moves.wrote(NS_OUTBOX, str(item), int(old), None)
        try:
            decisions.check_live(pending, moves)
        except RollbackDetected as error:
            # Rows not the loaded scope's: the whole transaction is undone.
            raise _Tampered(error) from None
        try:
            return decisions.moved_digest(pending, moves)
        except RollbackDetected as error:
            # Rows were written: only the savepoint the caller holds undoes them.
            raise _Refused(error) from None

    async def _current(self, connection: Connection, scope: str, write: RowWrite) -> int | None:
        value = await connection.fetchval(self._sql["current"], scope, write.namespace, write.item)
        return None if value is None else int(value)

    # Reads -----------------------------------------------------------------------------------

    async def _rows(self, scope: str, namespace: str, items: Sequence[str] | None) -> list[Row]:
        if items is not None:
            return await self._reads.rows(scope, namespace, set(items))

        async def body(connection: Connection) -> list[Row]:
            found = await connection.fetch(self._sql["select_namespace"], scope, namespace)
            return _floor_checked([tuple(row) for row in found])

        return await self._read("load", body)

    async def _fetch_items(self, scope: str, namespace: str, items: list[str]) -> list[Row]:
        async def body(connection: Connection) -> list[Row]:
            found = await connection.fetch(self._sql["select_items"], scope, namespace, items)
            return _floor_checked([tuple(row) for row in found])

        return await self._read("load", body)

    async def _outbox_rows(self, scope: str, session: str) -> tuple[list[Row], bool]:
        async def body(connection: Connection) -> list[Row]:
            found = await connection.fetch(self._sql["select_outbox_of"], scope, session)
            return _floor_checked([tuple(row) for row in found])

        return await self._read("load_outbox", body), True

    async def _session_rows(
        self, scope: str, keep: Sequence[str] | None
    ) -> tuple[list[Row], list[Row], list[Row]]:
        async def body(connection: Connection) -> tuple[list[Row], list[Row], list[Row]]:
            if keep is None:
                found = await connection.fetch(self._sql["select_sessions"], scope)
            else:
                found = await connection.fetch(self._sql["select_live_sessions"], scope, list(keep))
            states = [(r[0], r[2], r[3], r[4]) for r in found if r[1] == NS_SESSION]
            openings = [(r[0], r[2], r[3], r[4]) for r in found if r[1] == NS_SESSION_OPEN]
            requests = [(r[0], r[2], r[3], r[4]) for r in found if r[1] == NS_SESSION_REQUEST]
            return _floor_checked(states), _floor_checked(openings), _floor_checked(requests)

        return await self._read("load_sessions", body)

    async def _prunable_rows(self, scope: str, cutoff: float) -> list[tuple[Row, Any, Any]]:
        async def body(connection: Connection) -> list[tuple[Row, Any, Any]]:
            found = await connection.fetch(self._sql["select_prunable"], scope, cutoff)
            checked = _floor_checked([tuple(row)[:4] for row in found])
            return [(row, r[4], r[5]) for r, row in zip(found, checked, strict=True)]

        return await self._read("prune", body)

    async def _row_batch(self, scope: str, after: int) -> list[tuple[int, str, Row]]:
        async def body(connection: Connection) -> list[tuple[int, str, Row]]:
            found = await connection.fetch(self._sql["select_batch"], scope, after)
            checked = _floor_checked([(r[0], r[3], r[4], r[5]) for r in found])
            return [(int(r[1]), str(r[2]), row) for r, row in zip(found, checked, strict=True)]

        return await self._read("reseal", body)

    async def _head(self, scope: str) -> int:
        async def body(connection: Connection) -> int:
            row = await connection.fetchrow(self._sql["select_head"], scope)
            return 0 if row is None else int(row[0])

        return await self._read("head_revision", body)

    async def _scope_names(self, *, stored: bool = False) -> list[str]:
        async def body(connection: Connection) -> list[str]:
            statement = self._sql["select_stored_scopes" if stored else "select_scopes"]
            return [str(row[0]) for row in await connection.fetch(statement)]

        return await self._read("scopes", body)

    async def _metadata(self, scope: str) -> ScopeMetadata:
        async def body(connection: Connection) -> ScopeMetadata:
            head = await connection.fetchrow(self._sql["select_head"], scope)
            written = await connection.fetch(self._sql["select_written"], scope)
            closed = await connection.fetchval(self._sql["count_closed"], scope)
            return ScopeMetadata(
                0 if head is None else int(head[1]),
                {str(item): float(when) for item, when in written},
                int(closed or 0),
            )

        return await self._read("scope_metadata", body)

    async def _integrity(self) -> list[str]:
        """``["ok"]`` once the server answers and the schema is at the supported version
        (``postgres_heads.schema_problems``)."""
        return await self._read("integrity_check", self._store.schema_problems)

    # Maintenance writes (rows only, under the scope's head lock) ------------------------------

    async def _prune_rows(self, scope: str, victims: Sequence[Pruned]) -> int:
        """Swap each row still at the revision and envelope read for its pruned envelope
        (same revision: no digest or head moves)."""

        async def body(connection: Connection) -> int:
            changed = await connection.fetch(
                self._sql["prune_rows"],
                scope,
                [item for item, _, _, _ in victims],
                [revision for _, revision, _, _ in victims],
                [old for _, _, old, _ in victims],
                [new for _, _, _, new in victims],
            )
            return len(changed)

        return await self._write("prune", body)

    async def _replace_envelopes(self, scope: str, changes: Sequence[Resealed]) -> int:
        async def body(connection: Connection) -> int:
            await connection.fetchrow(self._sql["lock_head"], scope)
            replaced = await connection.fetch(
                self._sql["replace_envelopes"],
                scope,
                [change[0] for change in changes],
                [change[1] for change in changes],
                [change[2] for change in changes],
                [change[3] for change in changes],
            )
            return len(replaced)

        return await self._write("reseal", body)

    async def _mark_closed_rows(self, scope: str, ids: Sequence[str]) -> None:
        async def body(connection: Connection) -> None:
            await connection.execute(self._sql["mark_closed"], scope, list(ids))

        await self._write("mark_closed", body)


def _floor_checked(rows: Sequence[tuple[Any, ...]]) -> list[Row]:
    """Rows read as (head, item, revision, envelope) in one statement: the floor rule."""
    if not rows:
        return []
    head = rows[0][0]
    return checked_rows((row[1:] for row in rows), 0 if head is None else int(head))
