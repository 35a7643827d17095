"""The SQLite statements of the journal's scope heads (see ``scope_head`` for the rules).

Owns how a :class:`~octo_worker.storage.scope_head.ScopeHead` is read,
inserted and updated in the ``heads`` table, how a scope's row triples are
read for a recomputation, the schema 4 → 5 migration that adds the head's
digest and seal columns and builds them from the rows in the migration's own
transaction, the ``store_head`` table (``store_head``: one sealed digest over
every scope head, created and built by its own migration, moved with the
heads), and a whole scope read in one snapshot for the check it gets
whenever it is loaded (:func:`read_scope_snapshot`). The caller holds the
transaction: every function runs on the connection it is given, inside what
the caller began.

It must never decide what a head or a digest means (``scope_head`` does),
commit or roll back, or run on the event loop.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from octo_common.errors import StorageBackendError
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_worker.storage.scope_head import (
    DIGESTED_NAMESPACES,
    HEAD_NAMESPACE,
    STORE_HEAD_FORMAT,
    ScopeHead,
    ScopeSnapshot,
    digest_and_index,
    digest_of,
)
from octo_worker.storage.store_head import (
    HeadMove,
    HeadState,
    JournalStoreHead,
    check_store,
    digest_of_heads,
    moved,
)

__all__ = [
    "HEAD_COLUMNS",
    "STORE_HEAD_SCHEMA",
    "check_store_heads",
    "create_store_head",
    "move_store_head",
    "has_digests",
    "insert_head",
    "read_head",
    "read_scope_snapshot",
    "reseal_store_head",
    "scope_rows",
    "seal_existing_heads",
    "update_head",
]

# Schema 4 -> 5: the digest and seal of each scope head. NULL only between
# these statements and ``seal_existing_heads``, in the same transaction.
HEAD_COLUMNS: Final = (
    "ALTER TABLE heads ADD COLUMN row_count INTEGER",
    "ALTER TABLE heads ADD COLUMN digest BLOB",
    "ALTER TABLE heads ADD COLUMN key_id TEXT",
    "ALTER TABLE heads ADD COLUMN auth_tag TEXT",
)

# The schema version that added the store head (its migration: ``create_store_head``).
STORE_HEAD_SCHEMA: Final = STORE_HEAD_FORMAT

_UPDATE_STORE_HEAD: Final = (
    "UPDATE store_head SET revision = ?, row_count = ?, digest = ?, key_id = ?, auth_tag = ? "
    "WHERE id = 1"
)
_SELECT_HEAD: Final = (
    "SELECT revision, fence, row_count, digest, key_id, auth_tag FROM heads "
    "WHERE namespace = ? AND name = ?"
)
_UPDATE_HEAD: Final = (
    "UPDATE heads SET revision = ?, fence = ?, row_count = ?, digest = ?, key_id = ?, "
    "auth_tag = ? WHERE namespace = ? AND name = ?"
)
_INSERT_HEAD: Final = (
    "INSERT INTO heads (revision, fence, row_count, digest, key_id, auth_tag, namespace, name) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
# One index range per namespace (the UNIQUE (namespace, name, item) index).
_SELECT_ROWS: Final = (
    "SELECT namespace, item, revision FROM items WHERE namespace IN "  # noqa: S608
    f"({', '.join('?' * len(DIGESTED_NAMESPACES))}) AND name = ?"
)


def read_head(connection: sqlite3.Connection, scope: str) -> ScopeHead | None:
    """The scope's head as stored (None without one); its seal is not checked here."""
    row = connection.execute(_SELECT_HEAD, (HEAD_NAMESPACE, scope)).fetchone()
    return None if row is None else ScopeHead.from_row(scope, tuple(row))


def update_head(connection: sqlite3.Connection, head: ScopeHead) -> None:
    connection.execute(_UPDATE_HEAD, (*head.row(), HEAD_NAMESPACE, head.scope))


def insert_head(connection: sqlite3.Connection, head: ScopeHead) -> None:
    connection.execute(_INSERT_HEAD, (*head.row(), HEAD_NAMESPACE, head.scope))


def scope_rows(connection: sqlite3.Connection, scope: str) -> Iterator[tuple[str, str, int]]:
    """Every (namespace, key, revision) of ``scope`` in the digested namespaces."""
    cursor = connection.execute(_SELECT_ROWS, (*DIGESTED_NAMESPACES, scope))
    for namespace, item, revision in cursor:
        if not isinstance(namespace, str) or not isinstance(item, str):
            raise StorageBackendError("malformed item row")
        if type(revision) is not int or revision < 1:
            raise StorageBackendError("malformed item row")
        yield namespace, item, revision


def has_digests(connection: sqlite3.Connection) -> bool:
    """Whether the heads table has the digest columns (schema 4 or later)."""
    columns = {str(c[1]) for c in connection.execute("PRAGMA table_info(heads)").fetchall()}
    return "digest" in columns


def seal_existing_heads(keyring: StorageKeyring) -> Callable[[sqlite3.Connection], None]:
    """The migration step that builds every scope head's digest from its rows and seals it.

    Runs once, inside the migration's transaction (O(rows), once); the
    rows are taken as they are, as the journal did before digests existed.
    """

    def build(connection: sqlite3.Connection) -> None:
        heads = connection.execute(
            "SELECT name, revision, fence FROM heads WHERE namespace = ?", (HEAD_NAMESPACE,)
        ).fetchall()
        for name, revision, fence in heads:
            scope = str(name)
            digest = digest_of(scope, list(scope_rows(connection, scope)))
            head = ScopeHead(scope, int(revision), int(fence), digest).sealed(keyring)
            update_head(connection, head)

    return build


def _head_states(
    connection: sqlite3.Connection, keyring: StorageKeyring | None = None
) -> list[HeadState]:
    """Every scope head as (scope, fence, revision); each one's seal verified first
    when ``keyring`` is given (an edited head is told as such, not as a mismatch)."""
    rows = connection.execute(
        "SELECT name, revision, fence, row_count, digest, key_id, auth_tag FROM heads "
        "WHERE namespace = ?",
        (HEAD_NAMESPACE,),
    ).fetchall()
    states: list[HeadState] = []
    for name, *row in rows:
        if not isinstance(name, str):
            raise StorageBackendError("malformed scope head row")
        head = ScopeHead.from_row(name, tuple(row))
        if keyring is not None:
            head.verify(keyring)
        states.append((name, head.fence, head.revision))
    return states


def _read_store_head(connection: sqlite3.Connection) -> JournalStoreHead:
    rows = connection.execute(
        "SELECT revision, row_count, digest, key_id, auth_tag FROM store_head WHERE id = 1"
    ).fetchall()
    return JournalStoreHead.from_row(tuple(rows[0]) if len(rows) == 1 else None)


def _has_store_head(connection: sqlite3.Connection) -> bool:
    """Whether the schema has reached the store head's migration (the table is then
    required: a store that dropped it fails on the read)."""
    try:
        row = connection.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.OperationalError:
        return False
    return row is not None and type(row[0]) is int and row[0] >= STORE_HEAD_SCHEMA


def create_store_head(keyring: StorageKeyring) -> Callable[[sqlite3.Connection], None]:
    """The migration step that creates the store head and builds it from the scope heads
    as they are (O(scopes), once), sealed, inside the migration's transaction."""

    def build(connection: sqlite3.Connection) -> None:
        connection.execute(
            """CREATE TABLE store_head (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                revision INTEGER NOT NULL CHECK (revision >= 0),
                row_count INTEGER NOT NULL CHECK (row_count >= 0),
                digest BLOB NOT NULL,
                key_id TEXT NOT NULL,
                auth_tag TEXT NOT NULL
            )"""
        )
        head = JournalStoreHead.sealed(keyring, 0, digest_of_heads(_head_states(connection)))
        connection.execute(
            "INSERT INTO store_head (id, revision, row_count, digest, key_id, auth_tag) "
            "VALUES (1, ?, ?, ?, ?, ?)",
            head.row(),
        )

    return build


def check_store_heads(connection: sqlite3.Connection, keyring: StorageKeyring) -> int:
    """The store head against every scope head, in the caller's snapshot (O(scopes));
    how many scope heads there are. Nothing to check before the store head's migration."""
    heads = _head_states(connection, keyring)
    if _has_store_head(connection):
        check_store(_read_store_head(connection), heads, keyring)
    return len(heads)


def reseal_store_head(connection: sqlite3.Connection, keyring: StorageKeyring) -> bool:
    """Reseal the store head with the active key if another key sealed it (its digest
    unchanged, its seal verified first), inside the caller's transaction; whether it did."""
    if not _has_store_head(connection):
        return False
    head = _read_store_head(connection)
    if head.key_id == keyring.active_id:
        return False
    head = moved(head, [], keyring)
    connection.execute(
        _UPDATE_STORE_HEAD,
        head.row(),
    )
    return True


def move_store_head(
    connection: sqlite3.Connection, moves: list[HeadMove], keyring: StorageKeyring
) -> None:
    """Move the store head by ``moves`` and reseal it, inside the caller's transaction."""
    if not moves:
        return
    head = moved(_read_store_head(connection), moves, keyring)
    connection.execute(
        _UPDATE_STORE_HEAD,
        head.row(),
    )


def read_scope_snapshot(
    connection: sqlite3.Connection,
    scope: str,
    anchor: Mapping[StorageRecordKey, int],
    keyring: StorageKeyring,
) -> ScopeSnapshot:
    """The scope's head and the digest recomputed over its rows, in the caller's read
    snapshot (O(rows of the scope)), for ``scope_head.check_snapshot``. A journal
    without digests yet (a read-only look at schema 4 or older) gives no digest."""
    anchored = anchor.get(StorageRecordKey(HEAD_NAMESPACE, scope), 0)
    if not has_digests(connection):
        row = connection.execute(
            "SELECT revision FROM heads WHERE namespace = ? AND name = ?", (HEAD_NAMESPACE, scope)
        ).fetchone()
        revision = 0 if row is None else int(row[0])
        rows = sum(1 for _ in scope_rows(connection, scope))
        return ScopeSnapshot(None, None, revision, rows, anchored)
    check_store_heads(connection, keyring)
    head = read_head(connection, scope)
    hint = 0 if head is None else head.digest.count
    computed, index = digest_and_index(scope, scope_rows(connection, scope), hint)
    revision = 0 if head is None else head.revision
    index.revision = revision
    written = read_written(connection, scope)
    return ScopeSnapshot(head, computed, revision, computed.count, anchored, index, written)


# The schema (sqlite_rows.WRITTEN_AT_SCHEMA_VERSION) from which journal rows'
# ``written_at`` is sealed.
_WRITTEN_SCHEMA: Final = 9


def read_written(
    connection: sqlite3.Connection, scope: str
) -> frozenset[tuple[Any, Any, Any]] | None:
    """Every distinct (revision, written_at, written_tag) of the scope's journal rows;
    None for a journal older than the seals (a read-only look reads it as it is)."""
    try:
        rows = connection.execute(
            "SELECT DISTINCT revision, written_at, written_tag FROM items "
            "WHERE namespace = ? AND name = ?",
            (HEAD_NAMESPACE, scope),  # the journal rows' namespace
        ).fetchall()
    except sqlite3.OperationalError:
        row = connection.execute("SELECT version FROM schema_version").fetchone()
        if row is not None and int(row[0]) < _WRITTEN_SCHEMA:
            return None
        raise
    return frozenset(tuple(row) for row in rows)
