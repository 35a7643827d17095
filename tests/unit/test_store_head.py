"""The journal's store head (pure): its digest over scope heads, its seal, its moves."""

from __future__ import annotations

import pytest

from octo_common.errors import InvalidRecordAuthenticationTag, RollbackDetected, UnknownKeyId
from octo_common.records import StorageKeyring
from octo_worker.storage.store_head import (
    JournalStoreHead,
    check_store,
    digest_of_heads,
    moved,
)

HEADS = [("tenant-a", 1, 4), ("tenant-b", 3, 9)]


def ring(key_id: str = "k1", fill: int = 7) -> StorageKeyring:
    return StorageKeyring(key_id, bytes([fill]) * 32)


def test_a_sealed_store_head_checks_against_the_heads_it_was_built_from() -> None:
    store = JournalStoreHead.sealed(ring(), 3, digest_of_heads(HEADS))
    check_store(store, list(reversed(HEADS)), ring())  # order does not matter
    read = JournalStoreHead.from_row(store.row())
    check_store(read, HEADS, ring())
    assert repr(read) == "JournalStoreHead(revision=3, scopes=2, sealed=True)"


@pytest.mark.parametrize(
    "heads",
    [
        HEADS[:1],  # a scope deleted whole
        [("tenant-a", 1, 4), ("tenant-b", 3, 8)],  # a scope put back to an earlier revision
        [("tenant-a", 1, 4), ("tenant-b", 2, 9)],  # ... or an earlier fence
        [*HEADS, ("tenant-c", 1, 0)],  # a scope added behind the store's back
    ],
    ids=["deleted", "revision-back", "fence-back", "added"],
)
def test_any_other_set_of_scope_heads_is_a_rollback(heads: list[tuple[str, int, int]]) -> None:
    store = JournalStoreHead.sealed(ring(), 3, digest_of_heads(HEADS))
    with pytest.raises(RollbackDetected):
        check_store(store, heads, ring())


def test_a_store_head_row_missing_or_without_its_digest_is_a_rollback() -> None:
    with pytest.raises(RollbackDetected):
        JournalStoreHead.from_row(None)
    with pytest.raises(RollbackDetected):
        JournalStoreHead.from_row((1, 2, None, "k1", "0" * 64))
    with pytest.raises(RollbackDetected):
        JournalStoreHead.from_row((1, 2, b"short", "k1", "0" * 64))


def test_the_seal_is_checked_before_any_use() -> None:
    store = JournalStoreHead.sealed(ring(), 3, digest_of_heads(HEADS))
    forged = JournalStoreHead(3, digest_of_heads(HEADS[:1]), store.key_id, store.tag)
    with pytest.raises(InvalidRecordAuthenticationTag):
        check_store(JournalStoreHead(4, store.digest, store.key_id, store.tag), HEADS, ring())
    with pytest.raises(InvalidRecordAuthenticationTag):
        check_store(forged, HEADS[:1], ring())
    with pytest.raises(InvalidRecordAuthenticationTag):
        moved(forged, [], ring())
    with pytest.raises(UnknownKeyId):
        check_store(store, HEADS, ring("k2"))


def test_moves_give_the_digest_of_the_heads_after_them() -> None:
    store = JournalStoreHead.sealed(ring(), 3, digest_of_heads(HEADS))
    after = moved(
        store,
        [(("tenant-b", 3, 9), ("tenant-b", 3, 10)), (None, ("tenant-c", 1, 0))],
        ring(),
    )
    check_store(after, [("tenant-a", 1, 4), ("tenant-b", 3, 10), ("tenant-c", 1, 0)], ring())
    assert after.revision == 4
    assert moved(after, [], ring()).revision == 4  # a reseal
    with pytest.raises(RollbackDetected):
        moved(
            JournalStoreHead.sealed(ring(), 3, digest_of_heads([])), [(HEADS[0], HEADS[0])], ring()
        )
