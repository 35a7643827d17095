"""A journal store's head: one sealed value that commits to every scope head it holds.

Each scope's head (``scope_head``) commits to that scope's rows, so a row
deleted or put back inside a scope is caught. The **store head** does the
same one level up: a journal database (a SQLite file, a PostgreSQL schema)
keeps one row beside its scope heads with

* ``revision``: how many transactions moved it (a fence reservation, a
  commit batch); it never goes down, and is what a rollback anchor of the
  whole store keeps;
* a :class:`~octo_common.setdigest.SetDigest` under :data:`STORE_HEADS_DOMAIN`
  of every scope head, one element ``(scope, decimal fence, revision)`` per
  scope, with their count;
* ``key_id`` and ``auth_tag``: the seal of :mod:`octo_common.headseal` under
  :data:`STORE_HEAD_DOMAIN` over ``BE64(revision) ‖ BE64(count) ‖ LP(digest
  bytes)``, made
  with the active storage key.

So a scope deleted whole (its head row and every row), or a scope whose
rows and head were put back to an earlier copy's sealed versions, in a store
whose other scopes are untouched, no longer matches the store head: the
check that every scope load, every start and ``journal verify`` make
(:func:`check_store`, O(scopes)) refuses it with ``RollbackDetected``. Only
the whole store put back as a unit (every scope head and the store head
together) still matches: the rollback anchor is what catches that.

When. A fence reservation and a commit move the store head in the same
transaction as the scope heads they move: one element out and one in per
scope head changed (:func:`moved`), O(scope heads changed), after its seal
is verified. A reseal or a prune that keeps a scope head's revision and
fence leaves the store head as it is.

Migration. The schema migration that creates the store head builds it from
the scope heads as they are, in the migration's own transaction, so a store
head row never exists without its digest: a missing row, or a row whose
digest is NULL or malformed, is ``RollbackDetected`` (tampering), never a
head still to be built.

This module is pure: values, the seal, the digest arithmetic and the
comparison. It must never accept a store head whose seal it did not verify,
or put a key in an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from octo_common import headseal
from octo_common.digest import be64
from octo_common.errors import RevisionExhausted, RollbackDetected
from octo_common.limits import MAX_U64
from octo_common.records import StorageKeyring
from octo_common.setdigest import SET_DIGEST_BYTES, SetDigest

__all__ = [
    "STORE_HEADS_DOMAIN",
    "STORE_HEAD_DOMAIN",
    "HeadMove",
    "HeadState",
    "JournalStoreHead",
    "check_store",
    "digest_of_heads",
    "moved",
]

STORE_HEAD_DOMAIN: Final = b"octo-worker-store-head-v1"
STORE_HEADS_DOMAIN: Final = b"octo-worker-store-heads-v1"

# One scope head as the store head holds it: (scope, fence, revision).
HeadState = tuple[str, int, int]
# One scope head changed by a transaction: its state before (None: no head)
# and after.
HeadMove = tuple[HeadState | None, HeadState]


def _element(head: HeadState) -> tuple[str, str, int]:
    scope, fence, revision = head
    return scope, str(fence), revision


def digest_of_heads(heads: Iterable[HeadState]) -> SetDigest:
    """The store digest of ``heads`` (scope, fence, revision), from scratch."""
    return SetDigest.of(STORE_HEADS_DOMAIN, (_element(head) for head in heads))


class JournalStoreHead:
    """The store head: its revision, the digest of every scope head, and the seal it was
    read or made with."""

    __slots__ = ("digest", "key_id", "revision", "tag")

    def __init__(
        self, revision: int, digest: SetDigest, key_id: str | None = None, tag: str | None = None
    ):
        self.revision = revision
        self.digest = digest
        self.key_id = key_id
        self.tag = tag

    @classmethod
    def from_row(cls, row: tuple[object, ...] | None) -> JournalStoreHead:
        """A store head read as (revision, row_count, digest, key_id, auth_tag).

        No row, a NULL or malformed digest: ``RollbackDetected`` (the
        migration never leaves one: it was deleted or edited). The seal is
        checked by :meth:`verify`.
        """
        if row is None:
            raise RollbackDetected(None, 0)
        revision, count, value, key_id, tag = row
        if isinstance(value, memoryview):
            value = bytes(value)
        if (
            type(revision) is not int
            or not 0 <= revision <= MAX_U64
            or type(count) is not int
            or not 0 <= count <= MAX_U64
            or not isinstance(value, bytes)
            or len(value) != SET_DIGEST_BYTES
            or not (key_id is None or isinstance(key_id, str))
            or not (tag is None or isinstance(tag, str))
        ):
            raise RollbackDetected(None, 0)
        return cls(revision, SetDigest.from_bytes(STORE_HEADS_DOMAIN, value, count), key_id, tag)

    def verify(self, keyring: StorageKeyring) -> None:
        """Check the seal (``InvalidRecordAuthenticationTag``, ``InvalidKeyId``,
        ``UnknownKeyId``)."""
        headseal.verify_head_seal(
            keyring, STORE_HEAD_DOMAIN, self.key_id, self.tag, _fields(self.revision, self.digest)
        )

    @classmethod
    def sealed(cls, keyring: StorageKeyring, revision: int, digest: SetDigest) -> JournalStoreHead:
        """The store head at ``revision`` over ``digest``, sealed with the active storage key."""
        key_id, tag = headseal.seal_head(keyring, STORE_HEAD_DOMAIN, _fields(revision, digest))
        return cls(revision, digest, key_id, tag)

    def row(self) -> tuple[int, int, bytes, str | None, str | None]:
        """(revision, row_count, digest, key_id, auth_tag) as stored."""
        return (self.revision, self.digest.count, self.digest.to_bytes(), self.key_id, self.tag)

    def __repr__(self) -> str:
        return (
            f"JournalStoreHead(revision={self.revision}, scopes={self.digest.count}, "
            f"sealed={self.tag is not None})"
        )


def _fields(revision: int, digest: SetDigest) -> bytes:
    return be64(revision) + headseal.digest_fields(digest)


def check_store(
    store: JournalStoreHead,
    heads: Iterable[HeadState],
    keyring: StorageKeyring,
    anchored: int = 0,
) -> None:
    """Every scope head of the store, read in the same snapshot as ``store``, must be
    the ones it commits to, and the store head not below the revision a rollback
    anchor read before that snapshot holds (``anchored``; 0: none): its seal
    verified, then ``RollbackDetected`` on a mismatch."""
    store.verify(keyring)
    if store.revision < anchored:
        raise RollbackDetected(store.revision, anchored)
    if digest_of_heads(heads) != store.digest:
        raise RollbackDetected(None, 0)


def moved(
    store: JournalStoreHead, moves: Iterable[HeadMove], keyring: StorageKeyring
) -> JournalStoreHead:
    """``store`` (its seal verified first) moved by ``moves``, sealed again, one revision
    up (the same revision without moves: a reseal); O(moves).

    A move whose old head the digest cannot hold (an empty digest) is
    ``RollbackDetected``: the scope heads are not the store head's.
    """
    store.verify(keyring)
    moves = list(moves)
    revision = store.revision + 1 if moves else store.revision
    if revision > MAX_U64:
        raise RevisionExhausted()
    digest = store.digest.copy()
    try:
        for old, new in moves:
            if old is not None:
                digest.remove(*_element(old))
            digest.add(*_element(new))
    except ValueError:
        raise RollbackDetected(None, 0) from None
    return JournalStoreHead.sealed(keyring, revision, digest)
