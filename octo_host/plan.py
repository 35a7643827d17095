"""Workflow plans: steps, the plan fingerprint and plan construction.

This module owns the plan value types and the ordered checks of
``engine.plan``. A plan is only fingerprinted: Octo never parses or executes
``WorkflowStep.source``. Pure and synchronous; it must never do I/O, hold
engine state or look at ledgers.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from octo_common.digest import plan_fingerprint, plan_fingerprint_with_retries
from octo_common.errors import (
    DuplicateStepId,
    EmptyPlan,
    InvalidRetryPolicy,
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
from octo_common.states import FailureCode, StateKind

__all__ = [
    "MAX_RETRY_ATTEMPTS",
    "RetryOutcome",
    "RetryPolicy",
    "WorkflowPlan",
    "WorkflowStep",
    "build_plan",
    "is_step_id",
]

MAX_RETRY_ATTEMPTS: Final = 16
"""Attempts of one logical operation at most, the first included (a run's ledger
holds 64 operations, retries included)."""
MAX_RETRY_BACKOFF_SECONDS: Final = 3600.0


class RetryOutcome(enum.StrEnum):
    """The outcomes of an attempt a retry policy may answer with a new attempt.

    ``NOT_HAPPENED``: ``failed`` with ``FailureCode.NOT_HAPPENED`` (the effect
    is proven not to have happened, and the key is fenced). ``FAILED``: the
    effect's own definite failure (``failed`` without a code), only when a
    step names it. Nothing else can be named: not ``pending`` or ``running``
    (the effect may be under way: indeterminate), not ``cancelled``, not an
    operator's decision, and never a failure with another code.
    """

    NOT_HAPPENED = "not_happened"
    FAILED = "failed"


_OUTCOME_VALUES: Final = frozenset(outcome.value for outcome in RetryOutcome)
# The failure codes a policy may name (None: the effect's own failure); any other
# code (an input refusal, ...) is never retried, whatever the step says.
_RETRYABLE: Final[dict[str | None, RetryOutcome]] = {
    FailureCode.NOT_HAPPENED: RetryOutcome.NOT_HAPPENED,
    None: RetryOutcome.FAILED,
}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a step's operation is attempted again under a new key (off unless a step has one).

    ``attempts``: attempts at most, the first included (2 to
    :data:`MAX_RETRY_ATTEMPTS`). ``backoff_seconds``: the wait before the
    second attempt, doubled before each next one up to
    ``backoff_max_seconds``. ``retry_on``: the outcomes answered with a new
    attempt (:class:`RetryOutcome`; by default only ``not_happened``).
    Checked by :func:`build_plan` (``InvalidRetryPolicy``); part of the plan
    fingerprint.
    """

    attempts: int
    backoff_seconds: float = 0.5
    backoff_max_seconds: float = 30.0
    retry_on: frozenset[RetryOutcome] = frozenset({RetryOutcome.NOT_HAPPENED})

    def __post_init__(self) -> None:
        # Any collection of outcomes, spelled as members or their values; what
        # is no outcome stays as given, for check() to refuse.
        given = self.retry_on
        if isinstance(given, set | list | tuple | frozenset):
            outcomes = frozenset(
                RetryOutcome(item) if item in _OUTCOME_VALUES else item for item in given
            )
            object.__setattr__(self, "retry_on", outcomes)

    def check(self, step_id: str) -> None:
        """``InvalidRetryPolicy(step_id, detail)`` for a value out of its bounds."""
        attempts = self.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise InvalidRetryPolicy(step_id, "attempts is a whole number")
        if not 2 <= attempts <= MAX_RETRY_ATTEMPTS:
            raise InvalidRetryPolicy(step_id, f"attempts is 2 to {MAX_RETRY_ATTEMPTS}")
        for name in ("backoff_seconds", "backoff_max_seconds"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not 0 <= value <= MAX_RETRY_BACKOFF_SECONDS
            ):
                raise InvalidRetryPolicy(
                    step_id, f"{name} is 0 to {MAX_RETRY_BACKOFF_SECONDS:g} seconds"
                )
        if not isinstance(self.retry_on, frozenset) or not self.retry_on:
            raise InvalidRetryPolicy(step_id, "retry_on names at least one outcome")
        for outcome in self.retry_on:
            if not isinstance(outcome, RetryOutcome):
                raise InvalidRetryPolicy(step_id, "retry_on names not_happened or failed only")

    def encode(self) -> bytes:
        """The canonical bytes the plan fingerprint covers."""
        outcomes = ",".join(sorted(outcome.value for outcome in self.retry_on))
        text = (
            f"attempts={self.attempts};backoff={float(self.backoff_seconds)!r};"
            f"backoff_max={float(self.backoff_max_seconds)!r};retry_on={outcomes}"
        )
        return text.encode("ascii")

    def backoff_before(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt`` (2 and up)."""
        doubled = self.backoff_seconds * (2 ** max(0, attempt - 2))
        return float(min(doubled, self.backoff_max_seconds))

    def refusal(self, state: StateKind, failure: str | None, attempt: int) -> str | None:
        """Why an attempt that ended in ``state`` (with ``failure``) at number
        ``attempt`` may not be replaced, or None when it may."""
        if state != StateKind.FAILED:
            return f"the attempt is {state.value}"
        outcome = _RETRYABLE.get(failure)
        if outcome is None:
            return f"the outcome {failure} is never retried"
        if outcome not in self.retry_on:
            return f"the step does not retry {outcome.value}"
        if attempt >= self.attempts:
            return f"all {self.attempts} attempts are used"
        return None


@dataclass(frozen=True, slots=True)
class WorkflowStep:
    """One step of a plan: an id, an opaque source text (never executed), and an
    optional retry policy (None: an attempt that fails stays failed)."""

    id: str
    source: str
    retry: RetryPolicy | None = None


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

    def retry_policy(self, step_id: str) -> RetryPolicy | None:
        """The retry policy of step ``step_id`` (None: no such step, or none set)."""
        for step in self.steps:
            if step.id == step_id:
                return step.retry
        return None


def is_step_id(value: object) -> bool:
    """Step id syntax: an operation token of 1..128 bytes."""
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
    """Check ``steps`` in this order and build the plan.

    1. empty → ``EmptyPlan``; 2. over 1024 steps → ``TooManySteps``;
    3. total source over 1 MiB → ``PlanSourceTooLarge``; 4. per step in order,
    ``InvalidStepId`` then ``DuplicateStepId``, then ``InvalidRetryPolicy``.
    A plan with no retry policy has the plain plan fingerprint; one with any has
    the fingerprint that covers every step's policy too.
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
        if step.retry is not None:
            step.retry.check(step.id)
    if all(step.retry is None for step in frozen):
        fingerprint = plan_fingerprint(frozen)
    else:
        fingerprint = plan_fingerprint_with_retries(
            (step, None if step.retry is None else step.retry.encode()) for step in frozen
        )
    return WorkflowPlan(engine_id, plan_id, fingerprint, frozen)
