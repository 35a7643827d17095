"""Compensation targets, verifier protocols, actions and approvals.

This module owns the host's compensation authority values: the target bundle
handed to every hardened engine call, the two synchronous verifier protocols
that are the host's revocation boundary, the action a verifier inspects, and
the one-use, process-local ``CompensationApproval``. The policy (tenant scope
+ grant fingerprint) is :mod:`octo_host.policy`, re-exported here.

It must never do I/O, cache a verifier decision, keep raw compensation input
beyond the call that received it, or let an approval be copied, pickled or
built outside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

from octo_common.errors import CompensationPolicyMismatch, OperationBindingMismatch
from octo_common.grants import CapabilityGrant
from octo_common.payload import ToolPayload
from octo_host.ledger import WorkflowOperation
from octo_host.plan import WorkflowPlan
from octo_host.policy import WorkflowCompensationPolicy

__all__ = [
    "CompensationActionVerifier",
    "CompensationApproval",
    "CompensationGrantVerifier",
    "WorkflowCompensationAction",
    "WorkflowCompensationDispatch",
    "WorkflowCompensationPolicy",
    "WorkflowCompensationTarget",
]


class WorkflowCompensationAction:
    """What an action verifier decides on. Built by the engine only.

    ``compensation_input`` holds the exact canonical inverse bytes; the repr
    shows only their length.
    """

    __slots__ = (
        "compensation_input",
        "grant",
        "operation_key",
        "original_input_fingerprint",
        "plan_fingerprint",
        "step_id",
        "tenant_scope",
        "tool",
    )

    plan_fingerprint: str
    operation_key: str
    step_id: str
    tool: str
    original_input_fingerprint: str
    tenant_scope: str
    grant: CapabilityGrant
    compensation_input: bytes

    def __init__(
        self,
        plan_fingerprint: str,
        operation_key: str,
        step_id: str,
        tool: str,
        original_input_fingerprint: str,
        tenant_scope: str,
        grant: CapabilityGrant,
        compensation_input: bytes,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "plan_fingerprint", plan_fingerprint)
        set_(self, "operation_key", operation_key)
        set_(self, "step_id", step_id)
        set_(self, "tool", tool)
        set_(self, "original_input_fingerprint", original_input_fingerprint)
        set_(self, "tenant_scope", tenant_scope)
        set_(self, "grant", grant)
        set_(self, "compensation_input", bytes(compensation_input))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("WorkflowCompensationAction is read-only")

    def __repr__(self) -> str:
        return (
            f"WorkflowCompensationAction(plan_fingerprint={self.plan_fingerprint!r}, "
            f"operation_key={self.operation_key!r}, step_id={self.step_id!r}, "
            f"tool={self.tool!r}, tenant_scope={self.tenant_scope!r}, "
            f"compensation_input_bytes={len(self.compensation_input)})"
        )


class CompensationGrantVerifier(Protocol):
    """Host policy: is this grant currently allowed for this tenant? Raise to refuse
    (conventionally ``CompensationGrantDenied(tool, tenant_scope)``)."""

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None: ...


class CompensationActionVerifier(Protocol):
    """Host policy: is this exact inverse action currently allowed? Raise to refuse
    (conventionally ``CompensationActionDenied(operation_key, tool, tenant_scope)``)."""

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None: ...


@dataclass(frozen=True, slots=True)
class WorkflowCompensationTarget:
    """The bundle every hardened compensation call takes.

    The verifiers are trusted host policy objects; the repr never shows them.
    """

    operation_key: str
    policy: WorkflowCompensationPolicy
    grant: CapabilityGrant
    grant_verifier: CompensationGrantVerifier
    action_verifier: CompensationActionVerifier

    def __repr__(self) -> str:
        return (
            f"WorkflowCompensationTarget(operation_key={self.operation_key!r}, "
            f"policy={self.policy!r}, grant={self.grant!r}, "
            "grant_verifier=[trusted host policy], action_verifier=[trusted host policy])"
        )

    def verify_grant_current(self) -> None:
        """Policy syntax, then the grant still matches the policy, then the grant
        verifier (its exception passes through unchanged)."""
        self.policy.validate_syntax()
        if not self.policy.matches_grant(self.grant):
            raise CompensationPolicyMismatch(self.operation_key)
        self.grant_verifier.verify_compensation_grant(self.policy.tenant_scope, self.grant)

    def verify_action_current(
        self, plan: WorkflowPlan, operation: WorkflowOperation, compensation_input: bytes
    ) -> None:
        """Target bound to this operation, same tool as the policy, then the action
        verifier on the exact canonical inverse bytes."""
        if self.operation_key != operation.operation_key:
            raise OperationBindingMismatch(self.operation_key)
        if operation.tool != self.policy.tool:
            raise CompensationPolicyMismatch(operation.operation_key)
        action = WorkflowCompensationAction(
            plan.fingerprint,
            operation.operation_key,
            operation.step_id,
            operation.tool,
            operation.input_fingerprint,
            self.policy.tenant_scope,
            self.grant,
            compensation_input,
        )
        self.action_verifier.verify_compensation_action(action)


@dataclass(frozen=True, slots=True)
class WorkflowCompensationDispatch:
    """What to seal for an approved compensation: plain data, validated when sealed."""

    request_id: str
    payload: ToolPayload


# Only the engine holds this; an approval built without it is refused at construction.
_ISSUER = object()


class CompensationApproval:
    """A one-use, process-local permission to seal one compensation frame.

    Binds engine, plan object, ledger revision, both keys, input fingerprint,
    tenant, grant fingerprint and session. Never serialized or copied.
    """

    __slots__ = (
        "_consumed",
        "compensation_key",
        "engine_id",
        "grant_fingerprint",
        "input_fingerprint",
        "ledger_revision",
        "nonce",
        "operation_key",
        "plan_id",
        "session_id",
        "tenant_scope",
    )

    engine_id: int
    plan_id: int
    nonce: int
    ledger_revision: int
    operation_key: str
    compensation_key: str
    input_fingerprint: str
    tenant_scope: str
    grant_fingerprint: str
    session_id: str
    _consumed: bool

    def __init__(
        self,
        issuer: object,
        *,
        engine_id: int,
        plan_id: int,
        nonce: int,
        ledger_revision: int,
        operation_key: str,
        compensation_key: str,
        input_fingerprint: str,
        tenant_scope: str,
        grant_fingerprint: str,
        session_id: str,
    ) -> None:
        if issuer is not _ISSUER:
            raise TypeError("CompensationApproval is issued only by WorkflowEngine")
        set_ = object.__setattr__
        set_(self, "engine_id", engine_id)
        set_(self, "plan_id", plan_id)
        set_(self, "nonce", nonce)
        set_(self, "ledger_revision", ledger_revision)
        set_(self, "operation_key", operation_key)
        set_(self, "compensation_key", compensation_key)
        set_(self, "input_fingerprint", input_fingerprint)
        set_(self, "tenant_scope", tenant_scope)
        set_(self, "grant_fingerprint", grant_fingerprint)
        set_(self, "session_id", session_id)
        set_(self, "_consumed", False)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("CompensationApproval is read-only")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("CompensationApproval is read-only")

    @property
    def consumed(self) -> bool:
        """True once a sealing call has taken this approval."""
        return self._consumed

    def __reduce__(self) -> NoReturn:
        raise TypeError("CompensationApproval is process-local and cannot be serialized")

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("CompensationApproval is process-local and cannot be serialized")

    def __copy__(self) -> NoReturn:
        raise TypeError("CompensationApproval is one-use and cannot be copied")

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise TypeError("CompensationApproval is one-use and cannot be copied")

    def __repr__(self) -> str:
        return (
            f"CompensationApproval(engine_id={self.engine_id}, plan_id={self.plan_id}, "
            f"nonce={self.nonce}, ledger_revision={self.ledger_revision}, "
            f"operation_key={self.operation_key!r}, compensation_key={self.compensation_key!r}, "
            f"input_fingerprint={self.input_fingerprint!r}, tenant_scope={self.tenant_scope!r}, "
            f"grant_fingerprint={self.grant_fingerprint!r}, session_id={self.session_id!r})"
        )


def _issue_approval(
    *,
    engine_id: int,
    plan_id: int,
    nonce: int,
    ledger_revision: int,
    operation_key: str,
    compensation_key: str,
    input_fingerprint: str,
    tenant_scope: str,
    grant_fingerprint: str,
    session_id: str,
) -> CompensationApproval:
    """Engine-only constructor (the sentinel stays in this module)."""
    return CompensationApproval(
        _ISSUER,
        engine_id=engine_id,
        plan_id=plan_id,
        nonce=nonce,
        ledger_revision=ledger_revision,
        operation_key=operation_key,
        compensation_key=compensation_key,
        input_fingerprint=input_fingerprint,
        tenant_scope=tenant_scope,
        grant_fingerprint=grant_fingerprint,
        session_id=session_id,
    )


def _consume_approval(approval: object) -> bool:
    """Spend ``approval``; True only for a ``CompensationApproval`` not spent before."""
    if not isinstance(approval, CompensationApproval):
        return False
    fresh = not approval._consumed
    object.__setattr__(approval, "_consumed", True)
    return fresh
