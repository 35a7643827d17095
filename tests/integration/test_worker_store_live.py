"""A loaded scope's rows edited beside the store that serves it: refused when read or replaced.

The store that reserved a scope's fence keeps the loaded scope's live index
(``row_index``): a row a decision reads must be the one the sealed head
committed to, and a commit must replace exactly what the index holds. On
both backends (``journal_db``), with the store open the whole time, as a
running daemon's is.
"""

from __future__ import annotations

import pytest

from octo_common.errors import RollbackDetected
from octo_worker.storage.interface import RequestRow
from octo_worker.store import SessionDocuments, WorkerCommit

from .journal_backends import JournalDatabase
from .test_worker_store import (
    SCOPE,
    opening_doc,
    outbox,
    pending,
    rows,
    state_doc,
    storage_keyring,
    succeeded,
)


async def test_a_deleted_row_is_refused_when_read_and_when_written_again(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
        op_1 = await journal_db.journal_item(SCOPE, "op-1")
        await journal_db.sql("DELETE FROM items WHERE item = ?", op_1)
        with pytest.raises(RollbackDetected):
            await store.load_records(SCOPE, ["op-1"])
        # Written again as new, as an admission that did not look would.
        with pytest.raises(RollbackDetected):
            await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        assert await journal_db.sql("SELECT item FROM items WHERE item = ?", op_1) == []
        # The other rows are the head's: read and written as before.
        (found,) = (await store.load_records(SCOPE, ["op-2"])).values()
        assert found is not None
        await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-2"), found[1])))
    finally:
        await store.close()


async def test_a_row_put_back_to_its_older_copy_is_refused_when_read_and_replaced(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        op_1 = await journal_db.journal_item(SCOPE, "op-1")
        ((old_revision, old_envelope),) = await journal_db.sql(
            "SELECT revision, envelope FROM items WHERE item = ?", op_1
        )
        await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), old_revision)))
        await journal_db.sql(
            "UPDATE items SET revision = ?, envelope = ? WHERE item = ?",
            old_revision,
            old_envelope,
            op_1,
        )
        with pytest.raises(RollbackDetected):
            await store.load_records(SCOPE, ["op-1"])
        # A writer that built on the older copy is refused too.
        with pytest.raises(RollbackDetected):
            await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), old_revision)))
    finally:
        await store.close()


async def test_a_deleted_request_row_is_refused_when_inserted_again(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        first = SessionDocuments(
            state_doc(SCOPE, "sess-1"),
            opening_doc(SCOPE, "sess-1"),
            requests=(RequestRow(0, "req-1"),),
        )
        await store.commit(SCOPE, lease, WorkerCommit(sessions={"sess-1": first}))
        await journal_db.sql("DELETE FROM items WHERE namespace = ?", "worker-session-request")
        # The same request id persisted again: its row was there, so it is reused.
        again = SessionDocuments(
            state_doc(SCOPE, "sess-1", counter=1),
            base_revision=1,
            requests=(RequestRow(0, "req-1"),),
        )
        with pytest.raises(RollbackDetected):
            await store.commit(SCOPE, lease, WorkerCommit(sessions={"sess-1": again}))
    finally:
        await store.close()


async def test_an_outbox_row_deleted_beside_the_store_is_refused_at_its_release(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        opening = SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"))
        kept, lost = outbox("sess-1", b"reply one"), outbox("sess-1", b"reply two")
        await store.commit(SCOPE, lease, WorkerCommit(sessions={"sess-1": opening}))
        await store.commit(SCOPE, lease, WorkerCommit(outbox_insert=[kept, lost]))
        await journal_db.sql("DELETE FROM items WHERE item = ?", lost.message_id)
        # Its release would delete nothing: the reply deleted beside the store
        # (never republished) is refused, and nothing of the commit is written.
        with pytest.raises(RollbackDetected):
            await store.commit(
                SCOPE, lease, WorkerCommit(outbox_delete=[kept.message_id, lost.message_id])
            )
        assert await journal_db.sql("SELECT item FROM items WHERE item = ?", kept.message_id)
        # A release of a row the scope never held, or one already released, is no edit.
        await store.commit(SCOPE, lease, WorkerCommit(outbox_delete=[kept.message_id]))
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(outbox_delete=[kept.message_id, outbox("sess-1", b"x").message_id]),
        )
    finally:
        await store.close()
