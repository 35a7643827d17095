"""The documents a journal store keeps for sessions and replies.

Owns the row namespaces of a scope, the session **opening** document
(written once), the session **state** document (rewritten by every commit
that touches the session; fixed size: its retained request ids are a count
and a completion bitmap), the session **request** documents (one per
retained request id, with the compensation identity it admitted if any,
inserted once by the commit that first carries the id, never rewritten),
the **outbox** document (a committed reply frame), and how each is written
and read back:

* the session side builds documents with :func:`opening_document` and
  :func:`state_document`, and reads a persisted session back with
  :func:`read_session` (strict: unknown keys, duplicates, wrong types, a
  document not in its written form, a wrong location all fail closed; a
  request row missing or one the state does not count is
  ``RollbackDetected``). A state document of format 1 (every retained id
  inline, as written before the request rows existed) still reads; the
  session's next commit writes format 2 and the rows;
* a store renders request documents (:func:`request_document`), reads only a
  session document's location and status (:func:`session_header`,
  :func:`state_status`) and a request document's location
  (:func:`request_location`), and writes and reads outbox documents
  (:func:`outbox_document`, :func:`read_outbox`).

It must never hold a session key or a scope key in a document, do I/O, or
decide anything beyond a document's own validity.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

import msgspec

from octo_common.authorizer import (
    AuthorizerCheckpoint,
    AuthorizerState,
    CompensationIdentity,
    RetainedRequestId,
)
from octo_common.codec import decode_struct, encode_struct
from octo_common.digest import message_id as frame_message_id
from octo_common.errors import RecordLocationMismatch, RollbackDetected, SerializationError
from octo_common.frames import AuthenticatorState
from octo_common.grants import CapabilityManifest
from octo_common.ids import is_token, parse_key_nonce_hex
from octo_common.limits import (
    MAX_SESSION_REQUEST_IDS,
    PAYLOAD_CODEC,
    REPLAY_WINDOW_SIZE,
    WORKER_SESSION_FORMAT_VERSION,
)
from octo_worker.storage.interface import OutboxEntry, PersistedSession

__all__ = [
    "NS_JOURNAL",
    "NS_OUTBOX",
    "NS_SESSION",
    "NS_SESSION_OPEN",
    "NS_SESSION_REQUEST",
    "SESSION_STATUSES",
    "OpeningDocument",
    "OutboxDocument",
    "SessionStatus",
    "StateDocument",
    "StoredSession",
    "is_message_id",
    "opening_document",
    "outbox_document",
    "pruned_document",
    "read_outbox",
    "read_session",
    "request_document",
    "request_item",
    "request_location",
    "session_header",
    "state_document",
    "state_status",
]

# Row namespaces of a scope; the scope head lives under NS_JOURNAL.
NS_JOURNAL: Final = "worker-journal"
NS_SESSION: Final = "worker-session"
NS_SESSION_OPEN: Final = "worker-session-open"
NS_OUTBOX: Final = "worker-outbox"
# One row per retained request id of a session; item: request_item(...).
NS_SESSION_REQUEST: Final = "worker-session-request"

SessionStatus: TypeAlias = Literal["open", "closed", "poisoned"]
SESSION_STATUSES: Final = frozenset({"open", "closed", "poisoned"})

_OUTBOX_FORMAT_VERSION: Final = 1
_SEEN_HEX_CHARS: Final = REPLAY_WINDOW_SIZE // 4
# State documents: format 1 holds every retained request id inline; format 2
# holds their count and completion bitmap, the ids being request rows.
_STATE_FORMATS: Final = frozenset({WORKER_SESSION_FORMAT_VERSION, 2})
_STATE_FORMAT: Final = 2
_COMPLETED_HEX_CHARS: Final = MAX_SESSION_REQUEST_IDS // 4
_MESSAGE_ID: Final = re.compile(r"[0-9a-f]{64}")


# Session documents -------------------------------------------------------


class OpeningDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Written once, when the session opens; never contains a key (the nonce is not secret).

    ``payload_codec``: the codec the open named (absent: frames in the clear).
    """

    format_version: int
    scope: str
    session_id: str
    key_nonce: str
    reply_to: str
    manifest: CapabilityManifest
    payload_codec: str | None = None


class AuthenticatorDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    next_outgoing: int
    inbound_highest: int
    inbound_seen: str  # 256 lowercase hex: the 1024-bit window, big-endian


class ReconciliationDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    total: int
    by_tool: dict[str, int]


class StateDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Format 1, read only: every retained request id inline."""

    format_version: int
    scope: str
    session_id: str
    status: SessionStatus
    authenticator: AuthenticatorDocument
    authorizer: AuthorizerState
    reconciliations: ReconciliationDocument


class AuthorizerDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    calls_by_tool: dict[str, int]
    compensations_by_tool: dict[str, int]
    # Only identities no request row links to (a session first written in
    # format 1); every other identity is in the row of the id that admitted it.
    compensation_identities: tuple[CompensationIdentity, ...]
    retained: int  # request rows of the session: positions 0 .. retained - 1
    completed: str  # 256 lowercase hex: bit i set = position i completed, big-endian


class StateDocumentV2(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Format 2, rewritten by every commit that touches the session; fixed size
    whatever the number of retained request ids."""

    format_version: int
    scope: str
    session_id: str
    status: SessionStatus
    authenticator: AuthenticatorDocument
    authorizer: AuthorizerDocument
    reconciliations: ReconciliationDocument


class RequestDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One retained request id of a session, at its position in retention order,
    with the compensation identity it admitted (absent: none)."""

    format_version: int
    scope: str
    session_id: str
    request_id: str
    position: int
    compensation: CompensationIdentity | None = None


def opening_document(
    scope: str,
    session_id: str,
    key_nonce: bytes,
    reply_to: str,
    manifest: CapabilityManifest,
    payload_codec: str | None = None,
) -> bytes:
    """The opening document of a new session, in its written form."""
    return encode_struct(
        OpeningDocument(
            format_version=WORKER_SESSION_FORMAT_VERSION,
            scope=scope,
            session_id=session_id,
            key_nonce=key_nonce.hex(),
            reply_to=reply_to,
            manifest=manifest,
            payload_codec=payload_codec,
        )
    )


def state_document(
    scope: str,
    session_id: str,
    status: SessionStatus,
    authenticator: AuthenticatorState,
    authorizer: AuthorizerCheckpoint,
    reconciliations_total: int,
    reconciliations_by_tool: Mapping[str, int],
) -> bytes:
    """The state document one commit writes, in its written form (format 2, counters
    sorted by tool); the commit also inserts the request rows it is the first to count."""
    return encode_struct(
        StateDocumentV2(
            format_version=_STATE_FORMAT,
            scope=scope,
            session_id=session_id,
            status=status,
            authenticator=AuthenticatorDocument(
                next_outgoing=authenticator.next_outgoing,
                inbound_highest=authenticator.inbound_highest,
                inbound_seen=f"{authenticator.inbound_seen:0{_SEEN_HEX_CHARS}x}",
            ),
            authorizer=AuthorizerDocument(
                calls_by_tool=authorizer.calls_by_tool,
                compensations_by_tool=authorizer.compensations_by_tool,
                compensation_identities=authorizer.compensation_identities,
                retained=authorizer.retained,
                completed=f"{authorizer.completed:0{_COMPLETED_HEX_CHARS}x}",
            ),
            reconciliations=ReconciliationDocument(
                total=reconciliations_total,
                by_tool=dict(sorted(reconciliations_by_tool.items())),
            ),
        )
    )


def pruned_document(scope: str, operation_key: str) -> bytes:
    """What ``prune`` leaves in place of a journal row: the key remembered, its outcome
    gone. Compared byte for byte (scope and key are tokens: nothing to escape); the
    row keeps its revision, sealed like any row, so the scope's digest does not move."""
    return (
        f'{{"format_version":1,"pruned":true,"scope":"{scope}","operation_key":"{operation_key}"}}'
    ).encode("ascii")


class _RecordKey(msgspec.Struct, frozen=True):
    operation_key: str


class _JournalRowKey(msgspec.Struct, frozen=True):
    """The one field of a journal row document (kept or pruned) that names its key."""

    operation_key: str | None = None
    record: _RecordKey | None = None


def journal_row_key(document: bytes) -> str:
    """The operation key a journal row's document names (a kept row's record, or what
    ``prune`` left); ``SerializationError`` when it names none. The caller still
    checks the whole document against that key."""
    try:
        found = msgspec.json.decode(document, type=_JournalRowKey)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise SerializationError("journal row document") from None
    key = found.record.operation_key if found.record is not None else found.operation_key
    if key is None or not is_token(key):
        raise SerializationError("journal row document")
    return key


def request_item(session_id: str, request_id: str) -> str:
    """The item of a request row: ``session_id/request_id`` (``/`` is in no token)."""
    return f"{session_id}/{request_id}"


def request_document(
    scope: str,
    session_id: str,
    request_id: str,
    position: int,
    compensation: CompensationIdentity | None = None,
) -> bytes:
    """The request document of one retained request id, in its written form."""
    return encode_struct(
        RequestDocument(
            WORKER_SESSION_FORMAT_VERSION, scope, session_id, request_id, position, compensation
        )
    )


def request_location(document: bytes, scope: str, item: str) -> str:
    """The session a request document stored under ``item`` belongs to.

    Strict decode, format version 1, ``scope`` and ``item`` naming exactly
    the document's session and request id (``RecordLocationMismatch``):
    the item and the row's session column are not authenticated, the
    document is.
    """
    request = decode_struct(document, RequestDocument)
    if request.format_version != WORKER_SESSION_FORMAT_VERSION:
        raise SerializationError("request document format_version must be 1")
    if request.scope != scope:
        raise RecordLocationMismatch(scope, request.scope)
    expected = request_item(request.session_id, request.request_id)
    if expected != item:
        raise RecordLocationMismatch(item, expected)
    return request.session_id


@dataclass(frozen=True, slots=True)
class StoredSession:
    """A persisted session's documents, read back and checked (see :func:`read_session`).

    ``request_rows``: how many request rows the store holds for it (0 for a
    state of format 1, whose ids are inline: the next commit writes them all);
    ``admitted``: request id -> the compensation identity its row says it
    admitted (the others in ``authorizer`` are not linked to an id).
    """

    manifest: CapabilityManifest
    key_nonce: bytes
    reply_to: str
    payload_codec: str | None
    status: SessionStatus
    authenticator: AuthenticatorState
    authorizer: AuthorizerState
    reconciliations_total: int
    reconciliations_by_tool: dict[str, int]
    request_rows: int
    admitted: dict[str, CompensationIdentity]


def read_session(persisted: PersistedSession, scope: str) -> StoredSession:
    """Read a persisted session of ``scope`` back, refusing anything not written by this module.

    Both documents are decoded strictly and must name ``scope`` and the
    session id (``RecordLocationMismatch``), carry their format version
    (opening 1, state 1 or 2), agree on the status, be byte for byte in
    their written form (an unknown key inside the manifest, which the
    manifest's own decoding would drop, is refused), hold a valid manifest
    of this session, a reply queue, a 64-hex nonce and consistent
    reconciliation counters (``SerializationError``). A format 2 state's
    request rows (``persisted.requests``) must be exactly its positions
    0 .. retained - 1, each once: one missing, repeated or past the count
    is ``RollbackDetected`` (a row deleted, or a state put back).
    """
    opening = decode_struct(persisted.opening, OpeningDocument)
    session_id = persisted.session_id
    state: StateDocument | StateDocumentV2
    if _state_format(persisted.state) == _STATE_FORMAT:
        state = decode_struct(persisted.state, StateDocumentV2)
    else:
        state = decode_struct(persisted.state, StateDocument)
    _check_location(opening.format_version, opening.scope, opening.session_id, scope, session_id)
    _check_state_location(state.format_version, state.scope, state.session_id, scope, session_id)
    if persisted.status != state.status:
        raise SerializationError("session status disagrees with its state document")
    if encode_struct(opening) != bytes(persisted.opening) or encode_struct(state) != bytes(
        persisted.state
    ):
        raise SerializationError("session document is not in its written form")
    manifest = opening.manifest
    manifest.validate()
    if manifest.session_id != session_id:
        raise RecordLocationMismatch(session_id, manifest.session_id)
    if not opening.reply_to:
        raise SerializationError("session opening document lacks a reply queue")
    if opening.payload_codec not in (None, PAYLOAD_CODEC):
        raise SerializationError("session opening document names an unknown payload codec")
    nonce = parse_key_nonce_hex(opening.key_nonce)
    counters = state.reconciliations
    if not _count(counters.total) or not all(
        is_token(tool) and _count(n) and n > 0 for tool, n in counters.by_tool.items()
    ):
        raise SerializationError("session state: invalid reconciliation counters")
    if sum(counters.by_tool.values()) != counters.total:
        raise SerializationError("session state: reconciliation counters disagree")
    admitted: dict[str, CompensationIdentity] = {}
    if isinstance(state, StateDocumentV2):
        authorizer = _read_requests(state, persisted, scope, admitted)
        request_rows = len(authorizer.request_ids)
    else:
        if persisted.requests:
            # Rows exist only beside a format 2 state: this one was put back.
            raise RollbackDetected(None, persisted.revision)
        authorizer, request_rows = state.authorizer, 0
    window = state.authenticator
    return StoredSession(
        manifest=manifest,
        key_nonce=nonce,
        reply_to=opening.reply_to,
        payload_codec=opening.payload_codec,
        status=state.status,
        authenticator=AuthenticatorState(
            window.next_outgoing, window.inbound_highest, _parse_seen(window.inbound_seen)
        ),
        authorizer=authorizer,
        reconciliations_total=counters.total,
        reconciliations_by_tool=dict(counters.by_tool),
        request_rows=request_rows,
        admitted=admitted,
    )


def _state_format(document: bytes) -> object:
    try:
        return _SESSION_HEADER.decode(document).format_version
    except msgspec.MsgspecError:
        return None  # the strict decode reports it


def _read_requests(
    state: StateDocumentV2,
    persisted: PersistedSession,
    scope: str,
    admitted: dict[str, CompensationIdentity],
) -> AuthorizerState:
    """The authorizer state a format 2 state and its request rows hold together;
    fills ``admitted`` with the identities the rows link to their request ids."""
    document = state.authorizer
    retained = document.retained
    if not _count(retained) or retained > MAX_SESSION_REQUEST_IDS:
        raise SerializationError("session state: invalid retained request id count")
    completed = _parse_bits(document.completed, "completed")
    if completed >> retained:
        raise SerializationError("session state: a completed flag past the retained ids")
    ids: list[str | None] = [None] * retained
    for raw in persisted.requests:
        request = decode_struct(raw, RequestDocument)
        if request.format_version != WORKER_SESSION_FORMAT_VERSION:
            raise SerializationError("request document format_version must be 1")
        if request.scope != scope:
            raise RecordLocationMismatch(scope, request.scope)
        if request.session_id != persisted.session_id:
            raise RecordLocationMismatch(persisted.session_id, request.session_id)
        if encode_struct(request) != bytes(raw):
            raise SerializationError("request document is not in its written form")
        position = request.position
        if not _count(position) or position >= retained or ids[position] is not None:
            raise RollbackDetected(None, persisted.revision)
        ids[position] = request.request_id
        if request.compensation is not None:
            admitted[request.request_id] = request.compensation
    if any(request_id is None for request_id in ids):
        raise RollbackDetected(None, persisted.revision)
    # A repeated identity stays repeated here: the authorizer's restore refuses it.
    identities = [*document.compensation_identities, *admitted.values()]
    return AuthorizerState(
        calls_by_tool=document.calls_by_tool,
        compensations_by_tool=document.compensations_by_tool,
        compensation_identities=tuple(sorted(identities)),
        request_ids=tuple(
            RetainedRequestId(str(request_id), (completed >> position) & 1 == 1)
            for position, request_id in enumerate(ids)
        ),
    )


def _parse_seen(text: str) -> int:
    return _parse_bits(text, "inbound_seen")


def _parse_bits(text: str, name: str) -> int:
    if len(text) != _SEEN_HEX_CHARS or text.strip("0123456789abcdef"):
        raise SerializationError(f"session state: {name} must be 256 lowercase hex")
    return int(text, 16)


def _check_state_location(
    format_version: int, doc_scope: str, doc_session: str, scope: str, session_id: str
) -> None:
    if format_version not in _STATE_FORMATS:
        raise SerializationError("unsupported session state format_version")
    _check_location(WORKER_SESSION_FORMAT_VERSION, doc_scope, doc_session, scope, session_id)


def _check_location(
    format_version: int, doc_scope: str, doc_session: str, scope: str, session_id: str
) -> None:
    if format_version != WORKER_SESSION_FORMAT_VERSION:
        raise SerializationError("unsupported session document format_version")
    if doc_scope != scope:
        raise RecordLocationMismatch(scope, doc_scope)
    if doc_session != session_id:
        raise RecordLocationMismatch(session_id, doc_session)


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


# What a store reads of a session document ------------------------------------------


class _SessionHeader(msgspec.Struct, frozen=True):
    # Only the location fields and status; the rest belongs to the session side.
    format_version: int
    scope: str
    session_id: str
    status: str | None = None


_SESSION_HEADER = msgspec.json.Decoder(_SessionHeader)


def session_header(document: bytes, scope: str, session_id: str) -> str | None:
    """Check a session document's location fields; its status, if it has one.

    Reads only the location fields and status, with msgspec alone (a store
    runs this for every commit). :func:`read_session` decodes the whole
    document strictly (duplicate keys refused), so a document that only
    passes this lenient read still fails closed there.
    """
    try:
        header = _SESSION_HEADER.decode(document)
    except msgspec.MsgspecError as exc:
        raise SerializationError(f"session document: {str(exc)[:120]}") from None
    if header.format_version not in _STATE_FORMATS:
        raise SerializationError("session document format_version must be 1 or 2")
    if header.scope != scope:
        raise RecordLocationMismatch(scope, header.scope)
    if header.session_id != session_id:
        raise RecordLocationMismatch(session_id, header.session_id)
    return header.status


def state_status(document: bytes, scope: str, session_id: str) -> str:
    """The status of a session state document whose location checks out."""
    status = session_header(document, scope, session_id)
    if status not in SESSION_STATUSES:
        raise SerializationError("session state document needs a valid status")
    return status


# Outbox documents ------------------------------------------------


class OutboxDocument(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A committed reply: the frame as standard base64 without padding."""

    format_version: int
    scope: str
    session_id: str
    reply_to: str
    correlation_id: str | None
    frame: str


def outbox_document(
    scope: str, session_id: str, reply_to: str, correlation_id: str | None, frame: bytes
) -> bytes:
    """The outbox document of one reply frame, in its written form."""
    return encode_struct(
        OutboxDocument(
            _OUTBOX_FORMAT_VERSION, scope, session_id, reply_to, correlation_id, _b64encode(frame)
        )
    )


def read_outbox(document: bytes, scope: str, message_id: str, revision: int) -> OutboxEntry:
    """The reply an outbox document stored under ``message_id`` at ``revision`` holds.

    Strict decode, format version 1 and ``scope`` (else ``SerializationError``
    / ``RecordLocationMismatch``); the frame is canonical unpadded base64 and
    its hex BLAKE3 is ``message_id`` (``RecordLocationMismatch``).
    """
    outbox = decode_struct(document, OutboxDocument)
    if outbox.format_version != _OUTBOX_FORMAT_VERSION:
        raise SerializationError("outbox document format_version must be 1")
    if outbox.scope != scope:
        raise RecordLocationMismatch(scope, outbox.scope)
    frame = _b64decode(outbox.frame)
    actual = frame_message_id(frame)
    if actual != message_id:
        raise RecordLocationMismatch(message_id, actual)
    return OutboxEntry(
        message_id, outbox.session_id, outbox.reply_to, outbox.correlation_id, frame, revision
    )


def is_message_id(value: object) -> bool:
    """Whether ``value`` names an outbox row: 64 lowercase hex (a frame's BLAKE3)."""
    return isinstance(value, str) and _MESSAGE_ID.fullmatch(value) is not None


def _b64encode(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _b64decode(text: str) -> bytes:
    # Standard alphabet, no padding, canonical: re-encoding must give the text back.
    try:
        data = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise SerializationError("outbox frame is not unpadded standard base64") from None
    if _b64encode(data) != text:
        raise SerializationError("outbox frame base64 is not canonical")
    return data
