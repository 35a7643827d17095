"""What a worker session and the daemon need of a journal store.

Owns the commit value types (:class:`WorkerCommit`, :class:`SessionDocuments`,
:class:`OutboxEntry`), what a store loads (:class:`PersistedSession`), the
lease (:class:`WorkerJournalLease`), the operator reports any backend returns
(:class:`PruneReport`, :class:`ResealReport`, :class:`ScopeCheck`,
:class:`ScopeMetadata`) and the
protocols :class:`WorkerSessionStore` (what a session calls) and
:class:`WorkerJournalStore` (what the daemon calls besides). A backend
implements the protocols; a session and the daemon depend on nothing else.

It must never import a backend, do I/O, or hold a protocol rule: values
and signatures only. No value here ever shows a document, a frame or a
lease token in its repr.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, NamedTuple, NoReturn, Protocol

import msgspec

from octo_common.authorizer_state import CompensationIdentity
from octo_common.errors import InvalidJournalLease
from octo_worker.journal import JournalChangeset, WorkerOperationRecord

__all__ = [
    "LoadedScope",
    "OutboxEntry",
    "PersistedSession",
    "PruneReport",
    "RequestRow",
    "ResealReport",
    "ScopeCheck",
    "ScopeMetadata",
    "SessionDocuments",
    "WorkerCommit",
    "WorkerJournalLease",
    "WorkerJournalStore",
    "WorkerSessionStore",
    "issue_lease",
    "next_commit_link",
]


class WorkerJournalLease:
    """A scope's fencing token.

    Only a journal store's ``reserve_fence`` makes one (through
    :func:`issue_lease`); it is frozen, compares by value, cannot be pickled,
    and its repr is redacted. Besides its public ``token`` it remembers
    (privately) the scope it was reserved for, so a lease handed to a commit
    of another scope is refused even when the two fences happen to be equal.
    """

    __slots__ = ("_scope", "_token")
    _scope: str
    _token: int

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a WorkerJournalLease comes only from SqliteJournalStore.reserve_fence")

    @classmethod
    def _issue(cls, scope: str, token: int) -> WorkerJournalLease:
        if type(token) is not int or token < 1:
            raise InvalidJournalLease()
        lease = object.__new__(cls)
        object.__setattr__(lease, "_scope", scope)
        object.__setattr__(lease, "_token", token)
        return lease

    @property
    def token(self) -> int:
        """The fence this lease was reserved as (>= 1)."""
        return self._token

    def is_for(self, scope: str) -> bool:
        """Whether this lease was reserved for ``scope`` (a store checks it at every commit)."""
        return self._scope == scope

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("WorkerJournalLease is frozen")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("WorkerJournalLease is frozen")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkerJournalLease):
            return NotImplemented
        return (self._scope, self._token) == (other._scope, other._token)

    def __hash__(self) -> int:
        return hash((WorkerJournalLease, self._scope, self._token))

    def __repr__(self) -> str:
        return "WorkerJournalLease([redacted])"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("WorkerJournalLease cannot be pickled")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("WorkerJournalLease cannot be pickled")

    def __copy__(self) -> NoReturn:
        raise TypeError("WorkerJournalLease cannot be copied")

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise TypeError("WorkerJournalLease cannot be copied")


def issue_lease(scope: str, token: int) -> WorkerJournalLease:
    """The lease for a fence a store has just reserved (only stores call this).

    A token that is not an int >= 1 raises ``InvalidJournalLease``.
    """
    return WorkerJournalLease._issue(scope, token)


class RequestRow(NamedTuple):
    """One retained request id of a session: its position in retention order and
    the compensation identity it admitted (None: none)."""

    position: int
    request_id: str
    compensation: CompensationIdentity | None = None


class SessionDocuments(msgspec.Struct, frozen=True):
    """A session's documents for one commit.

    ``state``/``opening`` are compact JSON written by
    :mod:`octo_worker.storage.documents`; both carry their ``format_version``,
    ``scope`` and ``session_id`` (the state also ``status``); ``requests``
    become request rows rendered by the store.
    ``base_revision`` is the revision the state row was last written at;
    None means a new session, which must supply ``opening``.

    Pipelined commits (only with a store whose ``chains_session_commits`` is
    True): ``link`` is a number naming this commit, unique in the process
    (``next_commit_link()``); ``after`` (with ``base_revision`` None and no
    ``opening``) names the base revision another way: the revision that the
    change set whose ``link`` is ``after`` wrote, through this store
    instance, that change set being still queued or in flight. A session
    submits its next commit this way without waiting for the previous one's
    fsync, and the two share a transaction. The row's revision is still
    compared by the store; if that change set failed, never reached the
    store, or the row was written since, the chained one fails with
    ``WriteConflict``.
    """

    state: bytes
    opening: bytes | None = None
    base_revision: int | None = None
    link: int | None = None
    after: int | None = None
    # Each retained request id this commit is the first to persist: one
    # request row each, inserted (never rewritten).
    requests: tuple[RequestRow, ...] = ()

    def __repr__(self) -> str:
        return (
            f"SessionDocuments(base_revision={self.base_revision!r}, "
            f"link={self.link!r}, after={self.after!r})"
        )


class PersistedSession(msgspec.Struct, frozen=True):
    """A session as loaded: ``revision`` is its state row's revision; ``requests``
    the documents of its request rows (authenticated, in no particular order)."""

    session_id: str
    status: str
    opening: bytes
    state: bytes
    revision: int
    requests: tuple[bytes, ...] = ()

    def __repr__(self) -> str:
        return (
            f"PersistedSession(session_id={self.session_id!r}, status={self.status!r}, "
            f"revision={self.revision!r})"
        )


class OutboxEntry(msgspec.Struct, frozen=True):
    """A committed reply frame waiting for its publish confirmation.

    ``message_id`` is the hex BLAKE3 of ``frame``. Pass ``revision=0`` on
    insert; loads return the revision of the commit that inserted it.
    """

    message_id: str
    session_id: str
    reply_to: str
    correlation_id: str | None
    frame: bytes
    revision: int = 0

    def __repr__(self) -> str:
        return (
            f"OutboxEntry(message_id={self.message_id!r}, session_id={self.session_id!r}, "
            f"revision={self.revision!r})"
        )


class WorkerCommit(msgspec.Struct, frozen=True):
    """The ``changes`` argument of a store's ``commit``."""

    journal: JournalChangeset | None = None
    sessions: dict[str, SessionDocuments] = msgspec.field(default_factory=dict)
    outbox_insert: list[OutboxEntry] = msgspec.field(default_factory=list)
    outbox_delete: list[str] = msgspec.field(default_factory=list)

    def __repr__(self) -> str:
        rows = 0 if self.journal is None else len(self.journal.rows)
        return (
            f"WorkerCommit(journal_rows={rows}, sessions={sorted(self.sessions)!r}, "
            f"outbox_insert={len(self.outbox_insert)}, outbox_delete={len(self.outbox_delete)})"
        )


_LINKS = itertools.count(1)


def next_commit_link() -> int:
    """A number naming one session commit, never repeated in this process."""
    return next(_LINKS)


class ResealReport(NamedTuple):
    """What ``reseal`` did: rows re-sealed, rows already under the active keys."""

    resealed: int
    current: int


class PruneReport(NamedTuple):
    """What ``prune`` did: rows removed, candidates kept (not terminal)."""

    removed: int
    kept: int


class LoadedScope(NamedTuple):
    """What loading a scope reads (``load_scope``): its outbox rows, the sessions
    those rows belong to, and the sessions to restore (each already read back)."""

    outbox: list[OutboxEntry]
    in_outbox: set[str]
    sessions: dict[str, PersistedSession]


class ScopeCheck(NamedTuple):
    """What loading a whole scope against its sealed head found (``verify_scope``).

    ``revision``: the head revision; ``rows``: how many rows the scope
    holds (every digested namespace); ``digests``: False only for a journal
    read as it is before its heads got digests (an older schema beside a
    daemon not restarted yet), which then had the anchor check alone.
    """

    revision: int
    rows: int
    digests: bool


class ScopeMetadata(NamedTuple):
    """What a store keeps beside a scope's sealed rows, for operator views.

    ``fence``: the head's fence (how many times an owner reserved the scope).
    ``written_at``: journal item (the operation key's keyed hash, see
    ``journal_items``) -> when its row was last written (Unix time; empty on a
    schema-1 journal); :meth:`written` finds a key's by its items.
    ``closed_sessions``: sessions the store marked closed (0 before schema 3).
    ``written_at`` and ``closed_sessions`` are unauthenticated metadata: good
    for display, never for a decision.
    """

    fence: int
    written_at: dict[str, float]
    closed_sessions: int

    def written(self, items: Iterable[str]) -> float | None:
        """When the row stored under one of ``items`` (a store's ``journal_items``
        of one key) was last written; None without one."""
        for item in items:
            found = self.written_at.get(item)
            if found is not None:
                return found
        return None


class WorkerSessionStore(Protocol):
    """What a :class:`~octo_worker.session.WorkerSession` calls.

    A store MAY also have ``chains_session_commits = True``: it then takes
    chained session commits (:class:`SessionDocuments` ``link``/``after``),
    handed to ``commit`` in call order.
    """

    async def load_records(
        self, scope: str, keys: list[str]
    ) -> dict[str, tuple[WorkerOperationRecord, int] | None]: ...

    async def head_revision(self, scope: str) -> int: ...

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int: ...


class WorkerJournalStore(WorkerSessionStore, Protocol):
    """What the daemon calls besides: start-up, reload, routing, stop."""

    async def reserve_fence(self, scope: str) -> WorkerJournalLease:
        """Reserve the next fence, after checking the whole scope against its sealed head
        (``verify_scope``): a scope whose rows are not its head's is never served."""
        ...

    async def verify_scope(self, scope: str) -> ScopeCheck: ...

    async def load_scope(self, scope: str, *, every_session: bool = False) -> LoadedScope:
        """The outbox and the sessions to restore, each read back as a restore reads it:
        the one path of a load, ``check`` and ``journal verify``."""
        ...

    async def load_sessions(
        self, scope: str, *, skip_closed_except: Iterable[str] | None = None
    ) -> dict[str, PersistedSession]: ...

    async def load_outbox(
        self, scope: str, *, session_id: str | None = None
    ) -> list[OutboxEntry]: ...

    async def session_status(self, scope: str, session_id: str) -> str | None: ...

    async def mark_closed(self, scope: str, session_ids: Iterable[str]) -> None: ...

    async def close(self) -> None: ...
