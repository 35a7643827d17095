"""Host errors: the ledger and workflows."""

from __future__ import annotations

from typing import Any

from octo_common.errors._base import (
    LedgerError,
    WorkflowError,
    escape_untrusted,
)

# Ledger ------------------------------------------------------------


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


class InvalidRetryChain(LedgerError):
    """A retry record does not continue the attempt it names (same step, tool and
    input, the next attempt number, a ``failed`` attempt replaced once)."""

    _fields = ("key", "detail")
    key: str
    detail: str


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


# Workflow ----------------------------------------------------------


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


class InvalidRetryPolicy(WorkflowError):
    """A step's retry policy is out of its bounds (attempts, backoff, outcomes)."""

    _fields = ("step_id", "detail")
    step_id: str
    detail: str


class RetryNotAllowed(WorkflowError):
    """The step's retry policy does not let this attempt be replaced by a new one."""

    _fields = ("key", "reason")
    key: str
    reason: str
