"""The outcome of a key: "did not act" told from "may have acted", on both sides.

A ``failed`` state may carry a failure code (``Failed.code``); the adapter
contract maps an input or options refusal raised before any effect to one
(``refusal_status``); the host ledger keeps the code beside the state kind.
Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Literal

import msgspec
import pytest

from octo_common.codec import decode_struct
from octo_common.errors import (
    AdapterFailed,
    AdapterIndeterminate,
    AdapterInvalidJsonInput,
    AdapterInvalidOptions,
    InvalidLedgerEncoding,
    InvalidOperationFailure,
    OctoError,
)
from octo_common.messages import (
    OperationReconcileResult,
    ReconcileOperation,
    Resolution,
    decode_message,
    encode_message,
)
from octo_common.runtime.output import state_detail, state_line
from octo_common.states import (
    DID_NOT_ACT_CODES,
    Cancelled,
    Failed,
    FailureCode,
    OperationStatus,
    Running,
    StateKind,
    Succeeded,
    did_not_act,
)
from octo_host.ledger import WorkflowOperationLedger
from octo_worker.adapters import refusal_status, validation_text

PLAN_FP = "1a5593c4cb0b60c18fdd0c42b3b49abe7159867869d57069f5e2cfbfdd10d807"
TOOL = "release.publish"
KEY = "release-2026-1"
SESSION = "worker-1"


def test_a_failure_without_a_code_encodes_exactly_as_before() -> None:
    assert msgspec.json.encode(Failed("boom")) == b'{"state":"failed","message":"boom"}'
    coded = Failed("Expected `str`, got `int` - at `$.name`", FailureCode.INPUT_REFUSED)
    assert msgspec.json.encode(coded) == (
        b'{"state":"failed","message":"Expected `str`, got `int` - at `$.name`",'
        b'"code":"input_refused"}'
    )
    decoded = decode_struct(msgspec.json.encode(coded), Failed)  # type: ignore[arg-type]
    assert decoded == coded and decoded.code == "input_refused"
    assert Failed("x") != Failed("x", "input_refused")  # the code is part of the state
    assert "redacted" in repr(coded) and "`str`" not in repr(coded)


@pytest.mark.parametrize("code", ["", "Input", "input-refused", "x" * 65, "1code"])
def test_a_failure_code_has_the_syntax_of_an_error_code(code: str) -> None:
    with pytest.raises(InvalidOperationFailure):
        Failed("boom", code).validate()
    Failed("boom", "some_future_code").validate()  # unknown codes decode


def test_the_did_not_act_codes() -> None:
    assert {code.value for code in DID_NOT_ACT_CODES} == {
        "input_refused",
        "options_refused",
        "not_happened",
    }
    assert did_not_act(Failed("m", "input_refused"))
    assert did_not_act(Failed("m", "not_happened"))
    assert not did_not_act(Failed("m"))  # the adapter's own failure: it may have acted
    assert not did_not_act(Failed("m", "resolved_by_operator"))
    assert not did_not_act(Running())


def test_refusals_before_any_effect_end_the_key_failed_with_their_code() -> None:
    refused = refusal_status(AdapterInvalidJsonInput("Expected `str`, got `int` - at `$.name`"))
    assert refused == Failed("Expected `str`, got `int` - at `$.name`", "input_refused")
    options = refusal_status(AdapterInvalidOptions("Object missing required field `bucket`"))
    assert options == Failed("Object missing required field `bucket`", "options_refused")
    bare = refusal_status(AdapterInvalidJsonInput())
    assert bare is not None and bare.message == "adapter refused its JSON input"
    long = refusal_status(AdapterInvalidJsonInput("é" * 3000))
    assert long is not None and len(long.message.encode()) <= 4096
    long.validate()
    # Anything else may have acted: no definite status.
    for error in (AdapterIndeterminate("x"), AdapterFailed("x"), ValueError("x"), TimeoutError()):
        assert refusal_status(error) is None


def test_validation_text_names_the_field_and_never_a_value() -> None:
    class Input(msgspec.Struct):
        name: str
        mode: int = 0

    def message(value: object, kind: type) -> str:
        with pytest.raises(msgspec.ValidationError) as info:
            msgspec.convert(value, kind, strict=True)
        return validation_text(info.value)

    assert message({"name": 42}, Input) == "Expected `str`, got `int` - at `$.name`"
    assert message({}, Input) == "Object missing required field `name`"

    class Undo(msgspec.Struct):
        undo: Literal["transfer"]

    text = message({"undo": "secret-value-xyz"}, Undo)
    assert text == "Invalid enum value - at `$.undo`"
    assert "secret" not in text


def _reconciled(ledger: WorkflowOperationLedger, status: OperationStatus) -> None:
    request = ledger.reconcile_request(KEY, b"input", SESSION, "r-1")
    result = OperationReconcileResult(SESSION, "r-1", TOOL, KEY, status)
    ledger.apply_verified_reconciliation(request, result)


def test_the_ledger_keeps_the_failure_code_and_encodes_it_only_when_set() -> None:
    ledger = WorkflowOperationLedger(PLAN_FP)
    ledger.record("publish", TOOL, KEY, b"input")
    plain = ledger.copy()
    _reconciled(plain, Failed("boom"))
    assert plain.operation(KEY).failure is None  # type: ignore[union-attr]
    assert "failure" not in plain.to_json()  # as before the field existed

    _reconciled(ledger, Failed("Expected `str`, got `int` - at `$.name`", "input_refused"))
    operation = ledger.operation(KEY)
    assert operation is not None
    assert operation.state == StateKind.FAILED and operation.failure == "input_refused"
    text = ledger.to_json()
    assert json.loads(text)["operations"][0]["failure"] == "input_refused"
    assert "Expected" not in text  # the failure text never reaches the ledger
    again = WorkflowOperationLedger.from_json(text)
    assert again == ledger and again.operation(KEY).failure == "input_refused"  # type: ignore[union-attr]


def test_an_operator_decision_of_failed_is_coded_as_such() -> None:
    ledger = WorkflowOperationLedger(PLAN_FP)
    ledger.record("publish", TOOL, KEY, b"input")
    ledger.resolve_by_operator(KEY, StateKind.FAILED)
    assert ledger.operation(KEY).failure == "resolved_by_operator"  # type: ignore[union-attr]


def test_a_failure_code_on_a_state_other_than_failed_is_refused_at_decode() -> None:
    ledger = WorkflowOperationLedger(PLAN_FP)
    ledger.record("publish", TOOL, KEY, b"input")
    document = json.loads(ledger.to_json())
    document["operations"][0]["failure"] = "input_refused"  # on a pending operation
    with pytest.raises(InvalidLedgerEncoding):
        WorkflowOperationLedger.from_json(json.dumps(document, separators=(",", ":")))
    document["operations"][0]["state"] = "failed"
    document["operations"][0]["failure"] = "Not A Code"
    with pytest.raises(InvalidLedgerEncoding):
        WorkflowOperationLedger.from_json(json.dumps(document, separators=(",", ":")))


def test_a_failures_code_is_shown_and_its_text_only_when_revealed() -> None:
    refused = Failed("Expected `str`, got `int` - at `$.name`", "input_refused")
    hidden = state_detail(refused)
    assert hidden == {"state": "failed", "failure_code": "input_refused", "message_bytes": 39}
    assert state_line(hidden) == "failed [input_refused] (failure message: 39 bytes)"
    shown = state_detail(refused, reveal=True)
    assert shown["failure_text"] == refused.message
    assert state_detail(Failed("boom")) == {"state": "failed", "message_bytes": 4}


def test_a_resolution_is_a_terminal_decision_with_its_audit() -> None:
    decision = Resolution("failed", "alice", "checked the provider", "release-7")
    status = decision.status("json")
    assert status == Failed(
        "resolved by operator alice (run release-7): checked the provider", "resolved_by_operator"
    )
    succeeded = Resolution("succeeded", "bob", "confirmed", "release-7").status("json")
    assert isinstance(succeeded, Succeeded)
    assert succeeded.payload.value == {"resolved_by_operator": "bob", "run": "release-7"}
    text = Resolution("succeeded", "bob", "confirmed", "release-7").status("text")
    assert isinstance(text, Succeeded) and text.payload.format == "text"
    assert Resolution("cancelled", "bob", "gone", "r").status("json") == Cancelled()
    for bad in (
        {"state": "running"},
        {"operator": ""},
        {"operator": "a\nb"},
        {"reason": " "},
        {"reason": "x" * 1025},
        {"run": "not a token!"},
    ):
        fields = {"state": "failed", "operator": "alice", "reason": "why", "run": "r"} | bad
        with pytest.raises(OctoError):
            Resolution(**fields)  # type: ignore[arg-type]


def test_a_lookup_carries_a_resolution_only_when_given() -> None:
    ledger = WorkflowOperationLedger(PLAN_FP)
    ledger.record("publish", TOOL, KEY, b"input")
    plain = ledger.reconcile_request(KEY, None, SESSION, "r-1")  # no input needed
    assert encode_message(ReconcileOperation(plain)) == (
        b'{"type":"reconcile_operation","request":{"protocol_version":5,'
        b'"session_id":"worker-1","request_id":"r-1","tool":"release.publish",'
        b'"operation_key":"release-2026-1"}}'
    )
    with pytest.raises(OctoError):
        ledger.reconcile_request(KEY, b"other input", SESSION, "r-1")  # checked when given
    decision = Resolution("failed", "alice", "why", "run-1")
    carried = ledger.reconcile_request(KEY, None, SESSION, "r-2", resolution=decision)
    frame = encode_message(ReconcileOperation(carried))
    assert frame.endswith(
        b'"resolution":{"state":"failed","operator":"alice","reason":"why","run":"run-1"}}}'
    )
    assert decode_message(frame) == ReconcileOperation(carried)
