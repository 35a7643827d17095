"""The journal store's ``prune`` on both backends (`octo-worker journal prune`).

Only terminal rows (with no compensation, or a terminal one) older than the
cut-off go; pending and running rows stay whatever their age; the scope head
does not move. SQLite only (an inherently SQLite-file test): a database
from before the write-time column migrates.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Failed, Pending, Running, Succeeded
from octo_worker.journal import (
    JournalChangeset,
    JournalRowChange,
    WorkerCompensationRecord,
    WorkerOperationRecord,
)
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import SqliteJournalStore, WorkerCommit

from .journal_backends import JournalDatabase

SCOPE = "tenant-prune"
FP = "ab" * 32


def _record(key: str, state: object, compensation: object = None) -> WorkerOperationRecord:
    return WorkerOperationRecord("files.publish", key, FP, state, compensation)  # type: ignore[arg-type]


async def _write(store: JournalStoreBase, records: list[WorkerOperationRecord]) -> int:
    lease = await store.reserve_fence(SCOPE)
    rows = {r.operation_key: JournalRowChange(r, None) for r in records}
    return await store.commit(SCOPE, lease, WorkerCommit(journal=JournalChangeset(SCOPE, rows)))


async def test_prune_removes_only_old_terminal_rows(journal_db: JournalDatabase) -> None:
    store = journal_db.store(StorageKeyring("k1", bytes(32)))
    done = Succeeded(ToolPayload.json({"ok": 1}))
    open_compensation = WorkerCompensationRecord("cmp-a", FP, FP, Pending())
    closed_compensation = WorkerCompensationRecord("cmp-b", FP, FP, Succeeded(ToolPayload.json({})))
    await _write(
        store,
        [
            _record("op-pending", Pending()),
            _record("op-running", Running()),
            _record("op-succeeded", done),
            _record("op-failed", Failed("boom")),
            _record("op-compensating", done, open_compensation),
            _record("op-compensated", done, closed_compensation),
        ],
    )
    head = await store.head_revision(SCOPE)
    assert (await store.prune(SCOPE, 3600)).removed == 0  # nothing is old yet

    await journal_db.age_rows(7200)
    report = await store.prune(SCOPE, 3600)

    remaining = {record.operation_key for record, _ in await store.list_records(SCOPE)}
    assert remaining == {"op-pending", "op-running", "op-compensating"}
    assert report.removed == 3 and report.kept == 3
    assert await store.head_revision(SCOPE) == head
    await store.close()


async def test_a_database_without_write_times_migrates(tmp_path: Path) -> None:
    path = tmp_path / "journal.db"
    store = SqliteJournalStore(path, StorageKeyring("k1", bytes(32)))
    await _write(store, [_record("op-old", Failed("x"))])
    await store.close()
    # Take the database back to schema 1 (no written_at column, no closed mark,
    # no outbox session, no head digest).
    with sqlite3.connect(path) as connection:
        for column in ("row_count", "digest", "key_id", "auth_tag"):  # schema 5's head columns
            connection.execute(f"ALTER TABLE heads DROP COLUMN {column}")
        connection.execute("DROP TABLE IF EXISTS store_head")  # schema 7
        connection.execute("DROP INDEX IF EXISTS items_request_sessions")  # schema 6
        connection.execute("DROP INDEX items_outbox_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN session")
        connection.execute("DROP INDEX items_live_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN closed")
        connection.execute("ALTER TABLE items DROP COLUMN written_at")
        connection.execute("UPDATE schema_version SET version = 1")

    reopened = SqliteJournalStore(path, StorageKeyring("k1", bytes(32)))
    records = await reopened.list_records(SCOPE)
    assert [r.operation_key for r, _ in records] == ["op-old"]
    assert (await reopened.prune(SCOPE, 60)).removed == 0  # migrated rows count as new
    await reopened.close()
