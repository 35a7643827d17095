"""WorkerMetrics: remembered label children, the oldest-pending gauge and its sources, the
broker queue gauges."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.messages import (
    CompensationReconcileResult,
    CompensationResult,
    OperationCompensationBinding,
    OperationCompensationResult,
    OperationReconcileResult,
    OperationResult,
    ReconciledCompensation,
    ReconciledOperation,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, Running, Succeeded
from octo_worker.daemon import metrics as metrics_module
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.session.session import call_adapter_reporting, reply_unresolved
from octo_worker.session.steps import AdapterStep


def sample(metrics: WorkerMetrics, name: str, labels: dict[str, str]) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_children_are_the_registry_children_and_are_remembered() -> None:
    m = WorkerMetrics()

    pairs = [
        (
            m.admissions_for("s1", "dispatch", "dispatch"),
            m.admissions.labels("s1", "dispatch", "dispatch"),
        ),
        (
            m.adapter_outcomes_for("t.op", "dispatch_operation", "ok"),
            m.adapter_outcomes.labels("t.op", "dispatch_operation", "ok"),
        ),
        (
            m.adapter_duration_for("t.op", "dispatch_operation"),
            m.adapter_duration.labels("t.op", "dispatch_operation"),
        ),
        (m.deliveries_for("s1", "acked"), m.deliveries.labels("s1", "acked")),
        (
            m.frames_rejected_for("s1", "invalid_frame"),
            m.frames_rejected.labels("s1", "invalid_frame"),
        ),
        (m.replies_for("s1", "confirmed"), m.replies.labels("s1", "confirmed")),
    ]
    for cached, direct in pairs:
        assert cached is direct
    assert m.replies_for("s1", "confirmed") is m.replies_for("s1", "confirmed")
    assert m.replies_for("s1", "failed") is not m.replies_for("s1", "confirmed")


def test_children_count_into_the_exposition() -> None:
    m = WorkerMetrics()

    m.admissions_for("s1", "dispatch", "dispatch").inc()
    m.admissions_for("s1", "dispatch", "dispatch").inc()
    m.admissions.labels("s1", "dispatch", "dispatch").inc()
    m.replies_for("s2", "confirmed").inc()
    m.deliveries_for("s1", "acked").inc()
    m.adapter_outcomes_for("t.op", "invoke", "ok").inc()
    m.adapter_duration_for("t.op", "invoke").observe(0.003)

    labels = {"scope": "s1", "kind": "dispatch", "result": "dispatch"}
    assert sample(m, "octo_admissions_total", labels) == 3.0
    assert sample(m, "octo_replies_total", {"scope": "s2", "outcome": "confirmed"}) == 1.0
    assert sample(m, "octo_replies_total", {"scope": "s1", "outcome": "confirmed"}) is None
    assert sample(m, "octo_deliveries_total", {"scope": "s1", "outcome": "acked"}) == 1.0
    outcome = {"tool": "t.op", "method": "invoke", "outcome": "ok"}
    assert sample(m, "octo_adapter_outcomes_total", outcome) == 1.0
    duration = {"tool": "t.op", "method": "invoke"}
    assert sample(m, "octo_adapter_duration_seconds_count", duration) == 1.0
    assert b'octo_admissions_total{kind="dispatch",result="dispatch",scope="s1"} 3.0' in (
        m.exposition()
    )


def test_oldest_pending_age_is_per_scope_and_resets_when_resolved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(metrics_module.time, "time", lambda: now[0])
    m = WorkerMetrics()

    def age(scope: str) -> float | None:
        return sample(m, "octo_oldest_unresolved_pending_seconds", {"scope": scope})

    m.note_pending("s1", "key-a", True)
    assert age("s1") == 0.0
    now[0] = 1010.0
    m.note_pending("s1", "key-b", True)
    m.note_pending("s2", "key-a", True)
    assert (age("s1"), age("s2")) == (10.0, 0.0)
    now[0] = 1015.0
    # Noting a key pending again keeps its first time.
    m.note_pending("s1", "key-a", True)
    assert age("s1") == 15.0
    m.note_pending("s1", "key-a", False)
    assert age("s1") == 5.0
    m.note_pending("s1", "unknown", False)
    assert age("s1") == 5.0
    m.note_pending("s1", "key-b", False)
    assert age("s1") == 0.0
    # Read at scrape time: an unresolved key's age keeps growing with nothing
    # noted (an idle scope's alert still fires).
    assert age("s2") == 5.0
    now[0] = 1100.0
    assert age("s2") == 90.0
    m.note_pending("s3", "never", False)
    assert age("s3") == 0.0


class _Slow:
    tool = "t.slow"
    deadline_seconds = 0.05

    def __init__(self, raise_cancel: bool = False) -> None:
        self.raise_cancel = raise_cancel

    def durable_operation_contract(self) -> None:
        return None

    async def dispatch_operation(self, request: object, grant: object, context: object) -> object:
        if self.raise_cancel:
            raise asyncio.CancelledError  # a cancelled future of its own
        await asyncio.sleep(5)
        return None


async def _dispatch(adapter: _Slow, metrics: WorkerMetrics, deadline: float) -> Any:
    async def after(result: Any, error: BaseException | None) -> Any:
        raise AssertionError("the driver calls this, not the adapter call")

    step = AdapterStep(
        call=lambda _deadline: adapter.dispatch_operation(None, None, None),
        after=after,
        tool=adapter.tool,
        method="dispatch_operation",
        ack_first=True,
        deadline=deadline,
        returns=object,
    )
    return await call_adapter_reporting(step, "s1", metrics)


@pytest.mark.parametrize("raise_cancel", [False, True], ids=["deadline", "self-cancelled"])
async def test_a_deadline_or_an_adapters_own_cancellation_counts_as_indeterminate(
    raise_cancel: bool,
) -> None:
    m = WorkerMetrics()
    adapter = _Slow(raise_cancel)
    result, error = await _dispatch(adapter, m, adapter.deadline_seconds)
    assert result is None and isinstance(error, AdapterIndeterminate)
    labels = {"tool": "t.slow", "method": "dispatch_operation"}
    assert sample(m, "octo_adapter_outcomes_total", {**labels, "outcome": "cancelled"}) is None
    indeterminate = {**labels, "outcome": "adapter_indeterminate"}
    assert sample(m, "octo_adapter_outcomes_total", indeterminate) == 1.0


async def test_a_stopping_worker_counts_its_adapter_call_as_cancelled() -> None:
    m = WorkerMetrics()
    task = asyncio.ensure_future(_dispatch(_Slow(), m, 10.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    labels = {"tool": "t.slow", "method": "dispatch_operation", "outcome": "cancelled"}
    assert sample(m, "octo_adapter_outcomes_total", labels) == 1.0


# What a reply says of its key (the oldest-unresolved gauge's source) ---------------------


def _reconciled(status: Any) -> ReconciledOperation:
    return ReconciledOperation(OperationReconcileResult("session-1", "r-1", "t", "op-1", status))


def test_a_terminal_status_resolves_and_running_leaves_the_key_unresolved() -> None:
    payload = ToolPayload.json({"done": True})
    assert reply_unresolved(_reconciled(Succeeded(payload))) is False
    assert reply_unresolved(_reconciled(Failed("gone"))) is False
    assert reply_unresolved(_reconciled(Cancelled())) is False
    assert reply_unresolved(_reconciled(Running())) is True
    dispatched = OperationResult(
        OperationReconcileResult("session-1", "d-1", "t", "op-1", Running())
    )
    assert reply_unresolved(dispatched) is True
    binding = OperationCompensationBinding("t", "op-1", "cmp-1", "tenant-a", "ab" * 32)
    compensated = CompensationResult(
        OperationCompensationResult("session-1", "c-1", binding, Succeeded(payload))
    )
    assert reply_unresolved(compensated) is False
    for status, unresolved in ((Succeeded(payload), False), (Running(), True)):
        looked_up = ReconciledCompensation(
            CompensationReconcileResult(
                "session-1", "l-1", "t", "op-1", "cmp-1", "tenant-a", "ab" * 32, status
            )
        )
        assert reply_unresolved(looked_up) is unresolved


def test_a_pending_refusal_marks_the_key_unresolved_and_other_refusals_say_nothing() -> None:
    for code in ("pending_operation", "pending_compensation"):
        refused = RequestRejected("session-1", "d-2", code, "op-1")
        assert reply_unresolved(refused) is True
    for code in ("budget_exhausted", "indeterminate_operation", "missing_adapter"):
        refused = RequestRejected("session-1", "d-2", code, "op-1")
        assert reply_unresolved(refused) is None


def test_queue_gauges_follow_each_refresh() -> None:
    m = WorkerMetrics()
    m.note_queue("octo.v5.dead", 7, 0)
    m.note_queue("octo.v5.worker.a", 3, 2)
    assert sample(m, "octo_queue_messages", {"queue": "octo.v5.dead"}) == 7.0
    assert sample(m, "octo_queue_consumers", {"queue": "octo.v5.worker.a"}) == 2.0
    # A queue that disappeared: no depth, and nobody consumes it.
    m.note_queue("octo.v5.worker.a", None, None)
    assert sample(m, "octo_queue_messages", {"queue": "octo.v5.worker.a"}) is None
    assert sample(m, "octo_queue_consumers", {"queue": "octo.v5.worker.a"}) == 0.0
    assert sample(m, "octo_queue_refresh_timestamp_seconds", {}) == 0.0
    m.note_queues_refreshed()
    refreshed = sample(m, "octo_queue_refresh_timestamp_seconds", {})
    assert refreshed is not None and refreshed > 0
