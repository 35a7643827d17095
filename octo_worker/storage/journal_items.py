"""How a journal row's ``item`` names its operation key at rest: a keyed hash.

An operation key is derived from the plan, the step, the tool, the input
and a caller's nonce; stored in clear, a database copy and a guess at the
input would confirm each other offline. So a ``worker-journal`` row's item
is ``<key id>:<hex>``, where ``<hex>`` is keyed BLAKE3 over
``LP(utf8(scope)) ‖ LP(utf8(operation key))`` under a key derived (BLAKE3
``derive_key``, :data:`JOURNAL_ITEM_KEY_CONTEXT`) from the storage key
``<key id>``. The storage key is never used for this hash directly. The
item is what the row is sealed and encrypted under (the associated data of
its document, the scope's digest, the live index); the operation key itself
is only in the row's document, encrypted when a data key is configured.

A lookup tries every storage key the keyring holds (the active one first),
so rows hashed before a rotation are still found; a new row is hashed under
the active key. The ``:`` never occurs in a token, so an item in clear (a
journal from before this format, read as it is) is told apart by its shape.

:class:`JournalItems` holds no state but derived keys. It must never log,
raise with or return a key, and never accept a row whose item is not its
document's operation key under the item's own key id.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from octo_common.digest import derive_key, keyed_blake3, lp
from octo_common.errors import StorageBackendError, UnknownKeyId
from octo_common.ids import is_token
from octo_common.records import StorageKey, StorageKeyring
from octo_worker.storage.changesets import RowWrite
from octo_worker.storage.documents import NS_JOURNAL

__all__ = [
    "JOURNAL_ITEM_KEY_CONTEXT",
    "ItemLookups",
    "JournalItems",
    "item_key_id",
    "is_hashed_item",
]

JOURNAL_ITEM_KEY_CONTEXT: Final = "octo 2026-12 worker journal item key v1"


def is_hashed_item(item: str) -> bool:
    """Whether ``item`` has the keyed-hash shape ``<key id>:<64 hex>``."""
    key_id, sep, digest = item.partition(":")
    return bool(sep) and is_token(key_id) and len(digest) == 64 and _is_hex(digest)


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def item_key_id(item: str) -> str | None:
    """The storage key id a hashed item names (None: not a hashed item)."""
    return item.partition(":")[0] if is_hashed_item(item) else None


class JournalItems:
    """Operation key -> journal item under a storage keyring (see the module docstring).

    ``plain=True``: a journal from before keyed items, read as it is: an item
    may also be the operation key in clear (a read-only look at a journal the
    daemon has not migrated yet; such a store never writes). The keyring is
    used by reference: a key added by a rotation is tried from the next lookup on.
    """

    __slots__ = ("_derived", "_keyring", "plain")

    def __init__(self, keyring: StorageKeyring, *, plain: bool = False) -> None:
        self._keyring = keyring
        self._derived: dict[str, tuple[StorageKey, bytes]] = {}
        self.plain = plain

    def __repr__(self) -> str:
        return f"JournalItems(plain={self.plain})"

    def _key(self, key_id: str) -> bytes:
        key = self._keyring.key_for(key_id)  # UnknownKeyId when absent
        cached = self._derived.get(key_id)
        # Keyed by id and checked against the key object: an id never names two keys.
        if cached is None or cached[0] is not key:
            cached = (key, derive_key(JOURNAL_ITEM_KEY_CONTEXT, key.reveal()))
            self._derived[key_id] = cached
        return cached[1]

    def hashed(self, scope: str, operation_key: str, key_id: str) -> str:
        """The item of ``operation_key`` in ``scope`` under storage key ``key_id``."""
        digest = keyed_blake3(
            self._key(key_id), lp(scope.encode("utf-8")) + lp(operation_key.encode("utf-8"))
        )
        return f"{key_id}:{digest.hex()}"

    def item(self, scope: str, operation_key: str) -> str:
        """The item a new row of ``operation_key`` is written under (the active key)."""
        return self.hashed(scope, operation_key, self._keyring.active_id)

    def candidates(self, scope: str, operation_key: str) -> tuple[str, ...]:
        """Every item ``operation_key``'s row may be stored under, the active key's first
        (then, with ``plain``, the key in clear)."""
        active = self._keyring.active_id
        ids = [active, *(key_id for key_id in self._keyring.key_ids if key_id != active)]
        found = tuple(self.hashed(scope, operation_key, key_id) for key_id in ids)
        return (*found, operation_key) if self.plain else found

    def names(self, scope: str, item: str, operation_key: str) -> bool:
        """Whether ``item`` is ``operation_key``'s item in ``scope`` (under its own key id).

        A hashed item whose key id the keyring does not hold raises ``UnknownKeyId``.
        """
        if self.plain and item == operation_key:
            return True
        key_id = item_key_id(item)
        if key_id is None:
            return False
        return self.hashed(scope, operation_key, key_id) == item


# Operation keys whose rows a lookup found under another storage key than the
# active one (before a rotation's start renamed them), remembered so that a
# commit writes the row where it is; about 300 bytes each. A forgotten one
# fails closed (``WriteConflict``).
_FOUND_ELSEWHERE_LIMIT: Final = 65536


class ItemLookups:
    """A store's lookups by operation key: the items each key is asked under, where a
    key's row was found, the item a commit writes, and the key ids a scope's rows use."""

    __slots__ = ("_elsewhere", "_keyring", "checked", "items")

    def __init__(self, keyring: StorageKeyring) -> None:
        self.items = JournalItems(keyring)
        self._keyring = keyring
        self._elsewhere: dict[tuple[str, str], str] = {}
        # Scopes a store read without loading them (an operator's read), their
        # head checked once: the key ids of their journal rows' items.
        self.checked: dict[str, frozenset[str]] = {}

    def remember(self, scope: str, key_ids: Iterable[str]) -> frozenset[str]:
        """A scope's key ids as read once (bounded: forgotten ones are read again)."""
        if len(self.checked) >= 4096:
            self.checked.clear()
        found = self.checked[scope] = frozenset(key_ids)
        return found

    def asked(self, scope: str, keys: Iterable[str]) -> dict[str, str]:
        """Every item to read for ``keys``, mapped to its key."""
        return {item: key for key in keys for item in self.items.candidates(scope, key)}

    def found(self, scope: str, key: str, item: str) -> None:
        """``key``'s row was read under ``item``."""
        name = (scope, key)
        self._elsewhere.pop(name, None)
        if not item.startswith(f"{self._keyring.active_id}:"):
            self._elsewhere[name] = item
            if len(self._elsewhere) > _FOUND_ELSEWHERE_LIMIT:
                del self._elsewhere[next(iter(self._elsewhere))]

    def stored_writes(self, scope: str, writes: tuple[RowWrite, ...]) -> tuple[RowWrite, ...]:
        """A change set's journal row writes named by their items at rest (:meth:`written`)."""
        return tuple(
            write._replace(item=self.written(scope, write.item, write.base_revision))
            if write.namespace == NS_JOURNAL
            else write
            for write in writes
        )

    def written(self, scope: str, key: str, base_revision: int | None) -> str:
        """The item a commit writes ``key``'s row under: where a lookup found it, else
        the active key's hash."""
        item = None if base_revision is None else self._elsewhere.get((scope, key))
        return item or self.items.item(scope, key)

    def check_key_ids(self, key_ids: Iterable[str]) -> None:
        """Every journal row of a scope is found by a lookup: its item is hashed under
        a storage key the keyring holds (``UnknownKeyId`` otherwise: that row's key
        would look absent and run again), and none is in clear in a keyed journal
        ("" is the key id of an item in clear)."""
        for key_id in key_ids:
            if not key_id:
                if not self.items.plain:
                    raise StorageBackendError("a journal row names its operation key in clear")
            elif key_id not in self._keyring:
                raise UnknownKeyId(key_id)
