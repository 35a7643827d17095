"""Pure authenticated-storage rules: keys, keyring, envelope, encryption, anchor format.

Scenarios follow the keys and envelope, the check order of a read, payload
encryption, the anchor's format and the pure parts of the store's
scenarios. Byte-exact expectations come from the independent vectors in
tests/vectors/public.json.
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
from typing import Any

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octo_common import errors
from octo_common.errors import (
    ActiveKeyCannotBeRetired,
    DuplicateKeyId,
    InvalidEnvelope,
    InvalidKeyId,
    InvalidRecordAuthenticationTag,
    InvalidRecordName,
    InvalidRecordNamespace,
    InvalidRevision,
    InvalidStorageKey,
    PayloadTooLarge,
    RecordTooLarge,
    RevisionExhausted,
    RevisionFloorMismatch,
    RevisionMismatch,
    RollbackAnchorInvalid,
    RollbackDetected,
    StorageError,
    UnknownKeyId,
    UnsupportedRecordFormat,
)
from octo_common.records import (
    AuthenticatedRecord,
    Conflict,
    StorageKey,
    StorageKeyId,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
    decode_anchor,
    decrypt_document,
    encode_anchor,
    encrypt_document,
    open_record,
    seal_record,
    storage_record_tag,
    validate_revision_pair,
)
from tests.vectors import vectors_path

VECTORS = vectors_path()

# Vector error names → our classes, one to one (README "Error names").
VECTOR_ERRORS: dict[str, type[StorageError]] = {
    "InvalidAuthenticationTag": InvalidRecordAuthenticationTag,
    "InvalidEnvelope": InvalidEnvelope,
    "RecordTooLarge": RecordTooLarge,
    "UnsupportedRecordFormat": UnsupportedRecordFormat,
    "InvalidRevision": InvalidRevision,
    "RevisionMismatch": RevisionMismatch,
    "InvalidKeyId": InvalidKeyId,
    "PayloadTooLarge": PayloadTooLarge,
    "UnknownKeyId": UnknownKeyId,
    "RollbackDetected": RollbackDetected,
    "RevisionFloorMismatch": RevisionFloorMismatch,
}

KEY_07 = StorageKey(bytes([7]) * 32)
LEDGER = StorageRecordKey("workflow-ledger", "release-42")
FIRST_PAYLOAD = b"first payload"


def keyring(key_id: str = "storage-v1", key: StorageKey = KEY_07) -> StorageKeyring:
    return StorageKeyring(key_id, key)


def envelope(
    *,
    format_version: Any = 1,
    key_id: Any = "storage-v1",
    revision: Any = 1,
    payload: Any = "Zmlyc3QgcGF5bG9hZA",
    auth_tag: Any = "0" * 64,
) -> bytes:
    """A hand-built envelope (json.dumps keeps this order and is compact here)."""
    fields = {
        "format_version": format_version,
        "key_id": key_id,
        "revision": revision,
        "payload": payload,
        "auth_tag": auth_tag,
    }
    return json.dumps(fields, separators=(",", ":")).encode()


def load_vectors() -> dict[str, Any]:
    if not VECTORS.exists():
        pytest.skip(f"conformance vectors not found at {VECTORS}")
    return json.loads(VECTORS.read_text())  # type: ignore[no-any-return]


def vector_cases(category: str) -> list[dict[str, Any]]:
    if not VECTORS.exists():
        return []
    return json.loads(VECTORS.read_text())[category]  # type: ignore[no-any-return]


# Vectors ---------------------------------------------------------------------


def test_vectors_file_has_storage_categories() -> None:
    data = load_vectors()
    assert data["storage_envelopes"], "no storage_envelopes vectors"
    assert data["storage_open_cases"], "no storage_open_cases vectors"


@pytest.mark.parametrize("case", vector_cases("storage_envelopes"), ids=lambda c: c["id"])
def test_vector_storage_envelope_is_sealed_byte_for_byte(case: dict[str, Any]) -> None:
    ring = StorageKeyring(case["key_id"], StorageKey(bytes.fromhex(case["key_hex"])))
    record_key = StorageRecordKey(case["namespace"], case["name"])
    payload = bytes.fromhex(case["payload_hex"])

    sealed = seal_record(ring, record_key, case["revision"], payload)
    tag = storage_record_tag(ring.active_key, record_key, case["key_id"], case["revision"], payload)
    opened = open_record(ring, record_key, sealed, case["revision"])

    assert sealed == case["envelope_json"].encode("utf-8")
    assert tag == case["auth_tag"]
    if "payload_base64" in case:
        assert f'"payload":"{case["payload_base64"]}"' in sealed.decode()
    assert opened == AuthenticatedRecord(case["revision"], case["key_id"], payload)


@pytest.mark.parametrize("case", vector_cases("storage_open_cases"), ids=lambda c: c["id"])
def test_vector_storage_open_case(case: dict[str, Any]) -> None:
    ring = StorageKeyring(
        case["keyring"]["key_id"], StorageKey(bytes.fromhex(case["keyring"]["key_hex"]))
    )
    record_key = StorageRecordKey(case["namespace"], case["name"])
    stored = case.get("stored_bytes")
    stored_revision: int = case.get("stored_revision") or 0

    def load() -> AuthenticatedRecord | None:
        validate_revision_pair(
            stored_revision if stored is not None else None, case["revision_floor"]
        )
        if stored is None:
            return None
        return open_record(ring, record_key, stored.encode("utf-8"), stored_revision)

    if case["result"] == "ok":
        record = load()
        assert record is not None
        assert record.payload == bytes.fromhex(case["payload_hex"])
        assert record.revision == stored_revision
        assert record.key_id == case["keyring"]["key_id"]
    else:
        assert case["error"] in VECTOR_ERRORS, f"unmapped vector error {case['error']}"
        with pytest.raises(VECTOR_ERRORS[case["error"]]):
            load()


def test_vector_error_mapping_is_one_to_one_onto_storage_errors() -> None:
    targets = list(VECTOR_ERRORS.values())
    assert len(set(targets)) == len(targets)
    for name, cls in VECTOR_ERRORS.items():
        assert issubclass(cls, StorageError)
        assert errors.ERROR_CLASSES[cls.__name__] is cls, name


# StorageKey -----------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"\x01" * 31, b"\x01" * 33, "k" * 32, None])
def test_storage_key_must_be_32_bytes(raw: Any) -> None:
    with pytest.raises(InvalidStorageKey):
        StorageKey(raw)


def test_storage_key_accepts_all_zero_and_hides_its_bytes() -> None:
    key = StorageKey(bytes(32))
    secret = StorageKey(b"S" * 32)

    assert key.reveal() == bytes(32)
    assert repr(secret) == "StorageKey([redacted])"
    assert str(secret) == "StorageKey([redacted])"
    assert "S" * 8 not in repr(keyring(key=secret))


@pytest.mark.parametrize("action", [pickle.dumps, copy.copy, copy.deepcopy])
def test_storage_key_cannot_be_pickled_or_copied(action: Any) -> None:
    with pytest.raises(TypeError):
        action(StorageKey(b"\x02" * 32))


def test_storage_key_error_text_never_contains_the_material() -> None:
    with pytest.raises(InvalidStorageKey) as caught:
        StorageKey(b"TOPSECRET" * 4)
    assert "TOPSECRET" not in str(caught.value)
    assert "TOPSECRET" not in repr(caught.value)


# Identifiers ----------------------------------------------------------------


def test_storage_key_id_is_a_str_token_of_at_most_64_bytes() -> None:
    key_id = StorageKeyId("storage-v1")

    assert isinstance(key_id, str)
    assert key_id == "storage-v1"
    assert StorageKeyId("a" * 64) == "a" * 64


@pytest.mark.parametrize("bad", ["Storage v1", "", "a" * 65, "UPPER", "k/1", "k:1", "é", 7])
def test_storage_key_id_rejects_non_tokens(bad: Any) -> None:
    with pytest.raises(InvalidKeyId):
        StorageKeyId(bad)


def test_record_key_checks_namespace_then_name() -> None:
    assert StorageRecordKey("n" * 64, "r" * 128).name == "r" * 128
    with pytest.raises(InvalidRecordNamespace):
        StorageRecordKey("n" * 65, "ok")
    with pytest.raises(InvalidRecordName):
        StorageRecordKey("workflow-ledger", "r" * 129)
    with pytest.raises(InvalidRecordName):
        StorageRecordKey("workflow-ledger", "release 42")
    # Both invalid: the namespace is reported.
    with pytest.raises(InvalidRecordNamespace):
        StorageRecordKey("Bad Namespace", "release 42")
    with pytest.raises(InvalidRecordNamespace):
        StorageRecordKey("", "x")


def test_record_keys_are_frozen_hashable_and_ordered_by_namespace_then_name() -> None:
    keys = [
        StorageRecordKey("b", "a"),
        StorageRecordKey("a", "z"),
        StorageRecordKey("a", "b"),
    ]
    assert sorted(keys) == [
        StorageRecordKey("a", "b"),
        StorageRecordKey("a", "z"),
        StorageRecordKey("b", "a"),
    ]
    assert {StorageRecordKey("a", "b"): 1}[StorageRecordKey("a", "b")] == 1
    with pytest.raises(AttributeError):
        keys[0].name = "other"  # type: ignore[misc]


# Keyring --------------------------------------------------------------------


def test_keyring_add_rotate_retire() -> None:
    ring = keyring("k1", StorageKey(b"\x01" * 32))
    ring.add_read_key("k0", StorageKey(b"\x00" * 32))
    ring.rotate_to("k2", StorageKey(b"\x02" * 32))

    assert ring.active_id == "k2"
    assert isinstance(ring.active_id, StorageKeyId)
    assert ring.key_for("k1").reveal() == b"\x01" * 32
    assert set(ring.key_ids) == {"k0", "k1", "k2"}

    ring.retire("k1")
    with pytest.raises(UnknownKeyId) as caught:
        ring.key_for("k1")
    assert caught.value.key_id == "k1"


def test_keyring_refuses_duplicates_active_retirement_and_unknown_ids() -> None:
    ring = keyring("k1", StorageKey(b"\x01" * 32))
    with pytest.raises(DuplicateKeyId) as duplicate:
        ring.add_read_key("k1", StorageKey(b"\x03" * 32))
    assert duplicate.value.key_id == "k1"
    with pytest.raises(DuplicateKeyId):
        ring.rotate_to("k1", StorageKey(b"\x03" * 32))
    with pytest.raises(ActiveKeyCannotBeRetired):
        ring.retire("k1")
    with pytest.raises(UnknownKeyId) as unknown:
        ring.retire("k9")
    assert unknown.value.key_id == "k9"
    with pytest.raises(InvalidKeyId):
        ring.add_read_key("Bad Id", StorageKey(b"\x03" * 32))
    assert ring.active_id == "k1"
    assert ring.key_ids == ("k1",)


def test_keyring_repr_shows_only_active_id_and_count() -> None:
    ring = keyring("k1", StorageKey(b"Z" * 32))
    ring.add_read_key("k2", StorageKey(b"Y" * 32))

    assert repr(ring) == "StorageKeyring(active_id='k1', keys=2)"
    for action in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError):
            action(ring)


# Value types ----------------------------------------------------------------


def test_storage_values_are_frozen_and_compare_by_value() -> None:
    assert StoredRecord(1, b"x") == StoredRecord(1, b"x")
    assert StorageSnapshot(None, 0) == StorageSnapshot(None, 0)
    assert Stored(3) == Stored(3)
    assert Conflict(None, 0) != Conflict(1, 1)
    assert AuthenticatedRecord(1, "k", b"p") != AuthenticatedRecord(1, "k", b"q")
    with pytest.raises(AttributeError):
        Stored(3).revision_floor = 4  # type: ignore[misc]
    assert "secret" not in repr(AuthenticatedRecord(1, "k", b"secret"))
    assert "secret" not in repr(StoredRecord(1, b"secret"))


# Revision pair ------------------------------------------------


def test_revision_pair_rules() -> None:
    validate_revision_pair(None, 0)
    validate_revision_pair(3, 3)
    with pytest.raises(RollbackDetected) as deleted:
        validate_revision_pair(None, 1)
    assert (deleted.value.record_revision, deleted.value.revision_floor) == (None, 1)
    with pytest.raises(InvalidRevision):
        validate_revision_pair(0, 0)
    with pytest.raises(RollbackDetected) as older:
        validate_revision_pair(1, 2)
    assert (older.value.record_revision, older.value.revision_floor) == (1, 2)
    with pytest.raises(RevisionFloorMismatch) as forced:
        validate_revision_pair(1, 0)
    assert (forced.value.record_revision, forced.value.revision_floor) == (1, 0)


# Sealing --------------------------------------------------------------------


def test_seal_has_the_documented_shape() -> None:
    sealed = seal_record(keyring(), LEDGER, 1, FIRST_PAYLOAD).decode()
    prefix = (
        '{"format_version":1,"key_id":"storage-v1","revision":1,"payload":"Zmlyc3QgcGF5bG9hZA",'
    )
    assert sealed.startswith(prefix)
    assert sealed.endswith('"}')
    tag = json.loads(sealed)["auth_tag"]
    assert len(tag) == 64 and tag == tag.lower()

    empty = seal_record(keyring(), LEDGER, 1, b"").decode()
    assert '"payload":""' in empty
    assert open_record(keyring(), LEDGER, empty.encode(), 1).payload == b""


def test_tag_binds_location_key_id_revision_and_payload() -> None:
    """Cross-check the formula with a direct keyed BLAKE3 computation."""
    message = (
        b"octo-storage-record-v1"
        + b"\x01"
        + (15).to_bytes(8, "big")
        + b"workflow-ledger"
        + (10).to_bytes(8, "big")
        + b"release-42"
        + (10).to_bytes(8, "big")
        + b"storage-v1"
        + (1).to_bytes(8, "big")
        + (13).to_bytes(8, "big")
        + FIRST_PAYLOAD
    )
    expected = blake3.blake3(message, key=bytes([7]) * 32).hexdigest()
    tag = storage_record_tag(KEY_07, LEDGER, "storage-v1", 1, FIRST_PAYLOAD)

    assert tag == expected
    others = {
        storage_record_tag(
            KEY_07,
            StorageRecordKey("workflow-ledger", "release-43"),
            "storage-v1",
            1,
            FIRST_PAYLOAD,
        ),
        storage_record_tag(
            KEY_07, StorageRecordKey("worker-journal", "release-42"), "storage-v1", 1, FIRST_PAYLOAD
        ),
        storage_record_tag(KEY_07, LEDGER, "storage-v2", 1, FIRST_PAYLOAD),
        storage_record_tag(KEY_07, LEDGER, "storage-v1", 2, FIRST_PAYLOAD),
        storage_record_tag(KEY_07, LEDGER, "storage-v1", 1, FIRST_PAYLOAD + b"!"),
        storage_record_tag(StorageKey(bytes(32)), LEDGER, "storage-v1", 1, FIRST_PAYLOAD),
    }
    assert tag not in others and len(others) == 6


def test_seal_checks_payload_size_before_anything_else() -> None:
    with pytest.raises(PayloadTooLarge) as caught:
        seal_record(keyring(), LEDGER, 0, bytes(2_097_153))
    assert (caught.value.actual, caught.value.maximum) == (2_097_153, 2_097_152)
    # The largest payload fits: its envelope stays under 3 MiB.
    big = seal_record(keyring(), LEDGER, 1, bytes(2_097_152))
    assert len(big) < 3_145_728
    assert open_record(keyring(), LEDGER, big, 1).payload == bytes(2_097_152)


def test_seal_rejects_revision_zero_and_overflow() -> None:
    with pytest.raises(InvalidRevision):
        seal_record(keyring(), LEDGER, 0, b"x")
    with pytest.raises(RevisionExhausted):
        seal_record(keyring(), LEDGER, 2**64, b"x")
    top = seal_record(keyring(), LEDGER, 2**64 - 1, b"x")
    assert open_record(keyring(), LEDGER, top, 2**64 - 1).revision == 2**64 - 1


# Opening: every check of a read, in order ---------------------------------------------


def valid_envelope(revision: int = 1, payload: bytes = FIRST_PAYLOAD) -> bytes:
    return seal_record(keyring(), LEDGER, revision, payload)


def with_field(data: bytes, **changes: Any) -> bytes:
    fields = json.loads(data)
    fields.update(changes)
    return json.dumps(fields, separators=(",", ":")).encode()


def test_open_valid_envelope() -> None:
    record = open_record(keyring(), LEDGER, valid_envelope(), 1)
    assert record == AuthenticatedRecord(1, "storage-v1", FIRST_PAYLOAD)
    assert isinstance(record.key_id, StorageKeyId)


def test_open_step2_record_too_large_comes_first() -> None:
    oversized = b"x" * 3_145_729
    with pytest.raises(RecordTooLarge) as caught:
        open_record(keyring(), LEDGER, oversized, 1)
    assert (caught.value.actual, caught.value.maximum) == (3_145_729, 3_145_728)


@pytest.mark.parametrize(
    "stored",
    [
        b"not json",
        b"[]",
        b'"text"',
        b"\xff\xfe",
        envelope()[:-1],
        envelope() + b"x",
        envelope(format_version="1"),
        envelope(format_version="2"),
        envelope(format_version=True),
        envelope(format_version=1.0),
        envelope(format_version=256),
        envelope(format_version=-1),
        envelope(revision="1"),
        envelope(revision=True),
        envelope(revision=-1),
        envelope(revision=2**64),
        envelope(key_id=1),
        envelope(payload=None),
        envelope(auth_tag=["0" * 64]),
        envelope(key_id="\ud800"),
        envelope().replace(b'"revision":1', b'"revision":1.0'),
        envelope().replace(b'"revision":1', b'"revision":1e0'),
        envelope().replace(b'"revision":1', b'"revision":NaN'),
        envelope().replace(b'"key_id":"storage-v1"', b'"key_id":"stor\x01age"'),
        envelope()[:-1] + b',"extra":1}',
        envelope()[:-1] + b',"revision":1}',
        json.dumps({"format_version": 1, "key_id": "storage-v1", "revision": 1}).encode(),
    ],
    ids=lambda s: repr(s[:40]),
)
def test_open_step3_strict_parse_and_types_are_invalid_envelope(stored: bytes) -> None:
    with pytest.raises(InvalidEnvelope):
        open_record(keyring(), LEDGER, stored, 1)


def test_open_step4_unsupported_format_before_revision_checks() -> None:
    with pytest.raises(UnsupportedRecordFormat) as caught:
        open_record(keyring(), LEDGER, envelope(format_version=2, revision=0), 1)
    assert caught.value.version == 2


def test_open_step5_revision_zero_before_mismatch() -> None:
    with pytest.raises(InvalidRevision):
        open_record(keyring(), LEDGER, envelope(revision=0, key_id="Bad"), 1)


def test_open_step6_revision_mismatch_names_backend_then_envelope() -> None:
    with pytest.raises(RevisionMismatch) as caught:
        open_record(keyring(), LEDGER, with_field(valid_envelope(), revision=2), 1)
    assert (caught.value.backend, caught.value.envelope) == (1, 2)


def test_open_step7_key_id_syntax_before_base64() -> None:
    with pytest.raises(InvalidKeyId):
        open_record(keyring(), LEDGER, envelope(key_id="Storage v1", payload="a==="), 1)


@pytest.mark.parametrize(
    "payload",
    [
        "Zmlyc3QgcGF5bG9hZA==",
        "Zmlyc3QgcGF5bG9hZA=",
        "Zmlyc3QgcGF5bG9h-A",
        "Zmlyc3Qg_GF5bG9hZA",
        "Z",
        "Zm9v YmFy",
    ],
)
def test_open_step8_strict_base64(payload: str) -> None:
    with pytest.raises(InvalidEnvelope):
        open_record(keyring(), LEDGER, with_field(valid_envelope(), payload=payload), 1)


def test_open_step9_decoded_payload_too_large() -> None:
    too_big = base64.b64encode(bytes(2_097_153)).decode().rstrip("=")
    stored = envelope(payload=too_big, auth_tag="Z")
    assert len(stored) <= 3_145_728
    with pytest.raises(PayloadTooLarge) as caught:
        open_record(keyring(), LEDGER, stored, 1)
    assert (caught.value.actual, caught.value.maximum) == (2_097_153, 2_097_152)


def test_open_step10_non_canonical_base64_tail_bits() -> None:
    # "...ZB" decodes to the same bytes as "...ZA" but has nonzero unused bits.
    with pytest.raises(InvalidEnvelope):
        open_record(
            keyring(), LEDGER, with_field(valid_envelope(), payload="Zmlyc3QgcGF5bG9hZB"), 1
        )


@pytest.mark.parametrize("tag", ["A" * 64, "0" * 63, "0" * 65, "g" * 64, ""])
def test_open_step11_tag_syntax(tag: str) -> None:
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(), LEDGER, with_field(valid_envelope(), auth_tag=tag), 1)


def test_open_step11_uppercase_tag_of_a_valid_record() -> None:
    stored = valid_envelope()
    tag = json.loads(stored)["auth_tag"]
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(), LEDGER, with_field(stored, auth_tag=tag.upper()), 1)


def test_open_step11_tag_syntax_comes_before_unknown_key_id() -> None:
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(), LEDGER, with_field(valid_envelope(), key_id="k9", auth_tag="X"), 1)
    with pytest.raises(UnknownKeyId) as caught:
        open_record(keyring(), LEDGER, with_field(valid_envelope(), key_id="k9"), 1)
    assert caught.value.key_id == "k9"


def test_open_step13_tampered_moved_or_foreign_key_records_fail_authentication() -> None:
    stored = valid_envelope()
    tampered = with_field(stored, payload=base64.b64encode(b"first paylOad").decode().rstrip("="))
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(), LEDGER, tampered, 1)
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(), StorageRecordKey("workflow-ledger", "release-43"), stored, 1)
    with pytest.raises(InvalidRecordAuthenticationTag):
        open_record(keyring(key=StorageKey(b"\x08" * 32)), LEDGER, stored, 1)


def test_rotation_keeps_old_records_readable_until_retired() -> None:
    ring = keyring("k1", StorageKey(b"\x01" * 32))
    old = seal_record(ring, LEDGER, 1, b"v1")
    ring.rotate_to("k2", StorageKey(b"\x02" * 32))

    assert open_record(ring, LEDGER, old, 1).key_id == "k1"
    new = seal_record(ring, LEDGER, 2, b"v2")
    assert open_record(ring, LEDGER, new, 2) == AuthenticatedRecord(2, "k2", b"v2")

    ring.retire("k1")
    with pytest.raises(UnknownKeyId) as caught:
        open_record(ring, LEDGER, old, 1)
    assert caught.value.key_id == "k1"
    assert open_record(ring, LEDGER, new, 2).payload == b"v2"


record_names = st.from_regex(r"[a-z0-9._-]{1,128}", fullmatch=True)
namespaces = st.from_regex(r"[a-z0-9._-]{1,64}", fullmatch=True)


@settings(max_examples=150, deadline=None)
@given(
    namespace=namespaces,
    name=record_names,
    revision=st.integers(min_value=1, max_value=2**64 - 1),
    payload=st.binary(max_size=512),
)
def test_seal_open_round_trip(namespace: str, name: str, revision: int, payload: bytes) -> None:
    record_key = StorageRecordKey(namespace, name)
    sealed = seal_record(keyring(), record_key, revision, payload)
    assert open_record(keyring(), record_key, sealed, revision) == AuthenticatedRecord(
        revision, "storage-v1", payload
    )


@settings(max_examples=300, deadline=None)
@given(
    payload=st.binary(max_size=64),
    revision=st.integers(min_value=1, max_value=10**6),
    data=st.data(),
)
def test_any_single_byte_change_of_an_envelope_fails(
    payload: bytes, revision: int, data: st.DataObject
) -> None:
    sealed = bytearray(seal_record(keyring(), LEDGER, revision, payload))
    index = data.draw(st.integers(min_value=0, max_value=len(sealed) - 1))
    replacement = data.draw(
        st.integers(min_value=0, max_value=255).filter(lambda b: b != sealed[index])
    )
    sealed[index] = replacement
    with pytest.raises(StorageError):
        open_record(keyring(), LEDGER, bytes(sealed), revision)


# Payload encryption --------------------------------------------------------


def data_keyring() -> StorageKeyring:
    return StorageKeyring("data-1", StorageKey(b"\x11" * 32))


def test_encryption_round_trip_and_format() -> None:
    ring = data_keyring()
    payload = encrypt_document(ring, "worker-journal", "tenant-release", "op-1", 4, b'{"doc":1}')

    assert payload[:8] == (6).to_bytes(8, "big")
    assert payload[8:14] == b"data-1"
    assert len(payload) == 8 + 6 + 12 + len(b'{"doc":1}') + 16
    assert b'{"doc":1}' not in payload
    assert (
        decrypt_document(ring, "worker-journal", "tenant-release", "op-1", 4, payload)
        == b'{"doc":1}'
    )
    again = encrypt_document(ring, "worker-journal", "tenant-release", "op-1", 4, b'{"doc":1}')
    assert again != payload  # a fresh random nonce each time


@pytest.mark.parametrize(
    "location",
    [
        ("worker-session", "tenant-release", "op-1", 4),
        ("worker-journal", "tenant-other", "op-1", 4),
        ("worker-journal", "tenant-release", "op-2", 4),
        ("worker-journal", "tenant-release", "op-1", 5),
    ],
)
def test_encrypted_document_is_bound_to_its_location_and_revision(
    location: tuple[str, str, str, int],
) -> None:
    ring = data_keyring()
    payload = encrypt_document(ring, "worker-journal", "tenant-release", "op-1", 4, b"doc")
    with pytest.raises(InvalidEnvelope):
        decrypt_document(ring, *location, payload)


def test_encryption_tamper_truncation_and_unknown_key() -> None:
    ring = data_keyring()
    payload = encrypt_document(ring, "worker-journal", "s", "op-1", 1, b"document")
    tampered = bytearray(payload)
    tampered[-1] ^= 1
    with pytest.raises(InvalidEnvelope):
        decrypt_document(ring, "worker-journal", "s", "op-1", 1, bytes(tampered))
    for truncated in (b"", payload[:7], payload[:14], payload[: 14 + 12 + 15]):
        with pytest.raises(InvalidEnvelope):
            decrypt_document(ring, "worker-journal", "s", "op-1", 1, truncated)
    bad_id = (3).to_bytes(8, "big") + b"B D" + payload[14:]
    with pytest.raises(InvalidEnvelope):
        decrypt_document(ring, "worker-journal", "s", "op-1", 1, bad_id)

    other = StorageKeyring("data-2", StorageKey(b"\x22" * 32))
    with pytest.raises(UnknownKeyId) as caught:
        decrypt_document(other, "worker-journal", "s", "op-1", 1, payload)
    assert caught.value.key_id == "data-1"

    same_id_other_key = StorageKeyring("data-1", StorageKey(b"\x33" * 32))
    with pytest.raises(InvalidEnvelope):
        decrypt_document(same_id_other_key, "worker-journal", "s", "op-1", 1, payload)


def test_encryption_survives_rotation_until_retirement() -> None:
    ring = data_keyring()
    payload = encrypt_document(ring, "worker-journal", "s", "op-1", 1, b"document")
    ring.rotate_to("data-2", StorageKey(b"\x22" * 32))
    assert decrypt_document(ring, "worker-journal", "s", "op-1", 1, payload) == b"document"
    assert encrypt_document(ring, "worker-journal", "s", "op-1", 2, b"d")[8:14] == b"data-2"
    ring.retire("data-1")
    with pytest.raises(UnknownKeyId):
        decrypt_document(ring, "worker-journal", "s", "op-1", 1, payload)


def test_encrypted_payload_still_travels_in_an_authenticated_envelope() -> None:
    ring = data_keyring()
    record_key = StorageRecordKey("worker-journal", "tenant-release")
    payload = encrypt_document(ring, "worker-journal", "tenant-release", "op-1", 3, b"row")
    opened = open_record(keyring(), record_key, seal_record(keyring(), record_key, 3, payload), 3)
    assert (
        decrypt_document(ring, "worker-journal", "tenant-release", "op-1", 3, opened.payload)
        == b"row"
    )


# Rollback anchor format -----------------------------------------------


def test_anchor_encoding_is_compact_sorted_and_skips_zero() -> None:
    encoded = encode_anchor(
        {
            StorageRecordKey("worker-journal", "tenant-release"): 42,
            StorageRecordKey("workflow-ledger", "release-42"): 2,
            StorageRecordKey("workflow-ledger", "release-1"): 0,
            StorageRecordKey("worker-journal", "a"): 1,
        }
    )
    assert encoded == (
        b'{"format_version":1,"records":['
        b'{"namespace":"worker-journal","name":"a","revision":1},'
        b'{"namespace":"worker-journal","name":"tenant-release","revision":42},'
        b'{"namespace":"workflow-ledger","name":"release-42","revision":2}]}'
    )
    assert encode_anchor({}) == b'{"format_version":1,"records":[]}'


def test_anchor_decoding_round_trip() -> None:
    revisions = {
        StorageRecordKey("worker-journal", "tenant-release"): 42,
        StorageRecordKey("workflow-ledger", "release-42"): 2**64 - 1,
    }
    assert decode_anchor(encode_anchor(revisions)) == revisions
    assert decode_anchor(b'{"format_version":1,"records":[]}') == {}
    assert decode_anchor(b' {"records":[],"format_version":1}\n') == {}


def entry(namespace: str = "workflow-ledger", name: str = "r", revision: Any = 1) -> str:
    return json.dumps(
        {"namespace": namespace, "name": name, "revision": revision}, separators=(",", ":")
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "null",
        "[]",
        '{"format_version":2,"records":[]}',
        '{"format_version":"1","records":[]}',
        '{"format_version":true,"records":[]}',
        '{"format_version":1}',
        '{"records":[]}',
        '{"format_version":1,"records":[],"extra":0}',
        '{"format_version":1,"format_version":1,"records":[]}',
        '{"format_version":1,"records":{}}',
        '{"format_version":1,"records":[1]}',
        '{"format_version":1,"records":[' + entry(revision=0) + "]}",
        '{"format_version":1,"records":[' + entry(revision=-1) + "]}",
        '{"format_version":1,"records":[' + entry(revision=1.5) + "]}",
        '{"format_version":1,"records":[' + entry(revision=True) + "]}",
        '{"format_version":1,"records":[' + entry(revision="1") + "]}",
        '{"format_version":1,"records":[' + entry(revision=2**64) + "]}",
        '{"format_version":1,"records":[' + entry(namespace="Bad") + "]}",
        '{"format_version":1,"records":[' + entry(name="bad name") + "]}",
        '{"format_version":1,"records":[' + entry(name="b") + "," + entry(name="a") + "]}",
        '{"format_version":1,"records":['
        + entry(name="a")
        + ","
        + entry(name="a", revision=2)
        + "]}",
        '{"format_version":1,"records":[{"namespace":"n","name":"a","revision":1,"x":1}]}',
        '{"format_version":1,"records":[{"namespace":"n","name":"a"}]}',
        '{"format_version":1,"records":[{"namespace":"n","name":"a","name":"a","revision":1}]}',
    ],
)
def test_anchor_decoding_is_strict(text: str) -> None:
    with pytest.raises(RollbackAnchorInvalid):
        decode_anchor(text.encode())
