"""The journal's store head: one scope deleted or put back whole is refused (both backends).

Each scope head commits to its own rows; nothing committed to the set of
scope heads, so a scope deleted whole (its head row and every row) or put
back whole to an earlier copy's sealed rows and head, in a store whose other
scopes are untouched, passed every check and its keys ran again. The store
head commits to every scope head: a store opened on such an edit refuses it
(``verify_store``, every scope load) with ``rollback_detected``, on a real
SQLite file and a real PostgreSQL schema (``journal_db``). A store head row
deleted is refused the same way (never taken for one still to be built).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import RollbackDetected
from octo_common.runtime.anchorfile import read_anchor
from octo_worker.storage import postgres_heads, postgres_rekey
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.scope_head import STORE_HEAD_ANCHOR_KEY, STORE_HEAD_FORMAT
from octo_worker.storage.sqlite_rows import SCHEMA_VERSION as SQLITE_SCHEMA_VERSION
from octo_worker.store import SqliteJournalStore

from .journal_backends import JournalDatabase
from .test_worker_store import OTHER_SCOPE, SCOPE, pending, rows, storage_keyring, succeeded

COLUMNS = "namespace, name, item, revision, envelope, written_at, closed, session"
HEAD_COLUMNS = "namespace, name, revision, fence, row_count, digest, key_id, auth_tag"


async def fill(store: JournalStoreBase) -> None:
    """Two scopes with rows: SCOPE at revision 2, OTHER_SCOPE at revision 1."""
    lease = await store.reserve_fence(SCOPE)
    other = await store.reserve_fence(OTHER_SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), 1), (pending("op-2"), None)))
    await store.commit(OTHER_SCOPE, other, rows(OTHER_SCOPE, (pending("op-9"), None)))


async def filled(db: JournalDatabase) -> None:
    store = db.store(storage_keyring())
    try:
        await fill(store)
    finally:
        await store.close()


async def copy_of(db: JournalDatabase, scope: str) -> tuple[list[Any], list[Any]]:
    """What someone with the database keeps of one scope: its rows and its head row."""
    items = await db.sql(f"SELECT {COLUMNS} FROM items WHERE name = ?", scope)
    head = await db.sql(f"SELECT {HEAD_COLUMNS} FROM heads WHERE name = ?", scope)
    return items, head


async def put_back(db: JournalDatabase, scope: str, copy: tuple[list[Any], list[Any]]) -> None:
    items, head = copy
    await db.sql("DELETE FROM items WHERE name = ?", scope)
    await db.sql("DELETE FROM heads WHERE name = ?", scope)
    for row in items:
        await db.sql(f"INSERT INTO items ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", *row)
    for row in head:
        await db.sql(f"INSERT INTO heads ({HEAD_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", *row)


async def refused_everywhere(db: JournalDatabase) -> None:
    """A new store on the database: the store check, the other scope's load and the
    edited scope's reservation all refuse it."""
    store = db.store(storage_keyring())
    try:
        with pytest.raises(RollbackDetected):
            await store.verify_store()
        with pytest.raises(RollbackDetected):
            await store.verify_scope(OTHER_SCOPE)
        with pytest.raises(RollbackDetected):
            lease = await store.reserve_fence(SCOPE)
            await store.verify_scope(SCOPE)
            await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
    finally:
        await store.close()


async def test_the_store_head_counts_every_scope_head(journal_db: JournalDatabase) -> None:
    store = journal_db.store(storage_keyring())
    try:
        await fill(store)
        assert await store.verify_store() == 2
    finally:
        await store.close()


async def test_a_scope_deleted_whole_is_refused(journal_db: JournalDatabase) -> None:
    await filled(journal_db)
    await journal_db.sql("DELETE FROM items WHERE name = ?", SCOPE)
    await journal_db.sql("DELETE FROM heads WHERE name = ?", SCOPE)
    await refused_everywhere(journal_db)


async def test_a_scope_put_back_whole_to_an_earlier_copy_is_refused(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        await store.commit(OTHER_SCOPE, await store.reserve_fence(OTHER_SCOPE), rows(OTHER_SCOPE))
        copy = await copy_of(journal_db, SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), 1)))
    finally:
        await store.close()
    await put_back(journal_db, SCOPE, copy)
    await refused_everywhere(journal_db)


async def test_a_store_head_row_deleted_is_refused_not_rebuilt(
    journal_db: JournalDatabase,
) -> None:
    await filled(journal_db)
    await journal_db.sql("DELETE FROM store_head")
    await refused_everywhere(journal_db)


async def test_the_store_head_follows_a_key_rotation(journal_db: JournalDatabase) -> None:
    await filled(journal_db)
    rotated = storage_keyring("storage-v2", 2)
    rotated.add_read_key("storage-v1", bytes([1]) * 32)
    maintenance = journal_db.store(rotated, maintenance=True)
    try:
        await maintenance.reseal(SCOPE)
    finally:
        await maintenance.close()
    assert await journal_db.sql("SELECT key_id FROM store_head") == [("storage-v2",)]
    reopened = journal_db.store(rotated)
    try:
        assert await reopened.verify_store() == 2
    finally:
        await reopened.close()


async def test_a_journal_from_before_the_store_head_gets_it_built_by_the_migration(
    journal_db: JournalDatabase,
) -> None:
    await filled(journal_db)
    await journal_db.sql("DROP TABLE store_head")
    before = postgres_heads.SCHEMA_VERSION if journal_db.postgres else STORE_HEAD_FORMAT
    await journal_db.set_schema_version(before - 1)

    upgraded = journal_db.store(storage_keyring())
    try:
        await upgraded.reserve_fence(SCOPE)
        assert await upgraded.verify_store() == 2
    finally:
        await upgraded.close()
    # Forward to the newest schema (the migrations after the store head's too).
    newest = postgres_rekey.SCHEMA_VERSION if journal_db.postgres else SQLITE_SCHEMA_VERSION
    assert await journal_db.schema_version() == newest > before - 1
    # The store head the migration built is the one every load checks.
    await journal_db.sql("DELETE FROM items WHERE name = ?", SCOPE)
    await journal_db.sql("DELETE FROM heads WHERE name = ?", SCOPE)
    await refused_everywhere(journal_db)


async def test_a_journal_edited_back_to_before_its_store_head_is_refused_by_the_anchor(
    tmp_path: Path,
) -> None:
    path = tmp_path / "worker.db"
    anchor = tmp_path / "worker.anchor"
    store = SqliteJournalStore(path, storage_keyring(), anchor_path=anchor)
    try:
        await store.initialize_anchor()
    finally:
        await store.close()
    store = SqliteJournalStore(path, storage_keyring(), anchor_path=anchor)
    try:
        await fill(store)
    finally:
        await store.close()
    assert read_anchor(anchor)[STORE_HEAD_ANCHOR_KEY] == STORE_HEAD_FORMAT
    # The store head dropped and the schema edited back, so that a migration
    # would build it again from whatever scope heads the file then holds.
    database = JournalDatabase("sqlite", path, None)
    await database.sql("DROP TABLE store_head")
    await database.set_schema_version(STORE_HEAD_FORMAT - 1)
    reopened = SqliteJournalStore(path, storage_keyring(), anchor_path=anchor)
    try:
        with pytest.raises(RollbackDetected):
            await reopened.reserve_fence(SCOPE)
    finally:
        await reopened.close()
