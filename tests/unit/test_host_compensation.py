"""Compensation policy, targets, actions and approvals."""

from __future__ import annotations

import copy
import pickle

import blake3
import pytest

from octo_common.errors import (
    CompensationGrantDenied,
    CompensationNotGranted,
    CompensationPolicyMismatch,
    InvalidCompensationTenantScope,
    InvalidGrant,
    InvalidToken,
    OperationBindingMismatch,
)
from octo_common.grants import CapabilityGrant, ResourceKind, ResourceSelector
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import StateKind
from octo_host.compensation import (
    CompensationApproval,
    WorkflowCompensationAction,
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperation
from octo_host.plan import WorkflowStep

TOOL = "release.publish"
TENANT = "tenant-release"
GRANT = CapabilityGrant.json(TOOL).with_compensation_limit(1)
FP = "ab" * 32


class Grants:
    def __init__(self, *, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple[str, CapabilityGrant]] = []

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.calls.append((tenant_scope, grant))
        if self.refuse:
            raise CompensationGrantDenied(grant.tool, tenant_scope)


class Actions:
    def __init__(self) -> None:
        self.actions: list[WorkflowCompensationAction] = []

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        self.actions.append(action)


def spec_grant_fingerprint() -> str:
    """The example grant's text, hashed here, independently of octo_common."""
    text = (
        b'{"tool":"release.publish","format":"json","max_calls":1,"max_input_bytes":16384,'
        b'"max_output_bytes":65536,"max_compensations":1,"resources":[]}'
    )
    return blake3.blake3(
        b"octo-compensation-grant-v1" + len(text).to_bytes(8, "big") + text
    ).hexdigest()


# Policy ------------------------------------------------------------


def test_policy_binds_tool_tenant_and_grant_fingerprint() -> None:
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    assert policy.tool == TOOL
    assert policy.tenant_scope == TENANT
    assert policy.grant_fingerprint == spec_grant_fingerprint()
    policy.validate_syntax()
    assert policy == WorkflowCompensationPolicy(TENANT, GRANT)
    assert policy != WorkflowCompensationPolicy("tenant-other", GRANT)
    with pytest.raises(AttributeError):
        policy.tenant_scope = "tenant-other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        policy._tool = "other"


def test_example_17_policy_construction_refusals() -> None:
    with pytest.raises(CompensationNotGranted) as not_granted:
        WorkflowCompensationPolicy(TENANT, CapabilityGrant.json(TOOL))
    assert not_granted.value.tool == TOOL
    with pytest.raises(InvalidCompensationTenantScope) as tenant:
        WorkflowCompensationPolicy("Tenant", GRANT)
    assert tenant.value.scope == "Tenant"
    zero_calls = CapabilityGrant(TOOL, "json", max_calls=0, max_compensations=1)
    with pytest.raises(InvalidGrant) as grant:
        WorkflowCompensationPolicy(TENANT, zero_calls)
    assert grant.value.reason == "max_calls must be greater than zero"


def test_policy_check_order() -> None:
    zero_calls_no_budget = CapabilityGrant(TOOL, "json", max_calls=0)
    with pytest.raises(InvalidCompensationTenantScope):
        WorkflowCompensationPolicy("", zero_calls_no_budget)
    with pytest.raises(InvalidGrant):
        WorkflowCompensationPolicy(TENANT, zero_calls_no_budget)
    with pytest.raises(InvalidToken):
        WorkflowCompensationPolicy(TENANT, CapabilityGrant.json("Bad Tool"))


def test_policy_matches_grant() -> None:
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    assert policy.matches_grant(GRANT)
    assert policy.matches_grant(CapabilityGrant.json(TOOL).with_compensation_limit(1))
    assert not policy.matches_grant(CapabilityGrant.json(TOOL).with_compensation_limit(2))
    assert not policy.matches_grant(CapabilityGrant.json(TOOL))
    assert not policy.matches_grant(CapabilityGrant.text(TOOL).with_compensation_limit(1))
    assert not policy.matches_grant(CapabilityGrant.json("other.tool").with_compensation_limit(1))
    with_resource = CapabilityGrant(
        TOOL,
        "json",
        max_compensations=1,
        resources=(ResourceSelector(ResourceKind("secret"), "release-token"),),
    )
    assert not policy.matches_grant(with_resource)
    # Short-circuit: another tool is refused before the fingerprint would raise.
    assert not policy.matches_grant(CapabilityGrant("Bad Tool", "json", max_compensations=1))
    broken = CapabilityGrant(TOOL, "json", max_calls=0, max_compensations=1)
    with pytest.raises(InvalidGrant):
        policy.matches_grant(broken)


# Target and action -------------------------------------------------------------


def _operation(key: str = "release-2026-1", tool: str = TOOL) -> WorkflowOperation:
    return WorkflowOperation("publish", tool, key, FP, StateKind.SUCCEEDED, None)


def test_target_repr_hides_the_verifiers() -> None:
    class Secretive:
        def __repr__(self) -> str:
            return "SECRET-VERIFIER-STATE"

        def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
            return None

        def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
            return None

    secretive = Secretive()
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    target = WorkflowCompensationTarget("release-2026-1", policy, GRANT, secretive, secretive)
    text = repr(target)
    assert "SECRET" not in text
    assert text.count("[trusted host policy]") == 2
    assert "release-2026-1" in text
    assert (target.operation_key, target.policy, target.grant) == ("release-2026-1", policy, GRANT)


def test_verify_grant_current_order() -> None:
    grants, actions = Grants(refuse=True), Actions()
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    drifted = CapabilityGrant.json(TOOL).with_compensation_limit(3)
    target = WorkflowCompensationTarget("k", policy, drifted, grants, actions)
    with pytest.raises(CompensationPolicyMismatch) as info:
        target.verify_grant_current()
    assert info.value.key == "k"
    assert grants.calls == []
    target = WorkflowCompensationTarget("k", policy, GRANT, grants, actions)
    with pytest.raises(CompensationGrantDenied):
        target.verify_grant_current()
    assert grants.calls == [(TENANT, GRANT)]


def test_verify_action_current_builds_the_action() -> None:
    grants, actions = Grants(), Actions()
    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "let release = true")])
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    target = WorkflowCompensationTarget("release-2026-1", policy, GRANT, grants, actions)
    undo = canonical_operation_input_bytes(ToolPayload.json({"undo": "release"}))
    with pytest.raises(OperationBindingMismatch):
        target.verify_action_current(plan, _operation(key="other"), undo)
    with pytest.raises(CompensationPolicyMismatch):
        target.verify_action_current(plan, _operation(tool="other.tool"), undo)
    assert actions.actions == []
    target.verify_action_current(plan, _operation(), undo)
    (action,) = actions.actions
    assert action.plan_fingerprint == plan.fingerprint
    assert action.original_input_fingerprint == FP
    assert action.compensation_input == undo
    assert action.grant == GRANT
    assert repr(action) == (
        f"WorkflowCompensationAction(plan_fingerprint='{plan.fingerprint}', "
        "operation_key='release-2026-1', step_id='publish', tool='release.publish', "
        "tenant_scope='tenant-release', compensation_input_bytes=30)"
    )
    assert "undo" not in repr(action)
    assert grants.calls == []


def test_dispatch_is_plain_data() -> None:
    dispatch = WorkflowCompensationDispatch("Not A Token", ToolPayload.text("x"))
    assert dispatch.request_id == "Not A Token"
    assert dispatch.payload == ToolPayload.text("x")


# Approval ------------------------------------------------------------------------


def test_approval_constructor_is_private() -> None:
    with pytest.raises(TypeError):
        CompensationApproval(  # type: ignore[call-arg]
            engine_id=1,
            plan_id=1,
            nonce=1,
            ledger_revision=3,
            operation_key="k",
            compensation_key="cmp-k",
            input_fingerprint=FP,
            tenant_scope=TENANT,
            grant_fingerprint=FP,
            session_id="worker-1",
        )
    with pytest.raises(TypeError):
        CompensationApproval(
            object(),
            engine_id=1,
            plan_id=1,
            nonce=1,
            ledger_revision=3,
            operation_key="k",
            compensation_key="cmp-k",
            input_fingerprint=FP,
            tenant_scope=TENANT,
            grant_fingerprint=FP,
            session_id="worker-1",
        )


def _approval() -> CompensationApproval:
    from octo_host.compensation import _issue_approval

    return _issue_approval(
        engine_id=7,
        plan_id=2,
        nonce=5,
        ledger_revision=3,
        operation_key="release-2026-1",
        compensation_key="cmp-undo",
        input_fingerprint=FP,
        tenant_scope=TENANT,
        grant_fingerprint="cd" * 32,
        session_id="worker-1",
    )


def test_approval_is_process_local_and_read_only() -> None:
    approval = _approval()
    with pytest.raises(TypeError):
        pickle.dumps(approval)
    with pytest.raises(TypeError):
        copy.copy(approval)
    with pytest.raises(TypeError):
        copy.deepcopy(approval)
    with pytest.raises(TypeError):
        approval.__reduce__()
    with pytest.raises(AttributeError):
        approval.nonce = 6
    with pytest.raises(AttributeError):
        approval._consumed = True
    assert not approval.consumed


def test_approval_repr_shows_identity_and_bindings() -> None:
    text = repr(_approval())
    for part in (
        "engine_id=7",
        "plan_id=2",
        "nonce=5",
        "ledger_revision=3",
        "operation_key='release-2026-1'",
        "compensation_key='cmp-undo'",
        f"input_fingerprint='{FP}'",
        "tenant_scope='tenant-release'",
        f"grant_fingerprint='{'cd' * 32}'",
        "session_id='worker-1'",
    ):
        assert part in text
