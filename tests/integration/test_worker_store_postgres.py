"""The PostgreSQL journal store beyond the shared suite.

``test_worker_store.py`` and the other ``journal_db`` tests run every store
behaviour on PostgreSQL too; this module holds what only a shared server
has: several store objects (as several worker daemons) taking one scope
over from each other, a head lock held by a paused owner, the schema
migrated once by openers racing, a read-only store's session, the URL,
schema and password rules, and the loop binding. Every test works in a
schema of its own (``postgres_schema``), dropped afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from octo_common.errors import FencingTokenRejected, StorageBackendError, WriteConflict
from octo_common.records import StorageKeyring
from octo_common.states import Pending
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.storage import postgres as postgres_module
from octo_worker.storage import postgres_batch, postgres_rekey, postgres_sql
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
)
from octo_worker.storage.postgres import PostgresJournalStore
from octo_worker.store import WorkerCommit
from tests.postgres import PostgresSchema, errors_in_another_loop

SCOPE = "tenant-failover"


def ring() -> StorageKeyring:
    return StorageKeyring("k1", bytes([5]) * 32)


def store_in(place: PostgresSchema, **options: Any) -> PostgresJournalStore:
    return PostgresJournalStore(
        place.url,
        ring(),
        password_file=place.password_file,
        schema=place.schema,
        **options,
    )


def admission(key: str) -> WorkerCommit:
    record = WorkerOperationRecord("files.publish", key, "ab" * 32, Pending())
    return WorkerCommit(JournalChangeset(SCOPE, {key: JournalRowChange(record, None)}))


# One statement per group commit ----------------------------------------------------------


async def test_a_batch_that_all_commits_is_one_statement_and_a_refusal_runs_it_one_by_one(
    postgres_schema: PostgresSchema, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths: list[str] = []

    async def watched(*args: Any) -> None:
        try:
            await postgres_batch.write_batch(*args)
        except postgres_batch.SlowPath:
            paths.append("one by one")
            raise
        paths.append("one statement")

    monkeypatch.setattr(postgres_module, "write_batch", watched)
    store = store_in(postgres_schema)
    try:
        lease = await store.reserve_fence(SCOPE)
        first = await asyncio.gather(
            *(store.commit(SCOPE, lease, admission(f"op-{i}")) for i in range(8))
        )
        assert first == list(range(1, 9))  # submission order, every one committed
        assert paths and set(paths) == {"one statement"}
        paths.clear()

        later = [admission(f"op-{i}") for i in range(8, 15)]
        later.insert(3, admission("op-0"))  # already there: this one is refused
        outcomes = await asyncio.gather(
            *(store.commit(SCOPE, lease, change) for change in later), return_exceptions=True
        )
        assert isinstance(outcomes[3], WriteConflict)
        assert outcomes[:3] + outcomes[4:] == list(range(9, 16))
        assert "one by one" in paths
        loaded = await store.load_records(SCOPE, [f"op-{i}" for i in range(15)])
        assert [row[1] for row in map(loaded.__getitem__, (f"op-{i}" for i in range(15)))] == [
            *range(1, 16)
        ]
    finally:
        await store.close()


async def test_two_inserts_of_one_key_in_one_batch_commit_once(
    postgres_schema: PostgresSchema,
) -> None:
    store = store_in(postgres_schema)
    try:
        lease = await store.reserve_fence(SCOPE)
        # Submitted together, so they share a group commit: the second insert of
        # op-1 is not built on the first and must be refused, never merged.
        outcomes = await asyncio.gather(
            *(store.commit(SCOPE, lease, admission(key)) for key in ("op-1", "op-2", "op-1")),
            return_exceptions=True,
        )
        assert [type(outcome) for outcome in outcomes] == [int, int, WriteConflict], outcomes
        assert len(await store.list_records(SCOPE)) == 2
    finally:
        await store.close()


# Reads of concurrent admissions share a statement ---------------------------------------


async def test_concurrent_row_reads_share_one_statement_and_each_gets_its_own_rows(
    postgres_schema: PostgresSchema, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_in(postgres_schema)
    statements: list[list[str]] = []
    fetch = store._fetch_items

    async def counted(scope: str, namespace: str, items: list[str]) -> Any:
        statements.append(items)
        return await fetch(scope, namespace, items)

    try:
        lease = await store.reserve_fence(SCOPE)
        await asyncio.gather(*(store.commit(SCOPE, lease, admission(f"op-{i}")) for i in range(6)))
        monkeypatch.setattr(store._reads, "_fetch", counted)
        asked = [[f"op-{i}"] for i in range(12)] + [["op-1", "op-2", "op-absent"]]
        answers = await asyncio.gather(*(store.load_records(SCOPE, keys) for keys in asked))
        # One statement for all 13 callers, each answered for exactly its keys.
        at_rest = {store.journal_items(SCOPE, key)[0] for key in ("op-0", "op-11", "op-absent")}
        assert len(statements) == 1 and set(statements[0]) >= at_rest
        for keys, answer in zip(asked, answers, strict=True):
            assert list(answer) == keys
            for key in keys:
                found = answer[key]
                present = key in {f"op-{i}" for i in range(6)}
                assert (found is not None) == present, key
                assert found is None or found[0].operation_key == key

        async def failing(scope: str, namespace: str, items: list[str]) -> Any:
            raise StorageBackendError("load: refused")

        monkeypatch.setattr(store._reads, "_fetch", failing)
        outcomes = await asyncio.gather(
            *(store.load_records(SCOPE, [f"op-{i}"]) for i in range(3)), return_exceptions=True
        )
        # A failed statement fails every caller of its batch, with the store's error.
        assert all(isinstance(outcome, StorageBackendError) for outcome in outcomes), outcomes
    finally:
        await store.close()


# Several workers on one database --------------------------------------------------


async def test_a_new_owner_fences_out_every_later_commit_of_the_old_one(
    postgres_schema: PostgresSchema,
) -> None:
    old, new = store_in(postgres_schema), store_in(postgres_schema)
    try:
        old_lease = await old.reserve_fence(SCOPE)
        assert await old.commit(SCOPE, old_lease, admission("op-0")) == 1
        new_lease = await new.reserve_fence(SCOPE)
        assert new_lease.token == old_lease.token + 1
        # The old owner wakes up with a batch in hand: every change set of it
        # meets the new fence under the head lock, and nothing is written.
        late = await asyncio.gather(
            *(old.commit(SCOPE, old_lease, admission(f"op-{i}")) for i in range(1, 17)),
            return_exceptions=True,
        )
        assert all(isinstance(outcome, FencingTokenRejected) for outcome in late)
        assert {(o.current, o.supplied) for o in late} == {(new_lease.token, old_lease.token)}  # type: ignore[union-attr]
        # The new owner's baseline is the head it read while reserving.
        assert await new.commit(SCOPE, new_lease, admission("op-1")) == 2
        loaded = await new.load_records(SCOPE, [f"op-{i}" for i in range(17)])
        assert [key for key, row in loaded.items() if row is not None] == ["op-0", "op-1"]
        assert old.stats.failed_change_sets == 16
    finally:
        await old.close()
        await new.close()


async def holding_the_head(place: PostgresSchema, setting: str) -> asyncpg.Connection[Any]:
    """A connection (``setting`` applied) in a transaction holding the head row of
    SCOPE, which an owner reserved once (fence 1)."""
    owner = store_in(place)
    try:
        await owner.reserve_fence(SCOPE)
    finally:
        await owner.close()
    holder = await place.connect()
    await holder.execute(setting)
    await holder.transaction().start()
    await holder.fetch(
        "SELECT revision FROM heads WHERE namespace = 'worker-journal' AND name = $1 FOR UPDATE",
        SCOPE,
    )
    return holder


async def test_a_paused_owners_head_lock_ends_with_its_idle_transaction(
    postgres_schema: PostgresSchema,
) -> None:
    # A worker stopped inside its commit transaction holds the scope's head row.
    paused = await holding_the_head(
        postgres_schema, "SET idle_in_transaction_session_timeout = '500ms'"
    )
    standby = store_in(postgres_schema)
    try:
        # The standby's reservation waits for the lock, which the server
        # releases when it ends the idle transaction: the takeover completes.
        lease = await asyncio.wait_for(standby.reserve_fence(SCOPE), timeout=30)
        assert lease.token == 2
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await paused.fetch("SELECT 1")
    finally:
        await standby.close()
        paused.terminate()


async def test_a_replaced_owners_stuck_transaction_is_ended_by_the_new_owners_reservation(
    postgres_schema: PostgresSchema,
) -> None:
    # A worker stopped while its commit transaction is not idle to the server
    # (here: busy in a statement; a paused client that owes the rest of a
    # message or has not read a result looks alike): no idle timeout ends it.
    stuck = await holding_the_head(postgres_schema, "SET application_name = 'octo-worker-journal'")
    busy = asyncio.ensure_future(stuck.fetch("SELECT pg_sleep(120)"))
    standby = store_in(postgres_schema, idle_transaction_timeout=1.0)
    try:
        # The reservation waits out its lock timeout, ends the holder, reserves.
        lease = await asyncio.wait_for(standby.reserve_fence(SCOPE), timeout=30)
        assert lease.token == 2
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, ConnectionError)):
            await asyncio.wait_for(busy, timeout=10)
    finally:
        busy.cancel()
        await standby.close()
        stuck.terminate()


async def test_openers_racing_on_a_fresh_schema_migrate_it_once(
    postgres_schema: PostgresSchema,
) -> None:
    stores = [store_in(postgres_schema) for _ in range(3)]
    try:
        assert await asyncio.gather(*(store.integrity_check() for store in stores)) == [["ok"]] * 3
        connection = await postgres_schema.connect()
        try:
            assert await connection.fetch("SELECT version FROM schema_version") == [
                (postgres_rekey.SCHEMA_VERSION,)
            ]
        finally:
            await connection.close()
    finally:
        for store in stores:
            await store.close()


async def test_a_read_only_store_creates_nothing_and_its_session_cannot_write(
    postgres_schema: PostgresSchema,
) -> None:
    absent = store_in(postgres_schema, read_only=True)
    try:
        with pytest.raises(StorageBackendError, match="does not exist"):
            await absent.scopes()
    finally:
        await absent.close()
    connection = await postgres_schema.connect()
    try:
        exists = await connection.fetchval(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1",
            postgres_schema.schema,
        )
        assert exists == 0
    finally:
        await connection.close()

    writer = store_in(postgres_schema)
    lease = await writer.reserve_fence(SCOPE)
    await writer.commit(SCOPE, lease, admission("op-a"))
    await writer.close()
    reader = store_in(postgres_schema, read_only=True)
    try:
        assert await reader.head_revision(SCOPE) == 1
        pool = reader._pool
        assert pool is not None
        async with pool.acquire() as session:
            assert await session.fetchval("SHOW default_transaction_read_only") == "on"
            with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
                await session.execute(f'DELETE FROM "{postgres_schema.schema}".items')
    finally:
        await reader.close()


async def test_an_unreachable_server_is_a_backend_error_naming_no_secret() -> None:
    store = PostgresJournalStore(
        "postgresql://octo_test@127.0.0.1:1/octo_test", ring(), connect_timeout=2.0
    )
    try:
        for _ in range(2):  # the next call tries again
            with pytest.raises(StorageBackendError) as caught:
                await store.head_revision(SCOPE)
            assert "octo_test" not in str(caught.value)
    finally:
        await store.close()


async def test_the_store_is_bound_to_the_loop_of_its_first_call(
    postgres_schema: PostgresSchema,
) -> None:
    store = store_in(postgres_schema)
    try:
        await store.head_revision(SCOPE)
        caught = errors_in_another_loop(lambda: store.head_revision(SCOPE))
        assert len(caught) == 1 and isinstance(caught[0], StorageBackendError)
        assert "event loop" in str(caught[0])
    finally:
        await store.close()


# Construction (no I/O) ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://octo:secret@127.0.0.1/octo",
        "postgresql://octo@127.0.0.1/octo?password=secret",
        "mysql://octo@127.0.0.1/octo",
    ],
)
def test_a_url_with_a_password_or_another_scheme_is_refused(url: str) -> None:
    with pytest.raises(StorageBackendError) as caught:
        PostgresJournalStore(url, ring())
    assert "secret" not in str(caught.value) + repr(caught.value)


@pytest.mark.parametrize("schema", ["", "Octo", "octo-journal", "pg_octo", 'x"; drop'])
def test_a_schema_name_that_is_not_a_plain_identifier_is_refused(schema: str) -> None:
    with pytest.raises(StorageBackendError):
        PostgresJournalStore("postgresql://octo@127.0.0.1/octo", ring(), schema=schema)


def test_the_repr_shows_where_and_never_more() -> None:
    store = PostgresJournalStore(
        "postgres://octo@db.internal:5433/journal?sslmode=require", ring(), schema="journal_a"
    )
    assert repr(store) == (
        "PostgresJournalStore(url='postgres://octo@db.internal:5433/journal', schema='journal_a')"
    )


def test_the_statements_name_the_row_namespaces_of_the_documents() -> None:
    text = "\n".join(postgres_sql.statements("s").values())
    migrations = "\n".join(s for step in postgres_sql.MIGRATIONS for s in step)
    found = {part.split("'")[0] for part in (text + migrations).split("'worker-")[1:]}
    assert {f"worker-{name}" for name in found} == {
        NS_JOURNAL,
        NS_OUTBOX,
        NS_SESSION,
        NS_SESSION_OPEN,
        NS_SESSION_REQUEST,
    }
    assert f"LIMIT {postgres_sql.RESEAL_BATCH}" in text
