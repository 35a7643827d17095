"""How a journal row's item names its operation key at rest (``journal_items``)."""

from __future__ import annotations

import blake3
import pytest

from octo_common.errors import StorageBackendError, UnknownKeyId
from octo_common.records import StorageKeyring
from octo_worker.storage.journal_items import ItemLookups, JournalItems, is_hashed_item

K1, K2 = bytes(range(32)), bytes(range(32, 64))


def test_an_item_is_the_key_id_and_a_keyed_hash_of_scope_and_key_never_the_key() -> None:
    items = JournalItems(StorageKeyring("k1", K1))
    item = items.item("tenant-a", "op-1")
    key_id, _, digest = item.partition(":")
    assert key_id == "k1" and len(digest) == 64 and is_hashed_item(item)
    assert "op-1" not in item
    # Keyed with a key derived from the storage key, never the storage key itself.
    message = b"\x00" * 7 + b"\x08tenant-a" + b"\x00" * 7 + b"\x04op-1"
    assert digest != blake3.blake3(message, key=K1).hexdigest()
    derived = blake3.blake3(K1, derive_key_context="octo 2026-12 worker journal item key v1")
    assert digest == blake3.blake3(message, key=derived.digest()).hexdigest()
    # Another scope, key or storage key: another item.
    assert items.item("tenant-b", "op-1") != item
    assert items.item("tenant-a", "op-2") != item
    assert JournalItems(StorageKeyring("k1", K2)).item("tenant-a", "op-1") != item


def test_a_lookup_tries_every_key_of_the_keyring_the_active_one_first() -> None:
    ring = StorageKeyring("k1", K1)
    old = JournalItems(ring).item("tenant-a", "op-1")
    ring.rotate_to("k2", K2)
    items = JournalItems(ring)
    candidates = items.candidates("tenant-a", "op-1")
    assert candidates[0].startswith("k2:") and candidates[1] == old
    assert items.names("tenant-a", old, "op-1") and not items.names("tenant-a", old, "op-2")
    ring.retire("k1")
    with pytest.raises(UnknownKeyId):
        items.names("tenant-a", old, "op-1")


def test_a_commit_writes_a_row_where_its_lookup_found_it() -> None:
    ring = StorageKeyring("k1", K1)
    old = JournalItems(ring).item("tenant-a", "op-1")
    ring.rotate_to("k2", K2)
    lookups = ItemLookups(ring)
    assert set(lookups.asked("tenant-a", ["op-1"])) == set(
        JournalItems(ring).candidates("tenant-a", "op-1")
    )
    lookups.found("tenant-a", "op-1", old)
    assert lookups.written("tenant-a", "op-1", 3) == old
    assert lookups.written("tenant-a", "op-1", None).startswith("k2:")  # a new row


def test_rows_in_clear_or_under_a_missing_key_are_refused_at_the_load() -> None:
    lookups = ItemLookups(StorageKeyring("k1", K1))
    lookups.check_key_ids({"k1"})
    with pytest.raises(StorageBackendError):
        lookups.check_key_ids({""})
    with pytest.raises(UnknownKeyId):
        lookups.check_key_ids({"k0"})
    lookups.items.plain = True  # a read-only look at a journal not migrated yet
    lookups.check_key_ids({"", "k1"})
    assert lookups.items.candidates("tenant-a", "op-1")[-1] == "op-1"
