"""WorkerHooks: combining implementations, what the metrics count at each point, where the
fault hooks kill."""

from __future__ import annotations

from typing import Any

import pytest

from octo_common.errors import FencingTokenRejected, SessionReplay, StorageBackendError
from octo_common.runtime.faults import FAULT_POINTS, FaultInjector
from octo_worker.daemon.faults import FaultHooks
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.hooks import HOOK_NAMES, NO_HOOKS, WorkerHooks, combine_hooks


class Recorder(WorkerHooks):
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def after_ack(self, scope: str, kind: str, operation_key: str) -> None:
        self.log.append((self.name, "after_ack"))

    def on_dead_letter(self, scope: str, reason: str) -> None:
        self.log.append((self.name, "on_dead_letter"))


class OnlyDeadLetters(WorkerHooks):
    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    def on_dead_letter(self, scope: str, reason: str) -> None:
        self.log.append(("dead", reason))


def test_every_hook_is_a_no_op_on_the_base() -> None:
    assert "after_ack" in HOOK_NAMES and "on_commit_failed" in HOOK_NAMES
    for name in HOOK_NAMES:
        method = getattr(NO_HOOKS, name)
        arguments: list[Any] = [None] * (method.__code__.co_argcount - 1)
        assert method(*arguments) is None


def test_combined_hooks_run_in_the_order_given() -> None:
    log: list[tuple[str, str]] = []
    hooks = combine_hooks(Recorder("first", log), Recorder("second", log), OnlyDeadLetters(log))
    hooks.after_ack("s", "dispatch_operation", "op-1")
    hooks.on_dead_letter("s", "scope_mismatch")
    hooks.after_reply("s", "dispatch_operation", "op-1", False, True)  # nobody's
    assert log == [
        ("first", "after_ack"),
        ("second", "after_ack"),
        ("first", "on_dead_letter"),
        ("second", "on_dead_letter"),
        ("dead", "scope_mismatch"),
    ]


def test_a_hook_only_one_part_overrides_is_that_parts_own_method() -> None:
    log: list[tuple[str, str]] = []
    only = OnlyDeadLetters(log)
    hooks = combine_hooks(WorkerHooks(), only)
    assert hooks.on_dead_letter == only.on_dead_letter
    assert combine_hooks(only) is only


# Metrics -------------------------------------------------------------------------------


def sample(metrics: WorkerMetrics, name: str, labels: dict[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


def pending_age(metrics: WorkerMetrics, scope: str) -> float | None:
    return sample(metrics, "octo_oldest_unresolved_pending_seconds", {"scope": scope})


def test_an_admission_ack_counts_a_dispatch_and_notes_the_key_pending() -> None:
    m = WorkerMetrics()
    m.after_ack("s1", "compensate_operation", "op-1")
    labels = {"scope": "s1", "kind": "compensation", "result": "dispatch"}
    assert sample(m, "octo_admissions_total", labels) == 1.0
    assert m._pending_since["s1"].keys() == {"op-1"}


@pytest.mark.parametrize(
    ("kind", "refused", "acked", "admission"),
    [
        ("dispatch_operation", False, False, ("operation", "existing")),
        ("dispatch_operation", True, False, ("operation", "refused")),
        ("compensate_operation", True, False, ("compensation", "refused")),
        ("dispatch_operation", False, True, None),  # the observation after the admission
        ("reconcile_operation", False, False, None),
        ("invoke", False, False, None),
    ],
)
def test_a_confirmed_reply_counts_what_answered_before_any_ack(
    kind: str, refused: bool, acked: bool, admission: tuple[str, str] | None
) -> None:
    m = WorkerMetrics()
    m.after_reply("s1", kind, "op-1", refused, acked)
    assert sample(m, "octo_replies_total", {"scope": "s1", "outcome": "confirmed"}) == 1.0
    counted = {
        (sample_.labels["kind"], sample_.labels["result"])
        for metric in m.registry.collect()
        if metric.name == "octo_admissions"
        for sample_ in metric.samples
        if sample_.name == "octo_admissions_total"
    }
    assert counted == ({admission} if admission else set())


def test_a_reply_about_to_leave_resolves_or_keeps_its_key_pending() -> None:
    m = WorkerMetrics()
    m.after_ack("s1", "dispatch_operation", "op-1")
    m.before_reply("s1", "dispatch_operation", "op-1", True)  # running
    assert "op-1" in m._pending_since["s1"]
    m.before_reply("s1", "dispatch_operation", "op-1", None)  # says nothing
    assert "op-1" in m._pending_since["s1"]
    m.before_reply("s1", "invoke", "op-1", False)  # not a keyed request
    assert "op-1" in m._pending_since["s1"]
    m.after_reply("s1", "reconcile_operation", "op-1", False, False)  # the confirm: no change
    assert "op-1" in m._pending_since["s1"]
    m.before_reply("s1", "reconcile_operation", "op-1", False)  # terminal
    assert "s1" not in m._pending_since
    assert pending_age(m, "s1") == 0.0


def test_a_compensation_lookup_resolves_or_keeps_its_key_pending() -> None:
    # A compensation admitted and cut by a crash is found by its lookup.
    m = WorkerMetrics()
    m.after_ack("s1", "compensate_operation", "op-1")
    m.before_reply("s1", "reconcile_compensation", "op-1", True)  # pending
    assert "op-1" in m._pending_since["s1"]
    m.before_reply("s1", "reconcile_compensation", "op-1", False)  # terminal
    assert "s1" not in m._pending_since


def test_commit_failures_count_by_code_except_a_replayed_open() -> None:
    m = WorkerMetrics()
    m.on_commit_failed("s1", StorageBackendError("disk"))
    m.on_commit_failed("s1", FencingTokenRejected(3, 2))
    m.on_commit_failed("s1", SessionReplay("sess-1"))
    m.after_commit("s1", 0.002)
    assert sample(m, "octo_journal_commit_failures_total", {"code": "storage_backend_error"}) == 1
    assert sample(m, "octo_journal_commit_failures_total", {"code": "fencing_token_rejected"}) == 1
    assert sample(m, "octo_journal_commit_failures_total", {"code": "session_replay"}) is None
    assert sample(m, "octo_journal_commit_seconds_count") == 1.0


def test_daemon_points_set_their_metrics() -> None:
    m = WorkerMetrics()
    m.on_dead_letter("s1", "scope_mismatch")
    m.on_poisoned("s1", "sess-1")
    m.after_delivery("s1", "acked")
    m.on_reply_failed("s1", "dispatch_operation")
    m.after_outbox_loaded("s1", 4)
    m.after_transaction(3)
    m.on_consumers_changed(2)
    m.after_adapter_call("s1", "t.op", "invoke", "ok", 0.01)
    frames = {"scope": "s1", "reason": "scope_mismatch"}
    assert sample(m, "octo_frames_rejected_total", frames) == 1.0
    assert sample(m, "octo_sessions_poisoned_total", {"scope": "s1"}) == 1.0
    assert sample(m, "octo_deliveries_total", {"scope": "s1", "outcome": "acked"}) == 1.0
    assert sample(m, "octo_replies_total", {"scope": "s1", "outcome": "failed"}) == 1.0
    assert sample(m, "octo_outbox_pending", {"scope": "s1"}) == 4.0
    assert sample(m, "octo_journal_commit_batch_size_sum") == 3.0
    assert sample(m, "octo_consumers_active") == 2.0
    outcome = {"tool": "t.op", "method": "invoke", "outcome": "ok"}
    assert sample(m, "octo_adapter_outcomes_total", outcome) == 1.0
    assert (sample(m, "octo_last_progress_timestamp_seconds") or 0.0) > 0.0


# Faults --------------------------------------------------------------------------------


class RecordingInjector(FaultInjector):
    def __init__(self) -> None:
        super().__init__("")
        self.reached: list[tuple[str, float]] = []

    def reach(self, point: str, *, settle: float = 0.0) -> None:
        self.reached.append((point, settle))


def test_fault_hooks_reach_each_worker_point_at_its_hook() -> None:
    injector = RecordingInjector()
    hooks = FaultHooks(injector)
    hooks.after_admission_commit("s1", "dispatch_operation", "op-1")
    hooks.after_ack("s1", "dispatch_operation", "op-1")
    hooks.after_effect("s1", "t.op", "dispatch_operation")
    hooks.before_reply("s1", "dispatch_operation", "op-1", None)
    hooks.after_reply("s1", "dispatch_operation", "op-1", False, True)
    hooks.after_commit("s1", 0.001)  # no kill point
    hooks.on_dead_letter("s1", "scope_mismatch")  # no kill point
    assert injector.reached[:5] == [
        ("worker.after_admission_commit", 0.0),
        ("worker.after_ack", 0.2),
        ("worker.after_effect", 0.0),
        ("worker.before_reply", 0.0),
        ("worker.after_reply", 0.0),
    ]
    hooks.after_admission_commit("s1", "compensate_operation", "op-1")
    hooks.after_effect("s1", "t.op", "compensate_operation")
    hooks.after_effect("s1", "t.op", "invoke")  # another method: the generic point only
    assert injector.reached[5:] == [
        ("worker.after_admission_commit", 0.0),
        ("worker.after_compensation_admission_commit", 0.0),
        ("worker.after_effect", 0.0),
        ("worker.after_compensation_effect", 0.0),
        ("worker.after_effect", 0.0),
    ]
    assert {point for point, _ in injector.reached} == {
        point for point in FAULT_POINTS if point.startswith("worker.")
    }
