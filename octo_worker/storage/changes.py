"""How a batch of journal commits is decided, for every backend.

What a change set writes, prepared before any I/O, is
:mod:`octo_worker.storage.changesets` (its names are re-exported here).
This module owns, independent of any database:

* the decisions of one group-commit transaction (:class:`CommitBatch`):
  the fence and head-revision checks against the head as the transaction sees it
  (its seal verified before anything is written on it), the new revision (head
  + 1, with its ceiling), the error a refused row write gets (a base revision
  that is not the row's:
  ``WriteConflict``, or ``SessionReplay`` for a new session), the chained
  session commits resolved to the revision their predecessor wrote
  (:class:`SessionTails`), each scope's row digest moved by the rows each
  change set wrote or deleted (``scope_head``), the heads to write back,
  every caller's outcome, and what the store instance keeps once the
  transaction committed (baselines, tails) or failed (nothing).

A backend runs the statements (reading a head, writing a row under its
base revision, reading a row's current revision after a refusal) and tells
:class:`CommitBatch` what happened; it never decides an outcome itself.

It must never do I/O, hold a key, or let a refused change set leave a
trace in what the store keeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from octo_common.errors import (
    FencingTokenRejected,
    OctoError,
    RollbackDetected,
    SessionReplay,
    WriteConflict,
)
from octo_common.runtime.sqlite import copy_error
from octo_common.setdigest import SetDigest
from octo_worker.storage.changesets import (
    SESSION_ROWS,
    Outcomes,
    PendingCommit,
    Row,
    RowWrite,
    check_base_revision,
    check_scope,
    closed_sessions,
    prepare,
    record_key,
)
from octo_worker.storage.documents import (
    NS_OUTBOX,
    NS_SESSION,
)
from octo_worker.storage.row_index import RowIndex
from octo_worker.storage.scope_head import HEAD_NAMESPACE, DigestChanges, ScopeHead
from octo_worker.storage.store_head import HeadMove

__all__ = [
    "HEAD_NAMESPACE",
    "Outcomes",
    "closed_sessions",
    "SESSION_ROWS",
    "SESSION_TAIL_LIMIT",
    "CommitBatch",
    "PendingCommit",
    "Row",
    "RowWrite",
    "SessionTails",
    "check_base_revision",
    "check_scope",
    "prepare",
    "record_key",
]

# Sessions whose last committed state revision a store instance remembers
# for chained commits (SessionDocuments.link/after); about 100 bytes each.
SESSION_TAIL_LIMIT: Final = 65536


# Chained session commits --------------------------------------------------------------

_Tail = tuple[int, int]  # (link, revision) of the last change set that wrote a state row
_Name = tuple[str, str]  # (scope, session id)


class SessionTails:
    """What a store instance remembers of its last write to each session's state row.

    The base of a chained commit (``SessionDocuments.after``): the revision
    that the change set named by ``after`` wrote, through this instance.
    Bounded (the oldest is forgotten first); a forgotten or failed tail only
    makes a chained commit fail closed with ``WriteConflict``.
    """

    def __init__(self, limit: int = SESSION_TAIL_LIMIT) -> None:
        self._known: dict[_Name, _Tail] = {}
        self._limit = limit

    def get(self, name: _Name) -> _Tail | None:
        return self._known.get(name)

    def fold(self, tails: dict[_Name, _Tail | None]) -> None:
        """Take what a committed transaction wrote (None: nothing to chain on)."""
        known = self._known
        for name, tail in tails.items():
            known.pop(name, None)  # re-inserted last: the bound drops the oldest
            if tail is not None:
                known[name] = tail
        excess = len(known) - self._limit
        if excess > 0:
            for name in list(itertools.islice(known, excess)):
                del known[name]

    def forget(self, names: dict[_Name, _Tail | None]) -> None:
        """Drop what a failed transaction touched: nothing may chain on it."""
        for name in names:
            self._known.pop(name, None)

    def clear(self) -> None:
        self._known.clear()


# One group-commit transaction ----------------------------------------------------------


class CommitBatch:
    """The decisions of one transaction over a batch of change sets (fence, head, rows, revision).

    A backend, inside its transaction, for each change set in order:

    1. :meth:`needs_head` / :meth:`see_head`: the scope's head as the
       transaction sees it (None: no head row), read once per scope;
    2. :meth:`check`: steps 1-2, the head's seal verified (once per scope
       and transaction, through ``verify_head``, which holds the key), and
       chain resolution; returns the writes with their bases (a broken
       chain keeps ``after`` set: the backend reads the row's current
       revision and reports the refusal) and the new revision, or None when
       the revision would pass ``ceiling`` (the backend then reports the
       first refused write, if any, else :meth:`exhausted`);
    3. its rows written, each told to a :class:`DigestChanges` (old and new
       revision, None for absent), then :meth:`check_live` once the database
       confirmed the old revisions, and :meth:`moved_digest` (still inside
       the change set: a digest that cannot move refuses it), then
       :meth:`committed_one` or :meth:`refused` (with the error from
       :meth:`conflict`), then the next change set;

    then writes :meth:`advanced_heads` (sealed by the backend) into the
    heads, commits, and calls :meth:`finish` (or :meth:`fail_all` when the
    transaction failed).
    """

    def __init__(
        self,
        batch: Sequence[PendingCommit],
        baselines: dict[str, int],
        tails: SessionTails,
        ceiling: int,
        *,
        verify_head: Callable[[ScopeHead], None],
        live: Mapping[str, RowIndex] | None = None,
    ) -> None:
        self.batch = batch
        # The live index of each loaded scope: what a change set replaces must
        # be what the index holds (rows written by earlier change sets of this
        # batch first), and the index moves once the transaction committed.
        self._live = {} if live is None else live
        self._moved: dict[tuple[str, str, str], int | None] = {}
        self._last: tuple[PendingCommit, DigestChanges] | None = None
        self._baselines = baselines
        self._tails = tails
        self._ceiling = ceiling
        self._verify_head = verify_head
        self._heads: dict[str, ScopeHead] = {}
        self._seen: dict[str, int] = {}  # each scope head's revision as read
        self._unverified: set[str] = set()
        self.advanced: dict[str, int] = {}
        self._written: dict[_Name, _Tail | None] = {}
        self.outcomes: list[int | OctoError] = []

    def needs_head(self, scope: str) -> bool:
        return scope not in self._heads

    def see_head(self, scope: str, head: ScopeHead | None) -> None:
        """The head read in this transaction (None: no head row, so fence 0: refused)."""
        if head is None:
            self._heads[scope] = ScopeHead.empty(scope)
        else:
            self._heads[scope] = head
            self._seen[scope] = head.revision
            self._unverified.add(scope)

    def head_revision(self, scope: str) -> int:
        return self._heads[scope].revision

    def check(self, pending: PendingCommit) -> tuple[tuple[RowWrite, ...], int | None]:
        """Steps 1-2, the head authenticated, chains resolved, and the new revision
        (None: past the ceiling)."""
        scope = pending.scope
        head = self._heads[scope]
        if head.fence != pending.token:  # step 1
            raise FencingTokenRejected(head.fence, pending.token)
        baseline = self.advanced.get(scope, self._baselines.get(scope))
        if baseline != head.revision:  # step 2
            raise WriteConflict(baseline, head.revision, head.revision)
        if scope in self._unverified:
            self._verify_head(head)  # what this change set moves must be authentic
            self._unverified.discard(scope)
        writes = pending.writes
        if any(write.after is not None for write in writes):
            writes = tuple(self._chain(scope, write) for write in writes)
        revision = head.revision + 1 if head.revision < self._ceiling else None
        return writes, revision

    def _chain(self, scope: str, write: RowWrite) -> RowWrite:
        if write.after is None:
            return write
        name = (scope, write.item)
        tail = self._written[name] if name in self._written else self._tails.get(name)
        if tail is None or tail[0] != write.after:
            # That change set failed, never came here, or was written over
            # since: ``after`` stays set and the write is refused.
            return write
        return write._replace(base_revision=tail[1], after=None)

    def conflict(
        self, pending: PendingCommit, write: RowWrite, actual: int | None
    ) -> WriteConflict | SessionReplay:
        """The refusal of ``write``, whose row is at ``actual`` (None: absent)."""
        if (
            write.base_revision is None
            and write.after is None
            and write.namespace in SESSION_ROWS
            and write.item in pending.new_sessions
        ):
            return SessionReplay(write.item)
        return WriteConflict(write.base_revision, actual, self._heads[pending.scope].revision)

    def check_live(self, pending: PendingCommit, changes: DigestChanges) -> None:
        """What ``pending`` replaced and deleted, as the database confirmed it (its
        compare-and-swap passed), against the scope's live index (rows written by
        earlier change sets of this batch first): ``RollbackDetected`` when a row
        is not at the revision the index holds (deleted, put back or copied in
        since the scope was loaded), or an outbox row it releases that the index
        holds was not there to delete (deleted beside the store)."""
        scope = pending.scope
        index = self._live.get(scope)
        if index is None:
            return
        moved = self._moved
        deleted: set[str] = set()
        for namespace, key, old, new in changes:
            name = (scope, namespace, key)
            if namespace == NS_OUTBOX and new is None:
                deleted.add(key)
            if name in moved:
                if moved[name] != old:
                    raise RollbackDetected(old, self._heads[scope].revision)
            elif not index.expect(namespace, key, old):
                raise RollbackDetected(old, self._heads[scope].revision)
        for message in pending.outbox_delete:
            name = (scope, NS_OUTBOX, message)
            held = moved[name] if name in moved else index.get(NS_OUTBOX, message)
            if message not in deleted and held is not None:
                raise RollbackDetected(held, self._heads[scope].revision)

    def moved_digest(self, pending: PendingCommit, changes: DigestChanges) -> SetDigest:
        """The scope's digest moved by what ``pending`` wrote and deleted (O(rows it
        changed)); ``RollbackDetected`` when the rows are not the head's. The
        changes are what :meth:`committed_one` moves the live index by."""
        digest = changes.applied_to(self._heads[pending.scope])
        self._last = (pending, changes)
        return digest

    def committed_one(self, pending: PendingCommit, revision: int, digest: SetDigest) -> None:
        last = self._last
        if last is not None and last[0] is pending:
            scope = pending.scope
            for namespace, key, _, new in last[1]:
                self._moved[(scope, namespace, key)] = new
        self._last = None
        self._note_tails(pending, revision)
        scope = pending.scope
        before = self._heads[scope]
        self._heads[scope] = ScopeHead(scope, revision, before.fence, digest)
        self.advanced[scope] = revision
        self.outcomes.append(revision)

    def refused(self, pending: PendingCommit, error: OctoError) -> None:
        self._last = None
        self._note_tails(pending, None)
        self.outcomes.append(error)

    def advanced_heads(self) -> list[ScopeHead]:
        """The heads this transaction moved, unsealed: the backend seals and writes them."""
        return [self._heads[scope] for scope in self.advanced]

    def head_moves(self) -> list[HeadMove]:
        """Each scope head this transaction moved, as (scope, fence, revision) before
        and after: what the store head moves by (``store_head.moved``)."""
        moves: list[HeadMove] = []
        for scope, revision in self.advanced.items():
            fence = self._heads[scope].fence
            moves.append(((scope, fence, self._seen[scope]), (scope, fence, revision)))
        return moves

    def _note_tails(self, pending: PendingCommit, revision: int | None) -> None:
        for write in pending.writes:
            if write.namespace == NS_SESSION:
                link = write.link
                name = (pending.scope, write.item)
                self._written[name] = None if link is None or revision is None else (link, revision)

    def finish(self) -> list[int | OctoError]:
        """The transaction committed: baselines and tails move; every caller's outcome."""
        self._baselines.update(self.advanced)
        self._tails.fold(self._written)
        self._move_live()
        return self.outcomes

    def _move_live(self) -> None:
        """The live indexes moved by the committed change sets."""
        by_scope: dict[str, list[tuple[str, str, int | None]]] = {}
        for (scope, namespace, key), new in self._moved.items():
            by_scope.setdefault(scope, []).append((namespace, key, new))
        for scope, moves in by_scope.items():
            index = self._live.get(scope)
            if index is not None:
                index.apply(moves, self.advanced.get(scope, 0))

    def fail_all(self, failure: OctoError, *, committed: bool = False) -> list[int | OctoError]:
        """The transaction (or what follows its COMMIT) failed: every change set fails.

        ``committed``: the database holds the transaction all the same (a
        failure after COMMIT): the baselines still move, nothing may chain on it.
        """
        if committed:
            self._baselines.update(self.advanced)
            self._move_live()
        self._tails.forget(self._written)
        failed: list[int | OctoError] = [
            o if isinstance(o, OctoError) else copy_error(failure) for o in self.outcomes
        ]
        return failed + [copy_error(failure) for _ in range(len(self.batch) - len(failed))]
