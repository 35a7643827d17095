"""The worker's durable store: ``SqliteJournalStore`` (W§11, H§17.7-17.10, D7, D10).

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
Connections never leave their thread.

What it must never do
---------------------
Interpret documents beyond their location fields, decide protocol outcomes,
log or raise with keys, payloads, documents or frames, or let a caller's
cancellation leave a submitted commit's outcome unknown.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import sqlite3
import stat
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple, TypeVar, cast

import msgspec
import structlog

from octo_common.digest import message_id as frame_message_id
from octo_common.errors import (
    FencingTokenExhausted,
    FencingTokenRejected,
    InvalidJournalLease,
    InvalidRevision,
    InvalidToken,
    OctoError,
    OperationJournalScopeMismatch,
    RecordLocationMismatch,
    RevisionExhausted,
    RevisionFloorMismatch,
    RollbackDetected,
    SessionReplay,
    StorageBackendError,
    WriteConflict,
)
from octo_common.ids import validate_token
from octo_common.limits import (
    SQLITE_BUSY_TIMEOUT_SECONDS,
    SQLITE_MAX_INTEGER,
)
from octo_common.records import (
    StorageKeyring,
    StorageRecordKey,
    decrypt_document,
    encrypt_document,
    open_record,
    seal_record,
)
from octo_common.runtime.anchorfile import read_anchor, write_anchor
from octo_common.runtime.sqlite import DatabaseThread, copy_error, migrate_schema, run_each
from octo_common.states import TERMINAL_KINDS
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    is_message_id,
    outbox_document,
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
    SessionDocuments,
    WorkerCommit,
    WorkerJournalLease,
    issue_lease,
)

__all__ = [
    "NS_JOURNAL",
    "NS_OUTBOX",
    "NS_SESSION",
    "NS_SESSION_OPEN",
    "OutboxEntry",
    "PersistedSession",
    "PruneReport",
    "ResealReport",
    "ScopeMetadata",
    "SessionDocuments",
    "SqliteJournalStore",
    "StoreStats",
    "WorkerCommit",
    "WorkerJournalLease",
]

_log = structlog.get_logger("octo_worker.store")

_HEAD_NAMESPACE: Final = NS_JOURNAL
_SESSION_ROWS: Final = frozenset({NS_SESSION, NS_SESSION_OPEN})
# Sessions whose last committed state revision the writer remembers for
# chained commits (SessionDocuments.chained); about 100 bytes each.
_SESSION_TAIL_LIMIT: Final = 65536
_BY_ITEMS: Final = "WHERE namespace = ? AND name = ? AND item IN "
# The partial index's condition, repeated word for word by the query that
# uses it (SQLite matches the terms, so the namespaces are literals here).
_LIVE_SESSION_ROWS: Final = f"namespace IN ('{NS_SESSION}', '{NS_SESSION_OPEN}') AND closed = 0"
_SQL_CHUNK: Final = 500  # well under SQLite's bound on host parameters

# Forward-only migrations: index i moves the schema from version i to i + 1.
_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """CREATE TABLE heads (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            revision INTEGER NOT NULL CHECK (revision >= 0),
            fence INTEGER NOT NULL CHECK (fence >= 0),
            PRIMARY KEY (namespace, name)
        ) WITHOUT ROWID""",
        # A rowid table: envelopes can be large, and the rowid orders the
        # outbox rows one commit inserted.
        """CREATE TABLE items (
            id INTEGER PRIMARY KEY,
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            item TEXT NOT NULL,
            revision INTEGER NOT NULL,
            envelope BLOB NOT NULL,
            UNIQUE (namespace, name, item)
        )""",
    ),
    # 1 -> 2: when each row was last written (unauthenticated metadata, used only
    # to choose prune candidates; rows written before the migration count as new).
    (
        "ALTER TABLE items ADD COLUMN written_at REAL NOT NULL DEFAULT 0",
        "UPDATE items SET written_at = CAST(strftime('%s', 'now') AS REAL)",
    ),
    # 2 -> 3: 1 on both rows of a closed session (unauthenticated metadata, used
    # only so that a start reads the live sessions alone, through the partial
    # index; rows of sessions closed before the migration read 0 until the
    # daemon's next start marks them).
    (
        "ALTER TABLE items ADD COLUMN closed INTEGER NOT NULL DEFAULT 0",
        f"CREATE INDEX items_live_sessions ON items (name, item) WHERE {_LIVE_SESSION_ROWS}",
    ),
)

_SCHEMA_VERSION: Final = len(_MIGRATIONS)

T = TypeVar("T")


# Value types -------------------------------------------------------------------


_RESEAL_BATCH: Final = 1000


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


# Prepared change sets ---------------------------------------------------------------


class _RowWrite(NamedTuple):
    namespace: str
    item: str
    document: bytes
    # The revision the row must currently have; None: the row must be absent.
    base_revision: int | None
    # Session state rows only (SessionDocuments.link/after): this write's
    # link, and the link of the change set whose revision is its base.
    link: int | None = None
    after: int | None = None
    # Session state rows only: the document's status is ``closed``.
    closed: bool = False


@dataclass(slots=True)
class _Pending:
    scope: str
    token: int
    writes: tuple[_RowWrite, ...]
    new_sessions: tuple[str, ...]
    outbox_delete: tuple[str, ...]
    # The caller's window on the outcome: resolved with the revision or the
    # error (never an exception, so nothing is left unretrieved), or cancelled
    # with its caller, which the writer then skips.
    future: asyncio.Future[int | OctoError]


class _Row(NamedTuple):
    item: str
    revision: int
    envelope: bytes


@functools.lru_cache(maxsize=4096)
def _record_key(namespace: str, scope: str) -> StorageRecordKey:
    # Record keys validate on construction; rows of a scope reuse the same few.
    return StorageRecordKey(namespace, scope)


_VALID_SCOPES: set[str] = set()


def _check_scope(scope: str) -> None:
    """A scope is a token (field ``operation journal scope``); valid ones are remembered."""
    if type(scope) is str and scope in _VALID_SCOPES:
        return
    validate_token("operation journal scope", scope)
    if len(_VALID_SCOPES) >= 4096:
        _VALID_SCOPES.clear()
    _VALID_SCOPES.add(scope)


def _check_base_revision(value: object) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidRevision()


def _prepare(scope: str, changes: WorkerCommit) -> tuple[tuple[_RowWrite, ...], tuple[str, ...]]:
    """Validate a change set and render its documents, before any I/O."""
    writes: list[_RowWrite] = []
    new_sessions: list[str] = []
    journal = changes.journal
    if journal is not None:
        if journal.scope != scope:
            raise OperationJournalScopeMismatch(scope, journal.scope)
        for key, change in journal.rows.items():
            if change.record.operation_key != key:
                raise RecordLocationMismatch(key, change.record.operation_key)
            _check_base_revision(change.base_revision)
            document = change.record.to_row_json(scope)
            writes.append(_RowWrite(NS_JOURNAL, key, document, change.base_revision))
    for session_id, documents in changes.sessions.items():
        validate_token("session id", session_id)
        _check_base_revision(documents.base_revision)
        closed = state_status(documents.state, scope, session_id) == "closed"
        link, after = documents.link, documents.after
        for value in (link, after):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError("a commit link is a positive int")
        if after is not None:
            if documents.base_revision is not None or documents.opening is not None:
                raise ValueError("a chained commit names neither a base revision nor an opening")
            writes.append(
                _RowWrite(NS_SESSION, session_id, documents.state, None, link, after, closed)
            )
            continue
        writes.append(
            _RowWrite(
                NS_SESSION, session_id, documents.state, documents.base_revision, link, None, closed
            )
        )
        if documents.base_revision is None:
            if documents.opening is None:
                raise ValueError("a new session must supply its opening document")
            session_header(documents.opening, scope, session_id)
            writes.append(_RowWrite(NS_SESSION_OPEN, session_id, documents.opening, None))
            new_sessions.append(session_id)
        elif documents.opening is not None:
            raise ValueError("a session's opening document is written once, when it opens")
    for entry in changes.outbox_insert:
        validate_token("session id", entry.session_id)
        expected_id = frame_message_id(entry.frame)
        if entry.message_id != expected_id:
            raise RecordLocationMismatch(expected_id, entry.message_id)
        document = outbox_document(
            scope, entry.session_id, entry.reply_to, entry.correlation_id, entry.frame
        )
        writes.append(_RowWrite(NS_OUTBOX, entry.message_id, document, None))
    for message in changes.outbox_delete:
        if not is_message_id(message):
            raise InvalidToken("message id", message)
    return tuple(writes), tuple(new_sessions)


def _note_tails(
    tails: dict[tuple[str, str], tuple[int, int] | None], pending: _Pending, revision: int | None
) -> None:
    """Note what a change set did to session state rows (None: nothing to chain on)."""
    for write in pending.writes:
        if write.namespace == NS_SESSION:
            link = write.link
            name = (pending.scope, write.item)
            tails[name] = None if link is None or revision is None else (link, revision)


# Errors -------------------------------------------------------------------------------


def _backend_error(exc: BaseException) -> StorageBackendError:
    """Describe a sqlite/OS failure by class and code only (no paths, no data)."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorname", None) or "unknown"
        return StorageBackendError(f"sqlite {type(exc).__name__} {code}")
    if isinstance(exc, OSError):
        name = os.strerror(exc.errno) if exc.errno is not None else "unknown"
        return StorageBackendError(f"os {type(exc).__name__} {name}")
    return StorageBackendError(type(exc).__name__)


def _guarded(function: Callable[[], T]) -> T:
    try:
        return function()
    except OctoError:
        raise
    except (sqlite3.Error, OSError) as exc:
        raise _backend_error(exc) from None


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
        # Owned by the writer thread: its connection and the commit baselines.
        self._writer: sqlite3.Connection | None = None
        self._baselines: dict[str, int] = {}
        # (scope, session id) -> (link, revision) of the last change set that
        # wrote the session's state row through this instance: the base of a
        # chained commit (bounded; an evicted entry only makes a chained
        # commit fail closed).
        self._session_tails: dict[tuple[str, str], tuple[int, int]] = {}
        # Owned by the reader thread: its connection and the anchor its
        # current snapshot is compared with.
        self._reader: sqlite3.Connection | None = None
        self._snapshot_anchor: Mapping[StorageRecordKey, int] = {}
        self._snapshot_heads: dict[str, int] = {}
        # The anchor as last written; replaced (never mutated) by the writer thread.
        self._anchor: Mapping[StorageRecordKey, int] = {}
        # Event-loop state.
        self._open_lock = asyncio.Lock()
        self._opened = False
        self._closed = False
        self._queue: list[_Pending] = []
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

    # Takes chained session commits (SessionDocuments.link/after). A wrapper
    # that forwards this must hand change sets on in call order, without an
    # await before it does (a chained one arriving first fails closed).
    chains_session_commits: Final = True

    def __repr__(self) -> str:
        return f"SqliteJournalStore(path={os.fspath(self._path)!r})"

    # Public API ------------------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """How many transactions ran and how many change sets they carried."""
        return StoreStats(
            self._transactions,
            self._change_sets,
            self._committed,
            self._failed,
            self._largest_batch,
        )

    async def reserve_fence(self, scope: str) -> WorkerJournalLease:
        """Create the head if absent, add 1 to its fence, return it (W§11.3).

        The head revision read in the same transaction becomes this store
        instance's commit baseline for the scope.
        """
        _check_scope(scope)
        self._check_committing()
        token = await self._write_call(lambda: self._reserve_in_thread(scope))
        return issue_lease(scope, token)

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int:
        """Commit one change set (W§11.2); returns the new scope revision.

        Concurrent calls share transactions (group commit); each caller gets
        the outcome it would have had alone. Once submitted, the commit is
        shielded from the caller's cancellation: it completes or fails.
        """
        _check_scope(scope)
        if not isinstance(lease, WorkerJournalLease) or not lease.is_for(scope):
            raise InvalidJournalLease()
        if not isinstance(changes, WorkerCommit):
            raise TypeError("changes must be a WorkerCommit")
        writes, new_sessions = _prepare(scope, changes)
        self._check_committing()
        if not self._opened:
            await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int | OctoError] = loop.create_future()
        self._queue.append(
            _Pending(
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
        _check_scope(scope)
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            validate_token("operation key", key)
        rows = await self._read_call(lambda: self._read_items(scope, NS_JOURNAL, wanted))
        result: dict[str, tuple[WorkerOperationRecord, int] | None] = dict.fromkeys(wanted)
        for row in rows:
            document = self._open_row(scope, NS_JOURNAL, row)
            record = WorkerOperationRecord.from_row_json(document, scope, row.item)
            result[row.item] = (record, row.revision)
        return result

    async def list_records(self, scope: str) -> list[tuple[WorkerOperationRecord, int]]:
        """Every journal row of ``scope``, oldest revision first (operator helper)."""
        _check_scope(scope)
        rows = await self._read_call(lambda: self._read_items(scope, NS_JOURNAL, None))
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
        _check_scope(scope)
        if not older_than_seconds >= 0:
            raise ValueError("older_than_seconds must be a non-negative number")
        cutoff = time.time() - older_than_seconds
        rows = await self._read_call(lambda: self._read_prunable(scope, cutoff))
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
        removed = await self._write_call(lambda: self._delete_journal_rows(scope, victims))
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
        _check_scope(scope)
        self._check_writable()
        active = self._keyring.active_id
        data_active = None if self._data_keyring is None else self._data_keyring.active_id
        resealed = current = 0
        after = 0
        while True:
            rows = await self._read_call(functools.partial(self._read_batch, scope, after))
            if not rows:
                break
            changes: list[tuple[int, int, bytes, bytes]] = []
            for row_id, namespace, row in rows:
                after = row_id
                record = open_record(
                    self._keyring, _record_key(namespace, scope), row.envelope, row.revision
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
                    self._keyring, _record_key(namespace, scope), row.revision, payload
                )
                changes.append((row_id, row.revision, row.envelope, envelope))
            if changes:
                resealed += await self._write_call(
                    functools.partial(self._replace_envelopes, changes)
                )
        if resealed:
            _log.info("journal_resealed", scope=scope, resealed=resealed, current=current)
        return ResealReport(resealed=resealed, current=current)

    def _read_batch(self, scope: str, after: int) -> list[tuple[int, str, _Row]]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return connection.execute(
                "SELECT id, namespace, item, revision, envelope FROM items "
                "WHERE name = ? AND id > ? AND namespace IN (?, ?, ?, ?) ORDER BY id LIMIT ?",
                (scope, after, NS_JOURNAL, NS_SESSION, NS_SESSION_OPEN, NS_OUTBOX, _RESEAL_BATCH),
            ).fetchall()

        head, rows = self._read_transaction(select, scope)
        checked = self._checked_rows([row[2:] for row in rows], head)
        return [(int(row[0]), str(row[1]), ok) for row, ok in zip(rows, checked, strict=True)]

    def _replace_envelopes(self, changes: Sequence[tuple[int, int, bytes, bytes]]) -> int:
        """Swap envelopes of rows still at the revision and envelope that were read."""
        return self._count_in_transaction(
            "UPDATE items SET envelope = ? WHERE id = ? AND revision = ? AND envelope = ?",
            [(new, row_id, revision, old) for row_id, revision, old, new in changes],
        )

    def _count_in_transaction(self, statement: str, parameters: Sequence[tuple[Any, ...]]) -> int:
        """Run ``statement`` once per parameter tuple in one transaction; rows changed."""
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            changed = sum(connection.execute(statement, values).rowcount for values in parameters)
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        return changed

    def _read_prunable(self, scope: str, cutoff: float) -> list[_Row]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return connection.execute(
                "SELECT item, revision, envelope FROM items "
                "WHERE namespace = ? AND name = ? AND written_at < ? ORDER BY revision, id",
                (NS_JOURNAL, scope, cutoff),
            ).fetchall()

        head, rows = self._read_transaction(select, scope)
        return self._checked_rows(rows, head)

    def _delete_journal_rows(self, scope: str, victims: Sequence[tuple[str, int]]) -> int:
        return self._count_in_transaction(
            "DELETE FROM items WHERE namespace = ? AND name = ? AND item = ? AND revision = ?",
            [(NS_JOURNAL, scope, item, revision) for item, revision in victims],
        )

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
        _check_scope(scope)
        keep = None if skip_closed_except is None else sorted(set(skip_closed_except))
        for session_id in keep or ():
            validate_token("session id", session_id)
        states, openings = await self._read_call(lambda: self._read_sessions(scope, keep))
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
        _check_scope(scope)
        ids = sorted(set(session_ids))
        for session_id in ids:
            validate_token("session id", session_id)
        if ids:
            await self._write_call(lambda: self._mark_closed_in_thread(scope, ids))

    def _mark_closed_in_thread(self, scope: str, ids: Sequence[str]) -> None:
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            for start in range(0, len(ids), _SQL_CHUNK):
                chunk = ids[start : start + _SQL_CHUNK]
                marks = ",".join("?" * len(chunk))
                # Only "?" placeholders are formatted in; every value is bound.
                sql = (
                    "UPDATE items SET closed = 1 "  # noqa: S608
                    f"WHERE namespace IN (?, ?) AND name = ? AND item IN ({marks})"
                )
                connection.execute(sql, (NS_SESSION, NS_SESSION_OPEN, scope, *chunk))
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise

    async def session_status(self, scope: str, session_id: str) -> str | None:
        """The status in ``session_id``'s state row (read and authenticated), None without one."""
        _check_scope(scope)
        validate_token("session id", session_id)
        rows = await self._read_call(lambda: self._read_items(scope, NS_SESSION, [session_id]))
        if not rows:
            return None
        document = self._open_row(scope, NS_SESSION, rows[0])
        return state_status(document, scope, rows[0].item)

    async def load_outbox(self, scope: str) -> list[OutboxEntry]:
        """Every outbox row of ``scope``, oldest revision first (W§11.4)."""
        _check_scope(scope)
        rows = await self._read_call(lambda: self._read_items(scope, NS_OUTBOX, None))
        entries: list[OutboxEntry] = []
        for row in rows:
            document = self._open_row(scope, NS_OUTBOX, row)
            entries.append(read_outbox(document, scope, row.item, row.revision))
        return entries

    async def head_revision(self, scope: str) -> int:
        """The scope's committed revision (0 without a head)."""
        _check_scope(scope)
        return await self._read_call(lambda: self._read_head(scope))

    async def scopes(self) -> list[str]:
        """Every scope with a head, sorted (operator helper)."""
        return await self._read_call(self._read_scopes)

    async def scope_metadata(self, scope: str) -> ScopeMetadata:
        """The scope's fence and row metadata (operator helper; reads no envelope)."""
        _check_scope(scope)
        return await self._read_call(lambda: self._read_metadata(scope))

    async def integrity_check(self) -> list[str]:
        """``PRAGMA integrity_check``: ``["ok"]`` when the database is healthy."""
        return await self._read_call(self._integrity_in_thread)

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
                (self._writer_thread, self._close_writer),
                (self._reader_thread, self._close_reader),
            ):
                last = thread.close(functools.partial(_guarded, close_connection))
                if last is not None:
                    await last
        finally:
            self._writer_thread.close()
            self._reader_thread.close()

    # Event-loop plumbing ---------------------------------------------------------------

    async def _ensure_open(self, *, check_anchor: bool = True) -> None:
        if self._opened:
            return
        if self._closed:
            raise StorageBackendError("store is closed")
        async with self._open_lock:
            if self._opened:  # another task opened it while this one waited
                return  # type: ignore[unreachable]
            await self._writer_thread.submit(
                lambda: _guarded(lambda: self._open_writer(check_anchor))
            )
            await self._reader_thread.submit(lambda: _guarded(self._open_reader))
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
        return cast(T, await self._writer_thread.submit(lambda: _guarded(function)))

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
            functools.partial(self._run_reads, functions),
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
        outcomes = value if ok else [(False, _backend_error(value)) for _ in batch]
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
            functools.partial(self._apply_batch, batch),
            functools.partial(self._writes_done, batch),
        )

    def _writes_done(self, batch: Sequence[_Pending], outcome: tuple[bool, Any]) -> None:
        self._writer_busy = False
        ok, value = outcome
        # ``_apply_batch`` returns every change set's outcome; only a defect in
        # it fails the whole batch.
        outcomes = value if ok else [_backend_error(value) for _ in batch]
        try:
            self._release(batch, outcomes)
        finally:
            # Change sets queued during this batch go at once, together.
            self._start_writes()

    def _release(self, batch: Sequence[_Pending], outcomes: Sequence[int | OctoError]) -> None:
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

    # Writer thread ------------------------------------------------------------------------

    def _open_writer(self, check_anchor: bool) -> None:
        if self._read_only:
            self._open_checked_read_only()
            return
        self._close_writer()  # a failed earlier attempt may have left one open
        directory = self._path.parent
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
            os.chmod(directory, 0o700)
        elif directory.stat().st_mode & 0o077:
            _log.warning("journal_directory_permissive", mode=oct(directory.stat().st_mode & 0o777))
        if not self._path.exists():
            descriptor = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(descriptor)
        os.chmod(self._path, 0o600)
        connection = sqlite3.connect(
            self._path,
            timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            self._configure(connection)
            migrate_schema(connection, _MIGRATIONS)
            self._tighten_side_files()
            if self._anchor_path is not None:
                heads = self._all_heads(connection)
                if check_anchor:
                    anchor = self._read_anchor_file()
                    self._check_anchor(anchor, heads)
                else:
                    anchor = {}
                raised = dict(anchor)
                for name, revision in heads.items():
                    record_key = StorageRecordKey(_HEAD_NAMESPACE, name)
                    if revision > raised.get(record_key, 0):
                        raised[record_key] = revision
                if self._maintenance:
                    raised = anchor  # checked only: the daemon owns the file
                elif raised != anchor or not check_anchor:
                    self._write_anchor_file(raised)
                self._anchor = raised
        except BaseException:
            connection.close()
            raise
        self._writer = connection

    def _open_checked_read_only(self) -> None:
        """The open checks of a read-only store: schema version and anchor, no writes."""
        if not self._path.exists():
            raise StorageBackendError(f"no journal database at {self._path}")
        connection = self._connect_read_only()
        try:
            connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
            connection.execute("PRAGMA query_only=ON")
            try:
                row = connection.execute("SELECT version FROM schema_version").fetchone()
            except sqlite3.OperationalError:
                row = None
            version = 0 if row is None else int(row[0])
            # Every inspection query reads columns of schema 1, so a journal the
            # daemon has not migrated yet (just after an upgrade) reads as it is.
            if version < 1:
                raise StorageBackendError("not an Octo journal (no schema version)")
            if version > _SCHEMA_VERSION:
                raise StorageBackendError(
                    f"journal schema version {version} is newer than this octo-worker "
                    f"(version {_SCHEMA_VERSION}): use the release that wrote it"
                )
            if self._anchor_path is not None:
                anchor = self._read_anchor_file()
                self._check_anchor(anchor, self._all_heads(connection))
                self._anchor = anchor
        finally:
            connection.close()

    def _configure(self, connection: sqlite3.Connection) -> None:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise StorageBackendError("sqlite could not enable WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
        connection.execute("PRAGMA foreign_keys=ON")

    def _tighten_side_files(self) -> None:
        # SQLite gives -wal/-shm the main file's mode; this only repairs
        # files left by an older, looser process.
        for suffix in ("-wal", "-shm"):
            side = Path(os.fspath(self._path) + suffix)
            try:
                if stat.S_IMODE(side.stat().st_mode) != 0o600:
                    os.chmod(side, 0o600)
            except FileNotFoundError:
                continue

    @staticmethod
    def _all_heads(connection: sqlite3.Connection) -> dict[str, int]:
        rows = connection.execute(
            "SELECT name, revision FROM heads WHERE namespace = ?", (_HEAD_NAMESPACE,)
        ).fetchall()
        return {str(name): int(revision) for name, revision in rows}

    def _read_anchor_file(self) -> dict[StorageRecordKey, int]:
        assert self._anchor_path is not None
        return read_anchor(self._anchor_path)

    @staticmethod
    def _check_anchor(anchor: Mapping[StorageRecordKey, int], heads: Mapping[str, int]) -> None:
        for record_key, anchored in anchor.items():
            actual = heads.get(record_key.name) if record_key.namespace == _HEAD_NAMESPACE else None
            if actual is None:
                raise RollbackDetected(None, anchored)
            if actual < anchored:
                raise RollbackDetected(actual, anchored)

    def _write_anchor_file(self, revisions: Mapping[StorageRecordKey, int]) -> None:
        assert self._anchor_path is not None
        write_anchor(self._anchor_path, revisions)

    def _connection(self) -> sqlite3.Connection:
        if self._writer is None:
            raise StorageBackendError("store is closed")
        return self._writer

    def _reserve_in_thread(self, scope: str) -> int:
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            # One statement creates the head or adds 1 to its fence; it refuses
            # (returns no row) instead of overflowing SQLite's integer range.
            row = connection.execute(
                "INSERT INTO heads (namespace, name, revision, fence) VALUES (?, ?, 0, 1) "
                "ON CONFLICT (namespace, name) DO UPDATE SET fence = fence + 1 "
                "WHERE fence < ? RETURNING revision, fence",
                (_HEAD_NAMESPACE, scope, SQLITE_MAX_INTEGER),
            ).fetchone()
            if row is None:
                raise FencingTokenExhausted()
            revision, fence = int(row[0]), int(row[1])
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        self._baselines[scope] = revision
        return fence

    def _apply_batch(self, batch: Sequence[_Pending]) -> list[int | OctoError]:
        """One transaction, one fsync, for every change set of ``batch``.

        Runs entirely in the writer thread. A change set that fails its own
        checks is rolled back to its savepoint; a failure of the transaction
        (or of the anchor write) fails every change set in it.
        """
        outcomes: list[int | OctoError] = []
        # Heads as this transaction sees them: read once per scope, then kept
        # here (the write lock is ours) and written back once before COMMIT.
        heads: dict[str, tuple[int, int]] = {}
        advanced: dict[str, int] = {}
        # Session state rows written (or failed: None) by this transaction so
        # far; folded into ``_session_tails`` once it commits.
        tails: dict[tuple[str, str], tuple[int, int] | None] = {}
        # Alone in its transaction, a change set needs no savepoint: a refusal
        # rolls the whole (otherwise empty) transaction back.
        use_savepoints = len(batch) > 1
        try:
            connection = self._connection()
            connection.execute("BEGIN IMMEDIATE")
            try:
                for pending in batch:
                    if use_savepoints:
                        connection.execute("SAVEPOINT change_set")
                    try:
                        revision = self._apply_one(connection, pending, heads, advanced, tails)
                    except OctoError as exc:
                        if use_savepoints:
                            connection.execute("ROLLBACK TO change_set")
                            connection.execute("RELEASE change_set")
                        outcomes.append(exc)
                        _note_tails(tails, pending, None)
                        continue
                    if use_savepoints:
                        connection.execute("RELEASE change_set")
                    _note_tails(tails, pending, revision)
                    heads[pending.scope] = (revision, heads[pending.scope][1])
                    advanced[pending.scope] = revision
                    outcomes.append(revision)
                for scope, revision in advanced.items():
                    connection.execute(
                        "UPDATE heads SET revision = ? WHERE namespace = ? AND name = ?",
                        (revision, _HEAD_NAMESPACE, scope),
                    )
                connection.execute("COMMIT" if advanced else "ROLLBACK")
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError, OctoError) as exc:
            for tail in tails:
                self._session_tails.pop(tail, None)
            failure: OctoError = exc if isinstance(exc, OctoError) else _backend_error(exc)
            failed: list[int | OctoError] = [
                o if isinstance(o, OctoError) else copy_error(failure) for o in outcomes
            ]
            return failed + [copy_error(failure) for _ in range(len(batch) - len(outcomes))]
        # Committed: the database is the truth for this instance's baselines,
        # even if the anchor write below fails its callers.
        self._baselines.update(advanced)
        if advanced and self._anchor_path is not None:
            anchor = dict(self._anchor)
            for scope, revision in advanced.items():
                anchor[StorageRecordKey(_HEAD_NAMESPACE, scope)] = revision
            try:
                self._write_anchor_file(anchor)
            except OSError as exc:
                # Its callers are told the batch failed: nothing may chain on it.
                for name in tails:
                    self._session_tails.pop(name, None)
                failure = _backend_error(exc)
                return [o if isinstance(o, OctoError) else copy_error(failure) for o in outcomes]
            finally:
                # Readers compare against the newest anchor the disk may hold.
                self._anchor = anchor
        self._fold_tails(tails)
        return outcomes

    def _apply_one(
        self,
        connection: sqlite3.Connection,
        pending: _Pending,
        heads: dict[str, tuple[int, int]],
        advanced: Mapping[str, int],
        tails: Mapping[tuple[str, str], tuple[int, int] | None],
    ) -> int:
        """W§11.2 steps 1-4 for one change set, inside the open transaction.

        The head itself is advanced by the caller, once per scope and batch.
        """
        scope = pending.scope
        head = heads.get(scope)
        if head is None:
            row = connection.execute(
                "SELECT revision, fence FROM heads WHERE namespace = ? AND name = ?",
                (_HEAD_NAMESPACE, scope),
            ).fetchone()
            head = (0, 0) if row is None else (int(row[0]), int(row[1]))
            heads[scope] = head
        head_revision, fence = head
        if fence != pending.token:  # step 1
            raise FencingTokenRejected(fence, pending.token)
        baseline = advanced.get(scope, self._baselines.get(scope))
        if baseline != head_revision:  # step 2
            raise WriteConflict(baseline, head_revision, head_revision)
        writes = pending.writes
        if any(write.after is not None for write in writes):
            writes = tuple(self._chain(connection, scope, w, head_revision, tails) for w in writes)
        if head_revision >= SQLITE_MAX_INTEGER:  # step 4, after step 3's verdict
            for write in writes:
                conflict = self._conflict(connection, scope, write, head_revision)
                if conflict.actual != write.base_revision:
                    if write.item in pending.new_sessions and write.namespace in _SESSION_ROWS:
                        raise SessionReplay(write.item)
                    raise conflict
            raise RevisionExhausted()
        revision = head_revision + 1
        now = time.time()
        sealed = [(write, self._seal(scope, write, revision)) for write in writes]
        # Step 3 is checked by the writes themselves, one statement per row: an
        # insert meets the UNIQUE key when the row exists, an update names the
        # base revision. A refused change set is undone by the caller (its
        # savepoint, or the whole transaction when it is alone).
        for write, envelope in sealed:
            if write.base_revision is None:
                try:
                    connection.execute(
                        "INSERT INTO items (namespace, name, item, revision, envelope, "
                        "written_at, closed) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (write.namespace, scope, write.item, revision, envelope, now, write.closed),
                    )
                except sqlite3.IntegrityError:
                    if write.item in pending.new_sessions and write.namespace in _SESSION_ROWS:
                        raise SessionReplay(write.item) from None
                    raise self._conflict(connection, scope, write, head_revision) from None
            else:
                updated = connection.execute(
                    "UPDATE items SET revision = ?, envelope = ?, written_at = ?, closed = ? "
                    "WHERE namespace = ? AND name = ? AND item = ? AND revision = ?",
                    (
                        revision,
                        envelope,
                        now,
                        write.closed,
                        write.namespace,
                        scope,
                        write.item,
                        write.base_revision,
                    ),
                ).rowcount
                if updated != 1:
                    raise self._conflict(connection, scope, write, head_revision)
        for write in writes:
            if write.closed:
                # Its opening row is never rewritten: mark it beside the envelope.
                connection.execute(
                    "UPDATE items SET closed = 1 WHERE namespace = ? AND name = ? AND item = ?",
                    (NS_SESSION_OPEN, scope, write.item),
                )
        for message in pending.outbox_delete:
            connection.execute(
                "DELETE FROM items WHERE namespace = ? AND name = ? AND item = ?",
                (NS_OUTBOX, scope, message),
            )
        return revision

    def _chain(
        self,
        connection: sqlite3.Connection,
        scope: str,
        write: _RowWrite,
        head_revision: int,
        tails: Mapping[tuple[str, str], tuple[int, int] | None],
    ) -> _RowWrite:
        """A chained session write with its base: what the change set it follows wrote."""
        if write.after is None:
            return write
        name = (scope, write.item)
        tail = tails[name] if name in tails else self._session_tails.get(name)
        if tail is None or tail[0] != write.after:
            # That change set failed, never came here, or was written over since.
            raise self._conflict(connection, scope, write, head_revision)
        return write._replace(base_revision=tail[1], after=None)

    def _fold_tails(self, tails: Mapping[tuple[str, str], tuple[int, int] | None]) -> None:
        known = self._session_tails
        for name, revision in tails.items():
            known.pop(name, None)  # re-inserted last: the bound drops the oldest
            if revision is not None:
                known[name] = revision
        excess = len(known) - _SESSION_TAIL_LIMIT
        if excess > 0:
            for name in list(itertools.islice(known, excess)):
                del known[name]

    @staticmethod
    def _conflict(
        connection: sqlite3.Connection, scope: str, write: _RowWrite, head_revision: int
    ) -> WriteConflict:
        current = connection.execute(
            "SELECT revision FROM items WHERE namespace = ? AND name = ? AND item = ?",
            (write.namespace, scope, write.item),
        ).fetchone()
        actual = None if current is None else int(current[0])
        return WriteConflict(write.base_revision, actual, head_revision)

    def _seal(self, scope: str, write: _RowWrite, revision: int) -> bytes:
        payload = write.document
        if self._data_keyring is not None:
            payload = encrypt_document(
                self._data_keyring, write.namespace, scope, write.item, revision, payload
            )
        return seal_record(self._keyring, _record_key(write.namespace, scope), revision, payload)

    def _close_writer(self) -> None:
        self._session_tails.clear()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # Reader thread -------------------------------------------------------------------------

    def _connect_read_only(self) -> sqlite3.Connection:
        """A connection that cannot write the database (``mode=ro``): closing it
        as the last connection never checkpoints a WAL left by a crashed writer."""
        uri = "file:" + urllib.parse.quote(os.fspath(self._path.absolute())) + "?mode=ro"
        return sqlite3.connect(
            uri,
            uri=True,
            timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
            isolation_level=None,
            check_same_thread=False,
        )

    def _open_reader(self) -> None:
        self._close_reader()
        if self._read_only:
            connection = self._connect_read_only()
        else:
            connection = sqlite3.connect(
                self._path,
                timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
                isolation_level=None,
                check_same_thread=False,
            )
        try:
            connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
            connection.execute("PRAGMA foreign_keys=ON")
            connection.execute("PRAGMA query_only=ON")
        except BaseException:
            connection.close()
            raise
        self._reader = connection

    def _reading(self) -> sqlite3.Connection:
        if self._reader is None:
            raise StorageBackendError("store is closed")
        return self._reader

    def _snapshot_head(self, connection: sqlite3.Connection, scope: str) -> int:
        """The head revision in the current snapshot (read once per scope and snapshot)."""
        head = self._snapshot_heads.get(scope)
        if head is None:
            row = connection.execute(
                "SELECT revision FROM heads WHERE namespace = ? AND name = ?",
                (_HEAD_NAMESPACE, scope),
            ).fetchone()
            head = 0 if row is None else int(row[0])
            self._snapshot_heads[scope] = head
        return head

    def _run_reads(self, functions: Sequence[Callable[[], object]]) -> list[tuple[bool, Any]]:
        """Reader thread: every waiting read inside one read snapshot.

        Each read keeps its own outcome. The anchor is read before the
        snapshot starts: it is only raised after a COMMIT, so the snapshot is
        never older than the anchor it is compared with.
        """
        self._snapshot_anchor = self._anchor
        self._snapshot_heads = {}
        outcomes: list[tuple[bool, Any]] = []
        try:
            connection = self._reading()
            connection.execute("BEGIN")
        except (sqlite3.Error, OctoError) as exc:
            failure = exc if isinstance(exc, OctoError) else _backend_error(exc)
            return [(False, failure)] * len(functions)
        try:
            for function in functions:
                try:
                    outcomes.append((True, _guarded(function)))
                except Exception as exc:  # handed to its own caller, never to the others
                    outcomes.append((False, exc))
        finally:
            if connection.in_transaction:
                try:
                    connection.execute("COMMIT")
                except sqlite3.Error:
                    connection.execute("ROLLBACK")
        return outcomes

    def _read_transaction(
        self, function: Callable[[sqlite3.Connection], T], scope: str | None
    ) -> tuple[int, T]:
        """One read inside the current snapshot (``_run_reads``), anchor-checked."""
        connection = self._reading()
        head = 0 if scope is None else self._snapshot_head(connection, scope)
        result = function(connection)
        if scope is not None and self._anchor_path is not None:
            anchored = self._snapshot_anchor.get(_record_key(_HEAD_NAMESPACE, scope), 0)
            if head < anchored:
                raise RollbackDetected(head or None, anchored)
        return head, result

    def _read_head(self, scope: str) -> int:
        head, _ = self._read_transaction(lambda _connection: None, scope)
        return head

    def _read_items(self, scope: str, namespace: str, items: Sequence[str] | None) -> list[_Row]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if items is None:
                return connection.execute(
                    "SELECT item, revision, envelope FROM items "
                    "WHERE namespace = ? AND name = ? ORDER BY revision, id",
                    (namespace, scope),
                ).fetchall()
            found: list[tuple[Any, ...]] = []
            for start in range(0, len(items), _SQL_CHUNK):
                chunk = items[start : start + _SQL_CHUNK]
                marks = ",".join("?" * len(chunk))
                # Only "?" placeholders are formatted in; every value is bound.
                sql = f"SELECT item, revision, envelope FROM items {_BY_ITEMS}({marks})"  # noqa: S608
                found.extend(connection.execute(sql, (namespace, scope, *chunk)).fetchall())
            return found

        head, rows = self._read_transaction(select, scope)
        return self._checked_rows(rows, head)

    def _read_sessions(
        self, scope: str, keep: Sequence[str] | None
    ) -> tuple[list[_Row], list[_Row]]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if keep is None:
                return connection.execute(
                    "SELECT namespace, item, revision, envelope FROM items "
                    "WHERE namespace IN (?, ?) AND name = ? ORDER BY item",
                    (NS_SESSION, NS_SESSION_OPEN, scope),
                ).fetchall()
            found = connection.execute(
                "SELECT namespace, item, revision, envelope FROM items "  # noqa: S608
                f"INDEXED BY items_live_sessions WHERE name = ? AND {_LIVE_SESSION_ROWS}",
                (scope,),
            ).fetchall()
            for start in range(0, len(keep), _SQL_CHUNK):
                chunk = keep[start : start + _SQL_CHUNK]
                marks = ",".join("?" * len(chunk))
                # Only "?" placeholders are formatted in; every value is bound.
                sql = (
                    "SELECT namespace, item, revision, envelope FROM items "  # noqa: S608
                    f"WHERE namespace IN (?, ?) AND name = ? AND closed = 1 AND item IN ({marks})"
                )
                found.extend(
                    connection.execute(sql, (NS_SESSION, NS_SESSION_OPEN, scope, *chunk)).fetchall()
                )
            return found

        head, rows = self._read_transaction(select, scope)
        states = [row[1:] for row in rows if row[0] == NS_SESSION]
        openings = [row[1:] for row in rows if row[0] == NS_SESSION_OPEN]
        return self._checked_rows(states, head), self._checked_rows(openings, head)

    @staticmethod
    def _checked_rows(rows: Iterable[tuple[Any, ...]], head: int) -> list[_Row]:
        checked: list[_Row] = []
        for item, revision, envelope in rows:
            if type(revision) is not int or revision < 1:
                raise InvalidRevision()
            if revision > head:
                raise RevisionFloorMismatch(revision, head)
            checked.append(_Row(str(item), revision, bytes(envelope)))
        return checked

    def _read_scopes(self) -> list[str]:
        rows = (
            self._reading()
            .execute("SELECT name FROM heads WHERE namespace = ? ORDER BY name", (_HEAD_NAMESPACE,))
            .fetchall()
        )
        return [str(row[0]) for row in rows]

    def _read_metadata(self, scope: str) -> ScopeMetadata:
        connection = self._reading()
        row = connection.execute(
            "SELECT fence FROM heads WHERE namespace = ? AND name = ?", (_HEAD_NAMESPACE, scope)
        ).fetchone()
        fence = 0 if row is None else int(row[0])
        # A read-only store reads a journal of an older schema as it is.
        columns = {str(c[1]) for c in connection.execute("PRAGMA table_info(items)").fetchall()}
        written_at: dict[str, float] = {}
        if "written_at" in columns:
            rows = connection.execute(
                "SELECT item, written_at FROM items WHERE namespace = ? AND name = ?",
                (NS_JOURNAL, scope),
            ).fetchall()
            written_at = {str(item): float(when) for item, when in rows}
        closed = 0
        if "closed" in columns:
            found = connection.execute(
                "SELECT COUNT(*) FROM items WHERE namespace = ? AND name = ? AND closed = 1",
                (NS_SESSION, scope),
            ).fetchone()
            closed = int(found[0])
        return ScopeMetadata(fence, written_at, closed)

    def _integrity_in_thread(self) -> list[str]:
        rows = self._reading().execute("PRAGMA integrity_check").fetchall()
        return [str(row[0]) for row in rows]

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    # Rows, on the event loop -----------------------------------------------------------------

    def _open_row(self, scope: str, namespace: str, row: _Row) -> bytes:
        """Authenticate (and decrypt) one row; the caller checks its document."""
        record = open_record(
            self._keyring, _record_key(namespace, scope), row.envelope, row.revision
        )
        if self._data_keyring is None:
            return record.payload
        return decrypt_document(
            self._data_keyring, namespace, scope, row.item, row.revision, record.payload
        )
