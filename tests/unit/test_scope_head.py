"""A journal scope's sealed head and the shared head seal, as pure values.

Tags are recomputed here with the ``blake3`` package from the byte layouts
``octo_common.headseal`` and ``octo_worker.storage.scope_head`` document;
digests with ``SetDigest`` over the rows written out by hand.
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
from octo_common.headseal import digest_fields, head_tag, seal_head, verify_head_seal
from octo_common.records import StorageKey, StorageKeyring, StorageRecordKey
from octo_common.setdigest import SetDigest
from octo_worker.storage.scope_head import (
    DIGEST_ANCHOR_KEY,
    DIGESTED_NAMESPACES,
    STORE_HEAD_ANCHOR_KEY,
    DigestChanges,
    ScopeHead,
    ScopeSnapshot,
    anchored_with_digests,
    check_anchor,
    check_loaded_scope,
    check_rows,
    check_snapshot,
    digest_of,
    rows_domain,
)

KEY = bytes(range(32))
SCOPE = "tenant-release"
ROWS = [
    ("worker-journal", "op-1", 3),
    ("worker-journal", "op-2", 2),
    ("worker-session", "sess-1", 3),
    ("worker-session-open", "sess-1", 1),
]


def ring(key_id: str = "storage-v1", key: bytes = KEY) -> StorageKeyring:
    return StorageKeyring(key_id, StorageKey(key))


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def head(revision: int = 3, fence: int = 2, rows: list[tuple[str, str, int]] = ROWS) -> ScopeHead:
    return ScopeHead(SCOPE, revision, fence, digest_of(SCOPE, rows))


def test_the_shared_seal_is_keyed_blake3_over_domain_key_id_and_fields() -> None:
    fields = b"\x00" * 8 + _lp(b"x")
    key_id, tag = seal_head(ring(), b"some-domain", fields)
    expected = blake3.blake3(b"some-domain" + _lp(b"storage-v1") + fields, key=KEY).hexdigest()
    assert (key_id, tag) == ("storage-v1", expected)
    assert head_tag(StorageKey(KEY), b"some-domain", "storage-v1", fields) == expected
    verify_head_seal(ring(), b"some-domain", key_id, tag, fields)
    for domain, forged_fields in ((b"other-domain", fields), (b"some-domain", fields + b"\x00")):
        with pytest.raises(InvalidRecordAuthenticationTag):
            verify_head_seal(ring(), domain, key_id, tag, forged_fields)
    digest = SetDigest.of(b"d", [("n", "k", 1)])
    assert digest_fields(digest) == (1).to_bytes(8, "big") + _lp(digest.to_bytes())


def test_a_seal_that_is_absent_malformed_or_of_an_unknown_key_is_refused() -> None:
    fields = b"fields"
    key_id, tag = seal_head(ring(), b"d", fields)
    cases = [
        (None, tag, InvalidRecordAuthenticationTag),
        (key_id, None, InvalidRecordAuthenticationTag),
        (key_id, tag.upper(), InvalidRecordAuthenticationTag),
        (key_id, tag[:-1], InvalidRecordAuthenticationTag),
        ("not a token", tag, InvalidKeyId),
        ("storage-v2", tag, UnknownKeyId),
    ]
    for bad_id, bad_tag, error in cases:
        with pytest.raises(error):
            verify_head_seal(ring(), b"d", bad_id, bad_tag, fields)
    with pytest.raises(InvalidRecordAuthenticationTag):
        verify_head_seal(ring(key=bytes(32)), b"d", key_id, tag, fields)  # another key


def test_the_scope_head_seal_binds_scope_revision_fence_and_digest() -> None:
    sealed = head().sealed(ring())
    digest = digest_of(SCOPE, ROWS)
    message = (
        b"octo-worker-scope-head-v1"
        + _lp(b"storage-v1")
        + _lp(SCOPE.encode())
        + (3).to_bytes(8, "big")
        + (2).to_bytes(8, "big")
        + (4).to_bytes(8, "big")
        + _lp(digest.to_bytes())
    )
    assert sealed.tag == blake3.blake3(message, key=KEY).hexdigest()
    sealed.verify(ring())
    assert sealed.row() == (3, 2, 4, digest.to_bytes(), "storage-v1", sealed.tag)
    ScopeHead.from_row(SCOPE, sealed.row()).verify(ring())
    _, _, count, value, key_id, tag = sealed.row()
    forgeries = [
        ScopeHead.from_row("tenant-other", sealed.row()),  # another scope's head
        ScopeHead.from_row(SCOPE, (2, 2, count, value, key_id, tag)),  # older revision
        ScopeHead.from_row(SCOPE, (3, 1, count, value, key_id, tag)),  # lower fence
        ScopeHead(SCOPE, 3, 2, digest_of(SCOPE, ROWS[1:]), key_id, tag),  # a row gone
    ]
    for forged in forgeries:
        with pytest.raises(InvalidRecordAuthenticationTag):
            forged.verify(ring())


def test_the_digest_is_per_scope_over_every_digested_namespace() -> None:
    assert DIGESTED_NAMESPACES == (
        "worker-journal",
        "worker-session",
        "worker-session-open",
        "worker-outbox",
        "worker-session-request",
    )
    assert rows_domain(SCOPE) == b"octo-worker-scope-rows-v1" + _lp(SCOPE.encode())
    assert digest_of(SCOPE, ROWS) == SetDigest.of(rows_domain(SCOPE), reversed(ROWS))
    assert digest_of(SCOPE, ROWS).fingerprint() != digest_of("tenant-other", ROWS).fingerprint()


def test_a_malformed_head_row_is_a_storage_error() -> None:
    good = head().sealed(ring()).row()
    for index, bad in ((0, -1), (1, "2"), (2, None), (3, b"short"), (3, None), (4, 7)):
        row = list(good)
        row[index] = bad
        with pytest.raises(StorageBackendError):
            ScopeHead.from_row(SCOPE, tuple(row))


def test_digest_changes_move_a_copy_by_each_write_and_delete() -> None:
    before = head()
    changes = DigestChanges()
    changes.wrote("worker-journal", "op-1", 3, 4)  # updated
    changes.wrote("worker-journal", "op-3", None, 4)  # inserted
    changes.wrote("worker-journal", "op-2", 2, None)  # deleted
    moved = changes.applied_to(before)
    expected = [
        ("worker-journal", "op-1", 4),
        ("worker-journal", "op-3", 4),
        ROWS[2],
        ROWS[3],
    ]
    assert moved == digest_of(SCOPE, expected)
    assert before.digest == digest_of(SCOPE, ROWS)  # the head itself is untouched
    assert len(changes) == 3
    empty = ScopeHead.empty(SCOPE)
    too_many = DigestChanges()
    too_many.wrote("worker-journal", "op-1", 1, None)
    with pytest.raises(RollbackDetected):
        too_many.applied_to(empty)


def test_a_scope_is_accepted_only_with_its_own_rows() -> None:
    sealed = head().sealed(ring())
    check_loaded_scope(sealed, digest_of(SCOPE, ROWS), 3, ring())
    check_rows(sealed, digest_of(SCOPE, ROWS))
    check_loaded_scope(None, digest_of(SCOPE, []), 0, ring())  # a scope never written
    tampered = {
        "deleted": ROWS[1:],
        "older self": [("worker-journal", "op-1", 1), *ROWS[1:]],
        "copied in": [*ROWS, ("worker-journal", "op-9", 2)],
    }
    for rows in tampered.values():
        with pytest.raises(RollbackDetected):
            check_loaded_scope(sealed, digest_of(SCOPE, rows), 0, ring())
    with pytest.raises(RollbackDetected) as below:
        check_loaded_scope(sealed, digest_of(SCOPE, ROWS), 4, ring())  # behind the anchor
    assert (below.value.record_revision, below.value.revision_floor) == (3, 4)
    for anchored, rows in ((2, []), (0, ROWS)):  # the head row deleted
        with pytest.raises(RollbackDetected):
            check_loaded_scope(None, digest_of(SCOPE, rows), anchored, ring())
    with pytest.raises(InvalidRecordAuthenticationTag):
        check_loaded_scope(head(), digest_of(SCOPE, ROWS), 0, ring())  # unsealed


def test_the_anchor_marks_a_journal_with_digests_and_refuses_an_older_one() -> None:
    heads = {SCOPE: 3}
    scope_key = StorageRecordKey("worker-journal", SCOPE)
    marked = anchored_with_digests({scope_key: 3})
    assert marked == {scope_key: 3, DIGEST_ANCHOR_KEY: 5, STORE_HEAD_ANCHOR_KEY: 7}
    assert StorageRecordKey("worker-journal-format", "scope-row-digest") == DIGEST_ANCHOR_KEY
    assert StorageRecordKey("worker-journal-format", "store-head") == STORE_HEAD_ANCHOR_KEY
    check_anchor(marked, heads, 7)
    check_anchor({scope_key: 3}, heads, 4)  # an anchor from before digests, an older journal
    check_anchor({scope_key: 3, DIGEST_ANCHOR_KEY: 5}, heads, 6)  # before the store head
    with pytest.raises(RollbackDetected) as older:
        check_anchor(marked, heads, 4)  # digests dropped, schema edited back
    assert older.value.record_revision == 4
    with pytest.raises(RollbackDetected) as no_store_head:
        check_anchor(marked, heads, 6)  # store head dropped, schema edited back
    assert (no_store_head.value.record_revision, no_store_head.value.revision_floor) == (6, 7)
    with pytest.raises(RollbackDetected):
        check_anchor(marked, {SCOPE: 2}, 7)
    with pytest.raises(RollbackDetected):
        check_anchor(marked, {}, 7)
    with pytest.raises(RollbackAnchorInvalid):
        check_anchor({DIGEST_ANCHOR_KEY: 6}, heads, 7)
    with pytest.raises(RollbackAnchorInvalid):
        check_anchor({STORE_HEAD_ANCHOR_KEY: 8}, heads, 7)


def test_a_snapshot_without_digests_gets_the_anchor_check_alone() -> None:
    sealed = head().sealed(ring())
    check_snapshot(ScopeSnapshot(sealed, digest_of(SCOPE, ROWS), 3, 4, 3), ring())
    with pytest.raises(RollbackDetected):
        check_snapshot(ScopeSnapshot(sealed, digest_of(SCOPE, ROWS[1:]), 3, 3, 0), ring())
    check_snapshot(ScopeSnapshot(None, None, 3, 4, 3), ring())  # an older journal, read as it is
    with pytest.raises(RollbackDetected) as behind:
        check_snapshot(ScopeSnapshot(None, None, 2, 4, 3), ring())
    assert (behind.value.record_revision, behind.value.revision_floor) == (2, 3)
