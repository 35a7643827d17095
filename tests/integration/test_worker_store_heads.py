"""The journal's sealed scope heads on real databases.

Every commit, prune and reseal keeps each scope's digest equal to its rows
(checked by recomputing it, ``verify_scope``), and a head edited without
the key is refused: on both backends (``journal_db``). Inherently SQLite
(``db_path``): a journal from before the digests migrates forward with them
built once under the storage key, and one edited back to the older schema
behind its anchor's back is refused (the PostgreSQL journal had digests
from its first schema and keeps no anchor file).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from octo_common.errors import (
    InvalidRecordAuthenticationTag,
    OperationPruned,
    RollbackDetected,
    StorageBackendError,
    UnknownKeyId,
    WriteConflict,
)
from octo_common.records import StorageKeyring
from octo_common.runtime.anchorfile import read_anchor, write_anchor
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.journal_items import JournalItems
from octo_worker.storage.scope_head import DIGEST_ANCHOR_KEY, STORE_HEAD_ANCHOR_KEY
from octo_worker.storage.sqlite_rows import SCHEMA_VERSION
from octo_worker.store import SessionDocuments, SqliteJournalStore, WorkerCommit

from .journal_backends import JournalDatabase
from .test_worker_store import (
    OTHER_SCOPE,
    SCOPE,
    drop_head_digests,
    opening_doc,
    outbox,
    pending,
    rows,
    sql,
    state_doc,
    storage_keyring,
    succeeded,
)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "journal" / "worker.db"


async def fill(store: JournalStoreBase) -> None:
    """Journal, session and outbox rows in two scopes, some of them rewritten or deleted."""
    lease = await store.reserve_fence(SCOPE)
    other = await store.reserve_fence(OTHER_SCOPE)
    opening = SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"))
    reply = outbox("sess-1", b"reply one")
    await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            rows(SCOPE, (pending("op-1"), None), (pending("op-2"), None)).journal,
            {"sess-1": opening},
            [reply, outbox("sess-1", b"reply two")],
        ),
    )
    step = SessionDocuments(state_doc(SCOPE, "sess-1", counter=1), base_revision=1)
    await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            rows(SCOPE, (succeeded("op-1"), 1)).journal,
            {"sess-1": step},
            outbox_delete=[reply.message_id],
        ),
    )
    await store.commit(OTHER_SCOPE, other, rows(OTHER_SCOPE, (pending("op-1"), None)))


async def verified(store: JournalStoreBase, scope: str = SCOPE) -> tuple[int, int]:
    check = await store.verify_scope(scope)
    assert check.digests
    return check.revision, check.rows


async def test_every_commit_keeps_the_digest_equal_to_the_rows(journal_db: JournalDatabase) -> None:
    store = journal_db.store(storage_keyring())
    try:
        await fill(store)
        # op-1, op-2, the session's two rows, one outbox row left.
        assert await verified(store) == (2, 5)
        assert await verified(store, OTHER_SCOPE) == (1, 1)
        lease = await store.reserve_fence(SCOPE)
        # A group commit where some change sets are refused: only the others move it.
        outcomes = await asyncio.gather(
            *(
                store.commit(SCOPE, lease, rows(SCOPE, (pending(f"op-{i % 6}"), None)))
                for i in range(12)
            ),
            return_exceptions=True,
        )
        assert sum(isinstance(o, WriteConflict) for o in outcomes) == 8  # op-1..op-5 exist twice
        assert await verified(store) == (6, 9)
    finally:
        await store.close()
    # A fresh store, in a fresh read snapshot, recomputes the same.
    reopened = journal_db.store(storage_keyring(), read_only=True)
    try:
        assert await verified(reopened) == (6, 9)
    finally:
        await reopened.close()


async def test_prune_beside_a_running_writer_keeps_the_digest_right(
    journal_db: JournalDatabase,
) -> None:
    daemon = journal_db.store(storage_keyring())
    try:
        await fill(daemon)
        lease = await daemon.reserve_fence(SCOPE)
        await journal_db.age_rows(7200)
        maintenance = journal_db.store(storage_keyring(), maintenance=True)
        try:
            report = await maintenance.prune(SCOPE, 3600)
        finally:
            await maintenance.close()
        assert (report.removed, report.kept) == (1, 1)  # op-1 succeeded; op-2 pending
        # The pruned row stays, at its revision: neither head nor digest moved.
        assert await verified(daemon) == (2, 5)
        with pytest.raises(OperationPruned):
            await daemon.load_records(SCOPE, ["op-1"])
        await daemon.commit(SCOPE, lease, rows(SCOPE, (pending("op-3"), None)))
        assert await verified(daemon) == (3, 6)
        await daemon.reserve_fence(SCOPE)
    finally:
        await daemon.close()


async def test_reseal_moves_the_head_onto_the_active_key_so_the_old_one_can_go(
    journal_db: JournalDatabase,
) -> None:
    old = storage_keyring("storage-v1", 1)
    store = journal_db.store(old)
    try:
        await fill(store)
    finally:
        await store.close()
    rotated = StorageKeyring("storage-v2", bytes([2]) * 32)
    rotated.add_read_key("storage-v1", bytes([1]) * 32)
    # The worker's start under the rotated keyring rewrites the journal rows'
    # items (keyed hashes) under the new key; reseal does the rest beside it.
    started = journal_db.store(rotated)
    try:
        await started.scopes()
    finally:
        await started.close()
    maintenance = journal_db.store(rotated, maintenance=True)
    try:
        for scope in (SCOPE, OTHER_SCOPE):
            await maintenance.reseal(scope)
    finally:
        await maintenance.close()
    (key_ids,) = zip(*await journal_db.sql("SELECT DISTINCT key_id FROM heads"), strict=True)
    assert key_ids == ("storage-v2",)

    retired = journal_db.store(StorageKeyring("storage-v2", bytes([2]) * 32))
    try:
        assert await verified(retired) == (2, 5)
        await retired.reserve_fence(SCOPE)
        assert (await retired.load_records(SCOPE, ["op-1"]))["op-1"] == (succeeded("op-1"), 2)
    finally:
        await retired.close()
    stale = journal_db.store(storage_keyring("storage-v1", 1))
    try:
        with pytest.raises(UnknownKeyId):
            await stale.verify_scope(SCOPE)
    finally:
        await stale.close()


async def test_a_head_edited_without_the_key_is_refused(journal_db: JournalDatabase) -> None:
    store = journal_db.store(storage_keyring())
    try:
        await fill(store)
        await journal_db.sql("UPDATE heads SET fence = fence + 5 WHERE name = ?", SCOPE)
        with pytest.raises(InvalidRecordAuthenticationTag):
            await store.reserve_fence(SCOPE)
        with pytest.raises(InvalidRecordAuthenticationTag):
            await store.verify_scope(SCOPE)
        # No digest (SQLite), or one of the wrong size (PostgreSQL's column is NOT NULL).
        broken = b"\x00" if journal_db.postgres else None
        await journal_db.sql("UPDATE heads SET digest = ? WHERE name = ?", broken, OTHER_SCOPE)
        with pytest.raises(StorageBackendError):
            await store.reserve_fence(OTHER_SCOPE)
    finally:
        await store.close()


def back_to_schema_4(path: Path) -> None:
    with sqlite3.connect(path) as connection:
        drop_head_digests(connection)
        connection.execute("UPDATE schema_version SET version = 4")


async def test_a_journal_from_before_the_digests_migrates_forward_once(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    anchor.write_bytes(b'{"format_version":1,"records":[]}')
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        await fill(store)
    finally:
        await store.close()
    back_to_schema_4(db_path)
    # The anchor an older octo-worker wrote: head revisions only.
    write_anchor(
        anchor,
        {
            key: rev
            for key, rev in read_anchor(anchor).items()
            if key not in (DIGEST_ANCHOR_KEY, STORE_HEAD_ANCHOR_KEY)
        },
    )

    inspector = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor, read_only=True)
    try:
        check = await inspector.verify_scope(SCOPE)  # read as it is: no digest yet
        assert (check.revision, check.rows, check.digests) == (2, 5, False)
    finally:
        await inspector.close()

    upgraded = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        lease = await upgraded.reserve_fence(SCOPE)
        assert await verified(upgraded) == (2, 5)
        assert await verified(upgraded, OTHER_SCOPE) == (1, 1)
        await upgraded.commit(SCOPE, lease, rows(SCOPE, (pending("op-3"), None)))
        assert await verified(upgraded) == (3, 6)
    finally:
        await upgraded.close()
    assert sql(db_path, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    assert read_anchor(anchor)[DIGEST_ANCHOR_KEY] == 5

    # The digests built by the migration are the ones every load checks.
    op_2 = JournalItems(storage_keyring()).item(SCOPE, "op-2")
    sql(db_path, "DELETE FROM items WHERE name = ? AND item = ?", (SCOPE, op_2))
    tampered = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        with pytest.raises(RollbackDetected):
            await tampered.reserve_fence(SCOPE)
    finally:
        await tampered.close()


async def test_a_journal_edited_back_to_the_older_schema_is_refused_by_its_anchor(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    anchor.write_bytes(b'{"format_version":1,"records":[]}')
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        await fill(store)
    finally:
        await store.close()
    # Digests dropped and the schema version put back, so that a migration
    # would rebuild them from the rows as they are, one of them deleted.
    back_to_schema_4(db_path)
    op_2 = JournalItems(storage_keyring()).item(SCOPE, "op-2")
    sql(db_path, "DELETE FROM items WHERE name = ? AND item = ?", (SCOPE, op_2))

    for read_only in (False, True):
        reopened = SqliteJournalStore(
            db_path, storage_keyring(), anchor_path=anchor, read_only=read_only
        )
        try:
            with pytest.raises(RollbackDetected) as older:
                await reopened.scopes()
        finally:
            await reopened.close()
        assert (older.value.record_revision, older.value.revision_floor) == (4, 5)
    assert sql(db_path, "SELECT version FROM schema_version") == [(4,)]  # nothing migrated
