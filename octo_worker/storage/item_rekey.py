"""Journal rows brought under the active key's item hash, for every backend (``journal_items``).

Owns what one rekeying pass decides, whatever the database: which rows it
rewrites (every ``worker-journal`` row whose item is not the active
storage key's keyed hash: an item in clear, from before keyed items, or
one hashed under a key rotated away from), the check each scope passes
before any of its rows is rewritten (its head authenticates and its
digest is its rows': a pass never builds a head over rows edited
beforehand), each row rewritten (authenticated and decrypted at its
item, its document naming the operation key the item names, then sealed
again under the active keys at its own revision with the new item as the
associated data), and the scope's head resealed over the digest of its
rows as they then are. Revisions and fences never move.

A backend runs a pass inside one transaction (the schema migration that
introduced keyed items, and every writable open afterwards when rows need
it), one savepoint per scope: a scope that fails its check or a row that
does not open leaves that scope's rows as they were (its next load
refuses it, as it would have before) and the pass goes on. So a crash
leaves the whole store as it was, and the next open does the pass again.

Kill point (``OCTO_FAULT``): ``worker.during_journal_rekey`` after each row
rewritten (``@n``: the n-th row). It must never log a key, a document or an
operation key, and never rewrite a row it did not authenticate.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

from octo_common.errors import RecordLocationMismatch, RollbackDetected
from octo_common.records import StorageKeyring
from octo_common.runtime.faults import FaultInjector
from octo_worker.storage.changes import Row, RowWrite
from octo_worker.storage.documents import NS_JOURNAL, journal_row_key
from octo_worker.storage.journal_items import JournalItems, is_hashed_item
from octo_worker.storage.scope_head import ScopeHead, check_loaded_scope, digest_of
from octo_worker.storage.sealing import RowSealer

__all__ = ["REKEY_BATCH", "REKEY_FAULT_POINT", "ItemRekeying"]

# Rows read per statement while a scope is rewritten.
REKEY_BATCH: Final = 500
REKEY_FAULT_POINT: Final = "worker.during_journal_rekey"


class ItemRekeying:
    """One pass: the decisions above, for a backend that reads and writes the rows."""

    def __init__(self, keyring: StorageKeyring, data_keyring: StorageKeyring | None) -> None:
        self._keyring = keyring
        self._sealer = RowSealer(keyring, data_keyring)
        self._items = JournalItems(keyring)
        # Every item not starting with this is rewritten.
        self.prefix = f"{keyring.active_id}:"
        self._fault = FaultInjector()
        self.rewritten = 0

    def current(self, item: str) -> bool:
        """Whether ``item`` is already the active key's hash (a pass leaves its row)."""
        return item.startswith(self.prefix) and is_hashed_item(item)

    def checked_head(
        self, scope: str, head: ScopeHead | None, rows: Iterable[tuple[str, str, int]]
    ) -> ScopeHead:
        """The scope's head, once it authenticates and commits to exactly ``rows``
        (every row triple of the scope): else the load's own error."""
        check_loaded_scope(head, digest_of(scope, rows), 0, self._keyring)
        if head is None:  # rows are what brought the scope here
            raise RollbackDetected(None, 0)
        return head

    def rewritten_row(self, scope: str, row: Row) -> tuple[str, bytes] | None:
        """(new item, new envelope) of a journal row, None when it is current."""
        if self.current(row.item):
            return None
        document = self._sealer.open(scope, NS_JOURNAL, row)
        key = journal_row_key(document)
        if is_hashed_item(row.item):
            named = self._items.names(scope, row.item, key)
        else:
            named = row.item == key
        if not named:
            raise RecordLocationMismatch("(journal item)", key)
        item = self._items.item(scope, key)
        envelope = self._sealer.seal(
            scope, RowWrite(NS_JOURNAL, item, document, None), row.revision
        )
        return item, envelope

    def rewrites(
        self, scope: str, batch: Iterable[tuple[Any, ...]]
    ) -> list[tuple[str, bytes, int]]:
        """(new item, new envelope, row id) of each row read as (id, item, revision,
        envelope) that is not current."""
        found: list[tuple[str, bytes, int]] = []
        for row_id, item, revision, envelope in batch:
            rewritten = self.rewritten_row(scope, Row(str(item), int(revision), bytes(envelope)))
            if rewritten is not None:
                found.append((*rewritten, int(row_id)))
        return found

    def wrote(self, rows: int) -> None:
        """``rows`` rows rewritten, in the transaction (each one a kill point of the
        crash tests)."""
        for _ in range(rows):
            self.rewritten += 1
            self._fault.reach(REKEY_FAULT_POINT)

    def resealed_head(self, head: ScopeHead, rows: Iterable[tuple[str, str, int]]) -> ScopeHead:
        """``head`` over the scope's rows as rewritten, sealed with the active key."""
        return head.sealed(self._keyring, digest=digest_of(head.scope, rows))
