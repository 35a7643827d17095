"""The ledger store's head: one sealed value that commits to every record (issue 21).

A SQLite ledger database holds, beside its records, one *store head*:

* ``revision``: how many committed write transactions changed a record (a
  transaction of several writes counts once); it never goes down;
* a :class:`~octo_common.setdigest.SetDigest` under ``LEDGER_ROWS_DOMAIN``
  of every live record's (namespace, name, revision), with their count;
* ``key_id`` and ``auth_tag``: keyed BLAKE3 with the storage key ``key_id``
  names, 64 lowercase hex, over ``"octo-storage-head-v1" ‖ LP(key_id) ‖
  BE64(revision) ‖ BE64(count) ‖ LP(digest bytes)``.

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

import hmac
import re
from typing import Final

import blake3

from octo_common.digest import be64, lp
from octo_common.errors import (
    InvalidKeyId,
    InvalidRecordAuthenticationTag,
    StorageBackendError,
)
from octo_common.ids import is_token
from octo_common.limits import MAX_STORAGE_KEY_ID_BYTES
from octo_common.records import StorageKey, StorageKeyring
from octo_common.setdigest import SET_DIGEST_BYTES, SetDigest

__all__ = ["HEAD_DOMAIN", "LEDGER_ROWS_DOMAIN", "StoreHead", "head_tag"]

HEAD_DOMAIN: Final = b"octo-storage-head-v1"
LEDGER_ROWS_DOMAIN: Final = b"octo-host-ledger-records-v1"
_TAG_HEX = re.compile(r"[0-9a-f]{64}")


def head_tag(key: StorageKey, key_id: str, revision: int, digest: SetDigest) -> str:
    """The head's tag: keyed BLAKE3 (64 lowercase hex) of its framed fields."""
    message = b"".join(
        (
            HEAD_DOMAIN,
            lp(key_id.encode("utf-8")),
            be64(revision),
            be64(digest.count),
            lp(digest.to_bytes()),
        )
    )
    return str(blake3.blake3(message, key=key.reveal()).hexdigest())


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
        if self.key_id is None or self.tag is None:
            raise InvalidRecordAuthenticationTag()
        if not (is_token(self.key_id) and len(self.key_id) <= MAX_STORAGE_KEY_ID_BYTES):
            raise InvalidKeyId()
        if not _TAG_HEX.fullmatch(self.tag):
            raise InvalidRecordAuthenticationTag()
        key = keyring.key_for(self.key_id)
        expected = head_tag(key, self.key_id, self.revision, self.digest)
        if not hmac.compare_digest(expected.encode("ascii"), self.tag.encode("ascii")):
            raise InvalidRecordAuthenticationTag()

    def sealed_with(self, keyring: StorageKeyring | None) -> StoreHead:
        """This head sealed with the keyring's active key (unsealed without a keyring)."""
        if keyring is None:
            return StoreHead(self.revision, self.digest)
        key_id = keyring.active_id
        tag = head_tag(keyring.active_key, key_id, self.revision, self.digest)
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
