"""Protocol errors."""

from __future__ import annotations

from typing import Any

from octo_common.errors._base import (
    ProtocolError,
)

# Protocol ----------------------------------------------------------


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


class FrameDecryptionFailed(ProtocolError):
    _text = (
        "a frame of an encrypted session is not an envelope that decrypts under the session's"
        " frame key"
    )


class ReplyCorrelationMismatch(ProtocolError):
    _text = "an authentic reply answers another request than its correlation id names"


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
