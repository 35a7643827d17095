"""The workflow engine: plans, ownership, keys, requests, frames and approvals.

It owns the identity counters and every engine method's check order: recording
operations and compensations, building and sealing dispatch, reconciliation
(a lookup, or an operator's decision) and compensation frames, applying
authenticated results, and one-use compensation approvals after the grant and
action verifiers agree. One row per :class:`~octo_host.kinds.RequestKind` says
how its frame is sealed and its reply opened and applied (``apply_reply``).

It must never do I/O (the caller persists the ledger before publishing), run
step source, store raw input or output, catch a verifier's exception, or seal
a compensation without a fresh approval and both verifiers run again (a
compensation lookup performs no effect: sealed like a reconciliation).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from octo_common.digest import compensation_key_for, operation_key_for
from octo_common.errors import (
    ApprovalMismatch,
    CompensationDispatchRequiresHostAuthenticator,
    CompensationPolicyMismatch,
    CompensationRequiresSucceededOperation,
    EmptyOperationNonce,
    InputTooLarge,
    InvalidTool,
    OctoError,
    OperationDispatchRequiresHostAuthenticator,
    OperationNonceTooLarge,
    PlanOwnershipMismatch,
    ReconciliationMismatch,
    ReconciliationRequiresHostAuthenticator,
    UnexpectedCompensationMessage,
    UnexpectedOperationDispatchMessage,
    UnexpectedReconciliationMessage,
    UnknownCompensation,
    UnknownOperation,
    UnknownStep,
    WorkerRequestRejected,
)
from octo_common.frames import SessionAuthenticator, SessionRole
from octo_common.ids import is_token
from octo_common.limits import (
    MAX_U64,
    MAX_WORKFLOW_OPERATION_INPUT_BYTES,
    MAX_WORKFLOW_OPERATION_NONCE_BYTES,
)
from octo_common.messages import (
    CompensateOperation,
    CompensationReconcileRequest,
    CompensationReconcileResult,
    CompensationResult,
    DispatchOperation,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    OperationResult,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    Resolution,
    WorkerMessage,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import OperationStatus, StateKind
from octo_host.compensation import (
    CompensationApproval,
    WorkflowCompensationDispatch,
    WorkflowCompensationTarget,
    _consume_approval,
    _issue_approval,
)
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep, build_plan
from octo_host.policy import WorkflowCompensationPolicy

__all__ = ["OutboundFrame", "WorkflowEngine"]

RequestT_co = TypeVar(
    "RequestT_co",
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationCompensationRequest,
    CompensationReconcileRequest,
    covariant=True,
)


@dataclass(frozen=True, slots=True)
class OutboundFrame(Generic[RequestT_co]):
    """A sealed frame and the request it carries. Publish ``frame`` only
    after the ledger revision that justifies it is durable."""

    request: RequestT_co
    frame: bytes


# Process-wide engine ids start at 1; the lock keeps them unique across threads.
_ENGINE_IDS = itertools.count(1)
_ENGINE_IDS_LOCK = threading.Lock()


def _check_input_size(data: bytes) -> None:
    if len(data) > MAX_WORKFLOW_OPERATION_INPUT_BYTES:
        raise InputTooLarge(len(data), MAX_WORKFLOW_OPERATION_INPUT_BYTES)


def _check_nonce(nonce: bytes) -> None:
    if len(nonce) == 0:
        raise EmptyOperationNonce()
    if len(nonce) > MAX_WORKFLOW_OPERATION_NONCE_BYTES:
        raise OperationNonceTooLarge(len(nonce), MAX_WORKFLOW_OPERATION_NONCE_BYTES)


def _lookup(ledger: WorkflowOperationLedger, operation_key: str) -> WorkflowOperation:
    operation = ledger.operation(operation_key)
    if operation is None:
        raise UnknownOperation(operation_key)
    return operation


class WorkflowEngine:
    """One engine instance: a process-unique id, plans it owns, approvals it issues."""

    __slots__ = ("_engine_id", "_next_approval_nonce", "_next_plan_id")

    def __init__(self) -> None:
        with _ENGINE_IDS_LOCK:
            self._engine_id = next(_ENGINE_IDS)
        self._next_plan_id = 1
        self._next_approval_nonce = 1

    @property
    def engine_id(self) -> int:
        return self._engine_id

    def __repr__(self) -> str:
        return f"WorkflowEngine(engine_id={self._engine_id})"

    # Plans and ledgers -------------------------------------------

    def plan(self, steps: Sequence[WorkflowStep]) -> WorkflowPlan:
        """Check and fingerprint ``steps``; the plan gets this engine's next plan id."""
        plan = build_plan(self._engine_id, self._next_plan_id, steps)
        # Saturating: ids stop at 2^64 - 1 rather than wrap.
        self._next_plan_id = min(self._next_plan_id + 1, MAX_U64)
        return plan

    def _own(self, plan: WorkflowPlan) -> None:
        if plan.engine_id != self._engine_id:
            raise PlanOwnershipMismatch()

    def operation_ledger(self, plan: WorkflowPlan) -> WorkflowOperationLedger:
        """An empty ledger (format 2, revision 0) bound to the plan's fingerprint."""
        self._own(plan)
        return WorkflowOperationLedger(plan.fingerprint)

    def validate_operation_ledger(
        self, plan: WorkflowPlan, ledger: WorkflowOperationLedger
    ) -> None:
        """Own, then syntax, plan fingerprint and step ids."""
        self._own(plan)
        ledger.validate_for(plan)

    def validate_operation_ledger_at_or_after(
        self, plan: WorkflowPlan, ledger: WorkflowOperationLedger, minimum: int
    ) -> None:
        """As ``validate_operation_ledger``, then ``StaleRevision`` below ``minimum``."""
        self.validate_operation_ledger(plan, ledger)
        ledger.validate_minimum_revision(minimum)

    # Operations ----------------------------------------------------

    def derive_operation_key(
        self,
        plan: WorkflowPlan,
        step_id: str,
        tool: str,
        input: bytes,
        nonce: bytes,
    ) -> str:
        """The ``op-`` key for this plan, step, tool, input and nonce."""
        self._own(plan)
        if not plan.has_step(step_id):
            raise UnknownStep(step_id)
        if not is_token(tool):
            raise InvalidTool(tool)
        _check_input_size(input)
        _check_nonce(nonce)
        return operation_key_for(plan.fingerprint, step_id, tool, input, nonce)

    def record_operation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        step_id: str,
        tool: str,
        operation_key: str,
        input: bytes,
    ) -> None:
        """Record a pending operation for a step of the plan (revision + 1)."""
        self._own(plan)
        ledger.validate_for(plan)
        if not plan.has_step(step_id):
            raise UnknownStep(step_id)
        ledger.record(step_id, tool, operation_key, input)

    def record_derived_operation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        step_id: str,
        tool: str,
        input: bytes,
        nonce: bytes,
    ) -> str:
        """Derive the ``op-`` key and record it; returns the key."""
        operation_key = self.derive_operation_key(plan, step_id, tool, input, nonce)
        self.record_operation(plan, ledger, step_id, tool, operation_key, input)
        return operation_key

    # Dispatch -------------------------------------------------------------

    def operation_dispatch_request(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        payload: ToolPayload,
        session_id: str,
        request_id: str,
    ) -> OperationDispatchRequest:
        """The dispatch request for a recorded operation whose input matches (any state)."""
        self.validate_operation_ledger(plan, ledger)
        return self._dispatch_request_of_valid_ledger(
            ledger, operation_key, payload, session_id, request_id
        )

    @staticmethod
    def _dispatch_request_of_valid_ledger(
        ledger: WorkflowOperationLedger,
        operation_key: str,
        payload: ToolPayload,
        session_id: str,
        request_id: str,
    ) -> OperationDispatchRequest:
        # The caller has just validated ``ledger`` for the plan (same call, no await).
        operation = _lookup(ledger, operation_key)
        request = OperationDispatchRequest(
            session_id, request_id, operation.tool, operation.operation_key, payload
        )
        operation.verify_input(canonical_operation_input_bytes(request.payload))
        return request

    def prepare_authenticated_operation_dispatch(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        payload: ToolPayload,
        request_id: str,
        auth: SessionAuthenticator,
    ) -> OutboundFrame[OperationDispatchRequest]:
        """Build the dispatch request for ``auth``'s session and seal it."""
        rule = _RULES[RequestKind.DISPATCH]
        _check_host(rule, auth)
        request = self.operation_dispatch_request(
            plan, ledger, operation_key, payload, auth.session_id, request_id
        )
        return _sealed(rule, auth, request)

    def apply_verified_operation_dispatch_result(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationDispatchRequest,
        result: OperationReconcileResult,
    ) -> OperationStatus:
        """Check ``request`` is exactly what this ledger would send, then apply the
        result as a reconciliation observation."""
        self._own(plan)
        self.validate_operation_ledger(plan, ledger)
        # The ledger was validated just above and nothing changes it before the
        # apply, so the steps below do not validate it again.
        expected = self._dispatch_request_of_valid_ledger(
            ledger,
            request.operation_key,
            request.payload,
            request.session_id,
            request.request_id,
        )
        if expected != request or not result.matches_dispatch(request):
            raise ReconciliationMismatch()
        reconcile = OperationReconcileRequest(
            request.session_id, request.request_id, request.tool, request.operation_key
        )
        return ledger.apply_verified_reconciliation(reconcile, result)

    def apply_authenticated_operation_dispatch_result(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationDispatchRequest,
        auth: SessionAuthenticator,
        frame: bytes,
    ) -> tuple[OperationStatus, OperationReconcileResult]:
        """Open an ``operation_result`` frame and apply it; returns (state, result)."""
        result: OperationReconcileResult = _open_reply(
            _RULES[RequestKind.DISPATCH], request, auth, frame
        )
        state = self.apply_verified_operation_dispatch_result(plan, ledger, request, result)
        return state, result

    # Reconciliation -------------------------------------------------------

    def operation_reconcile_request(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        input: bytes | None,
        session_id: str,
        request_id: str,
        *,
        resolution: Resolution | None = None,
    ) -> OperationReconcileRequest:
        """The reconcile request for a recorded operation (its input, when given, matches)."""
        self.validate_operation_ledger(plan, ledger)
        return ledger.reconcile_request(
            operation_key, input, session_id, request_id, resolution=resolution
        )

    def prepare_authenticated_operation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        input: bytes | None,
        request_id: str,
        auth: SessionAuthenticator,
        *,
        resolution: Resolution | None = None,
    ) -> OutboundFrame[OperationReconcileRequest]:
        """Build the reconcile request for ``auth``'s session and seal it."""
        rule = _RULES[RequestKind.RECONCILE]
        _check_host(rule, auth)
        request = self.operation_reconcile_request(
            plan, ledger, operation_key, input, auth.session_id, request_id, resolution=resolution
        )
        return _sealed(rule, auth, request)

    def apply_verified_operation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationReconcileRequest,
        result: OperationReconcileResult,
    ) -> OperationStatus:
        """Apply an authenticated reconciliation result."""
        self._own(plan)
        ledger.validate_for(plan)
        return ledger.apply_verified_reconciliation(request, result)

    def apply_authenticated_operation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationReconcileRequest,
        auth: SessionAuthenticator,
        frame: bytes,
    ) -> OperationStatus:
        """Open a ``reconciled_operation`` frame and apply it; returns the state."""
        return self.apply_reply(RequestKind.RECONCILE, plan, ledger, request, auth, frame)

    # Compensation keys and records -------------------------------------

    def derive_compensation_key(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        policy: WorkflowCompensationPolicy,
        input: bytes,
        nonce: bytes,
    ) -> str:
        """The ``cmp-`` key of a succeeded operation under ``policy``; no grant,
        no verifier, an existing compensation ignored."""
        self.validate_operation_ledger(plan, ledger)
        policy.validate_syntax()
        operation = _lookup(ledger, operation_key)
        if operation.state != StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(operation_key, operation.state)
        if operation.tool != policy.tool:
            raise CompensationPolicyMismatch(operation_key)
        _check_input_size(input)
        _check_nonce(nonce)
        return compensation_key_for(
            plan.fingerprint,
            operation.operation_key,
            operation.tool,
            policy.tenant_scope,
            policy.grant_fingerprint,
            input,
            nonce,
        )

    def record_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        policy: WorkflowCompensationPolicy,
        compensation_key: str,
        input: bytes,
    ) -> None:
        """Record a compensation intent with **no verifier**; a host records
        through ``record_compensation_with_action_verifier``."""
        self._own(plan)
        ledger.validate_for(plan)
        ledger.record_compensation(operation_key, policy, compensation_key, input)

    def record_derived_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        policy: WorkflowCompensationPolicy,
        input: bytes,
        nonce: bytes,
    ) -> str:
        """Derive the ``cmp-`` key and record it without verifiers; returns the key."""
        compensation_key = self.derive_compensation_key(
            plan, ledger, operation_key, policy, input, nonce
        )
        self.record_compensation(plan, ledger, operation_key, policy, compensation_key, input)
        return compensation_key

    def record_compensation_with_action_verifier(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        target: WorkflowCompensationTarget,
        compensation_key: str,
        input: bytes,
    ) -> None:
        """The hardened recording path: grant verifier, action verifier, then record."""
        self._own(plan)
        ledger.validate_for(plan)
        target.verify_grant_current()
        _check_input_size(input)
        operation = _lookup(ledger, target.operation_key)
        target.verify_action_current(plan, operation, input)
        ledger.record_compensation(target.operation_key, target.policy, compensation_key, input)

    def record_derived_compensation_with_action_verifier(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        target: WorkflowCompensationTarget,
        input: bytes,
        nonce: bytes,
    ) -> str:
        """Derive the ``cmp-`` key, then the hardened recording path; returns the key."""
        compensation_key = self.derive_compensation_key(
            plan, ledger, target.operation_key, target.policy, input, nonce
        )
        self.record_compensation_with_action_verifier(plan, ledger, target, compensation_key, input)
        return compensation_key

    # Approval and sealing ---------------------------------------

    def approve_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        target: WorkflowCompensationTarget,
        input: bytes,
        auth: SessionAuthenticator,
    ) -> CompensationApproval:
        """Issue a one-use approval for the recorded compensation."""
        if auth.role != SessionRole.HOST:
            raise CompensationDispatchRequiresHostAuthenticator()
        self.validate_operation_ledger(plan, ledger)
        target.verify_grant_current()
        policy = target.policy
        operation = _lookup(ledger, target.operation_key)
        if operation.state != StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(operation.operation_key, operation.state)
        if operation.tool != policy.tool:
            raise CompensationPolicyMismatch(operation.operation_key)
        compensation = operation.compensation
        if compensation is None:
            raise UnknownCompensation(operation.operation_key)
        if not compensation.matches_policy(policy):
            raise CompensationPolicyMismatch(operation.operation_key)
        compensation.verify_input(input)
        target.verify_action_current(plan, operation, input)
        nonce = self._next_approval_nonce
        self._next_approval_nonce = min(nonce + 1, MAX_U64)
        return _issue_approval(
            engine_id=self._engine_id,
            plan_id=plan.id,
            nonce=nonce,
            ledger_revision=ledger.revision,
            operation_key=operation.operation_key,
            compensation_key=compensation.compensation_key,
            input_fingerprint=compensation.input_fingerprint,
            tenant_scope=compensation.tenant_scope,
            grant_fingerprint=compensation.grant_fingerprint,
            session_id=auth.session_id,
        )

    def prepare_authenticated_operation_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
        approval: CompensationApproval,
        auth: SessionAuthenticator,
    ) -> OutboundFrame[OperationCompensationRequest]:
        """Seal ``compensate_operation`` under a fresh approval.

        The approval is spent on entry, whatever the outcome.
        """
        fresh = _consume_approval(approval)
        rule = _RULES[RequestKind.COMPENSATE]
        _check_host(rule, auth)
        self.validate_operation_ledger(plan, ledger)
        target.verify_grant_current()
        policy = target.policy
        if (
            not fresh
            or approval.engine_id != self._engine_id
            or approval.plan_id != plan.id
            or approval.nonce == 0
        ):
            raise ApprovalMismatch()
        if (
            approval.ledger_revision != ledger.revision
            or approval.operation_key != target.operation_key
            or approval.tenant_scope != policy.tenant_scope
            or approval.grant_fingerprint != policy.grant_fingerprint
            or approval.session_id != auth.session_id
        ):
            raise ApprovalMismatch()
        operation = _lookup(ledger, target.operation_key)
        if operation.state != StateKind.SUCCEEDED or operation.tool != policy.tool:
            raise ApprovalMismatch()
        compensation = operation.compensation
        if compensation is None:
            raise UnknownCompensation(operation.operation_key)
        if (
            compensation.compensation_key != approval.compensation_key
            or compensation.input_fingerprint != approval.input_fingerprint
            or not compensation.matches_policy(policy)
        ):
            raise ApprovalMismatch()
        binding = OperationCompensationBinding(
            operation.tool,
            operation.operation_key,
            compensation.compensation_key,
            compensation.tenant_scope,
            compensation.grant_fingerprint,
        )
        request = OperationCompensationRequest(
            auth.session_id, dispatch.request_id, binding, dispatch.payload
        )
        canonical_input = canonical_operation_input_bytes(request.payload)
        compensation.verify_input(canonical_input)
        target.verify_action_current(plan, operation, canonical_input)
        return _sealed(rule, auth, request)

    # Compensation results ---------------------------------------------------

    def apply_verified_operation_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationCompensationRequest,
        result: OperationCompensationResult,
    ) -> OperationStatus:
        """Apply an authenticated compensation result; only the compensation state moves."""
        self._own(plan)
        ledger.validate_for(plan)
        return ledger.apply_verified_compensation(request, result)

    def apply_authenticated_operation_compensation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: OperationCompensationRequest,
        auth: SessionAuthenticator,
        frame: bytes,
    ) -> OperationStatus:
        """Open a ``compensation_result`` frame and apply it; returns the state."""
        return self.apply_reply(RequestKind.COMPENSATE, plan, ledger, request, auth, frame)

    # Compensation reconciliation ---------------------------------------------------

    def compensation_reconcile_request(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        session_id: str,
        request_id: str,
        *,
        resolution: Resolution | None = None,
    ) -> CompensationReconcileRequest:
        """The lookup of the compensation recorded for ``operation_key``, in any state
        (with ``resolution``: an operator's decision for it). No verifier, no approval."""
        self.validate_operation_ledger(plan, ledger)
        return ledger.compensation_reconcile_request(
            operation_key, session_id, request_id, resolution=resolution
        )

    def prepare_authenticated_compensation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        operation_key: str,
        request_id: str,
        auth: SessionAuthenticator,
        *,
        resolution: Resolution | None = None,
    ) -> OutboundFrame[CompensationReconcileRequest]:
        """Build the compensation lookup for ``auth``'s session and seal it
        (a worker-role authenticator: ``ReconciliationRequiresHostAuthenticator``)."""
        rule = _RULES[RequestKind.RECONCILE_COMPENSATION]
        _check_host(rule, auth)
        request = self.compensation_reconcile_request(
            plan, ledger, operation_key, auth.session_id, request_id, resolution=resolution
        )
        return _sealed(rule, auth, request)

    def apply_verified_compensation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: CompensationReconcileRequest,
        result: CompensationReconcileResult,
    ) -> OperationStatus:
        """Apply an authenticated compensation lookup; only the compensation state moves."""
        self._own(plan)
        ledger.validate_for(plan)
        return ledger.apply_verified_compensation_reconciliation(request, result)

    def apply_authenticated_compensation_reconciliation(
        self,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: CompensationReconcileRequest,
        auth: SessionAuthenticator,
        frame: bytes,
    ) -> OperationStatus:
        """Open a ``reconciled_compensation`` frame and apply it; returns the state.
        Host role (else ``ReconciliationRequiresHostAuthenticator``), ``open``, a
        matching ``request_rejected`` → ``WorkerRequestRejected``, another type →
        ``UnexpectedReconciliationMessage``, then apply (the host persists it first)."""
        return self.apply_reply(
            RequestKind.RECONCILE_COMPENSATION, plan, ledger, request, auth, frame
        )

    # Replies of every kind ---------------------------------------

    def apply_reply(
        self,
        kind: RequestKind,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: Any,
        auth: SessionAuthenticator,
        frame: bytes,
    ) -> OperationStatus:
        """Open the reply to ``request`` (a request of ``kind``) and apply it; returns the state.
        The checks and order of the kind's ``apply_authenticated_*``: a host authenticator,
        ``open``, this request's refusal raised as ``WorkerRequestRejected``, the expected
        result message, then the kind's ``apply_verified_*`` method."""
        result = self.open_reply(kind, request, auth, frame)
        return self.apply_opened_reply(kind, plan, ledger, request, result)

    def open_reply(
        self, kind: RequestKind, request: Any, auth: SessionAuthenticator, frame: bytes
    ) -> Any:
        """The first half of :meth:`apply_reply`: a host authenticator, ``open``, the
        worker's refusal raised as ``WorkerRequestRejected``, the expected result
        message; returns that message's result. Nothing is applied."""
        return _open_reply(_RULES[kind], request, auth, frame)

    def apply_opened_reply(
        self,
        kind: RequestKind,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        request: Any,
        result: Any,
    ) -> OperationStatus:
        """The second half of :meth:`apply_reply`: the kind's ``apply_verified_*`` method
        on a result :meth:`open_reply` returned.

        A frame opens once (a second ``open`` is a ``DuplicateFrame``): a host
        whose ledger write lost a compare-and-swap to another host applies the
        same result again, with every check, to the ledger the store now holds.
        """
        return _RULES[kind].apply_verified(self, plan, ledger, request, result)


# The per-kind table ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _KindRule:
    """How the engine seals one kind of request and opens and applies its reply."""

    requires_host: type[OctoError]
    """Raised when the authenticator is not the host's."""
    request_message: Callable[[Any], WorkerMessage]
    """The message that carries the request."""
    result_message: (
        type[OperationResult]
        | type[ReconciledOperation]
        | type[CompensationResult]
        | type[ReconciledCompensation]
    )
    """The message that carries the reply's result."""
    unexpected: type[OctoError]
    """Raised for any other authentic message that is not a refusal of this request."""
    apply_verified: Callable[
        [WorkflowEngine, WorkflowPlan, WorkflowOperationLedger, Any, Any], OperationStatus
    ]
    """The engine method that applies the opened result to the ledger."""


_RULES: Final[dict[RequestKind, _KindRule]] = {
    RequestKind.DISPATCH: _KindRule(
        OperationDispatchRequiresHostAuthenticator,
        DispatchOperation,
        OperationResult,
        UnexpectedOperationDispatchMessage,
        WorkflowEngine.apply_verified_operation_dispatch_result,
    ),
    RequestKind.RECONCILE: _KindRule(
        ReconciliationRequiresHostAuthenticator,
        ReconcileOperation,
        ReconciledOperation,
        UnexpectedReconciliationMessage,
        WorkflowEngine.apply_verified_operation_reconciliation,
    ),
    RequestKind.COMPENSATE: _KindRule(
        CompensationDispatchRequiresHostAuthenticator,
        CompensateOperation,
        CompensationResult,
        UnexpectedCompensationMessage,
        WorkflowEngine.apply_verified_operation_compensation,
    ),
    RequestKind.RECONCILE_COMPENSATION: _KindRule(
        ReconciliationRequiresHostAuthenticator,
        ReconcileCompensation,
        ReconciledCompensation,
        UnexpectedReconciliationMessage,
        WorkflowEngine.apply_verified_compensation_reconciliation,
    ),
}


def _check_host(rule: _KindRule, auth: SessionAuthenticator) -> None:
    if auth.role != SessionRole.HOST:
        raise rule.requires_host()


def _sealed(rule: _KindRule, auth: SessionAuthenticator, request: Any) -> OutboundFrame[Any]:
    return OutboundFrame(request, auth.seal(rule.request_message(request)))


def _open_reply(rule: _KindRule, request: Any, auth: SessionAuthenticator, frame: bytes) -> Any:
    """The result a reply to ``request`` carries; the worker's refusal of it is raised."""
    _check_host(rule, auth)
    message = auth.open(frame)
    if isinstance(message, RequestRejected) and message.matches_request(request):
        raise WorkerRequestRejected(message)
    if not isinstance(message, rule.result_message):
        raise rule.unexpected()
    return message.result
