"""Workflow plans: steps, the plan fingerprint and plan construction (H§4).

This module owns the plan value types and the ordered checks of
``engine.plan``. A plan is only fingerprinted: Octo never parses or executes
``WorkflowStep.source``. Pure and synchronous; it must never do I/O, hold
engine state or look at ledgers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from octo_common.digest import plan_fingerprint
from octo_common.errors import (
    DuplicateStepId,
    EmptyPlan,
    InvalidStepId,
    PlanSourceTooLarge,
    TooManySteps,
)
from octo_common.ids import is_token
from octo_common.limits import (
    MAX_WORKFLOW_PLAN_SOURCE_BYTES,
    MAX_WORKFLOW_STEP_ID_BYTES,
    MAX_WORKFLOW_STEPS,
)

__all__ = ["WorkflowPlan", "WorkflowStep", "build_plan", "is_step_id"]


@dataclass(frozen=True, slots=True)
class WorkflowStep:
    """One step of a plan: an id and an opaque source text (never executed)."""

    id: str
    source: str


@dataclass(frozen=True, slots=True)
class WorkflowPlan:
    """A plan of one engine: ``engine_id`` and ``id`` bind ownership and approvals;
    ``fingerprint`` binds ledgers."""

    engine_id: int
    id: int
    fingerprint: str
    steps: tuple[WorkflowStep, ...]
    _step_ids: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "_step_ids", frozenset(step.id for step in self.steps))

    def has_step(self, step_id: object) -> bool:
        """True exactly when ``step_id`` is the id of one of the plan's steps."""
        return isinstance(step_id, str) and step_id in self._step_ids


def is_step_id(value: object) -> bool:
    """Step id syntax (H§3, H§18A.1): an operation token of 1..128 bytes."""
    return (
        isinstance(value, str)
        and len(value.encode("utf-8", "surrogatepass")) <= MAX_WORKFLOW_STEP_ID_BYTES
        and is_token(value)
    )


def _source_bytes(source: object) -> int:
    if not isinstance(source, str):
        return 0
    return len(source.encode("utf-8", "surrogatepass"))


def build_plan(engine_id: int, plan_id: int, steps: Sequence[WorkflowStep]) -> WorkflowPlan:
    """Check ``steps`` in the order of H§4 and build the plan.

    1. empty → ``EmptyPlan``; 2. over 1024 steps → ``TooManySteps``;
    3. total source over 1 MiB → ``PlanSourceTooLarge``; 4. per step in order,
    ``InvalidStepId`` then ``DuplicateStepId``.
    """
    frozen = tuple(steps)
    if not frozen:
        raise EmptyPlan()
    if len(frozen) > MAX_WORKFLOW_STEPS:
        raise TooManySteps(MAX_WORKFLOW_STEPS)
    total = sum(_source_bytes(step.source) for step in frozen)
    if total > MAX_WORKFLOW_PLAN_SOURCE_BYTES:
        raise PlanSourceTooLarge(total, MAX_WORKFLOW_PLAN_SOURCE_BYTES)
    seen: set[str] = set()
    for step in frozen:
        if not is_step_id(step.id):
            raise InvalidStepId(step.id)
        if step.id in seen:
            raise DuplicateStepId(step.id)
        seen.add(step.id)
    return WorkflowPlan(engine_id, plan_id, plan_fingerprint(frozen), frozen)
