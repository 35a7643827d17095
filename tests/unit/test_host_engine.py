"""WorkflowEngine scenarios: plans, keys, requests, frames, verifiers and approvals.

Every test builds its own engine, plan, ledger and a pair of authenticators for
one session; the worker side of each exchange uses a real worker-role
``SessionAuthenticator`` so frames are really sealed and opened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from octo_common.errors import (
    ApprovalMismatch,
    CompensationActionDenied,
    CompensationAlreadyRecorded,
    CompensationDispatchRequiresHostAuthenticator,
    CompensationGrantDenied,
    CompensationInputFingerprintMismatch,
    CompensationPolicyMismatch,
    CompensationRequiresSucceededOperation,
    DuplicateFrame,
    DuplicateOperationKey,
    EmptyOperationNonce,
    InputFingerprintMismatch,
    InputTooLarge,
    InvalidAuthenticationTag,
    InvalidCompensationKey,
    InvalidCompensationStateTransition,
    InvalidOperationKey,
    InvalidStateTransition,
    InvalidToken,
    InvalidTool,
    OperationBindingMismatch,
    OperationDispatchRequiresHostAuthenticator,
    OperationNonceTooLarge,
    PlanMismatch,
    PlanOwnershipMismatch,
    ReconciliationMismatch,
    ReconciliationRequiresHostAuthenticator,
    RevisionExhausted,
    StaleRevision,
    UnexpectedCompensationMessage,
    UnexpectedOperationDispatchMessage,
    UnexpectedReconciliationMessage,
    UnknownCompensation,
    UnknownOperation,
    UnknownStep,
    WorkerRequestRejected,
)
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    CompensateOperation,
    CompensationResult,
    DispatchOperation,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    OperationResult,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import (
    Cancelled,
    Failed,
    OperationStatus,
    Running,
    StateKind,
    Succeeded,
)
from octo_host.compensation import (
    CompensationApproval,
    WorkflowCompensationAction,
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import OutboundFrame, WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep

# Fixtures --------------------------------------------------------------

STEPS = [WorkflowStep("publish", "let release = true")]
TOOL = "release.publish"
TENANT = "tenant-release"
SESSION = "worker-1"
KEY = bytes(range(1, 33))
OP_KEY = "release-2026-1"
ORIGINAL = ToolPayload.json({"version": "1.2.3", "channel": "stable"})
ORIGINAL_INPUT = canonical_operation_input_bytes(ORIGINAL)
UNDO = ToolPayload.json({"undo": "release"})
UNDO_INPUT = canonical_operation_input_bytes(UNDO)
UNDO_NONCE = b"release-42:publish:undo:1"


class GrantVerifier:
    """Counts calls; refuses with the conventional error while ``refuse`` is set."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, CapabilityGrant]] = []

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.calls.append((tenant_scope, grant))
        if self.refuse:
            raise CompensationGrantDenied(grant.tool, tenant_scope)


class ActionVerifier:
    """Counts calls and keeps every action; refuses while ``refuse`` is set."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.actions: list[WorkflowCompensationAction] = []

    @property
    def calls(self) -> int:
        return len(self.actions)

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        self.actions.append(action)
        if self.refuse:
            raise CompensationActionDenied(action.operation_key, action.tool, action.tenant_scope)


class Boom(Exception):
    """A host verifier's own exception type: must pass through unchanged."""


def authenticators(session: str = SESSION) -> tuple[SessionAuthenticator, SessionAuthenticator]:
    key = SessionKey.from_bytes(KEY)
    return (
        SessionAuthenticator(session, key, SessionRole.HOST),
        SessionAuthenticator(session, key, SessionRole.WORKER),
    )


@dataclass
class World:
    engine: WorkflowEngine
    plan: WorkflowPlan
    ledger: WorkflowOperationLedger
    host: SessionAuthenticator
    worker: SessionAuthenticator
    grant: CapabilityGrant
    policy: WorkflowCompensationPolicy
    grants: GrantVerifier = field(default_factory=GrantVerifier)
    actions: ActionVerifier = field(default_factory=ActionVerifier)

    def target(
        self,
        *,
        operation_key: str = OP_KEY,
        policy: WorkflowCompensationPolicy | None = None,
        grant: CapabilityGrant | None = None,
    ) -> WorkflowCompensationTarget:
        return WorkflowCompensationTarget(
            operation_key,
            policy or self.policy,
            grant or self.grant,
            self.grants,
            self.actions,
        )

    def snapshot(self) -> str:
        return self.ledger.to_json()

    def next_outgoing(self) -> int:
        return int(self.host.export_state().next_outgoing)


def make_world() -> World:
    engine = WorkflowEngine()
    plan = engine.plan(STEPS)
    ledger = engine.operation_ledger(plan)
    host, worker = authenticators()
    grant = CapabilityGrant.json(TOOL).with_compensation_limit(1)
    return World(
        engine, plan, ledger, host, worker, grant, WorkflowCompensationPolicy(TENANT, grant)
    )


def observe(w: World, status: OperationStatus, request_id: str = "r-1") -> OperationStatus:
    """Apply a verified reconciliation result for the original operation."""
    request = w.engine.operation_reconcile_request(
        w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, SESSION, request_id
    )
    result = OperationReconcileResult(SESSION, request_id, TOOL, OP_KEY, status)
    return w.engine.apply_verified_operation_reconciliation(w.plan, w.ledger, request, result)


def recorded(w: World) -> World:
    w.engine.record_operation(w.plan, w.ledger, "publish", TOOL, OP_KEY, ORIGINAL_INPUT)
    return w


def succeeded(w: World) -> World:
    recorded(w)
    observe(w, Succeeded(ToolPayload.json({"published": True})))
    return w


def compensated(w: World) -> str:
    """Original succeeded (revision 2) and its compensation recorded (revision 3)."""
    succeeded(w)
    return w.engine.record_derived_compensation_with_action_verifier(
        w.plan, w.ledger, w.target(), UNDO_INPUT, UNDO_NONCE
    )


def seal_compensation(
    w: World, request_id: str = "compensate-1"
) -> OutboundFrame[OperationCompensationRequest]:
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    return w.engine.prepare_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        w.target(),
        WorkflowCompensationDispatch(request_id, UNDO),
        approval,
        w.host,
    )


def compensation_result_frame(
    w: World, request: OperationCompensationRequest, status: OperationStatus
) -> bytes:
    binding = OperationCompensationBinding(
        request.tool,
        request.operation_key,
        request.compensation_key,
        request.tenant_scope,
        request.grant_fingerprint,
    )
    result = OperationCompensationResult(request.session_id, request.request_id, binding, status)
    return w.worker.seal(CompensationResult(result))


# Engine identity and plans -----------------------------------------------


def test_engine_ids_are_process_unique_and_plans_are_owned_by_their_engine() -> None:
    first, second = WorkflowEngine(), WorkflowEngine()
    assert second.engine_id == first.engine_id + 1
    plan_a, plan_b = first.plan(STEPS), first.plan(STEPS)
    assert (plan_a.id, plan_b.id) == (1, 2)
    assert plan_a.fingerprint == plan_b.fingerprint
    assert plan_a.engine_id == first.engine_id
    with pytest.raises(PlanOwnershipMismatch):
        second.operation_ledger(plan_a)


def test_example_1_record_operation_and_validate_against_rebuilt_plan() -> None:
    w = make_world()
    w.engine.record_operation(w.plan, w.ledger, "publish", TOOL, OP_KEY, b"private request payload")
    assert w.ledger.revision == 1
    text = w.ledger.to_json()
    assert "private request payload" not in text
    assert "let release" not in text
    decoded = WorkflowOperationLedger.from_json(text)
    other_engine = WorkflowEngine()
    rebuilt = other_engine.plan(STEPS)
    other_engine.validate_operation_ledger(rebuilt, decoded)
    with pytest.raises(StaleRevision) as stale:
        other_engine.validate_operation_ledger_at_or_after(rebuilt, decoded, 2)
    assert (stale.value.actual, stale.value.minimum) == (1, 2)
    other_engine.validate_operation_ledger_at_or_after(rebuilt, decoded, 1)
    other_plan = other_engine.plan([WorkflowStep("publish", "let release = false")])
    with pytest.raises(PlanMismatch):
        other_engine.validate_operation_ledger(other_plan, decoded)


def test_validate_operation_ledger_reports_first_step_unknown_to_the_plan() -> None:
    engine = WorkflowEngine()
    wide = engine.plan([WorkflowStep("publish", "x"), WorkflowStep("notify", "y")])
    ledger = engine.operation_ledger(wide)
    engine.record_operation(wide, ledger, "notify", TOOL, "op-1", b"a")
    engine.record_operation(wide, ledger, "publish", TOOL, "op-2", b"b")
    # A ledger with the wide plan's fingerprint but checked against a plan object
    # that only knows "publish" of the same fingerprint is impossible; so forge it.
    narrow = WorkflowPlan(engine.engine_id, 99, wide.fingerprint, (WorkflowStep("publish", "x"),))
    with pytest.raises(UnknownStep) as info:
        engine.validate_operation_ledger(narrow, ledger)
    assert info.value.step_id == "notify"


def test_foreign_plan_is_refused_before_anything_else() -> None:
    w = make_world()
    foreign = WorkflowEngine().plan(STEPS)
    calls: list[Callable[[], object]] = [
        lambda: w.engine.validate_operation_ledger(foreign, w.ledger),
        lambda: w.engine.derive_operation_key(foreign, "nope", "Bad", b"", b""),
        lambda: w.engine.record_operation(foreign, w.ledger, "nope", "Bad", "cmp-x", b""),
        lambda: w.engine.record_compensation(foreign, w.ledger, OP_KEY, w.policy, "x", b""),
        lambda: w.engine.apply_verified_operation_reconciliation(
            foreign,
            w.ledger,
            OperationReconcileRequest(SESSION, "r-1", TOOL, OP_KEY),
            OperationReconcileResult(SESSION, "r-1", TOOL, OP_KEY, Running()),
        ),
        lambda: w.engine.approve_compensation(foreign, w.ledger, w.target(), b"", w.host),
    ]
    for call in calls:
        with pytest.raises(PlanOwnershipMismatch):
            call()


# Operation keys --------------------------------------------------


def test_example_9_operation_key_derivation() -> None:
    w = make_world()
    key = w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"nonce")
    assert key == w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"nonce")
    assert key.startswith("op-") and len(key) == 67
    assert key != w.engine.derive_operation_key(w.plan, "publish", TOOL, b"other", b"nonce")
    assert key != w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"nonce2")
    other_plan = w.engine.plan([WorkflowStep("publish", "let release = false")])
    assert key != w.engine.derive_operation_key(other_plan, "publish", TOOL, b"input", b"nonce")
    with pytest.raises(EmptyOperationNonce):
        w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"")
    with pytest.raises(OperationNonceTooLarge) as too_large:
        w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"n" * 129)
    assert (too_large.value.actual, too_large.value.maximum) == (129, 128)
    w.engine.derive_operation_key(w.plan, "publish", TOOL, b"input", b"n" * 128)
    with pytest.raises(UnknownStep) as unknown:
        w.engine.derive_operation_key(w.plan, "nope", "Bad", b"", b"")
    assert unknown.value.step_id == "nope"


def test_operation_key_derivation_check_order() -> None:
    w = make_world()
    big = b"\0" * 262_145
    with pytest.raises(InvalidTool):
        w.engine.derive_operation_key(w.plan, "publish", "Bad", big, b"")
    with pytest.raises(InputTooLarge) as info:
        w.engine.derive_operation_key(w.plan, "publish", TOOL, big, b"")
    assert (info.value.actual, info.value.maximum) == (262_145, 262_144)
    with pytest.raises(EmptyOperationNonce):
        w.engine.derive_operation_key(w.plan, "publish", TOOL, b"\0" * 262_144, b"")


def test_record_derived_operation_returns_the_derived_key_and_refuses_a_repeat() -> None:
    w = make_world()
    expected = w.engine.derive_operation_key(w.plan, "publish", TOOL, b"in", b"n1")
    key = w.engine.record_derived_operation(w.plan, w.ledger, "publish", TOOL, b"in", b"n1")
    assert key == expected
    assert w.ledger.operation(key) is not None
    assert w.ledger.operation(key).state is StateKind.PENDING  # type: ignore[union-attr]
    before = w.snapshot()
    with pytest.raises(DuplicateOperationKey) as info:
        w.engine.record_derived_operation(w.plan, w.ledger, "publish", TOOL, b"in", b"n1")
    assert info.value.key == key
    assert w.snapshot() == before


def test_example_12_record_operation_refusals() -> None:
    w = make_world()
    with pytest.raises(InvalidOperationKey):
        w.engine.record_operation(w.plan, w.ledger, "publish", TOOL, "cmp-reserved", b"")
    # The unknown step wins over a bad tool and a bad key.
    with pytest.raises(UnknownStep):
        w.engine.record_operation(w.plan, w.ledger, "nope", "Bad", "cmp-reserved", b"")
    recorded(w)
    with pytest.raises(DuplicateOperationKey):
        w.engine.record_operation(w.plan, w.ledger, "publish", TOOL, OP_KEY, b"")
    assert w.ledger.revision == 1


# Dispatch ---------------------------------------


def test_example_3_dispatch_input_drift_and_worker_role() -> None:
    w = recorded(make_world())
    drifted = ToolPayload.json({"version": "1.2.4", "channel": "stable"})
    with pytest.raises(InputFingerprintMismatch) as info:
        w.engine.operation_dispatch_request(w.plan, w.ledger, OP_KEY, drifted, SESSION, "d-1")
    assert info.value.key == OP_KEY
    with pytest.raises(OperationDispatchRequiresHostAuthenticator):
        w.engine.prepare_authenticated_operation_dispatch(
            w.plan, w.ledger, OP_KEY, ORIGINAL, "d-1", w.worker
        )


def test_dispatch_request_canonicalises_the_payload_before_comparing() -> None:
    w = recorded(make_world())
    same = ToolPayload.json({"channel": "stable", "version": "1.2.3"})
    request = w.engine.operation_dispatch_request(w.plan, w.ledger, OP_KEY, same, SESSION, "d-1")
    assert request == OperationDispatchRequest(SESSION, "d-1", TOOL, OP_KEY, same)


def test_dispatch_request_check_order() -> None:
    w = recorded(make_world())
    with pytest.raises(UnknownOperation):
        w.engine.operation_dispatch_request(w.plan, w.ledger, "nope", ORIGINAL, "BAD", "d-1")
    with pytest.raises(InvalidToken):
        w.engine.operation_dispatch_request(
            w.plan, w.ledger, OP_KEY, ToolPayload.text("x"), "BAD", "d"
        )
    with pytest.raises(InputFingerprintMismatch):
        w.engine.operation_dispatch_request(
            w.plan, w.ledger, OP_KEY, ToolPayload.text("x"), SESSION, "d-1"
        )


def test_prepared_dispatch_frame_opens_at_the_worker() -> None:
    w = recorded(make_world())
    before = w.snapshot()
    outbound = w.engine.prepare_authenticated_operation_dispatch(
        w.plan, w.ledger, OP_KEY, ORIGINAL, "d-1", w.host
    )
    assert isinstance(outbound, OutboundFrame)
    assert w.worker.open(outbound.frame) == DispatchOperation(outbound.request)
    assert outbound.request == OperationDispatchRequest(SESSION, "d-1", TOOL, OP_KEY, ORIGINAL)
    assert w.snapshot() == before


def test_example_4_reconciled_message_is_not_a_dispatch_result() -> None:
    w = recorded(make_world())
    outbound = w.engine.prepare_authenticated_operation_dispatch(
        w.plan, w.ledger, OP_KEY, ORIGINAL, "d-1", w.host
    )
    result = OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Running())
    frame = w.worker.seal(ReconciledOperation(result))
    before = w.snapshot()
    with pytest.raises(UnexpectedOperationDispatchMessage):
        w.engine.apply_authenticated_operation_dispatch_result(
            w.plan, w.ledger, outbound.request, w.host, frame
        )
    assert w.snapshot() == before
    # open() succeeded before the type check, so the sequence is spent.
    with pytest.raises(DuplicateFrame):
        w.host.open(frame)


def test_example_21_dispatch_results() -> None:
    w = recorded(make_world())
    outbound = w.engine.prepare_authenticated_operation_dispatch(
        w.plan, w.ledger, OP_KEY, ORIGINAL, "d-1", w.host
    )
    request = outbound.request
    assert isinstance(request, OperationDispatchRequest)
    running = OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Running())
    for _ in range(2):
        frame = w.worker.seal(OperationResult(running))
        state, result = w.engine.apply_authenticated_operation_dispatch_result(
            w.plan, w.ledger, request, w.host, frame
        )
        assert state == Running() and result == running
        assert w.ledger.revision == 2
    wrong_request_id = OperationReconcileResult(SESSION, "d-2", TOOL, OP_KEY, Running())
    with pytest.raises(ReconciliationMismatch):
        w.engine.apply_verified_operation_dispatch_result(
            w.plan, w.ledger, request, wrong_request_id
        )
    other_tool = OperationDispatchRequest(SESSION, "d-1", "other.tool", OP_KEY, ORIGINAL)
    with pytest.raises(ReconciliationMismatch):
        w.engine.apply_verified_operation_dispatch_result(w.plan, w.ledger, other_tool, running)
    other_payload = OperationDispatchRequest(SESSION, "d-1", TOOL, OP_KEY, ToolPayload.text("x"))
    with pytest.raises(InputFingerprintMismatch):
        w.engine.apply_verified_operation_dispatch_result(w.plan, w.ledger, other_payload, running)
    other_key = OperationDispatchRequest(SESSION, "d-1", TOOL, "release-2026-2", ORIGINAL)
    with pytest.raises(UnknownOperation):
        w.engine.apply_verified_operation_dispatch_result(w.plan, w.ledger, other_key, running)
    payload = ToolPayload.json({"published": True})
    done = OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Succeeded(payload))
    state = w.engine.apply_verified_operation_dispatch_result(w.plan, w.ledger, request, done)
    assert state == Succeeded(payload)
    assert w.ledger.revision == 3
    cancelled = OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Cancelled())
    with pytest.raises(InvalidStateTransition) as info:
        w.engine.apply_verified_operation_dispatch_result(w.plan, w.ledger, request, cancelled)
    assert (info.value.current, info.value.observed) == (StateKind.SUCCEEDED, StateKind.CANCELLED)
    assert w.ledger.revision == 3
    assert "published" not in w.snapshot()


def test_matching_request_rejected_raises_worker_request_rejected() -> None:
    w = recorded(make_world())
    outbound = w.engine.prepare_authenticated_operation_dispatch(
        w.plan, w.ledger, OP_KEY, ORIGINAL, "d-1", w.host
    )
    rejection = RequestRejected(SESSION, "d-1", "pending_operation", OP_KEY)
    before = w.snapshot()
    with pytest.raises(WorkerRequestRejected) as info:
        w.engine.apply_authenticated_operation_dispatch_result(
            w.plan, w.ledger, outbound.request, w.host, w.worker.seal(rejection)
        )
    assert info.value.rejection.code == "pending_operation"
    assert info.value.rejection.operation_key == OP_KEY
    assert w.snapshot() == before
    # A rejection for another request is just an unexpected message.
    other = RequestRejected(SESSION, "d-9", "pending_operation", OP_KEY)
    with pytest.raises(UnexpectedOperationDispatchMessage):
        w.engine.apply_authenticated_operation_dispatch_result(
            w.plan, w.ledger, outbound.request, w.host, w.worker.seal(other)
        )


def test_example_18_reconcile_requests() -> None:
    w = recorded(make_world())
    with pytest.raises(InvalidOperationKey):
        w.engine.operation_reconcile_request(w.plan, w.ledger, "Bad", b"", SESSION, "r-1")
    with pytest.raises(UnknownOperation):
        w.engine.operation_reconcile_request(w.plan, w.ledger, "cmp-x", b"", SESSION, "r-1")
    with pytest.raises(InputTooLarge):
        w.engine.operation_reconcile_request(
            w.plan, w.ledger, OP_KEY, b"\0" * 262_145, SESSION, "r-1"
        )
    with pytest.raises(InputFingerprintMismatch):
        w.engine.operation_reconcile_request(w.plan, w.ledger, OP_KEY, b"x", SESSION, "r-1")
    with pytest.raises(InvalidToken):
        w.engine.operation_reconcile_request(w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, "S", "r-1")
    observe(w, Failed("boom"))
    # Terminal operations still yield both requests.
    assert w.engine.operation_reconcile_request(
        w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, SESSION, "r-2"
    ) == OperationReconcileRequest(SESSION, "r-2", TOOL, OP_KEY)
    w.engine.operation_dispatch_request(w.plan, w.ledger, OP_KEY, ORIGINAL, SESSION, "d-1")


# Reconciliation --------------------------------------


def test_example_10_reconciliation_states_and_revisions() -> None:
    w = recorded(make_world())
    payload = ToolPayload.json({"secret-output": "do-not-store"})
    steps: list[tuple[OperationStatus, int]] = [
        (Running(), 2),
        (Succeeded(payload), 3),
        (Succeeded(payload), 3),
        (Succeeded(ToolPayload.text("different")), 3),
    ]
    for number, (status, revision) in enumerate(steps):
        outbound = w.engine.prepare_authenticated_operation_reconciliation(
            w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, f"r-{number}", w.host
        )
        request = outbound.request
        assert isinstance(request, OperationReconcileRequest)
        assert w.worker.open(outbound.frame) == ReconcileOperation(request)
        result = OperationReconcileResult(SESSION, f"r-{number}", TOOL, OP_KEY, status)
        state = w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, w.worker.seal(ReconciledOperation(result))
        )
        assert state == status
        assert w.ledger.revision == revision
    with pytest.raises(InvalidStateTransition) as info:
        observe(w, Failed("late failure"))
    assert (info.value.current, info.value.observed) == (StateKind.SUCCEEDED, StateKind.FAILED)
    assert w.ledger.revision == 3
    assert "do-not-store" not in w.snapshot()


def test_example_11_tampered_frame_then_original_then_duplicate() -> None:
    w = recorded(make_world())
    request = w.engine.operation_reconcile_request(
        w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, SESSION, "r-1"
    )
    result = OperationReconcileResult(SESSION, "r-1", TOOL, OP_KEY, Running())
    frame = w.worker.seal(ReconciledOperation(result))
    tampered = frame.replace(b'"running"', b'"cancelled"')
    assert tampered != frame
    before = w.snapshot()
    with pytest.raises(InvalidAuthenticationTag):
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, tampered
        )
    assert w.snapshot() == before
    assert (
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, frame
        )
        == Running()
    )
    assert w.ledger.revision == 2
    with pytest.raises(DuplicateFrame) as info:
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, frame
        )
    assert info.value.sequence == 1
    assert w.ledger.revision == 2


def test_reconciliation_with_worker_role_and_wrong_message_type() -> None:
    w = recorded(make_world())
    with pytest.raises(ReconciliationRequiresHostAuthenticator):
        w.engine.prepare_authenticated_operation_reconciliation(
            w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, "r-1", w.worker
        )
    request = w.engine.operation_reconcile_request(
        w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, SESSION, "r-1"
    )
    result = OperationReconcileResult(SESSION, "r-1", TOOL, OP_KEY, Running())
    frame = w.worker.seal(OperationResult(result))
    with pytest.raises(ReconciliationRequiresHostAuthenticator):
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.worker, frame
        )
    with pytest.raises(UnexpectedReconciliationMessage):
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, frame
        )
    rejection = RequestRejected(SESSION, "r-1", "unknown_operation", OP_KEY)
    with pytest.raises(WorkerRequestRejected) as info:
        w.engine.apply_authenticated_operation_reconciliation(
            w.plan, w.ledger, request, w.host, w.worker.seal(rejection)
        )
    assert info.value.rejection.code == "unknown_operation"
    assert w.ledger.revision == 1


def test_reconciliation_result_for_another_request_or_tool_is_a_mismatch() -> None:
    w = recorded(make_world())
    request = w.engine.operation_reconcile_request(
        w.plan, w.ledger, OP_KEY, ORIGINAL_INPUT, SESSION, "r-1"
    )
    for result in (
        OperationReconcileResult(SESSION, "r-2", TOOL, OP_KEY, Running()),
        OperationReconcileResult("worker-2", "r-1", TOOL, OP_KEY, Running()),
    ):
        with pytest.raises(ReconciliationMismatch):
            w.engine.apply_verified_operation_reconciliation(w.plan, w.ledger, request, result)
    # Request and result agree with each other but not with the recorded tool.
    other = OperationReconcileRequest(SESSION, "r-1", "other.tool", OP_KEY)
    result = OperationReconcileResult(SESSION, "r-1", "other.tool", OP_KEY, Running())
    with pytest.raises(ReconciliationMismatch):
        w.engine.apply_verified_operation_reconciliation(w.plan, w.ledger, other, result)
    assert w.ledger.revision == 1


# Compensation keys -------------------------------------------------------------


@pytest.mark.parametrize(
    "status",
    [None, Running(), Failed("boom"), Cancelled()],
    ids=["pending", "running", "failed", "cancelled"],
)
def test_compensation_refused_for_unsucceeded_originals_without_verifier_calls(
    status: OperationStatus | None,
) -> None:
    w = recorded(make_world())
    if status is not None:
        observe(w, status)
    expected_state = StateKind.PENDING if status is None else status.kind
    before = w.snapshot()
    calls: list[Callable[[], object]] = [
        lambda: w.engine.record_derived_compensation(
            w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, UNDO_NONCE
        ),
        lambda: w.engine.record_derived_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), UNDO_INPUT, UNDO_NONCE
        ),
    ]
    for call in calls:
        with pytest.raises(CompensationRequiresSucceededOperation) as info:
            call()
        assert (info.value.operation_key, info.value.state) == (OP_KEY, expected_state)
    assert (len(w.grants.calls), w.actions.calls) == (0, 0)
    assert w.snapshot() == before


def test_explicit_key_on_pending_original_runs_both_verifiers_then_refuses() -> None:
    w = recorded(make_world())
    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), "cmp-explicit", UNDO_INPUT
        )
    assert info.value.state is StateKind.PENDING
    assert (len(w.grants.calls), w.actions.calls) == (1, 1)
    assert w.ledger.revision == 1


def test_compensation_key_derivation_order_and_shape() -> None:
    w = succeeded(make_world())
    key = w.engine.derive_compensation_key(w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"n")
    assert key.startswith("cmp-") and len(key) == 68
    assert key == w.engine.derive_compensation_key(
        w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"n"
    )
    assert key != w.engine.derive_compensation_key(
        w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"m"
    )
    other_tenant = WorkflowCompensationPolicy("tenant-other", w.grant)
    assert key != w.engine.derive_compensation_key(
        w.plan, w.ledger, OP_KEY, other_tenant, UNDO_INPUT, b"n"
    )
    other_grant = CapabilityGrant.json(TOOL).with_compensation_limit(2)
    assert key != w.engine.derive_compensation_key(
        w.plan, w.ledger, OP_KEY, WorkflowCompensationPolicy(TENANT, other_grant), UNDO_INPUT, b"n"
    )
    with pytest.raises(UnknownOperation):
        w.engine.derive_compensation_key(w.plan, w.ledger, "nope", w.policy, b"\0" * 300_000, b"")
    other_tool = WorkflowCompensationPolicy(
        TENANT, CapabilityGrant.json("other.tool").with_compensation_limit(1)
    )
    with pytest.raises(CompensationPolicyMismatch):
        w.engine.derive_compensation_key(w.plan, w.ledger, OP_KEY, other_tool, b"\0" * 300_000, b"")
    with pytest.raises(InputTooLarge):
        w.engine.derive_compensation_key(w.plan, w.ledger, OP_KEY, w.policy, b"\0" * 262_145, b"")
    with pytest.raises(EmptyOperationNonce):
        w.engine.derive_compensation_key(w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"")
    with pytest.raises(OperationNonceTooLarge):
        w.engine.derive_compensation_key(w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"n" * 129)
    # Derivation ignores an existing compensation and calls no verifier.
    compensated_key = w.engine.record_derived_compensation(
        w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"n"
    )
    assert compensated_key == key
    assert key == w.engine.derive_compensation_key(
        w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, b"n"
    )
    assert (len(w.grants.calls), w.actions.calls) == (0, 0)


def test_record_compensation_without_verifiers_validates_the_key() -> None:
    w = succeeded(make_world())
    with pytest.raises(InvalidCompensationKey):
        w.engine.record_compensation(w.plan, w.ledger, OP_KEY, w.policy, "op-x", UNDO_INPUT)
    w.engine.record_compensation(w.plan, w.ledger, OP_KEY, w.policy, "cmp-x", UNDO_INPUT)
    assert w.ledger.revision == 3
    with pytest.raises(CompensationAlreadyRecorded):
        w.engine.record_compensation(w.plan, w.ledger, OP_KEY, w.policy, "cmp-y", UNDO_INPUT)
    assert (len(w.grants.calls), w.actions.calls) == (0, 0)


def test_second_compensation_calls_both_verifiers_then_is_refused() -> None:
    w = make_world()
    compensated(w)
    assert (len(w.grants.calls), w.actions.calls) == (1, 1)
    before = w.snapshot()
    with pytest.raises(CompensationAlreadyRecorded) as info:
        w.engine.record_derived_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), UNDO_INPUT, b"release-42:publish:undo:2"
        )
    assert info.value.operation_key == OP_KEY
    assert (len(w.grants.calls), w.actions.calls) == (2, 2)
    assert w.snapshot() == before


def test_hardened_record_check_order() -> None:
    w = succeeded(make_world())
    # A refusing grant verifier wins over an oversized input and an unknown key.
    w.grants.refuse = True
    with pytest.raises(CompensationGrantDenied):
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(operation_key="nope"), "cmp-x", b"\0" * 262_145
        )
    w.grants.refuse = False
    with pytest.raises(InputTooLarge):
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(operation_key="nope"), "cmp-x", b"\0" * 262_145
        )
    with pytest.raises(UnknownOperation):
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(operation_key="nope"), "cmp-x", UNDO_INPUT
        )
    assert w.actions.calls == 0
    # The action verifier runs before the key syntax check.
    w.actions.refuse = True
    with pytest.raises(CompensationActionDenied):
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), "op-not-cmp", UNDO_INPUT
        )
    w.actions.refuse = False
    with pytest.raises(InvalidCompensationKey):
        w.engine.record_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), "op-not-cmp", UNDO_INPUT
        )
    assert w.ledger.revision == 2


def test_grant_drift_is_a_policy_mismatch_before_the_grant_verifier() -> None:
    w = succeeded(make_world())
    for grant in (
        CapabilityGrant.json(TOOL).with_compensation_limit(2),
        CapabilityGrant.json(TOOL),
        CapabilityGrant.json("other.tool").with_compensation_limit(1),
    ):
        with pytest.raises(CompensationPolicyMismatch) as info:
            w.engine.record_derived_compensation_with_action_verifier(
                w.plan, w.ledger, w.target(grant=grant), UNDO_INPUT, UNDO_NONCE
            )
        assert info.value.key == OP_KEY
    assert (len(w.grants.calls), w.actions.calls) == (0, 0)
    assert w.ledger.revision == 2


def test_verifier_exceptions_propagate_unchanged() -> None:
    w = succeeded(make_world())

    class Raising:
        def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
            raise Boom("grant")

        def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
            raise Boom("action")

    raising = Raising()
    target = WorkflowCompensationTarget(OP_KEY, w.policy, w.grant, raising, w.actions)
    with pytest.raises(Boom, match="grant"):
        w.engine.record_derived_compensation_with_action_verifier(
            w.plan, w.ledger, target, UNDO_INPUT, UNDO_NONCE
        )
    target = WorkflowCompensationTarget(OP_KEY, w.policy, w.grant, w.grants, raising)
    with pytest.raises(Boom, match="action"):
        w.engine.record_derived_compensation_with_action_verifier(
            w.plan, w.ledger, target, UNDO_INPUT, UNDO_NONCE
        )
    assert w.ledger.revision == 2


def test_action_verifier_sees_the_exact_action() -> None:
    w = make_world()
    compensated(w)
    action = w.actions.actions[0]
    operation = w.ledger.operation(OP_KEY)
    assert operation is not None
    assert action.plan_fingerprint == w.plan.fingerprint
    assert action.operation_key == OP_KEY
    assert action.step_id == "publish"
    assert action.tool == TOOL
    assert action.original_input_fingerprint == operation.input_fingerprint
    assert action.tenant_scope == TENANT
    assert action.grant is w.grant
    assert action.compensation_input == UNDO_INPUT
    assert w.grants.calls == [(TENANT, w.grant)]


def test_target_bound_to_another_operation_is_a_binding_mismatch() -> None:
    w = succeeded(make_world())
    operation = w.ledger.operation(OP_KEY)
    assert operation is not None
    with pytest.raises(OperationBindingMismatch) as info:
        w.target(operation_key="release-2026-9").verify_action_current(
            w.plan, operation, UNDO_INPUT
        )
    assert info.value.key == "release-2026-9"
    assert w.actions.calls == 0


# The golden path and the verifier table ---------------------


def test_example_5_golden_path_with_verifier_counts() -> None:
    w = make_world()
    key = compensated(w)
    assert w.ledger.revision == 3 and w.actions.calls == 1
    # Persistence stand-in: the ledger is written and read back before approval.
    w.ledger = WorkflowOperationLedger.from_json(w.ledger.to_json())
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert w.actions.calls == 2
    before_seal = w.next_outgoing()
    with pytest.raises(CompensationInputFingerprintMismatch) as drift:
        w.engine.prepare_authenticated_operation_compensation(
            w.plan,
            w.ledger,
            w.target(),
            WorkflowCompensationDispatch("compensate-1", ToolPayload.json({"undo": "different"})),
            approval,
            w.host,
        )
    assert drift.value.compensation_key == key
    assert w.actions.calls == 2
    assert w.next_outgoing() == before_seal
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert w.actions.calls == 3
    outbound = w.engine.prepare_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        w.target(),
        WorkflowCompensationDispatch("compensate-1", UNDO),
        approval,
        w.host,
    )
    assert w.actions.calls == 4
    assert len(w.grants.calls) == 5
    assert w.ledger.revision == 3
    opened = w.worker.open(outbound.frame)
    assert isinstance(opened, CompensateOperation)
    request = opened.request
    assert request == outbound.request
    assert (request.compensation_key, request.operation_key, request.tool) == (key, OP_KEY, TOOL)
    assert (request.tenant_scope, request.grant_fingerprint) == (TENANT, w.policy.grant_fingerprint)
    original_before = w.ledger.operation(OP_KEY)
    state = w.engine.apply_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        outbound.request,
        w.host,
        compensation_result_frame(w, request, Succeeded(ToolPayload.json({"undone": True}))),
    )
    assert state == Succeeded(ToolPayload.json({"undone": True}))
    after = w.ledger.operation(OP_KEY)
    assert after is not None and original_before is not None
    assert after.compensation is not None and original_before.compensation is not None
    assert after.compensation.state is StateKind.SUCCEEDED
    assert after.state is StateKind.SUCCEEDED
    assert (after.step_id, after.tool, after.input_fingerprint) == (
        original_before.step_id,
        original_before.tool,
        original_before.input_fingerprint,
    )
    assert after.compensation.compensation_key == original_before.compensation.compensation_key
    assert w.ledger.revision == 4
    assert "undone" not in w.snapshot()
    # Editing the stored ledger so the original is running fails decoding.
    edited = w.ledger.to_json().replace(
        '"state":"succeeded","compensation"', '"state":"running","compensation"'
    )
    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        WorkflowOperationLedger.from_json(edited)
    assert (info.value.operation_key, info.value.state) == (OP_KEY, StateKind.RUNNING)


def test_example_6_derived_compensation_on_pending_original() -> None:
    w = recorded(make_world())
    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        w.engine.record_derived_compensation(
            w.plan, w.ledger, OP_KEY, w.policy, UNDO_INPUT, UNDO_NONCE
        )
    assert info.value.state is StateKind.PENDING
    assert (len(w.grants.calls), w.actions.calls) == (0, 0)


def test_example_7_refusing_grant_verifier_wins_over_unknown_operation() -> None:
    w = make_world()
    w.grants.refuse = True
    with pytest.raises(CompensationGrantDenied) as info:
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert (info.value.tool, info.value.tenant_scope) == (TOOL, TENANT)
    # Prepare with an approval issued while the verifier agreed: the same refusal.
    other = make_world()
    compensated(other)
    approval = other.engine.approve_compensation(
        other.plan, other.ledger, other.target(), UNDO_INPUT, other.host
    )
    other.grants.refuse = True
    before = other.next_outgoing()
    with pytest.raises(CompensationGrantDenied):
        other.engine.prepare_authenticated_operation_compensation(
            other.plan,
            other.ledger,
            other.target(),
            WorkflowCompensationDispatch("compensate-1", UNDO),
            approval,
            other.host,
        )
    assert other.next_outgoing() == before
    # A refused grant is reported even with an unusable (spent) approval.
    with pytest.raises(CompensationGrantDenied):
        other.engine.prepare_authenticated_operation_compensation(
            other.plan,
            other.ledger,
            other.target(),
            WorkflowCompensationDispatch("compensate-1", UNDO),
            approval,
            other.host,
        )


def test_example_8_refusing_action_verifier() -> None:
    w = succeeded(make_world())
    w.actions.refuse = True
    with pytest.raises(CompensationActionDenied) as info:
        w.engine.record_derived_compensation_with_action_verifier(
            w.plan, w.ledger, w.target(), UNDO_INPUT, UNDO_NONCE
        )
    assert (info.value.operation_key, info.value.tool, info.value.tenant_scope) == (
        OP_KEY,
        TOOL,
        TENANT,
    )
    assert w.ledger.revision == 2
    operation = w.ledger.operation(OP_KEY)
    assert operation is not None and operation.compensation is None
    w.actions.refuse = False
    key = w.engine.record_derived_compensation_with_action_verifier(
        w.plan, w.ledger, w.target(), UNDO_INPUT, UNDO_NONCE
    )
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    w.actions.refuse = True
    before = w.next_outgoing()
    with pytest.raises(CompensationActionDenied):
        w.engine.prepare_authenticated_operation_compensation(
            w.plan,
            w.ledger,
            w.target(),
            WorkflowCompensationDispatch("compensate-1", UNDO),
            approval,
            w.host,
        )
    assert w.next_outgoing() == before
    stored = w.ledger.operation(OP_KEY)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.compensation_key == key
    assert approval.consumed


def test_refusing_action_verifier_stops_approval() -> None:
    w = make_world()
    compensated(w)
    w.actions.refuse = True
    with pytest.raises(CompensationActionDenied):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)


def test_approve_check_order() -> None:
    w = make_world()
    with pytest.raises(CompensationDispatchRequiresHostAuthenticator):
        w.engine.approve_compensation(
            WorkflowEngine().plan(STEPS), w.ledger, w.target(), UNDO_INPUT, w.worker
        )
    with pytest.raises(UnknownOperation):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    recorded(w)
    with pytest.raises(CompensationRequiresSucceededOperation):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    observe(w, Succeeded(ToolPayload.text("ok")))
    with pytest.raises(UnknownCompensation) as unknown:
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert unknown.value.operation_key == OP_KEY
    other_tool_grant = CapabilityGrant.json("other.tool").with_compensation_limit(1)
    other_tool = WorkflowCompensationPolicy(TENANT, other_tool_grant)
    with pytest.raises(CompensationPolicyMismatch):
        w.engine.approve_compensation(
            w.plan,
            w.ledger,
            w.target(policy=other_tool, grant=other_tool_grant),
            UNDO_INPUT,
            w.host,
        )
    assert w.actions.calls == 0


def test_example_16_policy_and_input_drift_at_approval() -> None:
    w = make_world()
    compensated(w)
    wider = CapabilityGrant.json(TOOL).with_compensation_limit(2)
    with pytest.raises(CompensationPolicyMismatch):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(grant=wider), UNDO_INPUT, w.host)
    other_tenant = WorkflowCompensationPolicy("tenant-other", w.grant)
    with pytest.raises(CompensationPolicyMismatch) as tenant:
        w.engine.approve_compensation(
            w.plan, w.ledger, w.target(policy=other_tenant), UNDO_INPUT, w.host
        )
    assert tenant.value.key == OP_KEY
    with pytest.raises(CompensationInputFingerprintMismatch):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), b"other", w.host)
    with pytest.raises(InputTooLarge):
        w.engine.approve_compensation(w.plan, w.ledger, w.target(), b"\0" * 262_145, w.host)
    # Every refusal above came before the action verifier.
    assert w.actions.calls == 1


# Approvals --------------------------------------------------


def _prepare(
    w: World, approval: CompensationApproval, **kwargs: Any
) -> OutboundFrame[OperationCompensationRequest]:
    return w.engine.prepare_authenticated_operation_compensation(
        kwargs.get("plan", w.plan),
        kwargs.get("ledger", w.ledger),
        kwargs.get("target", w.target()),
        kwargs.get("dispatch", WorkflowCompensationDispatch("compensate-1", UNDO)),
        approval,
        kwargs.get("auth", w.host),
    )


def test_example_14_revision_drift_voids_the_approval() -> None:
    w = make_world()
    compensated(w)
    first = seal_compensation(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    w.engine.apply_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        first.request,
        w.host,
        compensation_result_frame(w, first.request, Running()),
    )
    assert w.ledger.revision == 4
    before = w.next_outgoing()
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval)
    assert w.next_outgoing() == before


def test_example_14_other_session_plan_and_engine() -> None:
    w = make_world()
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    other_host, _ = authenticators("worker-2")
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval, auth=other_host)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    same_steps = w.engine.plan(STEPS)
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval, plan=same_steps)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    other_engine = WorkflowEngine()
    other_plan = other_engine.plan(STEPS)
    with pytest.raises(ApprovalMismatch):
        other_engine.prepare_authenticated_operation_compensation(
            other_plan,
            w.ledger,
            w.target(),
            WorkflowCompensationDispatch("compensate-1", UNDO),
            approval,
            w.host,
        )
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    with pytest.raises(PlanOwnershipMismatch):
        other_engine.prepare_authenticated_operation_compensation(
            w.plan,
            w.ledger,
            w.target(),
            WorkflowCompensationDispatch("compensate-1", UNDO),
            approval,
            w.host,
        )
    # Each failure spent its approval.
    assert approval.consumed


def test_example_14_reused_approval() -> None:
    w = make_world()
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    _prepare(w, approval)
    before = w.next_outgoing()
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval)
    assert w.next_outgoing() == before


def test_approval_is_consumed_on_entry_even_when_the_role_is_wrong() -> None:
    w = make_world()
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    with pytest.raises(CompensationDispatchRequiresHostAuthenticator):
        _prepare(w, approval, auth=w.worker)
    assert approval.consumed
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval)


def test_not_an_approval_is_an_approval_mismatch() -> None:
    w = make_world()
    compensated(w)
    with pytest.raises(ApprovalMismatch):
        _prepare(w, object())  # type: ignore[arg-type]


def test_approval_binding_drift_at_prepare() -> None:
    w = make_world()
    compensated(w)
    drifts: list[dict[str, Any]] = [
        {"target": w.target(operation_key="release-2026-9")},
        {"target": w.target(policy=WorkflowCompensationPolicy("tenant-other", w.grant))},
    ]
    other_grant = CapabilityGrant.json(TOOL).with_compensation_limit(2)
    drifts.append(
        {
            "target": w.target(
                policy=WorkflowCompensationPolicy(TENANT, other_grant), grant=other_grant
            )
        }
    )
    for drift in drifts:
        approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
        before = w.next_outgoing()
        with pytest.raises(ApprovalMismatch):
            _prepare(w, approval, **drift)
        assert w.next_outgoing() == before


def test_tool_drift_fails_closed_before_sealing() -> None:
    w = make_world()
    compensated(w)
    other_grant = CapabilityGrant.json("other.tool").with_compensation_limit(1)
    other = w.target(policy=WorkflowCompensationPolicy(TENANT, other_grant), grant=other_grant)
    with pytest.raises(CompensationPolicyMismatch):
        w.engine.approve_compensation(w.plan, w.ledger, other, UNDO_INPUT, w.host)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    before = w.next_outgoing()
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval, target=other)
    assert w.next_outgoing() == before


def test_prepare_request_errors_come_before_the_action_verifier() -> None:
    w = make_world()
    compensated(w)
    calls = w.actions.calls
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    with pytest.raises(InvalidToken) as info:
        _prepare(w, approval, dispatch=WorkflowCompensationDispatch("Bad Id", UNDO))
    assert info.value.field == "request id"
    assert w.actions.calls == calls + 1
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    with pytest.raises(CompensationInputFingerprintMismatch):
        _prepare(w, approval, dispatch=WorkflowCompensationDispatch("c-1", ToolPayload.text("x")))
    assert w.actions.calls == calls + 2


def test_prepare_passes_the_canonical_bytes_to_the_action_verifier() -> None:
    w = make_world()
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    reordered = ToolPayload.json({"undo": "release"})
    _prepare(w, approval, dispatch=WorkflowCompensationDispatch("c-1", reordered))
    assert w.actions.actions[-1].compensation_input == UNDO_INPUT


def test_prepare_refuses_when_the_compensation_is_gone_or_the_original_changed() -> None:
    w = make_world()
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    # A ledger at the same revision without the compensation (e.g. a rolled back copy).
    operation = w.ledger.operation(OP_KEY)
    assert operation is not None and operation.compensation is not None
    stored = operation.compensation
    bare = WorkflowOperationLedger(
        w.ledger.plan_fingerprint,
        revision=w.ledger.revision,
        operations=[replace(operation, compensation=None)],
    )
    with pytest.raises(UnknownCompensation):
        _prepare(w, approval, ledger=bare)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    other_key = WorkflowOperationLedger(
        w.ledger.plan_fingerprint,
        revision=w.ledger.revision,
        operations=[
            replace(
                operation,
                compensation=replace(stored, compensation_key="cmp-other"),
            )
        ],
    )
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval, ledger=other_key)


def test_example_15_after_success_the_same_key_can_be_sent_again() -> None:
    w = make_world()
    key = compensated(w)
    first = seal_compensation(w)
    w.engine.apply_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        first.request,
        w.host,
        compensation_result_frame(w, first.request, Succeeded(UNDO)),
    )
    assert w.ledger.revision == 4
    again = seal_compensation(w, "compensate-2")
    assert again.request.compensation_key == key
    # The repeated success is idempotent, a later failure is refused.
    state = w.engine.apply_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        again.request,
        w.host,
        compensation_result_frame(w, again.request, Succeeded(UNDO)),
    )
    assert state == Succeeded(UNDO) and w.ledger.revision == 4
    with pytest.raises(InvalidCompensationStateTransition) as info:
        w.engine.apply_authenticated_operation_compensation(
            w.plan,
            w.ledger,
            again.request,
            w.host,
            compensation_result_frame(w, again.request, Failed("late")),
        )
    assert (info.value.compensation_key, info.value.current, info.value.observed) == (
        key,
        StateKind.SUCCEEDED,
        StateKind.FAILED,
    )
    assert w.ledger.revision == 4


def test_compensation_results_change_only_the_compensation_state() -> None:
    w = make_world()
    compensated(w)
    outbound = seal_compensation(w)
    request = outbound.request
    assert isinstance(request, OperationCompensationRequest)
    original = w.ledger.operation(OP_KEY)
    for status, revision in ((Running(), 4), (Running(), 4), (Cancelled(), 5)):
        w.engine.apply_authenticated_operation_compensation(
            w.plan, w.ledger, request, w.host, compensation_result_frame(w, request, status)
        )
        assert w.ledger.revision == revision
        current = w.ledger.operation(OP_KEY)
        assert current is not None and original is not None
        assert current.compensation is not None and original.compensation is not None
        assert current.compensation.state is status.kind
        assert current == type(current)(
            original.step_id,
            original.tool,
            original.operation_key,
            original.input_fingerprint,
            original.state,
            type(original.compensation)(
                original.compensation.compensation_key,
                original.compensation.input_fingerprint,
                original.compensation.tenant_scope,
                original.compensation.grant_fingerprint,
                status.kind,
            ),
        )


def test_compensation_result_frames_of_the_wrong_kind() -> None:
    w = make_world()
    compensated(w)
    outbound = seal_compensation(w)
    request = outbound.request
    assert isinstance(request, OperationCompensationRequest)
    with pytest.raises(CompensationDispatchRequiresHostAuthenticator):
        w.engine.apply_authenticated_operation_compensation(
            w.plan, w.ledger, request, w.worker, b"{}"
        )
    wrong = OperationReconcileResult(SESSION, "compensate-1", TOOL, OP_KEY, Running())
    with pytest.raises(UnexpectedCompensationMessage):
        w.engine.apply_authenticated_operation_compensation(
            w.plan, w.ledger, request, w.host, w.worker.seal(OperationResult(wrong))
        )
    rejection = RequestRejected(
        SESSION, "compensate-1", "pending_compensation", OP_KEY, request.compensation_key
    )
    with pytest.raises(WorkerRequestRejected) as info:
        w.engine.apply_authenticated_operation_compensation(
            w.plan, w.ledger, request, w.host, w.worker.seal(rejection)
        )
    assert info.value.rejection.compensation_key == request.compensation_key
    mismatched = RequestRejected(
        SESSION, "compensate-1", "pending_compensation", OP_KEY, "cmp-other"
    )
    with pytest.raises(UnexpectedCompensationMessage):
        w.engine.apply_authenticated_operation_compensation(
            w.plan, w.ledger, request, w.host, w.worker.seal(mismatched)
        )
    assert w.ledger.revision == 3


def test_verifiers_are_not_called_when_applying_results() -> None:
    w = make_world()
    compensated(w)
    outbound = seal_compensation(w)
    calls = (len(w.grants.calls), w.actions.calls)
    w.grants.refuse = w.actions.refuse = True
    w.engine.apply_authenticated_operation_compensation(
        w.plan,
        w.ledger,
        outbound.request,
        w.host,
        compensation_result_frame(w, outbound.request, Running()),
    )
    assert (len(w.grants.calls), w.actions.calls) == calls


def test_approval_nonces_count_up_per_engine() -> None:
    w = make_world()
    compensated(w)
    first = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    second = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert (first.nonce, second.nonce) == (1, 2)
    assert (first.engine_id, first.plan_id, first.ledger_revision) == (
        w.engine.engine_id,
        w.plan.id,
        3,
    )
    assert first.session_id == SESSION
    assert not first.consumed
    assert w.ledger.revision == 3


# Error text ------------------------------------------------------------------


def test_error_text_escapes_untrusted_values() -> None:
    w = make_world()
    hostile = "\x1b[2J" + "x" * 512
    with pytest.raises(InvalidTool) as info:
        w.engine.record_operation(w.plan, w.ledger, "publish", hostile, OP_KEY, b"")
    text = str(info.value)
    assert "\\x1b[2J" in text
    assert "\x1b" not in text
    assert "preview truncated" in text
    assert len(text.encode()) < 768
    assert info.value.tool == hostile
    with pytest.raises(UnknownStep) as step:
        w.engine.derive_operation_key(w.plan, "a`b\\c\n", TOOL, b"", b"n")
    assert "`a\\`b\\\\c\\x0a`" in str(step.value)


def test_any_ledger_change_voids_an_approval() -> None:
    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "let release = true"), WorkflowStep("notify", "")])
    host, _ = authenticators()
    grant = CapabilityGrant.json(TOOL).with_compensation_limit(1)
    w = World(
        engine,
        plan,
        engine.operation_ledger(plan),
        host,
        authenticators()[1],
        grant,
        WorkflowCompensationPolicy(TENANT, grant),
    )
    compensated(w)
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    w.engine.record_operation(w.plan, w.ledger, "notify", "notify.send", "notify-1", b"")
    before = w.next_outgoing()
    with pytest.raises(ApprovalMismatch):
        _prepare(w, approval)
    assert w.next_outgoing() == before
    # A fresh approval at the new revision works.
    approval = w.engine.approve_compensation(w.plan, w.ledger, w.target(), UNDO_INPUT, w.host)
    assert _prepare(w, approval).request.compensation_key.startswith("cmp-")


def test_example_20_engine_accepts_the_ceiling_watermark() -> None:
    w = recorded(make_world())
    text = w.ledger.to_json().replace('"revision":1', f'"revision":{2**64 - 1}')
    ledger = WorkflowOperationLedger.from_json(text)
    w.engine.validate_operation_ledger_at_or_after(w.plan, ledger, 2**64 - 1)
    with pytest.raises(RevisionExhausted):
        w.engine.record_operation(w.plan, ledger, "publish", TOOL, "release-2026-2", b"")
    assert ledger.to_json() == text
