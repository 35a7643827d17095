"""Keyed storage records: identifiers, keyring, envelope, payload encryption, anchor format.

This module owns the byte-level rules of authenticated storage (keys, the
envelope and its tag, the checks of a read, encryption, the anchor's format)
shared by the host ledger store and the worker journal store:

* ``StorageKey``, ``StorageKeyId``, ``StorageRecordKey``, ``StorageKeyring``;
* the backend value types ``StoredRecord``, ``StorageSnapshot``, ``Stored``,
  ``Conflict`` and the opened ``AuthenticatedRecord``;
* ``seal_record`` / ``open_record`` (the envelope and its keyed BLAKE3 tag),
  ``validate_revision_pair`` (the floor rule);
* ``encrypt_document`` / ``decrypt_document`` (optional ChaCha20-Poly1305
  payload encryption of worker rows);
* ``encode_anchor`` / ``decode_anchor`` (the rollback anchor file content).

It is pure: it must never open files, touch a database or import asyncio.
Loading a key from a file lives in the stores (``octo_host.store``). Keys
never appear in a repr, an error, a pickle or a copy; errors never echo
payloads.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import re
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, NoReturn

import blake3
import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from octo_common.codec import decode_struct
from octo_common.digest import be64, lp
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
    UnknownKeyId,
    UnsupportedRecordFormat,
)
from octo_common.ids import is_token
from octo_common.limits import (
    AUTHENTICATED_RECORD_FORMAT_VERSION,
    MAX_AUTHENTICATED_PAYLOAD_BYTES,
    MAX_AUTHENTICATED_RECORD_BYTES,
    MAX_STORAGE_KEY_ID_BYTES,
    MAX_STORAGE_RECORD_NAME_BYTES,
    MAX_STORAGE_RECORD_NAMESPACE_BYTES,
    MAX_U64,
    ROLLBACK_ANCHOR_FORMAT_VERSION,
    STORAGE_KEY_BYTES,
)

__all__ = [
    "STORAGE_RECORD_DOMAIN",
    "AuthenticatedRecord",
    "Conflict",
    "StorageKey",
    "StorageKeyId",
    "StorageKeyring",
    "StorageRecordKey",
    "StorageSnapshot",
    "Stored",
    "StoredRecord",
    "decode_anchor",
    "decrypt_document",
    "encode_anchor",
    "encrypt_document",
    "open_record",
    "seal_record",
    "storage_record_tag",
    "validate_revision_pair",
]

STORAGE_RECORD_DOMAIN = b"octo-storage-record-v1"
_NONCE_BYTES = 12
_POLY1305_TAG_BYTES = 16
_TAG_HEX = re.compile(r"[0-9a-f]{64}")
_BASE64_TEXT = re.compile(r"[A-Za-z0-9+/]*")


def _is_storage_token(value: object, maximum: int) -> bool:
    # The token syntax (ASCII only, so characters are bytes) with a tighter bound.
    return is_token(value) and len(value) <= maximum  # type: ignore[arg-type]


def _is_u64(value: object) -> bool:
    # bool is an int subclass; JSON true is never a revision.
    return type(value) is int and 0 <= value <= MAX_U64


def _as_bytes(value: object, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"{what} must be bytes")


# Keys and identifiers ----------------------------------------------


class StorageKey:
    """A 32-byte storage key (any value, all-zero included).

    Never serialized, pickled, copied or shown: the repr is
    ``StorageKey([redacted])``. ``reveal()`` hands the raw bytes to the one
    place that needs them (keyed BLAKE3, the AEAD).
    """

    __slots__ = ("__key",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes | bytearray | memoryview):
            raise InvalidStorageKey()
        raw = bytes(key)
        if len(raw) != STORAGE_KEY_BYTES:
            raise InvalidStorageKey()
        self.__key = raw

    def reveal(self) -> bytes:
        """The raw key bytes. Callers must not log, store or copy them."""
        return self.__key

    def __repr__(self) -> str:
        return "StorageKey([redacted])"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageKey):
            return NotImplemented
        return hmac.compare_digest(self.__key, other.__key)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> NoReturn:
        raise TypeError("StorageKey cannot be pickled")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("StorageKey cannot be pickled")

    def __copy__(self) -> NoReturn:
        raise TypeError("StorageKey cannot be copied")

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise TypeError("StorageKey cannot be copied")


class StorageKeyId(str):
    """A storage key id: a token of at most 64 bytes, else ``InvalidKeyId``."""

    __slots__ = ()

    def __new__(cls, value: str) -> StorageKeyId:
        if not _is_storage_token(value, MAX_STORAGE_KEY_ID_BYTES):
            raise InvalidKeyId()
        return super().__new__(cls, value)


class StorageRecordKey(msgspec.Struct, frozen=True, order=True):
    """Where a record lives: ``(namespace, name)``, ordered by that pair.

    The namespace is checked first (token of at most 64 bytes, else
    ``InvalidRecordNamespace``), then the name (token of at most 128 bytes,
    else ``InvalidRecordName``). The host ledger of run ``r`` is
    ``StorageRecordKey("workflow-ledger", r)``; a worker row is tagged under
    ``StorageRecordKey(<row namespace>, <scope>)``.
    """

    namespace: str
    name: str

    def __post_init__(self) -> None:
        if not _is_storage_token(self.namespace, MAX_STORAGE_RECORD_NAMESPACE_BYTES):
            raise InvalidRecordNamespace()
        if not _is_storage_token(self.name, MAX_STORAGE_RECORD_NAME_BYTES):
            raise InvalidRecordName()

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def _key_id(value: object) -> StorageKeyId:
    if isinstance(value, StorageKeyId):
        return value
    if not isinstance(value, str):
        raise InvalidKeyId()
    return StorageKeyId(value)


def _storage_key(value: object) -> StorageKey:
    if isinstance(value, StorageKey):
        return value
    return StorageKey(value)  # type: ignore[arg-type]


class StorageKeyring:
    """One active write key plus any number of verification keys.

    Changed in place by ``add_read_key``, ``rotate_to`` and ``retire``. Not
    picklable or copyable; the repr shows only the active id and key count.
    """

    __slots__ = ("__active", "__keys")

    def __init__(self, active_id: str, active_key: StorageKey | bytes) -> None:
        key_id = _key_id(active_id)
        key = _storage_key(active_key)
        self.__keys: dict[StorageKeyId, StorageKey] = {key_id: key}
        self.__active = key_id

    @property
    def active_id(self) -> StorageKeyId:
        """The id that every new envelope is sealed under."""
        return self.__active

    @property
    def active_key(self) -> StorageKey:
        """The key that every new envelope is sealed with."""
        return self.__keys[self.__active]

    @property
    def key_ids(self) -> tuple[StorageKeyId, ...]:
        """Every id this keyring can verify, in insertion order."""
        return tuple(self.__keys)

    def add_read_key(self, id: str, key: StorageKey | bytes) -> None:
        """Add a verification key; an id already present → ``DuplicateKeyId``."""
        checked = _key_id(id)
        material = _storage_key(key)
        if checked in self.__keys:
            raise DuplicateKeyId(str(checked))
        self.__keys[checked] = material

    def rotate_to(self, id: str, key: StorageKey | bytes) -> None:
        """Add ``key`` (same rule as ``add_read_key``) and make it active.

        The previous active key stays for verification until ``retire``.
        """
        self.add_read_key(id, key)
        self.__active = StorageKeyId(id)

    def retire(self, id: str) -> None:
        """Forget a verification key; records it signed become ``UnknownKeyId``."""
        if id == self.__active:
            raise ActiveKeyCannotBeRetired()
        if not isinstance(id, str) or id not in self.__keys:
            raise UnknownKeyId(id)
        del self.__keys[id]  # type: ignore[arg-type]

    def key_for(self, key_id: str) -> StorageKey:
        """The key with this id (retired ids included in the miss) or ``UnknownKeyId``."""
        if not isinstance(key_id, str):
            raise UnknownKeyId(key_id)
        key = self.__keys.get(key_id)  # type: ignore[call-overload]
        if key is None:
            raise UnknownKeyId(key_id)
        return key  # type: ignore[no-any-return]

    def __contains__(self, key_id: object) -> bool:
        return key_id in self.__keys

    def __len__(self) -> int:
        return len(self.__keys)

    def __iter__(self) -> Iterator[StorageKeyId]:
        return iter(tuple(self.__keys))

    def __repr__(self) -> str:
        return f"StorageKeyring(active_id={self.__active!r}, keys={len(self.__keys)})"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("StorageKeyring cannot be pickled")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("StorageKeyring cannot be pickled")

    def __copy__(self) -> NoReturn:
        raise TypeError("StorageKeyring cannot be copied")

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise TypeError("StorageKeyring cannot be copied")


# Backend value types -----------------------------------------------


class StoredRecord(msgspec.Struct, frozen=True):
    """What a backend holds for a record: its revision and envelope bytes."""

    revision: int
    data: bytes

    def __repr__(self) -> str:
        return f"StoredRecord(revision={self.revision}, data=<{len(self.data)} bytes>)"


class StorageSnapshot(msgspec.Struct, frozen=True):
    """A record (or None) and its revision floor, read in one atomic snapshot."""

    record: StoredRecord | None
    revision_floor: int


class Stored(msgspec.Struct, frozen=True):
    """A successful backend compare-and-swap; the floor is the new revision."""

    revision_floor: int


class Conflict(msgspec.Struct, frozen=True):
    """A failed backend compare-and-swap: what the backend actually holds."""

    actual_revision: int | None
    revision_floor: int


class AuthenticatedRecord(msgspec.Struct, frozen=True):
    """An opened record: revision, the key id that signed it, the payload."""

    revision: int
    key_id: str
    payload: bytes

    def __repr__(self) -> str:
        return (
            f"AuthenticatedRecord(revision={self.revision}, key_id={self.key_id!r}, "
            f"payload=<{len(self.payload)} bytes>)"
        )


# Floor rule --------------------------------------------------


def validate_revision_pair(record_revision: int | None, floor: int) -> None:
    """Check a record revision (None when absent) against its revision floor.

    * absent, floor 0 → fine; absent, floor > 0 → ``RollbackDetected(None, floor)``;
    * revision 0 → ``InvalidRevision``;
    * below the floor → ``RollbackDetected(r, floor)``;
    * above the floor → ``RevisionFloorMismatch(r, floor)``.

    For a multi-row record pass the head revision and the anchored
    or expected head revision.
    """
    if record_revision is None:
        if floor > 0:
            raise RollbackDetected(None, floor)
        return
    if record_revision == 0:
        raise InvalidRevision()
    if record_revision < floor:
        raise RollbackDetected(record_revision, floor)
    if record_revision > floor:
        raise RevisionFloorMismatch(record_revision, floor)


# Envelope and tag ---------------------------------------------------


def storage_record_tag(
    key: StorageKey,
    record: StorageRecordKey,
    key_id: str,
    revision: int,
    payload: bytes,
) -> str:
    """The envelope tag: keyed BLAKE3 (64 lowercase hex) over

    ``"octo-storage-record-v1" ‖ u8(1) ‖ LP(namespace) ‖ LP(name) ‖ LP(key_id)
    ‖ BE64(revision) ‖ LP(payload)``.

    The location is in the tag, so an envelope moved to another record key
    (or, for worker rows, another scope or row namespace) fails to open.
    """
    message = b"".join(
        (
            STORAGE_RECORD_DOMAIN,
            bytes((AUTHENTICATED_RECORD_FORMAT_VERSION,)),
            lp(record.namespace.encode("utf-8")),
            lp(record.name.encode("utf-8")),
            lp(key_id.encode("utf-8")),
            be64(revision),
            lp(payload),
        )
    )
    return str(blake3.blake3(message, key=key.reveal()).hexdigest())


def _b64encode(payload: bytes) -> str:
    return base64.b64encode(payload).decode("ascii").rstrip("=")


def seal_record(
    keyring: StorageKeyring,
    record_key: StorageRecordKey,
    revision: int,
    payload: bytes,
) -> bytes:
    """Seal ``payload`` at ``revision`` under the keyring's active key.

    Returns the compact envelope
    ``{"format_version":1,"key_id":…,"revision":n,"payload":"<base64>","auth_tag":"<hex>"}``
    (standard base64 alphabet, no padding). ``PayloadTooLarge`` is checked
    before anything else; revision 0 → ``InvalidRevision``; above 2^64 - 1 →
    ``RevisionExhausted``; an envelope over 3 MiB → ``RecordTooLarge``.
    """
    data = _as_bytes(payload, "payload")
    if len(data) > MAX_AUTHENTICATED_PAYLOAD_BYTES:
        raise PayloadTooLarge(len(data), MAX_AUTHENTICATED_PAYLOAD_BYTES)
    if type(revision) is not int:
        raise TypeError("revision must be an int")
    if revision <= 0:
        raise InvalidRevision()
    if revision > MAX_U64:
        raise RevisionExhausted()
    key_id = keyring.active_id
    tag = storage_record_tag(keyring.active_key, record_key, key_id, revision, data)
    # Fixed shape: the key id is a token and the other values are digits,
    # base64 and hex, so none of them needs JSON escaping.
    envelope = (
        f'{{"format_version":{AUTHENTICATED_RECORD_FORMAT_VERSION},"key_id":"{key_id}",'
        f'"revision":{revision},"payload":"{_b64encode(data)}","auth_tag":"{tag}"}}'
    ).encode("ascii")
    if len(envelope) > MAX_AUTHENTICATED_RECORD_BYTES:
        raise RecordTooLarge(len(envelope), MAX_AUTHENTICATED_RECORD_BYTES)
    return envelope


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    """The stored envelope document; field order is the wire order."""

    # format_version is hashed as one byte (u8); revisions are u64.
    format_version: Annotated[int, msgspec.Meta(ge=0, le=255)]
    key_id: str
    # The codec turns integers beyond 2^64 - 1 into doubles, which an int
    # field refuses; msgspec cannot express that upper bound itself.
    revision: Annotated[int, msgspec.Meta(ge=0)]
    payload: str
    auth_tag: str


def _parse_envelope(data: bytes) -> _Envelope:
    """Strict parse; unknown, duplicate, missing fields and
    wrong JSON types (a string format_version, a float revision) are all
    ``InvalidEnvelope``."""
    envelope = decode_struct(data, _Envelope, error=InvalidEnvelope)
    if not _is_u64(envelope.revision):
        raise InvalidEnvelope("revision must be an unsigned 64-bit integer")
    return envelope


def _b64decode_strict(text: str) -> bytes:
    if not _BASE64_TEXT.fullmatch(text) or len(text) % 4 == 1:
        raise InvalidEnvelope("payload is not unpadded standard base64")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidEnvelope("payload is not unpadded standard base64") from None


def open_record(
    keyring: StorageKeyring,
    record_key: StorageRecordKey,
    stored: bytes,
    backend_revision: int,
) -> AuthenticatedRecord:
    """Open an envelope read at ``backend_revision`` under ``record_key``.

    Runs the checks of a read in this order (the floor check before them is
    ``validate_revision_pair``, done by the caller first):
    ``RecordTooLarge`` → ``InvalidEnvelope`` (strict parse, wrong types) →
    ``UnsupportedRecordFormat`` → ``InvalidRevision`` → ``RevisionMismatch``
    → ``InvalidKeyId`` → ``InvalidEnvelope`` (base64) → ``PayloadTooLarge`` →
    ``InvalidEnvelope`` (non-canonical base64) →
    ``InvalidRecordAuthenticationTag`` (tag syntax) → ``UnknownKeyId`` →
    ``InvalidRecordAuthenticationTag`` (constant-time mismatch).

    For a worker row pass the row's tag location
    (``StorageRecordKey(row namespace, scope)``) and the row's revision.
    """
    data = _as_bytes(stored, "stored record")
    if len(data) > MAX_AUTHENTICATED_RECORD_BYTES:  # step 2
        raise RecordTooLarge(len(data), MAX_AUTHENTICATED_RECORD_BYTES)
    parsed = _parse_envelope(data)  # step 3
    version, key_id, revision = parsed.format_version, parsed.key_id, parsed.revision
    payload_text, tag = parsed.payload, parsed.auth_tag
    if version != AUTHENTICATED_RECORD_FORMAT_VERSION:  # step 4
        raise UnsupportedRecordFormat(version)
    if revision == 0:  # step 5
        raise InvalidRevision()
    if revision != backend_revision:  # step 6
        raise RevisionMismatch(backend_revision, revision)
    if not _is_storage_token(key_id, MAX_STORAGE_KEY_ID_BYTES):  # step 7
        raise InvalidKeyId()
    payload = _b64decode_strict(payload_text)  # step 8
    if len(payload) > MAX_AUTHENTICATED_PAYLOAD_BYTES:  # step 9
        raise PayloadTooLarge(len(payload), MAX_AUTHENTICATED_PAYLOAD_BYTES)
    if _b64encode(payload) != payload_text:  # step 10
        raise InvalidEnvelope("payload base64 is not canonical")
    if not _TAG_HEX.fullmatch(tag):  # step 11
        raise InvalidRecordAuthenticationTag()
    key = keyring.key_for(key_id)  # step 12
    expected = storage_record_tag(key, record_key, key_id, revision, payload)
    if not hmac.compare_digest(expected.encode("ascii"), tag.encode("ascii")):  # step 13
        raise InvalidRecordAuthenticationTag()
    return AuthenticatedRecord(revision, StorageKeyId(key_id), payload)  # step 14


# Optional payload encryption ------------------------------------------


def _document_aad(namespace: str, name: str, item: str, revision: int) -> bytes:
    if not _is_u64(revision):
        raise TypeError("revision must be an unsigned 64-bit int")
    return b"".join(
        (
            lp(namespace.encode("utf-8")),
            lp(name.encode("utf-8")),
            lp(item.encode("utf-8")),
            be64(revision),
        )
    )


def encrypt_document(
    data_keyring: StorageKeyring,
    namespace: str,
    name: str,
    item: str,
    revision: int,
    document: bytes,
) -> bytes:
    """Encrypt a row document with the data keyring's active key.

    Returns ``LP(utf8(data_key_id)) ‖ nonce(12) ‖ ChaCha20-Poly1305 ciphertext``
    with ``aad = LP(namespace) ‖ LP(name) ‖ LP(item) ‖ BE64(revision)``: the
    ciphertext only decrypts at the same row location and revision. The
    result is then the payload of a normal envelope (``seal_record``).
    """
    plain = _as_bytes(document, "document")
    aad = _document_aad(namespace, name, item, revision)
    key_id = data_keyring.active_id
    nonce = os.urandom(_NONCE_BYTES)
    sealed = ChaCha20Poly1305(data_keyring.active_key.reveal()).encrypt(nonce, plain, aad)
    return lp(key_id.encode("utf-8")) + nonce + sealed


def decrypt_document(
    data_keyring: StorageKeyring,
    namespace: str,
    name: str,
    item: str,
    revision: int,
    payload: bytes,
) -> bytes:
    """Reverse ``encrypt_document`` for the same location and revision.

    A malformed payload or a failed decryption → ``InvalidEnvelope``; a data
    key id not in the keyring (retired included) → ``UnknownKeyId``.
    """
    data = _as_bytes(payload, "payload")
    aad = _document_aad(namespace, name, item, revision)
    if len(data) < 8:
        raise InvalidEnvelope("encrypted payload is truncated")
    id_length = int.from_bytes(data[:8], "big")
    if id_length > MAX_STORAGE_KEY_ID_BYTES or len(data) < 8 + id_length:
        raise InvalidEnvelope("encrypted payload has a malformed key id")
    try:
        key_id = data[8 : 8 + id_length].decode("ascii")
    except UnicodeDecodeError:
        raise InvalidEnvelope("encrypted payload has a malformed key id") from None
    if not _is_storage_token(key_id, MAX_STORAGE_KEY_ID_BYTES):
        raise InvalidEnvelope("encrypted payload has a malformed key id")
    rest = data[8 + id_length :]
    if len(rest) < _NONCE_BYTES + _POLY1305_TAG_BYTES:
        raise InvalidEnvelope("encrypted payload is truncated")
    key = data_keyring.key_for(key_id)
    try:
        return ChaCha20Poly1305(key.reveal()).decrypt(rest[:_NONCE_BYTES], rest[_NONCE_BYTES:], aad)
    except InvalidTag:
        raise InvalidEnvelope("encrypted payload does not decrypt") from None


# Rollback anchor format -------------------------------------


def encode_anchor(revisions: Mapping[StorageRecordKey, int]) -> bytes:
    """The anchor file content for ``revisions`` (record key → last committed revision).

    Compact JSON ``{"format_version":1,"records":[{"namespace":…,"name":…,"revision":n},…]}``,
    entries sorted by (namespace, name); records at revision 0 are left out.
    """
    entries = []
    for record_key in sorted(revisions):
        revision = revisions[record_key]
        if not _is_u64(revision):
            raise TypeError("anchor revisions must be unsigned 64-bit ints")
        if revision > 0:
            entries.append(
                f'{{"namespace":"{record_key.namespace}","name":"{record_key.name}",'
                f'"revision":{revision}}}'
            )
    body = ",".join(entries)
    return (f'{{"format_version":{ROLLBACK_ANCHOR_FORMAT_VERSION},"records":[{body}]}}').encode(
        "ascii"
    )


class _AnchorEntry(msgspec.Struct, forbid_unknown_fields=True):
    namespace: str
    name: str
    revision: Annotated[int, msgspec.Meta(ge=1)]


class _Anchor(msgspec.Struct, forbid_unknown_fields=True):
    format_version: int
    records: list[_AnchorEntry]


def decode_anchor(data: bytes) -> dict[StorageRecordKey, int]:
    """Parse anchor file content strictly, else ``RollbackAnchorInvalid``.

    Requires format_version 1, exactly the fields above, valid record keys,
    revisions in 1..2^64 - 1, and entries strictly sorted by (namespace, name)
    (so no duplicates).
    """
    raw = _as_bytes(data, "anchor")
    document = decode_struct(raw, _Anchor, error=RollbackAnchorInvalid)
    if document.format_version != ROLLBACK_ANCHOR_FORMAT_VERSION:
        raise RollbackAnchorInvalid("unsupported format_version")
    result: dict[StorageRecordKey, int] = {}
    previous: StorageRecordKey | None = None
    for entry in document.records:
        try:
            record_key = StorageRecordKey(entry.namespace, entry.name)
        except (InvalidRecordNamespace, InvalidRecordName):
            raise RollbackAnchorInvalid("malformed record key") from None
        if previous is not None and not previous < record_key:
            raise RollbackAnchorInvalid("records are not sorted or repeat a key")
        previous = record_key
        if not _is_u64(entry.revision):
            raise RollbackAnchorInvalid("record revision must be in 1..2^64-1")
        result[record_key] = entry.revision
    return result
