"""Authenticated ledger storage on real backends.

One suite for every backend: each create/load/replace scenario runs against the
``VolatileMemoryStore``, a real SQLite file (``SqliteRecordBackend``) and a
real PostgreSQL schema (``PostgresRecordBackend``, marked ``postgres``); the
durable-database behaviours (reopening, two store objects on one database,
fences shared through it, ceilings, group commit, schema versions) run on
SQLite and PostgreSQL. Tampering goes through a "backdoor" that edits the
backend's state directly, as someone with access to the database would.

SQLite only, because they are about its file or its thread: the rollback
anchor file (PostgreSQL stores take none, see ``octo_host.storage.postgres``),
file and directory modes, an unusable database path, a thread that cannot
start, and the thread internals of the database-error, defect and close
tests (their PostgreSQL counterparts are in ``test_ledger_store_postgres.py``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from octo_common.errors import (
    FencingRequired,
    FencingTokenExhausted,
    FencingTokenRejected,
    InvalidEnvelope,
    InvalidFencingToken,
    InvalidRecordAuthenticationTag,
    InvalidReplacementRevision,
    InvalidStorageKey,
    PayloadTooLarge,
    RevisionExhausted,
    RevisionFloorMismatch,
    RevisionMismatch,
    RollbackAnchorInvalid,
    RollbackAnchorMissing,
    RollbackDetected,
    StorageBackendError,
    UnknownKeyId,
    UnsupportedRecordFormat,
    WriteConflict,
)
from octo_common.limits import MAX_AUTHENTICATED_PAYLOAD_BYTES
from octo_common.records import (
    AuthenticatedRecord,
    Conflict,
    StorageKey,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
    seal_record,
)
from octo_common.setdigest import SetDigest
from octo_host.storage.head import LEDGER_ROWS_DOMAIN
from octo_host.storage.postgres import PostgresLedgerStore, PostgresRecordBackend
from octo_host.store import (
    AuthenticatedStore,
    SqliteLedgerStore,
    SqliteRecordBackend,
    VolatileMemoryStore,
    initialise_anchor,
    ledger_record_key,
    load_storage_key,
)
from tests.postgres import PostgresSchema

RUN = ledger_record_key("release-42")
OTHER_RUN = ledger_record_key("release-43")
SQLITE_MAX = 2**63 - 1


def new_keyring() -> StorageKeyring:
    return StorageKeyring("storage-v1", StorageKey(bytes([7]) * 32))


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def head_anchor_bytes(store_revision: int, records: list[tuple[StorageRecordKey, int]]) -> bytes:
    """The version 2 anchor of a store head at ``store_revision`` holding ``records``."""
    digest = SetDigest.of(
        LEDGER_ROWS_DOMAIN, [(key.namespace, key.name, revision) for key, revision in records]
    )
    return (
        f'{{"format_version":2,"store_revision":{store_revision},'
        f'"record_count":{len(records)},"digest":"{digest.fingerprint().hex()}"}}'
    ).encode()


class Backdoor:
    """Reads and rewrites a backend's raw state behind the store's back."""

    async def stored(self, key: StorageRecordKey) -> StoredRecord | None:
        raise AssertionError("abstract")

    async def put(self, key: StorageRecordKey, record: StoredRecord | None, floor: int) -> None:
        raise AssertionError("abstract")


class MemoryBackdoor(Backdoor):
    def __init__(self, backend: VolatileMemoryStore) -> None:
        self.backend = backend

    async def stored(self, key: StorageRecordKey) -> StoredRecord | None:
        return self.backend.records.get(key)

    async def put(self, key: StorageRecordKey, record: StoredRecord | None, floor: int) -> None:
        if record is None:
            self.backend.records.pop(key, None)
        else:
            self.backend.records[key] = record
        self.backend.floors[key] = floor


class SqliteBackdoor(Backdoor):
    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=5, isolation_level=None)

    async def stored(self, key: StorageRecordKey) -> StoredRecord | None:
        connection = self._connect()
        try:
            row = connection.execute(
                "SELECT revision, envelope FROM items WHERE namespace=? AND name=? AND item=''",
                (key.namespace, key.name),
            ).fetchone()
        finally:
            connection.close()
        return None if row is None else StoredRecord(row[0], row[1])

    async def put(self, key: StorageRecordKey, record: StoredRecord | None, floor: int) -> None:
        connection = self._connect()
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO heads (namespace, name, revision, fence) VALUES (?, ?, ?, 0) "
                "ON CONFLICT (namespace, name) DO UPDATE SET revision = excluded.revision",
                (key.namespace, key.name, floor),
            )
            connection.execute(
                "DELETE FROM items WHERE namespace=? AND name=? AND item=''",
                (key.namespace, key.name),
            )
            if record is not None:
                connection.execute(
                    "INSERT INTO items (namespace, name, item, revision, envelope) "
                    "VALUES (?, ?, '', ?, ?)",
                    (key.namespace, key.name, record.revision, record.data),
                )
            connection.execute("COMMIT")
        finally:
            connection.close()

    async def delete_heads(self) -> None:
        connection = self._connect()
        try:
            connection.execute("DELETE FROM heads")  # foreign keys are off in this connection
        finally:
            connection.close()

    async def schema_version(self) -> list[int]:
        connection = self._connect()
        try:
            return [row[0] for row in connection.execute("SELECT version FROM schema_version")]
        finally:
            connection.close()

    async def set_schema_version(self, version: int) -> None:
        connection = self._connect()
        try:
            connection.execute("UPDATE schema_version SET version = ?", (version,))
        finally:
            connection.close()


class PostgresBackdoor(Backdoor):
    """The same edits on the PostgreSQL tables, through a connection of its own."""

    def __init__(self, place: PostgresSchema) -> None:
        self.place = place

    async def stored(self, key: StorageRecordKey) -> StoredRecord | None:
        connection = await self.place.connect()
        try:
            row = await connection.fetchrow(
                "SELECT revision, envelope FROM items WHERE namespace=$1 AND name=$2 AND item=''",
                key.namespace,
                key.name,
            )
        finally:
            await connection.close()
        return None if row is None else StoredRecord(row[0], row[1])

    async def put(self, key: StorageRecordKey, record: StoredRecord | None, floor: int) -> None:
        connection = await self.place.connect()
        try:
            async with connection.transaction():
                await connection.execute(
                    "INSERT INTO heads (namespace, name, revision, fence) VALUES ($1, $2, $3, 0) "
                    "ON CONFLICT (namespace, name) DO UPDATE SET revision = excluded.revision",
                    key.namespace,
                    key.name,
                    floor,
                )
                await connection.execute(
                    "DELETE FROM items WHERE namespace=$1 AND name=$2 AND item=''",
                    key.namespace,
                    key.name,
                )
                if record is not None:
                    await connection.execute(
                        "INSERT INTO items (namespace, name, item, revision, envelope) "
                        "VALUES ($1, $2, '', $3, $4)",
                        key.namespace,
                        key.name,
                        record.revision,
                        record.data,
                    )
        finally:
            await connection.close()

    async def delete_heads(self) -> None:
        connection = await self.place.connect()
        try:
            # As someone who edits the tables without the constraints would.
            await connection.execute(
                "ALTER TABLE items DROP CONSTRAINT IF EXISTS items_namespace_name_fkey"
            )
            await connection.execute("DELETE FROM heads")
        finally:
            await connection.close()

    async def schema_version(self) -> list[int]:
        connection = await self.place.connect()
        try:
            return [row[0] for row in await connection.fetch("SELECT version FROM schema_version")]
        finally:
            await connection.close()

    async def set_schema_version(self, version: int) -> None:
        connection = await self.place.connect()
        try:
            await connection.execute("UPDATE schema_version SET version = $1", version)
        finally:
            await connection.close()


POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)


@dataclass
class Database:
    """One durable database (a SQLite file or a PostgreSQL schema) and how to open it."""

    kind: str
    path: Path
    place: PostgresSchema | None

    def store(self, ring: StorageKeyring | None = None) -> SqliteLedgerStore | PostgresLedgerStore:
        """A new ledger store object on this database (as another process would open)."""
        if self.place is None:
            return SqliteLedgerStore(self.path, ring or new_keyring())
        return PostgresLedgerStore(
            self.place.url,
            ring or new_keyring(),
            password_file=self.place.password_file,
            schema=self.place.schema,
        )

    def backend(self) -> SqliteRecordBackend | PostgresRecordBackend:
        """A new record backend object on this database."""
        if self.place is None:
            return SqliteRecordBackend(self.path)
        return PostgresRecordBackend(
            self.place.url, password_file=self.place.password_file, schema=self.place.schema
        )

    @property
    def backdoor(self) -> SqliteBackdoor | PostgresBackdoor:
        return SqliteBackdoor(self.path) if self.place is None else PostgresBackdoor(self.place)


@pytest.fixture(params=["sqlite", POSTGRES])
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    if request.param == "sqlite":
        return Database("sqlite", tmp_path / "ledger.db", None)
    place: PostgresSchema = request.getfixturevalue("postgres_schema")
    return Database("postgres", tmp_path / "unused", place)


@dataclass
class Env:
    kind: str
    store: AuthenticatedStore
    ring: StorageKeyring
    backdoor: Backdoor


@pytest.fixture(params=["memory", "sqlite", POSTGRES])
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Env]:
    ring = new_keyring()
    if request.param == "memory":
        backend = VolatileMemoryStore()
        store: AuthenticatedStore = AuthenticatedStore(backend, ring)
        backdoor: Backdoor = MemoryBackdoor(backend)
    elif request.param == "sqlite":
        path = tmp_path / "db" / "ledger.db"
        store = SqliteLedgerStore(path, ring)
        backdoor = SqliteBackdoor(path)
    else:
        database = Database("postgres", tmp_path, request.getfixturevalue("postgres_schema"))
        store = database.store(ring)
        backdoor = database.backdoor
    try:
        yield Env(request.param, store, ring, backdoor)
    finally:
        await store.close()


async def tamper(env: Env, key: StorageRecordKey, old: bytes, new: bytes) -> None:
    stored = await env.backdoor.stored(key)
    assert stored is not None and old in stored.data
    await env.backdoor.put(
        key, StoredRecord(stored.revision, stored.data.replace(old, new)), stored.revision
    )


# Create, load, replace and tampering, on every backend ------------------------------


async def test_create_load_replace_round_trip(env: Env) -> None:
    assert await env.store.load(RUN) is None

    created = await env.store.create(RUN, b"ledger v1")
    replaced = await env.store.replace(RUN, 1, b"ledger v2")

    assert created == AuthenticatedRecord(1, "storage-v1", b"ledger v1")
    assert replaced == AuthenticatedRecord(2, "storage-v1", b"ledger v2")
    assert await env.store.load(RUN) == replaced


async def test_replace_expecting_zero_after_create_conflicts(env: Env) -> None:
    await env.store.create(RUN, b"first payload")

    with pytest.raises(WriteConflict) as caught:
        await env.store.replace(RUN, 0, b"second")

    assert (caught.value.expected, caught.value.actual, caught.value.revision_floor) == (0, 1, 1)
    with pytest.raises(WriteConflict) as again:
        await env.store.create(RUN, b"second")
    assert (again.value.expected, again.value.actual, again.value.revision_floor) == (None, 1, 1)
    with pytest.raises(WriteConflict) as absent:
        await env.store.replace(OTHER_RUN, 3, b"x")
    assert (absent.value.expected, absent.value.actual, absent.value.revision_floor) == (3, None, 0)
    assert (await env.store.load(RUN)) == AuthenticatedRecord(1, "storage-v1", b"first payload")


async def test_fenced_writes(env: Env) -> None:
    first = await env.store.compare_and_swap_fenced(RUN, None, b"v1", 5)
    assert first.revision == 1
    assert await env.store.current_fence(RUN) == 5

    with pytest.raises(WriteConflict):
        await env.store.compare_and_swap_fenced(RUN, 0, b"v2", 6)
    assert await env.store.current_fence(RUN) == 6  # established before the conflict

    with pytest.raises(FencingRequired) as required:
        await env.store.replace(RUN, 1, b"unfenced")
    assert required.value.current == 6

    with pytest.raises(FencingTokenRejected) as rejected:
        await env.store.compare_and_swap_fenced(RUN, 1, b"stale", 5)
    assert (rejected.value.current, rejected.value.supplied) == (6, 5)

    second = await env.store.compare_and_swap_fenced(RUN, 1, b"v2", 6)
    assert second == AuthenticatedRecord(2, "storage-v1", b"v2")
    assert await env.store.load(RUN) == second


async def test_fence_is_established_even_when_the_payload_is_too_large(env: Env) -> None:
    with pytest.raises(PayloadTooLarge):
        await env.store.compare_and_swap_fenced(RUN, None, bytes(2_097_153), 9)
    assert await env.store.current_fence(RUN) == 9
    assert await env.store.load(RUN) is None


async def test_reserve_fence_counts_up_from_one(env: Env) -> None:
    assert await env.store.current_fence(RUN) == 0
    assert await env.store.reserve_fence(RUN) == 1
    assert await env.store.reserve_fence(RUN) == 2
    assert await env.store.current_fence(RUN) == 2
    assert await env.store.current_fence(OTHER_RUN) == 0
    token = await env.store.reserve_fence(OTHER_RUN)
    assert (await env.store.compare_and_swap_fenced(OTHER_RUN, None, b"x", token)).revision == 1


async def test_establish_fence_rules(env: Env) -> None:
    await env.store.establish_fence(RUN, 4)
    await env.store.establish_fence(RUN, 4)  # equal: no-op
    assert await env.store.current_fence(RUN) == 4
    with pytest.raises(FencingTokenRejected) as caught:
        await env.store.establish_fence(RUN, 3)
    assert (caught.value.current, caught.value.supplied) == (4, 3)
    with pytest.raises(InvalidFencingToken):
        await env.store.establish_fence(RUN, 0)
    assert await env.store.current_fence(RUN) == 4


async def test_token_zero_is_refused_and_nothing_is_written(env: Env) -> None:
    with pytest.raises(InvalidFencingToken):
        await env.store.compare_and_swap_fenced(RUN, None, b"v1", 0)
    assert await env.store.load(RUN) is None
    assert await env.store.current_fence(RUN) == 0


async def test_record_copied_to_another_name_fails_authentication(env: Env) -> None:
    await env.store.create(RUN, b"ledger of release-42")
    stored = await env.backdoor.stored(RUN)
    assert stored is not None
    await env.backdoor.put(OTHER_RUN, stored, stored.revision)

    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.load(OTHER_RUN)
    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.replace(OTHER_RUN, 1, b"overwrite")


async def test_tampered_payload_fails_authentication_and_blocks_writes(env: Env) -> None:
    await env.store.create(RUN, b"first payload")
    # "Zmlyc3Qg" is base64 of "first "; "Zmlyc3Rn" decodes to "firstg".
    await tamper(env, RUN, b"Zmlyc3Qg", b"Zmlyc3Rn")

    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.load(RUN)
    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.replace(RUN, 1, b"second")


# Several records in one transaction (the host's intent and its scope binding) ----------

OTHER = StorageRecordKey("workflow-routes", "release-42")


async def test_many_writes_land_together(env: Env) -> None:
    assert await env.store.compare_and_swap_many([]) == []
    await env.store.create(RUN, b"v1")

    written = await env.store.compare_and_swap_many([(RUN, 1, b"v2"), (OTHER, None, b"r1")])

    assert written == [
        AuthenticatedRecord(2, "storage-v1", b"v2"),
        AuthenticatedRecord(1, "storage-v1", b"r1"),
    ]
    assert await env.store.load(RUN) == written[0]
    assert await env.store.load(OTHER) == written[1]


async def test_many_writes_one_conflict_writes_nothing(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    with pytest.raises(WriteConflict) as caught:
        await env.store.compare_and_swap_many([(RUN, 1, b"v2"), (OTHER, 3, b"r")])
    assert (caught.value.expected, caught.value.actual) == (3, None)
    assert await env.store.load(RUN) == AuthenticatedRecord(1, "storage-v1", b"v1")
    assert await env.store.load(OTHER) is None


async def test_many_writes_a_refused_record_writes_nothing(env: Env) -> None:
    await env.store.create(RUN, b"first payload")
    await env.store.create(OTHER, b"r1")
    await tamper(env, RUN, b"Zmlyc3Qg", b"Zmlyc3Rn")
    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.compare_and_swap_many([(OTHER, 1, b"r2"), (RUN, 1, b"v2")])
    assert await env.store.load(OTHER) == AuthenticatedRecord(1, "storage-v1", b"r1")

    fenced = StorageRecordKey("workflow-ledger", "fenced")
    await env.store.reserve_fence(fenced)
    with pytest.raises(FencingRequired):
        await env.store.compare_and_swap_many([(OTHER, 1, b"r2"), (fenced, None, b"x")])
    assert await env.store.load(OTHER) == AuthenticatedRecord(1, "storage-v1", b"r1")
    assert await env.store.load(fenced) is None


async def test_many_writes_bad_arguments_are_refused_before_any_io(env: Env) -> None:
    too_large = b"x" * (MAX_AUTHENTICATED_PAYLOAD_BYTES + 1)
    with pytest.raises(PayloadTooLarge):
        await env.store.compare_and_swap_many([(OTHER, None, b"r"), (RUN, None, too_large)])
    with pytest.raises(ValueError):
        await env.store.compare_and_swap_many([(RUN, None, b"a"), (RUN, None, b"b")])
    with pytest.raises(TypeError):
        await env.store.compare_and_swap_many([(RUN, None)])  # type: ignore[list-item]
    assert await env.store.load(RUN) is None and await env.store.load(OTHER) is None


async def test_many_writes_need_a_backend_that_has_them() -> None:
    class Single:  # a RecordBackend of someone else's without the many-write
        def __init__(self) -> None:
            self.inner = VolatileMemoryStore()

        def __getattr__(self, name: str) -> Any:
            if name == "compare_and_swap_many_opened":
                raise AttributeError(name)
            return getattr(self.inner, name)

    backend = Single()
    store = AuthenticatedStore(backend, new_keyring())
    with pytest.raises(StorageBackendError):
        await store.compare_and_swap_many([(RUN, None, b"v1")])
    assert backend.inner.records == {}


async def test_older_record_restored_under_a_higher_floor_is_a_rollback(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    old = await env.backdoor.stored(RUN)
    assert old is not None
    await env.store.replace(RUN, 1, b"v2")
    await env.backdoor.put(RUN, old, 2)

    with pytest.raises(RollbackDetected) as caught:
        await env.store.load(RUN)
    assert (caught.value.record_revision, caught.value.revision_floor) == (1, 2)
    with pytest.raises(RollbackDetected):
        await env.store.replace(RUN, 1, b"v2 again")


async def test_rotation_resigns_and_retirement_locks_out_old_records(env: Env) -> None:
    await env.store.create(RUN, b"old ledger")
    await env.store.create(OTHER_RUN, b"never rewritten")
    env.ring.rotate_to("storage-v2", StorageKey(bytes([8]) * 32))

    old = await env.store.load(RUN)
    assert old == AuthenticatedRecord(1, "storage-v1", b"old ledger")
    rewritten = await env.store.replace(RUN, 1, b"old ledger")
    assert rewritten == AuthenticatedRecord(2, "storage-v2", b"old ledger")

    env.ring.retire("storage-v1")
    assert await env.store.load(RUN) == rewritten
    with pytest.raises(UnknownKeyId) as caught:
        await env.store.load(OTHER_RUN)
    assert caught.value.key_id == "storage-v1"
    with pytest.raises(UnknownKeyId):
        await env.store.replace(OTHER_RUN, 1, b"blocked")


async def test_padded_base64_is_an_invalid_envelope(env: Env) -> None:
    await env.store.create(RUN, b"first payload")
    await tamper(env, RUN, b'"Zmlyc3QgcGF5bG9hZA"', b'"Zmlyc3QgcGF5bG9hZA=="')
    with pytest.raises(InvalidEnvelope):
        await env.store.load(RUN)


async def test_uppercase_tag_is_an_invalid_tag(env: Env) -> None:
    await env.store.create(RUN, b"first payload")
    stored = await env.backdoor.stored(RUN)
    assert stored is not None
    tag = stored.data[-66:-2]
    await tamper(env, RUN, tag, tag.upper())
    with pytest.raises(InvalidRecordAuthenticationTag):
        await env.store.load(RUN)


async def test_envelope_revision_above_backend_revision_is_a_mismatch(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    await env.backdoor.put(RUN, StoredRecord(1, seal_record(env.ring, RUN, 2, b"v1")), 1)
    with pytest.raises(RevisionMismatch) as caught:
        await env.store.load(RUN)
    assert (caught.value.backend, caught.value.envelope) == (1, 2)


async def test_format_version_two_is_unsupported(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    await tamper(env, RUN, b'"format_version":1', b'"format_version":2')
    with pytest.raises(UnsupportedRecordFormat) as caught:
        await env.store.load(RUN)
    assert caught.value.version == 2


async def test_deleted_record_with_floor_one_is_a_rollback(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    await env.backdoor.put(RUN, None, 1)
    with pytest.raises(RollbackDetected) as caught:
        await env.store.load(RUN)
    assert (caught.value.record_revision, caught.value.revision_floor) == (None, 1)
    with pytest.raises(RollbackDetected):
        await env.store.create(RUN, b"recreate")


async def test_oversized_payload_is_refused_before_any_io(env: Env) -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        await env.store.create(RUN, bytes(2_097_153))
    assert (caught.value.actual, caught.value.maximum) == (2_097_153, 2_097_152)
    assert await env.store.load(RUN) is None


async def test_floor_forced_to_zero_under_a_live_record(env: Env) -> None:
    await env.store.create(RUN, b"v1")
    stored = await env.backdoor.stored(RUN)
    assert stored is not None
    await env.backdoor.put(RUN, stored, 0)
    with pytest.raises(RevisionFloorMismatch) as caught:
        await env.store.load(RUN)
    assert (caught.value.record_revision, caught.value.revision_floor) == (1, 0)


# Backend contract ---------------------------------------------------


AnyBackend = VolatileMemoryStore | SqliteRecordBackend | PostgresRecordBackend


@pytest.fixture(params=["memory", "sqlite", POSTGRES])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AnyBackend]:
    chosen: AnyBackend
    if request.param == "memory":
        chosen = VolatileMemoryStore()
    elif request.param == "sqlite":
        chosen = SqliteRecordBackend(tmp_path / "backend.db")
    else:
        chosen = Database(
            "postgres", tmp_path, request.getfixturevalue("postgres_schema")
        ).backend()
    try:
        yield chosen
    finally:
        await chosen.close()


async def test_backend_cas_outcomes(backend: AnyBackend) -> None:
    assert await backend.load(RUN) == StorageSnapshot(None, 0)
    assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"one")) == Stored(1)
    assert await backend.load(RUN) == StorageSnapshot(StoredRecord(1, b"one"), 1)
    assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"x")) == Conflict(1, 1)
    assert await backend.compare_and_swap(RUN, 0, StoredRecord(1, b"x")) == Conflict(1, 1)
    assert await backend.compare_and_swap(OTHER_RUN, 1, StoredRecord(2, b"x")) == Conflict(None, 0)
    assert await backend.compare_and_swap(RUN, 1, StoredRecord(2, b"two")) == Stored(2)
    assert await backend.load(RUN) == StorageSnapshot(StoredRecord(2, b"two"), 2)


async def test_backend_refuses_a_replacement_not_at_expected_plus_one(
    backend: AnyBackend,
) -> None:
    with pytest.raises(InvalidReplacementRevision) as create:
        await backend.compare_and_swap(RUN, None, StoredRecord(5, b"x"))
    assert (create.value.expected, create.value.actual) == (1, 5)
    await backend.compare_and_swap(RUN, None, StoredRecord(1, b"x"))
    with pytest.raises(InvalidReplacementRevision) as replace:
        await backend.compare_and_swap(RUN, 1, StoredRecord(3, b"x"))
    assert (replace.value.expected, replace.value.actual) == (2, 3)
    assert await backend.load(RUN) == StorageSnapshot(StoredRecord(1, b"x"), 1)


async def test_backend_fenced_cas_requires_the_current_token(
    backend: AnyBackend,
) -> None:
    with pytest.raises(InvalidFencingToken):
        await backend.compare_and_swap_fenced(RUN, None, StoredRecord(1, b"x"), 0)
    with pytest.raises(FencingTokenRejected) as unfenced_key:
        await backend.compare_and_swap_fenced(RUN, None, StoredRecord(1, b"x"), 1)
    assert (unfenced_key.value.current, unfenced_key.value.supplied) == (0, 1)
    token = await backend.reserve_fence(RUN)
    with pytest.raises(FencingTokenRejected):
        await backend.compare_and_swap_fenced(RUN, None, StoredRecord(1, b"x"), token + 1)
    with pytest.raises(FencingRequired) as required:
        await backend.compare_and_swap(RUN, None, StoredRecord(1, b"x"))
    assert required.value.current == token
    assert await backend.compare_and_swap_fenced(RUN, None, StoredRecord(1, b"x"), token) == Stored(
        1
    )


async def test_memory_backend_ceilings_are_u64() -> None:
    backend = VolatileMemoryStore()
    backend.fences[RUN] = 2**64 - 1
    with pytest.raises(FencingTokenExhausted):
        await backend.reserve_fence(RUN)
    backend.records[OTHER_RUN] = StoredRecord(2**64 - 1, b"x")
    backend.floors[OTHER_RUN] = 2**64 - 1
    with pytest.raises(RevisionExhausted):
        await backend.compare_and_swap(OTHER_RUN, 2**64 - 1, StoredRecord(2**64, b"y"))


# Durable databases: SQLite and PostgreSQL --------------------------------


async def test_committed_record_survives_reopening(database: Database) -> None:
    first = database.store()
    committed = await first.create(RUN, b"durable ledger")
    await first.close()
    await first.close()  # idempotent

    second = database.store()
    try:
        assert await second.load(RUN) == committed
        assert await second.integrity_check() == ["ok"]
    finally:
        await second.close()


# SQLite only: the rollback anchor file and the file modes -----


async def test_restored_backup_is_detected_by_the_anchor(tmp_path: Path) -> None:
    path = tmp_path / "db" / "ledger.db"
    anchor = tmp_path / "anchor" / "ledger.anchor"
    anchor.parent.mkdir(mode=0o700)
    initialise_anchor(anchor)

    store = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    await store.create(RUN, b"v1")
    await store.close()  # the last connection checkpoints the WAL into the file
    backup = tmp_path / "backup.db"
    shutil.copy2(path, backup)

    store = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    await store.replace(RUN, 1, b"v2")
    await store.close()
    # Two commits, one record at revision 2: a fixed-size version 2 anchor.
    assert anchor.read_bytes() == head_anchor_bytes(2, [(RUN, 2)])

    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    shutil.copy2(backup, path)

    restored = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    try:
        with pytest.raises(RollbackDetected) as caught:
            await restored.load(RUN)
        assert (caught.value.record_revision, caught.value.revision_floor) == (1, 2)
        with pytest.raises(RollbackDetected):
            await restored.replace(RUN, 1, b"v2 again")
    finally:
        await restored.close()

    # Without the anchor, the same restored file would load silently.
    unanchored = SqliteLedgerStore(path, new_keyring())
    try:
        record = await unanchored.load(RUN)
        assert record is not None and record.revision == 1
    finally:
        await unanchored.close()


async def test_anchor_detects_a_deleted_record_and_one_rolled_back_while_open(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    anchor = tmp_path / "ledger.anchor"
    initialise_anchor(anchor)
    store = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    backdoor = SqliteBackdoor(path)
    try:
        await store.create(RUN, b"v1")
        old = await backdoor.stored(RUN)
        await store.replace(RUN, 1, b"v2")
        # Head and record rolled back together: only the anchor can tell.
        await backdoor.put(RUN, old, 1)
        with pytest.raises(RollbackDetected) as rolled_back:
            await store.load(RUN)
        assert (rolled_back.value.record_revision, rolled_back.value.revision_floor) == (1, 2)

        await backdoor.put(RUN, None, 0)
        with pytest.raises(RollbackDetected) as deleted:
            await store.load(RUN)
        assert (deleted.value.record_revision, deleted.value.revision_floor) == (None, 2)
    finally:
        await store.close()


async def test_configured_anchor_must_exist_and_be_valid(tmp_path: Path) -> None:
    path = tmp_path / "db" / "ledger.db"
    anchor = tmp_path / "ledger.anchor"

    missing = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    with pytest.raises(RollbackAnchorMissing):
        await missing.load(RUN)
    await missing.close()
    assert not path.exists()  # nothing created before the anchor check

    anchor.write_bytes(b'{"format_version":1,"records":[],"extra":1}')
    malformed = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    with pytest.raises(RollbackAnchorInvalid):
        await malformed.load(RUN)
    await malformed.close()


async def test_database_ahead_of_the_anchor_is_accepted_and_the_anchor_rises(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    anchor = tmp_path / "ledger.anchor"
    plain = SqliteLedgerStore(path, new_keyring())
    await plain.create(RUN, b"v1")
    await plain.replace(RUN, 1, b"v2")
    await plain.close()
    # As after a crash between COMMIT and the anchor write: the anchor lags.
    initialise_anchor(anchor)

    store = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    try:
        assert (await store.load(RUN)) == AuthenticatedRecord(2, "storage-v1", b"v2")
        await store.create(OTHER_RUN, b"other")
        # The third commit of the database (two were made without the anchor).
        assert anchor.read_bytes() == head_anchor_bytes(3, [(RUN, 2), (OTHER_RUN, 1)])
        assert mode_of(anchor) == 0o600
        assert not Path(f"{anchor}.tmp").exists()
    finally:
        await store.close()


async def test_anchor_write_failure_fails_the_caller_after_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    anchor = tmp_path / "ledger.anchor"
    initialise_anchor(anchor)
    store = SqliteLedgerStore(path, new_keyring(), anchor_path=anchor)
    try:
        await store.create(RUN, b"v1")
        Path(f"{anchor}.tmp").mkdir()  # the temporary file can no longer be written

        with pytest.raises(StorageBackendError) as caught:
            await store.replace(RUN, 1, b"v2")
        assert "anchor" in str(caught.value)

        Path(f"{anchor}.tmp").rmdir()
        # The database holds the commit; the in-memory anchor already rose.
        record = await store.load(RUN)
        assert record is not None and record.revision == 2

        # The same for several records written in one transaction.
        Path(f"{anchor}.tmp").mkdir()
        with pytest.raises(StorageBackendError) as caught:
            await store.compare_and_swap_many([(RUN, 2, b"v3"), (OTHER, None, b"r1")])
        assert "anchor" in str(caught.value)
        Path(f"{anchor}.tmp").rmdir()
        assert [r.revision for r in [await store.load(RUN), await store.load(OTHER)] if r] == [3, 1]
    finally:
        await store.close()


def test_initialise_anchor_writes_the_empty_document_privately(tmp_path: Path) -> None:
    anchor = tmp_path / "ledger.anchor"
    initialise_anchor(anchor)
    assert anchor.read_bytes() == b'{"format_version":1,"records":[]}'
    assert mode_of(anchor) == 0o600
    with pytest.raises(StorageBackendError):
        initialise_anchor(anchor)
    initialise_anchor(anchor, overwrite=True)
    assert anchor.read_bytes() == b'{"format_version":1,"records":[]}'


async def test_files_are_private(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "host"
    path = directory / "ledger.db"
    store = SqliteLedgerStore(path, new_keyring())
    assert not directory.exists()  # the constructor does no I/O
    try:
        await store.create(RUN, b"v1")
        assert mode_of(directory) == 0o700
        for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
            assert mode_of(directory / name) == 0o600, name
    finally:
        await store.close()


async def test_existing_readable_directory_is_used_with_a_warning(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o755)
    path = directory / "ledger.db"
    path.touch()
    path.chmod(0o644)

    store = SqliteLedgerStore(path, new_keyring())
    try:
        with structlog.testing.capture_logs() as logs:
            await store.create(RUN, b"v1")
        assert mode_of(path) == 0o600
        assert mode_of(directory) == 0o755
        assert [entry["event"] for entry in logs] == ["storage_directory_not_private"]
    finally:
        await store.close()


# Durable databases: several store objects on one database ---------------------


async def test_cas_conflict_between_sequential_writers(database: Database) -> None:
    store = database.store()
    try:
        await store.create(RUN, b"v1")
        await store.replace(RUN, 1, b"v2")
        with pytest.raises(WriteConflict) as caught:
            await store.replace(RUN, 1, b"stale writer")
        assert (caught.value.expected, caught.value.actual, caught.value.revision_floor) == (
            1,
            2,
            2,
        )
        assert (await store.load(RUN)) == AuthenticatedRecord(2, "storage-v1", b"v2")
    finally:
        await store.close()


async def test_concurrent_cas_from_two_store_objects_on_one_database(database: Database) -> None:
    one = database.store()
    two = database.store()
    try:
        await one.create(RUN, b"v1")
        assert (await two.load(RUN)) is not None

        outcomes = await asyncio.gather(
            one.replace(RUN, 1, b"from one"),
            two.replace(RUN, 1, b"from two"),
            return_exceptions=True,
        )
        winners = [o for o in outcomes if isinstance(o, AuthenticatedRecord)]
        losers = [o for o in outcomes if isinstance(o, WriteConflict)]
        assert len(winners) == 1 and len(losers) == 1, outcomes
        assert (losers[0].expected, losers[0].actual, losers[0].revision_floor) == (1, 2, 2)
        assert await one.load(RUN) == winners[0]
        assert await two.load(RUN) == winners[0]
    finally:
        await one.close()
        await two.close()


async def test_concurrent_backend_cas_on_one_database_has_one_winner(database: Database) -> None:
    backends = [database.backend() for _ in range(4)]
    try:
        await backends[0].compare_and_swap(RUN, None, StoredRecord(1, b"v1"))
        outcomes = await asyncio.gather(
            *(
                b.compare_and_swap(RUN, 1, StoredRecord(2, bytes([i])))
                for i, b in enumerate(backends)
            )
        )
        assert sorted(outcomes, key=lambda o: isinstance(o, Conflict)) == [
            Stored(2),
            Conflict(2, 2),
            Conflict(2, 2),
            Conflict(2, 2),
        ]
    finally:
        for b in backends:
            await b.close()


async def test_fences_are_shared_through_the_database(database: Database) -> None:
    one = database.store()
    two = database.store()
    try:
        token_one = await one.reserve_fence(RUN)
        token_two = await two.reserve_fence(RUN)
        assert (token_one, token_two) == (1, 2)
        with pytest.raises(FencingTokenRejected) as caught:
            await one.compare_and_swap_fenced(RUN, None, b"superseded", token_one)
        assert (caught.value.current, caught.value.supplied) == (2, 1)
        assert (await two.compare_and_swap_fenced(RUN, None, b"current", token_two)).revision == 1
    finally:
        await one.close()
        await two.close()


async def test_database_ceilings_are_i64(database: Database) -> None:
    ring = new_keyring()
    store = database.store(ring)
    backdoor = database.backdoor
    try:
        await store.create(RUN, b"v1")
        await backdoor.put(
            RUN, StoredRecord(SQLITE_MAX, seal_record(ring, RUN, SQLITE_MAX, b"top")), SQLITE_MAX
        )
        assert (await store.load(RUN)) == AuthenticatedRecord(SQLITE_MAX, "storage-v1", b"top")
        with pytest.raises(RevisionExhausted):
            await store.replace(RUN, SQLITE_MAX, b"beyond")

        await store.establish_fence(OTHER_RUN, SQLITE_MAX)
        with pytest.raises(FencingTokenExhausted):
            await store.reserve_fence(OTHER_RUN)
        with pytest.raises(FencingTokenExhausted):
            await store.establish_fence(RUN, SQLITE_MAX + 1)
        assert await store.current_fence(OTHER_RUN) == SQLITE_MAX
    finally:
        await store.close()


async def test_cancelled_caller_does_not_interrupt_a_submitted_write(database: Database) -> None:
    backend = database.backend()
    try:
        await backend.load(RUN)  # open first, so the write below is the only step left
        write = asyncio.ensure_future(backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")))
        await asyncio.sleep(0)  # the write is submitted
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        assert await backend.load(RUN) == StorageSnapshot(StoredRecord(1, b"v1"), 1)
    finally:
        await backend.close()


async def test_schema_version_is_recorded_and_newer_schemas_are_refused(
    database: Database,
) -> None:
    store = database.store()
    await store.create(RUN, b"v1")
    await store.close()
    # Schema 2 added the store head (both backends).
    assert await database.backdoor.schema_version() == [2]
    await database.backdoor.set_schema_version(99)

    newer = database.store()
    with pytest.raises(StorageBackendError) as caught:
        await newer.load(RUN)
    assert "schema" in str(caught.value)
    await newer.close()


async def test_closed_store_refuses_work(database: Database) -> None:
    store = database.store()
    await store.create(RUN, b"v1")
    await store.close()
    with pytest.raises(StorageBackendError):
        await store.load(RUN)


async def test_unusable_database_path_is_a_backend_error(tmp_path: Path) -> None:
    (tmp_path / "ledger.db").mkdir()
    store = SqliteLedgerStore(tmp_path / "ledger.db", new_keyring())
    with pytest.raises(StorageBackendError):
        await store.load(RUN)
    await store.close()


# Key files (one reader, one rule for every key file) ------------------------------


def write_key_file(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    "content",
    [bytes(range(32)), bytes(range(32)).hex().encode(), bytes(range(32)).hex().encode() + b"\n"],
    ids=["raw", "hex", "hex-newline"],
)
def test_storage_key_file_formats(tmp_path: Path, content: bytes) -> None:
    key = load_storage_key(write_key_file(tmp_path / "storage.key", content))
    assert key == StorageKey(bytes(range(32)))


@pytest.mark.parametrize(
    "content",
    [
        bytes(31),
        bytes(33),
        bytes(range(32)).hex().encode() + b"\n\n",
        bytes(range(32)).hex().encode() + b" ",
        b"zz" * 32,
        b"",
    ],
)
def test_storage_key_file_with_a_bad_format(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(InvalidStorageKey) as caught:
        load_storage_key(write_key_file(tmp_path / "storage.key", content))
    assert "format" in "".join(getattr(caught.value, "__notes__", []))


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_storage_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    secret = bytes(range(32)).hex().encode()
    with pytest.raises(InvalidStorageKey) as caught:
        load_storage_key(write_key_file(tmp_path / "storage.key", secret, mode))
    assert "permissions" in "".join(getattr(caught.value, "__notes__", []))
    assert secret.decode() not in str(caught.value) + repr(caught.value)


def test_storage_key_file_must_be_a_readable_regular_file(tmp_path: Path) -> None:
    directory = tmp_path / "keys"
    directory.mkdir(mode=0o700)
    with pytest.raises(InvalidStorageKey):
        load_storage_key(directory)
    with pytest.raises(InvalidStorageKey):
        load_storage_key(tmp_path / "absent.key")
    # A link is refused like every other key file: the file itself is judged.
    link = tmp_path / "link.key"
    os.symlink(write_key_file(tmp_path / "real.key", bytes(32)), link)
    with pytest.raises(InvalidStorageKey) as caught:
        load_storage_key(link)
    assert "unreadable" in "".join(getattr(caught.value, "__notes__", []))
    assert load_storage_key(tmp_path / "real.key") == StorageKey(bytes(32))


def test_storage_key_file_in_uppercase_hex_is_refused(tmp_path: Path) -> None:
    upper = bytes(range(32)).hex().upper().encode()
    with pytest.raises(InvalidStorageKey) as caught:
        load_storage_key(write_key_file(tmp_path / "storage.key", upper))
    assert "format" in "".join(getattr(caught.value, "__notes__", []))


# AuthenticatedStore against a backend whose answer disagrees with its snapshot -------------


class RacingBackend(VolatileMemoryStore):
    """Answers every CAS with a fixed outcome, as if another writer got there first."""

    def __init__(self, outcome: Stored | Conflict) -> None:
        super().__init__()
        self.outcome = outcome

    async def compare_and_swap(
        self, key: StorageRecordKey, expected_revision: int | None, replacement: StoredRecord
    ) -> Stored | Conflict:
        return self.outcome


@pytest.mark.parametrize(
    ("outcome", "error", "fields"),
    [
        (Stored(7), RevisionFloorMismatch, (1, 7)),
        (Conflict(2, 2), WriteConflict, (None, 2, 2)),
        (Conflict(1, 2), RollbackDetected, (1, 2)),
        (Conflict(None, 3), RollbackDetected, (None, 3)),
        (Conflict(3, 2), RevisionFloorMismatch, (3, 2)),
    ],
)
async def test_backend_outcomes_are_checked_after_the_swap(
    outcome: Stored | Conflict, error: type[Exception], fields: tuple[object, ...]
) -> None:
    store = AuthenticatedStore(RacingBackend(outcome), new_keyring())
    with pytest.raises(error) as caught:
        await store.create(RUN, b"v1")
    names = (
        ("expected", "actual", "revision_floor")
        if error is WriteConflict
        else (
            "record_revision",
            "revision_floor",
        )
    )
    assert tuple(getattr(caught.value, name) for name in names) == fields


async def test_memory_store_revision_exhausted_at_u64() -> None:
    ring = new_keyring()
    backend = VolatileMemoryStore()
    store = AuthenticatedStore(backend, ring)
    top = 2**64 - 1
    backend.records[RUN] = StoredRecord(top, seal_record(ring, RUN, top, b"top"))
    backend.floors[RUN] = top
    assert (await store.load(RUN)) == AuthenticatedRecord(top, "storage-v1", b"top")
    with pytest.raises(RevisionExhausted):
        await store.replace(RUN, top, b"beyond")
    assert backend.floors[RUN] == top


async def test_item_whose_head_row_was_deleted_is_not_mistaken_for_absence(
    database: Database,
) -> None:
    store = database.store()
    try:
        await store.create(RUN, b"v1")
        await database.backdoor.delete_heads()
        with pytest.raises(RevisionFloorMismatch) as caught:
            await store.load(RUN)
        assert (caught.value.record_revision, caught.value.revision_floor) == (1, 0)
        with pytest.raises(RevisionFloorMismatch):
            await store.create(RUN, b"overwrite")
    finally:
        await store.close()


# Group commit ---------------------------------------------------------------


async def test_concurrent_writes_share_transactions_and_keep_their_own_outcomes(
    database: Database,
) -> None:
    backend = database.backend()
    store = AuthenticatedStore(backend, new_keyring())
    keys = [StorageRecordKey("workflow-ledger", f"run-{i}") for i in range(40)]
    try:
        await store.create(keys[0], b"first")
        await backend.reserve_fence(keys[1])  # plain writes to it are refused
        before = backend.group_commit_stats
        outcomes = await asyncio.gather(
            *(store.create(key, f"v{i}".encode()) for i, key in enumerate(keys)),
            # Two writers of one key in the same batch: the second sees the first.
            store.replace(keys[2], 1, b"second"),
            store.replace(keys[2], 1, b"loser"),
            return_exceptions=True,
        )
        transactions, writes = (
            now - then for now, then in zip(backend.group_commit_stats, before, strict=True)
        )
        assert writes == 42
        assert transactions < writes  # several writes per transaction
        assert isinstance(outcomes[0], WriteConflict)
        assert isinstance(outcomes[1], FencingRequired)
        assert outcomes[2] == AuthenticatedRecord(1, "storage-v1", b"v2")
        assert all(
            outcomes[i] == AuthenticatedRecord(1, "storage-v1", f"v{i}".encode())
            for i in range(3, 40)
        )
        assert outcomes[40] == AuthenticatedRecord(2, "storage-v1", b"second")
        assert isinstance(outcomes[41], WriteConflict)
    finally:
        await store.close()
    # Everything the callers were told is on disk, and nothing else.
    reopened = database.store()
    try:
        assert (await reopened.load(keys[0])) == AuthenticatedRecord(1, "storage-v1", b"first")
        assert await reopened.load(keys[1]) is None
        assert (await reopened.load(keys[2])) == AuthenticatedRecord(2, "storage-v1", b"second")
        for i in range(3, 40):
            assert (await reopened.load(keys[i])) == AuthenticatedRecord(
                1, "storage-v1", f"v{i}".encode()
            )
    finally:
        await reopened.close()


async def test_a_database_error_fails_every_write_of_its_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("octo_host.storage.sqlite.SQLITE_BUSY_TIMEOUT_SECONDS", 0.2)
    path = tmp_path / "ledger.db"
    backend = SqliteRecordBackend(path)
    keys = [StorageRecordKey("workflow-ledger", f"run-{i}") for i in range(8)]
    try:
        await backend.load(keys[0])  # open
        # Another connection holds the write lock longer than the busy timeout
        # allows: BEGIN IMMEDIATE fails for the whole group.
        blocker = sqlite3.connect(path, isolation_level=None, timeout=0)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(
                    *(backend.compare_and_swap(k, None, StoredRecord(1, b"x")) for k in keys),
                    return_exceptions=True,
                ),
                timeout=30,
            )
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        assert all(isinstance(o, StorageBackendError) for o in outcomes)
        assert len({id(o) for o in outcomes}) == len(keys)  # one instance per caller
        assert all("SQLITE_BUSY" in str(o) for o in outcomes)
        for key in keys:
            assert await backend.load(key) == StorageSnapshot(None, 0)
    finally:
        await backend.close()


async def test_a_defect_in_the_database_thread_fails_its_batch_and_not_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = SqliteRecordBackend(tmp_path / "ledger.db")
    original = SqliteRecordBackend._write_group
    calls = 0

    def broken_once(self: SqliteRecordBackend, writes: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("defect")
        return original(self, writes)

    monkeypatch.setattr(SqliteRecordBackend, "_write_group", broken_once)
    try:
        with pytest.raises(StorageBackendError, match="RuntimeError"):
            await asyncio.wait_for(
                backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")), timeout=10
            )
        # The thread is still serving.
        assert await backend.compare_and_swap(RUN, None, StoredRecord(1, b"v1")) == Stored(1)
        assert await backend.load(RUN) == StorageSnapshot(StoredRecord(1, b"v1"), 1)
    finally:
        await backend.close()


async def test_a_defect_in_one_write_fails_that_caller_only(database: Database) -> None:
    backend = database.backend()
    keys = [StorageRecordKey("workflow-ledger", name) for name in ("a", "b", "c")]

    def broken_opener(snapshot: StorageSnapshot) -> None:
        raise ValueError("a defect in this caller's check")

    try:
        await backend.load(keys[0])  # open, so the three writes below share a group
        outcomes = await asyncio.gather(
            backend.compare_and_swap(keys[0], None, StoredRecord(1, b"a")),
            backend.compare_and_swap_opened(keys[1], None, StoredRecord(1, b"b"), broken_opener),
            backend.reserve_fence(keys[2]),
            return_exceptions=True,
        )
        assert outcomes[0] == Stored(1)
        assert isinstance(outcomes[1], StorageBackendError)
        assert "ValueError" in str(outcomes[1])
        assert outcomes[2] == 1
        assert await backend.load(keys[0]) == StorageSnapshot(StoredRecord(1, b"a"), 1)
        assert await backend.load(keys[1]) == StorageSnapshot(None, 0)
    finally:
        await backend.close()


async def test_every_close_waits_for_the_work_submitted_before_the_first(tmp_path: Path) -> None:
    backend = SqliteRecordBackend(tmp_path / "ledger.db")
    await backend.load(RUN)

    def slow_write(connection: sqlite3.Connection) -> Stored:
        time.sleep(0.3)
        connection.execute(
            "INSERT INTO heads (namespace, name, revision, fence) VALUES (?, ?, 1, 0)",
            (RUN.namespace, RUN.name),
        )
        return Stored(1)

    write = backend._submit("slow_write", slow_write, write=True)
    first = asyncio.ensure_future(backend.close())
    await asyncio.sleep(0)
    await backend.close()  # the second close returns only once the thread is done
    assert write.done() and write.result() == Stored(1)
    await first
    with pytest.raises(StorageBackendError, match="closed"):
        await backend.load(RUN)


async def test_a_thread_that_cannot_start_fails_the_call_and_not_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    backend = SqliteRecordBackend(tmp_path / "ledger.db")
    original = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(StorageBackendError, match="database thread"):
        await backend.load(RUN)
    monkeypatch.setattr(threading.Thread, "start", original)
    try:
        assert await asyncio.wait_for(backend.load(RUN), timeout=10) == StorageSnapshot(None, 0)
    finally:
        await asyncio.wait_for(backend.close(), timeout=10)


async def test_an_unknown_decided_state_is_refused_as_an_octo_error(env: Env) -> None:
    from octo_host.audit import ResolutionRefused, load_audit, resolve_operation
    from octo_host.engine import WorkflowEngine
    from octo_host.plan import WorkflowStep

    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "publish the notes")])
    ledger = engine.operation_ledger(plan)
    ledger.record("publish", "files.publish", "op-stuck", b"input")
    await env.store.create(RUN, ledger.to_json().encode("utf-8"))

    for state in ("exploded", "Failed", ""):
        with pytest.raises(ResolutionRefused, match="must be succeeded, failed or cancelled"):
            await resolve_operation(
                env.store, RUN.name, "op-stuck", state, operator="alice", reason="checked"
            )
    assert await load_audit(env.store, RUN.name) == []  # nothing was written
    stored = await env.store.load(RUN)
    assert stored is not None and stored.revision == 1


@pytest.mark.parametrize("kind", ["sqlite", "memory"])
async def test_a_namespace_lists_the_names_of_its_records(tmp_path: Path, kind: str) -> None:
    store = (
        SqliteLedgerStore(tmp_path / "ledger.sqlite3", new_keyring())
        if kind == "sqlite"
        else AuthenticatedStore(VolatileMemoryStore(), new_keyring())
    )
    try:
        assert await store.names("workflow-ledger") == []
        for run in ("run-b", "run-a"):
            await store.create(ledger_record_key(run), b"{}")
        await store.create(StorageRecordKey("workflow-audit", "run-c"), b"{}")
        assert await store.names("workflow-ledger") == ["run-a", "run-b"]
        assert await store.names("workflow-audit") == ["run-c"]
    finally:
        await store.close()
