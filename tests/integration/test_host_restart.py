"""A host restart on a real ledger file (seed "Host Sequence" last paragraph).

Before the restart the host records an operation, applies the worker's
authenticated success, records the one compensation intent and persists each
revision with compare-and-swap. After it, a new engine rebuilds the plan from
the same steps, loads and validates the ledger through the authenticated store
(at or after the revision it last stored), refuses the old approval, and
issues a fresh approval for the existing intent: the sealed frame carries the
same ``cmp-`` key, input and grant fingerprint.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import ApprovalMismatch, CompensationAlreadyRecorded
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant
from octo_common.messages import CompensateOperation, OperationReconcileResult, OperationResult
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import StateKind, Succeeded
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore, ledger_record_key

STEPS = [WorkflowStep("publish", "publish release 42")]
GRANT = CapabilityGrant.json("release.publish").with_compensation_limit(1)
TENANT = "tenant-release"
UNDO = ToolPayload.json({"undo": "release"})


class Allow:
    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        assert grant == GRANT and tenant_scope == TENANT

    def verify_compensation_action(self, action: Any) -> None:
        assert action.compensation_input == canonical_operation_input_bytes(UNDO)


def _pair(session_id: str) -> tuple[SessionAuthenticator, SessionAuthenticator]:
    key = SessionKey.generate()
    return (
        SessionAuthenticator(session_id, key, SessionRole.HOST),
        SessionAuthenticator(session_id, key, SessionRole.WORKER),
    )


def _target(key: str) -> WorkflowCompensationTarget:
    policy = WorkflowCompensationPolicy(TENANT, GRANT)
    return WorkflowCompensationTarget(key, policy, GRANT, Allow(), Allow())


async def test_restart_rebuilds_plan_validates_ledger_and_issues_a_fresh_approval(
    tmp_path: Path,
) -> None:
    keyring_bytes = secrets.token_bytes(32)
    path = tmp_path / "ledger.sqlite3"
    record_key = ledger_record_key("release-42")

    # Before the restart -----------------------------------------------------------
    engine = WorkflowEngine()
    plan = engine.plan(STEPS)
    ledger = engine.operation_ledger(plan)
    store = SqliteLedgerStore(path, StorageKeyring("host-k1", keyring_bytes))
    stored = await store.create(record_key, ledger.to_json().encode())
    payload = ToolPayload.json({"version": "1.2.3"})
    key = engine.record_derived_operation(
        plan, ledger, "publish", "release.publish", canonical_operation_input_bytes(payload), b"n"
    )
    stored = await store.replace(record_key, stored.revision, ledger.to_json().encode())

    host, worker = _pair("session-1")
    outbound = engine.prepare_authenticated_operation_dispatch(
        plan, ledger, key, payload, "d-1", host
    )
    request = worker.open(outbound.frame).request  # type: ignore[union-attr]
    reply = worker.seal(
        OperationResult(
            OperationReconcileResult(
                request.session_id,
                request.request_id,
                request.tool,
                request.operation_key,
                Succeeded(ToolPayload.json({"ok": True})),
            )
        )
    )
    engine.apply_authenticated_operation_dispatch_result(
        plan, ledger, outbound.request, host, reply
    )
    stored = await store.replace(record_key, stored.revision, ledger.to_json().encode())
    compensation_key = engine.record_derived_compensation_with_action_verifier(
        plan, ledger, _target(key), canonical_operation_input_bytes(UNDO), b"undo-1"
    )
    stored = await store.replace(record_key, stored.revision, ledger.to_json().encode())
    watermark = ledger.revision
    old_approval = engine.approve_compensation(
        plan, ledger, _target(key), canonical_operation_input_bytes(UNDO), host
    )
    await store.close()

    # After the restart --------------------------------------------------------------
    engine2 = WorkflowEngine()
    plan2 = engine2.plan(STEPS)
    assert plan2.fingerprint == plan.fingerprint and plan2.engine_id != plan.engine_id
    store2 = SqliteLedgerStore(path, StorageKeyring("host-k1", keyring_bytes))
    try:
        record = await store2.load(record_key)
        assert record is not None
        loaded = WorkflowOperationLedger.from_json(record.payload)
        engine2.validate_operation_ledger_at_or_after(plan2, loaded, watermark)
        assert loaded == ledger
        operation = loaded.operation(key)
        assert operation is not None and operation.state == StateKind.SUCCEEDED
        assert operation.compensation is not None
        assert operation.compensation.compensation_key == compensation_key
        assert operation.compensation.state == StateKind.PENDING

        host2, worker2 = _pair("session-2")
        # The old approval belonged to the old engine and plan: refused.
        with pytest.raises(ApprovalMismatch):
            engine2.prepare_authenticated_operation_compensation(
                plan2,
                loaded,
                _target(key),
                WorkflowCompensationDispatch("c-1", UNDO),
                old_approval,
                host2,
            )
        # A second intent for the same original is refused; the stored one is reused.
        with pytest.raises(CompensationAlreadyRecorded):
            engine2.record_derived_compensation_with_action_verifier(
                plan2, loaded, _target(key), canonical_operation_input_bytes(UNDO), b"undo-2"
            )
        fresh = engine2.approve_compensation(
            plan2, loaded, _target(key), canonical_operation_input_bytes(UNDO), host2
        )
        sealed = engine2.prepare_authenticated_operation_compensation(
            plan2, loaded, _target(key), WorkflowCompensationDispatch("c-2", UNDO), fresh, host2
        )
        opened = worker2.open(sealed.frame)
        assert isinstance(opened, CompensateOperation)
        assert opened.request.compensation_key == compensation_key
        assert opened.request.operation_key == key
        assert opened.request.grant_fingerprint == GRANT.compensation_fingerprint()
        assert opened.request.payload == UNDO
        assert loaded.revision == watermark  # approvals and sealing change nothing
    finally:
        await store2.close()
