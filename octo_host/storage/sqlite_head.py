"""The SQLite ledger's rollback protection: its store head and its anchor file.

:class:`RollbackGuard` is what :class:`~octo_host.storage.sqlite.SqliteRecordBackend`
asks, from its database thread, before it trusts what it reads and after it
commits what it wrote:

* **open** (O(records), once): read the anchor file (before anything is
  created), authenticate the store head, compare it with the anchor (a
  version 1 anchor: every record it names), recompute the digest over every
  record row and compare it with the head. A head still to be built (the
  schema migration that created the table leaves one, sealed as such with
  the storage key in the migration's transaction) is built here from the
  rows, after the version 1 anchor check if there is one; a head row
  without a digest and without that seal (a digest set to NULL) is
  ``RollbackDetected``.
* **load** (O(1)): the head revision read with the record must not be below
  the highest one seen; with an anchor, a record this process saw recently
  (the last :data:`RECENT_RECORDS` it loaded or wrote) must not be below the
  revision it saw.
* **commit** (O(records written)): inside the transaction, read and
  authenticate the head, move its digest by the written records, add one to
  its revision, reseal it; after ``COMMIT``, write the version 2 anchor
  (fixed size) once for the whole transaction.

What is detected, and when. With the anchor: a database restored whole from
an older copy (at open, and on any later load or commit of this process);
a deleted record, or a record put back to an older sealed version (at open,
whatever the record; while open, on its next load when it is among the
records this process saw recently, else at the next open). Without the
anchor, the sealed head still catches a deleted or individually rolled-back
record at open, but nothing can tell a database restored whole.

It must never let a commit through on a head it could not authenticate (with
a keyring), cost more than O(records written) per commit, or keep per-record
state beyond :data:`RECENT_RECORDS` entries.
"""

from __future__ import annotations

import sqlite3
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from octo_common.errors import (
    OctoError,
    RevisionExhausted,
    RollbackDetected,
    StorageBackendError,
)
from octo_common.limits import SQLITE_MAX_INTEGER
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_common.runtime.anchorfile import read_anchor_file, write_anchor_file
from octo_common.runtime.sqlite import roll_back
from octo_common.setdigest import SetDigest
from octo_host.storage.anchor import (
    HeadAnchor,
    compare_head_with_anchor,
    compare_with_anchor,
    decode_ledger_anchor,
    encode_head_anchor,
)
from octo_host.storage.contract import Head
from octo_host.storage.head import LEDGER_ROWS_DOMAIN, StoreHead, seal_unbuilt, verify_unbuilt

__all__ = ["HEAD_MIGRATION", "RECENT_RECORDS", "AnchorDocument", "RollbackGuard"]

RECENT_RECORDS = 16_384
"""Records whose last seen revision an anchored backend keeps, least recently used out."""

HEAD_MIGRATION: tuple[str, ...] = (
    """
    CREATE TABLE store_head (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        revision INTEGER NOT NULL CHECK (revision >= 0),
        record_count INTEGER NOT NULL CHECK (record_count >= 0),
        digest BLOB,
        key_id TEXT,
        auth_tag TEXT
    )
    """,
    # digest NULL: to be built from the rows at the next open, in the same
    # transaction as the checks that let it be trusted.
    "INSERT INTO store_head (id, revision, record_count, digest) VALUES (1, 0, 0, NULL)",
)
"""Schema version 1 → 2: the store head, created unbuilt."""

AnchorDocument = dict[StorageRecordKey, int] | HeadAnchor

_SELECT_STORE_HEAD = "SELECT revision, record_count, digest, key_id, auth_tag FROM store_head"
_UPDATE_STORE_HEAD = (
    "UPDATE store_head SET revision = ?, record_count = ?, digest = ?, key_id = ?, auth_tag = ? "
    "WHERE id = 1"
)
_SINGLE_ITEM = ""


class _Unbuilt:
    """The head row the migration leaves: built at the next open, if its seal holds."""

    __slots__ = ("key_id", "tag")

    def __init__(self, key_id: object, tag: object) -> None:
        self.key_id = key_id if isinstance(key_id, str) else None
        self.tag = tag if isinstance(tag, str) else None


def _read_store_head(connection: sqlite3.Connection) -> StoreHead | _Unbuilt | None:
    rows = connection.execute(_SELECT_STORE_HEAD).fetchall()
    if not rows:
        return None
    if len(rows) != 1:
        raise StorageBackendError("malformed store head row")
    row = tuple(rows[0])
    if row[2] is None:
        return _Unbuilt(row[3], row[4])
    return StoreHead.from_row(row)


def _record_rows(connection: sqlite3.Connection) -> Iterator[tuple[str, str, int]]:
    cursor = connection.execute(
        "SELECT namespace, name, revision FROM items WHERE item = ?", (_SINGLE_ITEM,)
    )
    for namespace, name, revision in cursor:
        if not isinstance(namespace, str) or not isinstance(name, str) or type(revision) is not int:
            raise StorageBackendError("malformed item row")
        if revision < 1:
            raise StorageBackendError("malformed item row")
        yield namespace, name, revision


def _check_records_against_v1(
    connection: sqlite3.Connection, anchor: dict[StorageRecordKey, int]
) -> None:
    """The check of a version 1 anchor: every record it names, at or above its revision."""
    for key, anchored in anchor.items():
        row = connection.execute(
            "SELECT (SELECT revision FROM heads WHERE namespace = :ns AND name = :name), "
            "(SELECT revision FROM items WHERE namespace = :ns AND name = :name AND item = :item)",
            {"ns": key.namespace, "name": key.name, "item": _SINGLE_ITEM},
        ).fetchone()
        floor, item_revision = row
        floor = 0 if floor is None else floor
        if type(floor) is not int or not (item_revision is None or type(item_revision) is int):
            raise StorageBackendError("malformed head row")
        compare_with_anchor(anchored, floor, item_revision)


class RollbackGuard:
    """The store head and anchor of one backend; every method runs in its database thread
    (``bind`` excepted: it only stores the keyring)."""

    def __init__(self, anchor_path: Path | None) -> None:
        self.anchor_path = anchor_path
        self.keyring: StorageKeyring | None = None
        self._known = 0  # the highest head revision seen
        self._anchored: HeadAnchor | None = None  # what the anchor file holds, as far as we know
        self._recent: OrderedDict[StorageRecordKey, int] = OrderedDict()
        # One write transaction:
        self._changes: list[tuple[StorageRecordKey, int | None, int]] = []
        self._raised: dict[StorageRecordKey, int] = {}
        self._next: StoreHead | None = None

    def bind(self, keyring: StorageKeyring) -> None:
        if self.keyring is not None and self.keyring is not keyring:
            raise ValueError("this backend already seals its head with another keyring")
        self.keyring = keyring

    def seal_unbuilt(self, connection: sqlite3.Connection) -> None:
        """The migration step after ``HEAD_MIGRATION``: its head row left to be built,
        sealed as such (with the keyring bound; unsealed without one)."""
        if self.keyring is not None:
            key_id, tag = seal_unbuilt(self.keyring)
            connection.execute(
                "UPDATE store_head SET key_id = ?, auth_tag = ? WHERE id = 1 AND digest IS NULL",
                (key_id, tag),
            )

    # Open --------------------------------------------------------------------

    def read_anchor(self) -> AnchorDocument | None:
        """The configured anchor, strictly decoded (``RollbackAnchorMissing``/``Invalid``)."""
        if self.anchor_path is None:
            return None
        return decode_ledger_anchor(read_anchor_file(self.anchor_path))

    def open(self, connection: sqlite3.Connection, anchor: AnchorDocument | None) -> None:
        """The open checks, in one ``BEGIN IMMEDIATE`` (the head may be built in it)."""
        connection.execute("BEGIN IMMEDIATE")
        try:
            head = self._check_at_open(connection, anchor)
            connection.execute("COMMIT")
        except BaseException:
            roll_back(connection)
            raise
        self._known = head.revision
        if self.anchor_path is not None:
            self._anchored = HeadAnchor.of(head)
        self._recent.clear()

    def _check_at_open(
        self, connection: sqlite3.Connection, anchor: AnchorDocument | None
    ) -> StoreHead:
        stored = _read_store_head(connection)
        anchored_revision = anchor.store_revision if isinstance(anchor, HeadAnchor) else 0
        if stored is None:
            raise RollbackDetected(None, anchored_revision)  # the head row was deleted
        if isinstance(anchor, dict):
            _check_records_against_v1(connection, anchor)
        computed = SetDigest.of(LEDGER_ROWS_DOMAIN, _record_rows(connection))
        if isinstance(stored, _Unbuilt):
            if self.keyring is not None:
                # Only the migration's own sealed record says "to be built": a
                # digest set to NULL, or a head row without one, is tampering.
                try:
                    verify_unbuilt(self.keyring, stored.key_id, stored.tag)
                except OctoError:
                    raise RollbackDetected(None, anchored_revision) from None
            head = StoreHead(0, computed).sealed_with(self.keyring)
            connection.execute(_UPDATE_STORE_HEAD, head.row())
        else:
            head = stored
            if self.keyring is not None:
                head.verify(self.keyring)
        if isinstance(anchor, HeadAnchor):
            compare_head_with_anchor(anchor, head)
        if head.digest != computed:
            # A record deleted, added or put back to another version behind the head's back.
            raise RollbackDetected(None, head.revision)
        return head

    # Loads and writes ----------------------------------------------------------

    def check_load(self, key: StorageRecordKey, head: Head, store_revision: object) -> None:
        """Before a load returns: the store head read with it, then the record (with an anchor)."""
        if store_revision is None or type(store_revision) is not int:
            raise RollbackDetected(None, self._known)  # the head row is gone
        if store_revision < self._known:
            raise RollbackDetected(store_revision, self._known)
        self._known = store_revision
        self.check_record(key, head, in_write=False)

    def check_record(self, key: StorageRecordKey, head: Head, *, in_write: bool) -> None:
        """With an anchor: a record this process saw recently must not be below what it saw."""
        if self._anchored is None:
            return
        seen = self._recent.get(key, 0)
        record_revision = None if head.record is None else head.record.revision
        compare_with_anchor(seen, head.floor, record_revision)
        if head.floor > seen:
            if in_write:
                # Seen inside a transaction: kept only once it commits.
                self._raised[key] = max(head.floor, self._raised.get(key, 0))
            else:
                self._remember(key, head.floor)
        elif seen:
            self._recent.move_to_end(key)

    def _remember(self, key: StorageRecordKey, revision: int) -> None:
        recent = self._recent
        recent[key] = max(revision, recent.get(key, 0))
        recent.move_to_end(key)
        while len(recent) > RECENT_RECORDS:
            recent.popitem(last=False)

    # One write transaction -------------------------------------------------------

    def begin(self) -> None:
        self._changes.clear()
        self._raised.clear()
        self._next = None

    def mark(self) -> int:
        """Where the changes of the write about to run start (to undo a failed one)."""
        return len(self._changes)

    def undo_to(self, mark: int) -> None:
        del self._changes[mark:]

    def wrote(self, key: StorageRecordKey, old_revision: int | None, new_revision: int) -> None:
        self._changes.append((key, old_revision, new_revision))

    def seal(self, connection: sqlite3.Connection) -> None:
        """Before ``COMMIT``: move the head by this transaction's writes (O(writes))."""
        if not self._changes:
            return
        stored = _read_store_head(connection)
        if not isinstance(stored, StoreHead):
            raise RollbackDetected(None, self._known)
        if self.keyring is not None:
            stored.verify(self.keyring)
        if stored.revision < self._known:
            raise RollbackDetected(stored.revision, self._known)
        if stored.revision >= SQLITE_MAX_INTEGER:
            raise RevisionExhausted()
        digest = stored.digest.copy()
        try:
            for key, old, new in self._changes:
                digest.replace(key.namespace, key.name, old, new)
        except ValueError:
            # More records removed than the head holds: the rows are not the head's.
            raise RollbackDetected(None, stored.revision) from None
        head = StoreHead(stored.revision + 1, digest).sealed_with(self.keyring)
        connection.execute(_UPDATE_STORE_HEAD, head.row())
        self._next = head

    def committed(self) -> str | None:
        """After ``COMMIT``: keep what it made true and write the anchor once.

        Returns why the anchor could not be written (the callers that stored
        something must then fail), else None.
        """
        for key, revision in self._raised.items():
            self._remember(key, revision)
        head = self._next
        if head is None:
            return None
        self._known = max(self._known, head.revision)
        if self._anchored is None or self.anchor_path is None:
            return None
        for key, _, revision in self._changes:
            self._remember(key, revision)
        self._anchored = HeadAnchor.of(head)
        try:
            write_anchor_file(self.anchor_path, encode_head_anchor(self._anchored))
        except OSError as exc:
            return f"rollback anchor write failed: {exc.strerror}"
        return None
