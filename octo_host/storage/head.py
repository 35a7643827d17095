"""The ledger store's head: one sealed value that commits to every record.

A SQLite ledger database holds, beside its records, one *store head*:

* ``revision``: how many committed write transactions changed a record (a
  transaction of several writes counts once); it never goes down;
* a :class:`~octo_common.setdigest.SetDigest` under ``LEDGER_ROWS_DOMAIN``
  of every live record's (namespace, name, revision), with their count;
* ``key_id`` and ``auth_tag``: keyed BLAKE3 with the storage key ``key_id``
  names, 64 lowercase hex, over ``"octo-storage-head-v1" ‖ LP(key_id) ‖
  BE64(revision) ‖ BE64(count) ‖ LP(digest bytes)`` (the seal of
  :mod:`octo_common.headseal`, which the worker journal's scope heads share).

Each write transaction moves the head in O(1) (per written record: remove
its old element, add the new one) and reseals it with the active key; at
open the digest is recomputed over the rows and must match. A store without
a keyring (a bare backend) keeps the head unsealed; a keyed store refuses an
unsealed head, as it refuses an unsealed record.

This module is pure: it builds, seals and opens head values and never does
I/O. It must never accept a head whose tag it did not verify (when it has a
keyring) or put key material in an error.
"""

from __future__ import annotations

from typing import Final

from octo_common import headseal
from octo_common.digest import be64
from octo_common.errors import StorageBackendError
from octo_common.records import StorageKey, StorageKeyring
from octo_common.setdigest import SET_DIGEST_BYTES, SetDigest

__all__ = [
    "HEAD_DOMAIN",
    "LEDGER_ROWS_DOMAIN",
    "UNBUILT_DOMAIN",
    "StoreHead",
    "head_tag",
    "seal_unbuilt",
    "verify_unbuilt",
]

HEAD_DOMAIN: Final = b"octo-storage-head-v1"
# The seal of the migration record "this head is still to be built from the
# rows" (a head row without a digest): without it, a missing digest is tampering.
UNBUILT_DOMAIN: Final = b"octo-storage-head-unbuilt-v1"
LEDGER_ROWS_DOMAIN: Final = b"octo-host-ledger-records-v1"


def head_tag(key: StorageKey, key_id: str, revision: int, digest: SetDigest) -> str:
    """The head's tag: keyed BLAKE3 (64 lowercase hex) of its framed fields."""
    return headseal.head_tag(key, HEAD_DOMAIN, key_id, _fields(revision, digest))


def _fields(revision: int, digest: SetDigest) -> bytes:
    return be64(revision) + headseal.digest_fields(digest)


def seal_unbuilt(keyring: StorageKeyring) -> tuple[str, str]:
    """``(key_id, tag)`` of the migration record that leaves the head to be built
    (revision 0, no digest), sealed with the keyring's active key."""
    return headseal.seal_head(keyring, UNBUILT_DOMAIN, be64(0))


def verify_unbuilt(keyring: StorageKeyring, key_id: str | None, tag: str | None) -> None:
    """Check a head row without a digest carries the migration's seal (errors as
    :meth:`StoreHead.verify`)."""
    headseal.verify_head_seal(keyring, UNBUILT_DOMAIN, key_id, tag, be64(0))


class StoreHead:
    """One store head: its revision, its digest and the seal it was read with (if any)."""

    __slots__ = ("digest", "key_id", "revision", "tag")

    def __init__(
        self, revision: int, digest: SetDigest, key_id: str | None = None, tag: str | None = None
    ) -> None:
        self.revision = revision
        self.digest = digest
        self.key_id = key_id
        self.tag = tag

    @classmethod
    def empty(cls) -> StoreHead:
        """The head of a store without records, at revision 0 (unsealed)."""
        return cls(0, SetDigest(LEDGER_ROWS_DOMAIN))

    @classmethod
    def from_row(cls, row: tuple[object, ...]) -> StoreHead:
        """A head read as (revision, record_count, digest, key_id, auth_tag).

        Shapes only: a wrong type or length is ``StorageBackendError``; the
        seal is checked by :meth:`verify`.
        """
        revision, count, value, key_id, tag = row
        if isinstance(value, str):
            value = value.encode("utf-8", "surrogateescape")
        if (
            type(revision) is not int
            or revision < 0
            or type(count) is not int
            or count < 0
            or not isinstance(value, bytes)
            or len(value) != SET_DIGEST_BYTES
            or not (key_id is None or isinstance(key_id, str))
            or not (tag is None or isinstance(tag, str))
        ):
            raise StorageBackendError("malformed store head row")
        return cls(revision, SetDigest.from_bytes(LEDGER_ROWS_DOMAIN, value, count), key_id, tag)

    @property
    def sealed(self) -> bool:
        return self.key_id is not None and self.tag is not None

    def verify(self, keyring: StorageKeyring) -> None:
        """Check the seal: absent or malformed tag → ``InvalidRecordAuthenticationTag``,
        bad key id → ``InvalidKeyId``, key not in the keyring → ``UnknownKeyId``,
        mismatch → ``InvalidRecordAuthenticationTag``."""
        headseal.verify_head_seal(
            keyring, HEAD_DOMAIN, self.key_id, self.tag, _fields(self.revision, self.digest)
        )

    def sealed_with(self, keyring: StorageKeyring | None) -> StoreHead:
        """This head sealed with the keyring's active key (unsealed without a keyring)."""
        if keyring is None:
            return StoreHead(self.revision, self.digest)
        key_id, tag = headseal.seal_head(keyring, HEAD_DOMAIN, _fields(self.revision, self.digest))
        return StoreHead(self.revision, self.digest, key_id, tag)

    def row(self) -> tuple[int, int, bytes, str | None, str | None]:
        """(revision, record_count, digest, key_id, auth_tag) as stored."""
        return (self.revision, self.digest.count, self.digest.to_bytes(), self.key_id, self.tag)

    def matches(self, other: StoreHead) -> bool:
        """Same revision and digest (the seal aside)."""
        return self.revision == other.revision and self.digest == other.digest

    def __repr__(self) -> str:
        return (
            f"StoreHead(revision={self.revision}, records={self.digest.count}, "
            f"sealed={self.sealed})"
        )
