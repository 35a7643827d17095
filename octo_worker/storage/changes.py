"""What a journal commit writes and how a batch of commits is decided, for every backend.

Owns, independent of any database:

* the shape of a prepared change set (:class:`RowWrite`,
  :class:`PendingCommit`) and of a loaded row (:class:`Row`), and the
  validation and rendering of a ``WorkerCommit`` before any I/O
  (:func:`prepare`);
* the scope-token and base-revision checks every entry point makes
  (:func:`check_scope`, :func:`check_base_revision`) and the record key a
  row is sealed under (:func:`record_key`);
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

import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from octo_common.authorizer_state import CompensationIdentity
from octo_common.digest import message_id as frame_message_id
from octo_common.errors import (
    FencingTokenRejected,
    InvalidRevision,
    InvalidToken,
    OctoError,
    OperationJournalScopeMismatch,
    RecordLocationMismatch,
    RollbackDetected,
    SessionReplay,
    WriteConflict,
)
from octo_common.ids import validate_token
from octo_common.limits import MAX_SESSION_REQUEST_IDS
from octo_common.records import StorageRecordKey
from octo_common.runtime.sqlite import copy_error
from octo_common.setdigest import SetDigest
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
    is_message_id,
    outbox_document,
    request_document,
    request_item,
    session_header,
    state_status,
)
from octo_worker.storage.interface import RequestRow, WorkerCommit
from octo_worker.storage.row_index import RowIndex
from octo_worker.storage.scope_head import HEAD_NAMESPACE, DigestChanges, ScopeHead
from octo_worker.storage.store_head import HeadMove

__all__ = [
    "HEAD_NAMESPACE",
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

SESSION_ROWS: Final = frozenset({NS_SESSION, NS_SESSION_OPEN})
# Sessions whose last committed state revision a store instance remembers
# for chained commits (SessionDocuments.link/after); about 100 bytes each.
SESSION_TAIL_LIMIT: Final = 65536


class RowWrite(NamedTuple):
    namespace: str
    item: str
    document: bytes
    # The revision the row must currently have; None: the row must be absent.
    base_revision: int | None
    # Session state rows only (SessionDocuments.link/after): this write's
    # link, and the link of the change set whose revision is its base.
    link: int | None = None
    after: int | None = None
    # Session rows only: the session's state document says ``closed`` (the
    # opening row of a session opened and closed in one commit carries it too).
    closed: bool = False
    # Outbox and request rows only: the session the row belongs to (metadata).
    session: str | None = None


@dataclass(slots=True)
class PendingCommit:
    scope: str
    token: int
    writes: tuple[RowWrite, ...]
    new_sessions: tuple[str, ...]
    outbox_delete: tuple[str, ...]


Outcomes = Sequence[int | OctoError]
"""One outcome per change set of a batch, in order: its new revision, or its error
(never an exception, so nothing is left unretrieved)."""


class Row(NamedTuple):
    item: str
    revision: int
    envelope: bytes


@functools.lru_cache(maxsize=4096)
def record_key(namespace: str, scope: str) -> StorageRecordKey:
    # Record keys validate on construction; rows of a scope reuse the same few.
    return StorageRecordKey(namespace, scope)


_VALID_SCOPES: set[str] = set()


def check_scope(scope: str) -> None:
    """A scope is a token (field ``operation journal scope``); valid ones are remembered."""
    if type(scope) is str and scope in _VALID_SCOPES:
        return
    validate_token("operation journal scope", scope)
    if len(_VALID_SCOPES) >= 4096:
        _VALID_SCOPES.clear()
    _VALID_SCOPES.add(scope)


def check_base_revision(value: object) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidRevision()


def prepare(scope: str, changes: WorkerCommit) -> tuple[tuple[RowWrite, ...], tuple[str, ...]]:
    """Validate a change set and render its documents, before any I/O."""
    writes: list[RowWrite] = []
    new_sessions: list[str] = []
    journal = changes.journal
    if journal is not None:
        if journal.scope != scope:
            raise OperationJournalScopeMismatch(scope, journal.scope)
        for key, change in journal.rows.items():
            if change.record.operation_key != key:
                raise RecordLocationMismatch(key, change.record.operation_key)
            check_base_revision(change.base_revision)
            document = change.record.to_row_json(scope)
            writes.append(RowWrite(NS_JOURNAL, key, document, change.base_revision))
    for session_id, documents in changes.sessions.items():
        validate_token("session id", session_id)
        check_base_revision(documents.base_revision)
        closed = state_status(documents.state, scope, session_id) == "closed"
        link, after = documents.link, documents.after
        for value in (link, after):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError("a commit link is a positive int")
        writes.extend(_request_writes(scope, session_id, documents.requests))
        if after is not None:
            if documents.base_revision is not None or documents.opening is not None:
                raise ValueError("a chained commit names neither a base revision nor an opening")
            writes.append(
                RowWrite(NS_SESSION, session_id, documents.state, None, link, after, closed)
            )
            continue
        writes.append(
            RowWrite(
                NS_SESSION, session_id, documents.state, documents.base_revision, link, None, closed
            )
        )
        if documents.base_revision is None:
            if documents.opening is None:
                raise ValueError("a new session must supply its opening document")
            session_header(documents.opening, scope, session_id)
            writes.append(
                RowWrite(NS_SESSION_OPEN, session_id, documents.opening, None, closed=closed)
            )
            new_sessions.append(session_id)
        elif documents.opening is not None:
            raise ValueError("a session's opening document is written once, when it opens")
    for entry in changes.outbox_insert:
        validate_token("session id", entry.session_id)
        expected_id = frame_message_id(entry.frame)
        if entry.message_id != expected_id:
            raise RecordLocationMismatch(expected_id, entry.message_id)
        document = outbox_document(
            scope, entry.session_id, entry.reply_to, entry.correlation_id, entry.frame
        )
        writes.append(
            RowWrite(NS_OUTBOX, entry.message_id, document, None, session=entry.session_id)
        )
    for message in changes.outbox_delete:
        if not is_message_id(message):
            raise InvalidToken("message id", message)
    return tuple(writes), tuple(new_sessions)


def _request_writes(scope: str, session_id: str, requests: Sequence[RequestRow]) -> list[RowWrite]:
    """One inserted request row per retained request id: never written before
    (absent base), so a row already there refuses the change set."""
    writes: list[RowWrite] = []
    for position, request_id, compensation in requests:
        if type(position) is not int or not 0 <= position < MAX_SESSION_REQUEST_IDS:
            raise ValueError("a request row's position is an int in [0, 1024)")
        validate_token("request id", request_id)
        if compensation is not None and not isinstance(compensation, CompensationIdentity):
            raise TypeError("a request row's compensation is a CompensationIdentity")
        writes.append(
            RowWrite(
                NS_SESSION_REQUEST,
                request_item(session_id, request_id),
                request_document(scope, session_id, request_id, position, compensation),
                None,
                session=session_id,
            )
        )
    return writes


def closed_sessions(writes: Sequence[RowWrite]) -> list[str]:
    """The sessions a change set closes (their opening rows get the closed mark too)."""
    return [write.item for write in writes if write.closed and write.namespace == NS_SESSION]


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
        since the scope was loaded)."""
        scope = pending.scope
        index = self._live.get(scope)
        if index is None:
            return
        moved = self._moved
        for namespace, key, old, _ in changes:
            name = (scope, namespace, key)
            if name in moved:
                if moved[name] != old:
                    raise RollbackDetected(old, self._heads[scope].revision)
            elif not index.expect(namespace, key, old):
                raise RollbackDetected(old, self._heads[scope].revision)

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
