"""Worker errors: the journal, the worker and adapters."""

from __future__ import annotations

from typing import Any

from octo_common.errors._base import (
    JournalError,
    WorkerAdapterError,
    WorkerError,
)

# Journal -----------------------------------------------------------


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


class OperationPruned(JournalError):
    """The key's row was pruned: its outcome is no longer kept, and the key never runs again."""

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


# Worker ------------------------------------------------------------


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


class ReplyQueueNotAllowed(WorkerError):
    _text = (
        "the delivery's reply queue is neither the one sealed into open_session "
        "nor one the scope's configuration allows"
    )


# Adapter -----------------------------------------------------------


class AdapterUnsupported(WorkerAdapterError):
    _fields = ("method",)
    _defaults = {"method": ""}
    method: str


class AdapterInvalidJsonInput(WorkerAdapterError):
    """The adapter refused the request's input before any effect: raised from an
    effect method, it ends the key ``failed`` (``input_refused``) with ``detail``
    as the failure text (a validation message, never the input's values)."""

    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter refused its JSON input"
    detail: str


class AdapterInvalidOptions(WorkerAdapterError):
    """The adapter's own options (its configuration) refuse this call, before any
    effect: raised from an effect method, it ends the key ``failed``
    (``options_refused``); ``detail`` names the option, never its value."""

    _fields = ("detail",)
    _defaults = {"detail": ""}
    _hidden = frozenset({"detail"})
    _text = "adapter refused the call: its options do not allow it"
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
