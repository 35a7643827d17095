"""The ledger's records and their strict JSON documents.

This module owns :class:`WorkflowOperation` and :class:`WorkflowCompensation`
(fingerprints, state kinds, an operation's failure code and its place in a
retry chain), the syntax rules of one record and of a retry link, and the
private msgspec documents a ledger is encoded to and decoded from (optional
fields written only when set, so a record without them carries no trace of them).
``octo_host.ledger`` builds the ledger on them and re-exports both records.

Pure: it must never do I/O, and never hold raw input, output or worker text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from octo_common.digest import ledger_input_fingerprint
from octo_common.errors import (
    CompensationInputFingerprintMismatch,
    CompensationRequiresSucceededOperation,
    InputFingerprintMismatch,
    InputTooLarge,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidCompensationTenantScope,
    InvalidInputFingerprint,
    InvalidLedgerEncoding,
    InvalidOperationKey,
    InvalidRetryChain,
    InvalidStepId,
    InvalidTool,
)
from octo_common.ids import is_fingerprint, is_token
from octo_common.limits import MAX_WORKFLOW_OPERATION_INPUT_BYTES
from octo_common.states import StateKind, is_failure_code
from octo_host.ledger_json import (
    CompensationOut,
    CompensationOutFailed,
    OperationDoc,
    OperationOut,
    OperationOutFailed,
)
from octo_host.plan import is_step_id
from octo_host.policy import WorkflowCompensationPolicy

__all__ = ["WorkflowCompensation", "WorkflowOperation"]

_COMPENSATION_PREFIX = "cmp-"


def _token(value: object) -> bool:
    return isinstance(value, str) and is_token(value)


def _fingerprint(value: object) -> bool:
    return isinstance(value, str) and is_fingerprint(value)


def _is_workflow_operation_key(value: object) -> bool:
    return _token(value) and not str(value).startswith(_COMPENSATION_PREFIX)


def _is_compensation_key(value: object) -> bool:
    return _token(value) and str(value).startswith(_COMPENSATION_PREFIX)


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _check_input_size(data: bytes) -> None:
    if len(data) > MAX_WORKFLOW_OPERATION_INPUT_BYTES:
        raise InputTooLarge(len(data), MAX_WORKFLOW_OPERATION_INPUT_BYTES)


def _failure_bound(failure: str | None) -> int:
    """What a failure code adds to a record's encoding: ``,"failure":"CODE"``."""
    return 0 if failure is None else 16 + _utf8_len(failure)


def _check_failure(key: str, state: StateKind, failure: str | None) -> None:
    """A failure code only on a ``failed`` record, in the code syntax."""
    if failure is None:
        return
    if state != StateKind.FAILED or not is_failure_code(failure):
        raise InvalidLedgerEncoding(f"{key}: a failure code belongs to a failed state")


def _check_retry(
    retry: WorkflowOperation, replaced: WorkflowOperation | None, already: set[str]
) -> None:
    """A retry continues the earlier attempt it names: the same step, tool and
    input, the next attempt number, a ``failed`` attempt, replaced only once."""
    key = retry.operation_key
    if replaced is None:
        raise InvalidRetryChain(key, "the replaced attempt is not recorded before it")
    if (replaced.step_id, replaced.tool, replaced.input_fingerprint) != (
        retry.step_id,
        retry.tool,
        retry.input_fingerprint,
    ):
        raise InvalidRetryChain(key, "another step, tool or input than the replaced attempt")
    if retry.attempt != replaced.attempt + 1:
        raise InvalidRetryChain(key, "not the next attempt number")
    if replaced.state != StateKind.FAILED:
        raise InvalidRetryChain(key, "the replaced attempt is not failed")
    if replaced.operation_key in already:
        raise InvalidRetryChain(key, "the replaced attempt is replaced twice")


# Records ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkflowCompensation:
    """The one compensation intent of a succeeded operation: fingerprints and a state."""

    compensation_key: str
    input_fingerprint: str
    tenant_scope: str
    grant_fingerprint: str
    state: StateKind
    # Why a ``failed`` compensation is definite (a ``FailureCode`` value), when known.
    failure: str | None = None

    def matches_input(self, data: bytes) -> bool:
        """At most 256 KiB and the same ledger input fingerprint."""
        return (
            len(data) <= MAX_WORKFLOW_OPERATION_INPUT_BYTES
            and ledger_input_fingerprint(data) == self.input_fingerprint
        )

    def verify_input(self, data: bytes) -> None:
        """``InputTooLarge``, then ``CompensationInputFingerprintMismatch(key)``."""
        _check_input_size(data)
        if ledger_input_fingerprint(data) != self.input_fingerprint:
            raise CompensationInputFingerprintMismatch(self.compensation_key)

    def matches_policy(self, policy: WorkflowCompensationPolicy) -> bool:
        """Same tenant scope and grant fingerprint as ``policy``."""
        return (
            self.tenant_scope == policy.tenant_scope
            and self.grant_fingerprint == policy.grant_fingerprint
        )


@dataclass(frozen=True, slots=True)
class WorkflowOperation:
    """One recorded operation: identity, input fingerprint, state kind, compensation.

    A retry (a new key for the same step, tool and input, recorded by a
    step's retry policy) names the attempt it replaces in ``retry_of`` and
    counts itself in ``attempt``; a first attempt is 1 and replaces nothing.
    """

    step_id: str
    tool: str
    operation_key: str
    input_fingerprint: str
    state: StateKind
    compensation: WorkflowCompensation | None = None
    # Why a ``failed`` operation is definite (a ``FailureCode`` value), when known:
    # ``input_refused`` (the worker's adapter did not act), ``resolved_by_operator``, ...
    failure: str | None = None
    retry_of: str | None = None
    attempt: int = 1
    # Set once validate_syntax passed: the record is immutable, so it stays
    # valid, and a ledger re-validated several times per request checks each
    # record once. A changed record (dataclasses.replace) starts unchecked.
    _syntax_valid: bool = field(default=False, init=False, repr=False, compare=False)

    def matches_input(self, data: bytes) -> bool:
        """At most 256 KiB and the same ledger input fingerprint."""
        return (
            len(data) <= MAX_WORKFLOW_OPERATION_INPUT_BYTES
            and ledger_input_fingerprint(data) == self.input_fingerprint
        )

    def verify_input(self, data: bytes) -> None:
        """``InputTooLarge``, then ``InputFingerprintMismatch(operation_key)``."""
        _check_input_size(data)
        if ledger_input_fingerprint(data) != self.input_fingerprint:
            raise InputFingerprintMismatch(self.operation_key)

    def validate_syntax(self) -> None:
        """The operation's syntax, first error wins."""
        if self._syntax_valid:
            return
        self._check_syntax()
        object.__setattr__(self, "_syntax_valid", True)

    def _check_syntax(self) -> None:
        if not is_step_id(self.step_id):
            raise InvalidStepId(self.step_id)
        if not _token(self.tool):
            raise InvalidTool(self.tool)
        if not _is_workflow_operation_key(self.operation_key):
            raise InvalidOperationKey(self.operation_key)
        if not _fingerprint(self.input_fingerprint):
            raise InvalidInputFingerprint()
        _check_failure(self.operation_key, self.state, self.failure)
        attempt = self.attempt
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
            raise InvalidRetryChain(self.operation_key, "attempt is a number from 1")
        if (self.retry_of is None) != (attempt == 1):
            raise InvalidRetryChain(self.operation_key, "only a retry counts past attempt 1")
        if self.retry_of is not None and not _is_workflow_operation_key(self.retry_of):
            raise InvalidRetryChain(self.operation_key, "retry_of is not an operation key")
        compensation = self.compensation
        if compensation is None:
            return
        if self.state != StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(self.operation_key, self.state)
        if not _is_compensation_key(compensation.compensation_key):
            raise InvalidCompensationKey(compensation.compensation_key)
        if not _fingerprint(compensation.input_fingerprint):
            raise InvalidInputFingerprint()
        if not _token(compensation.tenant_scope):
            raise InvalidCompensationTenantScope(compensation.tenant_scope)
        if not _fingerprint(compensation.grant_fingerprint):
            raise InvalidCompensationGrantFingerprint()
        _check_failure(compensation.compensation_key, compensation.state, compensation.failure)


# Strict JSON documents (private) ------------------------------------------------


def _operation_from_doc(doc: OperationDoc) -> WorkflowOperation:
    compensation = None
    if doc.compensation is not None:
        c = doc.compensation
        compensation = WorkflowCompensation(
            c.compensation_key,
            c.input_fingerprint,
            c.tenant_scope,
            c.grant_fingerprint,
            c.state,
            c.failure,
        )
    return WorkflowOperation(
        doc.step_id,
        doc.tool,
        doc.operation_key,
        doc.input_fingerprint,
        doc.state,
        compensation,
        doc.failure,
        doc.retry_of,
        1 if doc.attempt is None else doc.attempt,
    )


def _operation_to_doc(operation: WorkflowOperation) -> OperationOut:
    compensation: CompensationOut | None = None
    c = operation.compensation
    if c is not None:
        fields = (c.compensation_key, c.input_fingerprint, c.tenant_scope, c.grant_fingerprint)
        if c.failure is None:
            compensation = CompensationOut(*fields, c.state)
        else:
            compensation = CompensationOutFailed(*fields, c.state, failure=c.failure)
    fields2 = (
        operation.step_id,
        operation.tool,
        operation.operation_key,
        operation.input_fingerprint,
    )
    retry_of: str | msgspec.UnsetType = (
        msgspec.UNSET if operation.retry_of is None else operation.retry_of
    )
    attempt: int | msgspec.UnsetType = (
        msgspec.UNSET if operation.attempt == 1 else operation.attempt
    )
    if operation.failure is None:
        return OperationOut(*fields2, operation.state, compensation, retry_of, attempt)
    return OperationOutFailed(
        *fields2, operation.state, compensation, retry_of, attempt, failure=operation.failure
    )
