"""WorkerOperationJournal scenarios.

Fixtures: ``G`` is the JSON grant ``math.add`` with two calls,
128-byte input and output limits and the ``math-api`` network origin;
``GC = G.with_compensation_limit(1)``; the journal scope is
``tenant-release``. Authorization tokens come from the real
``SessionAuthorizer``; each token gets a fresh authorizer, which is fine
because the journal never checks provenance.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octo_common.authorizer import (
    AuthorizedOperationCompensation,
    AuthorizedOperationInvocation,
    AuthorizedOperationReconciliation,
    SessionAuthorizer,
)
from octo_common.errors import (
    CompensationIdentityMismatch,
    CompensationRequiresSucceededOperation,
    CompensationToolMismatch,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidOperationFailure,
    InvalidOperationFingerprint,
    InvalidToken,
    InvalidWorkerCompensationTransition,
    InvalidWorkerOperationTransition,
    JournalError,
    JournalKeyNotLoaded,
    OctoError,
    OperationIdentityMismatch,
    OperationJournalScopeMismatch,
    OperationRecordTooLarge,
    OutputTooLarge,
    PayloadFormatMismatch,
    RecordLocationMismatch,
    SerializationError,
    UnknownCompensation,
    UnknownOperation,
    UnknownTool,
    UnsupportedOperationJournalVersion,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest, ResourceKind, ResourceSelector
from octo_common.messages import (
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
)
from octo_common.payload import ToolPayload, parse_json
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
    Dispatch,
    Existing,
    JournalChangeset,
    JournalRowChange,
    WorkerCompensationRecord,
    WorkerOperationJournal,
    WorkerOperationRecord,
    validate_record,
)
from tests.vectors import vectors_path

VECTORS = vectors_path()

SESSION = "session-1"
TOOL = "math.add"
OTHER_TOOL = "math.sub"
SCOPE = "tenant-release"
KEY = "release-42-add"
CMP_KEY = "cmp-release-42-add-undo"
FP = "0" * 64

ADD = ToolPayload.json({"left": 20, "right": 22})
ADD_CHANGED = ToolPayload.json({"left": 20, "right": 23})
UNDO = ToolPayload.json({"undo": "release"})
UNDO_CHANGED = ToolPayload.json({"undo": "release", "force": True})
TOTAL = ToolPayload.json({"total": 42})
SUCCESS = Succeeded(TOTAL)
PENDING = Pending()
MAX_ROW = 1_032_192


def grant_g(**limits: Any) -> CapabilityGrant:
    fields: dict[str, Any] = {
        "max_calls": 2,
        "max_input_bytes": 128,
        "max_output_bytes": 128,
        "resources": (ResourceSelector(ResourceKind("network_origin"), "math-api"),),
    }
    fields.update(limits)
    return CapabilityGrant(TOOL, "json", **fields)


GC = grant_g().with_compensation_limit(1)


def authorizer(*grants: CapabilityGrant) -> SessionAuthorizer:
    return SessionAuthorizer(CapabilityManifest(SESSION, list(grants or (GC,))))


def dispatch_request(
    payload: ToolPayload = ADD, *, tool: str = TOOL, key: str = KEY
) -> OperationDispatchRequest:
    return OperationDispatchRequest(SESSION, "dispatch-1", tool, key, payload)


def admission(
    payload: ToolPayload = ADD,
    *,
    tool: str = TOOL,
    key: str = KEY,
    grant: CapabilityGrant | None = None,
) -> AuthorizedOperationInvocation:
    if grant is None:
        grant = GC if tool == TOOL else CapabilityGrant.json(tool).with_compensation_limit(1)
    return authorizer(grant).authorize_operation(dispatch_request(payload, tool=tool, key=key))


def reconcile_request(*, tool: str = TOOL, key: str = KEY) -> OperationReconcileRequest:
    return OperationReconcileRequest(SESSION, "reconcile-1", tool, key)


def reconciliation(
    *, tool: str = TOOL, key: str = KEY, grant: CapabilityGrant | None = None
) -> AuthorizedOperationReconciliation:
    if grant is None:
        grant = GC if tool == TOOL else CapabilityGrant.json(tool)
    return authorizer(grant).authorize_reconciliation(reconcile_request(tool=tool, key=key))


def compensation_request(
    payload: ToolPayload = UNDO,
    *,
    tool: str = TOOL,
    key: str = KEY,
    cmp_key: str = CMP_KEY,
    tenant: str = SCOPE,
    grant: CapabilityGrant = GC,
) -> OperationCompensationRequest:
    binding = OperationCompensationBinding(
        tool, key, cmp_key, tenant, grant.compensation_fingerprint()
    )
    return OperationCompensationRequest(SESSION, "compensate-1", binding, payload)


def compensation(
    payload: ToolPayload = UNDO,
    *,
    tool: str = TOOL,
    key: str = KEY,
    cmp_key: str = CMP_KEY,
    tenant: str = SCOPE,
    grant: CapabilityGrant | None = None,
) -> AuthorizedOperationCompensation:
    if grant is None:
        grant = GC if tool == TOOL else CapabilityGrant.json(tool).with_compensation_limit(1)
    request = compensation_request(
        payload, tool=tool, key=key, cmp_key=cmp_key, tenant=tenant, grant=grant
    )
    return authorizer(grant).authorize_compensation(request)


def fingerprint_of(payload: ToolPayload) -> str:
    from octo_common.digest import worker_input_fingerprint

    return worker_input_fingerprint(payload)


def stored(
    state: WorkerOperationState,
    *,
    tool: str = TOOL,
    key: str = KEY,
    payload: ToolPayload = ADD,
    comp: WorkerCompensationRecord | None = None,
) -> WorkerOperationRecord:
    return WorkerOperationRecord(tool, key, fingerprint_of(payload), state, comp)


def stored_compensation(
    state: WorkerOperationState = PENDING,
    *,
    cmp_key: str = CMP_KEY,
    payload: ToolPayload = UNDO,
    grant: CapabilityGrant = GC,
) -> WorkerCompensationRecord:
    return WorkerCompensationRecord(
        cmp_key, fingerprint_of(payload), grant.compensation_fingerprint(), state
    )


def journal_with(
    record: WorkerOperationRecord | None = None, revision: int = 7, key: str = KEY
) -> WorkerOperationJournal:
    return WorkerOperationJournal(SCOPE, {key: None if record is None else (record, revision)})


def unchanged(journal: WorkerOperationJournal, error: type[OctoError], call: Any) -> OctoError:
    """Run ``call``, expect ``error``, and check the view did not change."""
    before_changes = journal.changeset()
    before_record = journal.operation(KEY)
    with pytest.raises(error) as info:
        call()
    assert journal.changeset() == before_changes
    assert journal.operation(KEY) == before_record
    return info.value


def row_dict(record: WorkerOperationRecord, scope: str = SCOPE) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(record.to_row_json(scope))
    return document


def row_text(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


# One operation's life -----------------------------------------


def test_example_8_admit_observe_and_replay_an_operation() -> None:
    journal = journal_with(None)

    assert journal.admit(admission()) == Dispatch()
    assert journal.admit(admission()) == Existing(Pending())
    assert journal.observe(admission(), Running()) == Running()
    assert journal.observe(admission(), SUCCESS) == SUCCESS
    assert journal.admit(admission()) == Existing(SUCCESS)
    assert journal.observe(admission(), Succeeded(ToolPayload.json({"total": 42}))) == SUCCESS

    error = unchanged(
        journal,
        InvalidWorkerOperationTransition,
        lambda: journal.observe(admission(), Failed("boom")),
    )
    assert (error.operation_key, error.current, error.observed) == (  # type: ignore[attr-defined]
        KEY,
        StateKind.SUCCEEDED,
        StateKind.FAILED,
    )
    unchanged(journal, OperationIdentityMismatch, lambda: journal.admit(admission(ADD_CHANGED)))

    changes = journal.changeset()
    assert changes.scope == SCOPE
    assert changes.rows == {KEY: JournalRowChange(stored(SUCCESS), None)}
    row = changes.rows[KEY].record.to_row_json(SCOPE)
    assert b"left" not in row and b"right" not in row  # never the raw input
    assert row_dict(changes.rows[KEY].record)["record"]["input_fingerprint"] == fingerprint_of(ADD)


def test_a_new_admission_records_exactly_one_pending_row() -> None:
    journal = journal_with(None)

    assert journal.admit(admission()) == Dispatch()

    record = journal.operation(KEY)
    assert record == WorkerOperationRecord(TOOL, KEY, fingerprint_of(ADD), Pending(), None)
    assert journal.changeset() == JournalChangeset(SCOPE, {KEY: JournalRowChange(record, None)})


def test_a_pending_duplicate_is_existing_pending_and_changes_nothing() -> None:
    journal = journal_with(stored(Pending()), revision=3)

    assert journal.admit(admission()) == Existing(Pending())
    assert journal.changeset().rows == {}


def test_a_duplicate_of_a_terminal_operation_is_existing_and_changes_nothing() -> None:
    for state in (SUCCESS, Failed("boom"), Cancelled(), Running()):
        journal = journal_with(stored(state))

        assert journal.admit(admission()) == Existing(state)
        assert journal.changeset().rows == {}


def test_the_journal_accepts_tokens_of_any_authorizer_instance() -> None:
    journal = journal_with(None)
    first = authorizer().authorize_operation(dispatch_request())
    later_session = authorizer().authorize_operation(dispatch_request())

    assert journal.admit(first) == Dispatch()
    assert journal.observe(later_session, SUCCESS) == SUCCESS


# Identity checks ------------------------------------------------------------------


def test_changed_input_for_a_known_key_is_an_identity_mismatch() -> None:
    journal = journal_with(stored(SUCCESS))

    error = unchanged(
        journal, OperationIdentityMismatch, lambda: journal.admit(admission(ADD_CHANGED))
    )
    assert error.key == KEY  # type: ignore[attr-defined]
    unchanged(
        journal,
        OperationIdentityMismatch,
        lambda: journal.observe(admission(ADD_CHANGED), SUCCESS),
    )


def test_changed_tool_for_a_known_key_is_an_identity_mismatch() -> None:
    journal = journal_with(stored(Pending()))

    unchanged(journal, OperationIdentityMismatch, lambda: journal.admit(admission(tool=OTHER_TOOL)))
    unchanged(
        journal,
        OperationIdentityMismatch,
        lambda: journal.observe(admission(tool=OTHER_TOOL), Running()),
    )
    unchanged(
        journal,
        OperationIdentityMismatch,
        lambda: journal.validate_reconciliation(reconciliation(tool=OTHER_TOOL)),
    )


def test_observing_an_unknown_key_is_unknown_operation() -> None:
    journal = journal_with(None)

    error = unchanged(journal, UnknownOperation, lambda: journal.observe(admission(), Running()))
    assert error.key == KEY  # type: ignore[attr-defined]


# Transitions -------------------------------------------------------------------


CONTRADICTIONS: list[tuple[OperationStatus, OperationStatus]] = [
    (SUCCESS, Succeeded(ToolPayload.json({"total": 43}))),
    (SUCCESS, Running()),
    (SUCCESS, Cancelled()),
    (Failed("boom"), Failed("bang")),
    (Failed("boom"), SUCCESS),
    (Failed("boom"), Running()),
    (Cancelled(), Running()),
    (Cancelled(), Failed("boom")),
    (Cancelled(), SUCCESS),
]


@pytest.mark.parametrize(("current", "observed"), CONTRADICTIONS)
def test_a_contradictory_observation_is_refused(
    current: OperationStatus, observed: OperationStatus
) -> None:
    journal = journal_with(stored(current))

    error = unchanged(
        journal, InvalidWorkerOperationTransition, lambda: journal.observe(admission(), observed)
    )
    assert (error.current, error.observed) == (current.kind, observed.kind)  # type: ignore[attr-defined]


@pytest.mark.parametrize("state", [SUCCESS, Failed("boom"), Cancelled(), Running()])
def test_an_identical_observation_is_idempotent(state: OperationStatus) -> None:
    journal = journal_with(stored(state))

    assert journal.observe(admission(), state) == state
    assert journal.changeset().rows == {}


@pytest.mark.parametrize("observed", [Running(), SUCCESS, Failed("boom"), Cancelled()])
def test_pending_accepts_every_status(observed: OperationStatus) -> None:
    journal = journal_with(stored(Pending()), revision=4)

    assert journal.observe(admission(), observed) == observed
    assert journal.changeset().rows == {KEY: JournalRowChange(stored(observed), 4)}


def test_pending_can_never_be_observed() -> None:
    journal = journal_with(stored(Running()))

    error = unchanged(
        journal,
        InvalidWorkerOperationTransition,
        lambda: journal.observe(admission(), Pending()),  # type: ignore[arg-type]
    )
    assert error.observed == StateKind.PENDING  # type: ignore[attr-defined]


def test_an_observation_is_checked_against_the_grant_first() -> None:
    journal = journal_with(None)

    unchanged(
        journal,
        OutputTooLarge,
        lambda: journal.observe(admission(), Succeeded(ToolPayload.json({"x": "y" * 200}))),
    )
    unchanged(
        journal,
        PayloadFormatMismatch,
        lambda: journal.observe(admission(), Succeeded(ToolPayload.text("done"))),
    )
    unchanged(journal, InvalidOperationFailure, lambda: journal.observe(admission(), Failed("")))


# Stored states re-checked against the current grant -----------


def seventy_five_byte_success() -> Succeeded:
    payload = ToolPayload.json({"total": "x" * 63})
    assert payload.validate_for("json") == 75
    return Succeeded(payload)


def test_example_10_a_stored_success_too_large_for_the_current_grant() -> None:
    journal = journal_with(stored(seventy_five_byte_success()))
    narrow = grant_g(max_output_bytes=16)

    error = unchanged(journal, OutputTooLarge, lambda: journal.admit(admission(grant=narrow)))
    assert (error.actual, error.maximum) == (75, 16)  # type: ignore[attr-defined]
    with pytest.raises(OutputTooLarge):
        journal.lookup_operation(dispatch_request(), narrow)
    with pytest.raises(OutputTooLarge):
        journal.validate_reconciliation(reconciliation(grant=narrow))
    with pytest.raises(OutputTooLarge):
        journal.lookup_reconciliation(reconcile_request(), narrow)


def test_a_stored_success_in_another_format_than_the_grant() -> None:
    text_grant = CapabilityGrant.text(TOOL)
    journal = journal_with(stored(SUCCESS, payload=ToolPayload.text("add 20 22")))

    with pytest.raises(PayloadFormatMismatch):
        journal.admit(admission(ToolPayload.text("add 20 22"), grant=text_grant))


# Compensation rules -----------------------------------------


@pytest.mark.parametrize(
    "state", [Pending(), Running(), Failed("boom"), Cancelled()], ids=lambda s: s.kind.value
)
def test_compensation_requires_a_succeeded_original(state: WorkerOperationState) -> None:
    journal = journal_with(stored(state))

    error = unchanged(
        journal,
        CompensationRequiresSucceededOperation,
        lambda: journal.admit_compensation(compensation()),
    )
    assert (error.operation_key, error.state) == (KEY, state.kind)  # type: ignore[attr-defined]


def test_example_9_compensation_on_a_pending_original_names_pending() -> None:
    journal = journal_with(None)
    journal.admit(admission())

    error = unchanged(
        journal,
        CompensationRequiresSucceededOperation,
        lambda: journal.admit_compensation(compensation()),
    )
    assert error.state == StateKind.PENDING  # type: ignore[attr-defined]


def test_example_9_a_wrong_tenant_is_a_scope_mismatch() -> None:
    journal = journal_with(stored(SUCCESS))

    error = unchanged(
        journal,
        OperationJournalScopeMismatch,
        lambda: journal.admit_compensation(compensation(tenant="tenant-other")),
    )
    assert (error.expected, error.actual) == ("tenant-other", SCOPE)  # type: ignore[attr-defined]


def test_the_scope_is_checked_before_the_original_exists() -> None:
    journal = journal_with(None)

    unchanged(
        journal,
        OperationJournalScopeMismatch,
        lambda: journal.admit_compensation(compensation(tenant="tenant-other")),
    )
    unchanged(journal, UnknownOperation, lambda: journal.admit_compensation(compensation()))


def test_compensation_admission_observation_and_replay() -> None:
    journal = journal_with(stored(SUCCESS), revision=9)

    assert journal.admit_compensation(compensation()) == Dispatch()
    assert journal.admit_compensation(compensation()) == Existing(Pending())
    assert journal.observe_compensation(compensation(), Running()) == Running()
    done = Succeeded(ToolPayload.json({"undone": True}))
    assert journal.observe_compensation(compensation(), done) == done
    assert journal.admit_compensation(compensation()) == Existing(done)
    assert journal.observe_compensation(compensation(), done) == done

    error = unchanged(
        journal,
        InvalidWorkerCompensationTransition,
        lambda: journal.observe_compensation(compensation(), Failed("late")),
    )
    assert (error.operation_key, error.current, error.observed) == (  # type: ignore[attr-defined]
        KEY,
        StateKind.SUCCEEDED,
        StateKind.FAILED,
    )
    record = journal.operation(KEY)
    assert record is not None
    assert record.state == SUCCESS  # the original is untouched
    assert record.compensation == stored_compensation(done)
    assert journal.changeset().rows == {KEY: JournalRowChange(record, 9)}
    row = record.to_row_json(SCOPE)
    assert b'"undo":"release"' not in row  # the inverse input is only fingerprinted


def test_a_changed_inverse_input_is_a_compensation_identity_mismatch() -> None:
    journal = journal_with(stored(SUCCESS, comp=stored_compensation()))

    error = unchanged(
        journal,
        CompensationIdentityMismatch,
        lambda: journal.admit_compensation(compensation(UNDO_CHANGED)),
    )
    assert error.key == KEY  # type: ignore[attr-defined]
    unchanged(
        journal,
        CompensationIdentityMismatch,
        lambda: journal.observe_compensation(compensation(UNDO_CHANGED), Running()),
    )


def test_a_second_compensation_key_is_refused() -> None:
    journal = journal_with(stored(SUCCESS, comp=stored_compensation()))

    unchanged(
        journal,
        CompensationIdentityMismatch,
        lambda: journal.admit_compensation(compensation(cmp_key="cmp-release-42-add-undo-2")),
    )


def test_a_changed_grant_fingerprint_is_refused() -> None:
    journal = journal_with(stored(SUCCESS, comp=stored_compensation()))
    changed = grant_g().with_compensation_limit(2)

    unchanged(
        journal,
        CompensationIdentityMismatch,
        lambda: journal.admit_compensation(compensation(grant=changed)),
    )


def test_a_compensation_with_another_tool_is_refused() -> None:
    journal = journal_with(stored(SUCCESS))

    error = unchanged(
        journal,
        CompensationToolMismatch,
        lambda: journal.admit_compensation(compensation(tool=OTHER_TOOL)),
    )
    assert error.key == KEY  # type: ignore[attr-defined]


def test_observing_a_compensation_that_was_never_admitted() -> None:
    journal = journal_with(stored(SUCCESS))

    unchanged(
        journal,
        UnknownCompensation,
        lambda: journal.observe_compensation(compensation(), Running()),
    )
    unchanged(
        journal,
        UnknownOperation,
        lambda: journal_with(None).observe_compensation(compensation(), Running()),
    )


def test_a_stored_compensation_is_rechecked_against_the_current_grant() -> None:
    big = Succeeded(ToolPayload.json({"undone": "y" * 100}))
    journal = journal_with(stored(SUCCESS, comp=stored_compensation(big)))

    assert journal.admit_compensation(compensation()) == Existing(big)
    narrow = grant_g(max_output_bytes=16).with_compensation_limit(1)
    record = stored(SUCCESS, comp=stored_compensation(big, grant=narrow))
    journal = journal_with(record)
    with pytest.raises(OutputTooLarge):
        journal.admit_compensation(compensation(grant=narrow))


def test_an_oversized_compensation_candidate_leaves_the_view_unchanged() -> None:
    grant = grant_g(max_output_bytes=1_100_000).with_compensation_limit(1)
    journal = journal_with(stored(SUCCESS, comp=stored_compensation(grant=grant)))
    huge = Succeeded(ToolPayload.json({"undone": "z" * MAX_ROW}))

    unchanged(
        journal,
        OperationRecordTooLarge,
        lambda: journal.observe_compensation(compensation(grant=grant), huge),
    )


# Reconciliation ------------------------------------------------------------------


def test_reconciliation_of_an_unknown_key() -> None:
    journal = journal_with(None)

    unchanged(journal, UnknownOperation, lambda: journal.validate_reconciliation(reconciliation()))
    unchanged(
        journal,
        UnknownOperation,
        lambda: journal.observe_reconciliation(reconciliation(), Running()),
    )


def test_an_unchanged_reconciliation_still_records_the_row() -> None:
    journal = journal_with(stored(Running()), revision=12)

    assert journal.observe_reconciliation(reconciliation(), Running()) == Running()

    assert journal.changeset().rows == {KEY: JournalRowChange(stored(Running()), 12)}


def test_reconciliation_resolves_a_pending_row() -> None:
    journal = journal_with(stored(Pending()), revision=2)

    journal.validate_reconciliation(reconciliation())
    assert journal.observe_reconciliation(reconciliation(), SUCCESS) == SUCCESS

    assert journal.changeset().rows == {KEY: JournalRowChange(stored(SUCCESS), 2)}


def test_a_contradictory_reconciliation_is_refused_and_records_nothing() -> None:
    journal = journal_with(stored(Failed("boom")))

    unchanged(
        journal,
        InvalidWorkerOperationTransition,
        lambda: journal.observe_reconciliation(reconciliation(), SUCCESS),
    )


# Read-only lookups -------------------------------------------------------


def test_lookups_without_a_grant_are_unknown_tool() -> None:
    journal = journal_with(stored(SUCCESS, comp=stored_compensation()))

    for call in (
        lambda: journal.lookup_operation(dispatch_request(), None),
        lambda: journal.lookup_reconciliation(reconcile_request(), None),
        lambda: journal.lookup_compensation(compensation_request(), None),
    ):
        error = unchanged(journal, UnknownTool, call)
        assert error.tool == TOOL  # type: ignore[attr-defined]


def test_lookups_answer_the_stored_state_and_never_mutate() -> None:
    done = Succeeded(ToolPayload.json({"undone": True}))
    journal = journal_with(stored(SUCCESS, comp=stored_compensation(done)))

    assert journal.lookup_operation(dispatch_request(), GC) == Existing(SUCCESS)
    assert journal.lookup_reconciliation(reconcile_request(), GC) == Existing(SUCCESS)
    assert journal.lookup_compensation(compensation_request(), GC) == Existing(done)
    assert journal.changeset().rows == {}


def test_lookups_of_missing_records() -> None:
    journal = journal_with(None)

    unchanged(journal, UnknownOperation, lambda: journal.lookup_operation(dispatch_request(), GC))
    unchanged(
        journal, UnknownOperation, lambda: journal.lookup_reconciliation(reconcile_request(), GC)
    )
    unchanged(
        journal, UnknownOperation, lambda: journal.lookup_compensation(compensation_request(), GC)
    )
    succeeded = journal_with(stored(SUCCESS))
    unchanged(
        succeeded,
        UnknownCompensation,
        lambda: succeeded.lookup_compensation(compensation_request(), GC),
    )


def test_lookups_apply_the_identity_rules() -> None:
    journal = journal_with(stored(Pending()))

    assert journal.lookup_operation(dispatch_request(), GC) == Existing(Pending())
    with pytest.raises(OperationIdentityMismatch):
        journal.lookup_operation(dispatch_request(ADD_CHANGED), GC)
    with pytest.raises(CompensationRequiresSucceededOperation):
        journal.lookup_compensation(compensation_request(), GC)
    with pytest.raises(OperationJournalScopeMismatch):
        journal.lookup_compensation(compensation_request(tenant="tenant-other"), GC)


# The view ----------------------------------------------------------------------------


def test_every_method_requires_a_loaded_key() -> None:
    journal = WorkerOperationJournal(SCOPE, {})
    calls: list[Callable[[], object]] = [
        lambda: journal.operation(KEY),
        lambda: journal.admit(admission()),
        lambda: journal.observe(admission(), Running()),
        lambda: journal.validate_reconciliation(reconciliation()),
        lambda: journal.observe_reconciliation(reconciliation(), Running()),
        lambda: journal.admit_compensation(compensation()),
        lambda: journal.observe_compensation(compensation(), Running()),
        lambda: journal.lookup_operation(dispatch_request(), GC),
        lambda: journal.lookup_reconciliation(reconcile_request(), GC),
        lambda: journal.lookup_compensation(compensation_request(), GC),
    ]
    for call in calls:
        with pytest.raises(JournalKeyNotLoaded) as info:
            call()
        assert info.value.key == KEY


def test_validate_scope() -> None:
    journal = WorkerOperationJournal(SCOPE, {})

    journal.validate_scope(SCOPE)
    with pytest.raises(OperationJournalScopeMismatch) as info:
        journal.validate_scope("tenant-other")
    assert (info.value.expected, info.value.actual) == ("tenant-other", SCOPE)
    with pytest.raises(InvalidToken) as bad:
        journal.validate_scope("Tenant Other")
    assert bad.value.field == "operation journal scope"
    with pytest.raises(InvalidToken):
        WorkerOperationJournal("Bad Scope", {})


def test_a_loaded_record_must_sit_at_its_own_key() -> None:
    with pytest.raises(RecordLocationMismatch) as info:
        WorkerOperationJournal(SCOPE, {"other-key": (stored(SUCCESS), 1)})
    assert (info.value.expected, info.value.actual) == ("other-key", KEY)


def test_the_changeset_carries_each_rows_base_revision() -> None:
    second = "release-43-add"
    journal = WorkerOperationJournal(
        SCOPE, {KEY: (stored(Pending()), 5), second: None, "untouched": None}
    )

    journal.observe(admission(), SUCCESS)
    journal.admit(admission(key=second))

    changes = journal.changeset()
    assert list(changes.rows) == [KEY, second]
    assert changes.rows[KEY].base_revision == 5
    assert changes.rows[second].base_revision is None
    assert bool(changes) and not bool(WorkerOperationJournal(SCOPE, {}).changeset())


def test_rebase_starts_the_next_changeset_from_the_committed_revision() -> None:
    journal = journal_with(None)
    journal.admit(admission())

    journal.rebase(21)
    assert journal.changeset().rows == {}
    journal.observe(admission(), SUCCESS)

    assert journal.changeset().rows == {KEY: JournalRowChange(stored(SUCCESS), 21)}
    with pytest.raises(ValueError):
        journal.rebase(0)


def test_values_are_frozen_and_compare_by_value() -> None:
    record = stored(SUCCESS)

    assert record == stored(Succeeded(ToolPayload.json({"total": 42})))
    assert Dispatch() == Dispatch()
    assert Existing(Running()) == Existing(Running())
    with pytest.raises(AttributeError):
        record.tool = OTHER_TOOL  # type: ignore[misc]
    with pytest.raises(AttributeError):
        Existing(Running()).state = Pending()  # type: ignore[misc]


def test_reprs_show_tool_key_and_state_kind_only() -> None:
    secret_output = Succeeded(ToolPayload.json({"total": "secret-output-value"}))
    record = stored(secret_output, comp=stored_compensation(Failed("secret failure text")))

    text = repr(record)
    assert TOOL in text and KEY in text and "succeeded" in text
    assert "secret" not in text and fingerprint_of(ADD) not in text
    assert "secret" not in repr(Existing(secret_output))
    assert "secret" not in repr(JournalChangeset(SCOPE, {KEY: JournalRowChange(record, 1)}))
    assert "secret" not in repr(stored(Failed("secret failure text")))


def test_journal_errors_never_echo_payloads() -> None:
    journal = journal_with(stored(SUCCESS))

    with pytest.raises(JournalError) as info:
        journal.admit(admission(ToolPayload.json({"left": "secret-input", "right": 1})))
    assert "secret" not in str(info.value) and "secret" not in repr(info.value)


# Rows --------------------------------------------------------------------------


def test_the_row_document_is_exactly_the_specified_compact_encoding() -> None:
    record = stored(Pending())

    assert record.to_row_json(SCOPE) == (
        b'{"format_version":2,"scope":"tenant-release","record":{"tool":"math.add",'
        b'"operation_key":"release-42-add","input_fingerprint":"'
        + fingerprint_of(ADD).encode()
        + b'","state":{"state":"pending"},"compensation":null}}'
    )


def test_rows_round_trip() -> None:
    records = [
        stored(Pending()),
        stored(Running()),
        stored(Failed('boom \u2028 "quoted"')),
        stored(Cancelled()),
        stored(SUCCESS),
        stored(SUCCESS, comp=stored_compensation()),
        stored(SUCCESS, comp=stored_compensation(Succeeded(ToolPayload.text("undone")))),
    ]
    for record in records:
        text = record.to_row_json(SCOPE)
        assert WorkerOperationRecord.from_row_json(text, SCOPE, KEY) == record
        assert WorkerOperationRecord.from_row_json(text.decode(), SCOPE, KEY) == record


def test_a_row_without_its_compensation_key_decodes_as_none() -> None:
    document = row_dict(stored(SUCCESS))
    del document["record"]["compensation"]

    assert WorkerOperationRecord.from_row_json(row_text(document), SCOPE, KEY) == stored(SUCCESS)


def test_a_non_canonical_but_valid_row_decodes() -> None:
    document = row_dict(stored(SUCCESS))
    text = json.dumps(document, indent=2, sort_keys=True)

    assert WorkerOperationRecord.from_row_json(text, SCOPE, KEY) == stored(SUCCESS)


def test_example_11_a_running_original_holding_a_compensation_fails_on_load() -> None:
    document = row_dict(stored(SUCCESS, comp=stored_compensation()))
    document["record"]["state"] = {"state": "running"}

    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        WorkerOperationRecord.from_row_json(row_text(document), SCOPE, KEY)
    assert (info.value.operation_key, info.value.state) == (KEY, StateKind.RUNNING)


def tampered(edit: Any, record: WorkerOperationRecord | None = None) -> bytes:
    document = row_dict(record or stored(SUCCESS, comp=stored_compensation()))
    edit(document)
    return row_text(document)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda d: d.update(extra=1), SerializationError),
        (lambda d: d["record"].update(extra=1), SerializationError),
        (lambda d: d["record"]["compensation"].update(extra=1), SerializationError),
        (lambda d: d.pop("scope"), SerializationError),
        (lambda d: d["record"].pop("state"), SerializationError),
        (lambda d: d["record"].update(state={"state": "Succeeded"}), SerializationError),
        (lambda d: d.update(format_version=True), SerializationError),
        (lambda d: d.update(format_version=2.0), SerializationError),
        (lambda d: d.update(format_version=256), SerializationError),
        (lambda d: d["record"].update(tool=7), SerializationError),
        (lambda d: d.update(format_version=1), UnsupportedOperationJournalVersion),
        (lambda d: d.update(format_version=3), UnsupportedOperationJournalVersion),
        (lambda d: d.update(scope="tenant-other"), OperationJournalScopeMismatch),
        (lambda d: d["record"].update(operation_key="other-key"), RecordLocationMismatch),
        (lambda d: d["record"].update(tool="Math.Add"), InvalidToken),
        (lambda d: d["record"].update(input_fingerprint="A" * 64), InvalidOperationFingerprint),
        (lambda d: d["record"].update(input_fingerprint="0" * 63), InvalidOperationFingerprint),
        (
            lambda d: d["record"].update(state={"state": "failed", "message": ""}),
            InvalidOperationFailure,
        ),
        (
            lambda d: d["record"]["compensation"].update(compensation_key="undo-1"),
            InvalidCompensationKey,
        ),
        (
            lambda d: d["record"]["compensation"].update(input_fingerprint="xyz"),
            InvalidOperationFingerprint,
        ),
        (
            lambda d: d["record"]["compensation"].update(grant_fingerprint="F" * 64),
            InvalidCompensationGrantFingerprint,
        ),
    ],
)
def test_tampered_rows_are_refused(edit: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        WorkerOperationRecord.from_row_json(tampered(edit), SCOPE, KEY)


def test_decoding_checks_run_in_the_specified_order() -> None:
    # version before scope before location before record validation
    both = tampered(lambda d: d.update(format_version=1, scope="tenant-other"))
    with pytest.raises(UnsupportedOperationJournalVersion) as version:
        WorkerOperationRecord.from_row_json(both, SCOPE, KEY)
    assert version.value.version == 1
    scope_and_key = tampered(
        lambda d: (d.update(scope="tenant-other"), d["record"].update(operation_key="other"))
    )
    with pytest.raises(OperationJournalScopeMismatch) as scope:
        WorkerOperationRecord.from_row_json(scope_and_key, SCOPE, KEY)
    assert (scope.value.expected, scope.value.actual) == (SCOPE, "tenant-other")
    key_and_fp = tampered(
        lambda d: d["record"].update(operation_key="other", input_fingerprint="bad")
    )
    with pytest.raises(RecordLocationMismatch) as location:
        WorkerOperationRecord.from_row_json(key_and_fp, SCOPE, KEY)
    assert (location.value.expected, location.value.actual) == (KEY, "other")


def test_the_failed_message_bounds_apply_to_stored_rows() -> None:
    empty = tampered(lambda d: d["record"].update(state={"state": "failed", "message": ""}))
    with pytest.raises(InvalidOperationFailure):
        WorkerOperationRecord.from_row_json(empty, SCOPE, KEY)


def test_duplicate_keys_in_a_row_are_refused() -> None:
    text = (
        stored(Pending())
        .to_row_json(SCOPE)
        .replace(b'"tool":"math.add"', b'"tool":"math.add","tool":"math.add"')
    )

    with pytest.raises(SerializationError):
        WorkerOperationRecord.from_row_json(text, SCOPE, KEY)


def test_an_oversized_row_text_is_refused_before_parsing() -> None:
    text = b"{" + b" " * MAX_ROW  # not even JSON: the size check must come first

    with pytest.raises(OperationRecordTooLarge) as info:
        WorkerOperationRecord.from_row_json(text, SCOPE, KEY)
    assert (info.value.actual, info.value.maximum) == (MAX_ROW + 1, MAX_ROW)
    with pytest.raises(OperationRecordTooLarge):
        WorkerOperationRecord.from_row_json(text.decode(), SCOPE, KEY)


def row_of_size(size: int) -> WorkerOperationRecord:
    base = len(stored(Succeeded(ToolPayload.json({"p": ""}))).to_row_json(SCOPE))
    record = stored(Succeeded(ToolPayload.json({"p": "x" * (size - base)})))
    assert len(record.to_row_json(SCOPE)) == size
    return record


def test_the_row_bound_is_inclusive() -> None:
    largest = row_of_size(MAX_ROW)
    text = largest.to_row_json(SCOPE)

    assert WorkerOperationRecord.from_row_json(text, SCOPE, KEY) == largest
    too_large = stored(
        Succeeded(ToolPayload.json({"p": "x" * (len(largest.state.payload.value["p"]) + 1)}))  # type: ignore[union-attr]
    )
    with pytest.raises(OperationRecordTooLarge) as info:
        too_large.to_row_json(SCOPE)
    assert (info.value.actual, info.value.maximum) == (MAX_ROW + 1, MAX_ROW)


def test_an_oversized_observation_leaves_the_row_pending() -> None:
    wide = grant_g(max_output_bytes=1_100_000)
    journal = journal_with(stored(Pending()), revision=1)
    huge = Succeeded(ToolPayload.json({"total": "z" * MAX_ROW}))

    unchanged(
        journal, OperationRecordTooLarge, lambda: journal.observe(admission(grant=wide), huge)
    )
    unchanged(
        journal,
        OperationRecordTooLarge,
        lambda: journal.observe_reconciliation(reconciliation(grant=wide), huge),
    )
    assert journal.operation(KEY) == stored(Pending())


def test_validate_record_checks_in_order() -> None:
    bad_everything = WorkerOperationRecord("Bad Tool", "Bad Key", "bad", Failed(""), None)

    with pytest.raises(InvalidToken) as scope:
        validate_record("Bad Scope", bad_everything)
    assert scope.value.field == "operation journal scope"
    with pytest.raises(InvalidToken) as tool:
        validate_record(SCOPE, bad_everything)
    assert tool.value.field == "tool"
    with pytest.raises(InvalidToken) as key:
        validate_record(SCOPE, msgspec.structs.replace(bad_everything, tool=TOOL))
    assert key.value.field == "operation key"
    good_ids = msgspec.structs.replace(bad_everything, tool=TOOL, operation_key=KEY)
    with pytest.raises(InvalidOperationFingerprint):
        validate_record(SCOPE, good_ids)
    with pytest.raises(InvalidOperationFailure):
        validate_record(SCOPE, msgspec.structs.replace(good_ids, input_fingerprint=FP))
    pending_with_comp = stored(Pending(), comp=stored_compensation(cmp_key="bad"))
    with pytest.raises(CompensationRequiresSucceededOperation):
        validate_record(SCOPE, pending_with_comp)
    with pytest.raises(InvalidToken) as cmp_token:
        validate_record(SCOPE, stored(SUCCESS, comp=stored_compensation(cmp_key="Bad Key")))
    assert cmp_token.value.field == "compensation key"


def test_validate_record_remembers_only_what_passed_under_that_scope() -> None:
    from octo_worker import journal as journal_module

    record = stored(SUCCESS)
    document = validate_record(SCOPE, record)
    # The store's check of the same record object returns the same document.
    assert validate_record(SCOPE, record) is document
    assert record.to_row_json(SCOPE) is document
    # An equal but distinct record, or another scope, is validated again.
    assert validate_record(SCOPE, stored(SUCCESS)) == document
    with pytest.raises(InvalidToken):
        validate_record("Bad Scope", record)
    other = validate_record("tenant-other", record)
    assert json.loads(other)["scope"] == "tenant-other"
    # A record that failed is refused every time.
    bad = WorkerOperationRecord(TOOL, KEY, "bad", SUCCESS, None)
    for _ in range(2):
        with pytest.raises(InvalidOperationFingerprint):
            validate_record(SCOPE, bad)
    # The memory is bounded.
    for index in range(journal_module._VALIDATED_MAX + 10):
        validate_record(SCOPE, stored(SUCCESS, key=f"key-{index}"))
    assert len(journal_module._VALIDATED) == journal_module._VALIDATED_MAX


# Conformance vectors ------------------------------------------------------------------


def test_rows_store_the_reference_worker_input_fingerprint() -> None:
    if not VECTORS.exists():
        pytest.skip(f"conformance vectors not found at {VECTORS}")
    cases = json.loads(VECTORS.read_text())["canonical_inputs"]
    wide = CapabilityGrant(TOOL, "json", max_input_bytes=1 << 20)
    text_grant = CapabilityGrant(TOOL, "text", max_input_bytes=1 << 20)
    checked = 0
    for case in cases:
        if case["format"] == "json":
            payload, grant = ToolPayload.json(parse_json(case["input"])), wide
        else:
            payload, grant = ToolPayload.text(case["input"]), text_grant
        journal = journal_with(None)
        journal.admit(admission(payload, grant=grant))
        record = journal.operation(KEY)
        assert record is not None
        assert record.input_fingerprint == case["worker_input_fingerprint"], case["id"]
        checked += 1
    assert checked == len(cases) > 0


# Properties ------------------------------------------------------------------------------


STATUSES = st.sampled_from(
    [
        Running(),
        SUCCESS,
        Succeeded(ToolPayload.json({"total": 43})),
        Failed("boom"),
        Failed("bang"),
        Cancelled(),
    ]
)
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.sampled_from([ADD, ADD_CHANGED])),
        st.tuples(st.just("observe"), STATUSES),
        st.tuples(st.just("reconcile"), STATUSES),
        st.tuples(st.just("admit_compensation"), st.sampled_from([UNDO, UNDO_CHANGED])),
        st.tuples(st.just("observe_compensation"), STATUSES),
    ),
    max_size=12,
)

# The transition table, written out independently of octo_common.states.
ALLOWED = {
    StateKind.PENDING: {
        StateKind.RUNNING,
        StateKind.SUCCEEDED,
        StateKind.FAILED,
        StateKind.CANCELLED,
    },
    StateKind.RUNNING: {
        StateKind.RUNNING,
        StateKind.SUCCEEDED,
        StateKind.FAILED,
        StateKind.CANCELLED,
    },
}


def model_accepts(current: WorkerOperationState, observed: OperationStatus) -> bool:
    if current.kind in ALLOWED:
        return observed.kind in ALLOWED[current.kind]
    return current == observed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_sequences_never_leave_an_invalid_row_and_errors_change_nothing(
    actions: list[tuple[str, Any]],
) -> None:
    journal = journal_with(None)
    for action, argument in actions:
        before_record = journal.operation(KEY)
        before_changes = journal.changeset()
        try:
            if action == "admit":
                outcome = journal.admit(admission(argument))
                if before_record is None:
                    assert outcome == Dispatch()
                else:
                    assert outcome == Existing(before_record.state)
            elif action == "observe":
                journal.observe(admission(), argument)
            elif action == "reconcile":
                journal.observe_reconciliation(reconciliation(), argument)
            elif action == "admit_compensation":
                journal.admit_compensation(compensation(argument))
            else:
                journal.observe_compensation(compensation(), argument)
        except OctoError:
            assert journal.operation(KEY) == before_record
            assert journal.changeset() == before_changes
            continue
        after = journal.operation(KEY)
        assert after is not None
        validate_record(SCOPE, after)  # never an invalid row
        assert WorkerOperationRecord.from_row_json(after.to_row_json(SCOPE), SCOPE, KEY) == after
        if action in ("observe", "reconcile") and before_record is not None:
            assert model_accepts(before_record.state, argument)
            assert after.state == argument
        if after.compensation is not None:
            assert after.state.kind is StateKind.SUCCEEDED
        if before_record is not None and before_record.compensation is not None:
            assert after.compensation is not None
            assert after.compensation.compensation_key == CMP_KEY
        if journal.changeset().rows:
            assert journal.changeset().rows[KEY].record == after
