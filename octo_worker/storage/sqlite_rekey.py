"""The SQLite journal's rekeying pass: its rows brought under the active key's item hash.

Owns the statements and the driver of ``item_rekey``'s pass on SQLite: the
schema 7 -> 8 migration step (journal items become keyed hashes, in the
migration's one transaction) and the same pass at a writable open when rows
are hashed under a key rotated away from (its own transaction). Each scope is
a savepoint: a scope that fails its check keeps its rows as they were. The
scope heads are resealed at their own revision and fence, so the store head
(over the scope heads' revisions and fences) does not move.

Also the schema 8 -> 9 step (:func:`seal_written_at`): the ``written_tag``
column, every journal row's ``written_at`` sealed as it stands, per scope
after the scope's rows were checked against its sealed head (heads do not
move), and the pass that seals again the tags of rows a retired-soon key
sealed (:func:`reseal_written_at`, ``reseal``).

It must never decide what a row or a head means (``item_rekey`` does), commit
or roll back the caller's transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Final

import structlog

from octo_common.errors import OctoError
from octo_common.records import StorageKeyring
from octo_worker.storage.documents import NS_JOURNAL
from octo_worker.storage.item_rekey import REKEY_BATCH, ItemRekeying
from octo_worker.storage.sealing import check_written, written_key_id, written_tag
from octo_worker.storage.sqlite_heads import read_head, scope_rows, update_head

__all__ = ["needs_rekey", "rekey_journal_items", "reseal_written_at", "seal_written_at"]

_log = structlog.get_logger("octo_worker.store")

_STALE_SCOPES: Final = (
    "SELECT DISTINCT name FROM items WHERE namespace = ? AND substr(item, 1, ?) <> ?"
)
_JOURNAL_BATCH: Final = (
    "SELECT id, item, revision, envelope FROM items "
    "WHERE namespace = ? AND name = ? AND id > ? ORDER BY id LIMIT ?"
)


def needs_rekey(connection: sqlite3.Connection, keyring: StorageKeyring) -> bool:
    """Whether a journal row's item is not the active key's hash (``item_rekey``)."""
    prefix = f"{keyring.active_id}:"
    found = connection.execute(
        _STALE_SCOPES + " LIMIT 1", (NS_JOURNAL, len(prefix), prefix)
    ).fetchone()
    return found is not None


def rekey_journal_items(
    keyring: StorageKeyring, data_keyring: StorageKeyring | None
) -> Callable[[sqlite3.Connection], None]:
    """The step that brings every journal row under the active key's item hash
    (``item_rekey``), inside the caller's transaction, one savepoint per scope."""

    def run(connection: sqlite3.Connection) -> None:
        rekey = ItemRekeying(keyring, data_keyring)
        prefix = rekey.prefix
        scopes = sorted(
            str(name)
            for (name,) in connection.execute(_STALE_SCOPES, (NS_JOURNAL, len(prefix), prefix))
        )
        for scope in scopes:
            connection.execute("SAVEPOINT rekey_scope")
            try:
                head = rekey.checked_head(
                    scope, read_head(connection, scope), _rows(connection, scope)
                )
                _rekey_rows(connection, rekey, scope)
                update_head(connection, rekey.resealed_head(head, _rows(connection, scope)))
            except OctoError as error:
                connection.execute("ROLLBACK TO rekey_scope")
                _log.warning("journal_items_not_rekeyed", scope=scope, error=error.code)
            connection.execute("RELEASE rekey_scope")

    return run


def _rows(connection: sqlite3.Connection, scope: str) -> list[tuple[str, str, int]]:
    return list(scope_rows(connection, scope))


def _rekey_rows(connection: sqlite3.Connection, rekey: ItemRekeying, scope: str) -> None:
    after = 0
    while True:
        batch = connection.execute(
            _JOURNAL_BATCH, (NS_JOURNAL, scope, after, REKEY_BATCH)
        ).fetchall()
        if not batch:
            return
        after = int(batch[-1][0])
        changes = rekey.rewrites(scope, batch)
        if changes:
            connection.executemany("UPDATE items SET item = ?, envelope = ? WHERE id = ?", changes)
        rekey.wrote(len(changes))


_SELECT_WRITTEN: Final = (
    "SELECT id, revision, written_at, written_tag FROM items WHERE namespace = ? AND name = ?"
)
_UPDATE_WRITTEN: Final = (
    "UPDATE items SET written_tag = ? WHERE id = ? AND revision = ? AND written_at = ?"
)


def seal_written_at(keyring: StorageKeyring) -> Callable[[sqlite3.Connection], None]:
    """The schema 8 -> 9 step: the ``written_tag`` column, and each scope's journal rows'
    ``written_at`` sealed as it stands once the scope's rows match its sealed head
    (a scope that does not keeps its rows untagged: refused at its load)."""

    def run(connection: sqlite3.Connection) -> None:
        columns = {str(c[1]) for c in connection.execute("PRAGMA table_info(items)")}
        if "written_tag" not in columns:  # a journal taken back to schema 8 has it
            connection.execute("ALTER TABLE items ADD COLUMN written_tag TEXT")
        check = ItemRekeying(keyring, None)
        scopes = sorted(
            str(name)
            for (name,) in connection.execute(
                "SELECT DISTINCT name FROM items WHERE namespace = ?", (NS_JOURNAL,)
            )
        )
        for scope in scopes:
            try:
                check.checked_head(scope, read_head(connection, scope), _rows(connection, scope))
            except OctoError as error:
                _log.warning("journal_written_at_not_sealed", scope=scope, error=error.code)
                continue
            rows = connection.execute(_SELECT_WRITTEN, (NS_JOURNAL, scope)).fetchall()
            connection.executemany(
                _UPDATE_WRITTEN,
                [
                    (written_tag(keyring, scope, revision, when), row_id, revision, when)
                    for row_id, revision, when, _ in rows
                ],
            )

    return run


def reseal_written_at(connection: sqlite3.Connection, keyring: StorageKeyring, scope: str) -> int:
    """Seal again, with the active key, every journal row's ``written_at`` of ``scope``
    that another key sealed, each checked first (inside the caller's transaction)."""
    changes = []
    for row_id, revision, when, tag in connection.execute(_SELECT_WRITTEN, (NS_JOURNAL, scope)):
        if written_key_id(tag) == keyring.active_id:
            continue
        check_written(keyring, scope, revision, when, tag)
        changes.append((written_tag(keyring, scope, revision, when), row_id, revision, when))
    connection.executemany(_UPDATE_WRITTEN, changes)
    return len(changes)
