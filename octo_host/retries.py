"""Retries of a plan step: when an attempt may be replaced, and the new attempt recorded.

This module owns the one decision of a retry policy (``WorkflowStep.retry``)
over a ledger: an attempt may be replaced by a new attempt under a new key
only when its step has a policy, the attempt is ``failed`` with an outcome
the policy names (by default only ``not_happened``: proven not to have
happened, key fenced), it is not replaced yet, and attempts remain. The new
key is derived from the first attempt's key and the new attempt number
(``octo_common.digest.retry_key_for``), so every host retrying the same
attempt records the same key, and it is recorded (``pending``, chained to
the attempt it replaces) before anything is sent.

Pure and synchronous: it must never do I/O, never replace an attempt that
is ``pending`` or ``running`` (its effect may be under way) or ``succeeded``,
and never reuse a key.
"""

from __future__ import annotations

from octo_common.digest import retry_key_for
from octo_common.errors import RetryNotAllowed, UnknownOperation
from octo_common.limits import MAX_WORKFLOW_OPERATIONS
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan

__all__ = ["record_retry", "retry_key", "retry_refusal"]


def retry_key(plan: WorkflowPlan, first_operation_key: str, attempt: int) -> str:
    """The key of attempt ``attempt`` (2 and up) of the logical operation whose first
    attempt is ``first_operation_key``."""
    return retry_key_for(plan.fingerprint, first_operation_key, attempt)


def retry_refusal(
    plan: WorkflowPlan, ledger: WorkflowOperationLedger, operation_key: str
) -> str | None:
    """Why ``operation_key`` may not be replaced by a new attempt now, or None when it
    may. ``UnknownOperation`` for a key the ledger does not hold; the ledger is
    checked against the plan first (``WorkflowOperationLedger.validate_for``)."""
    ledger.validate_for(plan)
    operation = ledger.operation(operation_key)
    if operation is None:
        raise UnknownOperation(operation_key)
    policy = plan.retry_policy(operation.step_id)
    if policy is None:
        return "the step has no retry policy"
    if ledger.replacement(operation_key) is not None:
        return "the attempt is already replaced"
    refusal = policy.refusal(operation.state, operation.failure, operation.attempt)
    if refusal is None and len(ledger.operations) >= MAX_WORKFLOW_OPERATIONS:
        return f"the run's ledger holds {MAX_WORKFLOW_OPERATIONS} operations"
    return refusal


def record_retry(plan: WorkflowPlan, ledger: WorkflowOperationLedger, operation_key: str) -> str:
    """Record the next attempt of ``operation_key`` in ``ledger`` (``pending``, chained
    to it) and return its key; ``RetryNotAllowed(key, reason)`` when
    :func:`retry_refusal` gives a reason. Only the ledger changes."""
    refusal = retry_refusal(plan, ledger, operation_key)
    if refusal is not None:
        raise RetryNotAllowed(operation_key, refusal)
    attempts = ledger.attempts(operation_key)
    key = retry_key(plan, attempts[0].operation_key, attempts[-1].attempt + 1)
    ledger.record_retry(operation_key, key)
    return key
