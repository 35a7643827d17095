"""The rollback anchor of a SQLite ledger: its formats and its rules.

The anchor is a small file, preferably on another filesystem, that says how
far the database had got; a database behind it was rolled back. This module
owns its two formats, the operator's explicit initialisation and the
comparisons a backend makes with it. The file handling (atomic fsynced
replace, strict read) is :mod:`octo_common.runtime.anchorfile`.

* ``format_version 2`` (written by every commit): the store head's revision,
  record count and digest fingerprint (:mod:`octo_host.storage.head`),
  ``{"format_version":2,"store_revision":N,"record_count":C,"digest":"<64 hex>"}``:
  a fixed-size file, whatever the number of records.
* ``format_version 1`` (read only): the revision of each record,
  checked record by record at open and replaced by a version 2 anchor at the
  next commit. ``{"format_version":1,"records":[]}`` is the explicit
  initialisation (``octo-host ledger init-anchor``; :func:`initialise_anchor` writes it).

It must never overwrite an anchor without being told to, or accept a
database below its anchor.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, NamedTuple

import msgspec

from octo_common.codec import decode_struct
from octo_common.errors import RollbackAnchorInvalid, RollbackDetected, StorageBackendError
from octo_common.limits import MAX_U64
from octo_common.records import StorageRecordKey, decode_anchor
from octo_common.runtime.anchorfile import write_anchor_file
from octo_host.storage.head import StoreHead

__all__ = [
    "EMPTY_ANCHOR",
    "HEAD_ANCHOR_FORMAT_VERSION",
    "HeadAnchor",
    "compare_head_with_anchor",
    "compare_with_anchor",
    "decode_ledger_anchor",
    "encode_head_anchor",
    "initialise_anchor",
]

EMPTY_ANCHOR = b'{"format_version":1,"records":[]}'
HEAD_ANCHOR_FORMAT_VERSION = 2
_DIGEST_HEX = re.compile(r"[0-9a-f]{64}")


class HeadAnchor(NamedTuple):
    """What a version 2 anchor holds: the head it was written for."""

    store_revision: int
    record_count: int
    digest: str  # the head digest's fingerprint, 64 lowercase hex

    @classmethod
    def of(cls, head: StoreHead) -> HeadAnchor:
        return cls(head.revision, head.digest.count, head.digest.fingerprint().hex())


def initialise_anchor(path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Write the explicit empty anchor ``{"format_version":1,"records":[]}`` (0o600).

    This is the operator's explicit initialisation: a configured
    anchor must exist before the first open. A database that already holds
    records is accepted on open and the anchor rises to it (the next commit
    writes a version 2 anchor). An existing anchor file is only replaced with
    ``overwrite=True``.
    """
    target = Path(os.fspath(path))
    if os.path.lexists(target) and not overwrite:
        raise StorageBackendError("rollback anchor file already exists")
    try:
        write_anchor_file(target, EMPTY_ANCHOR)
    except OSError as exc:
        raise StorageBackendError(f"rollback anchor write failed: {exc.strerror}") from exc


def encode_head_anchor(anchor: HeadAnchor) -> bytes:
    """The version 2 anchor file content (compact JSON, at most 180 bytes)."""
    revision, count, digest = anchor
    if not (type(revision) is int and 0 <= revision <= MAX_U64):
        raise TypeError("store_revision must be an unsigned 64-bit int")
    if not (type(count) is int and 0 <= count <= MAX_U64):
        raise TypeError("record_count must be an unsigned 64-bit int")
    if not (isinstance(digest, str) and _DIGEST_HEX.fullmatch(digest)):
        raise TypeError("digest must be 64 lowercase hex")
    return (
        f'{{"format_version":{HEAD_ANCHOR_FORMAT_VERSION},"store_revision":{revision},'
        f'"record_count":{count},"digest":"{digest}"}}'
    ).encode("ascii")


class _AnyAnchor(msgspec.Struct):
    format_version: int


class _HeadAnchorDocument(msgspec.Struct, forbid_unknown_fields=True):
    format_version: int
    store_revision: Annotated[int, msgspec.Meta(ge=0)]
    record_count: Annotated[int, msgspec.Meta(ge=0)]
    digest: str


def decode_ledger_anchor(data: bytes) -> dict[StorageRecordKey, int] | HeadAnchor:
    """Parse a ledger anchor file strictly: version 1 (per-record revisions) or 2 (head).

    Anything else (another version, an unknown or missing field, a duplicate
    key, a value out of range, a digest not 64 lowercase hex) is
    ``RollbackAnchorInvalid``.
    """
    version = decode_struct(data, _AnyAnchor, error=RollbackAnchorInvalid).format_version
    if version != HEAD_ANCHOR_FORMAT_VERSION:
        return decode_anchor(data)  # version 1, or RollbackAnchorInvalid
    document = decode_struct(data, _HeadAnchorDocument, error=RollbackAnchorInvalid)
    if document.store_revision > MAX_U64 or document.record_count > MAX_U64:
        raise RollbackAnchorInvalid("store_revision and record_count must be below 2^64")
    if not _DIGEST_HEX.fullmatch(document.digest):
        raise RollbackAnchorInvalid("digest must be 64 lowercase hex")
    return HeadAnchor(document.store_revision, document.record_count, document.digest)


def compare_head_with_anchor(anchored: HeadAnchor, head: StoreHead) -> None:
    """A database head behind its anchor was rolled back.

    Below the anchored revision → ``RollbackDetected(head revision, anchored
    revision)``; at it with another count or digest (a different history) →
    the same error. Above it (a crash between ``COMMIT`` and the anchor
    write) is accepted.
    """
    if head.revision < anchored.store_revision:
        raise RollbackDetected(head.revision, anchored.store_revision)
    if head.revision == anchored.store_revision and HeadAnchor.of(head) != anchored:
        raise RollbackDetected(head.revision, anchored.store_revision)


def compare_with_anchor(anchored: int, floor: int, record_revision: int | None) -> None:
    """The anchor's check of one record: one below the revision it was seen at was rolled back."""
    if anchored == 0:
        return
    if record_revision is None:
        raise RollbackDetected(None, anchored)
    if floor < anchored or record_revision < anchored:
        raise RollbackDetected(record_revision, anchored)
