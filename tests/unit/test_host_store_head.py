"""The ledger store head and the version 2 rollback anchor, as pure values.

The head's tag is recomputed here with the ``blake3`` package from the byte
layout ``octo_host.storage.head`` documents; the anchor bytes are written out
by hand.
"""

from __future__ import annotations

import blake3
import pytest

from octo_common.errors import (
    InvalidKeyId,
    InvalidRecordAuthenticationTag,
    RollbackAnchorInvalid,
    RollbackDetected,
    StorageBackendError,
    UnknownKeyId,
)
from octo_common.records import StorageKey, StorageKeyring, StorageRecordKey
from octo_common.setdigest import SetDigest
from octo_host.storage.anchor import (
    HeadAnchor,
    compare_head_with_anchor,
    decode_ledger_anchor,
    encode_head_anchor,
)
from octo_host.storage.head import LEDGER_ROWS_DOMAIN, StoreHead

KEY = bytes(range(32))
ROWS = [("workflow-ledger", "release-42", 2), ("workflow-routes", "release-42", 1)]


def ring() -> StorageKeyring:
    return StorageKeyring("storage-v1", StorageKey(KEY))


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def head_at(revision: int, rows: list[tuple[str, str, int]] = ROWS) -> StoreHead:
    return StoreHead(revision, SetDigest.of(LEDGER_ROWS_DOMAIN, rows))


def test_the_seal_is_keyed_blake3_over_the_framed_head() -> None:
    head = head_at(7).sealed_with(ring())
    digest = SetDigest.of(LEDGER_ROWS_DOMAIN, ROWS)
    message = (
        b"octo-storage-head-v1"
        + _lp(b"storage-v1")
        + (7).to_bytes(8, "big")
        + (2).to_bytes(8, "big")
        + _lp(digest.to_bytes())
    )
    assert head.key_id == "storage-v1"
    assert head.tag == blake3.blake3(message, key=KEY).hexdigest()
    head.verify(ring())
    assert head.row() == (7, 2, digest.to_bytes(), "storage-v1", head.tag)
    assert StoreHead.from_row(head.row()).matches(head)


def test_a_head_is_refused_when_any_sealed_field_changes() -> None:
    sealed = head_at(7).sealed_with(ring())
    _, count, value, key_id, tag = sealed.row()
    older = StoreHead.from_row((6, count, value, key_id, tag))
    fewer = StoreHead(7, SetDigest.of(LEDGER_ROWS_DOMAIN, ROWS[:1]), key_id, tag)
    rolled_back = StoreHead(
        7,
        SetDigest.of(LEDGER_ROWS_DOMAIN, [("workflow-ledger", "release-42", 1), ROWS[1]]),
        key_id,
        tag,
    )
    for forged in (older, fewer, rolled_back):
        with pytest.raises(InvalidRecordAuthenticationTag):
            forged.verify(ring())


def test_an_unsealed_or_foreign_head_is_refused_by_a_keyed_store() -> None:
    with pytest.raises(InvalidRecordAuthenticationTag):
        head_at(3).verify(ring())  # never sealed: what a bare backend writes
    sealed = head_at(3).sealed_with(ring())
    with pytest.raises(InvalidRecordAuthenticationTag):
        StoreHead(3, sealed.digest, sealed.key_id, (sealed.tag or "").upper()).verify(ring())
    with pytest.raises(InvalidKeyId):
        StoreHead(3, sealed.digest, "Storage v1", sealed.tag).verify(ring())
    other = StorageKeyring("storage-v2", StorageKey(bytes(32)))
    with pytest.raises(UnknownKeyId):
        sealed.verify(other)
    other.add_read_key("storage-v1", StorageKey(bytes(32)))  # same id, another key
    with pytest.raises(InvalidRecordAuthenticationTag):
        sealed.verify(other)


def test_a_head_resealed_after_rotation_opens_under_the_new_key_only() -> None:
    keyring = ring()
    keyring.rotate_to("storage-v2", StorageKey(bytes([9]) * 32))
    resealed = head_at(8).sealed_with(keyring)
    assert resealed.key_id == "storage-v2"
    keyring.retire("storage-v1")
    resealed.verify(keyring)


@pytest.mark.parametrize(
    "row",
    [
        (-1, 0, bytes(512), None, None),
        (1, -1, bytes(512), None, None),
        (1, 0, bytes(511), None, None),
        ("1", 0, bytes(512), None, None),
        (1, 0, bytes(512), 5, None),
        (1, 0, bytes(512), None, b"tag"),
    ],
)
def test_a_malformed_head_row_is_a_backend_error(row: tuple[object, ...]) -> None:
    with pytest.raises(StorageBackendError):
        StoreHead.from_row(row)


def test_the_version_2_anchor_is_fixed_size_compact_json() -> None:
    anchor = HeadAnchor.of(head_at(42))
    fingerprint = SetDigest.of(LEDGER_ROWS_DOMAIN, ROWS).fingerprint().hex()
    assert anchor == HeadAnchor(42, 2, fingerprint)
    encoded = encode_head_anchor(anchor)
    assert encoded == (
        b'{"format_version":2,"store_revision":42,"record_count":2,"digest":"'
        + fingerprint.encode()
        + b'"}'
    )
    assert decode_ledger_anchor(encoded) == anchor
    largest = encode_head_anchor(HeadAnchor(2**64 - 1, 2**64 - 1, "f" * 64))
    assert len(largest) <= 180


def test_version_1_anchors_still_decode_record_by_record() -> None:
    assert decode_ledger_anchor(b'{"format_version":1,"records":[]}') == {}
    assert decode_ledger_anchor(
        b'{"format_version":1,"records":'
        b'[{"namespace":"workflow-ledger","name":"release-42","revision":3}]}'
    ) == {StorageRecordKey("workflow-ledger", "release-42"): 3}


@pytest.mark.parametrize(
    "document",
    [
        b'{"format_version":2,"store_revision":1,"record_count":1,"digest":"' + b"A" * 64 + b'"}',
        b'{"format_version":2,"store_revision":1,"record_count":1,"digest":"' + b"a" * 63 + b'"}',
        b'{"format_version":2,"store_revision":-1,"record_count":1,"digest":"' + b"a" * 64 + b'"}',
        b'{"format_version":2,"store_revision":1,"record_count":1.5,"digest":"' + b"a" * 64 + b'"}',
        b'{"format_version":2,"store_revision":1,"record_count":1}',
        b'{"format_version":2,"store_revision":1,"record_count":1,"digest":"'
        + b"a" * 64
        + b'","extra":0}',
        b'{"format_version":2,"store_revision":1,"store_revision":2,"record_count":1,"digest":"'
        + b"a" * 64
        + b'"}',
        b'{"format_version":2,"store_revision":18446744073709551616,"record_count":1,"digest":"'
        + b"a" * 64
        + b'"}',
        b'{"format_version":3,"store_revision":1,"record_count":1,"digest":"' + b"a" * 64 + b'"}',
        b'{"format_version":"2"}',
        b'{"format_version":1,"records":[],"extra":1}',
        b"[]",
        b"",
    ],
)
def test_a_malformed_anchor_is_refused(document: bytes) -> None:
    with pytest.raises(RollbackAnchorInvalid):
        decode_ledger_anchor(document)


def test_a_head_behind_its_anchor_or_beside_it_is_a_rollback() -> None:
    anchored = HeadAnchor.of(head_at(5))
    compare_head_with_anchor(anchored, head_at(5))  # the same head
    compare_head_with_anchor(anchored, head_at(6, ROWS[:1]))  # ahead: a crash before the write
    with pytest.raises(RollbackDetected) as behind:
        compare_head_with_anchor(anchored, head_at(4))
    assert (behind.value.record_revision, behind.value.revision_floor) == (4, 5)
    with pytest.raises(RollbackDetected) as forked:
        compare_head_with_anchor(anchored, head_at(5, ROWS[:1]))  # another history
    assert (forked.value.record_revision, forked.value.revision_floor) == (5, 5)
