"""A host's whole compensation sequence, in Python.

grant with compensation limit 1 -> policy for tenant-release -> canonical input
of {"undo": "release"} -> target with both verifiers -> record -> persist ->
approve -> prepare -> the worker opens and authorizes the request -> the
worker seals a compensation_result -> the host applies it -> only the
compensation state changed. The ledger's JSON round trip stands in for the
authenticated store here; the SQLite store has its own tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from octo_common.authorizer import SessionAuthorizer
from octo_common.errors import (
    ApprovalMismatch,
    CompensationActionDenied,
    CompensationBudgetExhausted,
    CompensationGrantDenied,
)
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CompensateOperation,
    CompensationResult,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationReconcileResult,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import StateKind, Succeeded
from octo_host.compensation import (
    WorkflowCompensationAction,
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowStep

SESSION = "worker-1"
TOOL = "release.publish"
TENANT = "tenant-release"


class CurrentGrantVerifier:
    """Checks tenant policy and revocations against the host's current view."""

    def __init__(self, allowed: dict[str, CapabilityGrant]) -> None:
        self.allowed = allowed
        self.calls = 0

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.calls += 1
        if self.allowed.get(tenant_scope) != grant:
            raise CompensationGrantDenied(grant.tool, tenant_scope)


class CurrentActionVerifier:
    """Allows exactly the reviewed inverse payload for the original operation."""

    def __init__(self, allowed_input: bytes) -> None:
        self.allowed_input = allowed_input
        self.calls = 0

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        self.calls += 1
        if action.compensation_input != self.allowed_input:
            raise CompensationActionDenied(action.operation_key, action.tool, action.tenant_scope)


def test_seed_host_sequence() -> None:
    session_key = SessionKey.from_bytes(bytes(range(7, 39)))
    host = SessionAuthenticator(SESSION, session_key, SessionRole.HOST)
    worker = SessionAuthenticator(SESSION, session_key, SessionRole.WORKER)

    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "let release = true")])
    ledger = engine.operation_ledger(plan)
    release = ToolPayload.json({"version": "1.2.3"})
    operation_key = engine.record_derived_operation(
        plan,
        ledger,
        "publish",
        TOOL,
        canonical_operation_input_bytes(release),
        b"release-42:publish:1",
    )
    request = engine.operation_reconcile_request(
        plan, ledger, operation_key, canonical_operation_input_bytes(release), SESSION, "r-1"
    )
    engine.apply_verified_operation_reconciliation(
        plan,
        ledger,
        request,
        OperationReconcileResult(
            SESSION, "r-1", TOOL, operation_key, Succeeded(ToolPayload.json({"published": 1}))
        ),
    )
    assert ledger.revision == 2

    # The whole compensation sequence.
    grant = CapabilityGrant.json(TOOL).with_compensation_limit(1)
    policy = WorkflowCompensationPolicy(TENANT, grant)
    payload = ToolPayload.json({"undo": "release"})
    compensation_input = canonical_operation_input_bytes(payload)
    grants = CurrentGrantVerifier({TENANT: grant})
    actions = CurrentActionVerifier(compensation_input)
    target = WorkflowCompensationTarget(operation_key, policy, grant, grants, actions)
    compensation_key = engine.record_derived_compensation_with_action_verifier(
        plan, ledger, target, compensation_input, b"release-42:publish:undo:1"
    )
    assert compensation_key.startswith("cmp-")
    assert (grants.calls, actions.calls, ledger.revision) == (1, 1, 3)

    persisted = ledger.to_json()  # persist_ledger_compare_and_swap stand-in
    assert "undo" not in persisted
    ledger = WorkflowOperationLedger.from_json(persisted)
    engine.validate_operation_ledger_at_or_after(plan, ledger, 3)
    original = ledger.operation(operation_key)
    assert original is not None and original.compensation is not None

    approval = engine.approve_compensation(plan, ledger, target, compensation_input, host)
    outbound = engine.prepare_authenticated_operation_compensation(
        plan,
        ledger,
        target,
        WorkflowCompensationDispatch("compensate-1", payload),
        approval,
        host,
    )
    assert (grants.calls, actions.calls) == (3, 3)
    assert ledger.revision == 3

    # Worker side: open the host-authenticated frame, then re-authorize it.
    opened = worker.open(outbound.frame)
    assert isinstance(opened, CompensateOperation)
    compensate = opened.request
    assert compensate == outbound.request
    assert compensate.session_id == SESSION
    assert compensate.request_id == "compensate-1"
    assert (compensate.tool, compensate.operation_key) == (TOOL, operation_key)
    assert compensate.compensation_key == compensation_key
    assert compensate.tenant_scope == TENANT
    assert compensate.grant_fingerprint == grant.compensation_fingerprint()
    assert canonical_operation_input_bytes(compensate.payload) == compensation_input
    authorizer = SessionAuthorizer(CapabilityManifest(SESSION, [grant]))
    authorized = authorizer.authorize_compensation(compensate)
    assert authorized.compensation_key == compensation_key
    assert authorizer.compensations_for(TOOL) == 1
    # The grant's limit of 1: a retransmission is free, another key is not.
    authorizer.authorize_compensation(same_compensation(compensate, "compensate-2"))
    assert authorizer.compensations_for(TOOL) == 1
    with pytest.raises(CompensationBudgetExhausted):
        authorizer.authorize_compensation(
            same_compensation(compensate, "compensate-3", compensation_key="cmp-another")
        )

    # The worker's inverse succeeded; it seals the result.
    binding = OperationCompensationBinding(
        compensate.tool,
        compensate.operation_key,
        compensate.compensation_key,
        compensate.tenant_scope,
        compensate.grant_fingerprint,
    )
    result = OperationCompensationResult(
        SESSION, "compensate-1", binding, Succeeded(ToolPayload.json({"released": False}))
    )
    state = engine.apply_authenticated_operation_compensation(
        plan, ledger, outbound.request, host, worker.seal(CompensationResult(result))
    )
    assert state == Succeeded(ToolPayload.json({"released": False}))

    # Only the compensation state changed.
    after = ledger.operation(operation_key)
    assert after == replace(
        original, compensation=replace(original.compensation, state=StateKind.SUCCEEDED)
    )
    assert ledger.revision == 4
    assert len(ledger.operations) == 1
    assert (grants.calls, actions.calls) == (3, 3)

    # The approval was one-use.
    with pytest.raises(ApprovalMismatch):
        engine.prepare_authenticated_operation_compensation(
            plan,
            ledger,
            target,
            WorkflowCompensationDispatch("compensate-2", payload),
            approval,
            host,
        )


def same_compensation(
    request: OperationCompensationRequest, request_id: str, compensation_key: str | None = None
) -> OperationCompensationRequest:
    """The compensation under another request id, optionally under another key."""
    binding = OperationCompensationBinding(
        request.tool,
        request.operation_key,
        compensation_key or request.compensation_key,
        request.tenant_scope,
        request.grant_fingerprint,
    )
    return OperationCompensationRequest(request.session_id, request_id, binding, request.payload)
