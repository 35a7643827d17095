"""The seal of a store head: one keyed BLAKE3 tag over the head's framed fields.

A store that keeps a *head* beside its rows (a revision, the
:class:`~octo_common.setdigest.SetDigest` of every row it holds, whatever
else the store decides) seals that head with its active storage key, so
that nobody without the key can edit the head, and through its digest the
set of rows, unnoticed. The host ledger's store head
(``octo_host.storage.head``) and each worker journal scope's head
(``octo_worker.storage.scope_head``) are sealed this way, each under a
domain of its own:

* ``tag = BLAKE3-keyed(key, domain ‖ LP(utf8(key_id)) ‖ fields)``, 64
  lowercase hex, where ``key`` is the storage key ``key_id`` names;
* ``fields`` is the user's framing of its head: fixed-width integers
  (``BE64``) and ``LP``-framed byte strings only, so two different heads
  never frame alike; :func:`digest_fields` is the framing of a digest,
  ``BE64(count) ‖ LP(digest bytes)``, every user's last field.

It is pure: no I/O, no clock. It must never accept a tag it did not
recompute with the key the head names, compare tags in variable time, or put
key material in an error.
"""

from __future__ import annotations

import hmac
import re
from typing import Final

import blake3

from octo_common.digest import be64, lp
from octo_common.errors import InvalidKeyId, InvalidRecordAuthenticationTag
from octo_common.ids import is_token
from octo_common.limits import MAX_STORAGE_KEY_ID_BYTES
from octo_common.records import StorageKey, StorageKeyring
from octo_common.setdigest import SetDigest

__all__ = ["digest_fields", "head_tag", "seal_head", "verify_head_seal"]

_TAG_HEX: Final = re.compile(r"[0-9a-f]{64}")


def digest_fields(digest: SetDigest) -> bytes:
    """The framing of a digest inside a head: ``BE64(count) ‖ LP(digest bytes)``."""
    return be64(digest.count) + lp(digest.to_bytes())


def head_tag(key: StorageKey, domain: bytes, key_id: str, fields: bytes) -> str:
    """The head's tag: keyed BLAKE3 (64 lowercase hex) of ``domain ‖ LP(key_id) ‖ fields``."""
    if not isinstance(domain, bytes) or not domain:
        raise TypeError("head seal domain must be non-empty bytes")
    message = b"".join((domain, lp(key_id.encode("utf-8")), fields))
    return str(blake3.blake3(message, key=key.reveal()).hexdigest())


def seal_head(keyring: StorageKeyring, domain: bytes, fields: bytes) -> tuple[str, str]:
    """``(key_id, tag)`` of the head ``fields`` sealed with the keyring's active key."""
    key_id = str(keyring.active_id)
    return key_id, head_tag(keyring.active_key, domain, key_id, fields)


def verify_head_seal(
    keyring: StorageKeyring, domain: bytes, key_id: str | None, tag: str | None, fields: bytes
) -> None:
    """Check a head's seal.

    No seal, or a tag that is not 64 lowercase hex →
    ``InvalidRecordAuthenticationTag``; a malformed key id → ``InvalidKeyId``;
    a key the keyring lacks → ``UnknownKeyId``; a tag that does not match →
    ``InvalidRecordAuthenticationTag``.
    """
    if key_id is None or tag is None:
        raise InvalidRecordAuthenticationTag()
    if not (
        isinstance(key_id, str)
        and is_token(key_id)
        and len(key_id.encode("utf-8")) <= MAX_STORAGE_KEY_ID_BYTES
    ):
        raise InvalidKeyId()
    if not (isinstance(tag, str) and _TAG_HEX.fullmatch(tag)):
        raise InvalidRecordAuthenticationTag()
    key = keyring.key_for(key_id)
    expected = head_tag(key, domain, key_id, fields)
    if not hmac.compare_digest(expected.encode("ascii"), tag.encode("ascii")):
        raise InvalidRecordAuthenticationTag()
