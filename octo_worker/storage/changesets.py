"""What a journal commit writes, for every backend: change sets prepared before any I/O.

Owns the shape of a prepared change set (:class:`RowWrite`,
:class:`PendingCommit`, and the :data:`Outcomes` of a batch of them) and of
a loaded row (:class:`Row`), the validation and rendering of a
``WorkerCommit`` (:func:`prepare`), the scope-token and base-revision checks
every entry point makes (:func:`check_scope`, :func:`check_base_revision`),
the record key a row is sealed under (:func:`record_key`) and the sessions a
change set closes (:func:`closed_sessions`). How a batch of change sets is
decided in one transaction is :mod:`octo_worker.storage.changes`.

Pure: no I/O, no key. It must never decide an outcome.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from octo_common.authorizer_state import CompensationIdentity
from octo_common.digest import message_id as frame_message_id
from octo_common.errors import (
    InvalidRevision,
    InvalidToken,
    OctoError,
    OperationJournalScopeMismatch,
    RecordLocationMismatch,
)
from octo_common.ids import validate_token
from octo_common.limits import MAX_SESSION_REQUEST_IDS
from octo_common.records import StorageRecordKey
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

__all__ = [
    "SESSION_ROWS",
    "Outcomes",
    "PendingCommit",
    "Row",
    "RowWrite",
    "check_base_revision",
    "check_scope",
    "closed_sessions",
    "prepare",
    "record_key",
]

SESSION_ROWS: Final = frozenset({NS_SESSION, NS_SESSION_OPEN})


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
