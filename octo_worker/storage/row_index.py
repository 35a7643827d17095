"""The live index of a loaded scope: which rows its sealed head commits to, and at which revision.

A scope is checked whole against its sealed head when it is loaded
(``scope_head.check_snapshot``): the digest recomputed over every row
``(namespace, key, revision)`` must be the head's. Between two loads the
database can still be edited beside the running daemon: a row deleted, put
back to an older sealed copy, or copied in. :class:`RowIndex` carries the
authenticated state of the load forward so that each of those is refused
when it matters, before any decision is taken on it:

* it is built in the same pass that recomputes the digest at load (so it
  holds exactly the rows the sealed head commits to);
* every row a decision reads (:meth:`RowIndex.check_rows`) must be there at
  the revision the index holds, and a row the index holds must not be
  missing from a read that names it;
* every commit checks the revision each row it writes or deletes had
  against the index (:meth:`RowIndex.expect`, through
  ``changes.CommitBatch``) and moves the index once its transaction
  committed (:meth:`RowIndex.apply`).

A mismatch is ``RollbackDetected``: the rows are not the head's.

Layout. One open-addressing table with linear probing, two arrays of signed
64-bit integers: the key is the process's (randomised, keyed) ``hash`` of
``(namespace, key)``, 0 marking an empty slot, and the revision beside it;
deletion shifts the probe run back, so no tombstone is ever left and the
table's size follows the rows the scope holds, not its history. About 16
bytes per slot, at most 0.6 of the slots used after a build or growth
(so 16 / 0.6 ≈ 27 bytes per row), plus a count per namespace so that a read
of a whole namespace can check it returned every row.

Two rows whose keys hash alike (about one chance in 2^64 / rows² per
load, under a key an attacker does not know) share a slot: the second
insert at build time is refused as a duplicate and the scope is not served
(``StorageBackendError``), which fails closed.

Thread-safety: the SQLite backend decides commits on its writer thread and
reads on the event loop, so every method takes the index's lock.

It is pure: no I/O, no clock, no key material; it never holds a document.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from octo_common.errors import RollbackDetected, StorageBackendError
from octo_worker.storage.documents import NS_JOURNAL

__all__ = ["RowIndex"]

_EMPTY: Final = 0
_MIN_SLOTS: Final = 64
_BUILD_LOAD: Final = 0.6
_MAX_LOAD: Final = 0.8


def _slot_key(namespace: str, item: str) -> int:
    key = hash((namespace, item))
    return key if key != _EMPTY else 1


class RowIndex:
    """``(namespace, key) -> revision`` of every row one loaded scope holds (see the module)."""

    __slots__ = (
        "_counts",
        "_keys",
        "_lock",
        "_revisions",
        "_size",
        "_used",
        "journal_key_ids",
        "revision",
    )

    def __init__(self, rows_hint: int = 0) -> None:
        slots = max(_MIN_SLOTS, int(rows_hint / _BUILD_LOAD) + 1)
        self._keys = array("q", bytes(8 * slots))
        self._revisions = array("q", bytes(8 * slots))
        self._size = slots
        self._used = 0
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        # The head revision this index was built at, moved by commits.
        self.revision = 0
        # The key ids the journal rows' items were hashed under, as built
        # ("" for an item in clear: ``journal_items``); checked at the load.
        self.journal_key_ids: set[str] = set()

    @classmethod
    def building(
        cls, rows: Iterable[tuple[str, str, int]], rows_hint: int = 0
    ) -> tuple[RowIndex, Iterator[tuple[str, str, int]]]:
        """An empty index and ``rows`` passed through, each inserted as it goes by
        (so that the pass that recomputes the digest builds the index too)."""
        index = cls(rows_hint)

        def passing() -> Iterator[tuple[str, str, int]]:
            key_ids = index.journal_key_ids
            for row in rows:
                index._insert_new(*row)
                if row[0] == NS_JOURNAL:
                    item = row[1]
                    key_ids.add(item.partition(":")[0] if ":" in item else "")
                yield row

        return index, passing()

    # Size -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._used

    def nbytes(self) -> int:
        """The bytes the table's two arrays take."""
        return self._keys.itemsize * self._size * 2

    def count(self, namespace: str) -> int:
        """How many rows of ``namespace`` the index holds."""
        with self._lock:
            return self._counts.get(namespace, 0)

    # The table --------------------------------------------------------------------------------

    def _find(self, key: int) -> int:
        """The slot holding ``key``, or the empty slot where it would go."""
        keys = self._keys
        size = self._size
        slot = key % size
        while True:
            found = keys[slot]
            if found in (key, _EMPTY):
                return slot
            slot += 1
            if slot == size:
                slot = 0

    def _get(self, namespace: str, item: str) -> int | None:
        slot = self._find(_slot_key(namespace, item))
        return None if self._keys[slot] == _EMPTY else self._revisions[slot]

    def _insert_new(self, namespace: str, item: str, revision: int) -> None:
        key = _slot_key(namespace, item)
        slot = self._find(key)
        if self._keys[slot] != _EMPTY:
            raise StorageBackendError("two rows of one scope share an index slot")
        self._put(slot, key, revision, namespace)

    def _put(self, slot: int, key: int, revision: int, namespace: str) -> None:
        self._keys[slot] = key
        self._revisions[slot] = revision
        self._used += 1
        self._counts[namespace] = self._counts.get(namespace, 0) + 1
        if self._used > self._size * _MAX_LOAD:
            self._grow()

    def _grow(self) -> None:
        old_keys, old_revisions = self._keys, self._revisions
        slots = int(self._used / _BUILD_LOAD) + 1
        self._keys = array("q", bytes(8 * slots))
        self._revisions = array("q", bytes(8 * slots))
        self._size = slots
        for key, revision in zip(old_keys, old_revisions, strict=True):
            if key != _EMPTY:
                slot = self._find(key)
                self._keys[slot] = key
                self._revisions[slot] = revision

    def _delete(self, slot: int, namespace: str) -> None:
        """Empty ``slot`` and shift the rest of its probe run back (no tombstone)."""
        keys, revisions, size = self._keys, self._revisions, self._size
        keys[slot] = _EMPTY
        self._used -= 1
        self._counts[namespace] -= 1
        hole = slot
        probe = slot
        while True:
            probe = probe + 1 if probe + 1 < size else 0
            key = keys[probe]
            if key == _EMPTY:
                return
            home = key % size
            # Move the entry back into the hole unless its home lies in (hole, probe].
            if (hole < probe and hole < home <= probe) or (
                hole > probe and (home > hole or home <= probe)
            ):
                continue
            keys[hole] = key
            revisions[hole] = revisions[probe]
            keys[probe] = _EMPTY
            hole = probe

    def _set(self, namespace: str, item: str, revision: int | None) -> None:
        key = _slot_key(namespace, item)
        slot = self._find(key)
        present = self._keys[slot] != _EMPTY
        if revision is None:
            if present:
                self._delete(slot, namespace)
        elif present:
            self._revisions[slot] = revision
        else:
            self._put(slot, key, revision, namespace)

    # What decisions ask -----------------------------------------------------------------------

    def get(self, namespace: str, item: str) -> int | None:
        """The revision the index holds for the row (None: the head has no such row)."""
        with self._lock:
            return self._get(namespace, item)

    def check_rows(
        self,
        namespace: str,
        items: Sequence[str] | None,
        rows: Sequence[tuple[str, int, bytes]],
        *,
        deletable: bool = False,
        started: int | None = None,
    ) -> None:
        """Rows read as (key, revision, envelope) for ``items`` (None: the whole
        namespace) against the index; ``RollbackDetected`` when they are not its rows.

        Each row must be at the revision the index holds, or newer than every
        commit the index has taken in (a commit of this instance whose
        transaction is done but whose move is not applied yet: an attacker
        has no sealed row newer than the head). A row the index holds must
        not be missing, except in a ``deletable`` namespace (the outbox, whose
        rows commits delete: a read may overlap such a commit); a whole
        namespace read of another one must hold as many rows as the index.

        ``started``: the index's revision taken before the rows were read. A
        commit of this instance applied since then may have moved a row after
        the read's snapshot was taken: a row the index moved past ``started``
        may be read at its earlier revision or missing, a row such a commit
        deleted may still be read, and a whole namespace's count is not
        compared. Without ``started`` (or when no commit was applied during the
        read) every rule holds exactly.
        """
        with self._lock:
            newest = self.revision
            overlapped = started is not None and started < newest
            newer = 0
            for item, revision, _ in rows:
                expected = self._get(namespace, item)
                if expected == revision:
                    continue
                if revision > newest and (expected is None or expected < revision):
                    newer += 1
                    continue
                if deletable and expected is None:
                    continue
                if overlapped and self._moved_since(expected, revision, started):
                    continue
                raise RollbackDetected(revision, newest)
            if deletable or len(rows) == (len(items) if items is not None else -1):
                return
            if items is None:
                if overlapped:
                    return
                if len(rows) - newer != self._counts.get(namespace, 0):
                    raise RollbackDetected(None, newest)
                return
            found = {row[0] for row in rows}
            for item in items:
                if item in found:
                    continue
                expected = self._get(namespace, item)
                if expected is None or (overlapped and self._moved_since(expected, None, started)):
                    continue
                raise RollbackDetected(None, newest)

    @staticmethod
    def _moved_since(expected: int | None, read: int | None, started: int | None) -> bool:
        """Whether a commit applied after ``started`` explains a row read at ``read``
        (None: missing) where the index holds ``expected`` (None: deleted)."""
        if started is None:
            return False
        if expected is None:
            return True  # deleted by a commit after the snapshot (the index moved)
        return expected > started and (read is None or read < expected)

    def expect(self, namespace: str, item: str, revision: int | None) -> bool:
        """Whether the row is at ``revision`` (None: absent) as far as the index knows."""
        with self._lock:
            return self._get(namespace, item) == revision

    def apply(self, moves: Iterable[tuple[str, str, int | None]], revision: int) -> None:
        """A committed transaction's rows, as (namespace, key, new revision or None),
        and the head revision it advanced to."""
        with self._lock:
            for namespace, item, new in moves:
                self._set(namespace, item, new)
                if namespace == NS_JOURNAL and new is not None:
                    self.journal_key_ids.add(item.partition(":")[0] if ":" in item else "")
            self.revision = max(self.revision, revision)
