"""The host's workflow operation ledger: pure state machine and strict JSON.

This module owns the ledger's data model (operations and their one
compensation, as fingerprints and state kinds), its syntax rules, the
revision rule, its compact JSON encoding with the conservative size bound and
its strict decoding, and the ledger-level methods that stores and the engine
build on, the compensation lookup included.

It must never store raw input, output, worker error text, step source,
grants, approvals or session data; never call a verifier; never do I/O; and
never leave a ledger half-changed: every method checks everything first and
mutates last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from octo_common.codec import decode_struct, encode_struct
from octo_common.digest import ledger_input_fingerprint
from octo_common.errors import (
    CompensationAlreadyRecorded,
    CompensationPolicyMismatch,
    CompensationRequestMismatch,
    CompensationRequiresSucceededOperation,
    DuplicateOperationKey,
    InvalidCompensationKey,
    InvalidCompensationStateTransition,
    InvalidLedgerEncoding,
    InvalidOperationKey,
    InvalidPlanFingerprint,
    InvalidStateTransition,
    LedgerEncodingError,
    LedgerTooLarge,
    PlanMismatch,
    ReconciliationMismatch,
    RetryNotAllowed,
    RevisionExhausted,
    StaleRevision,
    TooManyOperations,
    UnknownCompensation,
    UnknownOperation,
    UnknownStep,
    UnsupportedLedgerVersion,
)
from octo_common.limits import (
    MAX_U64,
    MAX_WORKFLOW_OPERATION_LEDGER_BYTES,
    MAX_WORKFLOW_OPERATIONS,
    WORKFLOW_OPERATION_LEDGER_FORMAT_VERSION,
)
from octo_common.messages import (
    CompensationReconcileRequest,
    CompensationReconcileResult,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationReconcileRequest,
    OperationReconcileResult,
    Resolution,
)
from octo_common.payload import canonical_operation_input_bytes
from octo_common.states import (
    TERMINAL_KINDS,
    Failed,
    FailureCode,
    OperationStatus,
    StateKind,
    accepts,
)
from octo_host.ledger_json import LedgerDoc, LedgerOut
from octo_host.ledger_records import (
    WorkflowCompensation,
    WorkflowOperation,
    _check_input_size,
    _check_retry,
    _failure_bound,
    _fingerprint,
    _is_compensation_key,
    _operation_from_doc,
    _operation_to_doc,
    _token,
    _utf8_len,
)
from octo_host.plan import WorkflowPlan
from octo_host.policy import WorkflowCompensationPolicy

__all__ = ["WorkflowCompensation", "WorkflowOperation", "WorkflowOperationLedger"]

# The conservative bound, fixed per record plus the variable fields.
_BOUND_BASE = 224
_BOUND_PER_OPERATION = 256
_BOUND_PER_COMPENSATION = 320
# A retry's link and number (written only for a retry): ``,"retry_of":KEY,"attempt":N``.
_BOUND_PER_RETRY = 64


def _decided_state(value: StateKind | str) -> StateKind | None:
    """The state kind an operator decision names, or None for an unknown spelling."""
    try:
        return StateKind(value)
    except (ValueError, TypeError):
        return None


def _failure_of(status: OperationStatus) -> str | None:
    """The failure code a status carries into the ledger (a ``failed`` one's ``code``)."""
    return status.code if isinstance(status, Failed) else None


def _operator_failure(target: StateKind) -> str | None:
    """The failure code an operator's ``failed`` decision leaves in the ledger."""
    return FailureCode.RESOLVED_BY_OPERATOR.value if target == StateKind.FAILED else None


def _next_revision(revision: int) -> int:
    if revision >= MAX_U64:
        raise RevisionExhausted()
    return revision + 1


# The ledger ---------------------------------------------------------------------


class WorkflowOperationLedger:
    """The durable record of one workflow run's operations.

    Mutable in place through its methods (and the engine's); every method
    checks first and mutates last, so a failed call leaves it exactly as it was.
    Ledgers compare equal field by field.
    """

    __slots__ = ("_format_version", "_operations", "_plan_fingerprint", "_revision")

    def __init__(
        self,
        plan_fingerprint: str,
        *,
        revision: int = 0,
        operations: Iterable[WorkflowOperation] = (),
        format_version: int = WORKFLOW_OPERATION_LEDGER_FORMAT_VERSION,
    ) -> None:
        # No validation here: decoding and every method validate explicitly, so a
        # ledger built from untrusted parts still fails closed on first use.
        self._format_version = format_version
        self._revision = revision
        self._plan_fingerprint = plan_fingerprint
        self._operations: list[WorkflowOperation] = list(operations)

    # Accessors ------------------------------------------------------------------

    @property
    def format_version(self) -> int:
        return self._format_version

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def plan_fingerprint(self) -> str:
        return self._plan_fingerprint

    @property
    def operations(self) -> tuple[WorkflowOperation, ...]:
        """Operations in insertion order (a snapshot)."""
        return tuple(self._operations)

    def operation(self, operation_key: str) -> WorkflowOperation | None:
        """The operation with exactly this key, or None."""
        for operation in self._operations:
            if operation.operation_key == operation_key:
                return operation
        return None

    def _index(self, operation_key: str) -> int | None:
        for index, operation in enumerate(self._operations):
            if operation.operation_key == operation_key:
                return index
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkflowOperationLedger):
            return NotImplemented
        return (
            self._format_version == other._format_version
            and self._revision == other._revision
            and self._plan_fingerprint == other._plan_fingerprint
            and self._operations == other._operations
        )

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return (
            f"WorkflowOperationLedger(format_version={self._format_version}, "
            f"revision={self._revision}, plan_fingerprint={self._plan_fingerprint!r}, "
            f"operations={len(self._operations)})"
        )

    def copy(self) -> WorkflowOperationLedger:
        """An independent ledger with the same fields (records are immutable)."""
        return WorkflowOperationLedger(
            self._plan_fingerprint,
            revision=self._revision,
            operations=self._operations,
            format_version=self._format_version,
        )

    # Validation -----------------------------------------------------------------

    def validate_syntax(self) -> None:
        """The ledger's syntax, first error wins."""
        if self._format_version != WORKFLOW_OPERATION_LEDGER_FORMAT_VERSION:
            raise UnsupportedLedgerVersion(self._format_version)
        if not _fingerprint(self._plan_fingerprint):
            raise InvalidPlanFingerprint()
        if len(self._operations) > MAX_WORKFLOW_OPERATIONS:
            raise TooManyOperations(MAX_WORKFLOW_OPERATIONS)
        seen: dict[str, WorkflowOperation] = {}
        replaced: set[str] = set()
        for operation in self._operations:
            operation.validate_syntax()
            if operation.operation_key in seen:
                raise DuplicateOperationKey(operation.operation_key)
            if operation.retry_of is not None:
                _check_retry(operation, seen.get(operation.retry_of), replaced)
                replaced.add(operation.retry_of)
            seen[operation.operation_key] = operation

    def validate_minimum_revision(self, minimum: int) -> None:
        """Syntax, then ``StaleRevision(actual, minimum)`` below the watermark."""
        self.validate_syntax()
        if self._revision < minimum:
            raise StaleRevision(self._revision, minimum)

    def validate_for(self, plan: WorkflowPlan) -> None:
        """Syntax, the plan's fingerprint, and every step id a step of the plan."""
        self.validate_syntax()
        if self._plan_fingerprint != plan.fingerprint:
            raise PlanMismatch()
        for operation in self._operations:
            if not plan.has_step(operation.step_id):
                raise UnknownStep(operation.step_id)

    # Encoding -------------------------------------------------------------------

    def _size_bound(self) -> int:
        bound = _BOUND_BASE
        for op in self._operations:
            bound += (
                _BOUND_PER_OPERATION
                + _utf8_len(op.step_id)
                + _utf8_len(op.tool)
                + _utf8_len(op.operation_key)
                + _utf8_len(op.input_fingerprint)
                + _failure_bound(op.failure)
            )
            if op.retry_of is not None:
                bound += _BOUND_PER_RETRY + _utf8_len(op.retry_of)
            c = op.compensation
            if c is not None:
                bound += (
                    _BOUND_PER_COMPENSATION
                    + _utf8_len(c.compensation_key)
                    + _utf8_len(c.input_fingerprint)
                    + _utf8_len(c.tenant_scope)
                    + _utf8_len(c.grant_fingerprint)
                    + _failure_bound(c.failure)
                )
        return bound

    def to_json(self) -> str:
        """Compact JSON in declaration order: syntax, bound, encode, size."""
        self.validate_syntax()
        if self._size_bound() > MAX_WORKFLOW_OPERATION_LEDGER_BYTES:
            raise LedgerTooLarge()
        doc = LedgerOut(
            self._format_version,
            self._revision,
            self._plan_fingerprint,
            [_operation_to_doc(op) for op in self._operations],
        )
        try:
            data = encode_struct(doc)
        except Exception as exc:
            raise LedgerEncodingError() from exc
        if len(data) > MAX_WORKFLOW_OPERATION_LEDGER_BYTES:
            raise LedgerTooLarge()
        return data.decode("utf-8")

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkflowOperationLedger:
        """Strict decode: size before parse, any parse failure is
        ``InvalidLedgerEncoding``, then ``validate_syntax``."""
        size = _utf8_len(text) if isinstance(text, str) else len(text)
        if size > MAX_WORKFLOW_OPERATION_LEDGER_BYTES:
            raise LedgerTooLarge()
        try:
            doc = decode_struct(text, LedgerDoc, error=InvalidLedgerEncoding)
        except InvalidLedgerEncoding:
            raise
        except Exception as exc:
            # Whatever the strict parser refuses is, for a ledger, a bad encoding.
            raise InvalidLedgerEncoding("ledger JSON refused") from exc
        if doc.revision > MAX_U64:
            raise InvalidLedgerEncoding("revision out of range")
        ledger = cls(
            doc.plan_fingerprint,
            revision=doc.revision,
            operations=[_operation_from_doc(op) for op in doc.operations],
            format_version=doc.format_version,
        )
        ledger.validate_syntax()
        return ledger

    # Mutations ------------------------------------------------------------------

    def record(self, step_id: str, tool: str, operation_key: str, input: bytes) -> None:
        """Append a pending operation. Does not check the step against a plan."""
        self.validate_syntax()
        _check_input_size(input)
        if len(self._operations) >= MAX_WORKFLOW_OPERATIONS:
            raise TooManyOperations(MAX_WORKFLOW_OPERATIONS)
        revision = _next_revision(self._revision)
        operation = WorkflowOperation(
            step_id, tool, operation_key, ledger_input_fingerprint(input), StateKind.PENDING
        )
        operation.validate_syntax()
        if self._index(operation_key) is not None:
            raise DuplicateOperationKey(operation_key)
        self._operations.append(operation)
        self._revision = revision

    def record_retry(self, operation_key: str, retry_key: str) -> WorkflowOperation:
        """Append the next attempt of a ``failed`` operation under ``retry_key``,
        ``pending``, chained to it (``retry_of``, ``attempt`` + 1); returns it.

        Pure chain bookkeeping: whether the step's retry policy allows it,
        and the derivation of ``retry_key``, are the engine's
        (``WorkflowEngine.record_retry``). Errors: ``UnknownOperation``;
        ``RetryNotAllowed`` for an operation that is not ``failed`` or is
        already replaced; ``InvalidOperationKey``, ``DuplicateOperationKey``,
        ``TooManyOperations`` as for :meth:`record`.
        """
        self.validate_syntax()
        index = self._index(operation_key)
        if index is None:
            raise UnknownOperation(operation_key)
        operation = self._operations[index]
        if operation.state != StateKind.FAILED:
            raise RetryNotAllowed(operation_key, f"the attempt is {operation.state.value}")
        if self.replacement(operation_key) is not None:
            raise RetryNotAllowed(operation_key, "the attempt is already replaced")
        if len(self._operations) >= MAX_WORKFLOW_OPERATIONS:
            raise TooManyOperations(MAX_WORKFLOW_OPERATIONS)
        revision = _next_revision(self._revision)
        retry = WorkflowOperation(
            operation.step_id,
            operation.tool,
            retry_key,
            operation.input_fingerprint,
            StateKind.PENDING,
            retry_of=operation_key,
            attempt=operation.attempt + 1,
        )
        retry.validate_syntax()
        if self._index(retry_key) is not None:
            raise DuplicateOperationKey(retry_key)
        self._operations.append(retry)
        self._revision = revision
        return retry

    def replacement(self, operation_key: str) -> WorkflowOperation | None:
        """The retry that replaces ``operation_key``, or None."""
        for operation in self._operations:
            if operation.retry_of == operation_key:
                return operation
        return None

    def attempts(self, operation_key: str) -> tuple[WorkflowOperation, ...]:
        """Every attempt of the logical operation ``operation_key`` belongs to, first
        to latest (empty for an unknown key). At most one of them is ``succeeded``:
        only a ``failed`` attempt is ever replaced."""
        by_key = {operation.operation_key: operation for operation in self._operations}
        current = by_key.get(operation_key)
        if current is None:
            return ()
        while current.retry_of is not None and current.retry_of in by_key:
            current = by_key[current.retry_of]
        chain = [current]
        replaced_by = {op.retry_of: op for op in self._operations if op.retry_of is not None}
        while chain[-1].operation_key in replaced_by:
            chain.append(replaced_by[chain[-1].operation_key])
        return tuple(chain)

    def record_compensation(
        self,
        operation_key: str,
        policy: WorkflowCompensationPolicy,
        compensation_key: str,
        input: bytes,
    ) -> None:
        """Record the one compensation intent of a succeeded operation."""
        self.validate_syntax()
        policy.validate_syntax()
        _check_input_size(input)
        index = self._index(operation_key)
        if index is None:
            raise UnknownOperation(operation_key)
        operation = self._operations[index]
        if operation.state != StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(operation_key, operation.state)
        if operation.tool != policy.tool:
            raise CompensationPolicyMismatch(operation_key)
        if operation.compensation is not None:
            raise CompensationAlreadyRecorded(operation_key)
        if not _is_compensation_key(compensation_key):
            raise InvalidCompensationKey(compensation_key)
        revision = _next_revision(self._revision)
        compensation = WorkflowCompensation(
            compensation_key,
            ledger_input_fingerprint(input),
            policy.tenant_scope,
            policy.grant_fingerprint,
            StateKind.PENDING,
        )
        self._operations[index] = replace(operation, compensation=compensation)
        self._revision = revision

    def reconcile_request(
        self,
        operation_key: str,
        input: bytes | None,
        session_id: str,
        request_id: str,
        *,
        resolution: Resolution | None = None,
    ) -> OperationReconcileRequest:
        """Build a reconcile request for a recorded operation; any state. It
        carries no input: ``input`` (optional) is checked against the fingerprint; with
        ``resolution`` it carries an operator's decision."""
        self.validate_syntax()
        if not _token(operation_key):
            raise InvalidOperationKey(operation_key)
        operation = self.operation(operation_key)
        if operation is None:
            raise UnknownOperation(operation_key)
        if input is not None:
            operation.verify_input(input)
        return OperationReconcileRequest(
            session_id, request_id, operation.tool, operation.operation_key, resolution=resolution
        )

    def apply_verified_reconciliation(
        self, request: OperationReconcileRequest, result: OperationReconcileResult
    ) -> OperationStatus:
        """Apply an authenticated reconciliation or dispatch result.

        Returns the observed status; only its state kind is kept.
        """
        self.validate_syntax()
        request.validate()
        result.validate()
        if not result.matches_request(request):
            raise ReconciliationMismatch()
        status = result.status
        observed = status.kind
        index = self._index(request.operation_key)
        if index is None:
            raise UnknownOperation(request.operation_key)
        operation = self._operations[index]
        if operation.tool != request.tool:
            raise ReconciliationMismatch()
        if not accepts(operation.state, observed):
            raise InvalidStateTransition(operation.state, observed)
        if observed != operation.state:
            revision = _next_revision(self._revision)
            self._operations[index] = replace(
                operation, state=observed, failure=_failure_of(status)
            )
            self._revision = revision
        return status

    def resolve_by_operator(self, operation_key: str, state: StateKind | str) -> StateKind:
        """Record an operator's decision for a stuck operation (no worker answer).

        Only a ``pending`` or ``running`` operation can be resolved, only to a
        terminal state, and only along the one transition table; nothing is
        sent and no effect runs. The ledger keeps the state only: who decided
        and why belong in the audit record the caller writes with it.
        Advances the revision (the state changes by construction). A target
        that is no state spelling at all raises ``InvalidStateTransition``
        (current state, the given value) like any other refused target.
        """
        self.validate_syntax()
        target = _decided_state(state)
        if target is not None and target not in TERMINAL_KINDS:
            raise InvalidStateTransition(StateKind.PENDING, target)
        index = self._index(operation_key)
        if index is None:
            raise UnknownOperation(operation_key)
        operation = self._operations[index]
        if target is None:
            # Not a state spelling at all: refused like any other illegal target.
            raise InvalidStateTransition(operation.state, state)
        if operation.state in TERMINAL_KINDS or not accepts(operation.state, target):
            raise InvalidStateTransition(operation.state, target)
        revision = _next_revision(self._revision)
        self._operations[index] = replace(
            operation, state=target, failure=_operator_failure(target)
        )
        self._revision = revision
        return target

    def compensated_operation(self, compensation_key: str) -> WorkflowOperation | None:
        """The operation whose compensation has exactly this ``cmp-`` key, or None."""
        for operation in self._operations:
            compensation = operation.compensation
            if compensation is not None and compensation.compensation_key == compensation_key:
                return operation
        return None

    def resolve_compensation_by_operator(
        self, compensation_key: str, state: StateKind | str
    ) -> StateKind:
        """Record an operator's decision for a stuck compensation (no worker answer).

        The compensation counterpart of :meth:`resolve_by_operator`: only a
        ``pending`` or ``running`` compensation, only to a terminal state,
        along the one transition table. The original stays ``succeeded``;
        nothing is sent and no inverse runs. Advances the revision. A target
        that is no state spelling raises ``InvalidCompensationStateTransition``.
        """
        self.validate_syntax()
        target = _decided_state(state)
        operation = self.compensated_operation(compensation_key)
        if operation is None or operation.compensation is None:
            raise UnknownCompensation(compensation_key)
        compensation = operation.compensation
        if target is None:
            # Not a state spelling at all: refused like any other illegal target.
            raise InvalidCompensationStateTransition(compensation_key, compensation.state, state)
        if (
            target not in TERMINAL_KINDS
            or compensation.state in TERMINAL_KINDS
            or not accepts(compensation.state, target)
        ):
            raise InvalidCompensationStateTransition(compensation_key, compensation.state, target)
        index = self._index(operation.operation_key)
        assert index is not None  # found above
        revision = _next_revision(self._revision)
        self._operations[index] = replace(
            operation,
            compensation=replace(compensation, state=target, failure=_operator_failure(target)),
        )
        self._revision = revision
        return target

    def apply_verified_compensation(
        self, request: OperationCompensationRequest, result: OperationCompensationResult
    ) -> OperationStatus:
        """Apply an authenticated compensation result; only the
        compensation state can change."""
        index, compensation = self._answered_compensation(request, result)
        compensation.verify_input(canonical_operation_input_bytes(request.payload))
        return self._observe_compensation(index, compensation, request, result.status)

    def compensation_reconcile_request(
        self,
        operation_key: str,
        session_id: str,
        request_id: str,
        *,
        resolution: Resolution | None = None,
    ) -> CompensationReconcileRequest:
        """Build the lookup of an operation's recorded compensation; any state.

        The mirror of :meth:`reconcile_request` for the compensation: the
        request names the compensation exactly as recorded (tool, keys,
        tenant scope, grant fingerprint). A lookup carries no payload, so no
        input is asked for: whoever holds the ledger can resolve a
        compensation a crash left ``pending`` without its inverse input.
        Errors: ``InvalidOperationKey``, ``UnknownOperation``,
        ``UnknownCompensation(operation_key)``, ``InvalidToken`` for bad ids.
        """
        self.validate_syntax()
        if not _token(operation_key):
            raise InvalidOperationKey(operation_key)
        operation = self.operation(operation_key)
        if operation is None:
            raise UnknownOperation(operation_key)
        compensation = operation.compensation
        if compensation is None:
            raise UnknownCompensation(operation_key)
        return CompensationReconcileRequest(
            session_id,
            request_id,
            operation.tool,
            operation.operation_key,
            compensation.compensation_key,
            compensation.tenant_scope,
            compensation.grant_fingerprint,
            resolution=resolution,
        )

    def apply_verified_compensation_reconciliation(
        self, request: CompensationReconcileRequest, result: CompensationReconcileResult
    ) -> OperationStatus:
        """Apply an authenticated compensation lookup; only the compensation moves.

        The mirror of :meth:`apply_verified_reconciliation` with the identity
        checks of :meth:`apply_verified_compensation`: a ``pending`` or
        ``running`` compensation takes the observed state; a terminal one
        only accepts itself (``InvalidCompensationStateTransition``). In
        order: syntax; request; result; all eight identity fields match,
        else ``CompensationRequestMismatch``; the operation (``UnknownOperation``);
        its tool, else ``CompensationRequestMismatch``; its compensation
        (``UnknownCompensation``); the stored compensation key, tenant scope
        and grant fingerprint, else ``CompensationRequestMismatch``; the
        transition. The revision moves only when the state changes. Returns
        the observed status; only its state kind is kept.
        """
        index, compensation = self._answered_compensation(request, result)
        return self._observe_compensation(index, compensation, request, result.status)

    def _answered_compensation(
        self,
        request: OperationCompensationRequest | CompensationReconcileRequest,
        result: OperationCompensationResult | CompensationReconcileResult,
    ) -> tuple[int, WorkflowCompensation]:
        """The recorded compensation a worker answered for, checked in this order:
        syntax, request, result, result against request (``CompensationRequestMismatch``),
        the operation (``UnknownOperation``), its tool, its compensation
        (``UnknownCompensation``). Changes nothing."""
        self.validate_syntax()
        request.validate()
        result.validate()
        if not result.matches_request(request):
            raise CompensationRequestMismatch()
        index = self._index(request.operation_key)
        if index is None:
            raise UnknownOperation(request.operation_key)
        operation = self._operations[index]
        if operation.tool != request.tool:
            raise CompensationRequestMismatch()
        compensation = operation.compensation
        if compensation is None:
            raise UnknownCompensation(operation.operation_key)
        return index, compensation

    def _observe_compensation(
        self,
        index: int,
        compensation: WorkflowCompensation,
        request: OperationCompensationRequest | CompensationReconcileRequest,
        status: OperationStatus,
    ) -> OperationStatus:
        """Check the stored key, tenant and grant fingerprint against ``request``
        (``CompensationRequestMismatch``), then the transition; the compensation
        takes the observed state, the revision moves only on a change."""
        if (
            compensation.compensation_key != request.compensation_key
            or compensation.tenant_scope != request.tenant_scope
            or compensation.grant_fingerprint != request.grant_fingerprint
        ):
            raise CompensationRequestMismatch()
        observed = status.kind
        if not accepts(compensation.state, observed):
            raise InvalidCompensationStateTransition(
                compensation.compensation_key, compensation.state, observed
            )
        if observed != compensation.state:
            revision = _next_revision(self._revision)
            operation = self._operations[index]
            self._operations[index] = replace(
                operation,
                compensation=replace(compensation, state=observed, failure=_failure_of(status)),
            )
            self._revision = revision
        return status
