"""The worker's SQLite journal store: ``SqliteJournalStore`` (W§11, H§17.7-17.10, D7, D10).

What it owns
------------
One SQLite database holds the journals of many tenant scopes. Per scope there
is one **head** (``heads`` row ``worker-journal``/scope: scope revision and
fence) and any number of **rows** (``items``) in the namespaces
``worker-journal`` (operation key → ``JournalRow``), ``worker-session``
(session id → state document), ``worker-session-open`` (session id → opening
document) and ``worker-outbox`` (message id → outbox document). Every row is a
keyed storage envelope (``octo_common.records.seal_record``) tagged under
(row namespace, scope) at the revision of the commit that last wrote it; with
a data keyring its document is encrypted first (H§17.9). On load the store
checks the floor rule against the head, opens the envelope, decrypts, and
checks that the document names the row's scope and item.

Commits follow W§11.2 steps 1-5 inside one ``BEGIN IMMEDIATE`` transaction.
**Group commit** (ARCHITECTURE.md decision 5): concurrent ``commit`` calls are
queued; the writer thread takes the whole queue and applies every waiting change set
in ONE transaction and ONE fsync, each under its own ``SAVEPOINT`` so a change
set that fails its checks is rolled back alone. A lone caller is committed at
once (no batching delay). Each caller awaits its own outcome; a submitted
commit is shielded from its caller's cancellation. **Chained session
commits** (``SessionDocuments.link``/``after``): a session submits its next
commit while the previous one is still queued or in flight, naming it
instead of a base revision; the writer resolves the name to the revision
that change set wrote, so one session's commits can share a transaction.

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
public API, the commit queue, the hand-off of batched reads and writes to
their threads, and opening each loaded row (authenticate, decrypt, check
its document's location).

What it must never do
---------------------
Interpret documents beyond their location fields, decide protocol outcomes,
log or raise with keys, payloads, documents or frames, or let a caller's
cancellation leave a submitted commit's outcome unknown.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import msgspec
import structlog

from octo_common.errors import (
    InvalidJournalLease,
    OctoError,
    RecordLocationMismatch,
    RollbackDetected,
    StorageBackendError,
)
from octo_common.ids import validate_token
from octo_common.records import (
    StorageKeyring,
    decrypt_document,
    encrypt_document,
    open_record,
    seal_record,
)
from octo_common.runtime.sqlite import DatabaseThread, run_each
from octo_common.states import TERMINAL_KINDS
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    read_outbox,
    session_header,
    state_status,
)
from octo_worker.storage.interface import (
    OutboxEntry,
    PersistedSession,
    PruneReport,
    ResealReport,
    ScopeMetadata,
    WorkerCommit,
    WorkerJournalLease,
    issue_lease,
)
from octo_worker.storage.sqlite_reader import JournalReader
from octo_worker.storage.sqlite_rows import (
    PendingCommit,
    Row,
    backend_error,
    check_scope,
    guarded,
    open_row,
    prepare,
    record_key,
)
from octo_worker.storage.sqlite_writer import JournalWriter

__all__ = ["SqliteJournalStore", "StoreStats"]

_log = structlog.get_logger("octo_worker.store")

T = TypeVar("T")


def _data_key_id(payload: bytes) -> str | None:
    """The data key id an encrypted row payload names (``LP(id)`` first), if readable."""
    if len(payload) < 8:
        return None
    length = int.from_bytes(payload[:8], "big")
    try:
        return payload[8 : 8 + length].decode("ascii")
    except UnicodeDecodeError:
        return None


class StoreStats(msgspec.Struct, frozen=True):
    """Counters for observability: a snapshot, not a live view."""

    transactions: int
    change_sets: int
    committed_change_sets: int
    failed_change_sets: int
    largest_batch: int
    rows_opened: int = 0
    """Rows loaded, authenticated and decrypted (every load of every namespace)."""


# The store ------------------------------------------------------------------------------


class SqliteJournalStore:
    """Rows, CAS revisions, fences, group commit and the outbox (W§11).

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
        if not isinstance(keyring, StorageKeyring):
            raise TypeError("keyring must be a StorageKeyring")
        if data_keyring is not None and not isinstance(data_keyring, StorageKeyring):
            raise TypeError("data_keyring must be a StorageKeyring")
        self._path = Path(os.fspath(path))
        self._anchor_path = None if anchor_path is None else Path(os.fspath(anchor_path))
        self._keyring = keyring
        self._data_keyring = data_keyring
        self._read_only = read_only
        self._maintenance = maintenance
        # Told the size of every group-commit transaction (metrics), on the loop.
        self._on_batch = on_batch
        self._group_commit = group_commit
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
        )
        self._reader = JournalReader(
            self._path, self._anchor_path, self._writer, read_only=read_only
        )
        # Event-loop state.
        self._open_lock = asyncio.Lock()
        self._opened = False
        self._closed = False
        self._queue: list[PendingCommit] = []
        # Each thread runs one batch at a time; ``*_scheduled`` means a start
        # is already on the loop's ready queue (it collects every change set
        # submitted in the same loop iteration), ``*_busy`` that a batch is in
        # its thread. ``_idle`` is set while neither holds (close waits on it).
        self._writer_scheduled = False
        self._writer_busy = False
        self._read_queue: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._reader_scheduled = False
        self._reader_busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._transactions = 0
        self._change_sets = 0
        self._committed = 0
        self._failed = 0
        self._largest_batch = 0
        self._rows_opened = 0

    # Takes chained session commits (SessionDocuments.link/after). A wrapper
    # that forwards this must hand change sets on in call order, without an
    # await before it does (a chained one arriving first fails closed).
    chains_session_commits: Final = True

    def __repr__(self) -> str:
        return f"SqliteJournalStore(path={os.fspath(self._path)!r})"

    @property
    def stats(self) -> StoreStats:
        """How many transactions ran and how many change sets they carried."""
        return StoreStats(
            self._transactions,
            self._change_sets,
            self._committed,
            self._failed,
            self._largest_batch,
            self._rows_opened,
        )

    async def reserve_fence(self, scope: str) -> WorkerJournalLease:
        """Create the head if absent, add 1 to its fence, return it (W§11.3).

        The head revision read in the same transaction becomes this store
        instance's commit baseline for the scope.
        """
        check_scope(scope)
        self._check_committing()
        token = await self._write_call(lambda: self._writer.reserve(scope))
        return issue_lease(scope, token)

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int:
        """Commit one change set (W§11.2); returns the new scope revision.

        Concurrent calls share transactions (group commit); each caller gets
        the outcome it would have had alone. Once submitted, the commit is
        shielded from the caller's cancellation: it completes or fails.
        """
        check_scope(scope)
        if not isinstance(lease, WorkerJournalLease) or not lease.is_for(scope):
            raise InvalidJournalLease()
        if not isinstance(changes, WorkerCommit):
            raise TypeError("changes must be a WorkerCommit")
        writes, new_sessions = prepare(scope, changes)
        self._check_committing()
        if not self._opened:
            await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int | OctoError] = loop.create_future()
        self._queue.append(
            PendingCommit(
                scope,
                lease.token,
                writes,
                new_sessions,
                tuple(changes.outbox_delete),
                future,
            )
        )
        self._change_sets += 1
        if not (self._writer_scheduled or self._writer_busy):
            self._writer_scheduled = True
            self._idle.clear()
            loop.call_soon(self._start_writes)
        # Shielded by construction, as ``asyncio.shield`` would do but one
        # callback hop cheaper: the change set now belongs to the writer's
        # queue, and ``future`` is only this caller's window on its outcome.
        # Cancelling the caller cancels that window, never the commit; the
        # writer skips a cancelled window and the commit completes or fails.
        outcome = await future
        if isinstance(outcome, OctoError):
            raise outcome
        return outcome

    async def load_records(
        self, scope: str, keys: Iterable[str]
    ) -> dict[str, tuple[WorkerOperationRecord, int] | None]:
        """The rows of ``keys`` (None for a key without a row), W§9.2's ``records``."""
        check_scope(scope)
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            validate_token("operation key", key)
        rows = await self._read_call(lambda: self._reader.read_items(scope, NS_JOURNAL, wanted))
        result: dict[str, tuple[WorkerOperationRecord, int] | None] = dict.fromkeys(wanted)
        for row in rows:
            document = self._open_row(scope, NS_JOURNAL, row)
            record = WorkerOperationRecord.from_row_json(document, scope, row.item)
            result[row.item] = (record, row.revision)
        return result

    async def list_records(self, scope: str) -> list[tuple[WorkerOperationRecord, int]]:
        """Every journal row of ``scope``, oldest revision first (operator helper)."""
        check_scope(scope)
        rows = await self._read_call(lambda: self._reader.read_items(scope, NS_JOURNAL, None))
        records: list[tuple[WorkerOperationRecord, int]] = []
        for row in rows:
            document = self._open_row(scope, NS_JOURNAL, row)
            record = WorkerOperationRecord.from_row_json(document, scope, row.item)
            records.append((record, row.revision))
        return records

    async def prune(self, scope: str, older_than_seconds: float) -> PruneReport:
        """Remove terminal journal rows not written for ``older_than_seconds``.

        Only an operation in a terminal state whose compensation is absent or
        terminal is removed; ``pending`` and ``running`` rows are never touched.
        Every candidate is authenticated before it is chosen, and a row written
        again since (another revision) is kept. The scope head does not move.

        A pruned key is forgotten: a later request for it is admitted as new.
        Prune only keys whose host runs are finished (see OPERATIONS.md).
        """
        check_scope(scope)
        if not older_than_seconds >= 0:
            raise ValueError("older_than_seconds must be a non-negative number")
        cutoff = time.time() - older_than_seconds
        rows = await self._read_call(lambda: self._reader.read_prunable(scope, cutoff))
        victims: list[tuple[str, int]] = []
        kept = 0
        for row in rows:
            record = WorkerOperationRecord.from_row_json(
                self._open_row(scope, NS_JOURNAL, row), scope, row.item
            )
            compensation = record.compensation
            if record.state.kind in TERMINAL_KINDS and (
                compensation is None or compensation.state.kind in TERMINAL_KINDS
            ):
                victims.append((row.item, row.revision))
            else:
                kept += 1
        removed = await self._write_call(lambda: self._writer.delete_journal_rows(scope, victims))
        if removed:
            _log.info("journal_pruned", scope=scope, removed=removed, kept=kept)
        return PruneReport(removed=removed, kept=kept)

    async def reseal(self, scope: str) -> ResealReport:
        """Re-seal every row of ``scope`` that an old key sealed, at its own revision.

        A row is re-sealed when the storage key that sealed it is not the
        keyring's active key or, with a data keyring, when its payload is
        encrypted under another data key than the active one. Every row is
        authenticated (and decrypted) first; a row that fails stops the
        call with that error. Revisions, the head, the fence and the anchor do
        not move, so this is safe while the daemon runs: a row the daemon
        writes meanwhile (sealed with the active key) is left as it is.
        Batches of 1,000 rows, one short transaction each. Rows a running
        daemon never writes again (closed sessions, above all) need this
        before an old key can be retired.
        """
        check_scope(scope)
        self._check_writable()
        active = self._keyring.active_id
        data_active = None if self._data_keyring is None else self._data_keyring.active_id
        resealed = current = 0
        after = 0
        while True:
            rows = await self._read_call(functools.partial(self._reader.read_batch, scope, after))
            if not rows:
                break
            changes: list[tuple[int, int, bytes, bytes]] = []
            for row_id, namespace, row in rows:
                after = row_id
                record = open_record(
                    self._keyring, record_key(namespace, scope), row.envelope, row.revision
                )
                payload = record.payload
                stale_data = False
                if self._data_keyring is not None:
                    document = decrypt_document(  # checks the data key
                        self._data_keyring, namespace, scope, row.item, row.revision, payload
                    )
                    if _data_key_id(payload) != data_active:
                        stale_data = True
                        payload = encrypt_document(
                            self._data_keyring, namespace, scope, row.item, row.revision, document
                        )
                if record.key_id == active and not stale_data:
                    current += 1
                    continue
                envelope = seal_record(
                    self._keyring, record_key(namespace, scope), row.revision, payload
                )
                changes.append((row_id, row.revision, row.envelope, envelope))
            if changes:
                resealed += await self._write_call(
                    functools.partial(self._writer.replace_envelopes, changes)
                )
        if resealed:
            _log.info("journal_resealed", scope=scope, resealed=resealed, current=current)
        return ResealReport(resealed=resealed, current=current)

    async def load_sessions(
        self, scope: str, *, skip_closed_except: Iterable[str] | None = None
    ) -> dict[str, PersistedSession]:
        """Every session of ``scope`` (every status), keyed by session id.

        With ``skip_closed_except``, closed sessions are left out (neither
        read nor authenticated), except those it names: a start then costs
        what the live sessions cost, not every session ever closed. "Closed"
        is the store's own mark, set by the commit that closed the session;
        one closed before that mark existed (schema 3) is still returned.
        """
        check_scope(scope)
        keep = None if skip_closed_except is None else sorted(set(skip_closed_except))
        for session_id in keep or ():
            validate_token("session id", session_id)
        states, openings = await self._read_call(lambda: self._reader.read_sessions(scope, keep))
        opened: dict[str, tuple[bytes, int]] = {}
        for row in openings:
            document = self._open_row(scope, NS_SESSION_OPEN, row)
            session_header(document, scope, row.item)
            opened[row.item] = (document, row.revision)
        sessions: dict[str, PersistedSession] = {}
        for row in states:
            document = self._open_row(scope, NS_SESSION, row)
            status = state_status(document, scope, row.item)
            opening = opened.pop(row.item, None)
            if opening is None:
                # Both rows are written by the session's first commit: a
                # missing half was deleted.
                raise RollbackDetected(None, row.revision)
            sessions[row.item] = PersistedSession(
                row.item, status, opening[0], document, row.revision
            )
        if opened:  # an opening document whose state row is gone
            raise RollbackDetected(None, next(iter(opened.values()))[1])
        return sessions

    async def mark_closed(self, scope: str, session_ids: Iterable[str]) -> None:
        """Mark sessions the caller read, authenticated and found closed, so that
        ``skip_closed_except`` leaves them out from now on.

        For sessions closed before schema 3 (a commit that closes a session
        marks it itself). Metadata only: no revision, envelope or head moves.
        """
        check_scope(scope)
        ids = sorted(set(session_ids))
        for session_id in ids:
            validate_token("session id", session_id)
        if ids:
            await self._write_call(lambda: self._writer.mark_closed(scope, ids))

    async def session_status(self, scope: str, session_id: str) -> str | None:
        """The status in ``session_id``'s state row (read and authenticated), None without one."""
        check_scope(scope)
        validate_token("session id", session_id)
        rows = await self._read_call(
            lambda: self._reader.read_items(scope, NS_SESSION, [session_id])
        )
        if not rows:
            return None
        document = self._open_row(scope, NS_SESSION, rows[0])
        return state_status(document, scope, rows[0].item)

    async def load_outbox(self, scope: str, *, session_id: str | None = None) -> list[OutboxEntry]:
        """Every outbox row of ``scope``, oldest revision first (W§11.4).

        With ``session_id``, the rows of that session alone, found through the
        rows' session column and its index: the cost is that session's rows,
        not the scope's outbox. Each row is authenticated, and one whose
        document names another session than its column raises
        ``RecordLocationMismatch`` (the column is unauthenticated metadata).
        """
        check_scope(scope)
        if session_id is None:
            rows = await self._read_call(lambda: self._reader.read_items(scope, NS_OUTBOX, None))
            chosen = False
        else:
            validate_token("session id", session_id)
            wanted = session_id
            rows, chosen = await self._read_call(lambda: self._reader.read_outbox(scope, wanted))
        entries: list[OutboxEntry] = []
        for row in rows:
            document = self._open_row(scope, NS_OUTBOX, row)
            entry = read_outbox(document, scope, row.item, row.revision)
            if session_id is not None and entry.session_id != session_id:
                if chosen:
                    raise RecordLocationMismatch(session_id, entry.session_id)
                continue
            entries.append(entry)
        return entries

    async def head_revision(self, scope: str) -> int:
        """The scope's committed revision (0 without a head)."""
        check_scope(scope)
        return await self._read_call(lambda: self._reader.read_head(scope))

    async def scopes(self) -> list[str]:
        """Every scope with a head, sorted (operator helper)."""
        return await self._read_call(self._reader.read_scopes)

    async def scope_metadata(self, scope: str) -> ScopeMetadata:
        """The scope's fence and row metadata (operator helper; reads no envelope)."""
        check_scope(scope)
        return await self._read_call(lambda: self._reader.read_metadata(scope))

    async def integrity_check(self) -> list[str]:
        """``PRAGMA integrity_check``: ``["ok"]`` when the database is healthy."""
        return await self._read_call(self._reader.integrity)

    async def initialize_anchor(self) -> None:
        """Write the anchor file from the current database (explicit operator step).

        A configured anchor that is missing or malformed fails every open
        (H§17.10); this is the one way to (re)create it. Call it before any
        other method of this store instance.
        """
        if self._anchor_path is None:
            raise ValueError("this store has no anchor_path")
        if self._opened:
            raise ValueError("initialize_anchor must run before the store is opened")
        self._check_committing()
        await self._ensure_open(check_anchor=False)

    async def close(self) -> None:
        """Finish queued commits, close both connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._idle.wait()
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

    async def _ensure_open(self, *, check_anchor: bool = True) -> None:
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
            self._opened = True

    def _check_writable(self) -> None:
        if self._read_only:
            raise StorageBackendError("the store was opened read-only")

    def _check_committing(self) -> None:
        """Moving a head (commit, fence) needs the anchor: not read-only, not maintenance."""
        self._check_writable()
        if self._maintenance:
            raise StorageBackendError("a maintenance store neither commits nor reserves fences")

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
            self._idle.clear()
            loop.call_soon(self._start_reads)
        return cast(T, await future)

    def _settle_idle(self) -> None:
        if not (self._writer_scheduled or self._writer_busy) and not (
            self._reader_scheduled or self._reader_busy
        ):
            self._idle.set()

    def _start_reads(self) -> None:
        """Hand every waiting read to the reader thread at once."""
        self._reader_scheduled = False
        if self._reader_busy or not self._read_queue:
            self._settle_idle()
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
        # ``_run_reads`` keeps every read's outcome apart; only a defect in it
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

    def _start_writes(self) -> None:
        """Apply the queued change sets: all of them (group commit) or the oldest."""
        self._writer_scheduled = False
        if self._writer_busy or not self._queue:
            self._settle_idle()
            return
        if self._group_commit:
            batch, self._queue = self._queue, []
        else:
            batch = [self._queue.pop(0)]
        self._writer_busy = True
        self._writer_thread.call(
            functools.partial(self._writer.apply_batch, batch),
            functools.partial(self._writes_done, batch),
        )

    def _writes_done(self, batch: Sequence[PendingCommit], outcome: tuple[bool, Any]) -> None:
        self._writer_busy = False
        ok, value = outcome
        # ``_apply_batch`` returns every change set's outcome; only a defect in
        # it fails the whole batch.
        outcomes = value if ok else [backend_error(value) for _ in batch]
        try:
            self._release(batch, outcomes)
        finally:
            # Change sets queued during this batch go at once, together.
            self._start_writes()

    def _release(self, batch: Sequence[PendingCommit], outcomes: Sequence[int | OctoError]) -> None:
        self._transactions += 1
        self._largest_batch = max(self._largest_batch, len(batch))
        if self._on_batch is not None:
            self._on_batch(len(batch))
        for pending, outcome in zip(batch, outcomes, strict=True):
            if pending.future.done():
                continue
            if isinstance(outcome, OctoError):
                self._failed += 1
            else:
                self._committed += 1
            pending.future.set_result(outcome)

    def _open_row(self, scope: str, namespace: str, row: Row) -> bytes:
        """Authenticate (and decrypt) one row; the caller checks its document."""
        self._rows_opened += 1
        return open_row(self._keyring, self._data_keyring, scope, namespace, row)
