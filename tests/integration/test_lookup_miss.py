"""A lookup miss through a real WorkerSession and SQLite journal (the adapter kit):
"proven not happened" is recorded only from an adapter that declares that its
lookup miss fences the key, and then with its stable code in the journal and the
reply; from any other adapter it is refused and the key stays unsettled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import WorkerRequestRejected
from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, Pending, StateKind
from octo_worker.adapters import BaseWorkerAdapter, DurableOperationContract
from octo_worker.testing import AdapterKit

TOOL = "test.miss"
PAYLOAD = ToolPayload.json({"n": 1})
MISS = Failed("no trace of it", FailureCode.NOT_HAPPENED)


class MissingAdapter(BaseWorkerAdapter):
    """Every lookup answers "proven not happened"; ``fences`` is its declaration."""

    tool = TOOL

    def __init__(self, fences: Any) -> None:
        self.fences = fences

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> Any:
        return self.fences

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AssertionError("never reached: the worker dies before the call")

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return MISS


async def _cut_before_the_effect(kit: AdapterKit) -> str:
    report = await kit.dispatch_crashing(PAYLOAD, at="worker.after_ack")
    assert report.reached and report.redelivered is None  # acked: nothing redelivers it
    return report.key


async def _journal_state(kit: AdapterKit, key: str) -> Any:
    assert kit._store is not None
    rows = await kit._store.load_records(kit.scope, [key])
    row = rows[key]
    assert row is not None
    return row[0].state


async def test_a_fencing_adapter_s_miss_settles_the_key_with_its_code(tmp_path: Path) -> None:
    async with AdapterKit(MissingAdapter(True), tmp_path) as kit:
        key = await _cut_before_the_effect(kit)
        assert await kit.reconcile(key) == MISS
        assert await _journal_state(kit, key) == MISS
        # A second lookup gives the same answer, code included (the journal accepts
        # nothing else for a failed key), and no effect was ever called.
        assert await kit.reconcile(key) == MISS
        assert await _journal_state(kit, key) == MISS
        assert kit.calls["dispatch_operation"] == 0


@pytest.mark.parametrize("declaration", [False, None, "yes", 1])
async def test_an_adapter_that_does_not_fence_cannot_report_proven_not_happened(
    tmp_path: Path, declaration: Any
) -> None:
    async with AdapterKit(MissingAdapter(declaration), tmp_path) as kit:
        key = await _cut_before_the_effect(kit)
        with pytest.raises(WorkerRequestRejected) as refused:
            await kit.reconcile(key)
        assert refused.value.rejection_code == "adapter_error"
        # The row stays as it was: nothing settled it, so nothing may retry it.
        state = await _journal_state(kit, key)
        assert isinstance(state, Pending) and state.kind == StateKind.PENDING
