"""The host's reactions to a worker's refusal and to a reply, as tables.

This module owns two decisions and nothing else:

* :func:`rejection_reaction`: what a verb does after the worker answered its
  request with ``request_rejected``: reconcile the same key later,
  open a new session, dispatch the same key again (only ``unknown_operation``
  on a reconcile), or fail closed;
* :func:`reply_reaction`: what the reply consumer does with an authentic
  reply that could not be applied to the ledger: drop it, keep the
  request waiting for an outcome that may follow, release the caller with the
  refusal, drop a stale observation, fail closed, or dead-letter it.

A code or an error this module does not list fails closed. It is pure: it
must never do I/O, read a ledger or a session, or log; the client applies
its answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

from octo_common.errors import (
    DuplicateFrame,
    InvalidCompensationStateTransition,
    InvalidStateTransition,
    LedgerError,
    OctoError,
    WorkerRequestRejected,
    WorkflowError,
)
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.kinds import RequestKind

__all__ = [
    "Reaction",
    "ReplyReaction",
    "rejection_reaction",
    "reply_reaction",
    "stale_observation",
]


class Reaction(StrEnum):
    """What a verb does after the worker refused its request."""

    RECONCILE = "reconcile"
    """The intent is durable at the worker, its outcome unknown: reconcile the same key."""
    NEW_SESSION = "new_session"
    """This session cannot serve the key: open a new session, then reconcile."""
    DISPATCH_SAME_KEY = "dispatch_same_key"
    """The worker never admitted the key: it may be dispatched again under the same key
    (only while the ledger still holds it ``pending``; the verb checks that)."""
    COMPENSATE_SAME_KEY = "compensate_same_key"
    """The worker never admitted the compensation (``unknown_compensation`` on a
    lookup): it may be sent under the same ``cmp-`` key and a fresh approval,
    only while the ledger still holds it ``pending`` and by a caller that holds the
    inverse input (recovery); the lookup itself raises the refusal to that caller."""
    FAIL_CLOSED = "fail_closed"
    """Drift between host and worker, configuration, or a code not listed: raise."""


_R = Reaction

# The reaction to each refusal code. Every kind reacts alike unless _BY_KIND says otherwise.
_BY_CODE: Final[Mapping[str, Reaction]] = {
    # The intent is durable at the worker; the outcome is not known.
    "pending_operation": _R.RECONCILE,
    "pending_compensation": _R.RECONCILE,
    "adapter_error": _R.RECONCILE,
    "indeterminate_operation": _R.RECONCILE,
    "indeterminate_compensation": _R.RECONCILE,
    # The session is unusable (or the worker no longer knows it).
    "session_poisoned": _R.NEW_SESSION,
    "journal_persistence_failed": _R.NEW_SESSION,
    "invalid_journal_revision": _R.NEW_SESSION,
    "unknown_session": _R.NEW_SESSION,
    "session_closed": _R.NEW_SESSION,
    # This session's budget is spent.
    "call_budget_exhausted": _R.NEW_SESSION,
    "compensation_budget_exhausted": _R.NEW_SESSION,
    "reconciliation_budget_exhausted": _R.NEW_SESSION,
    "reconciliation_session_budget_exhausted": _R.NEW_SESSION,
    "session_request_limit_exceeded": _R.NEW_SESSION,
    # Drift between host and worker: an operator decides.
    "operation_identity_mismatch": _R.FAIL_CLOSED,
    "compensation_identity_mismatch": _R.FAIL_CLOSED,
    "compensation_grant_mismatch": _R.FAIL_CLOSED,
    "compensation_tool_mismatch": _R.FAIL_CLOSED,
    "operation_journal_scope_mismatch": _R.FAIL_CLOSED,
    "compensation_requires_succeeded_operation": _R.FAIL_CLOSED,
    # Configuration: an operator decides.
    "missing_adapter": _R.FAIL_CLOSED,
    "durable_operation_contract_not_declared": _R.FAIL_CLOSED,
    "invocation_safety_not_declared": _R.FAIL_CLOSED,
    "unknown_tool": _R.FAIL_CLOSED,
    # Reserved message types.
    "unsupported_message": _R.FAIL_CLOSED,
    # Admission precedes every effect, but only a reconcile proves the key unknown.
    "unknown_operation": _R.FAIL_CLOSED,
    # The worker pruned the key's row: it never runs again; an operator settles it.
    "operation_pruned": _R.FAIL_CLOSED,
}

# Where a kind reacts otherwise. A compensation lookup (RECONCILE_COMPENSATION)
# reacts as the rows above say, except that it alone proves a compensation
# unknown: admission precedes the inverse effect.
_BY_KIND: Final[Mapping[tuple[RequestKind, str], Reaction]] = {
    (RequestKind.RECONCILE, "unknown_operation"): _R.DISPATCH_SAME_KEY,
    (RequestKind.RECONCILE_COMPENSATION, "unknown_compensation"): _R.COMPENSATE_SAME_KEY,
}


def rejection_reaction(kind: RequestKind, code: str) -> Reaction:
    """The reaction to ``request_rejected(code)`` for a request of ``kind``."""
    return _BY_KIND.get((kind, code)) or _BY_CODE.get(code, Reaction.FAIL_CLOSED)


class ReplyReaction(StrEnum):
    """What the reply consumer does with an authentic reply it could not apply.

    Each member names what happens to the delivery and to the waiting request.
    """

    DROP = "drop"
    """A copy already opened (``DuplicateFrame``): ack; the request keeps waiting."""
    KEEP_WAITING = "keep_waiting"
    """A ``pending_*`` refusal of a dispatch or compensation: the worker may still send
    this request's outcome, so ack, release the caller with the refusal and keep
    the request registered (given up on) so that outcome is applied."""
    REFUSED = "refused"
    """Any other refusal: ack, forget the request, release the caller with the refusal;
    the ledger is unchanged."""
    STALE = "stale"
    """A ``running`` observed for a record already terminal (an older answer): ack, forget
    the request, release the caller with ``Running``; nothing is applied."""
    FAIL_CLOSED = "fail_closed"
    """Authentic but inconsistent with the ledger: dead-letter, forget the request,
    release the caller with the error."""
    DEAD_LETTER = "dead_letter"
    """Did not open (tag, stale frame, syntax): not from this session's worker;
    dead-letter, the request keeps waiting."""


# The kinds whose refused request may still be answered with its outcome.
_OUTCOME_MAY_FOLLOW: Final[Mapping[RequestKind, frozenset[str]]] = {
    RequestKind.DISPATCH: frozenset({"pending_operation", "pending_compensation"}),
    RequestKind.COMPENSATE: frozenset({"pending_operation", "pending_compensation"}),
}


def reply_reaction(kind: RequestKind, error: OctoError) -> ReplyReaction:
    """The reaction to ``error``, raised while opening and applying a reply to ``kind``."""
    if isinstance(error, DuplicateFrame):
        return ReplyReaction.DROP
    if isinstance(error, WorkerRequestRejected):
        if error.rejection_code in _OUTCOME_MAY_FOLLOW.get(kind, frozenset()):
            return ReplyReaction.KEEP_WAITING
        return ReplyReaction.REFUSED
    if isinstance(error, InvalidStateTransition | InvalidCompensationStateTransition):
        return ReplyReaction.STALE if stale_observation(error) else ReplyReaction.FAIL_CLOSED
    if isinstance(error, LedgerError | WorkflowError):
        return ReplyReaction.FAIL_CLOSED
    return ReplyReaction.DEAD_LETTER


def stale_observation(
    error: InvalidStateTransition | InvalidCompensationStateTransition,
) -> bool:
    """An observed ``running`` for a record already terminal: older, not contradictory.

    ``running`` precedes every terminal state, so it is an answer the
    worker gave before the outcome the ledger holds. A terminal state that
    differs from the stored one is a contradiction and stays refused.
    """
    return error.observed == StateKind.RUNNING and error.current in TERMINAL_KINDS
