"""The PostgreSQL ledger store beyond the shared suite.

``test_ledger_store.py`` runs every backend behaviour on PostgreSQL too; this
module holds what only a shared server has: several store objects (as
several hosts) racing on one record, lock order, the compare-and-swap
checked in SQL, server errors and timeouts, the URL and password rules, and
the PostgreSQL counterparts of the SQLite thread tests. Every test works in
a schema of its own (``postgres_schema``), dropped afterwards.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import StorageBackendError, WriteConflict
from octo_common.records import (
    StorageKey,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
)
from octo_host.storage.postgres import (
    PostgresLedgerStore,
    PostgresRecordBackend,
    read_password_file,
    redacted_url,
)
from octo_host.store import ledger_record_key
from tests.postgres import PostgresSchema, errors_in_another_loop

RUN = ledger_record_key("release-42")


def new_keyring() -> StorageKeyring:
    return StorageKeyring("storage-v1", StorageKey(bytes([7]) * 32))


def store_in(place: PostgresSchema, **options: Any) -> PostgresLedgerStore:
    return PostgresLedgerStore(
        place.url,
        new_keyring(),
        password_file=place.password_file,
        schema=place.schema,
        **options,
    )


def backend_in(place: PostgresSchema, **options: Any) -> PostgresRecordBackend:
    return PostgresRecordBackend(
        place.url, password_file=place.password_file, schema=place.schema, **options
    )


# Several hosts on one database --------------------------------------------------


async def record_intents(store: PostgresLedgerStore, host: str, steps: int) -> int:
    """Record an intent for each step not yet taken, as a host driving the run does.

    Reads the run, appends ``[host, step]`` for the first step without an
    intent and writes it back with compare-and-swap; a conflict means the
    other host wrote first, so it reads again. Returns how many it recorded.
    """
    recorded = 0
    while True:
        current = await store.load(RUN)
        intents: list[list[Any]] = [] if current is None else json.loads(current.payload)
        if len(intents) == steps:
            return recorded
        intents.append([host, len(intents)])
        payload = json.dumps(intents).encode()
        try:
            if current is None:
                await store.create(RUN, payload)
            else:
                await store.replace(RUN, current.revision, payload)
        except WriteConflict:
            continue
        recorded += 1


async def test_two_hosts_racing_on_one_run_never_record_two_intents_for_one_step(
    postgres_schema: PostgresSchema,
) -> None:
    hosts = [store_in(postgres_schema), store_in(postgres_schema)]
    steps = 30
    try:
        counts = await asyncio.gather(
            record_intents(hosts[0], "host-a", steps), record_intents(hosts[1], "host-b", steps)
        )
        final = await hosts[1].load(RUN)
    finally:
        for host in hosts:
            await host.close()
    assert final is not None
    intents = json.loads(final.payload)
    assert [step for _, step in intents] == list(range(steps))  # one intent per step
    assert sum(counts) == steps == final.revision  # every success is one revision
    assert {host for host, _ in intents} <= {"host-a", "host-b"}


async def test_fence_reservations_from_two_hosts_are_all_distinct(
    postgres_schema: PostgresSchema,
) -> None:
    hosts = [store_in(postgres_schema), store_in(postgres_schema)]
    try:
        tokens = await asyncio.gather(
            *(hosts[i % 2].reserve_fence(RUN) for i in range(40)),
        )
        assert sorted(tokens) == list(range(1, 41))
        assert await hosts[0].current_fence(RUN) == 40
    finally:
        for host in hosts:
            await host.close()


async def test_writes_of_two_records_in_opposite_orders_all_complete(
    postgres_schema: PostgresSchema,
) -> None:
    first = StorageRecordKey("workflow-ledger", "a")
    second = StorageRecordKey("workflow-routes", "a")
    hosts = [store_in(postgres_schema), store_in(postgres_schema)]

    async def drive(store: PostgresLedgerStore, order: list[StorageRecordKey]) -> int:
        written = 0
        for _ in range(15):
            while True:
                records = [await store.load(key) for key in order]
                writes = [
                    (key, None if record is None else record.revision, b"x")
                    for key, record in zip(order, records, strict=True)
                ]
                try:
                    await store.compare_and_swap_many(writes)
                except WriteConflict:
                    continue
                written += 1
                break
        return written

    try:
        counts = await asyncio.gather(
            drive(hosts[0], [first, second]), drive(hosts[1], [second, first])
        )
        loaded = [await hosts[0].load(key) for key in (first, second)]
    finally:
        for host in hosts:
            await host.close()
    assert counts == [15, 15]  # no StorageBackendError (a deadlock) on either side
    assert [record.revision for record in loaded if record] == [30, 30]


# The compare-and-swap is checked in SQL ------------------------------------------------


async def test_the_write_statement_refuses_a_stale_expectation(
    postgres_schema: PostgresSchema,
) -> None:
    backend = backend_in(postgres_schema)
    try:
        assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")) == Stored(1)
        connection = await postgres_schema.connect()
        try:
            statement = backend._sql["write_record"]
            # (namespace, name, new revision, expected floor, fence, expected item, data)
            for stale in [(2, 0, 0, None), (2, 0, 0, 1), (3, 2, 0, 2), (2, 1, 5, 1)]:
                new, floor, fence, item = stale
                arguments = (RUN.namespace, RUN.name, new, floor, fence, item, b"blind")
                assert await connection.fetchval(statement, *arguments) is None
            fresh = (RUN.namespace, RUN.name, 2, 1, 0, 1, b"v2")
            assert await connection.fetchval(statement, *fresh) == 2
        finally:
            await connection.close()
        assert await backend.load(RUN) == StorageSnapshot(StoredRecord(2, b"v2"), 2)
    finally:
        await backend.close()


async def test_a_write_the_sql_refuses_is_never_committed_whatever_python_decided(
    postgres_schema: PostgresSchema, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_in(postgres_schema)
    original = PostgresRecordBackend._record_statement

    def stale(
        self: PostgresRecordBackend,
        key: StorageRecordKey,
        expected: int | None,
        replacement: StoredRecord,
        fence: int,
    ) -> Any:
        sql, arguments, value = original(self, key, expected, replacement, fence)
        return sql, (*arguments[:3], 7, *arguments[4:]), value  # a wrong expected floor

    try:
        await backend.load(RUN)  # open
        monkeypatch.setattr(PostgresRecordBackend, "_record_statement", stale)
        with pytest.raises(StorageBackendError, match="changed under its lock"):
            await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1"))
        assert await backend.load(RUN) == StorageSnapshot(None, 0)
        monkeypatch.setattr(PostgresRecordBackend, "_record_statement", original)
        assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")) == Stored(1)
    finally:
        await backend.close()


# Failures: server errors, defects, closing ----------------------------------------------


async def test_a_database_error_fails_every_write_of_its_transaction(
    postgres_schema: PostgresSchema,
) -> None:
    backend = backend_in(postgres_schema, command_timeout=0.5)
    keys = [StorageRecordKey("workflow-ledger", f"run-{i}") for i in range(8)]
    try:
        assert await backend.compare_and_swap(keys[0], None, StoredRecord(1, b"x")) == Stored(1)
        # Another session holds the head of keys[0] longer than a statement may wait:
        # the transaction that carries all eight writes fails whole.
        blocker = await postgres_schema.connect()
        try:
            transaction = blocker.transaction()
            await transaction.start()
            await blocker.execute(
                "SELECT 1 FROM heads WHERE namespace = $1 AND name = $2 FOR UPDATE",
                keys[0].namespace,
                keys[0].name,
            )
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    backend.compare_and_swap(keys[0], 1, StoredRecord(2, b"y")),
                    *(backend.compare_and_swap(k, None, StoredRecord(1, b"x")) for k in keys[1:]),
                    return_exceptions=True,
                ),
                timeout=30,
            )
            await transaction.rollback()
        finally:
            await blocker.close()
        assert all(isinstance(o, StorageBackendError) for o in outcomes), outcomes
        assert len({id(o) for o in outcomes}) == len(keys)  # one instance per caller
        assert all("timed out" in str(o) for o in outcomes)
        assert await backend.load(keys[0]) == StorageSnapshot(StoredRecord(1, b"x"), 1)
        for key in keys[1:]:
            assert await backend.load(key) == StorageSnapshot(None, 0)
        # The backend still serves once the lock is gone.
        assert await backend.compare_and_swap(keys[1], None, StoredRecord(1, b"x")) == Stored(1)
    finally:
        await backend.close()


async def test_a_defect_in_the_writer_fails_its_batch_and_not_the_backend(
    postgres_schema: PostgresSchema, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backend_in(postgres_schema)
    original = PostgresRecordBackend._transaction
    calls = 0

    async def broken_once(self: PostgresRecordBackend, connection: Any, batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("defect")
        return await original(self, connection, batch)

    monkeypatch.setattr(PostgresRecordBackend, "_transaction", broken_once)
    try:
        with pytest.raises(StorageBackendError, match="RuntimeError"):
            await asyncio.wait_for(
                backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")), timeout=10
            )
        assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")) == Stored(1)
        assert await backend.load(RUN) == StorageSnapshot(StoredRecord(1, b"v1"), 1)
    finally:
        await backend.close()


async def test_every_close_waits_for_the_writes_submitted_before_the_first(
    postgres_schema: PostgresSchema,
) -> None:
    backend = backend_in(postgres_schema)
    await backend.load(RUN)

    def slow(view: Any) -> tuple[Stored, list[tuple[str, tuple[Any, ...], int]]]:
        return Stored(1), [("SELECT 1 FROM pg_sleep(0.3)", (), 1)]

    write = backend._submit("slow_write", (RUN,), slow)
    await asyncio.sleep(0.05)  # its transaction has begun: the next write waits for another
    other = StorageRecordKey("workflow-ledger", "other")
    waiting = asyncio.ensure_future(backend.compare_and_swap(other, None, StoredRecord(1, b"x")))
    await asyncio.sleep(0)
    first = asyncio.ensure_future(backend.close())
    await asyncio.sleep(0)
    await backend.close()  # the second close returns only once both writes have ended
    assert write.done() and write.result() == Stored(1)
    assert waiting.done() and waiting.result() == Stored(1)
    await first
    reopened = backend_in(postgres_schema)
    try:
        assert await reopened.load(other) == StorageSnapshot(StoredRecord(1, b"x"), 1)
    finally:
        await reopened.close()
    with pytest.raises(StorageBackendError, match="closed"):
        await backend.load(RUN)
    with pytest.raises(StorageBackendError, match="closed"):
        await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1"))


async def test_two_stores_opening_a_fresh_schema_together_migrate_it_once(
    postgres_schema: PostgresSchema,
) -> None:
    stores = [store_in(postgres_schema) for _ in range(3)]
    try:
        assert await asyncio.gather(*(store.integrity_check() for store in stores)) == [["ok"]] * 3
        connection = await postgres_schema.connect()
        try:
            assert await connection.fetch("SELECT version FROM schema_version") == [(2,)]
            # Migrated once: one store head, built once and sealed.
            ((count, sealed),) = await connection.fetch(
                "SELECT count(*), bool_and(digest IS NOT NULL AND auth_tag IS NOT NULL) "
                "FROM store_head"
            )
            assert (count, sealed) == (1, True)
        finally:
            await connection.close()
    finally:
        for store in stores:
            await store.close()


async def test_an_unreachable_server_is_a_backend_error_naming_no_secret(tmp_path: Path) -> None:
    store = PostgresLedgerStore(
        "postgresql://octo_test@127.0.0.1:1/octo_test", new_keyring(), connect_timeout=2.0
    )
    try:
        for _ in range(2):  # the next call tries again
            with pytest.raises(StorageBackendError) as caught:
                await store.load(RUN)
            assert caught.value.code == "storage_backend_error"
            assert "octo_test" not in str(caught.value)
    finally:
        await store.close()


async def test_the_backend_is_bound_to_the_loop_of_its_first_call(
    postgres_schema: PostgresSchema,
) -> None:
    backend = backend_in(postgres_schema)
    try:
        await backend.load(RUN)
        caught = errors_in_another_loop(lambda: backend.load(RUN))
        assert len(caught) == 1 and isinstance(caught[0], StorageBackendError)
        assert "event loop" in str(caught[0])
    finally:
        await backend.close()


# URL and password file -------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://octo:secret@127.0.0.1/octo",
        "postgresql://octo:@127.0.0.1/octo",
        "postgresql://octo@127.0.0.1/octo?password=secret",
        "mysql://octo@127.0.0.1/octo",
        "127.0.0.1:5432",
    ],
)
def test_a_url_with_a_password_or_another_scheme_is_refused(url: str) -> None:
    with pytest.raises(StorageBackendError) as caught:
        PostgresLedgerStore(url, new_keyring())
    assert "secret" not in str(caught.value) + repr(caught.value)


@pytest.mark.parametrize("schema", ["", "Octo", "octo-ledger", "pg_octo", "a" * 64, 'x"; drop'])
def test_a_schema_name_that_is_not_a_plain_identifier_is_refused(schema: str) -> None:
    with pytest.raises(StorageBackendError):
        PostgresRecordBackend("postgresql://octo@127.0.0.1/octo", schema=schema)


def test_the_repr_shows_where_and_never_more() -> None:
    backend = PostgresRecordBackend(
        "postgres://octo@db.internal:5433/ledger?sslmode=require", schema="ledger_a"
    )
    assert repr(backend) == (
        "PostgresRecordBackend(url='postgres://octo@db.internal:5433/ledger', schema='ledger_a')"
    )
    assert redacted_url("postgresql://127.0.0.1/x") == "postgresql://127.0.0.1/x"


def test_the_password_file_must_be_private_and_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pw"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    assert read_password_file(path) == "s3cret"
    for content, mode, problem in [
        ("s3cret\n", 0o640, "group or others"),
        ("", 0o600, "one line"),
        ("two\nlines\n", 0o600, "one line"),
    ]:
        path.write_text(content)
        path.chmod(mode)
        with pytest.raises(StorageBackendError, match=problem) as caught:
            read_password_file(path)
        assert "s3cret" not in str(caught.value)
    with pytest.raises(StorageBackendError, match="does not exist"):
        read_password_file(tmp_path / "absent")
    (tmp_path / "link").symlink_to(path)
    with pytest.raises(StorageBackendError, match="cannot be opened"):
        read_password_file(tmp_path / "link")


async def test_a_group_readable_password_file_fails_the_first_call(
    postgres_schema: PostgresSchema,
) -> None:
    postgres_schema.password_file.chmod(0o640)
    store = store_in(postgres_schema)
    try:
        with pytest.raises(StorageBackendError, match="password_file"):
            await store.load(RUN)
        postgres_schema.password_file.chmod(0o600)
        assert await store.load(RUN) is None  # opened on the next call
    finally:
        await store.close()


async def test_a_namespace_lists_the_names_of_its_records(
    postgres_schema: PostgresSchema,
) -> None:
    store = store_in(postgres_schema)
    try:
        assert await store.names(RUN.namespace) == []
        for run in ("run-b", "run-a"):
            await store.create(ledger_record_key(run), b"{}")
        await store.reserve_fence(ledger_record_key("fenced-only"))  # a head, no value
        await store.create(StorageRecordKey("workflow-audit", "run-c"), b"{}")
        assert await store.names(RUN.namespace) == ["run-a", "run-b"]
    finally:
        await store.close()
