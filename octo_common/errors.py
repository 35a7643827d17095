"""The Octo error hierarchy (W§13, H§18, PROTOCOL.md §3).

Every error derives from :class:`OctoError` and carries a stable snake_case
``code`` derived from its class name (``SerializationError`` is
``serialization``). Fields are positional, in the order the protocol lists
them, and kept exactly on the instance for programs. ``str()`` escapes every
untrusted string (H§15) and never shows keys, payloads or adapter text: an
error that carries such material (``DuplicateFrame.message``,
``WorkerRequestRejected.rejection``) keeps it out of its text.

This module must never import anything else from Octo.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from octo_common.limits import MAX_ERROR_PREVIEW_BYTES

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def _code_for(name: str) -> str:
    if name == "SerializationError":
        return "serialization"
    return _CAMEL.sub("_", name).lower()


def escape_untrusted(value: object) -> str:
    """Render an untrusted value for an error text (H§15).

    Strings are wrapped in backticks, cut to their first 96 UTF-8 bytes, with
    backslash and backtick escaped and every byte outside printable ASCII
    written as ``\\xNN``. Other values are shown with ``repr``.
    """
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
    else:
        return repr(value)
    preview = data[:MAX_ERROR_PREVIEW_BYTES]
    out: list[str] = []
    for byte in preview:
        if byte == 0x5C:
            out.append("\\\\")
        elif byte == 0x60:
            out.append("\\`")
        elif 0x20 <= byte <= 0x7E:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    text = "`" + "".join(out) + "`"
    if len(data) > MAX_ERROR_PREVIEW_BYTES:
        text += f" ({len(data)} bytes; preview truncated)"
    return text


class OctoError(Exception):
    """Base of every Octo error. ``code`` is stable API."""

    code: ClassVar[str] = "octo_error"
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _text: ClassVar[str] = ""
    _hidden: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = _code_for(cls.__name__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = self._fields
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes at most {len(fields)} fields")
        values: dict[str, Any] = dict(zip(fields, args, strict=False))
        for name, value in kwargs.items():
            if name not in fields:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__} got {name!r} twice")
            values[name] = value
        for name in fields:
            if name not in values:
                if name in self._defaults:
                    values[name] = self._defaults[name]
                else:
                    raise TypeError(f"{type(self).__name__} is missing field {name!r}")
            object.__setattr__(self, name, values[name])
        super().__init__(*(values[name] for name in fields if name not in self._hidden))

    def _field_text(self) -> str:
        parts = [
            f"{name}={escape_untrusted(getattr(self, name))}"
            for name in self._fields
            if name not in self._hidden
        ]
        return ", ".join(parts)

    def __str__(self) -> str:
        text = self._text or self.code.replace("_", " ")
        fields = self._field_text()
        return f"{text} ({fields})" if fields else text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._field_text()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), {n: getattr(self, n) for n in self._fields}))


def _rebuild_error(cls: type[OctoError], values: dict[str, Any]) -> OctoError:
    return cls(**values)


# Groups ---------------------------------------------------------------------


class ProtocolError(OctoError):
    """Wire protocol, payload, grant, frame and authorizer errors (W§13.1)."""


class JournalError(OctoError):
    """Worker journal errors (W§13.2)."""


class WorkerError(OctoError):
    """Worker runtime errors (W§13.3)."""


class WorkerAdapterError(OctoError):
    """Errors an adapter reports (W§10.2)."""


class LedgerError(OctoError):
    """Host ledger errors (H§18.1)."""


class WorkflowError(OctoError):
    """Host workflow errors (H§18.2)."""


class StorageError(OctoError):
    """Authenticated storage errors (H§18.3)."""


# Protocol (W§13.1) ----------------------------------------------------------


class UnsupportedVersion(ProtocolError):
    _fields = ("actual",)
    _text = "unsupported protocol version"
    actual: int


class InvalidToken(ProtocolError):
    _fields = ("field", "value")
    _text = "invalid token"
    field: str
    value: str


class InvalidKeyNonce(ProtocolError):
    _text = "key nonce must be 32 bytes (64 lowercase hex characters)"


class InvalidScopeKey(ProtocolError):
    _fields = ("reason",)
    _text = "invalid scope key"
    reason: str


class DuplicateGrant(ProtocolError):
    _fields = ("tool",)
    tool: str


class InvalidGrant(ProtocolError):
    _fields = ("reason",)
    _text = "invalid grant"
    reason: str

    def __str__(self) -> str:
        return f"invalid grant: {self.reason}"


class TooManyGrants(ProtocolError):
    _fields = ("maximum",)
    _defaults = {"maximum": 128}
    maximum: int


class TooManyResources(ProtocolError):
    _fields = ("maximum",)
    _defaults = {"maximum": 64}
    maximum: int


class AttenuationWidensLimits(ProtocolError):
    _text = "attenuation may lower limits but never raise them"


class AttenuationExpandsResources(ProtocolError):
    _text = "attenuated resources must be a subset of the parent's"


class UnknownSession(ProtocolError):
    _fields = ("session_id",)
    session_id: str


class UnknownTool(ProtocolError):
    _fields = ("tool",)
    tool: str


class InvalidSessionKeyLength(ProtocolError):
    _fields = ("actual", "expected")
    _defaults = {"expected": 32}
    actual: int
    expected: int


class WeakSessionKey(ProtocolError):
    _text = "session key is all zero"


class InvalidSequence(ProtocolError):
    _text = "frame sequence must not be zero"


class SequenceExhausted(ProtocolError):
    _text = "frame sequence space exhausted"


class DuplicateFrame(ProtocolError):
    """An authentic frame whose sequence was already accepted.

    ``message`` is the authenticated message, so the receiver can answer from
    durable state; it never appears in ``str()`` or ``repr()``.
    """

    _fields = ("sequence", "message")
    _defaults = {"message": None}
    _hidden = frozenset({"message"})
    _text = "duplicate frame"
    sequence: int
    message: Any


class StaleFrame(ProtocolError):
    _fields = ("sequence", "highest")
    _text = "frame is older than the replay window"
    sequence: int
    highest: int


class InvalidAuthenticatorState(ProtocolError):
    _text = "impossible authenticator state"


class InvalidAuthenticationTag(ProtocolError):
    _text = "frame authentication failed"


class AuthorizationProvenanceMismatch(ProtocolError):
    _text = "authorization token was issued by another authorizer"


class DuplicateRequest(ProtocolError):
    _fields = ("request_id",)
    request_id: str


class SessionRequestLimitExceeded(ProtocolError):
    _fields = ("maximum",)
    _defaults = {"maximum": 1024}
    maximum: int


class DuplicateResult(ProtocolError):
    _fields = ("request_id",)
    request_id: str


class CancellationIdMatchesRequest(ProtocolError):
    _text = "cancellation id must differ from the request id"


class OperationResultMismatch(ProtocolError):
    _text = "operation result does not match its request"


class InvalidCompensationKey(ProtocolError):
    _fields = ("value",)
    _text = "compensation key must start with cmp-"
    value: str


class InvalidCompensationGrantFingerprint(ProtocolError):
    _text = "grant fingerprint must be 64 lowercase hex characters"


class CompensationNotGranted(ProtocolError):
    _fields = ("tool",)
    tool: str


class CompensationBudgetExhausted(ProtocolError):
    _fields = ("tool", "maximum")
    tool: str
    maximum: int


class CompensationGrantMismatch(ProtocolError):
    _text = "grant fingerprint differs from the active grant"


class CompensationResultMismatch(ProtocolError):
    _text = "compensation result does not match its request"


class PayloadFormatMismatch(ProtocolError):
    _fields = ("expected", "actual")
    expected: str
    actual: str


class InvalidJsonEnvelope(ProtocolError):
    _text = "JSON payload root must be an object or an array"


class JsonPayloadTooDeep(ProtocolError):
    _fields = ("maximum",)
    _defaults = {"maximum": 32}
    maximum: int


class InvalidOperationFailure(ProtocolError):
    _text = "failure message must not be empty"


class OperationFailureTooLarge(ProtocolError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 4096}
    actual: int
    maximum: int


class InputTooLarge(ProtocolError):
    _fields = ("actual", "maximum")
    actual: int
    maximum: int


class OutputTooLarge(ProtocolError):
    _fields = ("actual", "maximum")
    actual: int
    maximum: int


class CallBudgetExhausted(ProtocolError):
    _fields = ("tool", "maximum")
    tool: str
    maximum: int


class RequestMismatch(ProtocolError):
    _fields = ("expected", "actual")
    expected: str
    actual: str


class WireFrameTooLarge(ProtocolError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 1_048_576}
    actual: int
    maximum: int


class SerializationError(ProtocolError):
    """JSON parse, type, range, duplicate-key or unknown-field failure.

    ``detail`` describes the position or rule; tests match the class only.
    """

    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "serialization"
    detail: str

    def __str__(self) -> str:
        # The detail comes from our own decoder, never from payload text.
        return f"serialization failed: {self.detail}" if self.detail else "serialization failed"


# Journal (W§13.2) -----------------------------------------------------------


class UnsupportedOperationJournalVersion(JournalError):
    _fields = ("version",)
    version: int


class OperationRecordTooLarge(JournalError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 1_032_192}
    actual: int
    maximum: int


class OperationJournalScopeMismatch(JournalError):
    _fields = ("expected", "actual")
    expected: str
    actual: str


class InvalidOperationFingerprint(JournalError):
    _text = "input fingerprint must be 64 lowercase hex characters"


class RecordLocationMismatch(JournalError):
    _fields = ("expected", "actual")
    expected: str
    actual: str


class JournalKeyNotLoaded(JournalError):
    _fields = ("key",)
    key: str


class UnknownOperation(JournalError):
    _fields = ("key",)
    key: str


class OperationIdentityMismatch(JournalError):
    _fields = ("key",)
    key: str


class InvalidWorkerOperationTransition(JournalError):
    _fields = ("operation_key", "current", "observed")
    operation_key: str
    current: Any
    observed: Any


class CompensationToolMismatch(JournalError):
    _fields = ("key",)
    key: str


class CompensationRequiresSucceededOperation(JournalError):
    _fields = ("operation_key", "state")
    operation_key: str
    state: Any


class UnknownCompensation(JournalError):
    _fields = ("operation_key",)
    operation_key: str


class CompensationIdentityMismatch(JournalError):
    _fields = ("key",)
    key: str


class InvalidWorkerCompensationTransition(JournalError):
    _fields = ("operation_key", "current", "observed")
    operation_key: str
    current: Any
    observed: Any


# Worker (W§13.3) ------------------------------------------------------------


class ZeroPerToolReconciliationLimit(WorkerError):
    _text = "per-tool reconciliation limit must be greater than zero"


class ZeroSessionReconciliationLimit(WorkerError):
    _text = "per-session reconciliation limit must be greater than zero"


class InvalidTool(WorkerError):
    _fields = ("tool",)
    tool: str


class DuplicateTool(WorkerError):
    _fields = ("tool",)
    tool: str


class RequiresWorkerAuthenticator(WorkerError):
    _text = "a worker session needs a worker-role authenticator"


class UnexpectedOpeningMessage(WorkerError):
    _text = "the first frame of a session must be open_session"


class MissingAdapter(WorkerError):
    _fields = ("tool",)
    tool: str


class InvalidJournalLease(WorkerError):
    _text = "invalid journal lease"


class SessionReplay(WorkerError):
    _fields = ("session_id",)
    session_id: str


class SessionClosed(WorkerError):
    _fields = ("session_id",)
    _defaults = {"session_id": ""}
    session_id: str


class SessionPoisoned(WorkerError):
    _text = "session is poisoned; open a new session and reconcile"


class JournalPersistenceFailed(WorkerError):
    _fields = ("cause",)
    _defaults = {"cause": "storage_backend_error"}
    cause: str


class InvalidJournalRevision(WorkerError):
    _fields = ("expected", "actual")
    expected: int
    actual: int


class InvocationSafetyNotDeclared(WorkerError):
    _fields = ("tool",)
    tool: str


class DurableOperationContractNotDeclared(WorkerError):
    _fields = ("tool",)
    tool: str


class AdapterError(WorkerError):
    _fields = ("tool", "kind")
    tool: str
    kind: str


class IndeterminateOperation(WorkerError):
    _fields = ("operation_key", "cause")
    operation_key: str
    cause: str


class IndeterminateCompensation(WorkerError):
    _fields = ("operation_key", "compensation_key", "cause")
    operation_key: str
    compensation_key: str
    cause: str


class PendingOperation(WorkerError):
    _fields = ("key",)
    key: str


class PendingCompensation(WorkerError):
    _fields = ("key",)
    key: str


class ReconciliationBudgetExhausted(WorkerError):
    _fields = ("tool", "maximum")
    tool: str
    maximum: int


class ReconciliationSessionBudgetExhausted(WorkerError):
    _fields = ("maximum",)
    maximum: int


class UnexpectedMessage(WorkerError):
    _fields = ("kind",)
    kind: str


class UnsupportedMessage(WorkerError):
    _fields = ("kind",)
    kind: str


class ScopeMismatch(WorkerError):
    _text = "frame scope header does not match the queue's scope"


class InvalidFrameHeaders(WorkerError):
    _text = "frame headers are missing or malformed"


# Adapter (W§10.2) -----------------------------------------------------------


class AdapterUnsupported(WorkerAdapterError):
    _fields = ("method",)
    _defaults = {"method": ""}
    method: str


class AdapterInvalidJsonInput(WorkerAdapterError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter refused its JSON input"
    detail: str


class AdapterInvalidJsonOutput(WorkerAdapterError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter produced invalid JSON output"
    detail: str


class AdapterFailed(WorkerAdapterError):
    """The adapter failed; ``detail`` is adapter text and is never shown."""

    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter failed"
    detail: str


class AdapterIndeterminate(WorkerAdapterError):
    """The adapter cannot tell whether its effect happened."""

    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter outcome is indeterminate"
    detail: str


# Ledger (H§18.1) ------------------------------------------------------------


class LedgerTooLarge(LedgerError):
    _text = "ledger exceeds 64 KiB"


class LedgerEncodingError(LedgerError):
    _text = "ledger could not be encoded"


class InvalidLedgerEncoding(LedgerError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "invalid ledger encoding"
    detail: str


class UnsupportedLedgerVersion(LedgerError):
    _fields = ("version",)
    version: int


class InvalidPlanFingerprint(LedgerError):
    _text = "plan fingerprint must be 64 lowercase hex characters"


class TooManyOperations(LedgerError):
    _fields = ("maximum",)
    _defaults = {"maximum": 64}
    maximum: int


class RevisionExhausted(LedgerError):
    _text = "revision would overflow"


class StaleRevision(LedgerError):
    _fields = ("actual", "minimum")
    actual: int
    minimum: int


class EmptyOperationNonce(LedgerError):
    _text = "operation nonce must not be empty"


class OperationNonceTooLarge(LedgerError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 128}
    actual: int
    maximum: int


class InvalidStepId(LedgerError):
    _fields = ("step_id",)
    step_id: str


class InvalidOperationKey(LedgerError):
    _fields = ("key",)
    key: str


class InvalidInputFingerprint(LedgerError):
    _text = "input fingerprint must be 64 lowercase hex characters"


class InputFingerprintMismatch(LedgerError):
    _fields = ("key",)
    key: str


class OperationBindingMismatch(LedgerError):
    _fields = ("key",)
    key: str


class InvalidCompensationTenantScope(LedgerError):
    _fields = ("scope",)
    scope: str


class CompensationGrantDenied(LedgerError):
    _fields = ("tool", "tenant_scope")
    tool: str
    tenant_scope: str


class CompensationActionDenied(LedgerError):
    _fields = ("operation_key", "tool", "tenant_scope")
    operation_key: str
    tool: str
    tenant_scope: str


class CompensationInputFingerprintMismatch(LedgerError):
    _fields = ("compensation_key",)
    compensation_key: str


class CompensationAlreadyRecorded(LedgerError):
    _fields = ("operation_key",)
    operation_key: str


class CompensationPolicyMismatch(LedgerError):
    _fields = ("key",)
    key: str


class CompensationRequestMismatch(LedgerError):
    _text = "compensation request or result does not match the record"


class CompensationDispatchRequiresHostAuthenticator(LedgerError):
    _text = "compensation needs a host-role authenticator"


class UnexpectedCompensationMessage(LedgerError):
    _text = "expected compensation_result"


class InvalidCompensationStateTransition(LedgerError):
    _fields = ("compensation_key", "current", "observed")
    compensation_key: str
    current: Any
    observed: Any


class DuplicateOperationKey(LedgerError):
    _fields = ("key",)
    key: str


class PlanMismatch(LedgerError):
    _text = "ledger belongs to another plan"


class UnknownStep(LedgerError):
    _fields = ("step_id",)
    step_id: str


class ReconciliationMismatch(LedgerError):
    _text = "reconciliation result does not match its request"


class ReconciliationRequiresHostAuthenticator(LedgerError):
    _text = "reconciliation needs a host-role authenticator"


class OperationDispatchRequiresHostAuthenticator(LedgerError):
    _text = "dispatch needs a host-role authenticator"


class UnexpectedOperationDispatchMessage(LedgerError):
    _text = "expected operation_result"


class UnexpectedReconciliationMessage(LedgerError):
    _text = "expected reconciled_operation (reconciled_compensation for a compensation lookup)"


class InvalidStateTransition(LedgerError):
    _fields = ("current", "observed")
    current: Any
    observed: Any


class WorkerRequestRejected(LedgerError):
    """The worker answered ``request_rejected``; ``rejection.code`` says why."""

    _fields = ("rejection",)
    rejection: Any

    def _field_text(self) -> str:
        rej = self.rejection
        parts = [f"code={escape_untrusted(getattr(rej, 'code', '?'))}"]
        for name in ("request_id", "operation_key", "compensation_key"):
            value = getattr(rej, name, None)
            if value is not None:
                parts.append(f"{name}={escape_untrusted(value)}")
        return ", ".join(parts)

    @property
    def rejection_code(self) -> str:
        return str(getattr(self.rejection, "code", ""))


# Workflow (H§18.2) ----------------------------------------------------------


class PlanOwnershipMismatch(WorkflowError):
    _text = "plan belongs to another engine"


class ApprovalMismatch(WorkflowError):
    _text = "approval does not match this use"


class EmptyPlan(WorkflowError):
    _text = "a plan needs at least one step"


class TooManySteps(WorkflowError):
    _fields = ("maximum",)
    _defaults = {"maximum": 1024}
    maximum: int


class PlanSourceTooLarge(WorkflowError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 1_048_576}
    actual: int
    maximum: int


class DuplicateStepId(WorkflowError):
    _fields = ("step_id",)
    step_id: str


# Storage (H§18.3) -----------------------------------------------------------


class InvalidStorageKey(StorageError):
    _text = "storage key must be 32 bytes"


class InvalidKeyId(StorageError):
    _text = "invalid storage key id"


class InvalidRecordNamespace(StorageError):
    _text = "invalid record namespace"


class InvalidRecordName(StorageError):
    _text = "invalid record name"


class DuplicateKeyId(StorageError):
    _fields = ("key_id",)
    key_id: str


class UnknownKeyId(StorageError):
    _fields = ("key_id",)
    key_id: str


class ActiveKeyCannotBeRetired(StorageError):
    _text = "the active key cannot be retired"


class PayloadTooLarge(StorageError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 2_097_152}
    actual: int
    maximum: int


class RecordTooLarge(StorageError):
    _fields = ("actual", "maximum")
    _defaults = {"maximum": 3_145_728}
    actual: int
    maximum: int


class EnvelopeEncodingError(StorageError):
    _text = "envelope could not be encoded"


class InvalidEnvelope(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "invalid storage envelope"
    detail: str


class UnsupportedRecordFormat(StorageError):
    _fields = ("version",)
    version: int


class InvalidRevision(StorageError):
    _text = "revision must be greater than zero"


class RevisionMismatch(StorageError):
    _fields = ("backend", "envelope")
    backend: int
    envelope: int


class InvalidRecordAuthenticationTag(StorageError):
    _text = "record authentication failed"


class RollbackDetected(StorageError):
    _fields = ("record_revision", "revision_floor")
    record_revision: int | None
    revision_floor: int


class RevisionFloorMismatch(StorageError):
    _fields = ("record_revision", "revision_floor")
    record_revision: int | None
    revision_floor: int


class WriteConflict(StorageError):
    _fields = ("expected", "actual", "revision_floor")
    _defaults = {"revision_floor": 0}
    expected: int | None
    actual: int | None
    revision_floor: int


class InvalidReplacementRevision(StorageError):
    _fields = ("expected", "actual")
    expected: int
    actual: int


class FencingRequired(StorageError):
    _fields = ("current",)
    current: int


class InvalidFencingToken(StorageError):
    _text = "fencing token must be greater than zero"


class FencingTokenRejected(StorageError):
    _fields = ("current", "supplied")
    current: int
    supplied: int


class FencingTokenExhausted(StorageError):
    _text = "fencing token would overflow"


class RollbackAnchorMissing(StorageError):
    _text = "rollback anchor file is missing"


class RollbackAnchorInvalid(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "rollback anchor file is invalid"
    detail: str


class StorageBackendError(StorageError):
    _fields = ("detail",)
    _defaults = {"detail": ""}
    _text = "storage backend failed"
    detail: str


# Deployment (not a protocol error) -------------------------------------------


class InvalidConfiguration(OctoError):
    """A worker or host configuration file (or a file it names) is unusable.

    ``detail`` names the configuration key and what is wrong with it, in one
    line; it never holds key bytes or passwords.
    """

    _fields = ("detail",)
    _text = "invalid configuration"
    detail: str

    def __str__(self) -> str:
        return f"invalid configuration: {self.detail}"


def _all_error_classes() -> list[type[OctoError]]:
    found: list[type[OctoError]] = []
    pending: list[type[OctoError]] = [OctoError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


ERROR_CLASSES: dict[str, type[OctoError]] = {
    cls.__name__: cls for cls in _all_error_classes() if cls.__module__ == __name__
}
"""Every error class of this module by name (tests and docs use it)."""
