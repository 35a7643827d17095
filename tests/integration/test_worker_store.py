"""The worker journal store on real databases.

One suite for both backends: every test that takes ``journal_db`` runs on a
SQLite file and on a PostgreSQL schema (``journal_backends``), and edits the
database behind the store's back through the same back door. Inherently
SQLite-file tests take ``db_path`` and run on SQLite only:

* the rollback anchor file (a restored older database, a database ahead of
  its anchor, a head rolled back while open, a malformed anchor, a failed
  anchor write, a chain never landing on a commit whose anchor write
  failed): the PostgreSQL store keeps no anchor file (see
  ``octo_worker.storage.postgres``);
* file and directory modes (``test_files_are_private``);
* journals of SQLite schema 2 (``test_sessions_closed_before_schema_3_...``).
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import random
import shutil
import sqlite3
import stat
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from octo_common.errors import (
    FencingTokenExhausted,
    FencingTokenRejected,
    InvalidEnvelope,
    InvalidJournalLease,
    InvalidRecordAuthenticationTag,
    OperationJournalScopeMismatch,
    RecordLocationMismatch,
    RevisionExhausted,
    RevisionFloorMismatch,
    RevisionMismatch,
    RollbackAnchorInvalid,
    RollbackAnchorMissing,
    RollbackDetected,
    SessionReplay,
    StorageBackendError,
    UnknownKeyId,
    WriteConflict,
)
from octo_common.limits import SQLITE_MAX_INTEGER
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Pending, Succeeded
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import (
    OutboxEntry,
    SessionDocuments,
    SqliteJournalStore,
    WorkerCommit,
    WorkerJournalLease,
)

from .journal_backends import JournalDatabase

# The anchor entry of a journal whose scope heads carry digests (schema 5).
DIGEST_MARK = (
    b'{"namespace":"worker-journal-format","name":"scope-row-digest","revision":5},'
    b'{"namespace":"worker-journal-format","name":"store-head","revision":7}'
)
SCOPE = "tenant-release"
OTHER_SCOPE = "tenant-audit"
SECRET_TEXT = "very-secret-output-7f3a"


def storage_keyring(key_id: str = "storage-v1", fill: int = 1) -> StorageKeyring:
    return StorageKeyring(key_id, bytes([fill]) * 32)


def data_keyring(key_id: str = "data-v1", fill: int = 9) -> StorageKeyring:
    return StorageKeyring(key_id, bytes([fill]) * 32)


def fingerprint(text: str) -> str:
    return blake3.blake3(text.encode()).hexdigest()


def pending(key: str, tag: str = "") -> WorkerOperationRecord:
    return WorkerOperationRecord("math.add", key, fingerprint(key + tag), Pending())


def succeeded(key: str, text: str = SECRET_TEXT) -> WorkerOperationRecord:
    return WorkerOperationRecord(
        "math.add", key, fingerprint(key), Succeeded(ToolPayload.text(text))
    )


def rows(scope: str, *changes: tuple[WorkerOperationRecord, int | None]) -> WorkerCommit:
    return WorkerCommit(
        JournalChangeset(
            scope,
            {record.operation_key: JournalRowChange(record, base) for record, base in changes},
        )
    )


def state_doc(scope: str, session_id: str, status: str = "open", counter: int = 0) -> bytes:
    return (
        f'{{"format_version":1,"scope":"{scope}","session_id":"{session_id}",'
        f'"status":"{status}","next_outgoing":{counter}}}'
    ).encode()


def opening_doc(scope: str, session_id: str) -> bytes:
    return (
        f'{{"format_version":1,"scope":"{scope}","session_id":"{session_id}",'
        f'"reply_to":"host.replies"}}'
    ).encode()


def outbox(session_id: str, frame: bytes, correlation_id: str | None = "req-1") -> OutboxEntry:
    return OutboxEntry(
        blake3.blake3(frame).hexdigest(), session_id, "host.replies", correlation_id, frame
    )


def sql(
    path: Path, statement: str, parameters: tuple[object, ...] = ()
) -> list[tuple[object, ...]]:
    """Edit or read the database behind the store's back, as an attacker would."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        return connection.execute(statement, parameters).fetchall()
    finally:
        connection.close()


def drop_head_digests(connection: sqlite3.Connection) -> None:
    """Take the scope heads back to schema 4 (no digest, no seal, no request rows index,
    no store head)."""
    connection.execute("DROP TABLE IF EXISTS store_head")
    connection.execute("DROP INDEX IF EXISTS items_request_sessions")
    for column in ("row_count", "digest", "key_id", "auth_tag"):
        connection.execute(f"ALTER TABLE heads DROP COLUMN {column}")


def envelopes(path: Path) -> list[bytes]:
    return [bytes(row[0]) for row in sql(path, "SELECT envelope FROM items")]  # type: ignore[call-overload]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "journal" / "worker.db"


@pytest.fixture
async def store(journal_db: JournalDatabase) -> AsyncIterator[JournalStoreBase]:
    journal_store = journal_db.store(storage_keyring())
    yield journal_store
    await journal_store.close()


# Round trip --------------------------------------------------------------------------


async def test_reserve_commit_load_round_trip(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    assert lease.token == 1
    first = await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    second = await store.commit(
        SCOPE, lease, rows(SCOPE, (succeeded("op-1"), first), (pending("op-2"), None))
    )

    loaded = await store.load_records(SCOPE, ["op-1", "op-2", "op-3"])
    assert (first, second) == (1, 2)
    assert loaded == {
        "op-1": (succeeded("op-1"), 2),
        "op-2": (pending("op-2"), 2),
        "op-3": None,
    }
    assert await store.head_revision(SCOPE) == 2
    assert await store.head_revision(OTHER_SCOPE) == 0
    assert await store.scopes() == [SCOPE]
    assert await store.list_records(SCOPE) == [(succeeded("op-1"), 2), (pending("op-2"), 2)]
    assert await store.integrity_check() == ["ok"]


async def test_scopes_are_independent(store: JournalStoreBase) -> None:
    lease_a = await store.reserve_fence(SCOPE)
    lease_b = await store.reserve_fence(OTHER_SCOPE)
    await store.commit(SCOPE, lease_a, rows(SCOPE, (pending("op-1"), None)))
    revision_b = await store.commit(
        OTHER_SCOPE, lease_b, rows(OTHER_SCOPE, (pending("op-1"), None))
    )

    assert revision_b == 1
    assert (await store.load_records(OTHER_SCOPE, ["op-1"]))["op-1"] == (pending("op-1"), 1)
    assert sorted(await store.scopes()) == sorted([SCOPE, OTHER_SCOPE])


async def test_every_commit_advances_the_revision_even_when_empty(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    revisions = [await store.commit(SCOPE, lease, WorkerCommit()) for _ in range(3)]
    assert revisions == [1, 2, 3]


async def test_reopened_store_reads_rows_and_keeps_the_fence(journal_db: JournalDatabase) -> None:
    first = journal_db.store(storage_keyring())
    lease = await first.reserve_fence(SCOPE)
    await first.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), None)))
    await first.close()

    second = journal_db.store(storage_keyring())
    try:
        new_lease = await second.reserve_fence(SCOPE)
        loaded = await second.load_records(SCOPE, ["op-1"])
        revision = await second.commit(SCOPE, new_lease, rows(SCOPE, (pending("op-2"), None)))
    finally:
        await second.close()
    assert new_lease.token == 2
    assert loaded == {"op-1": (succeeded("op-1"), 1)}
    assert revision == 2


# Leases and fences -------------------------------------------------------------------


async def test_a_lease_has_no_public_constructor_and_a_redacted_repr(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    with pytest.raises(TypeError):
        WorkerJournalLease(1)
    with pytest.raises(AttributeError):
        lease._token = 5
    assert "1" not in repr(lease)
    with pytest.raises(InvalidJournalLease):
        await store.commit(SCOPE, 1, WorkerCommit())  # type: ignore[arg-type]
    # Every scope's first fence is 1: the lease still belongs to its own scope.
    other_lease = await store.reserve_fence(OTHER_SCOPE)
    assert other_lease.token == lease.token and other_lease != lease
    with pytest.raises(InvalidJournalLease):
        await store.commit(OTHER_SCOPE, lease, WorkerCommit())
    with pytest.raises(TypeError):
        copy.copy(lease)
    with pytest.raises(TypeError):
        pickle.dumps(lease)


async def test_a_superseded_fence_cannot_write(journal_db: JournalDatabase) -> None:
    store_a = journal_db.store(storage_keyring())
    store_b = journal_db.store(storage_keyring())
    try:
        lease_a = await store_a.reserve_fence(SCOPE)
        lease_b = await store_b.reserve_fence(SCOPE)
        with pytest.raises(FencingTokenRejected) as rejected:
            await store_a.commit(SCOPE, lease_a, rows(SCOPE, (pending("op-1"), None)))
        revision = await store_b.commit(SCOPE, lease_b, rows(SCOPE, (pending("op-1"), None)))
    finally:
        await store_a.close()
        await store_b.close()
    assert (rejected.value.current, rejected.value.supplied) == (2, 1)
    assert revision == 1


async def test_a_head_moved_by_another_writer_is_a_write_conflict(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    # Another writer advanced the head without taking the fence.
    await journal_db.raise_head(SCOPE)

    with pytest.raises(WriteConflict) as conflict:
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
    assert (conflict.value.expected, conflict.value.actual) == (1, 2)


async def test_a_lease_used_by_a_store_that_never_reserved_conflicts(
    journal_db: JournalDatabase,
) -> None:
    owner = journal_db.store(storage_keyring())
    stranger = journal_db.store(storage_keyring())
    try:
        lease = await owner.reserve_fence(SCOPE)
        await owner.commit(SCOPE, lease, WorkerCommit())
        # Loads never set a baseline.
        await stranger.load_records(SCOPE, ["op-1"])
        with pytest.raises(WriteConflict):
            await stranger.commit(SCOPE, lease, WorkerCommit())
    finally:
        await owner.close()
        await stranger.close()


async def test_fence_and_revision_exhaustion(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    await store.reserve_fence(SCOPE)
    maximum = SQLITE_MAX_INTEGER - 1
    await journal_db.set_head(SCOPE, storage_keyring(), fence=maximum, revision=maximum)
    lease = await store.reserve_fence(SCOPE)
    assert lease.token == SQLITE_MAX_INTEGER
    with pytest.raises(FencingTokenExhausted):
        await store.reserve_fence(SCOPE)

    await store.commit(SCOPE, lease, WorkerCommit())
    with pytest.raises(RevisionExhausted):
        await store.commit(SCOPE, lease, WorkerCommit())
    assert await store.head_revision(SCOPE) == SQLITE_MAX_INTEGER


# Row checks -------------------------------------------------------------------------


async def test_stale_base_revision_is_a_write_conflict(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), 1)))

    with pytest.raises(WriteConflict) as stale:
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1", "x"), 1)))
    with pytest.raises(WriteConflict) as recreated:
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1", "x"), None)))
    with pytest.raises(WriteConflict) as absent:
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-9"), 2)))

    assert (stale.value.expected, stale.value.actual, stale.value.revision_floor) == (1, 2, 2)
    assert (recreated.value.expected, recreated.value.actual) == (None, 2)
    assert (absent.value.expected, absent.value.actual) == (2, None)
    assert (await store.load_records(SCOPE, ["op-1"]))["op-1"] == (succeeded("op-1"), 2)


async def test_a_conflicting_change_set_is_excluded_alone_from_a_group_commit(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-0"), None)))
    before = store.stats.transactions

    commits = [rows(SCOPE, (pending(f"op-{i}"), None)) for i in range(1, 10)]
    commits.insert(4, rows(SCOPE, (succeeded("op-0"), 7)))  # stale base revision
    outcomes = await asyncio.gather(
        *(store.commit(SCOPE, lease, change) for change in commits), return_exceptions=True
    )

    assert isinstance(outcomes[4], WriteConflict)
    assert outcomes[:4] + outcomes[5:] == list(range(2, 11))  # submission order
    assert store.stats.transactions - before == 1
    loaded = await store.load_records(SCOPE, ["op-0", *(f"op-{i}" for i in range(1, 10))])
    assert loaded["op-0"] == (pending("op-0"), 1)
    assert all(loaded[f"op-{i}"] is not None for i in range(1, 10))


async def test_mismatched_changeset_locations_are_refused_before_any_io(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    wrong_scope = rows(OTHER_SCOPE, (pending("op-1"), None))
    wrong_key = WorkerCommit(
        JournalChangeset(SCOPE, {"op-2": JournalRowChange(pending("op-1"), None)})
    )
    with pytest.raises(OperationJournalScopeMismatch):
        await store.commit(SCOPE, lease, wrong_scope)
    with pytest.raises(RecordLocationMismatch):
        await store.commit(SCOPE, lease, wrong_key)
    assert await store.head_revision(SCOPE) == 0


# Sessions ----------------------------------------------------------------------------


async def test_sessions_round_trip_and_replay_is_refused(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    opened = await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            sessions={
                "sess-1": SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"))
            }
        ),
    )
    updated = await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            sessions={
                "sess-1": SessionDocuments(state_doc(SCOPE, "sess-1", "closed", 3), None, opened)
            }
        ),
    )
    with pytest.raises(SessionReplay) as replay:
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                sessions={
                    "sess-1": SessionDocuments(
                        state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1")
                    )
                }
            ),
        )
    with pytest.raises(WriteConflict):
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                sessions={"sess-1": SessionDocuments(state_doc(SCOPE, "sess-1"), None, opened)}
            ),
        )

    sessions = await store.load_sessions(SCOPE)
    assert replay.value.session_id == "sess-1"
    session = sessions["sess-1"]
    assert (session.status, session.revision) == ("closed", updated)
    assert session.state == state_doc(SCOPE, "sess-1", "closed", 3)
    assert session.opening == opening_doc(SCOPE, "sess-1")


async def test_a_replayed_session_fails_alone_inside_a_group_commit(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)

    def open_session(session_id: str) -> WorkerCommit:
        documents = SessionDocuments(state_doc(SCOPE, session_id), opening_doc(SCOPE, session_id))
        return WorkerCommit(sessions={session_id: documents})

    await store.commit(SCOPE, lease, open_session("sess-1"))
    outcomes = await asyncio.gather(
        store.commit(SCOPE, lease, open_session("sess-2")),
        store.commit(SCOPE, lease, open_session("sess-1")),
        store.commit(SCOPE, lease, open_session("sess-3")),
        return_exceptions=True,
    )

    assert outcomes[0] == 2 and outcomes[2] == 3
    assert isinstance(outcomes[1], SessionReplay) and outcomes[1].session_id == "sess-1"
    assert sorted(await store.load_sessions(SCOPE)) == ["sess-1", "sess-2", "sess-3"]


async def test_session_documents_must_name_their_row(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    with pytest.raises(RecordLocationMismatch):
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                sessions={
                    "sess-1": SessionDocuments(
                        state_doc(SCOPE, "sess-2"), opening_doc(SCOPE, "sess-1")
                    )
                }
            ),
        )
    with pytest.raises(RecordLocationMismatch):
        await store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                sessions={
                    "sess-1": SessionDocuments(
                        state_doc(SCOPE, "sess-1"), opening_doc(OTHER_SCOPE, "sess-1")
                    )
                }
            ),
        )
    assert await store.load_sessions(SCOPE) == {}


# Outbox --------------------------------------------------------------------------------


async def test_outbox_insert_delete_and_load_order(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    frames = [f'{{"frame":{i}}}'.encode() for i in range(4)]
    first = await store.commit(
        SCOPE,
        lease,
        WorkerCommit(outbox_insert=[outbox("sess-1", frames[2]), outbox("sess-1", frames[0])]),
    )
    second = await store.commit(
        SCOPE, lease, WorkerCommit(outbox_insert=[outbox("sess-2", frames[1], None)])
    )
    loaded = await store.load_outbox(SCOPE)
    third = await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            outbox_insert=[outbox("sess-1", frames[3])],
            outbox_delete=[loaded[0].message_id, loaded[2].message_id],
        ),
    )
    after = await store.load_outbox(SCOPE)

    assert [(entry.frame, entry.revision) for entry in loaded] == [
        (frames[2], first),
        (frames[0], first),
        (frames[1], second),
    ]
    assert loaded[2].correlation_id is None and loaded[2].session_id == "sess-2"
    assert [(entry.frame, entry.revision) for entry in after] == [
        (frames[0], first),
        (frames[3], third),
    ]


def test_value_reprs_never_show_documents_or_frames() -> None:
    frame = b'{"secret":"' + SECRET_TEXT.encode() + b'"}'
    values = [
        outbox("sess-1", frame),
        SessionDocuments(frame, frame, 3),
        WorkerCommit(outbox_insert=[outbox("sess-1", frame)]),
    ]
    assert all(SECRET_TEXT not in repr(value) for value in values)


async def test_outbox_message_id_must_be_the_frame_digest(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    entry = outbox("sess-1", b'{"frame":1}')
    forged = OutboxEntry("0" * 64, entry.session_id, entry.reply_to, None, entry.frame)
    with pytest.raises(RecordLocationMismatch):
        await store.commit(SCOPE, lease, WorkerCommit(outbox_insert=[forged]))


# Tampering fails closed --------------------------------------------------------------------


async def test_a_tampered_envelope_fails_closed(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), None)))
    envelope = await journal_db.envelope("op-1")
    tag_start = envelope.index(b'"auth_tag":"') + len(b'"auth_tag":"')
    flipped = b"1" if envelope[tag_start : tag_start + 1] != b"1" else b"2"
    tampered = envelope[:tag_start] + flipped + envelope[tag_start + 1 :]
    await journal_db.set_envelope("op-1", tampered)

    with pytest.raises(InvalidRecordAuthenticationTag):
        await store.load_records(SCOPE, ["op-1"])


async def test_a_failing_load_fails_alone_among_concurrent_loads(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None), (pending("op-2"), None)))
    await journal_db.set_envelope("op-2", b"{}")

    outcomes = await asyncio.gather(
        store.load_records(SCOPE, ["op-1"]),
        store.load_records(SCOPE, ["op-2"]),
        store.head_revision(SCOPE),
        return_exceptions=True,
    )

    assert outcomes[0] == {"op-1": (pending("op-1"), 1)}
    assert isinstance(outcomes[1], InvalidEnvelope)
    assert outcomes[2] == 1


async def test_row_revision_edits_fail_closed(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))

    await journal_db.set_revision("op-1", 2)
    with pytest.raises(RevisionMismatch):
        await store.load_records(SCOPE, ["op-1"])
    await journal_db.set_revision("op-1", 3)
    with pytest.raises(RevisionFloorMismatch):
        await store.load_records(SCOPE, ["op-1"])


async def test_rows_transplanted_to_another_scope_or_key_fail_closed(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    other_lease = await store.reserve_fence(OTHER_SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), None)))
    await store.commit(OTHER_SCOPE, other_lease, rows(OTHER_SCOPE, (pending("op-7"), None)))
    # Another scope: same key, same revision, different tag location.
    await journal_db.copy_row("op-1", SCOPE, to_scope=OTHER_SCOPE, to_item="op-1")
    # Another key of the same scope: the tag passes, the document names op-1.
    await journal_db.copy_row("op-1", SCOPE, to_scope=SCOPE, to_item="op-2")

    with pytest.raises(InvalidRecordAuthenticationTag):
        await store.load_records(OTHER_SCOPE, ["op-1"])
    with pytest.raises(RecordLocationMismatch):
        await store.load_records(SCOPE, ["op-2"])
    assert (await store.load_records(SCOPE, ["op-1"]))["op-1"] == (succeeded("op-1"), 1)


async def test_a_session_row_moved_to_another_session_fails_closed(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await store.commit(
        SCOPE,
        lease,
        WorkerCommit(
            sessions={
                "sess-1": SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"))
            }
        ),
    )
    await journal_db.rename_items("worker-session", "sess-2")
    with pytest.raises(RecordLocationMismatch):
        await store.load_sessions(SCOPE)


async def test_a_session_missing_half_of_its_rows_fails_closed(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    documents = SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"))
    await store.commit(SCOPE, lease, WorkerCommit(sessions={"sess-1": documents}))
    await journal_db.delete_rows("worker-session-open")
    with pytest.raises(RollbackDetected):
        await store.load_sessions(SCOPE)


# Keys --------------------------------------------------------------------------------------


async def test_unknown_and_wrong_storage_keys_fail_closed(journal_db: JournalDatabase) -> None:
    writer = journal_db.store(storage_keyring("storage-v1", 1))
    lease = await writer.reserve_fence(SCOPE)
    await writer.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    await writer.close()

    unknown = journal_db.store(storage_keyring("storage-v2", 1))
    wrong = journal_db.store(storage_keyring("storage-v1", 2))
    try:
        with pytest.raises(UnknownKeyId):
            await unknown.load_records(SCOPE, ["op-1"])
        with pytest.raises(InvalidRecordAuthenticationTag):
            await wrong.load_records(SCOPE, ["op-1"])
    finally:
        await unknown.close()
        await wrong.close()


async def test_storage_key_rotation_reads_old_rows_and_writes_new_ones(
    journal_db: JournalDatabase,
) -> None:
    keyring = storage_keyring("storage-v1", 1)
    store = journal_db.store(keyring)
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        keyring.rotate_to("storage-v2", bytes([2]) * 32)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
        loaded = await store.load_records(SCOPE, ["op-1", "op-2"])
        keyring.retire("storage-v1")
        with pytest.raises(UnknownKeyId):
            await store.load_records(SCOPE, ["op-1"])
    finally:
        await store.close()
    assert loaded == {"op-1": (pending("op-1"), 1), "op-2": (pending("op-2"), 2)}
    assert any(b'"key_id":"storage-v2"' in envelope for envelope in await journal_db.envelopes())


async def test_data_encryption_hides_payloads_and_rotates(journal_db: JournalDatabase) -> None:
    data_keys = data_keyring("data-v1", 9)
    store = journal_db.store(storage_keyring(), data_keyring=data_keys)
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), None)))
        data_keys.rotate_to("data-v2", bytes([10]) * 32)
        await store.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-2"), None)))
        loaded = await store.load_records(SCOPE, ["op-1", "op-2"])
    finally:
        await store.close()

    assert loaded == {"op-1": (succeeded("op-1"), 1), "op-2": (succeeded("op-2"), 2)}
    raw = await journal_db.raw_bytes()
    assert SECRET_TEXT.encode() not in raw
    assert b"op-1" not in b"".join(await journal_db.envelopes())


async def test_wrong_or_unknown_data_key_fails_closed(journal_db: JournalDatabase) -> None:
    writer = journal_db.store(storage_keyring(), data_keyring=data_keyring("data-v1", 9))
    lease = await writer.reserve_fence(SCOPE)
    await writer.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), None)))
    await writer.close()

    wrong = journal_db.store(storage_keyring(), data_keyring=data_keyring("data-v1", 8))
    unknown = journal_db.store(storage_keyring(), data_keyring=data_keyring("data-v2", 9))
    try:
        with pytest.raises(InvalidEnvelope):
            await wrong.load_records(SCOPE, ["op-1"])
        with pytest.raises(UnknownKeyId):
            await unknown.load_records(SCOPE, ["op-1"])
    finally:
        await wrong.close()
        await unknown.close()


# Rollback anchor ---------------------------------------------------------------------------


def snapshot(db_path: Path, into: Path) -> None:
    into.mkdir()
    for suffix in ("", "-wal", "-shm"):
        source = Path(str(db_path) + suffix)
        if source.exists():
            shutil.copy2(source, into / source.name)


def restore(db_path: Path, source: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(str(db_path) + suffix).unlink(missing_ok=True)
    for saved in source.iterdir():
        shutil.copy2(saved, db_path.parent / saved.name)


async def test_restoring_an_older_database_is_detected_by_the_anchor(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "anchor" / "worker.anchor"
    anchor.parent.mkdir()
    missing = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    with pytest.raises(RollbackAnchorMissing):
        await missing.scopes()
    await missing.close()
    anchor.write_bytes(b'{"format_version":1,"records":[]}')

    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
    await store.close()
    snapshot(db_path, tmp_path / "old")
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
    await store.close()
    assert anchor.read_bytes() == (
        b'{"format_version":1,"records":[{"namespace":"worker-journal","name":"tenant-release","revision":2},'
        + DIGEST_MARK
        + b"]}"
    )
    assert stat.S_IMODE(anchor.stat().st_mode) == 0o600

    restore(db_path, tmp_path / "old")
    rolled_back = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        with pytest.raises(RollbackDetected) as detected:
            await rolled_back.load_records(SCOPE, ["op-1"])
    finally:
        await rolled_back.close()
    assert (detected.value.record_revision, detected.value.revision_floor) == (1, 2)


async def test_a_database_ahead_of_its_anchor_raises_the_anchor(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    store = SqliteJournalStore(db_path, storage_keyring())
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, WorkerCommit())
    await store.close()
    anchor.write_bytes(b'{"format_version":1,"records":[]}')

    anchored = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        assert await anchored.head_revision(SCOPE) == 1
    finally:
        await anchored.close()
    assert b'"revision":1' in anchor.read_bytes()


async def test_a_head_rolled_back_while_open_fails_every_load(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    anchor.write_bytes(b'{"format_version":1,"records":[]}')
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None)))
        sql(db_path, "UPDATE heads SET revision = 1")
        with pytest.raises(RollbackDetected) as lowered:
            await store.load_records(SCOPE, ["op-1"])
        sql(db_path, "DELETE FROM heads")
        with pytest.raises(RollbackDetected) as deleted:
            await store.load_sessions(SCOPE)
    finally:
        await store.close()
    assert (lowered.value.record_revision, lowered.value.revision_floor) == (1, 2)
    assert (deleted.value.record_revision, deleted.value.revision_floor) == (None, 2)


async def test_a_malformed_anchor_fails_the_open_until_initialised(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    anchor.write_bytes(b'{"format_version":1}')
    broken = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    with pytest.raises(RollbackAnchorInvalid):
        await broken.scopes()
    await broken.close()

    operator = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        await operator.initialize_anchor()
        assert await operator.scopes() == []
    finally:
        await operator.close()
    assert anchor.read_bytes() == b'{"format_version":1,"records":[' + DIGEST_MARK + b"]}"


async def test_an_anchor_write_failure_fails_every_caller_of_the_transaction(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    anchor.write_bytes(b'{"format_version":1,"records":[]}')
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        lease = await store.reserve_fence(SCOPE)
        # A directory where the temporary anchor file must go: the write fails.
        Path(str(anchor) + ".tmp").mkdir()
        outcomes = await asyncio.gather(
            *(
                store.commit(SCOPE, lease, rows(SCOPE, (pending(f"op-{i}"), None)))
                for i in range(5)
            ),
            return_exceptions=True,
        )
        head = await store.head_revision(SCOPE)
    finally:
        await store.close()
    assert all(isinstance(outcome, StorageBackendError) for outcome in outcomes)
    assert head == 5  # the database holds the commit; its callers were failed


# Group commit, cancellation, concurrency ------------------------------------------------------


async def test_group_commit_batches_concurrent_callers(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    before = store.stats

    revisions = await asyncio.gather(
        *(store.commit(SCOPE, lease, rows(SCOPE, (pending(f"op-{i}"), None))) for i in range(64))
    )

    after = store.stats
    assert revisions == list(range(1, 65))
    assert after.change_sets - before.change_sets == 64
    assert after.transactions - before.transactions <= 4
    assert after.largest_batch >= 16


async def test_without_group_commit_every_change_set_is_its_own_transaction(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring(), group_commit=False)
    try:
        lease = await store.reserve_fence(SCOPE)
        revisions = await asyncio.gather(
            *(store.commit(SCOPE, lease, rows(SCOPE, (pending(f"op-{i}"), None))) for i in range(8))
        )
        assert revisions == list(range(1, 9))
        assert (store.stats.transactions, store.stats.largest_batch) == (8, 1)
    finally:
        await store.close()


async def test_group_commit_outcomes_equal_a_serial_model(store: JournalStoreBase) -> None:
    """Random concurrent change sets (some stale) get exactly their serial outcome."""
    chooser = random.Random(20261202)
    scopes = [SCOPE, OTHER_SCOPE]
    leases = {scope: await store.reserve_fence(scope) for scope in scopes}
    heads = dict.fromkeys(scopes, 0)
    model: dict[tuple[str, str], tuple[str, int]] = {}  # (scope, key) -> (tag, revision)
    conflicts = 0

    for round_number in range(25):
        submitted: list[tuple[str, list[tuple[str, int | None]], str]] = []
        for index in range(chooser.randint(1, 12)):
            scope = chooser.choice(scopes)
            keys = chooser.sample([f"op-{k}" for k in range(8)], chooser.randint(1, 3))
            changes: list[tuple[str, int | None]] = []
            for key in keys:
                current = model.get((scope, key))
                base = None if current is None else current[1]
                if chooser.random() < 0.25:  # a stale or wrong expectation
                    base = chooser.choice([None, 1, (base or 0) + 5])
                changes.append((key, base))
            submitted.append((scope, changes, f"r{round_number}-{index}"))

        outcomes = await asyncio.gather(
            *(
                store.commit(
                    scope,
                    leases[scope],
                    rows(scope, *((pending(key, tag), base) for key, base in changes)),
                )
                for scope, changes, tag in submitted
            ),
            return_exceptions=True,
        )

        for (scope, changes, tag), outcome in zip(submitted, outcomes, strict=True):
            stale = [
                (base, model.get((scope, key), (None, None))[1])
                for key, base in changes
                if model.get((scope, key), (None, None))[1] != base
            ]
            if stale:
                assert isinstance(outcome, WriteConflict)
                assert (outcome.expected, outcome.actual) == stale[0]
                conflicts += 1
                continue
            heads[scope] += 1
            assert outcome == heads[scope]
            for key, _base in changes:
                model[(scope, key)] = (tag, heads[scope])

    assert conflicts > 10 and sum(heads.values()) > 50  # both outcomes were exercised
    for scope in scopes:
        stored = {
            record.operation_key: (record, revision)
            for record, revision in await store.list_records(scope)
        }
        expected = {
            key: (pending(key, tag), revision)
            for (row_scope, key), (tag, revision) in model.items()
            if row_scope == scope
        }
        assert stored == expected
        assert await store.head_revision(scope) == heads[scope]


async def test_a_cancelled_caller_still_commits(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    task = asyncio.create_task(store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None))))
    await asyncio.sleep(0)  # the change set is submitted
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # The next commit is queued behind the cancelled caller's change set.
    assert await store.commit(SCOPE, lease, WorkerCommit()) == 2
    assert (await store.load_records(SCOPE, ["op-1"]))["op-1"] == (pending("op-1"), 1)


async def test_concurrent_admissions_from_two_sessions_never_overwrite(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    keys = [f"op-{i}" for i in range(100)]
    winners: dict[str, list[tuple[str, int]]] = {key: [] for key in keys}
    outcomes = {"committed": 0, "conflict": 0, "seen": 0}

    async def admit(session: str, attempt: int, key: str) -> None:
        loaded = await store.load_records(SCOPE, [key])
        if loaded[key] is not None:
            outcomes["seen"] += 1
            return
        tag = f"{session}-{attempt}"
        try:
            revision = await store.commit(SCOPE, lease, rows(SCOPE, (pending(key, tag), None)))
        except WriteConflict:
            outcomes["conflict"] += 1
            return
        outcomes["committed"] += 1
        winners[key].append((tag, revision))

    session_a = [admit("a", i, keys[i % 100]) for i in range(500)]
    session_b = [admit("b", i, keys[(i * 7) % 100]) for i in range(500)]
    await asyncio.gather(*session_a, *session_b)

    stored = {
        record.operation_key: (record, revision)
        for record, revision in await store.list_records(SCOPE)
    }
    assert len(stored) == 100
    assert outcomes["committed"] == 100
    assert sum(outcomes.values()) == 1000
    for key in keys:
        ((tag, revision),) = winners[key]
        assert stored[key] == (pending(key, tag), revision)
    assert store.stats.transactions < 1000


# Files and lifecycle ---------------------------------------------------------------------------


async def test_files_are_private(db_path: Path) -> None:
    store = SqliteJournalStore(db_path, storage_keyring())
    assert not db_path.parent.exists()  # the constructor does no I/O
    try:
        lease = await store.reserve_fence(SCOPE)
        await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in db_path.parent.iterdir()}
    finally:
        await store.close()
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    assert modes == {"worker.db": 0o600, "worker.db-wal": 0o600, "worker.db-shm": 0o600}


async def test_close_is_idempotent_and_final(journal_db: JournalDatabase) -> None:
    store = journal_db.store(storage_keyring())
    lease = await store.reserve_fence(SCOPE)
    await store.close()
    await store.close()
    with pytest.raises(StorageBackendError):
        await store.commit(SCOPE, lease, WorkerCommit())
    with pytest.raises(StorageBackendError):
        await store.load_records(SCOPE, ["op-1"])


async def test_a_newer_schema_is_refused(journal_db: JournalDatabase) -> None:
    store = journal_db.store(storage_keyring())
    await store.scopes()
    await store.close()
    await journal_db.set_schema_version(99)

    newer = journal_db.store(storage_keyring())
    try:
        with pytest.raises(StorageBackendError):
            await newer.scopes()
    finally:
        await newer.close()


# Chained session commits (SessionDocuments.link/after) ---------------------------------------


async def open_session(store: JournalStoreBase, lease: WorkerJournalLease, sid: str) -> int:
    documents = SessionDocuments(state_doc(SCOPE, sid), opening_doc(SCOPE, sid), link=None)
    return await store.commit(SCOPE, lease, WorkerCommit(sessions={sid: documents}))


def session_step(
    sid: str, counter: int, *, base: int | None = None, link: int | None, after: int | None = None
) -> WorkerCommit:
    documents = SessionDocuments(
        state_doc(SCOPE, sid, counter=counter), base_revision=base, link=link, after=after
    )
    return WorkerCommit(sessions={sid: documents})


async def test_chained_commits_of_one_session_share_a_transaction_in_build_order(
    store: JournalStoreBase,
) -> None:
    assert store.chains_session_commits is True
    lease = await store.reserve_fence(SCOPE)
    opened = await open_session(store, lease, "sess-1")
    before = store.stats

    # Submitted together: the first names its base revision, each next one the
    # link of the one before it, whose revision nobody knows yet.
    commits = [store.commit(SCOPE, lease, session_step("sess-1", 1, base=opened, link=101))]
    commits += [
        store.commit(SCOPE, lease, session_step("sess-1", n, link=100 + n, after=99 + n))
        for n in range(2, 9)
    ]
    revisions = await asyncio.gather(*commits)

    assert revisions == list(range(opened + 1, opened + 9))
    assert store.stats.transactions - before.transactions == 1
    loaded = (await store.load_sessions(SCOPE))["sess-1"]
    assert loaded.revision == opened + 8
    assert loaded.state == state_doc(SCOPE, "sess-1", counter=8)


async def test_a_commit_chained_on_a_failed_one_fails_and_the_rest_of_the_batch_commits(
    store: JournalStoreBase,
) -> None:
    lease = await store.reserve_fence(SCOPE)
    opened = await open_session(store, lease, "sess-1")
    await store.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))

    # The first commit's journal row is stale (op-1 exists): it fails alone,
    # and the commit chained on it must not land on the older state.
    stale = WorkerCommit(
        journal=rows(SCOPE, (pending("op-1", "x"), None)).journal,
        sessions={
            "sess-1": SessionDocuments(
                state_doc(SCOPE, "sess-1", counter=1), base_revision=opened, link=201
            )
        },
    )
    outcomes = await asyncio.gather(
        store.commit(SCOPE, lease, stale),
        store.commit(SCOPE, lease, session_step("sess-1", 2, link=202, after=201)),
        store.commit(SCOPE, lease, rows(SCOPE, (pending("op-2"), None))),
        return_exceptions=True,
    )

    assert isinstance(outcomes[0], WriteConflict)
    assert isinstance(outcomes[1], WriteConflict)
    assert outcomes[1].actual == opened  # the row still holds what the open wrote
    assert isinstance(outcomes[2], int)
    loaded = (await store.load_sessions(SCOPE))["sess-1"]
    assert (loaded.revision, loaded.state) == (opened, state_doc(SCOPE, "sess-1"))
    # The chain stays broken: a commit naming the failed link fails too.
    with pytest.raises(WriteConflict):
        await store.commit(SCOPE, lease, session_step("sess-1", 3, link=203, after=201))


async def test_a_chain_fails_closed_on_a_link_this_store_did_not_commit(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(storage_keyring())
    try:
        lease = await store.reserve_fence(SCOPE)
        opened = await open_session(store, lease, "sess-1")
        first = await store.commit(SCOPE, lease, session_step("sess-1", 1, base=opened, link=301))
        # A link that never reached the store (its caller failed before submitting).
        with pytest.raises(WriteConflict):
            await store.commit(SCOPE, lease, session_step("sess-1", 2, link=303, after=302))
        # A write without a link moves the row: what 301 wrote is no base any more.
        await store.commit(SCOPE, lease, session_step("sess-1", 9, base=first, link=None))
        with pytest.raises(WriteConflict):
            await store.commit(SCOPE, lease, session_step("sess-1", 2, link=304, after=301))
    finally:
        await store.close()
    # Another instance (a restarted worker) knows no link at all.
    reopened = journal_db.store(storage_keyring())
    try:
        lease = await reopened.reserve_fence(SCOPE)
        with pytest.raises(WriteConflict):
            await reopened.commit(SCOPE, lease, session_step("sess-1", 3, link=305, after=301))
    finally:
        await reopened.close()


async def test_chained_documents_are_checked_before_any_io(store: JournalStoreBase) -> None:
    lease = await store.reserve_fence(SCOPE)
    bad = [
        SessionDocuments(state_doc(SCOPE, "sess-1"), base_revision=1, link=2, after=1),
        SessionDocuments(state_doc(SCOPE, "sess-1"), opening_doc(SCOPE, "sess-1"), after=1),
        SessionDocuments(state_doc(SCOPE, "sess-1"), base_revision=1, link=0),
        SessionDocuments(state_doc(SCOPE, "sess-1"), after=True),  # type: ignore[arg-type]
    ]
    for documents in bad:
        with pytest.raises(ValueError):
            await store.commit(SCOPE, lease, WorkerCommit(sessions={"sess-1": documents}))
    assert await store.head_revision(SCOPE) == 0


async def test_a_chain_never_lands_on_a_commit_whose_anchor_write_failed(
    db_path: Path, tmp_path: Path
) -> None:
    anchor = tmp_path / "worker.anchor"
    store = SqliteJournalStore(db_path, storage_keyring(), anchor_path=anchor)
    try:
        await store.initialize_anchor()
        lease = await store.reserve_fence(SCOPE)
        opened = await open_session(store, lease, "sess-1")
        write_anchor = store._writer._write_anchor_file
        entered, go = threading.Event(), threading.Event()
        blocker = Path(str(anchor) + ".tmp")

        def first_fails(revisions: Any) -> None:  # the writer thread
            if not entered.is_set():
                entered.set()
                go.wait(5)
                blocker.mkdir()  # where the temporary anchor must go: a real failure
                try:
                    write_anchor(revisions)
                finally:
                    blocker.rmdir()
            write_anchor(revisions)

        store._writer._write_anchor_file = first_fails  # type: ignore[method-assign]
        first = asyncio.ensure_future(
            store.commit(SCOPE, lease, session_step("sess-1", 1, base=opened, link=501))
        )
        while not entered.is_set():
            await asyncio.sleep(0.001)
        # The first is committed in SQLite and writing its anchor; the second,
        # chained on it, waits for the next transaction.
        second = asyncio.ensure_future(
            store.commit(SCOPE, lease, session_step("sess-1", 2, link=502, after=501))
        )
        await asyncio.sleep(0.01)
        go.set()
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        loaded = (await store.load_sessions(SCOPE))["sess-1"]
    finally:
        await store.close()
    # Its caller was told the first failed: nothing may be built on it.
    assert isinstance(outcomes[0], StorageBackendError)
    assert isinstance(outcomes[1], WriteConflict)
    assert loaded.state == state_doc(SCOPE, "sess-1", counter=1)


# Closed sessions at start (schema 3) -----------------------------------------------------------


async def close_session(store: JournalStoreBase, lease: WorkerJournalLease, sid: str) -> int:
    base = (await store.load_sessions(SCOPE))[sid].revision
    documents = SessionDocuments(state_doc(SCOPE, sid, "closed", 1), base_revision=base)
    return await store.commit(SCOPE, lease, WorkerCommit(sessions={sid: documents}))


async def test_a_start_reads_no_closed_session_but_those_it_names(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    for sid in ("s-open", "s-gone", "s-replying"):
        await open_session(store, lease, sid)
    await close_session(store, lease, "s-gone")
    await close_session(store, lease, "s-replying")

    everything = await store.load_sessions(SCOPE)
    live = await store.load_sessions(SCOPE, skip_closed_except=[])
    named = await store.load_sessions(SCOPE, skip_closed_except=["s-replying", "s-unknown"])

    assert sorted(everything) == ["s-gone", "s-open", "s-replying"]
    assert sorted(live) == ["s-open"]
    assert sorted(named) == ["s-open", "s-replying"]
    assert named["s-replying"] == everything["s-replying"]  # both rows, authenticated
    assert [await store.session_status(SCOPE, sid) for sid in ("s-open", "s-gone", "s-x")] == [
        "open",
        "closed",
        None,
    ]
    # The mark is metadata beside the sealed rows: both rows of a closed
    # session carry it, nothing else does.
    marked = await journal_db.closed_rows()
    assert marked == [
        ("worker-session", "s-gone"),
        ("worker-session-open", "s-gone"),
        ("worker-session", "s-replying"),
        ("worker-session-open", "s-replying"),
    ]


async def test_a_tampered_closed_mark_never_hides_a_session_state(
    store: JournalStoreBase, journal_db: JournalDatabase
) -> None:
    lease = await store.reserve_fence(SCOPE)
    await open_session(store, lease, "s-open")
    await journal_db.mark_closed("s-open")
    # Left out of a start, but its sealed state still says open wherever it is read.
    assert await store.load_sessions(SCOPE, skip_closed_except=[]) == {}
    assert await store.session_status(SCOPE, "s-open") == "open"
    assert (await store.load_sessions(SCOPE))["s-open"].status == "open"
    # Half a session hidden: the other half alone is a rollback, refused.
    await open_session(store, lease, "s-half")
    await journal_db.mark_closed("s-half", "worker-session")
    with pytest.raises(RollbackDetected):
        await store.load_sessions(SCOPE, skip_closed_except=[])


async def test_sessions_closed_before_schema_3_are_still_read_at_start(db_path: Path) -> None:
    store = SqliteJournalStore(db_path, storage_keyring())
    lease = await store.reserve_fence(SCOPE)
    await open_session(store, lease, "s-old")
    await close_session(store, lease, "s-old")
    await store.close()
    with sqlite3.connect(db_path) as connection:  # back to schema 2
        drop_head_digests(connection)
        connection.execute("DROP INDEX IF EXISTS items_request_sessions")  # schema 6
        connection.execute("DROP INDEX items_outbox_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN session")
        connection.execute("DROP INDEX items_live_sessions")
        connection.execute("ALTER TABLE items DROP COLUMN closed")
        connection.execute("UPDATE schema_version SET version = 2")

    reopened = SqliteJournalStore(db_path, storage_keyring())
    try:
        lease = await reopened.reserve_fence(SCOPE)
        # Unmarked: read (and authenticated) as before the migration.
        assert sorted(await reopened.load_sessions(SCOPE, skip_closed_except=[])) == ["s-old"]
        await open_session(reopened, lease, "s-new")
        await close_session(reopened, lease, "s-new")
        assert sorted(await reopened.load_sessions(SCOPE, skip_closed_except=[])) == ["s-old"]
        # Marked once found closed (what the daemon's start does): not read again.
        head = await reopened.head_revision(SCOPE)
        await reopened.mark_closed(SCOPE, ["s-old"])
        assert await reopened.load_sessions(SCOPE, skip_closed_except=[]) == {}
        assert await reopened.head_revision(SCOPE) == head  # metadata only
        assert (await reopened.load_sessions(SCOPE))["s-old"].status == "closed"
    finally:
        await reopened.close()
