"""A session's retained request ids as rows of their own, on both journal backends.

The state document of a session has a fixed size (its retained request ids
are a count and a completion bitmap); each retained id is one request row,
inserted by the commit that first carries it and never rewritten. So the
bytes a commit writes do not grow with the ids a session retains; a
restored session equals the one that wrote it; a request row deleted,
copied elsewhere or outlived by a state put back fails closed; a state
document written before the rows existed (format 1, ids inline) still loads
and its session's next commit writes the rows; both schemas migrate forward.
Every session here is a real ``WorkerSession`` on a real store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from octo_common.authorizer import AuthorizerState, RetainedRequestId
from octo_common.codec import encode_struct
from octo_common.errors import RecordLocationMismatch, RollbackDetected
from octo_common.messages import OperationResult
from octo_common.records import StorageKeyring
from octo_worker.session.session import WorkerSession
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.documents import (
    NS_SESSION,
    NS_SESSION_REQUEST,
    AuthenticatorDocument,
    ReconciliationDocument,
    StateDocument,
    read_session,
    request_item,
)
from octo_worker.store import SessionDocuments, WorkerCommit, WorkerJournalLease

from .journal_backends import JournalDatabase
from .test_session_concurrency import (
    SCOPE,
    CountingAdapter,
    Delivery,
    dispatch,
    open_session,
    registry,
)
from .test_session_concurrency import restored_session as restore

T = TypeVar("T")
KEYRING = StorageKeyring("k1", bytes(32))
SESSION = "session-1"


async def written_by(journal_db: JournalDatabase, after: int) -> int:
    """Bytes of the envelopes the commits after revision ``after`` wrote (and left)."""
    ((total,),) = await journal_db.sql(
        "SELECT COALESCE(SUM(LENGTH(envelope)), 0) FROM items WHERE revision > ?", after
    )
    return int(total)


def same_state(one: WorkerSession, other: WorkerSession) -> bool:
    return bool(
        one._state.authorizer.export_state() == other._state.authorizer.export_state()
        and one._state.authenticator.export_state() == other._state.authenticator.export_state()
        and one.status == other.status
    )


async def serve(store: JournalStoreBase, lease: WorkerJournalLease, count: int) -> Any:
    """A session that dispatched ``count`` operations (every result validated)."""
    session, host = await open_session(store, lease, registry(CountingAdapter()), 1024, 1)
    answers: list[Any] = []
    for n in range(count):
        await session.handle(dispatch(host, n), store, Delivery(host, answers))
    assert len(answers) == count and all(isinstance(a, OperationResult) for a in answers)
    return session, host


async def test_bytes_written_per_commit_do_not_grow_with_the_retained_ids(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(KEYRING)
    try:
        lease = await store.reserve_fence(SCOPE)
        session, host = await serve(store, lease, 10)
        answers: list[Any] = []

        async def one_handling(n: int) -> int:
            before = await store.head_revision(SCOPE)
            await session.handle(dispatch(host, n), store, Delivery(host, answers))
            assert await store.head_revision(SCOPE) == before + 2  # admission, observation
            return await written_by(journal_db, before)

        early = await one_handling(100)  # the 11th retained id
        # Up to 1,023 retained ids, in concurrent batches (they share commits).
        for start in range(200, 1212, 64):
            batch = range(start, min(start + 64, 1212))
            await asyncio.gather(
                *(session.handle(dispatch(host, n), store, Delivery(host, answers)) for n in batch)
            )
        assert session._state.authorizer.request_id_count() == 1023
        late = await one_handling(5000)  # the 1,024th
        # Same shape of work, 93 times as many retained ids: the same bytes,
        # up to the longer request id, operation key and payload (a few
        # digits each, sealed and encrypted as they are). A state document
        # holding the ids would have grown by tens of kilobytes.
        assert early > 0
        assert abs(late - early) <= 64, (early, late)
        persisted = (await store.load_sessions(SCOPE))[SESSION]
        assert len(persisted.requests) == 1024
        assert len(persisted.state) < 2048
        assert same_state(await restore(store, lease), session)
    finally:
        await store.close()


async def test_a_restored_session_equals_the_one_that_wrote_it(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(KEYRING)
    try:
        lease = await store.reserve_fence(SCOPE)
        session, host = await serve(store, lease, 5)
        restored = await restore(store, lease)
        assert same_state(restored, session)
        assert [r.completed for r in restored._state.authorizer.export_state().request_ids] == [
            True
        ] * 5
        # It goes on from there: the next commit adds one row, the rest stay.
        answers: list[Any] = []
        await restored.handle(dispatch(host, 5), store, Delivery(host, answers))
        assert isinstance(answers[0], OperationResult)
        rows = await journal_db.sql(
            "SELECT item FROM items WHERE namespace = ?", NS_SESSION_REQUEST
        )
        assert sorted(str(item) for (item,) in rows) == [
            request_item(SESSION, f"d-{n}") for n in range(6)
        ]
        assert same_state(await restore(store, lease), restored)
    finally:
        await store.close()


async def written(
    journal_db: JournalDatabase,
    body: Callable[[JournalStoreBase, WorkerJournalLease], Awaitable[T]],
) -> T:
    """``body`` run on a store of ``journal_db`` under a fresh lease; the store closed."""
    store = journal_db.store(KEYRING)
    try:
        return await body(store, await store.reserve_fence(SCOPE))
    finally:
        await store.close()


async def check_refused(journal_db: JournalDatabase, load_error: type[Exception]) -> None:
    """No lease on the tampered scope (its rows are not its head's), and reading its
    sessions back, as a restore does, fails with ``load_error``."""
    tampered = journal_db.store(KEYRING)
    try:
        with pytest.raises(RollbackDetected):
            await tampered.reserve_fence(SCOPE)
        with pytest.raises(load_error):
            for persisted in (await tampered.load_sessions(SCOPE)).values():
                read_session(persisted, SCOPE)
    finally:
        await tampered.close()


async def test_a_deleted_request_row_fails_closed(journal_db: JournalDatabase) -> None:
    await written(journal_db, lambda store, lease: serve(store, lease, 3))
    await journal_db.sql("DELETE FROM items WHERE item = ?", request_item(SESSION, "d-1"))
    await check_refused(journal_db, RollbackDetected)  # the state counts 3, 2 are left


async def test_a_request_row_copied_to_another_session_fails_closed(
    journal_db: JournalDatabase,
) -> None:
    async def two_sessions(store: JournalStoreBase, lease: WorkerJournalLease) -> None:
        await serve(store, lease, 2)
        await open_session(store, lease, registry(CountingAdapter()), 10, 2)

    await written(journal_db, two_sessions)
    # Session-2 "retains" d-0 too: its row copied in under session-2's item.
    copy = request_item("session-2", "d-0")
    await journal_db.copy_row(request_item(SESSION, "d-0"), SCOPE, to_scope=SCOPE, to_item=copy)
    await journal_db.sql("UPDATE items SET session = ? WHERE item = ?", "session-2", copy)
    await check_refused(journal_db, RecordLocationMismatch)  # its document names session-1


async def test_a_state_put_back_behind_its_request_rows_fails_closed(
    journal_db: JournalDatabase,
) -> None:
    async def two_then_one(store: JournalStoreBase, lease: WorkerJournalLease) -> Any:
        session, host = await serve(store, lease, 2)
        (old,) = await journal_db.sql(
            "SELECT revision, envelope FROM items WHERE namespace = ? AND item = ?",
            NS_SESSION,
            SESSION,
        )
        await session.handle(dispatch(host, 2), store, Delivery(host, []))
        return old

    old_revision, old_envelope = await written(journal_db, two_then_one)
    # The state row as it was one request ago (a sealed row of its own).
    await journal_db.sql(
        "UPDATE items SET revision = ?, envelope = ? WHERE namespace = ? AND item = ?",
        old_revision,
        old_envelope,
        NS_SESSION,
        SESSION,
    )
    await check_refused(journal_db, RollbackDetected)  # a request row it does not count


async def test_a_format_1_state_loads_and_its_next_commit_writes_the_rows(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(KEYRING)
    try:
        lease = await store.reserve_fence(SCOPE)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        window = session._state.authenticator.export_state()
        # What an octo-worker from before the request rows wrote: every
        # retained id inline (here two, retained by lookups: no budget spent).
        inline = (RetainedRequestId("r-old-1", True), RetainedRequestId("r-old-2", False))
        state = StateDocument(
            format_version=1,
            scope=SCOPE,
            session_id=SESSION,
            status="open",
            authenticator=AuthenticatorDocument(
                window.next_outgoing, window.inbound_highest, f"{window.inbound_seen:0256x}"
            ),
            authorizer=AuthorizerState({}, {}, (), inline),
            reconciliations=ReconciliationDocument(0, {}),
        )
        revision = session._commits.state_revision
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                sessions={SESSION: SessionDocuments(encode_struct(state), base_revision=revision)}
            ),
        )
        await store.close()
        store = journal_db.store(KEYRING)
        lease = await store.reserve_fence(SCOPE)
        restored = await restore(store, lease)
        assert restored._state.authorizer.export_state().request_ids == inline
        assert (
            await journal_db.sql("SELECT item FROM items WHERE namespace = ?", NS_SESSION_REQUEST)
            == []
        )
        answers: list[Any] = []
        await restored.handle(dispatch(host, 0), store, Delivery(host, answers))
        assert isinstance(answers[0], OperationResult)
        # Its first commit wrote format 2 and a row for each id, old ones first.
        persisted = (await store.load_sessions(SCOPE))[SESSION]
        assert b'"format_version":2' in persisted.state
        assert len(persisted.requests) == 3
        again = await restore(store, lease)
        assert same_state(again, restored)
        assert [r.request_id for r in again._state.authorizer.export_state().request_ids] == [
            "r-old-1",
            "r-old-2",
            "d-0",
        ]
    finally:
        await store.close()


async def test_the_schema_migrates_forward_to_the_request_rows_index(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(KEYRING)
    try:
        lease = await store.reserve_fence(SCOPE)
        await serve(store, lease, 2)
        current = await journal_db.schema_version()
    finally:
        await store.close()
    assert current == (5 if journal_db.postgres else 9)
    # Back to before the request rows index (the migrations after it run again:
    # the store head is built anew, and the keyed journal items' finds every
    # item keyed already and rewrites nothing).
    await journal_db.sql("DROP TABLE store_head")
    await journal_db.sql("DROP INDEX items_request_sessions")
    await journal_db.set_schema_version(current - 4)
    reopened = journal_db.store(KEYRING)
    try:
        lease = await reopened.reserve_fence(SCOPE)
        assert len((await reopened.load_sessions(SCOPE))[SESSION].requests) == 2
    finally:
        await reopened.close()
    assert await journal_db.schema_version() == current
    if journal_db.postgres:
        found = await journal_db.sql(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() "
            "AND indexname = ?",
            "items_request_sessions",
        )
    else:
        found = await journal_db.sql(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND name = ?",
            "items_request_sessions",
        )
    assert len(found) == 1


async def test_a_commit_that_fails_before_it_is_submitted_leaves_its_rows_to_the_next(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(KEYRING)
    try:
        lease = await store.reserve_fence(SCOPE)
        session, host = await serve(store, lease, 3)
        commits = session._commits
        build = commits.state_document
        failing = [True]

        def fails_once(point: Any) -> bytes:
            if failing:
                failing.clear()
                raise RuntimeError("the state document could not be built")
            return bytes(build(point))

        commits.state_document = fails_once  # type: ignore[method-assign]
        answers: list[Any] = []
        # The handling fails inside the session (logged as session_handle_failed).
        await session.handle(dispatch(host, 3), store, Delivery(host, answers))
        assert not failing, "the failing build was not reached"
        # Whatever the session does next (a poisoned session's commit, or the
        # next handling), the rows of every id its state counts are written:
        # the session restores, no request row missing.
        if session.status == "open":
            await session.handle(dispatch(host, 4), store, Delivery(host, answers))
        restored = await restore(store, lease)
        counted = restored._state.authorizer.request_id_count()
        rows = await journal_db.sql(
            "SELECT item FROM items WHERE namespace = ?", NS_SESSION_REQUEST
        )
        assert len(rows) == counted >= 3
    finally:
        await store.close()
