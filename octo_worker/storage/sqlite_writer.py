"""The SQLite journal store's writer thread: schema, anchor, fences, group commit.

:class:`JournalWriter` runs only in the store's writer thread and owns its
connection: it opens the database (created 0o600, WAL, ``synchronous=FULL``,
schema migrated) and checks or initialises the rollback anchor,
reserves fences (each reservation verifies and reseals the scope's head),
applies a batch of change sets in ONE transaction and ONE fsync (each under
its own savepoint; chained session commits resolved to
the revision their predecessor wrote; each scope's row digest moved by the
rows written and deleted, and its head resealed, in the same transaction),
advances the anchor after a commit, and runs the maintenance writes (closed
marks, outbox rows' sessions, re-sealed envelopes and heads, pruned rows
with their digest) in short transactions.

It must never run on the event loop, let its connection leave its thread,
move a head outside a commit, or raise with a path, a key or a document.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from octo_common.errors import (
    FencingTokenExhausted,
    OctoError,
    RevisionExhausted,
    StorageBackendError,
)
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS, SQLITE_MAX_INTEGER
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_common.runtime.anchorfile import read_anchor, write_anchor
from octo_common.runtime.sqlite import (
    check_database_files,
    migrate_schema,
    prepare_database_files,
    roll_back,
)
from octo_common.setdigest import SetDigest
from octo_worker.storage.changes import (
    HEAD_NAMESPACE,
    CommitBatch,
    PendingCommit,
    Row,
    RowWrite,
    SessionTails,
)
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    read_outbox,
)
from octo_worker.storage.row_index import RowIndex
from octo_worker.storage.scope_head import DigestChanges, ScopeHead, anchored_with_digests
from octo_worker.storage.scope_head import check_anchor as compare_with_anchor
from octo_worker.storage.sealing import RowSealer, written_tag
from octo_worker.storage.sqlite_heads import (
    check_store_heads,
    insert_head,
    move_store_head,
    read_head,
    reseal_store_head,
    update_head,
)
from octo_worker.storage.sqlite_rekey import needs_rekey, rekey_journal_items, reseal_written_at
from octo_worker.storage.sqlite_rows import (
    KEYED_ITEMS_SCHEMA_VERSION,
    SCHEMA_VERSION,
    SQL_CHUNK,
    backend_error,
    connect_read_only,
    migrations,
    schema_version,
)

__all__ = ["JournalWriter"]

_log = structlog.get_logger("octo_worker.store")


class JournalWriter:
    """The writer thread's side of a ``SqliteJournalStore`` (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        anchor_path: Path | None,
        keyring: StorageKeyring,
        data_keyring: StorageKeyring | None,
        *,
        read_only: bool,
        maintenance: bool,
        live: Mapping[str, RowIndex] | None = None,
    ) -> None:
        self._path = path
        # The store's live index of each loaded scope (``row_index``): every
        # batch checks what it replaces against it and moves it.
        self._live: Mapping[str, RowIndex] = {} if live is None else live
        self._anchor_path = anchor_path
        self._sealer = RowSealer(keyring, data_keyring)
        self._read_only = read_only
        self._maintenance = maintenance
        self._db: sqlite3.Connection | None = None
        # Commit baselines per scope: set by reserve and commits.
        self._baselines: dict[str, int] = {}
        # The last write to each session's state row through this instance:
        # the base of a chained commit.
        self._session_tails = SessionTails()
        # The anchor as last written; replaced (never mutated), read by the
        # reader thread at the start of each snapshot.
        self.anchor: Mapping[StorageRecordKey, int] = {}
        # The schema version a read-only open found (a writable open migrates).
        self.schema_found = SCHEMA_VERSION

    def open(self, check_anchor: bool) -> None:
        if self._read_only:
            self._open_checked_read_only()
            return
        self.close()  # a failed earlier attempt may have left one open
        # Before anything is created or migrated: a configured anchor must exist.
        anchor = self._read_anchor_file() if self._anchor_path and check_anchor else None
        loose = prepare_database_files(self._path)
        if loose is not None:
            _log.warning("journal_directory_permissive", mode=oct(loose))
        connection = sqlite3.connect(
            self._path,
            timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            self._configure(connection)
            if anchor is not None:
                # Before migrating: a journal whose anchor says its heads carry
                # digests must not get them rebuilt from its rows as they are.
                found = schema_version(connection)
                compare_with_anchor(anchor, self._all_heads(connection) if found else {}, found)
            sealer = self._sealer
            # What a migration or a rekeying pass replaces (operation keys in
            # clear, above all) is overwritten, not left in free pages.
            connection.execute("PRAGMA secure_delete=ON")
            found = migrate_schema(connection, migrations(sealer.keyring, sealer.data_keyring))
            rekeyed = found < KEYED_ITEMS_SCHEMA_VERSION
            if not self._maintenance and needs_rekey(connection, sealer.keyring):
                # Rows hashed under a key rotated away from (a migration just
                # rekeyed the others): the same pass, in its own transaction.
                self._run_in_transaction(
                    connection, rekey_journal_items(sealer.keyring, sealer.data_keyring)
                )
                rekeyed = True
            connection.execute("PRAGMA secure_delete=OFF")
            if rekeyed and found:
                # Nor in the write-ahead log's older frames.
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            # Every scope head against the store head (O(scopes)): a scope
            # deleted or put back whole is refused before anything is served.
            connection.execute("BEGIN")  # one snapshot for the store head and the heads
            try:
                check_store_heads(connection, self._sealer.keyring)
            finally:
                connection.execute("ROLLBACK")
            self.fill_outbox_sessions(connection)
            check_database_files(self._path)
            if self._anchor_path is not None:
                heads = self._all_heads(connection)
                raised = anchored_with_digests(anchor or {})
                for name, revision in heads.items():
                    head_key = StorageRecordKey(HEAD_NAMESPACE, name)
                    if revision > raised.get(head_key, 0):
                        raised[head_key] = revision
                if self._maintenance:
                    raised = dict(anchor or {})  # checked only: the daemon owns the file
                elif raised != anchor:
                    self._write_anchor_file(raised)
                self.anchor = raised
        except BaseException:
            connection.close()
            raise
        self._db = connection

    def fill_outbox_sessions(self, connection: sqlite3.Connection) -> int:
        """Fill in the session of the outbox rows written before schema 4 (once, at open).

        Each row is authenticated and decrypted, and its document gives the
        session; a row that does not open is left as it is (the daemon's start
        reads the whole outbox and fails on it, as before the migration).
        Metadata only: no revision, envelope or head moves. Returns the rows
        filled in.
        """
        rows = connection.execute(
            "SELECT id, name, item, revision, envelope FROM items "
            "WHERE namespace = ? AND session IS NULL",
            (NS_OUTBOX,),
        ).fetchall()
        if not rows:
            return 0
        found: list[tuple[str, int]] = []
        for row_id, scope, item, revision, envelope in rows:
            row = Row(str(item), int(revision), bytes(envelope))
            try:
                document = self._sealer.open(str(scope), NS_OUTBOX, row)
                entry = read_outbox(document, str(scope), row.item, row.revision)
            except (OctoError, ValueError):
                continue
            found.append((entry.session_id, int(row_id)))
        if found:
            connection.execute("BEGIN IMMEDIATE")
            try:
                connection.executemany(
                    "UPDATE items SET session = ? WHERE id = ? AND session IS NULL", found
                )
                connection.execute("COMMIT")
            except BaseException:
                roll_back(connection)
                raise
        return len(found)

    @staticmethod
    def _run_in_transaction(
        connection: sqlite3.Connection, step: Callable[[sqlite3.Connection], None]
    ) -> None:
        connection.execute("BEGIN IMMEDIATE")
        try:
            step(connection)
            connection.execute("COMMIT")
        except BaseException:
            roll_back(connection)
            raise

    def _open_checked_read_only(self) -> None:
        """The open checks of a read-only store: schema version and anchor, no writes."""
        if not self._path.exists():
            raise StorageBackendError(f"no journal database at {self._path}")
        connection = connect_read_only(self._path)
        try:
            connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
            connection.execute("PRAGMA query_only=ON")
            version = schema_version(connection)
            self.schema_found = version
            # Every inspection query reads columns of schema 1, so a journal the
            # daemon has not migrated yet (just after an upgrade) reads as it is
            # (its journal items in clear before schema 7).
            if version < 1:
                raise StorageBackendError("not an Octo journal (no schema version)")
            if version > SCHEMA_VERSION:
                raise StorageBackendError(
                    f"journal schema version {version} is newer than this octo-worker "
                    f"(version {SCHEMA_VERSION}): use the release that wrote it"
                )
            if self._anchor_path is not None:
                anchor = self._read_anchor_file()
                compare_with_anchor(anchor, self._all_heads(connection), version)
                self.anchor = anchor
        finally:
            connection.close()

    def _configure(self, connection: sqlite3.Connection) -> None:
        mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise StorageBackendError("sqlite could not enable WAL")
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_SECONDS * 1000)}")
        connection.execute("PRAGMA foreign_keys=ON")

    @staticmethod
    def _all_heads(connection: sqlite3.Connection) -> dict[str, int]:
        rows = connection.execute(
            "SELECT name, revision FROM heads WHERE namespace = ?", (HEAD_NAMESPACE,)
        ).fetchall()
        return {str(name): int(revision) for name, revision in rows}

    def _read_anchor_file(self) -> dict[StorageRecordKey, int]:
        assert self._anchor_path is not None
        return read_anchor(self._anchor_path)

    def _write_anchor_file(self, revisions: Mapping[StorageRecordKey, int]) -> None:
        assert self._anchor_path is not None
        write_anchor(self._anchor_path, revisions)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise StorageBackendError("store is closed")
        return self._db

    def reserve(self, scope: str) -> int:
        """Create the scope's head (fence 1) or verify it and add 1 to its fence; reseal it."""
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            head = read_head(connection, scope)
            before = None if head is None else (scope, head.fence, head.revision)
            if head is None:
                head = self._sealer.seal_head(ScopeHead.empty(scope).with_fence(1))
                insert_head(connection, head)
            else:
                self._sealer.verify_head(head)
                # Refused instead of overflowing SQLite's integer range.
                if head.fence >= SQLITE_MAX_INTEGER:
                    raise FencingTokenExhausted()
                head = self._sealer.seal_head(head.with_fence(head.fence + 1))
                update_head(connection, head)
            after = (scope, head.fence, head.revision)
            move_store_head(connection, [(before, after)], self._sealer.keyring)
            connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        self._baselines[scope] = head.revision
        return head.fence

    def apply_batch(self, batch: Sequence[PendingCommit]) -> list[int | OctoError]:
        """One transaction, one fsync, for every change set of ``batch``.

        Runs entirely in the writer thread; every outcome is decided by
        ``CommitBatch``. A change set that fails its own checks is rolled
        back to its savepoint; a failure of the transaction (or of the anchor
        write) fails every change set in it.
        """
        decisions = CommitBatch(
            batch,
            self._baselines,
            self._session_tails,
            SQLITE_MAX_INTEGER,
            verify_head=self._sealer.verify_head,
            live=self._live,
        )
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
                        revision, digest = self._apply_one(connection, pending, decisions)
                    except OctoError as exc:
                        if use_savepoints:
                            connection.execute("ROLLBACK TO change_set")
                            connection.execute("RELEASE change_set")
                        decisions.refused(pending, exc)
                        continue
                    if use_savepoints:
                        connection.execute("RELEASE change_set")
                    decisions.committed_one(pending, revision, digest)
                for head in decisions.advanced_heads():
                    update_head(connection, self._sealer.seal_head(head))
                move_store_head(connection, decisions.head_moves(), self._sealer.keyring)
                connection.execute("COMMIT" if decisions.advanced else "ROLLBACK")
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError, OctoError) as exc:
            return decisions.fail_all(exc if isinstance(exc, OctoError) else backend_error(exc))
        advanced = decisions.advanced
        if advanced and self._anchor_path is not None:
            anchor = dict(self.anchor)
            for scope, revision in advanced.items():
                anchor[StorageRecordKey(HEAD_NAMESPACE, scope)] = revision
            try:
                self._write_anchor_file(anchor)
            except OSError as exc:
                # Committed all the same (the baselines move), but its callers
                # are told the batch failed: nothing may chain on it.
                return decisions.fail_all(backend_error(exc), committed=True)
            finally:
                # Readers compare against the newest anchor the disk may hold.
                self.anchor = anchor
        return decisions.finish()

    def _apply_one(
        self, connection: sqlite3.Connection, pending: PendingCommit, decisions: CommitBatch
    ) -> tuple[int, SetDigest]:
        """The commit checks and writes of one change set, inside the open transaction: its
        revision and the scope digest moved by its rows (O(rows it changes)).

        The head itself is advanced by the caller, once per scope and batch.
        """
        scope = pending.scope
        if decisions.needs_head(scope):
            decisions.see_head(scope, read_head(connection, scope))
        writes, revision = decisions.check(pending)  # steps 1-2
        for write in writes:
            if write.after is not None:  # a broken chain
                raise decisions.conflict(pending, write, self._current(connection, scope, write))
        if revision is None:  # step 4, after step 3's verdict
            for write in writes:
                actual = self._current(connection, scope, write)
                if actual != write.base_revision:
                    raise decisions.conflict(pending, write, actual)
            raise RevisionExhausted()
        now = time.time()
        moves = DigestChanges()
        sealed = [(write, self._sealer.seal(scope, write, revision)) for write in writes]
        tag = written_tag(self._sealer.keyring, scope, revision, now)
        # Step 3 is checked by the writes themselves, one statement per row: an
        # insert meets the UNIQUE key when the row exists, an update names the
        # base revision. A refused change set is undone by the caller (its
        # savepoint, or the whole transaction when it is alone).
        for write, envelope in sealed:
            if write.base_revision is None:
                try:
                    connection.execute(
                        "INSERT INTO items (namespace, name, item, revision, envelope, "
                        "written_at, written_tag, closed, session) "
                        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            write.namespace,
                            scope,
                            write.item,
                            revision,
                            envelope,
                            now,
                            tag if write.namespace == NS_JOURNAL else None,
                            write.closed,
                            write.session,
                        ),
                    )
                except sqlite3.IntegrityError:
                    actual = self._current(connection, scope, write)
                    raise decisions.conflict(pending, write, actual) from None
            else:
                updated = connection.execute(
                    "UPDATE items SET revision = ?, envelope = ?, written_at = ?, written_tag = ?, "
                    "closed = ? WHERE namespace = ? AND name = ? AND item = ? AND revision = ?",
                    (
                        revision,
                        envelope,
                        now,
                        tag if write.namespace == NS_JOURNAL else None,
                        write.closed,
                        write.namespace,
                        scope,
                        write.item,
                        write.base_revision,
                    ),
                ).rowcount
                if updated != 1:
                    actual = self._current(connection, scope, write)
                    raise decisions.conflict(pending, write, actual)
            moves.wrote(write.namespace, write.item, write.base_revision, revision)
        for write in writes:
            if write.closed and write.namespace == NS_SESSION:
                # Its opening row is never rewritten: mark it beside the envelope.
                connection.execute(
                    "UPDATE items SET closed = 1 WHERE namespace = ? AND name = ? AND item = ?",
                    (NS_SESSION_OPEN, scope, write.item),
                )
        for message in pending.outbox_delete:
            for (deleted,) in connection.execute(
                "DELETE FROM items WHERE namespace = ? AND name = ? AND item = ? "
                "RETURNING revision",
                (NS_OUTBOX, scope, message),
            ).fetchall():
                moves.wrote(NS_OUTBOX, message, int(deleted), None)
        decisions.check_live(pending, moves)
        return revision, decisions.moved_digest(pending, moves)

    @staticmethod
    def _current(connection: sqlite3.Connection, scope: str, write: RowWrite) -> int | None:
        """The revision ``write``'s row has now (None: absent)."""
        current = connection.execute(
            "SELECT revision FROM items WHERE namespace = ? AND name = ? AND item = ?",
            (write.namespace, scope, write.item),
        ).fetchone()
        return None if current is None else int(current[0])

    def close(self) -> None:
        self._session_tails.clear()
        if self._db is not None:
            self._db.close()
            self._db = None

    def mark_closed(self, scope: str, ids: Sequence[str]) -> None:
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            for start in range(0, len(ids), SQL_CHUNK):
                chunk = ids[start : start + SQL_CHUNK]
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

    def replace_envelopes(self, changes: Sequence[tuple[int, int, bytes, bytes]]) -> int:
        """Swap envelopes of rows still at the revision and envelope that were read."""
        return self._count_in_transaction(
            "UPDATE items SET envelope = ? WHERE id = ? AND revision = ? AND envelope = ?",
            [(new, row_id, revision, old) for row_id, revision, old, new in changes],
        )

    def prune_rows(self, scope: str, victims: Sequence[tuple[str, int, bytes, bytes]]) -> int:
        """Swap each journal row still at the revision and envelope read for its pruned
        envelope (same revision: no digest or head moves), in one transaction."""
        return self._count_in_transaction(
            "UPDATE items SET envelope = ? WHERE namespace = ? AND name = ? AND item = ? "
            "AND revision = ? AND envelope = ?",
            [(new, NS_JOURNAL, scope, item, revision, old) for item, revision, old, new in victims],
        )

    def reseal_head(self, scope: str) -> bool:
        """Reseal the scope's head with the active key if another key sealed it (its
        revision, fence and digest unchanged), and the ``written_at`` seals of its journal
        rows; whether the head was resealed."""
        connection = self._connection()
        connection.execute("BEGIN IMMEDIATE")
        try:
            head = read_head(connection, scope)
            moved = reseal_store_head(connection, self._sealer.keyring)
            if head is not None and head.key_id != self._sealer.keyring.active_id:
                self._sealer.verify_head(head)
                update_head(connection, self._sealer.seal_head(head))
                moved = True
            # And the seals of the journal rows' ``written_at`` another key made.
            tagged = reseal_written_at(connection, self._sealer.keyring, scope)
            connection.execute("COMMIT" if moved or tagged else "ROLLBACK")
        except BaseException:
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
        return moved
