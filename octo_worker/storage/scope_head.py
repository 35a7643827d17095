"""A journal scope's sealed head: it commits to every row the scope holds.

Every backend of the worker journal keeps, per scope, one **head** beside
the scope's rows:

* ``revision``: the scope revision, moved by every commit;
* ``fence``: the fencing token, moved by every reservation;
* a :class:`~octo_common.setdigest.SetDigest` under :func:`rows_domain`
  (the scope is part of the domain) of every row the scope holds, as
  ``(namespace, key, revision)``, with their count;
* ``key_id`` and ``auth_tag``: the seal of :mod:`octo_common.headseal`
  under ``"octo-worker-scope-head-v1"`` over ``LP(utf8(scope)) ‖
  BE64(revision) ‖ BE64(fence) ‖ BE64(count) ‖ LP(digest bytes)``, made with
  the active storage key.

Which rows. All five row namespaces of a scope, because the head revision
covers all of them and each is a decision input at a restart:
``worker-journal`` (a deleted key would be admitted and run again),
``worker-session`` and ``worker-session-open`` (a session state put back
to an older version would accept a replayed frame or a reused sequence),
``worker-session-request`` (a deleted retained request id would let a
request id be reused),
``worker-outbox`` (a deleted reply would never be republished, an old one
put back would be sent twice). None is excluded. What is not covered is
the unauthenticated metadata beside the rows (``written_at``, ``closed``),
which never decides an outcome, and the head row itself, which the seal
covers.

When. A commit moves the digest in the same transaction as its rows, one
element out and one in per row written or deleted (O(rows changed), never
O(rows held)): :class:`DigestChanges`. A reservation, a prune and a reseal
reseal the head in their own transaction. Loading a scope (every fence
reservation, so every start and every reload) and ``journal verify`` / ``check``
recompute the digest over the scope's rows (O(rows of the scope), once per
load) and compare (:func:`check_rows`): a mismatch is ``rollback_detected``.
The same pass builds the scope's live index (``row_index``), which carries
that check forward between loads: every row a decision reads, and every
row a commit replaces, must be the one the index holds.

The rollback anchor keeps each scope's head revision and, once a journal's
heads carry digests, :data:`DIGEST_ANCHOR_KEY` (and, once it has a store
head, :data:`STORE_HEAD_ANCHOR_KEY`): a journal that presents itself as
older than that (schema edited back, digests or store head dropped, so that
a migration would rebuild them from edited rows or heads) is refused
(:func:`check_anchor`).

This module is pure and backend-neutral: values, the seal, the digest
arithmetic and the comparisons. A backend reads and writes head rows and
row triples with its own statements. It must never accept a head whose seal
it did not verify, let a change set's digest moves outlive a refused change
set, or put a key or a document in an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final, NamedTuple

from octo_common import headseal
from octo_common.digest import be64, lp
from octo_common.errors import (
    RollbackAnchorInvalid,
    RollbackDetected,
    StorageBackendError,
)
from octo_common.limits import MAX_U64
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_common.setdigest import SET_DIGEST_BYTES, SetDigest
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
)
from octo_worker.storage.row_index import RowIndex

__all__ = [
    "DIGESTED_NAMESPACES",
    "DIGEST_ANCHOR_KEY",
    "DIGEST_FORMAT",
    "HEAD_NAMESPACE",
    "SCOPE_HEAD_DOMAIN",
    "SCOPE_ROWS_DOMAIN",
    "STORE_HEAD_ANCHOR_KEY",
    "STORE_HEAD_FORMAT",
    "DigestChanges",
    "ScopeHead",
    "anchored_with_digests",
    "ScopeSnapshot",
    "check_anchor",
    "check_loaded_scope",
    "check_rows",
    "check_snapshot",
    "digest_and_index",
    "digest_of",
    "rows_domain",
]

SCOPE_HEAD_DOMAIN: Final = b"octo-worker-scope-head-v1"
SCOPE_ROWS_DOMAIN: Final = b"octo-worker-scope-rows-v1"

# The scope heads live under the journal namespace.
HEAD_NAMESPACE: Final = NS_JOURNAL
DIGESTED_NAMESPACES: Final = (
    NS_JOURNAL,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_OUTBOX,
    NS_SESSION_REQUEST,
)

# The anchor entry that says "this journal's heads carry digests, since
# format DIGEST_FORMAT" (the SQLite schema version that added them).
DIGEST_FORMAT: Final = 5
DIGEST_ANCHOR_KEY: Final = StorageRecordKey("worker-journal-format", "scope-row-digest")
# Likewise "this journal has a store head (``store_head``), since format
# STORE_HEAD_FORMAT": a journal edited back below it, so that a migration
# would build the store head again from scope heads as they are, is refused.
STORE_HEAD_FORMAT: Final = 7
STORE_HEAD_ANCHOR_KEY: Final = StorageRecordKey("worker-journal-format", "store-head")
_FORMAT_MARKS: Final = {DIGEST_ANCHOR_KEY: DIGEST_FORMAT, STORE_HEAD_ANCHOR_KEY: STORE_HEAD_FORMAT}


def rows_domain(scope: str) -> bytes:
    """The set digest domain of ``scope``'s rows: ``SCOPE_ROWS_DOMAIN ‖ LP(utf8(scope))``."""
    return SCOPE_ROWS_DOMAIN + lp(scope.encode("utf-8"))


def digest_of(scope: str, rows: Iterable[tuple[str, str, int]]) -> SetDigest:
    """The digest of ``scope``'s rows, as (namespace, key, revision), from scratch."""
    return SetDigest.of(rows_domain(scope), rows)


def digest_and_index(
    scope: str, rows: Iterable[tuple[str, str, int]], rows_hint: int = 0
) -> tuple[SetDigest, RowIndex]:
    """The digest of ``scope``'s rows and the live index of the same rows, in one pass."""
    index, passing = RowIndex.building(rows, rows_hint)
    return digest_of(scope, passing), index


def _fields(scope: str, revision: int, fence: int, digest: SetDigest) -> bytes:
    return lp(scope.encode("utf-8")) + be64(revision) + be64(fence) + headseal.digest_fields(digest)


class ScopeHead:
    """One scope's head: revision, fence, digest, and the seal it was read or made with."""

    __slots__ = ("digest", "fence", "key_id", "revision", "scope", "tag")

    def __init__(
        self,
        scope: str,
        revision: int,
        fence: int,
        digest: SetDigest,
        key_id: str | None = None,
        tag: str | None = None,
    ) -> None:
        self.scope = scope
        self.revision = revision
        self.fence = fence
        self.digest = digest
        self.key_id = key_id
        self.tag = tag

    @classmethod
    def empty(cls, scope: str) -> ScopeHead:
        """The head of a scope without rows: revision 0, fence 0, unsealed."""
        return cls(scope, 0, 0, SetDigest(rows_domain(scope)))

    @classmethod
    def from_row(cls, scope: str, row: tuple[object, ...]) -> ScopeHead:
        """A head read as (revision, fence, row_count, digest, key_id, auth_tag).

        Shapes only (a wrong type, range or length, or a digest never built,
        is ``StorageBackendError``); the seal is checked by :meth:`verify`.
        """
        revision, fence, count, value, key_id, tag = row
        if isinstance(value, memoryview):
            value = bytes(value)
        if (
            type(revision) is not int
            or not 0 <= revision <= MAX_U64
            or type(fence) is not int
            or not 0 <= fence <= MAX_U64
            or type(count) is not int
            or not 0 <= count <= MAX_U64
            or not isinstance(value, bytes)
            or len(value) != SET_DIGEST_BYTES
            or not (key_id is None or isinstance(key_id, str))
            or not (tag is None or isinstance(tag, str))
        ):
            raise StorageBackendError("malformed scope head row")
        digest = SetDigest.from_bytes(rows_domain(scope), value, count)
        return cls(scope, revision, fence, digest, key_id, tag)

    def verify(self, keyring: StorageKeyring) -> None:
        """Check the seal: ``InvalidRecordAuthenticationTag``, ``InvalidKeyId`` or
        ``UnknownKeyId`` when it does not hold."""
        headseal.verify_head_seal(
            keyring,
            SCOPE_HEAD_DOMAIN,
            self.key_id,
            self.tag,
            _fields(self.scope, self.revision, self.fence, self.digest),
        )

    def sealed(
        self,
        keyring: StorageKeyring,
        *,
        revision: int | None = None,
        fence: int | None = None,
        digest: SetDigest | None = None,
    ) -> ScopeHead:
        """This head (with the fields given replaced) sealed with the active key."""
        revision = self.revision if revision is None else revision
        fence = self.fence if fence is None else fence
        digest = self.digest if digest is None else digest
        key_id, tag = headseal.seal_head(
            keyring, SCOPE_HEAD_DOMAIN, _fields(self.scope, revision, fence, digest)
        )
        return ScopeHead(self.scope, revision, fence, digest, key_id, tag)

    def with_fence(self, fence: int) -> ScopeHead:
        """This head at another fence, unsealed (a reservation seals it)."""
        return ScopeHead(self.scope, self.revision, fence, self.digest)

    def with_digest(self, digest: SetDigest) -> ScopeHead:
        """This head over other rows, unsealed (a prune seals it)."""
        return ScopeHead(self.scope, self.revision, self.fence, digest)

    def row(self) -> tuple[int, int, int, bytes, str | None, str | None]:
        """(revision, fence, row_count, digest, key_id, auth_tag) as stored."""
        digest = self.digest
        return (self.revision, self.fence, digest.count, digest.to_bytes(), self.key_id, self.tag)

    def __repr__(self) -> str:
        return (
            f"ScopeHead(scope={self.scope!r}, revision={self.revision}, fence={self.fence}, "
            f"rows={self.digest.count}, sealed={self.tag is not None})"
        )


class DigestChanges:
    """The digest moves of one change set, applied to a copy only when it succeeds.

    ``wrote(namespace, key, old, new)``: the row ``key`` went from revision
    ``old`` (None: absent) to ``new`` (None: deleted). :meth:`applied_to`
    returns the head's digest with every move made, in O(moves).
    """

    __slots__ = ("_moves",)

    def __init__(self) -> None:
        self._moves: list[tuple[str, str, int | None, int | None]] = []

    def wrote(self, namespace: str, key: str, old: int | None, new: int | None) -> None:
        self._moves.append((namespace, key, old, new))

    def __len__(self) -> int:
        return len(self._moves)

    def __iter__(self) -> Iterator[tuple[str, str, int | None, int | None]]:
        """Every move as (namespace, key, old revision, new revision), in order."""
        return iter(self._moves)

    def applied_to(self, head: ScopeHead) -> SetDigest:
        """``head``'s digest moved by these changes (``head`` itself is left as it is).

        More rows removed than the digest holds means the rows are not the
        head's: ``RollbackDetected``.
        """
        digest = head.digest.copy()
        try:
            for namespace, key, old, new in self._moves:
                digest.replace(namespace, key, old, new)
        except ValueError:
            raise RollbackDetected(None, head.revision) from None
        return digest


def check_rows(head: ScopeHead, computed: SetDigest) -> None:
    """The rows a backend found must be the head's rows: else ``RollbackDetected``.

    A row deleted, a row put back to an older sealed version, a row copied
    in from another scope or key all change the recomputed digest.
    """
    if computed != head.digest:
        raise RollbackDetected(None, head.revision)


def check_loaded_scope(
    head: ScopeHead | None, computed: SetDigest, anchored: int, keyring: StorageKeyring
) -> None:
    """A whole scope as loaded: its head (None: no head row) and the digest recomputed
    over its rows in the same snapshot, against the anchored head revision (0: none).

    The head must exist when there are rows or an anchored revision, carry a
    valid seal, not be below the anchor, and commit to exactly these rows;
    else ``RollbackDetected`` (or the seal's own error).
    """
    if head is None:
        if computed.count or anchored:
            raise RollbackDetected(None, anchored)  # rows, or an anchor, without their head
        return
    head.verify(keyring)
    if head.revision < anchored:
        raise RollbackDetected(head.revision, anchored)
    check_rows(head, computed)


class ScopeSnapshot(NamedTuple):
    """A whole scope as a backend read it in one snapshot, for :func:`check_snapshot`.

    ``head``: the head row as stored (None: no head row); ``computed``: the
    digest recomputed over every row of the scope (None: the journal has no
    digests yet, an older schema read as it is); ``revision``: the head
    revision (0 without a head); ``rows``: how many rows the scope holds;
    ``anchored``: the head revision the rollback anchor holds (0: none);
    ``live``: the live index of the same rows (None without digests), which
    a store serving the scope keeps once the snapshot passed its check;
    ``written``: every distinct (revision, written_at, seal) of the scope's
    journal rows, each checked by the store (None: a journal older than the
    seals, read as it is).
    """

    head: ScopeHead | None
    computed: SetDigest | None
    revision: int
    rows: int
    anchored: int
    live: RowIndex | None = None
    written: frozenset[tuple[Any, Any, Any]] | None = None


def check_snapshot(snapshot: ScopeSnapshot, keyring: StorageKeyring) -> None:
    """:func:`check_loaded_scope` of a snapshot; without digests, the anchor alone."""
    if snapshot.computed is None:
        if snapshot.revision < snapshot.anchored:
            raise RollbackDetected(snapshot.revision or None, snapshot.anchored)
        return
    check_loaded_scope(snapshot.head, snapshot.computed, snapshot.anchored, keyring)


def check_anchor(
    anchor: Mapping[StorageRecordKey, int], heads: Mapping[str, int], schema_version: int
) -> None:
    """The anchor's check of a journal: every anchored scope head at or above its revision,
    and a journal whose heads carry digests never presenting itself as older.

    ``heads`` maps scope → head revision; ``schema_version`` is the one the
    database had before any migration of this open.
    """
    for anchored_key, anchored in anchor.items():
        if anchored_key in _FORMAT_MARKS:
            if anchored > _FORMAT_MARKS[anchored_key]:
                raise RollbackAnchorInvalid("written by a newer octo-worker")
            if schema_version < anchored:
                raise RollbackDetected(schema_version, anchored)
            continue
        actual = heads.get(anchored_key.name) if anchored_key.namespace == HEAD_NAMESPACE else None
        if actual is None:
            raise RollbackDetected(None, anchored)
        if actual < anchored:
            raise RollbackDetected(actual, anchored)


def anchored_with_digests(anchor: Mapping[StorageRecordKey, int]) -> dict[StorageRecordKey, int]:
    """``anchor`` with :data:`DIGEST_ANCHOR_KEY` and :data:`STORE_HEAD_ANCHOR_KEY` (what a
    store that keeps digests and a store head writes)."""
    return {**anchor, **_FORMAT_MARKS}
