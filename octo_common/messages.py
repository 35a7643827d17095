"""Wire structs and the ``WorkerMessage`` tagged union.

Every struct here is a frozen value that compares by value. Built by user
code, a struct sets ``protocol_version = 5`` and validates itself;
decoded from bytes, it is validated by ``decode_message`` in one fixed
order. Field order is the serialization order, which tags, sizes
and fingerprints are computed over.
"""

from __future__ import annotations

from typing import Any

from octo_common._struct import ProtocolStruct, leading_keyword
from octo_common.codec import convert_tree, decode_fast, encode_struct, parse_tree
from octo_common.errors import (
    SerializationError,
    WireFrameTooLarge,
)
from octo_common.grants import CapabilityManifest
from octo_common.ids import (
    is_token,
    validate_compensation_key,
    validate_rejection_code,
    validate_token,
)
from octo_common.limits import MAX_WIRE_FRAME_BYTES, PAYLOAD_CODEC, PROTOCOL_VERSION
from octo_common.requests import (
    U16,
    CompensationReconcileRequest,
    CompensationReconcileResult,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    Resolution,
    ToolInvocation,
    ToolResult,
    WorkerCancellationRequest,
    WorkerCancellationResult,
    check_version,
)

__all__ = [
    "Cancel",
    "CancellationResult",
    "CloseSession",
    "CompensateOperation",
    "CompensationReconcileRequest",
    "CompensationReconcileResult",
    "CompensationResult",
    "DispatchOperation",
    "Invoke",
    "OpenSession",
    "OperationCompensationBinding",
    "OperationCompensationRequest",
    "OperationCompensationResult",
    "OperationDispatchRequest",
    "OperationReconcileRequest",
    "OperationReconcileResult",
    "OperationResult",
    "ReconcileCompensation",
    "ReconcileOperation",
    "ReconciledCompensation",
    "ReconciledOperation",
    "Resolution",
    "RequestRejected",
    "Result",
    "ToolInvocation",
    "ToolResult",
    "WorkerCancellationRequest",
    "WorkerCancellationResult",
    "WorkerMessage",
    "decode_message",
    "encode_message",
    "message_type",
    "request_id_of",
    "session_id_of",
]


def _is_reply_queue(name: str) -> bool:
    prefix = "octo.v5.reply."
    return isinstance(name, str) and name.startswith(prefix) and is_token(name[len(prefix) :])


# Messages -------------------------------------------------------------


class _Message(ProtocolStruct, frozen=True, tag_field="type"):
    pass


class OpenSession(_Message, frozen=True, tag="open_session", omit_defaults=True):
    """A session's grants, and what its opener binds into the sealed frame.

    ``reply_to``: the one reply queue of the session; a worker refuses a
    delivery of this frame that names any other (a copy republished with a
    foreign ``reply_to`` gets no reply). ``payload_codec``: every later frame
    of the session travels encrypted (:mod:`octo_common.payload_codec`). Both
    are left out of the encoding when absent, so a frame without them is
    byte for byte the frame of the protocol's base form.
    """

    manifest: CapabilityManifest
    reply_to: str | None = None
    payload_codec: str | None = None

    def validate(self) -> None:
        self.manifest.validate()
        if self.reply_to is not None and not _is_reply_queue(self.reply_to):
            raise SerializationError("open_session reply_to must be a host reply queue")
        if self.payload_codec is not None and self.payload_codec != PAYLOAD_CODEC:
            raise SerializationError("open_session names an unknown payload codec")


class Invoke(_Message, frozen=True, tag="invoke"):
    invocation: ToolInvocation

    def validate(self) -> None:
        self.invocation.validate()


class Result(_Message, frozen=True, tag="result"):
    result: ToolResult

    def validate(self) -> None:
        self.result.validate()


class DispatchOperation(_Message, frozen=True, tag="dispatch_operation"):
    request: OperationDispatchRequest

    def validate(self) -> None:
        self.request.validate()


class OperationResult(_Message, frozen=True, tag="operation_result"):
    result: OperationReconcileResult

    def validate(self) -> None:
        self.result.validate()


class CompensateOperation(_Message, frozen=True, tag="compensate_operation"):
    request: OperationCompensationRequest

    def validate(self) -> None:
        self.request.validate()


class CompensationResult(_Message, frozen=True, tag="compensation_result"):
    result: OperationCompensationResult

    def validate(self) -> None:
        self.result.validate()


class ReconcileOperation(_Message, frozen=True, tag="reconcile_operation"):
    request: OperationReconcileRequest

    def validate(self) -> None:
        self.request.validate()


class ReconciledOperation(_Message, frozen=True, tag="reconciled_operation"):
    result: OperationReconcileResult

    def validate(self) -> None:
        self.result.validate()


class ReconcileCompensation(_Message, frozen=True, tag="reconcile_compensation"):
    """A compensation lookup by its ``cmp-`` key, host to worker (no effect)."""

    request: CompensationReconcileRequest

    def validate(self) -> None:
        self.request.validate()


class ReconciledCompensation(_Message, frozen=True, tag="reconciled_compensation"):
    """What a compensation lookup observed, worker to host."""

    result: CompensationReconcileResult

    def validate(self) -> None:
        self.result.validate()


class Cancel(_Message, frozen=True, tag="cancel"):
    request: WorkerCancellationRequest

    def validate(self) -> None:
        self.request.validate()


class CancellationResult(_Message, frozen=True, tag="cancellation_result"):
    result: WorkerCancellationResult

    def validate(self) -> None:
        self.result.validate()


class CloseSession(_Message, frozen=True, tag="close_session"):
    protocol_version: U16 = leading_keyword(default=PROTOCOL_VERSION, kw_only=True)
    session_id: str

    def validate(self) -> None:
        check_version(self.protocol_version)
        validate_token("session id", self.session_id)


class RequestRejected(
    _Message, frozen=True, tag="request_rejected", forbid_unknown_fields=True, omit_defaults=True
):
    """A refused authenticated request; carries a code, never error text."""

    protocol_version: U16 = leading_keyword(default=PROTOCOL_VERSION, kw_only=True)
    session_id: str
    request_id: str
    code: str
    operation_key: str | None = None
    compensation_key: str | None = None

    def validate(self) -> None:
        check_version(self.protocol_version)
        validate_token("session id", self.session_id)
        validate_token("request id", self.request_id)
        validate_rejection_code(self.code)
        if self.operation_key is not None:
            validate_token("operation key", self.operation_key)
        if self.compensation_key is not None:
            validate_compensation_key(self.compensation_key)

    def matches_request(self, request: Any) -> bool:
        """Version, session, request id; and keys when present."""
        if not (
            self.protocol_version == getattr(request, "protocol_version", None)
            and self.session_id == getattr(request, "session_id", None)
            and self.request_id == getattr(request, "request_id", None)
        ):
            return False
        if self.operation_key is not None and self.operation_key != getattr(
            request, "operation_key", None
        ):
            return False
        return not (
            self.compensation_key is not None
            and self.compensation_key != getattr(request, "compensation_key", None)
        )


WorkerMessage = (
    OpenSession
    | Invoke
    | Result
    | DispatchOperation
    | OperationResult
    | CompensateOperation
    | CompensationResult
    | ReconcileOperation
    | ReconciledOperation
    | ReconcileCompensation
    | ReconciledCompensation
    | Cancel
    | CancellationResult
    | CloseSession
    | RequestRejected
)

_MESSAGE_TYPES: tuple[type[ProtocolStruct], ...] = (
    OpenSession,
    Invoke,
    Result,
    DispatchOperation,
    OperationResult,
    CompensateOperation,
    CompensationResult,
    ReconcileOperation,
    ReconciledOperation,
    ReconcileCompensation,
    ReconciledCompensation,
    Cancel,
    CancellationResult,
    CloseSession,
    RequestRejected,
)


def message_type(message: Any) -> str:
    """The wire ``type`` of a message (``"dispatch_operation"``...)."""
    return str(type(message).__struct_config__.tag)


def _body(message: Any) -> Any:
    if isinstance(message, OpenSession):
        return message.manifest
    if isinstance(message, Invoke):
        return message.invocation
    if isinstance(message, CloseSession | RequestRejected):
        return message
    for name in ("request", "result"):
        body = getattr(message, name, None)
        if body is not None:
            return body
    raise TypeError(f"{type(message).__name__} is not a WorkerMessage")


def session_id_of(message: Any) -> str:
    """The session field of the inner struct (``manifest.session_id`` for open)."""
    getter = _SESSION_ID_OF.get(type(message))
    if getter is None:
        return str(_body(message).session_id)
    return str(getter(message))


_SESSION_ID_OF: dict[type, Any] = {
    OpenSession: lambda m: m.manifest.session_id,
    Invoke: lambda m: m.invocation.session_id,
    Result: lambda m: m.result.session_id,
    DispatchOperation: lambda m: m.request.session_id,
    OperationResult: lambda m: m.result.session_id,
    CompensateOperation: lambda m: m.request.session_id,
    CompensationResult: lambda m: m.result.session_id,
    ReconcileOperation: lambda m: m.request.session_id,
    ReconciledOperation: lambda m: m.result.session_id,
    ReconcileCompensation: lambda m: m.request.session_id,
    ReconciledCompensation: lambda m: m.result.session_id,
    Cancel: lambda m: m.request.session_id,
    CancellationResult: lambda m: m.result.session_id,
    CloseSession: lambda m: m.session_id,
    RequestRejected: lambda m: m.session_id,
}


def request_id_of(message: Any) -> str | None:
    """The id a reply correlates with: ``request_id`` (the cancellation id for cancel)."""
    if isinstance(message, Cancel | CancellationResult):
        body = message.request if isinstance(message, Cancel) else message.result
        return str(body.cancellation_id)
    if isinstance(message, OpenSession | CloseSession):
        return None
    return str(_body(message).request_id)


def operation_key_of(message: Any) -> str | None:
    """The operation key a message is about, when it has one."""
    body = _body(message)
    key = getattr(body, "operation_key", None)
    return None if key is None else str(key)


def validate_message(message: Any) -> None:
    if not isinstance(message, _MESSAGE_TYPES):
        raise SerializationError("not a WorkerMessage")
    message.validate()


def encode_message(message: WorkerMessage) -> bytes:
    """Validate, encode compactly, then bound the size."""
    validate_message(message)
    data = encode_struct(message)
    if len(data) > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(len(data), MAX_WIRE_FRAME_BYTES)
    return data


def decode_message(data: bytes | str) -> WorkerMessage:
    """Length first, then strict parse (``SerializationError``), then validate."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(len(raw), MAX_WIRE_FRAME_BYTES)
    message = decode_fast(raw, WorkerMessage)
    if message is None:
        message = convert_tree(parse_tree(raw), WorkerMessage)
    message.validate()
    return message  # type: ignore[no-any-return]
