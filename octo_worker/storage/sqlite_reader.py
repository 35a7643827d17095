"""The reader thread of the SQLite journal store: one read snapshot per batch of loads.

:class:`JournalReader` runs only in the store's reader thread and owns its
connection (``query_only``; ``mode=ro`` for a read-only store). It runs
every load waiting at once inside one read snapshot, which WAL lets run
beside a commit's fsync, checks each row's revision against the scope head
in that snapshot (the floor rule) and the head against the rollback anchor
as last written, and returns rows still sealed: the store opens them on the
event loop.

It must never write, run on the event loop, or let its connection leave
its thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from octo_common.errors import OctoError, RollbackDetected, StorageBackendError
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS
from octo_common.records import StorageRecordKey
from octo_worker.storage.changes import HEAD_NAMESPACE, Row, record_key
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
)
from octo_worker.storage.interface import ScopeMetadata
from octo_worker.storage.sealing import checked_rows
from octo_worker.storage.sqlite_rows import (
    BY_ITEMS,
    LIVE_SESSION_ROWS,
    OUTBOX_ROWS,
    REQUEST_ROWS,
    RESEAL_BATCH,
    backend_error,
    connect_read_only,
    guarded,
    select_in_chunks,
)
from octo_worker.storage.sqlite_writer import JournalWriter

__all__ = ["JournalReader"]

T = TypeVar("T")


class JournalReader:
    """The reader thread's side of a ``SqliteJournalStore`` (see the module docstring)."""

    def __init__(
        self, path: Path, anchor_path: Path | None, writer: JournalWriter, *, read_only: bool
    ) -> None:
        self._path = path
        self._anchor_path = anchor_path
        # Read for the anchor it last wrote, at the start of each snapshot.
        self._writer = writer
        self._read_only = read_only
        self._db: sqlite3.Connection | None = None
        # The anchor and the heads the current snapshot is compared with.
        self._snapshot_anchor: Mapping[StorageRecordKey, int] = {}
        self._snapshot_heads: dict[str, int] = {}
        # Whether outbox rows carry their session (schema 4): a read-only
        # store reads an older journal as it is.
        self._outbox_sessions = False

    def open(self) -> None:
        self.close()
        if self._read_only:
            connection = connect_read_only(self._path)
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
            columns = connection.execute("PRAGMA table_info(items)").fetchall()
        except BaseException:
            connection.close()
            raise
        self._outbox_sessions = any(str(column[1]) == "session" for column in columns)
        self._db = connection

    def _reading(self) -> sqlite3.Connection:
        if self._db is None:
            raise StorageBackendError("store is closed")
        return self._db

    def _snapshot_head(self, connection: sqlite3.Connection, scope: str) -> int:
        """The head revision in the current snapshot (read once per scope and snapshot)."""
        head = self._snapshot_heads.get(scope)
        if head is None:
            row = connection.execute(
                "SELECT revision FROM heads WHERE namespace = ? AND name = ?",
                (HEAD_NAMESPACE, scope),
            ).fetchone()
            head = 0 if row is None else int(row[0])
            self._snapshot_heads[scope] = head
        return head

    def run_reads(self, functions: Sequence[Callable[[], object]]) -> list[tuple[bool, Any]]:
        """Reader thread: every waiting read inside one read snapshot.

        Each read keeps its own outcome. The anchor is read before the
        snapshot starts: it is only raised after a COMMIT, so the snapshot is
        never older than the anchor it is compared with.
        """
        self._snapshot_anchor = self._writer.anchor
        self._snapshot_heads = {}
        outcomes: list[tuple[bool, Any]] = []
        try:
            connection = self._reading()
            connection.execute("BEGIN")
        except (sqlite3.Error, OctoError) as exc:
            failure = exc if isinstance(exc, OctoError) else backend_error(exc)
            return [(False, failure)] * len(functions)
        try:
            for function in functions:
                try:
                    outcomes.append((True, guarded(function)))
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
            anchored = self._snapshot_anchor.get(record_key(HEAD_NAMESPACE, scope), 0)
            if head < anchored:
                raise RollbackDetected(head or None, anchored)
        return head, result

    def read_head(self, scope: str) -> int:
        head, _ = self._read_transaction(lambda _connection: None, scope)
        return head

    def read_items(self, scope: str, namespace: str, items: Sequence[str] | None) -> list[Row]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if items is None:
                return connection.execute(
                    "SELECT item, revision, envelope FROM items "
                    "WHERE namespace = ? AND name = ? ORDER BY revision, id",
                    (namespace, scope),
                ).fetchall()
            return select_in_chunks(
                connection,
                f"SELECT item, revision, envelope FROM items {BY_ITEMS}",  # noqa: S608
                (namespace, scope),
                items,
            )

        head, rows = self._read_transaction(select, scope)
        return checked_rows(rows, head)

    def read_outbox(self, scope: str, session: str) -> tuple[list[Row], bool]:
        """The outbox rows of one session, oldest revision first, through the index.

        Returns the rows and whether they were chosen by their session column;
        without it (a read-only store on a journal older than schema 4) every
        outbox row of the scope, for the caller to choose from.
        """
        if not self._outbox_sessions:
            return self.read_items(scope, NS_OUTBOX, None), False

        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return connection.execute(
                "SELECT item, revision, envelope FROM items "  # noqa: S608
                f"INDEXED BY items_outbox_sessions WHERE {OUTBOX_ROWS} "
                "AND name = ? AND session = ? ORDER BY revision, id",
                (scope, session),
            ).fetchall()

        head, rows = self._read_transaction(select, scope)
        return checked_rows(rows, head), True

    def read_sessions(
        self, scope: str, keep: Sequence[str] | None
    ) -> tuple[list[Row], list[Row], list[Row]]:
        """(state rows, opening rows, request rows of the sessions whose state was read)."""

        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            if keep is None:
                return connection.execute(
                    "SELECT namespace, item, revision, envelope FROM items "
                    "WHERE namespace IN (?, ?) AND name = ? ORDER BY item",
                    (NS_SESSION, NS_SESSION_OPEN, scope),
                ).fetchall()
            found = connection.execute(
                "SELECT namespace, item, revision, envelope FROM items "  # noqa: S608
                f"INDEXED BY items_live_sessions WHERE name = ? AND {LIVE_SESSION_ROWS}",
                (scope,),
            ).fetchall()
            found.extend(
                select_in_chunks(
                    connection,
                    "SELECT namespace, item, revision, envelope FROM items "
                    "WHERE namespace IN (?, ?) AND name = ? AND closed = 1 AND item",
                    (NS_SESSION, NS_SESSION_OPEN, scope),
                    keep,
                )
            )
            return found

        def select_all(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            found = select(connection)
            sessions = sorted({str(row[1]) for row in found if row[0] == NS_SESSION})
            if self._outbox_sessions:  # (schema 4 on: no request row exists before 6)
                found.extend(self._request_rows(connection, scope, sessions))
            return found

        head, rows = self._read_transaction(select_all, scope)
        states = [row[1:] for row in rows if row[0] == NS_SESSION]
        openings = [row[1:] for row in rows if row[0] == NS_SESSION_OPEN]
        requests = [row[1:] for row in rows if row[0] == NS_SESSION_REQUEST]
        return (
            checked_rows(states, head),
            checked_rows(openings, head),
            checked_rows(requests, head),
        )

    @staticmethod
    def _request_rows(
        connection: sqlite3.Connection, scope: str, sessions: Sequence[str]
    ) -> list[tuple[Any, ...]]:
        """The request rows of ``sessions``, through their partial index (schema 6)."""
        return select_in_chunks(
            connection,
            "SELECT namespace, item, revision, envelope FROM items "  # noqa: S608
            f"WHERE {REQUEST_ROWS} AND name = ? AND session",
            (scope,),
            sessions,
        )

    def read_scopes(self, *, stored: bool = False) -> list[str]:
        """Every scope with a head; ``stored``: with a head or a row (O(rows))."""
        statement = "SELECT name FROM heads WHERE namespace = ?"
        if stored:
            statement += " UNION SELECT name FROM items"
        rows = self._reading().execute(statement + " ORDER BY name", (HEAD_NAMESPACE,)).fetchall()
        return [str(row[0]) for row in rows]

    def read_metadata(self, scope: str) -> ScopeMetadata:
        connection = self._reading()
        row = connection.execute(
            "SELECT fence FROM heads WHERE namespace = ? AND name = ?", (HEAD_NAMESPACE, scope)
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

    def integrity(self) -> list[str]:
        rows = self._reading().execute("PRAGMA integrity_check").fetchall()
        return [str(row[0]) for row in rows]

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def read_batch(self, scope: str, after: int) -> list[tuple[int, str, Row]]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return connection.execute(
                "SELECT id, namespace, item, revision, envelope FROM items "
                "WHERE name = ? AND id > ? AND namespace IN (?, ?, ?, ?, ?) ORDER BY id LIMIT ?",
                (
                    scope,
                    after,
                    NS_JOURNAL,
                    NS_SESSION,
                    NS_SESSION_OPEN,
                    NS_OUTBOX,
                    NS_SESSION_REQUEST,
                    RESEAL_BATCH,
                ),
            ).fetchall()

        head, rows = self._read_transaction(select, scope)
        checked = checked_rows([row[2:] for row in rows], head)
        return [(int(row[0]), str(row[1]), ok) for row, ok in zip(rows, checked, strict=True)]

    def read_prunable(self, scope: str, cutoff: float) -> list[tuple[Row, Any, Any]]:
        def select(connection: sqlite3.Connection) -> list[tuple[Any, ...]]:
            return connection.execute(
                "SELECT item, revision, envelope, written_at, written_tag FROM items "
                "WHERE namespace = ? AND name = ? AND written_at < ? ORDER BY revision, id",
                (NS_JOURNAL, scope, cutoff),
            ).fetchall()

        head, rows = self._read_transaction(select, scope)
        checked = checked_rows([row[:3] for row in rows], head)
        return [(ok, row[3], row[4]) for row, ok in zip(rows, checked, strict=True)]
