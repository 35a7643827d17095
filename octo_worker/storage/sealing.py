"""Sealing and opening a journal row, for every backend.

Owns :class:`RowSealer`: a row's document sealed as a keyed storage
envelope (``octo_common.records.seal_record``) under (row namespace, scope)
at the revision of the commit that writes it, encrypted first with a data
keyring; a loaded row authenticated and decrypted; a row sealed
again under the active keys (``reseal``); a scope's head sealed and
verified with the storage keyring (``scope_head``). Also :func:`checked_rows`, the
floor rule a backend applies to rows read in the same snapshot as their
scope head (every revision >= 1 and <= the head), and the seal of a journal
row's ``written_at`` (:func:`written_tag`, :func:`check_written`): a keyed
BLAKE3 tag over (scope, revision, written_at) under the domain
``octo-worker-written-at-v1``, stored as ``<key id>:<64 hex>`` beside the row.
Every row a commit writes carries the commit's revision and time, so the tag
of (scope, revision) fixes the time of every row at that revision; prune,
reseal and rekey keep a row's revision and ``written_at``, so its tag.

A backend reads and writes envelopes; everything that needs a key happens
here, on the event loop. It must never log or raise with a key, a document
or an envelope, and never return a document it did not authenticate.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, Final

from octo_common import headseal
from octo_common.digest import be64, lp
from octo_common.errors import (
    InvalidRecordAuthenticationTag,
    InvalidRevision,
    RevisionFloorMismatch,
)
from octo_common.records import (
    StorageKeyring,
    decrypt_document,
    encrypt_document,
    open_record,
    seal_record,
)
from octo_worker.storage.changesets import Row, RowWrite, record_key
from octo_worker.storage.scope_head import ScopeHead

__all__ = [
    "RowSealer",
    "check_written",
    "check_written_times",
    "checked_rows",
    "data_key_id",
    "written_key_id",
    "written_tag",
]

WRITTEN_DOMAIN: Final = b"octo-worker-written-at-v1"


def _written_fields(scope: str, revision: int, written_at: float) -> bytes:
    return lp(scope.encode("utf-8")) + be64(revision) + struct.pack(">d", written_at)


def written_tag(keyring: StorageKeyring, scope: str, revision: int, written_at: float) -> str:
    """The seal of a row's ``written_at`` at ``revision``: ``<key id>:<64 hex>``."""
    key_id, tag = headseal.seal_head(
        keyring, WRITTEN_DOMAIN, _written_fields(scope, revision, float(written_at))
    )
    return f"{key_id}:{tag}"


def written_key_id(tag: object) -> str | None:
    """The key id a stored ``written_at`` seal names, if it is readable."""
    if not isinstance(tag, str) or ":" not in tag:
        return None
    return tag.rpartition(":")[0]


def check_written_times(
    keyring: StorageKeyring, scope: str, written: Iterable[tuple[Any, Any, Any]]
) -> None:
    """:func:`check_written` of every (revision, written_at, seal) of ``scope``."""
    for revision, written_at, tag in written:
        check_written(keyring, scope, revision, written_at, tag)


def check_written(
    keyring: StorageKeyring, scope: str, revision: int, written_at: object, tag: object
) -> None:
    """Check a row's ``written_at`` against its seal: none, or one that does not
    hold, is ``InvalidRecordAuthenticationTag`` (an unknown key: ``UnknownKeyId``)."""
    if not isinstance(tag, str) or ":" not in tag or not isinstance(written_at, (int, float)):
        raise InvalidRecordAuthenticationTag()
    key_id, _, hexed = tag.rpartition(":")
    headseal.verify_head_seal(
        keyring, WRITTEN_DOMAIN, key_id, hexed, _written_fields(scope, revision, float(written_at))
    )


def data_key_id(payload: bytes) -> str | None:
    """The data key id an encrypted row payload names (``LP(id)`` first), if readable."""
    if len(payload) < 8:
        return None
    length = int.from_bytes(payload[:8], "big")
    try:
        return payload[8 : 8 + length].decode("ascii")
    except UnicodeDecodeError:
        return None


def checked_rows(rows: Iterable[tuple[Any, ...]], head: int) -> list[Row]:
    """Rows read as (item, revision, envelope) beside their head: the floor rule."""
    checked: list[Row] = []
    for item, revision, envelope in rows:
        if type(revision) is not int or revision < 1:
            raise InvalidRevision()
        if revision > head:
            raise RevisionFloorMismatch(revision, head)
        checked.append(Row(str(item), revision, bytes(envelope)))
    return checked


class RowSealer:
    """The storage keyring (and optional data keyring) a store seals and opens rows with.

    Keyrings are used by reference, so a rotation done on them takes effect
    at the next seal.
    """

    def __init__(self, keyring: StorageKeyring, data_keyring: StorageKeyring | None) -> None:
        if not isinstance(keyring, StorageKeyring):
            raise TypeError("keyring must be a StorageKeyring")
        if data_keyring is not None and not isinstance(data_keyring, StorageKeyring):
            raise TypeError("data_keyring must be a StorageKeyring")
        self.keyring = keyring
        self.data_keyring = data_keyring
        self.opened = 0  # rows authenticated by ``open``

    def seal(self, scope: str, write: RowWrite, revision: int) -> bytes:
        """The envelope of ``write`` at ``revision`` (its document encrypted first)."""
        payload = write.document
        if self.data_keyring is not None:
            payload = encrypt_document(
                self.data_keyring, write.namespace, scope, write.item, revision, payload
            )
        return seal_record(self.keyring, record_key(write.namespace, scope), revision, payload)

    def open(self, scope: str, namespace: str, row: Row) -> bytes:
        """Authenticate (and decrypt) one row; the caller checks its document."""
        self.opened += 1
        record = open_record(self.keyring, record_key(namespace, scope), row.envelope, row.revision)
        if self.data_keyring is None:
            return record.payload
        return decrypt_document(
            self.data_keyring, namespace, scope, row.item, row.revision, record.payload
        )

    def reseal(self, scope: str, namespace: str, row: Row) -> bytes | None:
        """``row`` sealed again under the active keys, at its own revision; None when it
        already is. The row is authenticated (and decrypted) first: a row that fails
        raises that error."""
        key = record_key(namespace, scope)
        record = open_record(self.keyring, key, row.envelope, row.revision)
        payload = record.payload
        stale_data = False
        data_keyring = self.data_keyring
        if data_keyring is not None:
            document = decrypt_document(  # checks the data key
                data_keyring, namespace, scope, row.item, row.revision, payload
            )
            if data_key_id(payload) != data_keyring.active_id:
                stale_data = True
                payload = encrypt_document(
                    data_keyring, namespace, scope, row.item, row.revision, document
                )
        if record.key_id == self.keyring.active_id and not stale_data:
            return None
        return seal_record(self.keyring, key, row.revision, payload)

    def seal_head(self, head: ScopeHead) -> ScopeHead:
        """``head`` sealed with the active storage key."""
        return head.sealed(self.keyring)

    def verify_head(self, head: ScopeHead) -> None:
        """Check ``head``'s seal (``InvalidRecordAuthenticationTag``, ``UnknownKeyId``, ...)."""
        head.verify(self.keyring)
