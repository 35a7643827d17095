"""The journal's side of compensation reconciliation.

A compensation left ``pending`` or ``running`` after a crash is resolved by a
lookup: the key must hold a compensation with exactly the identity the
request names; the observed state moves it along the one transition table;
a terminal compensation never changes; a duplicate lookup is answered from
the stored state. Fixtures follow test_journal: ``math.add`` with a
compensation budget of one, scope ``tenant-release``.
"""

from __future__ import annotations

from typing import Any

import pytest

from octo_common.authorizer import AuthorizedCompensationReconciliation, SessionAuthorizer
from octo_common.digest import worker_input_fingerprint
from octo_common.errors import (
    CompensationIdentityMismatch,
    CompensationToolMismatch,
    InvalidWorkerCompensationTransition,
    JournalKeyNotLoaded,
    OctoError,
    OperationJournalScopeMismatch,
    OperationRecordTooLarge,
    OutputTooLarge,
    PayloadFormatMismatch,
    UnknownCompensation,
    UnknownOperation,
    UnknownTool,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import CompensationReconcileRequest
from octo_common.payload import ToolPayload
from octo_common.states import (
    Cancelled,
    Failed,
    OperationStatus,
    Pending,
    Running,
    StateKind,
    Succeeded,
    WorkerOperationState,
)
from octo_worker.journal import (
    Existing,
    JournalRowChange,
    WorkerCompensationRecord,
    WorkerOperationJournal,
    WorkerOperationRecord,
)

SESSION = "session-1"
TOOL = "math.add"
OTHER_TOOL = "math.sub"
SCOPE = "tenant-release"
KEY = "release-42-add"
CMP_KEY = "cmp-release-42-add-undo"

ADD = ToolPayload.json({"left": 20, "right": 22})
UNDO = ToolPayload.json({"undo": "release"})
SUCCESS = Succeeded(ToolPayload.json({"total": 42}))
UNDONE = Succeeded(ToolPayload.json({"undone": True}))
MAX_ROW = 1_032_192

GC = CapabilityGrant(TOOL, "json", 2, 128, 128).with_compensation_limit(1)
OTHER = CapabilityGrant(OTHER_TOOL, "json", 2, 128, 128).with_compensation_limit(1)


def lookup_request(**changes: str) -> CompensationReconcileRequest:
    fields = {
        "session_id": SESSION,
        "request_id": "reconcile-compensation-1",
        "tool": TOOL,
        "operation_key": KEY,
        "compensation_key": CMP_KEY,
        "tenant_scope": SCOPE,
        "grant_fingerprint": GC.compensation_fingerprint(),
    }
    fields.update(changes)
    return CompensationReconcileRequest(**fields)  # type: ignore[arg-type]


def lookup(grant: CapabilityGrant = GC, /, **changes: str) -> AuthorizedCompensationReconciliation:
    authorizer = SessionAuthorizer(CapabilityManifest(SESSION, [grant]))
    return authorizer.authorize_compensation_reconciliation(lookup_request(**changes))


def compensated(
    state: WorkerOperationState, *, grant: CapabilityGrant = GC
) -> WorkerOperationRecord:
    comp = WorkerCompensationRecord(
        CMP_KEY, worker_input_fingerprint(UNDO), grant.compensation_fingerprint(), state
    )
    return WorkerOperationRecord(TOOL, KEY, worker_input_fingerprint(ADD), SUCCESS, comp)


def journal_with(
    record: WorkerOperationRecord | None, revision: int = 7, scope: str = SCOPE
) -> WorkerOperationJournal:
    return WorkerOperationJournal(scope, {KEY: None if record is None else (record, revision)})


def unchanged(journal: WorkerOperationJournal, error: type[OctoError], call: Any) -> OctoError:
    """Run ``call``, expect ``error``, and check the view did not change."""
    before_changes = journal.changeset()
    before_record = journal.operation(KEY)
    with pytest.raises(error) as info:
        call()
    assert journal.changeset() == before_changes
    assert journal.operation(KEY) == before_record
    return info.value


# Resolving a compensation left behind by a crash --------------------------------------


@pytest.mark.parametrize("left", [Pending(), Running()], ids=["pending", "running"])
@pytest.mark.parametrize(
    "observed",
    [UNDONE, Failed("inverse refused"), Cancelled(), Running()],
    ids=["succeeded", "failed", "cancelled", "running"],
)
def test_a_lookup_moves_an_unfinished_compensation_to_the_observed_state(
    left: WorkerOperationState, observed: OperationStatus
) -> None:
    journal = journal_with(compensated(left), revision=11)

    journal.validate_compensation_reconciliation(lookup())
    assert journal.observe_compensation_reconciliation(lookup(), observed) == observed

    record = journal.operation(KEY)
    assert record == compensated(observed)
    assert record is not None and record.state == SUCCESS  # the original never moves
    assert journal.changeset().rows == {KEY: JournalRowChange(compensated(observed), 11)}


@pytest.mark.parametrize(
    "terminal", [UNDONE, Failed("inverse refused"), Cancelled()], ids=lambda s: s.kind.value
)
def test_a_terminal_compensation_answers_itself_and_records_the_row(
    terminal: OperationStatus,
) -> None:
    journal = journal_with(compensated(terminal), revision=4)

    assert journal.observe_compensation_reconciliation(lookup(), terminal) == terminal

    # Like a reconciliation of an operation: the row is committed with the answer.
    assert journal.changeset().rows == {KEY: JournalRowChange(compensated(terminal), 4)}


@pytest.mark.parametrize(
    ("terminal", "observed"),
    [
        (UNDONE, Failed("late")),
        (UNDONE, Running()),
        (UNDONE, Succeeded(ToolPayload.json({"undone": False}))),
        (Failed("inverse refused"), UNDONE),
        (Failed("inverse refused"), Failed("another reason")),
        (Cancelled(), Running()),
        (Cancelled(), UNDONE),
    ],
)
def test_a_terminal_compensation_never_changes(
    terminal: OperationStatus, observed: OperationStatus
) -> None:
    journal = journal_with(compensated(terminal))

    error = unchanged(
        journal,
        InvalidWorkerCompensationTransition,
        lambda: journal.observe_compensation_reconciliation(lookup(), observed),
    )
    assert (error.operation_key, error.current, error.observed) == (  # type: ignore[attr-defined]
        KEY,
        terminal.kind,
        observed.kind,
    )
    assert error.code == "invalid_worker_compensation_transition"


def test_pending_is_never_an_observation() -> None:
    journal = journal_with(compensated(Pending()))
    error = unchanged(
        journal,
        InvalidWorkerCompensationTransition,
        lambda: journal.observe_compensation_reconciliation(lookup(), Pending()),  # type: ignore[arg-type]
    )
    assert error.observed == StateKind.PENDING  # type: ignore[attr-defined]


# Exactly this identity ---------------------------------------------------------------


def test_a_key_without_a_row_is_an_unknown_operation() -> None:
    journal = journal_with(None)
    for call in (
        lambda: journal.validate_compensation_reconciliation(lookup()),
        lambda: journal.observe_compensation_reconciliation(lookup(), UNDONE),
        lambda: journal.lookup_compensation_reconciliation(lookup_request(), GC),
    ):
        error = unchanged(journal, UnknownOperation, call)
        assert error.key == KEY  # type: ignore[attr-defined]


def test_an_original_without_a_compensation_is_an_unknown_compensation() -> None:
    journal = journal_with(WorkerOperationRecord(TOOL, KEY, worker_input_fingerprint(ADD), SUCCESS))
    for call in (
        lambda: journal.validate_compensation_reconciliation(lookup()),
        lambda: journal.observe_compensation_reconciliation(lookup(), UNDONE),
        lambda: journal.lookup_compensation_reconciliation(lookup_request(), GC),
    ):
        error = unchanged(journal, UnknownCompensation, call)
        assert error.code == "unknown_compensation"
        assert error.operation_key == KEY  # type: ignore[attr-defined]
    # An original that never succeeded holds no compensation either.
    pending = journal_with(
        WorkerOperationRecord(TOOL, KEY, worker_input_fingerprint(ADD), Pending())
    )
    unchanged(
        pending, UnknownCompensation, lambda: pending.validate_compensation_reconciliation(lookup())
    )


@pytest.mark.parametrize(
    "change",
    [
        {"compensation_key": "cmp-release-42-add-undo-2"},
        {"grant_fingerprint": "f" * 64},
    ],
    ids=["another-compensation-key", "another-grant-fingerprint"],
)
def test_another_identity_is_a_compensation_identity_mismatch(change: dict[str, str]) -> None:
    journal = journal_with(compensated(Pending()))
    for call in (
        lambda: journal.validate_compensation_reconciliation(lookup(**change)),
        lambda: journal.observe_compensation_reconciliation(lookup(**change), UNDONE),
        lambda: journal.lookup_compensation_reconciliation(lookup_request(**change), GC),
    ):
        error = unchanged(journal, CompensationIdentityMismatch, call)
        assert error.code == "compensation_identity_mismatch"
        assert error.key == KEY  # type: ignore[attr-defined]


def test_another_tool_is_a_compensation_tool_mismatch() -> None:
    journal = journal_with(compensated(Pending()))
    unchanged(
        journal,
        CompensationToolMismatch,
        lambda: journal.validate_compensation_reconciliation(
            lookup(OTHER, tool=OTHER_TOOL, grant_fingerprint=GC.compensation_fingerprint())
        ),
    )


def test_another_tenant_scope_is_refused_before_the_row_is_read() -> None:
    journal = journal_with(compensated(Pending()))
    error = unchanged(
        journal,
        OperationJournalScopeMismatch,
        lambda: journal.validate_compensation_reconciliation(lookup(tenant_scope="tenant-other")),
    )
    assert (error.expected, error.actual) == ("tenant-other", SCOPE)  # type: ignore[attr-defined]
    # Even for a key without a row: the scope is checked first.
    empty = journal_with(None)
    unchanged(
        empty,
        OperationJournalScopeMismatch,
        lambda: empty.lookup_compensation_reconciliation(
            lookup_request(tenant_scope="tenant-other"), GC
        ),
    )


def test_the_stored_state_and_the_observation_are_checked_against_the_current_grant() -> None:
    big = Succeeded(ToolPayload.json({"undone": "y" * 100}))
    narrow = CapabilityGrant(TOOL, "json", 2, 128, 16).with_compensation_limit(1)
    journal = journal_with(compensated(big, grant=narrow))
    unchanged(
        journal,
        OutputTooLarge,
        lambda: journal.validate_compensation_reconciliation(
            lookup(narrow, grant_fingerprint=narrow.compensation_fingerprint())
        ),
    )
    pending = journal_with(compensated(Pending()))
    unchanged(
        pending,
        PayloadFormatMismatch,
        lambda: pending.observe_compensation_reconciliation(
            lookup(), Succeeded(ToolPayload.text("undone"))
        ),
    )


def test_an_oversized_row_leaves_the_view_unchanged() -> None:
    grant = CapabilityGrant(TOOL, "json", 2, 128, 1_100_000).with_compensation_limit(1)
    journal = journal_with(compensated(Pending(), grant=grant))
    huge = Succeeded(ToolPayload.json({"undone": "z" * MAX_ROW}))
    unchanged(
        journal,
        OperationRecordTooLarge,
        lambda: journal.observe_compensation_reconciliation(
            lookup(grant, grant_fingerprint=grant.compensation_fingerprint()), huge
        ),
    )


def test_a_key_that_was_not_loaded_is_a_programming_error() -> None:
    journal = WorkerOperationJournal(SCOPE, {})
    for call in (
        lambda: journal.validate_compensation_reconciliation(lookup()),
        lambda: journal.observe_compensation_reconciliation(lookup(), UNDONE),
        lambda: journal.lookup_compensation_reconciliation(lookup_request(), GC),
    ):
        with pytest.raises(JournalKeyNotLoaded):
            call()


def test_a_token_of_any_authorizer_is_accepted() -> None:
    # A later session reconciles what an earlier one left behind.
    journal = journal_with(compensated(Running()))
    first, second = lookup(), lookup()
    journal.validate_compensation_reconciliation(first)
    assert journal.observe_compensation_reconciliation(second, UNDONE) == UNDONE


# Duplicate lookups -----------------------------------------------------------------


@pytest.mark.parametrize(
    "state", [Pending(), Running(), UNDONE, Failed("inverse refused"), Cancelled()]
)
def test_a_duplicate_lookup_is_answered_from_the_stored_state(
    state: WorkerOperationState,
) -> None:
    journal = journal_with(compensated(state))
    assert journal.lookup_compensation_reconciliation(lookup_request(), GC) == Existing(state)
    assert journal.changeset().rows == {}
    assert journal.operation(KEY) == compensated(state)


def test_a_duplicate_lookup_without_a_grant_is_an_unknown_tool() -> None:
    journal = journal_with(compensated(Pending()))
    error = unchanged(
        journal,
        UnknownTool,
        lambda: journal.lookup_compensation_reconciliation(lookup_request(), None),
    )
    assert error.tool == TOOL  # type: ignore[attr-defined]
