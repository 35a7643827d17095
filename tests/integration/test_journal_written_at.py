"""A journal row's write time is sealed, on both backends.

``written_at`` (what ``prune`` chooses rows by) is sealed with the storage
key at the row's revision. Set back by someone with the database and without
the key, the scope no longer verifies (``InvalidRecordAuthenticationTag``, the
check every load makes) and ``prune`` refuses to act on it; a journal from
before the seals migrates (each scope's rows checked against its head first)
and verifies; after a key rotation, ``reseal`` seals the times again so the
old key can be retired.
"""

from __future__ import annotations

import pytest

from octo_common.errors import InvalidRecordAuthenticationTag
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Succeeded
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.storage import postgres_rekey
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.sqlite_rows import SCHEMA_VERSION as SQLITE_SCHEMA_VERSION
from octo_worker.store import WorkerCommit

from .journal_backends import JournalDatabase

SCOPE = "tenant-written"
FP = "ab" * 32
RING = StorageKeyring("k1", bytes([7]) * 32)


async def _written(store: JournalStoreBase, *keys: str) -> None:
    lease = await store.reserve_fence(SCOPE)
    done = Succeeded(ToolPayload.json({"ok": 1}))
    for key in keys:
        row = JournalRowChange(WorkerOperationRecord("files.publish", key, FP, done, None), None)
        changes = JournalChangeset(SCOPE, {key: row})
        await store.commit(SCOPE, lease, WorkerCommit(journal=changes))


async def _verified(journal_db: JournalDatabase, ring: StorageKeyring = RING) -> None:
    store = journal_db.store(ring, read_only=True)
    try:
        await store.verify_scope(SCOPE)
    finally:
        await store.close()


async def test_a_write_time_set_back_fails_verify_and_prune(journal_db: JournalDatabase) -> None:
    store = journal_db.store(RING)
    try:
        await _written(store, "op-a", "op-b")
    finally:
        await store.close()
    await _verified(journal_db)
    item = await journal_db.journal_item(SCOPE, "op-a")
    await journal_db.sql("UPDATE items SET written_at = 0 WHERE item = ?", item)
    with pytest.raises(InvalidRecordAuthenticationTag):
        await _verified(journal_db)
    maintenance = journal_db.store(RING, maintenance=True)
    try:
        with pytest.raises(InvalidRecordAuthenticationTag):
            await maintenance.prune(SCOPE, 3600)
    finally:
        await maintenance.close()
    # Nothing was pruned: the row still holds its outcome.
    reader = journal_db.store(RING, read_only=True)
    try:
        records = {record.operation_key for record, _ in await reader.list_records(SCOPE)}
        assert records == {"op-a", "op-b"}
    finally:
        await reader.close()


async def test_a_journal_from_before_the_seals_migrates_and_verifies(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(RING)
    try:
        await _written(store, "op-a", "op-b")
    finally:
        await store.close()
    newest = postgres_rekey.SCHEMA_VERSION if journal_db.postgres else SQLITE_SCHEMA_VERSION
    assert await journal_db.schema_version() == newest
    # Back to the schema before the seals: no written_tag column.
    await journal_db.sql("ALTER TABLE items DROP COLUMN written_tag")
    await journal_db.set_schema_version(newest - 1)
    migrated = journal_db.store(RING)
    try:
        await migrated.reserve_fence(SCOPE)  # opened: migrated
        assert await journal_db.schema_version() == newest
        assert await migrated.verify_store() == 1
        await migrated.verify_scope(SCOPE)
        await _written(migrated, "op-c")  # and commits on
    finally:
        await migrated.close()
    await _verified(journal_db)
    tags = await journal_db.sql(
        "SELECT written_tag FROM items WHERE namespace = 'worker-journal' AND name = ?", SCOPE
    )
    assert len(tags) == 3 and all(str(tag).startswith("k1:") for (tag,) in tags)


async def test_reseal_seals_the_write_times_again_so_the_old_key_can_go(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(RING)
    try:
        await _written(store, "op-a")
    finally:
        await store.close()
    rotated = StorageKeyring("k1", bytes([7]) * 32)
    rotated.rotate_to("k2", bytes([8]) * 32)
    writer = journal_db.store(rotated)  # a writable open rekeys the journal items
    try:
        await writer.reserve_fence(SCOPE)
    finally:
        await writer.close()
    maintenance = journal_db.store(rotated, maintenance=True)
    try:
        await maintenance.reseal(SCOPE)
    finally:
        await maintenance.close()
    only_new = StorageKeyring("k2", bytes([8]) * 32)
    await _verified(journal_db, only_new)
