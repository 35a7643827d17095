"""The host's reaction tables (octo_host.reactions), row by row.

Each row of the refusal table is a case: the code, the kind of request it refused and
the reaction the table gives. Then the reply side: each error the engine can
raise while opening and applying a reply, and what the reply consumer does.
"""

from __future__ import annotations

import pytest

from octo_common.errors import (
    CompensationRequestMismatch,
    DuplicateFrame,
    InvalidAuthenticationTag,
    InvalidCompensationStateTransition,
    InvalidStateTransition,
    OctoError,
    PlanOwnershipMismatch,
    ReconciliationMismatch,
    StaleFrame,
    UnexpectedOperationDispatchMessage,
    WorkerRequestRejected,
)
from octo_common.messages import RequestRejected
from octo_common.states import StateKind
from octo_host.kinds import RequestKind
from octo_host.reactions import (
    Reaction,
    ReplyReaction,
    rejection_reaction,
    reply_reaction,
    stale_observation,
)

ALL_KINDS = list(RequestKind)

# One row per code: the reaction for every kind of request.
SAME_FOR_EVERY_KIND = [
    # the intent is durable at the worker, the outcome is not known
    ("pending_operation", Reaction.RECONCILE),
    ("pending_compensation", Reaction.RECONCILE),
    ("adapter_error", Reaction.RECONCILE),
    ("indeterminate_operation", Reaction.RECONCILE),
    ("indeterminate_compensation", Reaction.RECONCILE),
    # the session is unusable
    ("session_poisoned", Reaction.NEW_SESSION),
    ("journal_persistence_failed", Reaction.NEW_SESSION),
    ("invalid_journal_revision", Reaction.NEW_SESSION),
    ("unknown_session", Reaction.NEW_SESSION),
    ("session_closed", Reaction.NEW_SESSION),
    # this session's budget is spent
    ("call_budget_exhausted", Reaction.NEW_SESSION),
    ("compensation_budget_exhausted", Reaction.NEW_SESSION),
    ("reconciliation_budget_exhausted", Reaction.NEW_SESSION),
    ("reconciliation_session_budget_exhausted", Reaction.NEW_SESSION),
    ("session_request_limit_exceeded", Reaction.NEW_SESSION),
    # drift between host and worker
    ("operation_identity_mismatch", Reaction.FAIL_CLOSED),
    ("compensation_identity_mismatch", Reaction.FAIL_CLOSED),
    ("compensation_grant_mismatch", Reaction.FAIL_CLOSED),
    ("compensation_tool_mismatch", Reaction.FAIL_CLOSED),
    ("operation_journal_scope_mismatch", Reaction.FAIL_CLOSED),
    ("compensation_requires_succeeded_operation", Reaction.FAIL_CLOSED),
    # configuration
    ("missing_adapter", Reaction.FAIL_CLOSED),
    ("durable_operation_contract_not_declared", Reaction.FAIL_CLOSED),
    ("invocation_safety_not_declared", Reaction.FAIL_CLOSED),
    ("unknown_tool", Reaction.FAIL_CLOSED),
    # reserved message types
    ("unsupported_message", Reaction.FAIL_CLOSED),
]


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(("code", "reaction"), SAME_FOR_EVERY_KIND)
def test_a_code_gets_its_row_whatever_the_kind(
    kind: RequestKind, code: str, reaction: Reaction
) -> None:
    assert rejection_reaction(kind, code) is reaction


@pytest.mark.parametrize(
    ("kind", "reaction"),
    [
        (RequestKind.RECONCILE, Reaction.DISPATCH_SAME_KEY),
        (RequestKind.DISPATCH, Reaction.FAIL_CLOSED),
        (RequestKind.COMPENSATE, Reaction.FAIL_CLOSED),
        (RequestKind.RECONCILE_COMPENSATION, Reaction.FAIL_CLOSED),
    ],
)
def test_only_a_reconcile_proves_an_operation_unknown(
    kind: RequestKind, reaction: Reaction
) -> None:
    # Admission precedes every effect, so only the answer to a reconcile shows
    # the worker never admitted the key; after a dispatch or a compensation it
    # is drift, and the host fails closed.
    assert rejection_reaction(kind, "unknown_operation") is reaction


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("code", ["", "not_a_code", "PENDING_OPERATION", "pending_operation "])
def test_a_code_the_table_does_not_list_fails_closed(kind: RequestKind, code: str) -> None:
    assert rejection_reaction(kind, code) is Reaction.FAIL_CLOSED


def test_every_reaction_is_reachable() -> None:
    reached = {
        rejection_reaction(kind, code) for kind in ALL_KINDS for code, _ in SAME_FOR_EVERY_KIND
    }
    reached.add(rejection_reaction(RequestKind.RECONCILE, "unknown_operation"))
    reached.add(rejection_reaction(RequestKind.RECONCILE_COMPENSATION, "unknown_compensation"))
    assert reached == set(Reaction)


@pytest.mark.parametrize(
    ("kind", "reaction"),
    [
        (RequestKind.RECONCILE_COMPENSATION, Reaction.COMPENSATE_SAME_KEY),
        (RequestKind.RECONCILE, Reaction.FAIL_CLOSED),
        (RequestKind.DISPATCH, Reaction.FAIL_CLOSED),
        (RequestKind.COMPENSATE, Reaction.FAIL_CLOSED),
    ],
)
def test_only_a_compensation_lookup_proves_a_compensation_unknown(
    kind: RequestKind, reaction: Reaction
) -> None:
    # Admission precedes the inverse effect: a lookup answered unknown_compensation
    # shows the worker never admitted the cmp- key; after anything else the
    # code is drift, and the host fails closed.
    assert rejection_reaction(kind, "unknown_compensation") is reaction


# Replies ------------------------------------------------------------------------


def refused(code: str) -> WorkerRequestRejected:
    return WorkerRequestRejected(RequestRejected("s-1", "r-1", code, "op-1"))


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_a_duplicate_reply_is_dropped_and_the_request_keeps_waiting(kind: RequestKind) -> None:
    assert reply_reaction(kind, DuplicateFrame(7, None)) is ReplyReaction.DROP


@pytest.mark.parametrize("code", ["pending_operation", "pending_compensation"])
@pytest.mark.parametrize("kind", [RequestKind.DISPATCH, RequestKind.COMPENSATE])
def test_a_pending_refusal_of_a_send_keeps_its_request_for_the_outcome(
    kind: RequestKind, code: str
) -> None:
    # The worker may still answer the request with its outcome.
    assert reply_reaction(kind, refused(code)) is ReplyReaction.KEEP_WAITING


@pytest.mark.parametrize("code", ["pending_operation", "pending_compensation"])
@pytest.mark.parametrize("kind", [RequestKind.RECONCILE, RequestKind.RECONCILE_COMPENSATION])
def test_a_pending_refusal_of_a_lookup_releases_its_request(kind: RequestKind, code: str) -> None:
    # As for an operation reconciliation: the caller is released, the verb asks again.
    assert reply_reaction(kind, refused(code)) is ReplyReaction.REFUSED


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(
    "code", ["adapter_error", "session_poisoned", "unknown_operation", "missing_adapter", "x"]
)
def test_any_other_refusal_releases_its_request(kind: RequestKind, code: str) -> None:
    assert reply_reaction(kind, refused(code)) is ReplyReaction.REFUSED


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("current", [StateKind.SUCCEEDED, StateKind.FAILED, StateKind.CANCELLED])
def test_an_older_running_for_a_terminal_record_is_stale(
    kind: RequestKind, current: StateKind
) -> None:
    operation = InvalidStateTransition(current, StateKind.RUNNING)
    compensation = InvalidCompensationStateTransition("cmp-1", current, StateKind.RUNNING)
    assert reply_reaction(kind, operation) is ReplyReaction.STALE
    assert reply_reaction(kind, compensation) is ReplyReaction.STALE


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(
    "error",
    [
        # A terminal state that differs from the stored one contradicts the ledger.
        InvalidStateTransition(StateKind.SUCCEEDED, StateKind.FAILED),
        InvalidCompensationStateTransition("cmp-1", StateKind.FAILED, StateKind.SUCCEEDED),
        # No transition leads back to pending.
        InvalidStateTransition(StateKind.RUNNING, StateKind.PENDING),
        ReconciliationMismatch(),
        CompensationRequestMismatch(),
        UnexpectedOperationDispatchMessage(),
        PlanOwnershipMismatch(),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_reply_the_ledger_contradicts_fails_closed(kind: RequestKind, error: OctoError) -> None:
    assert reply_reaction(kind, error) is ReplyReaction.FAIL_CLOSED


@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize(
    "error",
    [InvalidAuthenticationTag(), StaleFrame(1, 2048)],
    ids=lambda error: type(error).__name__,
)
def test_a_reply_that_does_not_open_is_dead_lettered(kind: RequestKind, error: OctoError) -> None:
    assert reply_reaction(kind, error) is ReplyReaction.DEAD_LETTER


def test_stale_means_running_after_a_terminal_state_only() -> None:
    assert stale_observation(InvalidStateTransition(StateKind.SUCCEEDED, StateKind.RUNNING))
    assert not stale_observation(InvalidStateTransition(StateKind.PENDING, StateKind.RUNNING))
    assert not stale_observation(InvalidStateTransition(StateKind.SUCCEEDED, StateKind.FAILED))
    assert not stale_observation(
        InvalidCompensationStateTransition("cmp-1", StateKind.RUNNING, StateKind.RUNNING)
    )
