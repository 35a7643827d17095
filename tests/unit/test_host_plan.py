"""Plans."""

from __future__ import annotations

import dataclasses

import blake3
import pytest

from octo_common.errors import (
    DuplicateStepId,
    EmptyPlan,
    InvalidStepId,
    PlanSourceTooLarge,
    TooManySteps,
)
from octo_host.engine import WorkflowEngine
from octo_host.plan import WorkflowPlan, WorkflowStep


def spec_fingerprint(steps: list[WorkflowStep]) -> str:
    """The plan fingerprint computed here, independently of octo_common.digest."""
    data = b"octo-workflow-plan-v1" + len(steps).to_bytes(8, "big")
    for step in steps:
        for text in (step.id, step.source):
            raw = text.encode()
            data += len(raw).to_bytes(8, "big") + raw
    return blake3.blake3(data).hexdigest()


def test_plan_fingerprint_and_ids() -> None:
    engine = WorkflowEngine()
    steps = [WorkflowStep("fetch", "let x = 1\n"), WorkflowStep("publish", "Zoë — 東京")]
    first = engine.plan(steps)
    second = engine.plan(steps)
    assert first.fingerprint == spec_fingerprint(steps)
    assert first.fingerprint == second.fingerprint
    assert (first.id, second.id) == (1, 2)
    assert first.engine_id == second.engine_id == engine.engine_id
    assert first.steps == tuple(steps)
    assert first != second
    # A rebuilt plan after a "restart" (another engine) keeps the fingerprint.
    assert WorkflowEngine().plan(steps).fingerprint == first.fingerprint
    # Order and content matter.
    assert engine.plan(steps[::-1]).fingerprint != first.fingerprint
    edited = [steps[0], WorkflowStep("publish", "Zoë — 東京 ")]
    assert engine.plan(edited).fingerprint != first.fingerprint


def test_plans_and_steps_are_frozen() -> None:
    plan = WorkflowEngine().plan([WorkflowStep("a", "")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.id = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps[0].source = "x"  # type: ignore[misc]
    assert plan.has_step("a")
    assert not plan.has_step("b")
    assert isinstance(plan, WorkflowPlan)


def test_source_syntax_is_not_checked() -> None:
    WorkflowEngine().plan([WorkflowStep("a", "\0 not a program {{{")])


def test_empty_plan() -> None:
    with pytest.raises(EmptyPlan):
        WorkflowEngine().plan([])


def test_example_13_step_and_source_limits() -> None:
    engine = WorkflowEngine()
    with pytest.raises(TooManySteps) as many:
        engine.plan([WorkflowStep(f"s{i}", "") for i in range(1025)])
    assert many.value.maximum == 1024
    engine.plan([WorkflowStep(f"s{i}", "") for i in range(1024)])
    with pytest.raises(PlanSourceTooLarge) as large:
        engine.plan([WorkflowStep("a", "x" * 1_048_577)])
    assert (large.value.actual, large.value.maximum) == (1_048_577, 1_048_576)
    engine.plan([WorkflowStep("a", "x" * 1_048_575), WorkflowStep("b", "y")])
    # The source total counts UTF-8 bytes across every step.
    with pytest.raises(PlanSourceTooLarge) as utf8:
        engine.plan([WorkflowStep("a", "é" * 262_144), WorkflowStep("b", "é" * 262_145)])
    assert utf8.value.actual == 1_048_578


def test_plan_check_order() -> None:
    engine = WorkflowEngine()
    # Too many steps wins over too much source and bad ids.
    with pytest.raises(TooManySteps):
        engine.plan([WorkflowStep("Bad", "x" * 1024)] * 1025)
    # Too much source wins over bad and duplicate ids.
    with pytest.raises(PlanSourceTooLarge):
        engine.plan([WorkflowStep("Bad", "x" * 1_048_576), WorkflowStep("Bad", "x")])
    # Per step in order: the first problem found wins.
    with pytest.raises(DuplicateStepId) as duplicate:
        engine.plan([WorkflowStep("a", ""), WorkflowStep("a", ""), WorkflowStep("Bad", "")])
    assert duplicate.value.step_id == "a"
    with pytest.raises(InvalidStepId) as invalid:
        engine.plan([WorkflowStep("a", ""), WorkflowStep("Bad", ""), WorkflowStep("a", "")])
    assert invalid.value.step_id == "Bad"


@pytest.mark.parametrize(
    "step_id", ["", "Publish", "pub lish", "a/b", "a:b", "é", "s" * 129, "x\n"]
)
def test_invalid_step_ids(step_id: str) -> None:
    with pytest.raises(InvalidStepId) as info:
        WorkflowEngine().plan([WorkflowStep(step_id, "")])
    assert info.value.step_id == step_id


@pytest.mark.parametrize("step_id", ["a", "build.step_2", "publish-3", "0", "s" * 128])
def test_valid_step_ids(step_id: str) -> None:
    assert WorkflowEngine().plan([WorkflowStep(step_id, "")]).has_step(step_id)


def test_plan_ids_increase_per_engine_and_engine_ids_per_process() -> None:
    first, second = WorkflowEngine(), WorkflowEngine()
    assert first.engine_id >= 1
    assert second.engine_id == first.engine_id + 1
    step = [WorkflowStep("a", "")]
    assert [first.plan(step).id for _ in range(3)] == [1, 2, 3]
    assert second.plan(step).id == 1
    # A failed plan does not consume a plan id.
    with pytest.raises(EmptyPlan):
        second.plan([])
    assert second.plan(step).id == 2
