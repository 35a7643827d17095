"""The host's side of compensation reconciliation: the ledger transition and
the engine methods that build, seal and apply a compensation lookup.

The mirror of operation reconciliation with the
identity of a compensation: a ``pending`` or ``running``
compensation takes the observed state, a terminal one never changes, and the
original operation is never touched. No input and no approval: a lookup
performs no effect. Frames are really sealed and opened by a host and a
worker ``SessionAuthenticator``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from octo_common.errors import (
    CompensationRequestMismatch,
    DuplicateFrame,
    InvalidAuthenticationTag,
    InvalidCompensationStateTransition,
    InvalidOperationKey,
    InvalidToken,
    OctoError,
    PlanMismatch,
    PlanOwnershipMismatch,
    ReconciliationRequiresHostAuthenticator,
    RevisionExhausted,
    UnexpectedReconciliationMessage,
    UnknownCompensation,
    UnknownOperation,
    WorkerRequestRejected,
)
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    CompensationReconcileRequest,
    CompensationReconcileResult,
    CompensationResult,
    OperationCompensationBinding,
    OperationCompensationResult,
    OperationReconcileResult,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
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
from octo_host.compensation import WorkflowCompensationPolicy
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowCompensation, WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep

STEPS = [WorkflowStep("publish", "let release = true")]
TOOL = "release.publish"
TENANT = "tenant-release"
SESSION = "worker-1"
KEY = bytes(range(1, 33))
OP_KEY = "release-2026-1"
ORIGINAL_INPUT = canonical_operation_input_bytes(
    ToolPayload.json({"version": "1.2.3", "channel": "stable"})
)
UNDO_INPUT = canonical_operation_input_bytes(ToolPayload.json({"undo": "release"}))
UNDO_NONCE = b"release-42:publish:undo:1"
MAX_U64 = 2**64 - 1
REMOVED = Succeeded(ToolPayload.json({"removed": True}))


@dataclass
class World:
    engine: WorkflowEngine
    plan: WorkflowPlan
    ledger: WorkflowOperationLedger
    host: SessionAuthenticator
    worker: SessionAuthenticator
    grant: CapabilityGrant
    cmp_key: str = ""

    def lookup(self, request_id: str = "rc-1") -> CompensationReconcileRequest:
        return self.engine.compensation_reconcile_request(
            self.plan, self.ledger, OP_KEY, SESSION, request_id
        )

    def answer(self, request: CompensationReconcileRequest, status: OperationStatus) -> bytes:
        """The worker's sealed ``reconciled_compensation`` for ``request``."""
        result = CompensationReconcileResult(
            request.session_id,
            request.request_id,
            request.tool,
            request.operation_key,
            request.compensation_key,
            request.tenant_scope,
            request.grant_fingerprint,
            status,
        )
        return self.worker.seal(ReconciledCompensation(result))

    def apply(self, request: CompensationReconcileRequest, frame: bytes) -> OperationStatus:
        return self.engine.apply_authenticated_compensation_reconciliation(
            self.plan, self.ledger, request, self.host, frame
        )

    def compensation(self) -> WorkflowCompensation:
        operation = self.ledger.operation(OP_KEY)
        assert operation is not None and operation.compensation is not None
        return operation.compensation


def compensated_world() -> World:
    """The original succeeded (revision 2), its compensation recorded ``pending`` (3)."""
    engine = WorkflowEngine()
    plan = engine.plan(STEPS)
    ledger = engine.operation_ledger(plan)
    key = SessionKey.from_bytes(KEY)
    host = SessionAuthenticator(SESSION, key, SessionRole.HOST)
    worker = SessionAuthenticator(SESSION, key, SessionRole.WORKER)
    grant = CapabilityGrant.json(TOOL).with_compensation_limit(1)
    w = World(engine, plan, ledger, host, worker, grant)
    engine.record_operation(plan, ledger, "publish", TOOL, OP_KEY, ORIGINAL_INPUT)
    reconcile = engine.operation_reconcile_request(
        plan, ledger, OP_KEY, ORIGINAL_INPUT, SESSION, "r-0"
    )
    engine.apply_verified_operation_reconciliation(
        plan,
        ledger,
        reconcile,
        OperationReconcileResult(SESSION, "r-0", TOOL, OP_KEY, Succeeded(ToolPayload.json({}))),
    )
    w.cmp_key = engine.record_derived_compensation(
        plan, ledger, OP_KEY, WorkflowCompensationPolicy(TENANT, grant), UNDO_INPUT, UNDO_NONCE
    )
    assert ledger.revision == 3
    return w


def unchanged(w: World, error: type[OctoError], call: object) -> OctoError:
    """Run ``call``, expect ``error``, and check the ledger did not move at all."""
    before = w.ledger.to_json()
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    assert w.ledger.to_json() == before
    return info.value


# The request -------------------------------------------------------------------------


def test_the_lookup_names_the_recorded_compensation_exactly() -> None:
    w = compensated_world()
    request = w.lookup()
    recorded = w.compensation()
    assert request == CompensationReconcileRequest(
        SESSION,
        "rc-1",
        TOOL,
        OP_KEY,
        recorded.compensation_key,
        TENANT,
        w.grant.compensation_fingerprint(),
    )
    assert recorded.compensation_key == w.cmp_key
    assert w.ledger.revision == 3  # building a request changes nothing


def test_the_lookup_is_sealed_without_input_or_approval() -> None:
    # A lookup performs no effect: built from the ledger alone and sealed as
    # the session's next frame, like an operation reconciliation.
    w = compensated_world()
    before = w.host.export_state().next_outgoing
    outbound = w.engine.prepare_authenticated_compensation_reconciliation(
        w.plan, w.ledger, OP_KEY, "rc-1", w.host
    )
    assert w.host.export_state().next_outgoing == before + 1
    assert w.worker.open(outbound.frame) == ReconcileCompensation(outbound.request)
    assert outbound.request == w.lookup()
    assert w.ledger.revision == 3


def test_a_lookup_can_be_built_for_a_terminal_compensation() -> None:
    w = compensated_world()
    w.apply(w.lookup("rc-1"), w.answer(w.lookup("rc-1"), Failed("inverse refused")))
    assert w.compensation().state is StateKind.FAILED
    assert w.lookup("rc-2").compensation_key == w.cmp_key


def test_a_lookup_of_what_the_ledger_does_not_hold_is_refused() -> None:
    w = compensated_world()
    for key, error in (
        ("Bad Key", InvalidOperationKey),
        ("op-unknown", UnknownOperation),
        ("cmp-" + "0" * 8, UnknownOperation),  # a cmp- key is no operation key here
    ):
        unchanged(
            w,
            error,
            lambda key=key: w.engine.compensation_reconcile_request(
                w.plan, w.ledger, key, SESSION, "rc-1"
            ),
        )
    unchanged(
        w,
        InvalidToken,
        lambda: w.engine.compensation_reconcile_request(
            w.plan, w.ledger, OP_KEY, SESSION, "Bad Id"
        ),
    )
    # An operation without a compensation (recorded, never compensated).
    engine = WorkflowEngine()
    plan = engine.plan(STEPS)
    ledger = engine.operation_ledger(plan)
    engine.record_operation(plan, ledger, "publish", TOOL, OP_KEY, ORIGINAL_INPUT)
    with pytest.raises(UnknownCompensation) as info:
        engine.compensation_reconcile_request(plan, ledger, OP_KEY, SESSION, "rc-1")
    assert info.value.operation_key == OP_KEY


def test_the_engine_checks_ownership_and_the_plan_first() -> None:
    w = compensated_world()
    other_engine = WorkflowEngine()
    other_plan = other_engine.plan([WorkflowStep("other", "x")])
    with pytest.raises(PlanOwnershipMismatch):
        w.engine.compensation_reconcile_request(other_plan, w.ledger, OP_KEY, SESSION, "rc-1")
    foreign = w.engine.plan([WorkflowStep("other", "x")])
    with pytest.raises(PlanMismatch):
        w.engine.compensation_reconcile_request(foreign, w.ledger, OP_KEY, SESSION, "rc-1")
    request = w.lookup()
    result = CompensationReconcileResult(
        SESSION,
        "rc-1",
        TOOL,
        OP_KEY,
        w.cmp_key,
        TENANT,
        w.grant.compensation_fingerprint(),
        REMOVED,
    )
    unchanged(
        w,
        PlanOwnershipMismatch,
        lambda: w.engine.apply_verified_compensation_reconciliation(
            other_plan, w.ledger, request, result
        ),
    )
    unchanged(
        w,
        PlanMismatch,
        lambda: w.engine.apply_verified_compensation_reconciliation(
            foreign, w.ledger, request, result
        ),
    )


# Applying the answer ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "observed",
    [REMOVED, Failed("inverse refused"), Cancelled()],
    ids=["succeeded", "failed", "cancelled"],
)
def test_a_pending_compensation_takes_the_observed_terminal_state(
    observed: OperationStatus,
) -> None:
    w = compensated_world()
    original = w.ledger.operation(OP_KEY)
    request = w.lookup()

    assert w.apply(request, w.answer(request, observed)) == observed

    assert w.compensation().state is observed.kind
    assert w.ledger.revision == 4
    current = w.ledger.operation(OP_KEY)
    assert original is not None and original.compensation is not None
    # Only the compensation's state moved: the original and the identity are as recorded.
    assert current == WorkflowOperation(
        original.step_id,
        original.tool,
        original.operation_key,
        original.input_fingerprint,
        StateKind.SUCCEEDED,
        WorkflowCompensation(
            original.compensation.compensation_key,
            original.compensation.input_fingerprint,
            original.compensation.tenant_scope,
            original.compensation.grant_fingerprint,
            observed.kind,
        ),
    )
    assert "removed" not in w.ledger.to_json()  # the payload is never stored


def test_running_then_terminal_and_idempotent_answers_move_the_revision_only_on_change() -> None:
    w = compensated_world()
    answers: list[tuple[OperationStatus, int]] = [
        (Running(), 4),
        (Running(), 4),
        (REMOVED, 5),
        (REMOVED, 5),
        (Succeeded(ToolPayload.json({"removed": "again"})), 5),  # state kinds only
    ]
    for number, (status, revision) in enumerate(answers):
        request = w.lookup(f"rc-{number}")
        assert w.apply(request, w.answer(request, status)) == status
        assert w.ledger.revision == revision
    assert w.compensation().state is StateKind.SUCCEEDED


@pytest.mark.parametrize(
    ("terminal", "observed"),
    [
        (REMOVED, Failed("late")),
        (REMOVED, Running()),
        (REMOVED, Cancelled()),
        (Failed("inverse refused"), REMOVED),
        (Cancelled(), Running()),
    ],
)
def test_a_terminal_compensation_never_changes(
    terminal: OperationStatus, observed: OperationStatus
) -> None:
    w = compensated_world()
    first = w.lookup("rc-1")
    w.apply(first, w.answer(first, terminal))
    second = w.lookup("rc-2")
    frame = w.answer(second, observed)

    error = unchanged(w, InvalidCompensationStateTransition, lambda: w.apply(second, frame))
    assert (error.compensation_key, error.current, error.observed) == (  # type: ignore[attr-defined]
        w.cmp_key,
        terminal.kind,
        observed.kind,
    )


@pytest.mark.parametrize(
    ("field_name", "value"),
    [
        ("session_id", "worker-2"),
        ("request_id", "rc-9"),
        ("tool", "other.tool"),
        ("operation_key", "op-other"),
        ("compensation_key", "cmp-other"),
        ("tenant_scope", "tenant-other"),
        ("grant_fingerprint", "f" * 64),
    ],
)
def test_an_answer_for_another_identity_is_a_mismatch(field_name: str, value: str) -> None:
    w = compensated_world()
    request = w.lookup()
    fields = {
        "session_id": SESSION,
        "request_id": "rc-1",
        "tool": TOOL,
        "operation_key": OP_KEY,
        "compensation_key": w.cmp_key,
        "tenant_scope": TENANT,
        "grant_fingerprint": w.grant.compensation_fingerprint(),
        field_name: value,
    }
    result = CompensationReconcileResult(**fields, status=REMOVED)  # type: ignore[arg-type]
    unchanged(
        w,
        CompensationRequestMismatch,
        lambda: w.engine.apply_verified_compensation_reconciliation(
            w.plan, w.ledger, request, result
        ),
    )


@pytest.mark.parametrize(
    ("field_name", "value", "error"),
    [
        ("tool", "other.tool", CompensationRequestMismatch),
        ("compensation_key", "cmp-other", CompensationRequestMismatch),
        ("tenant_scope", "tenant-other", CompensationRequestMismatch),
        ("grant_fingerprint", "f" * 64, CompensationRequestMismatch),
        ("operation_key", "op-other", UnknownOperation),
    ],
)
def test_a_request_and_answer_that_agree_but_not_with_the_record_are_refused(
    field_name: str, value: str, error: type[OctoError]
) -> None:
    w = compensated_world()
    fields = {
        "session_id": SESSION,
        "request_id": "rc-1",
        "tool": TOOL,
        "operation_key": OP_KEY,
        "compensation_key": w.cmp_key,
        "tenant_scope": TENANT,
        "grant_fingerprint": w.grant.compensation_fingerprint(),
        field_name: value,
    }
    request = CompensationReconcileRequest(**fields)  # type: ignore[arg-type]
    result = CompensationReconcileResult(**fields, status=REMOVED)  # type: ignore[arg-type]
    unchanged(
        w,
        error,
        lambda: w.engine.apply_verified_compensation_reconciliation(
            w.plan, w.ledger, request, result
        ),
    )


def test_an_operation_without_a_compensation_is_an_unknown_compensation() -> None:
    w = compensated_world()
    request = w.lookup()
    result = CompensationReconcileResult(
        SESSION,
        "rc-1",
        TOOL,
        OP_KEY,
        w.cmp_key,
        TENANT,
        w.grant.compensation_fingerprint(),
        REMOVED,
    )
    bare = WorkflowOperationLedger(
        w.ledger.plan_fingerprint,
        revision=2,
        operations=[WorkflowOperation("publish", TOOL, OP_KEY, "ab" * 32, StateKind.SUCCEEDED)],
    )
    with pytest.raises(UnknownCompensation):
        bare.apply_verified_compensation_reconciliation(request, result)
    assert bare.revision == 2


def test_the_revision_ceiling_refuses_a_change_but_not_an_idempotent_answer() -> None:
    w = compensated_world()
    operation = w.ledger.operation(OP_KEY)
    assert operation is not None and operation.compensation is not None
    request = w.lookup()
    result = CompensationReconcileResult(
        SESSION,
        "rc-1",
        TOOL,
        OP_KEY,
        w.cmp_key,
        TENANT,
        w.grant.compensation_fingerprint(),
        Running(),
    )

    def at_ceiling(state: StateKind) -> WorkflowOperationLedger:
        compensation = WorkflowCompensation(
            operation.compensation.compensation_key,  # type: ignore[union-attr]
            operation.compensation.input_fingerprint,  # type: ignore[union-attr]
            TENANT,
            w.grant.compensation_fingerprint(),
            state,
        )
        return WorkflowOperationLedger(
            w.ledger.plan_fingerprint,
            revision=MAX_U64,
            operations=[replace(operation, compensation=compensation)],
        )

    pending = at_ceiling(StateKind.PENDING)
    with pytest.raises(RevisionExhausted):
        pending.apply_verified_compensation_reconciliation(request, result)
    assert pending.operation(OP_KEY) == operation
    running = at_ceiling(StateKind.RUNNING)
    assert running.apply_verified_compensation_reconciliation(request, result) == Running()
    assert running.revision == MAX_U64


# Frames ------------------------------------------------------------------------------------


def test_a_tampered_answer_fails_before_any_change_then_the_original_applies_once() -> None:
    w = compensated_world()
    request = w.lookup()
    frame = w.answer(request, REMOVED)
    tampered = frame.replace(b'"removed":true', b'"removed":false')
    assert tampered != frame

    unchanged(w, InvalidAuthenticationTag, lambda: w.apply(request, tampered))
    assert w.apply(request, frame) == REMOVED
    assert w.ledger.revision == 4
    with pytest.raises(DuplicateFrame):
        w.apply(request, frame)
    assert w.ledger.revision == 4


def test_a_worker_role_authenticator_is_refused_as_for_any_reconciliation() -> None:
    w = compensated_world()
    with pytest.raises(ReconciliationRequiresHostAuthenticator):
        w.engine.prepare_authenticated_compensation_reconciliation(
            w.plan, w.ledger, OP_KEY, "rc-1", w.worker
        )
    request = w.lookup()
    frame = w.answer(request, REMOVED)
    unchanged(
        w,
        ReconciliationRequiresHostAuthenticator,
        lambda: w.engine.apply_authenticated_compensation_reconciliation(
            w.plan, w.ledger, request, w.worker, frame
        ),
    )
    # Nothing was opened: the frame still applies with the host.
    assert w.apply(request, frame) == REMOVED


def test_a_worker_refusal_is_reported_and_changes_nothing() -> None:
    w = compensated_world()
    request = w.lookup()
    rejection = RequestRejected(SESSION, "rc-1", "adapter_error", OP_KEY, w.cmp_key)
    error = unchanged(w, WorkerRequestRejected, lambda: w.apply(request, w.worker.seal(rejection)))
    assert error.rejection_code == "adapter_error"  # type: ignore[attr-defined]
    assert w.compensation().state is StateKind.PENDING


def test_other_messages_are_unexpected() -> None:
    w = compensated_world()
    request = w.lookup()
    binding = OperationCompensationBinding(
        TOOL, OP_KEY, w.cmp_key, TENANT, w.grant.compensation_fingerprint()
    )
    for message in (
        CompensationResult(OperationCompensationResult(SESSION, "rc-1", binding, REMOVED)),
        ReconciledOperation(OperationReconcileResult(SESSION, "rc-1", TOOL, OP_KEY, Running())),
        RequestRejected(SESSION, "rc-1", "adapter_error", OP_KEY, "cmp-other"),
        RequestRejected(SESSION, "rc-9", "adapter_error"),
    ):
        unchanged(
            w, UnexpectedReconciliationMessage, lambda m=message: w.apply(request, w.worker.seal(m))
        )
    assert "reconciled_compensation" in str(UnexpectedReconciliationMessage())
