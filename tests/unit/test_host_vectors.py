"""Host conformance vectors: plan fingerprints, derived keys, derivation rejections and
ledger scripts, replayed through the real engine and real sealed frames.

Every expected value comes from the conformance vectors (found by
``tests.vectors``), computed by an independent implementation; nothing here
is derived from Octo's own output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from octo_common import errors
from octo_common.codec import decode_struct
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import Failed, OperationStatus, StateKind, Succeeded
from octo_host.compensation import (
    WorkflowCompensationAction,
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep
from tests.vectors import vectors_path

VECTORS = vectors_path()

pytestmark = pytest.mark.skipif(
    not VECTORS.exists(), reason=f"conformance vectors not found at {VECTORS}"
)


def _load() -> dict[str, Any]:
    if not VECTORS.exists():
        return {}
    data = json.loads(VECTORS.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


DATA = _load()


def cases(category: str) -> list[Any]:
    return [pytest.param(case, id=case["id"]) for case in DATA.get(category, [])]


def error_class(name: str) -> type[BaseException]:
    """Map a vector error name to Octo's class (one-to-one, by name)."""
    if name == "Serialization":
        return errors.SerializationError
    found = getattr(errors, name, None)
    assert isinstance(found, type) and issubclass(found, BaseException), name
    return found


def plan_for(engine: WorkflowEngine, case: dict[str, Any]) -> WorkflowPlan:
    steps = [WorkflowStep(step["id"], step["source"]) for step in case["plan_steps"]]
    plan = engine.plan(steps)
    if "plan_fingerprint" in case:
        assert plan.fingerprint == case["plan_fingerprint"]
    return plan


def grant_from(text: str) -> CapabilityGrant:
    return decode_struct(text, CapabilityGrant)


def payload_from(
    spec: dict[str, Any], format_key: str = "format", value_key: str = "value"
) -> ToolPayload:
    fmt = spec[format_key]
    value = spec[value_key]
    if fmt == "text":
        return ToolPayload.text(value)
    if isinstance(value, str):
        # JSON payload values are exact JSON texts in the vectors.
        return ToolPayload.json(json.loads(value))
    return ToolPayload.json(value)


class AllowAll:
    """Trusted host policy stand-in for replaying recorded scripts."""

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        return None

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        return None


# Fingerprints and keys ---------------------------------------------------------------


@pytest.mark.parametrize("case", cases("plan_fingerprints"))
def test_plan_fingerprints(case: dict[str, Any]) -> None:
    steps = [WorkflowStep(step["id"], step["source"]) for step in case["plan_steps"]]
    assert WorkflowEngine().plan(steps).fingerprint == case["fingerprint"]


@pytest.mark.parametrize("case", cases("operation_keys"))
def test_operation_keys(case: dict[str, Any]) -> None:
    engine = WorkflowEngine()
    plan = plan_for(engine, case)
    key = engine.derive_operation_key(
        plan,
        case["step_id"],
        case["tool"],
        bytes.fromhex(case["input_hex"]),
        bytes.fromhex(case["nonce_hex"]),
    )
    assert key == case["operation_key"]
    ledger = engine.operation_ledger(plan)
    recorded = engine.record_derived_operation(
        plan,
        ledger,
        case["step_id"],
        case["tool"],
        bytes.fromhex(case["input_hex"]),
        bytes.fromhex(case["nonce_hex"]),
    )
    assert recorded == case["operation_key"]


def _succeeded_ledger(
    engine: WorkflowEngine, plan: WorkflowPlan, operation_key: str, tool: str
) -> WorkflowOperationLedger:
    """A ledger holding ``operation_key`` as succeeded (recorded, then observed)."""
    ledger = engine.operation_ledger(plan)
    engine.record_operation(plan, ledger, plan.steps[0].id, tool, operation_key, b"original")
    request = engine.operation_reconcile_request(
        plan, ledger, operation_key, b"original", "session-1", "reconcile-1"
    )
    result = OperationReconcileResult(
        "session-1", "reconcile-1", tool, operation_key, Succeeded(ToolPayload.text("done"))
    )
    engine.apply_verified_operation_reconciliation(plan, ledger, request, result)
    return ledger


@pytest.mark.parametrize("case", cases("compensation_keys"))
def test_compensation_keys(case: dict[str, Any]) -> None:
    engine = WorkflowEngine()
    plan = plan_for(engine, case)
    grant = grant_from(case["grant_json"])
    assert grant.tool == case["tool"]
    policy = WorkflowCompensationPolicy(case["tenant_scope"], grant)
    assert policy.grant_fingerprint == case["grant_fingerprint"]
    ledger = _succeeded_ledger(engine, plan, case["operation_key"], case["tool"])
    arguments = (
        plan,
        ledger,
        case["operation_key"],
        policy,
        bytes.fromhex(case["input_hex"]),
        bytes.fromhex(case["nonce_hex"]),
    )
    assert engine.derive_compensation_key(*arguments) == case["compensation_key"]
    assert engine.record_derived_compensation(*arguments) == case["compensation_key"]


@pytest.mark.parametrize("case", cases("derivation_rejections"))
def test_derivation_rejections(case: dict[str, Any]) -> None:
    engine = WorkflowEngine()
    plan = plan_for(engine, case)
    expected = error_class(case["error"])
    input_bytes = bytes.fromhex(case.get("input_hex", ""))
    nonce = bytes.fromhex(case.get("nonce_hex", ""))
    if case["kind"] == "operation_key":
        with pytest.raises(expected) as info:
            engine.derive_operation_key(plan, case["step_id"], case["tool"], input_bytes, nonce)
    else:
        assert case["kind"] == "compensation_key", case["kind"]
        grant = grant_from(case["grant_json"])
        policy = WorkflowCompensationPolicy(case["tenant_scope"], grant)
        ledger = _succeeded_ledger(engine, plan, case["operation_key"], grant.tool)
        with pytest.raises(expected) as info:
            engine.derive_compensation_key(
                plan, ledger, case["operation_key"], policy, input_bytes, nonce
            )
    for name, value in case.get("error_fields", {}).items():
        assert getattr(info.value, name) == value


# Ledger scripts ------------------------------------------------------------------------


@dataclass
class Replay:
    """One script's host state plus the worker frames it is fed."""

    engine: WorkflowEngine
    plan: WorkflowPlan
    ledger: WorkflowOperationLedger
    host: SessionAuthenticator
    session_id: str
    inputs: dict[str, bytes] = field(default_factory=dict)
    payloads: dict[str, ToolPayload] = field(default_factory=dict)
    targets: dict[str, WorkflowCompensationTarget] = field(default_factory=dict)
    compensation_payloads: dict[str, ToolPayload] = field(default_factory=dict)
    last_operation: str | None = None


def _frame_request(line: str) -> dict[str, Any]:
    message = json.loads(line)["message"]
    body = message.get("request")
    assert isinstance(body, dict)
    return body


def _step_input(step: dict[str, Any]) -> tuple[ToolPayload | None, bytes]:
    payload = payload_from(step["payload"]) if "payload" in step else None
    if payload is not None:
        data = canonical_operation_input_bytes(payload)
        if "input_hex" in step:
            assert data.hex() == step["input_hex"]
        return payload, data
    return None, bytes.fromhex(step["input_hex"])


def _check_observed(step: dict[str, Any], state: OperationStatus) -> None:
    if "state" in step:
        assert state.kind == StateKind(step["state"])
    observed = step.get("observed")
    if not observed:
        return
    assert state.kind == StateKind(observed["state"])
    if isinstance(state, Succeeded) and "payload" in observed:
        assert state.payload == payload_from(observed, "payload_format", "payload")
    if isinstance(state, Failed) and "message" in observed:
        assert state.message == observed["message"]


def _operation_key(replay: Replay, step: dict[str, Any]) -> str:
    key = step.get("operation_key") or replay.last_operation
    assert key is not None
    return str(key)


def _run_step(replay: Replay, step: dict[str, Any]) -> None:
    action: str = step["action"]
    engine, plan, ledger, host = replay.engine, replay.plan, replay.ledger, replay.host
    if action == "operation_ledger":
        replay.ledger = engine.operation_ledger(plan)
        return
    if action.startswith("record") and "compensation" not in action:
        payload, data = _step_input(step)
        if "nonce_hex" in step and "derived" in action:
            key = engine.record_derived_operation(
                plan, ledger, step["step_id"], step["tool"], data, bytes.fromhex(step["nonce_hex"])
            )
            assert key == step["operation_key"]
        else:
            key = step["operation_key"]
            engine.record_operation(plan, ledger, step["step_id"], step["tool"], key, data)
        replay.inputs[key] = data
        if payload is not None:
            replay.payloads[key] = payload
        replay.last_operation = key
        return
    if action.startswith("record"):
        payload, data = _step_input(step)
        grant = grant_from(step["grant_json"])
        policy = WorkflowCompensationPolicy(step["tenant_scope"], grant)
        if "grant_fingerprint" in step:
            assert policy.grant_fingerprint == step["grant_fingerprint"]
        key = _operation_key(replay, step)
        if "nonce_hex" in step and "derived" in action:
            compensation_key = engine.record_derived_compensation(
                plan, ledger, key, policy, data, bytes.fromhex(step["nonce_hex"])
            )
            assert compensation_key == step["compensation_key"]
        else:
            compensation_key = step["compensation_key"]
            engine.record_compensation(plan, ledger, key, policy, compensation_key, data)
        allow = AllowAll()
        replay.targets[key] = WorkflowCompensationTarget(key, policy, grant, allow, allow)
        if payload is not None:
            replay.compensation_payloads[key] = payload
        return
    if "reconcile_frame_line" in step:
        body = _frame_request(step["reconcile_frame_line"])
        key = body["operation_key"]
        outbound = engine.prepare_authenticated_operation_reconciliation(
            plan, ledger, key, replay.inputs[key], body["request_id"], host
        )
        assert outbound.frame == step["reconcile_frame_line"].encode()
        reconcile: OperationReconcileRequest = outbound.request
        state = engine.apply_authenticated_operation_reconciliation(
            plan, ledger, reconcile, host, step["result_frame_line"].encode()
        )
        _check_observed(step, state)
        return
    if "dispatch_frame_line" in step:
        body = _frame_request(step["dispatch_frame_line"])
        key = body["operation_key"]
        dispatched = engine.prepare_authenticated_operation_dispatch(
            plan, ledger, key, replay.payloads[key], body["request_id"], host
        )
        assert dispatched.frame == step["dispatch_frame_line"].encode()
        dispatch: OperationDispatchRequest = dispatched.request
        state, _result = engine.apply_authenticated_operation_dispatch_result(
            plan, ledger, dispatch, host, step["result_frame_line"].encode()
        )
        _check_observed(step, state)
        return
    if "compensate_frame_line" in step:
        body = _frame_request(step["compensate_frame_line"])
        key = body["operation_key"]
        target = replay.targets[key]
        payload = replay.compensation_payloads[key]
        data = canonical_operation_input_bytes(payload)
        approval = engine.approve_compensation(plan, ledger, target, data, host)
        sealed = engine.prepare_authenticated_operation_compensation(
            plan,
            ledger,
            target,
            WorkflowCompensationDispatch(body["request_id"], payload),
            approval,
            host,
        )
        assert sealed.frame == step["compensate_frame_line"].encode()
        compensation: OperationCompensationRequest = sealed.request
        state = engine.apply_authenticated_operation_compensation(
            plan, ledger, compensation, host, step["result_frame_line"].encode()
        )
        _check_observed(step, state)
        return
    pytest.fail(f"unknown ledger script action {action!r}")


@pytest.mark.parametrize("case", cases("ledger_scripts"))
def test_ledger_scripts(case: dict[str, Any]) -> None:
    engine = WorkflowEngine()
    plan = plan_for(engine, case)
    session_id = case.get("session_id", "session-1")
    key = SessionKey.from_bytes(bytes.fromhex(case.get("key_hex", "07" * 32)))
    replay = Replay(
        engine,
        plan,
        engine.operation_ledger(plan),
        SessionAuthenticator(session_id, key, SessionRole.HOST),
        session_id,
    )
    for number, step in enumerate(case["steps"]):
        before = replay.ledger.to_json()
        if "error" in step:
            with pytest.raises(error_class(step["error"])):
                _run_step(replay, step)
            assert replay.ledger.to_json() == before, f"step {number} changed the ledger"
        else:
            _run_step(replay, step)
        assert replay.ledger.revision == step["revision"], f"step {number}"
        assert replay.ledger.to_json() == step["ledger_json"], f"step {number}"
        assert WorkflowOperationLedger.from_json(step["ledger_json"]) == replay.ledger
