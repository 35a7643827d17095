"""A read-only journal store (the operator's inspection verbs) writes nothing.

`octo-worker journal list|show|verify` and `check` run beside a live daemon:
they must not migrate the schema, create files, or rewrite the rollback
anchor the daemon replaces after each commit. Tests that take ``journal_db``
run on both backends; the others are inherently SQLite-file tests (the
anchor file, the database file's bytes and its WAL, SQLite schemas 1 and 2).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from octo_common.errors import StorageBackendError
from octo_common.records import StorageKeyring
from octo_common.states import Pending
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import SessionDocuments, SqliteJournalStore, WorkerCommit

from .journal_backends import JournalDatabase
from .test_worker_store import opening_doc, state_doc
from .test_worker_store_prune import SCOPE, _record, _write

RING = StorageKeyring("k1", bytes(32))


async def test_a_read_only_store_reads_and_refuses_every_write(journal_db: JournalDatabase) -> None:
    writer = journal_db.store(RING)
    await _write(writer, [_record("op-a", Pending())])
    await writer.close()
    rows = await journal_db.sql("SELECT namespace, name, item, revision, envelope FROM items")
    heads = await journal_db.sql("SELECT name, revision, fence FROM heads")

    reader = journal_db.store(RING, read_only=True)
    try:
        assert await reader.scopes() == [SCOPE]
        assert [r.operation_key for r, _ in await reader.list_records(SCOPE)] == ["op-a"]
        for write in (
            reader.reserve_fence(SCOPE),
            reader.prune(SCOPE, 0),
            reader.reseal(SCOPE),
            reader.mark_closed(SCOPE, ["s-1"]),
        ):
            with pytest.raises(StorageBackendError, match="read-only"):
                await write
    finally:
        await reader.close()
    assert (
        await journal_db.sql("SELECT namespace, name, item, revision, envelope FROM items") == rows
    )
    assert await journal_db.sql("SELECT name, revision, fence FROM heads") == heads


async def test_a_maintenance_store_rewrites_rows_but_never_a_head(
    journal_db: JournalDatabase,
) -> None:
    writer = journal_db.store(RING)
    await _write(writer, [_record("op-a", Pending())])
    lease = await writer.reserve_fence(SCOPE)
    await writer.close()
    heads = await journal_db.sql("SELECT name, revision, fence FROM heads")

    rotated = StorageKeyring("k2", bytes([9]) * 32)
    rotated.add_read_key("k1", bytes(32))
    maintenance = journal_db.store(rotated, maintenance=True)
    try:
        with pytest.raises(StorageBackendError, match="maintenance"):
            await maintenance.reserve_fence(SCOPE)
        with pytest.raises(StorageBackendError, match="maintenance"):
            await maintenance.commit(SCOPE, lease, WorkerCommit())
        assert (await maintenance.reseal(SCOPE)).resealed == 1
        assert (await maintenance.prune(SCOPE, 3600)).removed == 0
    finally:
        await maintenance.close()
    assert await journal_db.sql("SELECT name, revision, fence FROM heads") == heads
    assert all(b'"key_id":"k2"' in envelope for envelope in await journal_db.envelopes())


async def test_a_read_only_store_reads_and_never_writes(tmp_path: Path) -> None:
    path, anchor = tmp_path / "journal.db", tmp_path / "journal.anchor"
    store = SqliteJournalStore(path, RING, anchor_path=anchor)
    await store.initialize_anchor()
    await store.close()
    anchored = anchor.read_bytes()
    # The database moves on while the anchor file is behind (a daemon between
    # its commit and its anchor write): a read-only open must not rewrite it.
    writer = SqliteJournalStore(path, RING)
    await _write(writer, [_record("op-a", Pending())])
    await writer.close()
    database = path.read_bytes()

    reader = SqliteJournalStore(path, RING, anchor_path=anchor, read_only=True)
    try:
        assert await reader.scopes() == [SCOPE]
        assert [r.operation_key for r, _ in await reader.list_records(SCOPE)] == ["op-a"]
        with pytest.raises(StorageBackendError, match="read-only"):
            await reader.reserve_fence(SCOPE)
        with pytest.raises(StorageBackendError, match="read-only"):
            await reader.prune(SCOPE, 0)
        with pytest.raises(StorageBackendError, match="read-only"):
            await reader.reseal(SCOPE)
    finally:
        await reader.close()
    assert anchor.read_bytes() == anchored
    assert path.read_bytes() == database


async def test_a_read_only_store_refuses_what_it_would_have_to_create_or_migrate(
    tmp_path: Path,
) -> None:
    absent = SqliteJournalStore(tmp_path / "none" / "journal.db", RING, read_only=True)
    with pytest.raises(StorageBackendError, match="no journal database"):
        await absent.scopes()
    await absent.close()
    assert not (tmp_path / "none").exists()

    path = tmp_path / "journal.db"
    writer = SqliteJournalStore(path, RING)
    await _write(writer, [_record("op-a", Pending())])
    await writer.close()
    # A journal the daemon has not migrated yet (just after an upgrade) reads as it is.
    with sqlite3.connect(path) as connection:
        connection.execute("UPDATE schema_version SET version = 2")
    old = SqliteJournalStore(path, RING, read_only=True)
    try:
        assert [r.operation_key for r, _ in await old.list_records(SCOPE)] == ["op-a"]
    finally:
        await old.close()
    with sqlite3.connect(path) as connection:
        assert connection.execute("SELECT version FROM schema_version").fetchone() == (2,)
        connection.execute("UPDATE schema_version SET version = 99")
    newer = SqliteJournalStore(path, RING, read_only=True)
    with pytest.raises(StorageBackendError, match="schema version 99 is newer"):
        await newer.scopes()
    await newer.close()


KILLED_WRITER = """
import asyncio, os, sys
from octo_common.records import StorageKeyring
from octo_common.states import Pending
from octo_worker.store import SqliteJournalStore
from tests.integration.test_worker_store_prune import _record, _write

async def main():
    store = SqliteJournalStore(sys.argv[1], StorageKeyring("k1", bytes(32)))
    await _write(store, [_record("op-a", Pending())])
    os._exit(0)  # killed: the WAL is left behind, not checkpointed

asyncio.run(main())
"""


async def test_a_read_only_store_never_checkpoints_a_wal_left_by_a_killed_writer(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, str(path)],
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    wal = Path(f"{path}-wal")
    assert wal.stat().st_size > 0
    database, log = path.read_bytes(), wal.read_bytes()
    reader = SqliteJournalStore(path, RING, read_only=True)
    try:
        assert [r.operation_key for r, _ in await reader.list_records(SCOPE)] == ["op-a"]
    finally:
        await reader.close()  # the last connection: a writable one would checkpoint
    assert path.read_bytes() == database
    assert wal.read_bytes() == log


async def test_a_maintenance_store_changes_rows_but_never_the_anchor(tmp_path: Path) -> None:
    path, anchor = tmp_path / "journal.db", tmp_path / "journal.anchor"
    store = SqliteJournalStore(path, RING, anchor_path=anchor)
    await store.initialize_anchor()
    await store.close()
    anchored = anchor.read_bytes()
    writer = SqliteJournalStore(path, RING)  # the database moves ahead of the anchor
    await _write(writer, [_record("op-a", Pending())])
    await writer.close()

    rotated = StorageKeyring("k2", bytes([9]) * 32)
    rotated.add_read_key("k1", bytes(32))
    maintenance = SqliteJournalStore(path, rotated, anchor_path=anchor, maintenance=True)
    try:
        with pytest.raises(StorageBackendError, match="maintenance"):
            await maintenance.reserve_fence(SCOPE)
        assert (await maintenance.reseal(SCOPE)).resealed == 1
        assert (await maintenance.prune(SCOPE, 3600)).removed == 0
    finally:
        await maintenance.close()
    assert anchor.read_bytes() == anchored


async def _metadata_scenario(writer: JournalStoreBase) -> None:
    """Fence 4, journal rows op-a and op-b, one open and one closed session."""
    await _write(writer, [_record("op-a", Pending())])
    await writer.reserve_fence(SCOPE)  # a second owner: fence 2, then _write's 3rd below
    await _write(writer, [_record("op-b", Pending())])
    lease = await writer.reserve_fence(SCOPE)  # fence 4
    opened: dict[str, int] = {}
    for session_id in ("s-closed", "s-open"):
        documents = SessionDocuments(state_doc(SCOPE, session_id), opening_doc(SCOPE, session_id))
        changes = WorkerCommit(sessions={session_id: documents})
        opened[session_id] = await writer.commit(SCOPE, lease, changes)
    closing = SessionDocuments(state_doc(SCOPE, "s-closed", "closed", 3), None, opened["s-closed"])
    await writer.commit(SCOPE, lease, WorkerCommit(sessions={"s-closed": closing}))
    await writer.close()


async def test_scope_metadata_reads_the_fence_and_write_times(journal_db: JournalDatabase) -> None:
    await _metadata_scenario(journal_db.store(RING))
    op_a = await journal_db.journal_item(SCOPE, "op-a")
    op_b = await journal_db.journal_item(SCOPE, "op-b")
    await journal_db.sql("UPDATE items SET written_at = 1000.0 WHERE item = ?", op_a)
    rows = await journal_db.sql("SELECT item, revision, envelope, written_at FROM items")

    reader = journal_db.store(RING, read_only=True)
    try:
        metadata = await reader.scope_metadata(SCOPE)
        assert metadata.fence == 4
        assert metadata.written_at[op_a] == 1000.0
        assert metadata.written(reader.journal_items(SCOPE, "op-a")) == 1000.0
        assert set(metadata.written_at) == {op_a, op_b}
        assert metadata.closed_sessions == 1
        assert (await reader.scope_metadata("tenant-none")).fence == 0
    finally:
        await reader.close()
    assert await journal_db.sql("SELECT item, revision, envelope, written_at FROM items") == rows


async def test_scope_metadata_reads_a_schema_1_journal_without_its_later_columns(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.db"
    await _metadata_scenario(SqliteJournalStore(path, RING))
    database = path.read_bytes()
    reader = SqliteJournalStore(path, RING, read_only=True)
    try:
        assert (await reader.scope_metadata(SCOPE)).fence == 4
    finally:
        await reader.close()
    assert path.read_bytes() == database

    # A schema-1 journal (no written_at, no closed mark) reads without them.
    with sqlite3.connect(path) as connection:
        connection.execute("DROP INDEX items_live_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN closed")
        connection.execute("ALTER TABLE items DROP COLUMN written_at")
        connection.execute("UPDATE schema_version SET version = 1")
    old = SqliteJournalStore(path, RING, read_only=True)
    try:
        metadata = await old.scope_metadata(SCOPE)
        assert metadata == (4, {}, 0)
    finally:
        await old.close()
