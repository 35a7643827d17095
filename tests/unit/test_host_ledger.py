"""WorkflowOperationLedger: data model, JSON, syntax, revision rule and ledger methods
."""

from __future__ import annotations

import json
from dataclasses import replace

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octo_common.errors import (
    CompensationAlreadyRecorded,
    CompensationInputFingerprintMismatch,
    CompensationPolicyMismatch,
    CompensationRequestMismatch,
    CompensationRequiresSucceededOperation,
    DuplicateOperationKey,
    InputFingerprintMismatch,
    InputTooLarge,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidCompensationStateTransition,
    InvalidCompensationTenantScope,
    InvalidInputFingerprint,
    InvalidLedgerEncoding,
    InvalidOperationKey,
    InvalidPlanFingerprint,
    InvalidStateTransition,
    InvalidStepId,
    InvalidToken,
    InvalidTool,
    LedgerTooLarge,
    ReconciliationMismatch,
    RevisionExhausted,
    StaleRevision,
    TooManyOperations,
    UnknownCompensation,
    UnknownOperation,
    UnsupportedLedgerVersion,
)
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationReconcileRequest,
    OperationReconcileResult,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import Cancelled, Failed, OperationStatus, Running, StateKind, Succeeded
from octo_host.compensation import WorkflowCompensationPolicy
from octo_host.ledger import WorkflowCompensation, WorkflowOperation, WorkflowOperationLedger

PLAN_FP = "1a5593c4cb0b60c18fdd0c42b3b49abe7159867869d57069f5e2cfbfdd10d807"
FP = "ab" * 32
MAX_U64 = 2**64 - 1
TOOL = "release.publish"
KEY = "release-2026-1"
SESSION = "worker-1"
GRANT = CapabilityGrant.json(TOOL).with_compensation_limit(1)
POLICY = WorkflowCompensationPolicy("tenant-release", GRANT)
UNDO = ToolPayload.json({"undo": "release"})
UNDO_INPUT = canonical_operation_input_bytes(UNDO)


def fingerprint(data: bytes) -> str:
    """The workflow input fingerprint computed here, independently of octo_common.digest."""
    return blake3.blake3(
        b"octo-workflow-operation-input-v1" + len(data).to_bytes(8, "big") + data
    ).hexdigest()


def fresh() -> WorkflowOperationLedger:
    return WorkflowOperationLedger(PLAN_FP)


def with_operation(state: StateKind = StateKind.PENDING) -> WorkflowOperationLedger:
    ledger = fresh()
    ledger.record("publish", TOOL, KEY, b"input")
    if state is not StateKind.PENDING:
        statuses: dict[StateKind, OperationStatus] = {
            StateKind.RUNNING: Running(),
            StateKind.SUCCEEDED: Succeeded(ToolPayload.text("ok")),
            StateKind.FAILED: Failed("boom"),
            StateKind.CANCELLED: Cancelled(),
        }
        reconcile(ledger, statuses[state])
    return ledger


def reconcile(
    ledger: WorkflowOperationLedger, status: OperationStatus, request_id: str = "r-1"
) -> OperationStatus:
    request = ledger.reconcile_request(KEY, b"input", SESSION, request_id)
    result = OperationReconcileResult(SESSION, request_id, TOOL, KEY, status)
    return ledger.apply_verified_reconciliation(request, result)


def with_compensation() -> WorkflowOperationLedger:
    ledger = with_operation(StateKind.SUCCEEDED)
    ledger.record_compensation(KEY, POLICY, "cmp-undo", UNDO_INPUT)
    return ledger


def compensation_request(request_id: str = "c-1") -> OperationCompensationRequest:
    return OperationCompensationRequest(SESSION, request_id, binding(), UNDO)


def binding(**changes: str) -> OperationCompensationBinding:
    fields = {
        "tool": TOOL,
        "operation_key": KEY,
        "compensation_key": "cmp-undo",
        "tenant_scope": "tenant-release",
        "grant_fingerprint": POLICY.grant_fingerprint,
    }
    fields.update(changes)
    return OperationCompensationBinding(**fields)


def compensation_result(
    status: OperationStatus, request_id: str = "c-1", **changes: str
) -> OperationCompensationResult:
    return OperationCompensationResult(SESSION, request_id, binding(**changes), status)


def document(ledger: WorkflowOperationLedger) -> dict[str, object]:
    value = json.loads(ledger.to_json())
    assert isinstance(value, dict)
    return value


# Data model and JSON -------------------------------------------------------


def test_fresh_ledger_encoding_is_exact() -> None:
    assert fresh().to_json() == (
        '{"format_version":2,"revision":0,"plan_fingerprint":"' + PLAN_FP + '","operations":[]}'
    )


def test_recorded_operation_encoding_is_exact_and_holds_only_fingerprints() -> None:
    ledger = fresh()
    ledger.record("publish", TOOL, KEY, b"private request payload")
    assert ledger.revision == 1
    text = ledger.to_json()
    assert text == (
        '{"format_version":2,"revision":1,"plan_fingerprint":"' + PLAN_FP + '","operations":['
        '{"step_id":"publish","tool":"release.publish","operation_key":"release-2026-1",'
        '"input_fingerprint":"' + fingerprint(b"private request payload") + '",'
        '"state":"pending","compensation":null}]}'
    )
    assert list(document(ledger)) == [
        "format_version",
        "revision",
        "plan_fingerprint",
        "operations",
    ]
    assert "private" not in text


def test_compensation_encoding_is_exact() -> None:
    ledger = with_compensation()
    operation = document(ledger)["operations"][0]  # type: ignore[index]
    assert list(operation) == [
        "step_id",
        "tool",
        "operation_key",
        "input_fingerprint",
        "state",
        "compensation",
    ]
    assert operation["compensation"] == {
        "compensation_key": "cmp-undo",
        "input_fingerprint": fingerprint(UNDO_INPUT),
        "tenant_scope": "tenant-release",
        "grant_fingerprint": POLICY.grant_fingerprint,
        "state": "pending",
    }
    assert list(operation["compensation"]) == [
        "compensation_key",
        "input_fingerprint",
        "tenant_scope",
        "grant_fingerprint",
        "state",
    ]


def test_accessors_and_records() -> None:
    ledger = with_compensation()
    assert ledger.plan_fingerprint == PLAN_FP
    assert ledger.format_version == 2
    operation = ledger.operation(KEY)
    assert operation is not None
    assert ledger.operations == (operation,)
    assert ledger.operation("release-2026") is None
    assert operation.state is StateKind.SUCCEEDED
    assert operation.matches_input(b"input")
    assert not operation.matches_input(b"other")
    assert not operation.matches_input(b"\0" * 262_145)
    compensation = operation.compensation
    assert compensation is not None
    assert compensation.matches_input(UNDO_INPUT)
    assert compensation.matches_policy(POLICY)
    assert not compensation.matches_policy(WorkflowCompensationPolicy("tenant-other", GRANT))
    with pytest.raises(InputTooLarge):
        compensation.verify_input(b"\0" * 262_145)
    with pytest.raises(CompensationInputFingerprintMismatch) as info:
        compensation.verify_input(b"x")
    assert info.value.compensation_key == "cmp-undo"
    with pytest.raises(InputFingerprintMismatch) as op_info:
        operation.verify_input(b"x")
    assert op_info.value.key == KEY


def test_ledgers_compare_field_by_field_and_copies_are_independent() -> None:
    first, second = with_operation(), with_operation()
    assert first == second
    copy = first.copy()
    copy.record("publish", TOOL, "release-2026-2", b"")
    assert copy != first
    assert first != WorkflowOperationLedger(PLAN_FP, revision=1, operations=first.operations[:0])
    assert first != WorkflowOperationLedger("cd" * 32, revision=1, operations=first.operations)


# Encoding size bound ---------------------------------------------------


def _long_operation(index: int, *, compensated: bool) -> WorkflowOperation:
    pad = f"{index:03d}"
    compensation = None
    if compensated:
        compensation = WorkflowCompensation(
            "cmp-" + pad + "c" * 121, FP, pad + "t" * 125, FP, StateKind.PENDING
        )
    return WorkflowOperation(
        pad + "s" * 125,
        pad + "t" * 125,
        pad + "k" * 125,
        FP,
        StateKind.SUCCEEDED,
        compensation,
    )


def test_conservative_bound_trips_before_the_real_encoding_is_too_large() -> None:
    # 64 recorded operations with 128-byte step, tool and key (35 527 bytes).
    plain = [
        replace(_long_operation(i, compensated=False), state=StateKind.PENDING) for i in range(64)
    ]
    ledger = WorkflowOperationLedger(PLAN_FP, revision=64, operations=plain)
    assert len(ledger.to_json()) == 35_527
    with_28 = [_long_operation(i, compensated=i < 28) for i in range(64)]
    WorkflowOperationLedger(PLAN_FP, operations=with_28).to_json()
    with_29 = [_long_operation(i, compensated=i < 29) for i in range(64)]
    too_large = WorkflowOperationLedger(PLAN_FP, operations=with_29)
    with pytest.raises(LedgerTooLarge):
        too_large.to_json()


def test_to_json_validates_syntax_first() -> None:
    ledger = WorkflowOperationLedger("ABC")
    with pytest.raises(InvalidPlanFingerprint):
        ledger.to_json()


# Decoding ---------------------------------------------------------


def _text(**changes: object) -> str:
    value = json.loads(with_compensation().to_json())
    value.update(changes)
    return json.dumps(value, separators=(",", ":"))


def test_example_19_decoding() -> None:
    base = with_compensation()
    assert WorkflowOperationLedger.from_json(base.to_json()) == base
    with pytest.raises(UnsupportedLedgerVersion) as version:
        WorkflowOperationLedger.from_json(_text(format_version=1))
    assert version.value.version == 1
    for bad in (
        _text(format_version=256),
        _text(format_version=-1),
        _text(extra=1),
        base.to_json().replace('"revision":3', '"revision":3,"revision":3'),
        base.to_json().replace('"state":"succeeded"', '"state":"Succeeded"'),
        base.to_json().replace('"revision":3', '"revision":1.0'),
        base.to_json().replace('"revision":3', '"revision":-1'),
        base.to_json().replace('"revision":3', '"revision":true'),
        base.to_json().replace('"revision":3', '"revision":18446744073709551616'),
        base.to_json() + "x",
        base.to_json()[:-1],
        base.to_json().replace('"tool":"release.publish",', ""),
        base.to_json().replace('"tenant_scope"', '"tenant_scope":"x","tenant"'),
        base.to_json().replace('"compensation":{', '"compensation":{"extra":1,'),
        base.to_json().replace('"step_id"', '"step_id":"publish","step_id"'),
        "",
        "null",
        "[]",
    ):
        assert bad != base.to_json()
        with pytest.raises(InvalidLedgerEncoding):
            WorkflowOperationLedger.from_json(bad)
    missing = base.to_json().replace(',"compensation":null', "")
    no_compensation = with_operation(StateKind.SUCCEEDED)
    assert (
        WorkflowOperationLedger.from_json(
            no_compensation.to_json().replace(',"compensation":null', "")
        )
        == no_compensation
    )
    assert WorkflowOperationLedger.from_json(missing) == base
    zero = WorkflowOperationLedger.from_json(_text(revision=0))
    assert zero.revision == 0 and len(zero.operations) == 1
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger.from_json(_text(plan_fingerprint="ABC"))
    with pytest.raises(InvalidCompensationKey):
        WorkflowOperationLedger.from_json(base.to_json().replace('"cmp-undo"', '"op-x"'))
    assert WorkflowOperationLedger.from_json("  \n" + base.to_json() + "\t\n") == base
    assert WorkflowOperationLedger.from_json(base.to_json().encode()) == base


def test_example_12_decoding_limits_and_stored_syntax() -> None:
    with pytest.raises(LedgerTooLarge):
        WorkflowOperationLedger.from_json("x" * 65_537)
    # The size check counts UTF-8 bytes and runs before parsing.
    with pytest.raises(LedgerTooLarge):
        WorkflowOperationLedger.from_json("é" * 32_769)
    with pytest.raises(InvalidTool) as info:
        WorkflowOperationLedger.from_json(with_operation().to_json().replace(TOOL, "bad tool"))
    assert info.value.tool == "bad tool"


def test_decoding_checks_compensation_against_original_state() -> None:
    text = (
        with_compensation()
        .to_json()
        .replace('"state":"succeeded","compensation"', '"state":"running","compensation"')
    )
    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        WorkflowOperationLedger.from_json(text)
    assert (info.value.operation_key, info.value.state) == (KEY, StateKind.RUNNING)


# validate_syntax -----------------------------------------------------------------


def _operation(**changes: object) -> WorkflowOperation:
    base = WorkflowOperation("publish", TOOL, KEY, FP, StateKind.SUCCEEDED, None)
    return replace(base, **changes)  # type: ignore[arg-type]


def _compensation(**changes: object) -> WorkflowCompensation:
    base = WorkflowCompensation("cmp-undo", FP, "tenant-release", FP, StateKind.PENDING)
    return replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("operation", "error"),
    [
        (_operation(step_id="Publish", tool="Bad", operation_key="cmp-x"), InvalidStepId),
        (_operation(step_id="", tool="Bad"), InvalidStepId),
        (_operation(step_id="s" * 129), InvalidStepId),
        (_operation(tool="Bad", operation_key="cmp-x"), InvalidTool),
        (_operation(operation_key="cmp-x", input_fingerprint="x"), InvalidOperationKey),
        (_operation(operation_key=""), InvalidOperationKey),
        (_operation(input_fingerprint="AB" * 32), InvalidInputFingerprint),
        (
            _operation(state=StateKind.FAILED, compensation=_compensation(compensation_key="x")),
            CompensationRequiresSucceededOperation,
        ),
        (
            _operation(compensation=_compensation(compensation_key="op-x", tenant_scope="T")),
            InvalidCompensationKey,
        ),
        (
            _operation(compensation=_compensation(compensation_key="cmp-X")),
            InvalidCompensationKey,
        ),
        (
            _operation(compensation=_compensation(input_fingerprint="x", tenant_scope="T")),
            InvalidInputFingerprint,
        ),
        (
            _operation(compensation=_compensation(tenant_scope="T", grant_fingerprint="x")),
            InvalidCompensationTenantScope,
        ),
        (
            _operation(compensation=_compensation(grant_fingerprint="x")),
            InvalidCompensationGrantFingerprint,
        ),
    ],
)
def test_operation_syntax_first_error_wins(
    operation: WorkflowOperation, error: type[Exception]
) -> None:
    with pytest.raises(error):
        operation.validate_syntax()
    with pytest.raises(error):
        WorkflowOperationLedger(PLAN_FP, operations=[operation]).validate_syntax()


def test_ledger_syntax_order() -> None:
    bad_operation = _operation(tool="Bad")
    with pytest.raises(UnsupportedLedgerVersion):
        WorkflowOperationLedger("ABC", format_version=3).validate_syntax()
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC", operations=[bad_operation] * 65).validate_syntax()
    with pytest.raises(TooManyOperations):
        WorkflowOperationLedger(PLAN_FP, operations=[bad_operation] * 65).validate_syntax()
    # Each operation's own syntax comes before the duplicate check of a later one.
    duplicate = _operation()
    with pytest.raises(DuplicateOperationKey) as info:
        WorkflowOperationLedger(
            PLAN_FP, operations=[duplicate, duplicate, bad_operation]
        ).validate_syntax()
    assert info.value.key == KEY
    with pytest.raises(InvalidTool):
        WorkflowOperationLedger(
            PLAN_FP, operations=[duplicate, bad_operation, duplicate]
        ).validate_syntax()


def test_compensation_keys_need_not_be_unique_across_operations() -> None:
    shared = _compensation()
    WorkflowOperationLedger(
        PLAN_FP,
        operations=[
            _operation(compensation=shared),
            _operation(operation_key="op-2", compensation=shared),
        ],
    ).validate_syntax()


def test_validate_minimum_revision() -> None:
    ledger = with_operation()
    ledger.validate_minimum_revision(1)
    ledger.validate_minimum_revision(0)
    with pytest.raises(StaleRevision) as info:
        ledger.validate_minimum_revision(2)
    assert (info.value.actual, info.value.minimum) == (1, 2)
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC", revision=5).validate_minimum_revision(9)


# record ------------------------------------------------------------


def test_record_appends_pending_and_increments() -> None:
    ledger = fresh()
    ledger.record("publish", TOOL, KEY, b"a")
    ledger.record("publish", TOOL, "op-2", b"b")
    assert ledger.revision == 2
    assert [op.operation_key for op in ledger.operations] == [KEY, "op-2"]
    assert all(
        op.state is StateKind.PENDING and op.compensation is None for op in ledger.operations
    )
    assert ledger.operations[1].input_fingerprint == fingerprint(b"b")


def test_record_refusals_leave_the_ledger_unchanged() -> None:
    ledger = with_operation()
    before = ledger.to_json()
    with pytest.raises(InputTooLarge) as info:
        ledger.record("publish", TOOL, "op-2", b"\0" * 262_145)
    assert (info.value.actual, info.value.maximum) == (262_145, 262_144)
    with pytest.raises(InvalidOperationKey):
        ledger.record("publish", TOOL, "cmp-reserved", b"")
    with pytest.raises(DuplicateOperationKey):
        ledger.record("publish", TOOL, KEY, b"")
    assert ledger.to_json() == before
    ledger.record("publish", TOOL, "op-2", b"\0" * 262_144)


def test_record_check_order() -> None:
    big = b"\0" * 262_145
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC").record("Bad", "Bad", "cmp-x", big)
    with pytest.raises(InputTooLarge):
        fresh().record("Bad", "Bad", "cmp-x", big)
    full = WorkflowOperationLedger(
        PLAN_FP,
        revision=MAX_U64,
        operations=[_operation(operation_key=f"op-{i}") for i in range(64)],
    )
    with pytest.raises(TooManyOperations):
        full.record("Bad", "Bad", "cmp-x", b"")
    exhausted = WorkflowOperationLedger(PLAN_FP, revision=MAX_U64)
    with pytest.raises(RevisionExhausted):
        exhausted.record("Bad", "Bad", "cmp-x", b"")
    with pytest.raises(InvalidStepId):
        fresh().record("Bad", "Bad", "cmp-x", b"")
    with pytest.raises(InvalidTool):
        fresh().record("publish", "Bad", "cmp-x", b"")
    ledger = with_operation()
    with pytest.raises(InvalidOperationKey):
        ledger.record("publish", TOOL, "Bad", b"")


def test_sixty_fifth_operation_is_refused() -> None:
    ledger = fresh()
    for index in range(64):
        ledger.record("publish", TOOL, f"op-{index}", b"")
    with pytest.raises(TooManyOperations) as info:
        ledger.record("publish", TOOL, "op-64", b"")
    assert info.value.maximum == 64
    assert ledger.revision == 64


def test_example_20_revision_exhaustion() -> None:
    text = (
        with_operation(StateKind.RUNNING).to_json().replace('"revision":2', f'"revision":{MAX_U64}')
    )
    ledger = WorkflowOperationLedger.from_json(text)
    assert ledger.revision == MAX_U64
    with pytest.raises(RevisionExhausted):
        ledger.record("publish", TOOL, "op-2", b"")
    ledger.validate_minimum_revision(MAX_U64)
    # An idempotent observation at the ceiling succeeds; a change does not.
    assert reconcile(ledger, Running()) == Running()
    with pytest.raises(RevisionExhausted):
        reconcile(ledger, Cancelled())
    assert ledger.operations[0].state is StateKind.RUNNING
    assert ledger.to_json() == text


# record_compensation --------------------------------------------------------------


def test_record_compensation_sets_intent_and_increments() -> None:
    ledger = with_compensation()
    assert ledger.revision == 3
    operation = ledger.operation(KEY)
    assert operation is not None
    assert operation.compensation == WorkflowCompensation(
        "cmp-undo",
        fingerprint(UNDO_INPUT),
        "tenant-release",
        POLICY.grant_fingerprint,
        StateKind.PENDING,
    )
    assert operation.state is StateKind.SUCCEEDED


def test_record_compensation_check_order() -> None:
    big = b"\0" * 262_145
    other_tool = WorkflowCompensationPolicy(
        "tenant-release", CapabilityGrant.json("other.tool").with_compensation_limit(1)
    )
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC").record_compensation("nope", POLICY, "x", big)
    with pytest.raises(InputTooLarge):
        fresh().record_compensation("nope", POLICY, "x", big)
    with pytest.raises(UnknownOperation) as unknown:
        fresh().record_compensation("nope", other_tool, "x", b"")
    assert unknown.value.key == "nope"
    with pytest.raises(CompensationRequiresSucceededOperation) as pending:
        with_operation().record_compensation(KEY, other_tool, "x", b"")
    assert pending.value.state is StateKind.PENDING
    with pytest.raises(CompensationPolicyMismatch) as mismatch:
        with_operation(StateKind.SUCCEEDED).record_compensation(KEY, other_tool, "x", b"")
    assert mismatch.value.key == KEY
    with pytest.raises(CompensationAlreadyRecorded):
        with_compensation().record_compensation(KEY, POLICY, "x", b"")
    with pytest.raises(InvalidCompensationKey) as bad_key:
        with_operation(StateKind.SUCCEEDED).record_compensation(KEY, POLICY, "op-x", b"")
    assert bad_key.value.value == "op-x"
    with pytest.raises(InvalidCompensationKey):
        with_operation(StateKind.SUCCEEDED).record_compensation(KEY, POLICY, "cmp-BAD", b"")
    text = (
        with_operation(StateKind.SUCCEEDED)
        .to_json()
        .replace('"revision":2', f'"revision":{MAX_U64}')
    )
    exhausted = WorkflowOperationLedger.from_json(text)
    with pytest.raises(RevisionExhausted):
        exhausted.record_compensation(KEY, POLICY, "cmp-x", b"")
    assert exhausted.to_json() == text


@pytest.mark.parametrize(
    "state", [StateKind.PENDING, StateKind.RUNNING, StateKind.FAILED, StateKind.CANCELLED]
)
def test_record_compensation_refused_for_unsucceeded_originals(state: StateKind) -> None:
    ledger = with_operation(state)
    before = ledger.to_json()
    with pytest.raises(CompensationRequiresSucceededOperation) as info:
        ledger.record_compensation(KEY, POLICY, "cmp-x", UNDO_INPUT)
    assert info.value.state is state
    assert ledger.to_json() == before


# reconcile_request and apply_verified_reconciliation ------------------------


def test_reconcile_request_order() -> None:
    ledger = with_operation()
    assert ledger.reconcile_request(KEY, b"input", SESSION, "r-1") == OperationReconcileRequest(
        SESSION, "r-1", TOOL, KEY
    )
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC").reconcile_request("Bad", b"", SESSION, "r-1")
    with pytest.raises(InvalidOperationKey):
        ledger.reconcile_request("Bad", b"", SESSION, "r-1")
    with pytest.raises(UnknownOperation):
        ledger.reconcile_request("cmp-x", b"", SESSION, "r-1")
    with pytest.raises(InputTooLarge):
        ledger.reconcile_request(KEY, b"\0" * 262_145, "S", "r-1")
    with pytest.raises(InputFingerprintMismatch):
        ledger.reconcile_request(KEY, b"other", "S", "r-1")
    with pytest.raises(InvalidToken) as info:
        ledger.reconcile_request(KEY, b"input", SESSION, "R 1")
    assert info.value.field == "request id"


def test_terminal_operations_can_still_be_reconciled() -> None:
    for state in (StateKind.SUCCEEDED, StateKind.FAILED, StateKind.CANCELLED):
        ledger = with_operation(state)
        assert ledger.reconcile_request(KEY, b"input", SESSION, "r-9").operation_key == KEY


def test_reconciliation_transitions_and_revisions() -> None:
    ledger = with_operation()
    assert reconcile(ledger, Running()) == Running()
    assert ledger.revision == 2
    assert reconcile(ledger, Running()) == Running()
    assert ledger.revision == 2
    payload = ToolPayload.json({"output": "never stored"})
    assert reconcile(ledger, Succeeded(payload)) == Succeeded(payload)
    assert ledger.revision == 3
    assert reconcile(ledger, Succeeded(ToolPayload.text("other"))) == Succeeded(
        ToolPayload.text("other")
    )
    assert ledger.revision == 3
    before = ledger.to_json()
    for status in (Running(), Failed("boom"), Cancelled()):
        with pytest.raises(InvalidStateTransition) as info:
            reconcile(ledger, status)
        assert (info.value.current, info.value.observed) == (StateKind.SUCCEEDED, status.kind)
    assert ledger.to_json() == before
    assert "never stored" not in before


@pytest.mark.parametrize(
    ("terminal", "allowed"),
    [(Failed("x"), Failed("y")), (Cancelled(), Cancelled())],
)
def test_failed_and_cancelled_accept_only_themselves(
    terminal: OperationStatus, allowed: OperationStatus
) -> None:
    ledger = with_operation()
    reconcile(ledger, terminal)
    assert ledger.revision == 2
    reconcile(ledger, allowed)
    assert ledger.revision == 2
    for status in (Running(), Succeeded(ToolPayload.text("x")), Failed("z"), Cancelled()):
        if status.kind is terminal.kind:
            continue
        with pytest.raises(InvalidStateTransition):
            reconcile(ledger, status)


def test_reconciliation_check_order() -> None:
    ledger = with_operation()
    request = OperationReconcileRequest(SESSION, "r-1", TOOL, KEY)
    with pytest.raises(InvalidPlanFingerprint):
        WorkflowOperationLedger("ABC").apply_verified_reconciliation(
            request, OperationReconcileResult(SESSION, "r-2", TOOL, KEY, Running())
        )
    with pytest.raises(ReconciliationMismatch):
        ledger.apply_verified_reconciliation(
            request, OperationReconcileResult(SESSION, "r-2", TOOL, "nope", Running())
        )
    with pytest.raises(UnknownOperation):
        ledger.apply_verified_reconciliation(
            OperationReconcileRequest(SESSION, "r-1", TOOL, "nope"),
            OperationReconcileResult(SESSION, "r-1", TOOL, "nope", Running()),
        )
    with pytest.raises(ReconciliationMismatch):
        ledger.apply_verified_reconciliation(
            OperationReconcileRequest(SESSION, "r-1", "other.tool", KEY),
            OperationReconcileResult(SESSION, "r-1", "other.tool", KEY, Running()),
        )
    assert ledger.revision == 1


# apply_verified_compensation ----------------------------------------------------


def test_compensation_observations_change_only_the_compensation() -> None:
    ledger = with_compensation()
    original = ledger.operation(KEY)
    request = compensation_request()
    assert ledger.apply_verified_compensation(request, compensation_result(Running())) == Running()
    assert ledger.revision == 4
    assert ledger.apply_verified_compensation(request, compensation_result(Running())) == Running()
    assert ledger.revision == 4
    failed = Failed("notes already retracted")
    assert ledger.apply_verified_compensation(request, compensation_result(failed)) == failed
    assert ledger.revision == 5
    operation = ledger.operation(KEY)
    assert operation is not None and original is not None and original.compensation is not None
    assert operation == replace(
        original, compensation=replace(original.compensation, state=StateKind.FAILED)
    )
    assert "retracted" not in ledger.to_json()
    with pytest.raises(InvalidCompensationStateTransition) as info:
        ledger.apply_verified_compensation(request, compensation_result(Cancelled()))
    assert (info.value.compensation_key, info.value.current, info.value.observed) == (
        "cmp-undo",
        StateKind.FAILED,
        StateKind.CANCELLED,
    )
    assert ledger.revision == 5


def test_compensation_result_check_order() -> None:
    ledger = with_compensation()
    request = compensation_request()
    with pytest.raises(CompensationRequestMismatch):
        ledger.apply_verified_compensation(request, compensation_result(Running(), "c-2"))
    for field, value in (
        ("tool", "other.tool"),
        ("operation_key", "other-key"),
        ("compensation_key", "cmp-other"),
        ("tenant_scope", "tenant-other"),
        ("grant_fingerprint", FP),
    ):
        with pytest.raises(CompensationRequestMismatch):
            ledger.apply_verified_compensation(
                request, compensation_result(Running(), **{field: value})
            )
    # Request and result agree, the ledger does not.
    unknown = OperationCompensationRequest(SESSION, "c-1", binding(operation_key="nope"), UNDO)
    with pytest.raises(UnknownOperation):
        ledger.apply_verified_compensation(
            unknown, compensation_result(Running(), operation_key="nope")
        )
    other_tool = OperationCompensationRequest(SESSION, "c-1", binding(tool="other.tool"), UNDO)
    with pytest.raises(CompensationRequestMismatch):
        ledger.apply_verified_compensation(
            other_tool, compensation_result(Running(), tool="other.tool")
        )
    drifted = OperationCompensationRequest(
        SESSION, "c-1", binding(compensation_key="cmp-other"), ToolPayload.text("x")
    )
    with pytest.raises(CompensationInputFingerprintMismatch):
        ledger.apply_verified_compensation(
            drifted, compensation_result(Running(), compensation_key="cmp-other")
        )
    other_key = OperationCompensationRequest(
        SESSION, "c-1", binding(compensation_key="cmp-other"), UNDO
    )
    with pytest.raises(CompensationRequestMismatch):
        ledger.apply_verified_compensation(
            other_key, compensation_result(Running(), compensation_key="cmp-other")
        )
    other_tenant = OperationCompensationRequest(
        SESSION, "c-1", binding(tenant_scope="tenant-other"), UNDO
    )
    with pytest.raises(CompensationRequestMismatch):
        ledger.apply_verified_compensation(
            other_tenant, compensation_result(Running(), tenant_scope="tenant-other")
        )
    assert ledger.revision == 3
    no_compensation = with_operation(StateKind.SUCCEEDED)
    with pytest.raises(UnknownCompensation) as info:
        no_compensation.apply_verified_compensation(request, compensation_result(Running()))
    assert info.value.operation_key == KEY


# Properties ---------------------------------------------------------------------------

_tokens = st.from_regex(r"[a-z0-9._-]{1,24}", fullmatch=True)
_keys = _tokens.filter(lambda key: not key.startswith("cmp-"))
_statuses = st.sampled_from([Running(), Succeeded(ToolPayload.text("a")), Failed("f"), Cancelled()])


@settings(max_examples=60, deadline=None)
@given(
    operations=st.lists(
        st.tuples(_tokens, _tokens, _keys, st.binary(max_size=64)),
        max_size=8,
        unique_by=lambda item: item[2],
    ),
    compensate=st.booleans(),
    tenant=_tokens,
)
def test_json_round_trip(
    operations: list[tuple[str, str, str, bytes]], compensate: bool, tenant: str
) -> None:
    ledger = fresh()
    for step_id, tool, key, data in operations:
        ledger.record(step_id, tool, key, data)
    if operations and compensate:
        step_id, tool, key, data = operations[0]
        request = ledger.reconcile_request(key, data, SESSION, "r-1")
        ledger.apply_verified_reconciliation(
            request,
            OperationReconcileResult(SESSION, "r-1", tool, key, Succeeded(ToolPayload.text("x"))),
        )
        grant = CapabilityGrant.text(tool).with_compensation_limit(1)
        ledger.record_compensation(
            key, WorkflowCompensationPolicy(tenant, grant), "cmp-" + key, data
        )
    text = ledger.to_json()
    decoded = WorkflowOperationLedger.from_json(text)
    assert decoded == ledger
    assert decoded.to_json() == text


@settings(max_examples=60, deadline=None)
@given(observations=st.lists(_statuses, min_size=1, max_size=10))
def test_revision_moves_only_when_the_state_changes(observations: list[OperationStatus]) -> None:
    ledger = with_operation()
    for number, status in enumerate(observations):
        before_state = ledger.operations[0].state
        before_revision = ledger.revision
        try:
            reconcile(ledger, status, f"r-{number}")
        except InvalidStateTransition:
            assert ledger.revision == before_revision
            continue
        changed = status.kind is not before_state
        assert ledger.revision == before_revision + (1 if changed else 0)


@settings(max_examples=60, deadline=None)
@given(observations=st.lists(_statuses, min_size=1, max_size=10))
def test_compensation_revision_moves_only_when_its_state_changes(
    observations: list[OperationStatus],
) -> None:
    ledger = with_compensation()
    request = compensation_request()
    for status in observations:
        operation = ledger.operation(KEY)
        assert operation is not None and operation.compensation is not None
        before_state, before_revision = operation.compensation.state, ledger.revision
        try:
            ledger.apply_verified_compensation(request, compensation_result(status))
        except InvalidCompensationStateTransition:
            assert ledger.revision == before_revision
            continue
        changed = status.kind is not before_state
        assert ledger.revision == before_revision + (1 if changed else 0)
        after = ledger.operation(KEY)
        assert after is not None and after.state is StateKind.SUCCEEDED


# Operator resolution (`octo-host resolve`) -----------------------------


def _ledger_with_pending() -> tuple[WorkflowOperationLedger, str]:
    from octo_common.digest import plan_fingerprint as _plan_fp
    from octo_host.plan import WorkflowStep as _Step

    ledger = WorkflowOperationLedger(_plan_fp([_Step("publish", "x")]))
    ledger.record("publish", "release.publish", "release-2026-9", b"input")
    return ledger, "release-2026-9"


def test_operator_resolution_moves_a_pending_operation_to_a_terminal_state() -> None:
    ledger, key = _ledger_with_pending()
    before = ledger.revision
    assert ledger.resolve_by_operator(key, "failed") == StateKind.FAILED
    operation = ledger.operation(key)
    assert operation is not None and operation.state == StateKind.FAILED
    assert ledger.revision == before + 1


@pytest.mark.parametrize("target", ["pending", "running"])
def test_operator_resolution_only_to_terminal_states(target: str) -> None:
    ledger, key = _ledger_with_pending()
    before = ledger.copy()
    with pytest.raises(InvalidStateTransition):
        ledger.resolve_by_operator(key, target)
    assert ledger == before


def test_operator_resolution_refuses_terminal_operations_and_unknown_keys() -> None:
    ledger, key = _ledger_with_pending()
    ledger.resolve_by_operator(key, "succeeded")
    after = ledger.copy()
    with pytest.raises(InvalidStateTransition):
        ledger.resolve_by_operator(key, "failed")
    with pytest.raises(InvalidStateTransition):
        ledger.resolve_by_operator(key, "succeeded")
    with pytest.raises(UnknownOperation):
        ledger.resolve_by_operator("release-2026-10", "failed")
    assert ledger == after


# Operator resolution of a compensation (`octo-host resolve RUN cmp-...`) --------


@pytest.mark.parametrize("observed", [None, Running()])
@pytest.mark.parametrize("target", ["succeeded", "failed", "cancelled"])
def test_operator_resolution_decides_a_stuck_compensation_only(
    observed: OperationStatus | None, target: str
) -> None:
    ledger = with_compensation()
    if observed is not None:
        ledger.apply_verified_compensation(compensation_request(), compensation_result(observed))
    before = ledger.revision
    assert ledger.compensated_operation("cmp-undo") == ledger.operation(KEY)
    assert ledger.resolve_compensation_by_operator("cmp-undo", target) == StateKind(target)
    operation = ledger.operation(KEY)
    assert operation is not None and operation.compensation is not None
    assert operation.state is StateKind.SUCCEEDED  # the original is never touched
    assert operation.compensation.state is StateKind(target)
    assert ledger.revision == before + 1
    # Terminal now: a second decision is refused and changes nothing.
    after = ledger.copy()
    with pytest.raises(InvalidCompensationStateTransition):
        ledger.resolve_compensation_by_operator("cmp-undo", "failed")
    assert ledger == after


def test_operator_resolution_of_a_compensation_refuses_other_keys_and_targets() -> None:
    ledger = with_compensation()
    before = ledger.copy()
    for target in ("pending", "running"):
        with pytest.raises(InvalidCompensationStateTransition):
            ledger.resolve_compensation_by_operator("cmp-undo", target)
    with pytest.raises(UnknownCompensation):
        ledger.resolve_compensation_by_operator("cmp-other", "failed")
    with pytest.raises(UnknownCompensation):  # an operation key is not a compensation key
        ledger.resolve_compensation_by_operator(KEY, "failed")
    assert ledger.compensated_operation(KEY) is None
    assert ledger == before


@pytest.mark.parametrize("target", ["exploded", "Failed", "", None])
def test_operator_resolution_refuses_an_unknown_state_with_a_ledger_error(
    target: object,
) -> None:
    # Library callers get the ledger's own refusal (a stable code), not a raw ValueError.
    ledger, key = _ledger_with_pending()
    before = ledger.copy()
    with pytest.raises(InvalidStateTransition) as refused:
        ledger.resolve_by_operator(key, target)  # type: ignore[arg-type]
    assert refused.value.code == "invalid_state_transition"
    assert refused.value.current is StateKind.PENDING
    assert refused.value.observed == target
    assert ledger == before


@pytest.mark.parametrize("target", ["exploded", "Cancelled", "", None])
def test_operator_resolution_of_a_compensation_refuses_an_unknown_state(
    target: object,
) -> None:
    ledger = with_compensation()
    before = ledger.copy()
    with pytest.raises(InvalidCompensationStateTransition) as refused:
        ledger.resolve_compensation_by_operator("cmp-undo", target)  # type: ignore[arg-type]
    assert refused.value.code == "invalid_compensation_state_transition"
    assert refused.value.compensation_key == "cmp-undo"
    assert refused.value.current is StateKind.PENDING
    assert ledger == before


# A record's syntax is checked once --------------------------------------------


def test_a_record_that_passed_stays_valid_and_a_changed_one_is_checked_again() -> None:
    valid = WorkflowOperation("publish", TOOL, KEY, "0" * 64, StateKind.PENDING)
    valid.validate_syntax()
    valid.validate_syntax()
    assert valid == WorkflowOperation("publish", TOOL, KEY, "0" * 64, StateKind.PENDING)
    assert "_syntax_valid" not in repr(valid)
    compensation = WorkflowCompensation(
        "cmp-undo", "1" * 64, "tenant-a", "2" * 64, StateKind.PENDING
    )
    # A compensation on an operation that did not succeed: the changed record is refused.
    changed = replace(valid, compensation=compensation)
    with pytest.raises(CompensationRequiresSucceededOperation):
        changed.validate_syntax()
    replace(changed, state=StateKind.SUCCEEDED).validate_syntax()


def test_a_refused_record_is_refused_every_time() -> None:
    bad = WorkflowOperation("publish", TOOL, KEY, "not-a-fingerprint", StateKind.PENDING)
    for _ in range(2):
        with pytest.raises(InvalidInputFingerprint):
            bad.validate_syntax()
    ledger = WorkflowOperationLedger(PLAN_FP, operations=[bad])
    with pytest.raises(InvalidInputFingerprint):
        ledger.to_json()
