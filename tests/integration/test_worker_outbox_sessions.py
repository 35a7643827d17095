"""One session's outbox rows, found without reading the scope's whole outbox.

Both backends (``journal_db``); the schema-4 migration tests are
inherently SQLite-file tests. Rows read are counted with the store's own
counter (``StoreStats.rows_opened``: rows loaded, authenticated and
decrypted), never timed.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from octo_common.errors import OctoError, RecordLocationMismatch
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.sqlite_rows import SCHEMA_VERSION
from octo_worker.store import SqliteJournalStore, WorkerCommit

from .journal_backends import JournalDatabase
from .test_worker_store import SCOPE, data_keyring, outbox, sql, storage_keyring


def frame(session: int, number: int) -> bytes:
    return f'{{"session":{session},"frame":{number}}}'.encode()


async def fill(store: JournalStoreBase, sessions: int, per_session: int) -> None:
    lease = await store.reserve_fence(SCOPE)
    for number in range(per_session):
        entries = [outbox(f"s-{session}", frame(session, number)) for session in range(sessions)]
        await store.commit(SCOPE, lease, WorkerCommit(outbox_insert=entries))


def to_schema_3(path: Path) -> None:
    """The database as schema 3 left it: no session column, no outbox index (and no
    scope head digests, which schema 5 added)."""
    with sqlite3.connect(path) as connection:
        for column in ("row_count", "digest", "key_id", "auth_tag"):
            connection.execute(f"ALTER TABLE heads DROP COLUMN {column}")
        connection.execute("DROP TABLE IF EXISTS store_head")  # schema 7
        connection.execute("DROP INDEX IF EXISTS items_request_sessions")  # schema 6
        connection.execute("DROP INDEX items_outbox_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN session")
        connection.execute("UPDATE schema_version SET version = 3")


@pytest.mark.parametrize("encrypted", [False, True], ids=["sealed", "encrypted"])
async def test_one_sessions_rows_are_read_alone_whatever_the_outbox_holds(
    journal_db: JournalDatabase, encrypted: bool
) -> None:
    store = journal_db.store(storage_keyring(), data_keyring=data_keyring() if encrypted else None)
    try:
        await fill(store, sessions=60, per_session=3)
        before = store.stats.rows_opened
        mine = await store.load_outbox(SCOPE, session_id="s-7")
        assert store.stats.rows_opened - before == 3  # its own rows, not the 180
        assert [entry.frame for entry in mine] == [frame(7, n) for n in range(3)]
        assert all(entry.session_id == "s-7" for entry in mine)
        revisions = [entry.revision for entry in mine]
        assert revisions == sorted(revisions)  # oldest first, as the whole outbox
        assert await store.load_outbox(SCOPE, session_id="s-none") == []
        assert store.stats.rows_opened - before == 3
        # The whole outbox is still every row (start-up republish).
        assert len(await store.load_outbox(SCOPE)) == 180
    finally:
        await store.close()


async def test_a_rows_session_column_edited_behind_the_store_is_refused(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        await fill(store, sessions=2, per_session=1)
        # The column is metadata: the authenticated document says whose row it is.
        await journal_db.set_outbox_session("s-1", "s-0")
        with pytest.raises(RecordLocationMismatch):
            await store.load_outbox(SCOPE, session_id="s-0")
        assert await store.load_outbox(SCOPE, session_id="s-1") == []
    finally:
        await store.close()


async def test_rows_written_before_schema_4_get_their_session_at_the_next_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "worker.db"
    store = SqliteJournalStore(path, storage_keyring(), data_keyring=data_keyring())
    await fill(store, sessions=4, per_session=2)
    await store.close()
    to_schema_3(path)
    # One row no longer authenticates: it is left unfilled, and the whole
    # outbox (what a start reads) still fails on it, as before the migration.
    (bad_id,) = sql(path, "SELECT id FROM items WHERE namespace = 'worker-outbox' LIMIT 1")[0]
    sql(path, "UPDATE items SET envelope = X'00' WHERE id = ?", (bad_id,))

    reopened = SqliteJournalStore(path, storage_keyring(), data_keyring=data_keyring())
    try:
        await reopened.head_revision(SCOPE)  # opens: migrates, fills the sessions in
        assert sql(path, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
        filled = sql(
            path,
            "SELECT session, COUNT(*) FROM items WHERE namespace = 'worker-outbox' "
            "GROUP BY session ORDER BY session",
        )
        assert filled == [(None, 1), ("s-0", 1), ("s-1", 2), ("s-2", 2), ("s-3", 2)]
        assert len(await reopened.load_outbox(SCOPE, session_id="s-2")) == 2
        with pytest.raises(OctoError):
            await reopened.load_outbox(SCOPE)
        # Rows written from now on carry their session.
        lease = await reopened.reserve_fence(SCOPE)
        await reopened.commit(SCOPE, lease, WorkerCommit(outbox_insert=[outbox("s-9", b"{}")]))
        assert [e.session_id for e in await reopened.load_outbox(SCOPE, session_id="s-9")] == [
            "s-9"
        ]
    finally:
        await reopened.close()


async def test_a_read_only_store_on_schema_3_finds_one_sessions_rows_all_the_same(
    tmp_path: Path,
) -> None:
    path = tmp_path / "worker.db"
    store = SqliteJournalStore(path, storage_keyring())
    await fill(store, sessions=3, per_session=2)
    await store.close()
    to_schema_3(path)
    inspector = SqliteJournalStore(path, storage_keyring(), read_only=True)
    try:
        mine = await inspector.load_outbox(SCOPE, session_id="s-1")
        assert [entry.frame for entry in mine] == [frame(1, 0), frame(1, 1)]
        assert sql(path, "SELECT version FROM schema_version") == [(3,)]  # never migrated
    finally:
        await inspector.close()
