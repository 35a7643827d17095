"""The rollback anchor file both stores write and read, on real files."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from octo_common.errors import RollbackAnchorInvalid, RollbackAnchorMissing, StorageBackendError
from octo_common.records import StorageKeyring, StorageRecordKey, encode_anchor
from octo_common.runtime.anchorfile import (
    read_anchor,
    read_anchor_file,
    write_anchor,
    write_anchor_file,
)
from octo_common.setdigest import SetDigest
from octo_host.storage.anchor import HeadAnchor, decode_ledger_anchor
from octo_host.storage.head import LEDGER_ROWS_DOMAIN
from octo_host.store import SqliteLedgerStore, initialise_anchor, ledger_record_key
from octo_worker.store import SessionDocuments, SqliteJournalStore, WorkerCommit

REVISIONS = {
    StorageRecordKey("worker-journal", "tenant-b"): 7,
    StorageRecordKey("worker-journal", "tenant-a"): 42,
}


@pytest.fixture
def loose_umask() -> Iterator[None]:
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_content_is_the_encoded_anchor_and_reads_back(tmp_path: Path) -> None:
    anchor = tmp_path / "a.anchor"
    write_anchor(anchor, REVISIONS)
    assert anchor.read_bytes() == encode_anchor(REVISIONS)
    assert read_anchor(anchor) == REVISIONS
    assert not (tmp_path / "a.anchor.tmp").exists()


def test_created_private_even_under_a_loose_umask_and_over_a_loose_temporary(
    tmp_path: Path, loose_umask: None
) -> None:
    anchor = tmp_path / "a.anchor"
    write_anchor_file(anchor, b"one")
    assert mode(anchor) == 0o600
    leftover = tmp_path / "a.anchor.tmp"  # a crash between write and rename left it behind
    leftover.write_bytes(b"stale")
    leftover.chmod(0o666)
    write_anchor_file(anchor, b"two")
    assert (anchor.read_bytes(), mode(anchor)) == (b"two", 0o600)


def test_a_link_planted_at_the_temporary_path_is_never_followed(tmp_path: Path) -> None:
    anchor = tmp_path / "a.anchor"
    write_anchor_file(anchor, b"before")
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (tmp_path / "a.anchor.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        write_anchor_file(anchor, b"after")
    assert victim.read_bytes() == b"untouched"
    assert anchor.read_bytes() == b"before"


def test_reading_refuses_a_link_a_directory_and_reports_a_missing_file(tmp_path: Path) -> None:
    real = tmp_path / "real.anchor"
    write_anchor(real, REVISIONS)
    link = tmp_path / "link.anchor"
    link.symlink_to(real)
    with pytest.raises(RollbackAnchorInvalid):
        read_anchor_file(link)
    (tmp_path / "dir.anchor").mkdir()
    with pytest.raises(RollbackAnchorInvalid):
        read_anchor_file(tmp_path / "dir.anchor")
    with pytest.raises(RollbackAnchorMissing):
        read_anchor_file(tmp_path / "absent.anchor")
    with pytest.raises(RollbackAnchorInvalid):
        read_anchor(tmp_path / "dir.anchor")


def test_an_anchor_inside_a_symlinked_directory_is_read_and_replaced_in_place(
    tmp_path: Path,
) -> None:
    real = tmp_path / "other-disk"
    real.mkdir()
    linked = tmp_path / "anchors"
    linked.symlink_to(real, target_is_directory=True)
    write_anchor(linked / "a.anchor", REVISIONS)
    assert read_anchor(real / "a.anchor") == REVISIONS
    assert linked.is_symlink()


async def test_the_worker_journal_writes_its_anchor_private(
    tmp_path: Path, loose_umask: None
) -> None:
    anchor = tmp_path / "worker.anchor"
    store = SqliteJournalStore(
        tmp_path / "journal.db", StorageKeyring("k1", bytes(range(32))), anchor_path=anchor
    )
    try:
        await store.initialize_anchor()
        lease = await store.reserve_fence("tenant-a")
        state = b'{"format_version":1,"scope":"tenant-a","session_id":"s1","status":"open"}'
        await store.commit(
            "tenant-a", lease, WorkerCommit(sessions={"s1": SessionDocuments(state, state)})
        )
    finally:
        await store.close()
    assert mode(anchor) == 0o600
    assert read_anchor(anchor) == {
        StorageRecordKey("worker-journal", "tenant-a"): 1,
        StorageRecordKey("worker-journal-format", "scope-row-digest"): 5,
        StorageRecordKey("worker-journal-format", "store-head"): 7,
    }


async def test_the_host_ledger_writes_its_anchor_private(tmp_path: Path, loose_umask: None) -> None:
    anchor = tmp_path / "ledger.anchor"
    initialise_anchor(anchor)
    assert mode(anchor) == 0o600
    store = SqliteLedgerStore(
        tmp_path / "ledger.db", StorageKeyring("h1", bytes(range(32))), anchor_path=anchor
    )
    try:
        await store.create(ledger_record_key("run-1"), b"{}")
    finally:
        await store.close()
    assert mode(anchor) == 0o600
    # The host writes the fixed-size version 2 anchor of its store head.
    digest = SetDigest.of(LEDGER_ROWS_DOMAIN, [("workflow-ledger", "run-1", 1)])
    assert decode_ledger_anchor(read_anchor_file(anchor)) == HeadAnchor(
        1, 1, digest.fingerprint().hex()
    )


def test_initialise_refuses_to_replace_even_a_dangling_link(tmp_path: Path) -> None:
    anchor = tmp_path / "ledger.anchor"
    anchor.symlink_to(tmp_path / "nowhere")
    with pytest.raises(StorageBackendError, match="already exists"):
        initialise_anchor(anchor)
    assert anchor.is_symlink()
