"""The SQLite ledger's store head and rollback anchor on real files.

A commit moves one sealed store head (revision, digest of every record) in
the same transaction and rewrites a fixed-size anchor: its cost does not
depend on the number of records. What each protection detects is shown on
real databases edited behind the store's back, as someone with access to
the files would: (a) the whole database restored from an older copy, (b) a
record deleted, (c) one record put back to an older sealed version; with
the anchor, and without it. Also: migration from a version 1 anchor with
records, the explicit empty initialisation, the unbuilt head a schema
upgrade leaves, and group commit writing the anchor once per transaction.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import statistics
from pathlib import Path

import pytest

from octo_common.errors import (
    InvalidRecordAuthenticationTag,
    RollbackDetected,
    UnknownKeyId,
)
from octo_common.records import (
    StorageKey,
    StorageKeyring,
    StorageRecordKey,
    StoredRecord,
    encode_anchor,
)
from octo_common.runtime.anchorfile import read_anchor_file, write_anchor
from octo_common.setdigest import SetDigest
from octo_host.storage import sqlite_head
from octo_host.storage.anchor import HeadAnchor, decode_ledger_anchor
from octo_host.storage.head import LEDGER_ROWS_DOMAIN
from octo_host.store import (
    AuthenticatedStore,
    SqliteLedgerStore,
    SqliteRecordBackend,
    initialise_anchor,
    ledger_record_key,
)

RUN = ledger_record_key("release-42")
OTHER = ledger_record_key("release-43")
THIRD = ledger_record_key("release-44")


def new_keyring() -> StorageKeyring:
    return StorageKeyring("storage-v1", StorageKey(bytes([7]) * 32))


def anchored(path: Path) -> HeadAnchor:
    document = decode_ledger_anchor(read_anchor_file(path))
    assert isinstance(document, HeadAnchor)
    return document


def head_anchor(store_revision: int, records: list[tuple[StorageRecordKey, int]]) -> HeadAnchor:
    digest = SetDigest.of(LEDGER_ROWS_DOMAIN, [(k.namespace, k.name, r) for k, r in records])
    return HeadAnchor(store_revision, len(records), digest.fingerprint().hex())


class Files:
    """A ledger database, its anchor, and raw SQL on them (the "backdoor")."""

    def __init__(self, root: Path) -> None:
        self.db = root / "db" / "ledger.db"
        self.anchor = root / "anchor" / "ledger.anchor"
        self.anchor.parent.mkdir(mode=0o700, parents=True)

    def store(
        self, *, anchor: bool = True, ring: StorageKeyring | None = None
    ) -> SqliteLedgerStore:
        return SqliteLedgerStore(
            self.db, ring or new_keyring(), anchor_path=self.anchor if anchor else None
        )

    def sql(self, *statements: tuple[str, tuple[object, ...]]) -> None:
        connection = sqlite3.connect(self.db, timeout=5, isolation_level=None)
        try:
            connection.execute("BEGIN IMMEDIATE")
            for statement, parameters in statements:
                connection.execute(statement, parameters)
            connection.execute("COMMIT")
        finally:
            connection.close()

    def item(self, key: StorageRecordKey) -> tuple[int, bytes]:
        connection = sqlite3.connect(self.db, timeout=5)
        try:
            row = connection.execute(
                "SELECT revision, envelope FROM items WHERE namespace=? AND name=? AND item=''",
                (key.namespace, key.name),
            ).fetchone()
        finally:
            connection.close()
        assert row is not None
        return int(row[0]), bytes(row[1])

    def put_back(self, key: StorageRecordKey, revision: int, envelope: bytes) -> None:
        """Put an older sealed version back, head row (floor) and item together."""
        self.sql(
            (
                "UPDATE heads SET revision=? WHERE namespace=? AND name=?",
                (revision, key.namespace, key.name),
            ),
            (
                "UPDATE items SET revision=?, envelope=? WHERE namespace=? AND name=? AND item=''",
                (revision, envelope, key.namespace, key.name),
            ),
        )

    def delete(self, key: StorageRecordKey) -> None:
        """Remove a record entirely: its item and its head row."""
        self.sql(
            ("DELETE FROM items WHERE namespace=? AND name=?", (key.namespace, key.name)),
            ("DELETE FROM heads WHERE namespace=? AND name=?", (key.namespace, key.name)),
        )

    def head_row(self) -> tuple[object, ...]:
        connection = sqlite3.connect(self.db, timeout=5)
        try:
            row = connection.execute(
                "SELECT revision, record_count, digest, key_id, auth_tag FROM store_head"
            ).fetchone()
        finally:
            connection.close()
        return tuple(row)

    def set_head_row(self, row: tuple[object, ...]) -> None:
        self.sql(
            (
                "UPDATE store_head SET revision=?, record_count=?, digest=?, key_id=?, "
                "auth_tag=? WHERE id = 1",
                row,
            )
        )

    def make_legacy(self) -> None:
        """Turn the database back into schema 1, from before the store head existed."""
        self.sql(("DROP TABLE store_head", ()), ("UPDATE schema_version SET version = 1", ()))


async def populate(files: Files, *, anchor: bool = True) -> bytes:
    """RUN at 2 and OTHER at 1 (three commits); returns RUN's sealed version 1."""
    store = files.store(anchor=anchor)
    try:
        await store.create(RUN, b"v1")
        _, first = files.item(RUN)
        await store.replace(RUN, 1, b"v2")
        await store.create(OTHER, b"other")
    finally:
        await store.close()
    return first


async def open_fails(files: Files, *, anchor: bool) -> RollbackDetected:
    store = files.store(anchor=anchor)
    try:
        with pytest.raises(RollbackDetected) as caught:
            await store.load(OTHER)
        with pytest.raises(RollbackDetected):  # and nothing can be written
            await store.create(THIRD, b"new")
    finally:
        await store.close()
    return caught.value


# Cost: the anchor and the bytes written per commit do not grow with the records --------


def written_bytes() -> int:
    """Bytes this process has handed to write(2)/pwrite(2) so far (every thread)."""
    with open("/proc/self/io", encoding="ascii") as status:
        for line in status:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


async def commit_costs(
    root: Path, records: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, list[int], list[int]]:
    """(anchor file size, anchor bytes per commit, bytes written per commit) after
    building ``records`` records with the anchor on."""
    files = Files(root)
    initialise_anchor(files.anchor)
    store = files.store()
    anchor_writes: list[int] = []
    real_write = sqlite_head.write_anchor_file

    def counting_write(path: Path, content: bytes) -> None:
        anchor_writes.append(len(content))
        real_write(path, content)

    try:
        for start in range(0, records, 500):
            batch = range(start, min(start + 500, records))
            await store.compare_and_swap_many(
                [(ledger_record_key(f"run-{i}"), None, b"x" * 300) for i in batch]
            )
        monkeypatch.setattr(sqlite_head, "write_anchor_file", counting_write)
        per_commit: list[int] = []
        for revision in range(1, 12):
            before = written_bytes()
            await store.replace(ledger_record_key("run-0"), revision, b"y" * 300)
            per_commit.append(written_bytes() - before)
    finally:
        monkeypatch.setattr(sqlite_head, "write_anchor_file", real_write)
        await store.close()
    return files.anchor.stat().st_size, anchor_writes, per_commit


async def test_a_commit_writes_the_same_bytes_at_10_and_at_2000_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "small").mkdir()
    (tmp_path / "large").mkdir()
    small = await commit_costs(tmp_path / "small", 10, monkeypatch)
    large = await commit_costs(tmp_path / "large", 2000, monkeypatch)
    small_size, small_anchor, small_commits = small
    large_size, large_anchor, large_commits = large

    # One anchor write per commit, a fixed-size document: only the digits of
    # the revision and the count differ.
    assert len(small_anchor) == len(large_anchor) == 11
    assert max(large_anchor) - min(small_anchor) <= 6
    assert small_size <= 180 and large_size <= 180
    # A version 1 anchor of 2,000 records was over 100 KiB, rewritten per commit.
    records = {ledger_record_key(f"run-{i}"): 1 for i in range(2000)}
    assert len(encode_anchor(records)) > 100 * 1024 > 100 * large_size
    # Everything the process wrote per commit (WAL frames + anchor), medians so
    # that a checkpoint landing in one commit does not decide.
    assert statistics.median(large_commits) <= statistics.median(small_commits) + 1024


async def test_group_commit_writes_the_anchor_once_per_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    backend = SqliteRecordBackend(files.db, anchor_path=files.anchor)
    store = AuthenticatedStore(backend, new_keyring())
    writes: list[bytes] = []
    real_write = sqlite_head.write_anchor_file

    def counting_write(path: Path, content: bytes) -> None:
        writes.append(content)
        real_write(path, content)

    monkeypatch.setattr(sqlite_head, "write_anchor_file", counting_write)
    keys = [ledger_record_key(f"run-{i}") for i in range(40)]
    try:
        await store.load(keys[0])  # open first: the creates below may share transactions
        before, _ = backend.group_commit_stats
        await asyncio.gather(*(store.create(key, b"v1") for key in keys))
        transactions = backend.group_commit_stats[0] - before
    finally:
        await store.close()
    assert transactions < len(keys)
    assert len(writes) == transactions
    # The last anchor names the head after every transaction, all 40 records in it.
    assert anchored(files.anchor) == head_anchor(transactions, [(key, 1) for key in keys])


# Detection: (a) restored whole, (b) deleted, (c) one record rolled back alone -----------


async def test_a_database_restored_whole_is_detected_by_the_anchor_only(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    store = files.store()
    await store.create(RUN, b"v1")
    await store.close()
    backup = tmp_path / "backup.db"
    shutil.copy2(files.db, backup)
    await populate_more(files)
    assert anchored(files.anchor).store_revision == 3
    for suffix in ("-wal", "-shm"):
        Path(f"{files.db}{suffix}").unlink(missing_ok=True)
    shutil.copy2(backup, files.db)

    caught = await open_fails(files, anchor=True)
    assert (caught.record_revision, caught.revision_floor) == (1, 3)
    # Without the anchor the restored copy is consistent in itself: it opens.
    unanchored = files.store(anchor=False)
    try:
        record = await unanchored.load(RUN)
        assert record is not None and record.revision == 1
    finally:
        await unanchored.close()


async def populate_more(files: Files) -> None:
    store = files.store()
    try:
        await store.replace(RUN, 1, b"v2")
        await store.create(OTHER, b"other")
    finally:
        await store.close()


@pytest.mark.parametrize("with_anchor", [True, False], ids=["anchor", "no-anchor"])
async def test_a_deleted_record_is_detected_at_open(tmp_path: Path, with_anchor: bool) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files, anchor=with_anchor)
    files.delete(RUN)

    caught = await open_fails(files, anchor=with_anchor)
    # The rows no longer add up to the sealed head at revision 3.
    assert (caught.record_revision, caught.revision_floor) == (None, 3)


@pytest.mark.parametrize("with_anchor", [True, False], ids=["anchor", "no-anchor"])
async def test_one_record_rolled_back_alone_is_detected_at_open(
    tmp_path: Path, with_anchor: bool
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    first = await populate(files, anchor=with_anchor)
    files.put_back(RUN, 1, first)  # authentic, consistent with its floor

    caught = await open_fails(files, anchor=with_anchor)
    assert (caught.record_revision, caught.revision_floor) == (None, 3)


async def test_a_record_rolled_back_while_open_is_caught_on_load_or_at_the_next_open(
    tmp_path: Path,
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    first = await populate(files)
    store = files.store()
    try:
        await store.load(OTHER)  # open; RUN not seen by this process
        files.put_back(RUN, 1, first)
        # The next commit moves the head as the store believes it should;
        # the rows still do not add up to it.
        await store.create(THIRD, b"third")
    finally:
        await store.close()
    caught = await open_fails(files, anchor=True)
    assert (caught.record_revision, caught.revision_floor) == (None, 4)

    # A record this process wrote is checked on every load.
    files2 = Files(tmp_path / "second")
    initialise_anchor(files2.anchor)
    store = files2.store()
    try:
        await store.create(RUN, b"v1")
        _, old = files2.item(RUN)
        await store.replace(RUN, 1, b"v2")
        files2.put_back(RUN, 1, old)
        with pytest.raises(RollbackDetected) as seen:
            await store.load(RUN)
        assert (seen.value.record_revision, seen.value.revision_floor) == (1, 2)
    finally:
        await store.close()


async def test_a_database_swapped_while_open_is_caught_on_the_next_load(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    store = files.store()
    try:
        await store.create(RUN, b"v1")
        _, first = files.item(RUN)
        older_head = files.head_row()
        await store.replace(RUN, 1, b"v2")
        # Behind the store's back, the database goes back one commit, head and
        # record together (authentic, consistent: as a restored copy would be).
        files.put_back(RUN, 1, first)
        files.set_head_row(older_head)
        with pytest.raises(RollbackDetected) as caught:
            await store.load(OTHER)
        assert (caught.value.record_revision, caught.value.revision_floor) == (1, 2)
        with pytest.raises(RollbackDetected):
            await store.create(THIRD, b"third")
    finally:
        await store.close()


# The head itself cannot be edited, removed or unsealed ---------------------------------


@pytest.mark.parametrize("with_anchor", [True, False], ids=["anchor", "no-anchor"])
async def test_a_head_edited_to_match_a_deleted_record_fails_authentication(
    tmp_path: Path, with_anchor: bool
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files, anchor=with_anchor)
    files.delete(RUN)
    # The digest is public: recompute it for the remaining rows. The tag cannot follow.
    remaining = SetDigest.of(LEDGER_ROWS_DOMAIN, [(OTHER.namespace, OTHER.name, 1)])
    files.sql(
        (
            "UPDATE store_head SET record_count = ?, digest = ? WHERE id = 1",
            (remaining.count, remaining.to_bytes()),
        )
    )
    store = files.store(anchor=with_anchor)
    try:
        with pytest.raises(InvalidRecordAuthenticationTag):
            await store.load(OTHER)
    finally:
        await store.close()
    # Unsealing it (what a bare backend writes) is refused the same way.
    files.sql(("UPDATE store_head SET key_id = NULL, auth_tag = NULL WHERE id = 1", ()))
    store = files.store(anchor=with_anchor)
    try:
        with pytest.raises(InvalidRecordAuthenticationTag):
            await store.load(OTHER)
    finally:
        await store.close()


async def test_a_deleted_head_row_is_a_rollback(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files)
    files.sql(("DELETE FROM store_head", ()))
    for with_anchor, floor in ((True, 3), (False, 0)):
        caught = await open_fails(files, anchor=with_anchor)
        assert (caught.record_revision, caught.revision_floor) == (None, floor)


async def test_a_head_reset_to_unbuilt_cannot_hide_a_rollback_from_the_anchor(
    tmp_path: Path,
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    first = await populate(files)
    files.put_back(RUN, 1, first)
    files.make_legacy()  # drop the head and claim schema 1: it is rebuilt from the rows
    caught = await open_fails(files, anchor=True)
    assert (caught.record_revision, caught.revision_floor) == (0, 3)


async def test_rotation_reseals_the_head_on_the_next_commit(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files)
    ring = new_keyring()
    ring.rotate_to("storage-v2", StorageKey(bytes([8]) * 32))
    store = files.store(ring=ring)
    try:
        await store.replace(RUN, 2, b"v3")  # the head is sealed with storage-v2 now
        await store.replace(OTHER, 1, b"other again")
    finally:
        await store.close()
    ring.retire("storage-v1")
    store = files.store(ring=ring)
    try:
        record = await store.load(OTHER)
        assert record is not None and record.key_id == "storage-v2"
    finally:
        await store.close()
    # A keyring without the head's key cannot open the database at all.
    stranger = StorageKeyring("storage-v3", StorageKey(bytes([9]) * 32))
    store = files.store(ring=stranger)
    try:
        with pytest.raises(UnknownKeyId):
            await store.load(OTHER)
    finally:
        await store.close()


# Initialisation and migration -------------------------------------------------------


async def test_the_explicit_empty_anchor_initialises_a_new_database(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    assert files.anchor.read_bytes() == b'{"format_version":1,"records":[]}'
    store = files.store()
    try:
        assert await store.load(RUN) is None
        assert files.anchor.read_bytes() == b'{"format_version":1,"records":[]}'  # no commit yet
        await store.create(RUN, b"v1")
    finally:
        await store.close()
    assert anchored(files.anchor) == head_anchor(1, [(RUN, 1)])


async def test_the_empty_anchor_re_anchors_a_database_with_records(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    first = await populate(files)
    initialise_anchor(files.anchor, overwrite=True)  # the operator accepts this database
    store = files.store()
    try:
        record = await store.load(RUN)
        assert record is not None and record.revision == 2
        await store.create(THIRD, b"third")
    finally:
        await store.close()
    assert anchored(files.anchor) == head_anchor(4, [(RUN, 2), (OTHER, 1), (THIRD, 1)])
    # Anchored again: the protection is back.
    files.put_back(RUN, 1, first)
    await open_fails(files, anchor=True)


async def test_a_version_1_anchor_with_records_is_checked_then_migrated(tmp_path: Path) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files)
    files.make_legacy()
    write_anchor(files.anchor, {RUN: 2, OTHER: 1})  # as an older host left it

    store = files.store()
    try:
        record = await store.load(RUN)  # accepted: every record at its anchored revision
        assert record is not None and record.revision == 2
        assert decode_ledger_anchor(read_anchor_file(files.anchor)) == {RUN: 2, OTHER: 1}
        await store.create(THIRD, b"third")
    finally:
        await store.close()
    # The first commit replaced it: the head built at revision 0 over the
    # migrated records, then that commit.
    assert anchored(files.anchor) == head_anchor(1, [(RUN, 2), (OTHER, 1), (THIRD, 1)])
    store = files.store()
    try:
        assert await store.load(THIRD) is not None
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("revisions", "expected"),
    [
        ({RUN: 3, OTHER: 1}, (2, 3)),  # a record below the revision the anchor holds
        ({RUN: 2, OTHER: 1, THIRD: 1}, (None, 1)),  # a record the anchor holds is gone
    ],
    ids=["behind", "missing"],
)
async def test_a_version_1_anchor_is_never_ignored(
    tmp_path: Path,
    revisions: dict[StorageRecordKey, int],
    expected: tuple[int | None, int],
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    await populate(files)
    files.make_legacy()
    write_anchor(files.anchor, revisions)
    caught = await open_fails(files, anchor=True)
    assert (caught.record_revision, caught.revision_floor) == expected
    assert decode_ledger_anchor(read_anchor_file(files.anchor)) == revisions  # untouched


async def test_a_legacy_database_without_anchor_gets_its_head_at_open(tmp_path: Path) -> None:
    files = Files(tmp_path)
    first = await populate(files, anchor=False)
    files.make_legacy()
    store = files.store(anchor=False)
    try:
        record = await store.load(RUN)
        assert record is not None and record.revision == 2
    finally:
        await store.close()
    # From now on the head protects it.
    files.put_back(RUN, 1, first)
    caught = await open_fails(files, anchor=False)
    assert (caught.record_revision, caught.revision_floor) == (None, 0)


async def test_a_bare_backend_keeps_an_unsealed_head_a_keyed_store_refuses(
    tmp_path: Path,
) -> None:
    files = Files(tmp_path)
    backend = SqliteRecordBackend(files.db)
    try:
        await backend.compare_and_swap(RUN, None, StoredRecord(1, b"not an envelope"))
    finally:
        await backend.close()
    store = files.store(anchor=False)
    try:
        with pytest.raises(InvalidRecordAuthenticationTag):
            await store.load(OTHER)
    finally:
        await store.close()
