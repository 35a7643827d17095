"""Proven-not-happened outcomes and step retry policies, pure parts: the failure code
on the wire and in the ledger, the retry chain's rules, the plan fingerprint with
and without a policy, the one retry decision and the derived retry key."""

from __future__ import annotations

import json

import blake3
import msgspec
import pytest

from octo_common.digest import be64, lp, plan_fingerprint
from octo_common.errors import (
    InvalidLedgerEncoding,
    InvalidRetryChain,
    InvalidRetryPolicy,
    RetryNotAllowed,
    TooManyOperations,
    UnknownOperation,
)
from octo_common.messages import OperationReconcileRequest, OperationReconcileResult
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import (
    Failed,
    FailureCode,
    Running,
    StateKind,
    Succeeded,
    WorkerOperationState,
    is_proven_not_happened,
)
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import RetryOutcome, RetryPolicy, WorkflowPlan, WorkflowStep
from octo_host.retries import record_retry, retry_key, retry_refusal

TOOL = "files.publish"
INPUT = canonical_operation_input_bytes(ToolPayload.json({"name": "a.txt", "content": "x"}))
NOT_HAPPENED = Failed("not published", FailureCode.NOT_HAPPENED)
POLICY = RetryPolicy(attempts=3, backoff_seconds=0.0)


# The failure code on the wire ----------------------------------------------------------


def test_a_failure_without_a_code_encodes_as_before_and_one_with_a_code_names_it() -> None:
    assert msgspec.json.encode(Failed("boom")) == b'{"state":"failed","message":"boom"}'
    assert msgspec.json.encode(NOT_HAPPENED) == (
        b'{"state":"failed","message":"not published","code":"not_happened"}'
    )
    decoded = msgspec.json.decode(msgspec.json.encode(NOT_HAPPENED), type=WorkerOperationState)
    assert decoded == NOT_HAPPENED and is_proven_not_happened(decoded)
    assert not is_proven_not_happened(Failed("not published"))
    assert not is_proven_not_happened(Running())
    assert "not published" not in repr(NOT_HAPPENED) and "NOT_HAPPENED" in repr(NOT_HAPPENED)


def test_only_the_not_happened_code_is_proof_that_nothing_happened() -> None:
    other = msgspec.json.decode(
        b'{"state":"failed","message":"x","code":"maybe"}', type=WorkerOperationState
    )
    assert isinstance(other, Failed) and not is_proven_not_happened(other)
    for code in ("input_refused", "options_refused", "resolved_by_operator"):
        assert not is_proven_not_happened(Failed("x", code))


# The ledger ----------------------------------------------------------------------------


def plan_and_ledger(
    policy: RetryPolicy | None = POLICY,
) -> tuple[WorkflowEngine, WorkflowPlan, WorkflowOperationLedger, str]:
    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "publish a file", policy)])
    ledger = engine.operation_ledger(plan)
    key = engine.record_derived_operation(plan, ledger, "publish", TOOL, INPUT, b"n-1")
    return engine, plan, ledger, key


def observe(ledger: WorkflowOperationLedger, key: str, status: object) -> None:
    request = OperationReconcileRequest("s-1", "r-1", TOOL, key)
    result = OperationReconcileResult("s-1", "r-1", TOOL, key, status)
    ledger.apply_verified_reconciliation(request, result)


def test_the_ledger_keeps_the_failure_code_and_encodes_it_only_when_set() -> None:
    _, _, ledger, key = plan_and_ledger()
    before = json.loads(ledger.to_json())["operations"][0]
    assert "failure" not in before and "attempt" not in before and "retry_of" not in before
    observe(ledger, key, NOT_HAPPENED)
    operation = ledger.operation(key)
    assert operation is not None and operation.failure == FailureCode.NOT_HAPPENED
    text = ledger.to_json()
    assert json.loads(text)["operations"][0]["failure"] == "not_happened"
    assert WorkflowOperationLedger.from_json(text) == ledger


def test_a_plain_failure_keeps_no_code() -> None:
    _, _, ledger, key = plan_and_ledger()
    observe(ledger, key, Failed("target exists"))
    operation = ledger.operation(key)
    assert operation is not None and operation.failure is None


def test_a_failure_code_on_an_operation_that_is_not_failed_is_refused() -> None:
    _, _, ledger, _ = plan_and_ledger()
    document = json.loads(ledger.to_json())
    document["operations"][0]["failure"] = "not_happened"
    with pytest.raises(InvalidLedgerEncoding):
        WorkflowOperationLedger.from_json(json.dumps(document))


def test_a_retry_is_recorded_pending_chained_to_the_failed_attempt() -> None:
    _, plan, ledger, key = plan_and_ledger()
    observe(ledger, key, NOT_HAPPENED)
    revision = ledger.revision
    second = record_retry(plan, ledger, key)
    assert second != key and second.startswith("op-") and len(second) == 67
    assert ledger.revision == revision + 1
    retry = ledger.operation(second)
    first = ledger.operation(key)
    assert retry is not None and first is not None
    assert (retry.state, retry.retry_of, retry.attempt) == (StateKind.PENDING, key, 2)
    assert (retry.step_id, retry.tool, retry.input_fingerprint) == (
        first.step_id,
        first.tool,
        first.input_fingerprint,
    )
    assert ledger.replacement(key) == retry
    assert [op.operation_key for op in ledger.attempts(second)] == [key, second]
    assert ledger.attempts(key) == ledger.attempts(second)
    document = json.loads(ledger.to_json())["operations"][1]
    assert (document["retry_of"], document["attempt"]) == (key, 2)
    assert WorkflowOperationLedger.from_json(ledger.to_json()) == ledger


def test_the_retry_key_is_derived_from_the_first_key_and_the_attempt_in_its_own_domain() -> None:
    _, plan, ledger, key = plan_and_ledger()
    observe(ledger, key, NOT_HAPPENED)
    second = record_retry(plan, ledger, key)
    observe(ledger, second, NOT_HAPPENED)
    third = record_retry(plan, ledger, second)
    fingerprint = plan.fingerprint
    for attempt, found in ((2, second), (3, third)):
        expected = blake3.blake3(
            b"octo-workflow-retry-key-v1"
            + lp(fingerprint.encode("ascii"))
            + lp(key.encode("ascii"))
            + be64(attempt)
        ).hexdigest()
        assert found == "op-" + expected
        assert retry_key(plan, key, attempt) == found
    # Every host that retries the same attempt records the same key.
    again = WorkflowOperationLedger.from_json(ledger.to_json())
    assert [op.operation_key for op in again.attempts(key)] == [key, second, third]


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (None, "the attempt is pending"),
        (Running(), "the attempt is running"),
        (Succeeded(ToolPayload.json({})), "the attempt is succeeded"),
        (Failed("target exists"), "the step does not retry failed"),
    ],
)
def test_only_a_proven_not_happened_attempt_is_retried_by_default(
    status: object, reason: str
) -> None:
    _, plan, ledger, key = plan_and_ledger()
    if status is not None:
        observe(ledger, key, status)
    assert retry_refusal(plan, ledger, key) == reason
    operations = ledger.operations
    with pytest.raises(RetryNotAllowed):
        record_retry(plan, ledger, key)
    assert ledger.operations == operations


def test_an_indeterminate_attempt_is_never_retried_whatever_the_policy_names() -> None:
    # Indeterminate: the worker's row stays running (or pending); the ledger says so.
    everything = RetryPolicy(attempts=16, retry_on=frozenset(RetryOutcome))
    _, plan, ledger, key = plan_and_ledger(everything)
    observe(ledger, key, Running())
    assert retry_refusal(plan, ledger, key) == "the attempt is running"
    with pytest.raises(RetryNotAllowed):
        record_retry(plan, ledger, key)


@pytest.mark.parametrize("code", ["input_refused", "options_refused"])
def test_a_refused_input_is_never_retried_whatever_the_policy_names(code: str) -> None:
    everything = RetryPolicy(attempts=16, retry_on=frozenset(RetryOutcome))
    _, plan, ledger, key = plan_and_ledger(everything)
    observe(ledger, key, Failed("refused", code))
    assert retry_refusal(plan, ledger, key) == f"the outcome {code} is never retried"


def test_an_operator_decision_is_never_retried_whatever_the_policy_names() -> None:
    everything = RetryPolicy(attempts=16, retry_on=frozenset(RetryOutcome))
    _, plan, ledger, key = plan_and_ledger(everything)
    ledger.resolve_by_operator(key, StateKind.FAILED)
    refusal = retry_refusal(plan, ledger, key)
    assert refusal == "the outcome resolved_by_operator is never retried"


def test_a_step_that_names_failed_retries_the_effects_own_failure() -> None:
    policy = RetryPolicy(attempts=2, retry_on={"failed"})
    assert policy.retry_on == frozenset({RetryOutcome.FAILED})
    _, plan, ledger, key = plan_and_ledger(policy)
    observe(ledger, key, Failed("target exists"))
    assert retry_refusal(plan, ledger, key) is None
    # ... and only that: not_happened is not named.
    _, plan, ledger, key = plan_and_ledger(policy)
    observe(ledger, key, NOT_HAPPENED)
    assert retry_refusal(plan, ledger, key) == "the step does not retry not_happened"


def test_no_policy_no_retry_and_attempts_run_out() -> None:
    _, plan, ledger, key = plan_and_ledger(None)
    observe(ledger, key, NOT_HAPPENED)
    assert retry_refusal(plan, ledger, key) == "the step has no retry policy"
    _, plan, ledger, key = plan_and_ledger(RetryPolicy(attempts=2))
    observe(ledger, key, NOT_HAPPENED)
    second = record_retry(plan, ledger, key)
    assert retry_refusal(plan, ledger, key) == "the attempt is already replaced"
    observe(ledger, second, NOT_HAPPENED)
    assert retry_refusal(plan, ledger, second) == "all 2 attempts are used"
    with pytest.raises(UnknownOperation):
        retry_refusal(plan, ledger, "op-unknown")


def test_a_full_ledger_records_no_retry() -> None:
    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "publish", POLICY)])
    ledger = engine.operation_ledger(plan)
    keys = [
        engine.record_derived_operation(plan, ledger, "publish", TOOL, INPUT, f"n-{i}".encode())
        for i in range(64)
    ]
    observe(ledger, keys[0], NOT_HAPPENED)
    assert retry_refusal(plan, ledger, keys[0]) == "the run's ledger holds 64 operations"
    with pytest.raises(RetryNotAllowed):
        record_retry(plan, ledger, keys[0])
    with pytest.raises(TooManyOperations):
        ledger.record_retry(keys[0], "op-" + "ab" * 32)
    assert len(ledger.operations) == 64


def _chain_document() -> dict[str, object]:
    _, plan, ledger, key = plan_and_ledger()
    observe(ledger, key, NOT_HAPPENED)
    record_retry(plan, ledger, key)
    document: dict[str, object] = json.loads(ledger.to_json())
    return document


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda ops: ops[1].update(attempt=3), InvalidRetryChain),
        (lambda ops: ops[1].update(step_id="other"), InvalidRetryChain),
        (lambda ops: ops[1].update(input_fingerprint="cd" * 32), InvalidRetryChain),
        (lambda ops: ops[0].update(state="succeeded", failure=None), InvalidRetryChain),
        (lambda ops: ops[1].update(retry_of="op-" + "ef" * 32), InvalidRetryChain),
        (lambda ops: ops.reverse(), InvalidRetryChain),
        (lambda ops: ops[1].pop("retry_of"), InvalidRetryChain),
        (lambda ops: ops[1].update(attempt=1), InvalidLedgerEncoding),
    ],
)
def test_a_stored_chain_that_does_not_hold_is_refused(change: object, error: type) -> None:
    document = _chain_document()
    operations = document["operations"]
    assert isinstance(operations, list)
    for operation in operations:
        if operation.get("failure", "") is None:
            operation.pop("failure")
    change(operations)  # type: ignore[operator]
    for operation in operations:
        if operation.get("failure", "") is None:
            operation.pop("failure")
    with pytest.raises(error):
        WorkflowOperationLedger.from_json(json.dumps(document))


def test_an_attempt_is_replaced_once() -> None:
    _, plan, ledger, key = plan_and_ledger()
    observe(ledger, key, NOT_HAPPENED)
    record_retry(plan, ledger, key)
    document = json.loads(ledger.to_json())
    twin = dict(document["operations"][1], operation_key="op-" + "12" * 32)
    document["operations"].append(twin)
    with pytest.raises(InvalidRetryChain):
        WorkflowOperationLedger.from_json(json.dumps(document))


# Plans ------------------------------------------------------------------------------------


def test_a_plan_without_a_policy_keeps_its_fingerprint_and_a_policy_changes_it() -> None:
    engine = WorkflowEngine()
    steps = [WorkflowStep("publish", "let release = true")]
    plain = engine.plan(steps)
    assert plain.fingerprint == plan_fingerprint(steps)
    assert plain.fingerprint == "1a5593c4cb0b60c18fdd0c42b3b49abe7159867869d57069f5e2cfbfdd10d807"
    with_policy = engine.plan([WorkflowStep("publish", "let release = true", POLICY)])
    other_policy = engine.plan(
        [WorkflowStep("publish", "let release = true", RetryPolicy(attempts=4))]
    )
    fingerprints = {plain.fingerprint, with_policy.fingerprint, other_policy.fingerprint}
    assert len(fingerprints) == 3
    again = engine.plan([WorkflowStep("publish", "let release = true", POLICY)])
    assert again.fingerprint == with_policy.fingerprint
    assert with_policy.retry_policy("publish") == POLICY
    assert plain.retry_policy("publish") is None


@pytest.mark.parametrize(
    "policy",
    [
        RetryPolicy(attempts=1),
        RetryPolicy(attempts=17),
        RetryPolicy(attempts=True),
        RetryPolicy(attempts=3, backoff_seconds=-1.0),
        RetryPolicy(attempts=3, backoff_max_seconds=float("inf")),
        RetryPolicy(attempts=3, retry_on=frozenset()),
        RetryPolicy(attempts=3, retry_on={"running"}),
        RetryPolicy(attempts=3, retry_on={"input_refused"}),
    ],
)
def test_a_policy_out_of_bounds_is_refused_when_the_plan_is_built(policy: RetryPolicy) -> None:
    with pytest.raises(InvalidRetryPolicy) as raised:
        WorkflowEngine().plan([WorkflowStep("publish", "x", policy)])
    assert raised.value.step_id == "publish"


def test_backoff_doubles_up_to_its_bound() -> None:
    policy = RetryPolicy(attempts=8, backoff_seconds=0.5, backoff_max_seconds=3.0)
    assert [policy.backoff_before(n) for n in range(2, 7)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_first_attempt_counts_one_and_names_nothing() -> None:
    operation = WorkflowOperation("publish", TOOL, "op-" + "ab" * 32, "cd" * 32, StateKind.PENDING)
    assert (operation.attempt, operation.retry_of) == (1, None)
