"""States, the one transition table and status validation.

The transition table is written out cell by cell below and checked for state
objects (payloads and messages compared exactly) and for bare kinds.
"""

from __future__ import annotations

import pickle

import pytest

from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    InvalidJsonEnvelope,
    InvalidOperationFailure,
    JsonPayloadTooDeep,
    OperationFailureTooLarge,
    OutputTooLarge,
    PayloadFormatMismatch,
    SerializationError,
)
from octo_common.grants import CapabilityGrant
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
    accepts,
    state_for_kind,
    validate_operation_status_for_grant,
    validate_state_for_grant,
)

P = ToolPayload.json({"total": 42})
P_SAME = ToolPayload.json({"total": 42})
P_OTHER = ToolPayload.json({"total": 42.0})  # 42 and 42.0 differ

# (name, state) for every current state and every observation.
CURRENT = {
    "pending": Pending(),
    "running": Running(),
    "succeeded(p)": Succeeded(P),
    "failed(n)": Failed("boom"),
    "cancelled": Cancelled(),
}
OBSERVED = {
    "pending": Pending(),
    "running": Running(),
    "succeeded(p)": Succeeded(P_SAME),
    "succeeded(x)": Succeeded(P_OTHER),
    "failed(n)": Failed("boom"),
    "failed(m)": Failed("boom!"),
    "cancelled": Cancelled(),
}

# The table written out: the set of observations each current state accepts.
ACCEPTED = {
    "pending": {"running", "succeeded(p)", "succeeded(x)", "failed(n)", "failed(m)", "cancelled"},
    "running": {"running", "succeeded(p)", "succeeded(x)", "failed(n)", "failed(m)", "cancelled"},
    "succeeded(p)": {"succeeded(p)"},
    "failed(n)": {"failed(n)"},
    "cancelled": {"cancelled"},
}


@pytest.mark.parametrize("current", list(CURRENT))
@pytest.mark.parametrize("observed", list(OBSERVED))
def test_transition_table_for_state_objects(current: str, observed: str) -> None:
    expected = observed in ACCEPTED[current]
    assert accepts(CURRENT[current], OBSERVED[observed]) is expected


KIND_ACCEPTED = {
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
    StateKind.SUCCEEDED: {StateKind.SUCCEEDED},
    StateKind.FAILED: {StateKind.FAILED},
    StateKind.CANCELLED: {StateKind.CANCELLED},
}


@pytest.mark.parametrize("current", list(StateKind))
@pytest.mark.parametrize("observed", list(StateKind))
def test_transition_table_for_bare_kinds(current: StateKind, observed: StateKind) -> None:
    assert accepts(current, observed) is (observed in KIND_ACCEPTED[current])


def test_pending_can_never_be_observed() -> None:
    for current in [*CURRENT.values(), *StateKind]:
        assert accepts(current, Pending()) is False
        assert accepts(current, StateKind.PENDING) is False


def test_mixed_object_and_kind_compare_by_kind() -> None:
    assert accepts(Succeeded(P), StateKind.SUCCEEDED) is True
    assert accepts(StateKind.FAILED, Failed("anything")) is True
    assert accepts(StateKind.SUCCEEDED, Failed("x")) is False


def test_state_kinds_are_a_str_enum_with_wire_spellings() -> None:
    assert [kind.value for kind in StateKind] == [
        "pending",
        "running",
        "succeeded",
        "failed",
        "cancelled",
    ]
    assert StateKind("succeeded") is StateKind.SUCCEEDED
    assert str(StateKind.FAILED) == "failed"
    assert isinstance(StateKind.FAILED, str)
    assert Pending().kind is StateKind.PENDING
    assert Running().kind is StateKind.RUNNING
    assert Succeeded(P).kind is StateKind.SUCCEEDED
    assert Failed("x").kind is StateKind.FAILED
    assert Cancelled().kind is StateKind.CANCELLED


def test_state_for_kind_gives_payload_less_states() -> None:
    assert state_for_kind(StateKind.PENDING) == Pending()
    assert state_for_kind("running") == Running()
    assert state_for_kind(StateKind.CANCELLED) == Cancelled()


def test_states_compare_by_value_and_are_frozen() -> None:
    assert Succeeded(P) == Succeeded(P_SAME)
    assert Succeeded(P) != Succeeded(P_OTHER)
    assert Failed("a") == Failed("a")
    assert Failed("a") != Failed("b")
    with pytest.raises(AttributeError):
        Failed("a").message = "b"  # type: ignore[misc]


# Wire form ---------------------------------------------------------------


def test_states_encode_tagged_by_state() -> None:
    assert encode_struct(Running()) == b'{"state":"running"}'
    assert encode_struct(Cancelled()) == b'{"state":"cancelled"}'
    assert encode_struct(Pending()) == b'{"state":"pending"}'
    assert encode_struct(Failed("boom")) == b'{"state":"failed","message":"boom"}'
    assert encode_struct(Succeeded(ToolPayload.json({"b": 1, "a": 2}))) == (
        b'{"state":"succeeded","payload":{"format":"json","value":{"a":2,"b":1}}}'
    )


def test_pending_is_not_a_status_but_is_a_journal_state() -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"state":"pending"}', OperationStatus)  # type: ignore[arg-type]
    assert decode_struct('{"state":"pending"}', WorkerOperationState) == Pending()  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ['{"state":"Succeeded"}', '{"state":"done"}', "{}", '{"state":1}'])
def test_unknown_state_spellings_are_rejected(text: str) -> None:
    with pytest.raises(SerializationError):
        decode_struct(text, OperationStatus)  # type: ignore[arg-type]


def test_unknown_keys_in_a_status_are_ignored() -> None:
    text = '{"state":"failed","message":"m","extra":1}'
    status: object = decode_struct(text, OperationStatus)  # type: ignore[arg-type]
    assert status == Failed("m")


def test_status_fields_are_type_checked() -> None:
    for text in ('{"state":"failed","message":1}', '{"state":"succeeded"}', '{"state":"failed"}'):
        with pytest.raises(SerializationError):
            decode_struct(text, OperationStatus)  # type: ignore[arg-type]


# Status validation ---------------------------------------------------------


def test_running_and_cancelled_are_always_valid() -> None:
    Running().validate()
    Cancelled().validate()
    Pending().validate()


def test_failed_message_bounds() -> None:
    with pytest.raises(InvalidOperationFailure):
        Failed("").validate()
    Failed("x").validate()
    Failed("x" * 4096).validate()
    with pytest.raises(OperationFailureTooLarge) as raised:
        Failed("x" * 4097).validate()
    assert (raised.value.actual, raised.value.maximum) == (4097, 4096)


def test_failed_message_size_counts_utf8_bytes() -> None:
    Failed("é" * 2048).validate()  # 4096 bytes
    with pytest.raises(OperationFailureTooLarge) as raised:
        Failed("é" * 2048 + "x").validate()
    assert raised.value.actual == 4097


def test_succeeded_validates_envelope_and_depth() -> None:
    Succeeded(ToolPayload.text("")).validate()
    with pytest.raises(InvalidJsonEnvelope):
        Succeeded(ToolPayload.json(7)).validate()
    deep: object = {}
    for _ in range(32):
        deep = [deep]
    with pytest.raises(JsonPayloadTooDeep):
        Succeeded(ToolPayload.json(deep)).validate()


def test_status_for_grant_format_mismatch() -> None:
    grant = CapabilityGrant.json("math.add")
    with pytest.raises(PayloadFormatMismatch) as raised:
        validate_operation_status_for_grant(Succeeded(ToolPayload.text("x")), grant)
    assert (raised.value.expected, raised.value.actual) == ("json", "text")


def test_status_for_grant_output_size() -> None:
    # A 75-byte success under max_output_bytes=16.
    value = {"total": "x" * 63}
    payload = ToolPayload.json(value)
    assert payload.validate_for("json") == 75
    small = CapabilityGrant("math.add", "json", max_output_bytes=16)
    with pytest.raises(OutputTooLarge) as raised:
        validate_operation_status_for_grant(Succeeded(payload), small)
    assert (raised.value.actual, raised.value.maximum) == (75, 16)
    exact = CapabilityGrant("math.add", "json", max_output_bytes=75)
    validate_operation_status_for_grant(Succeeded(payload), exact)


def test_status_for_grant_validates_the_status_first() -> None:
    grant = CapabilityGrant.json("math.add")
    with pytest.raises(InvalidOperationFailure):
        validate_operation_status_for_grant(Failed(""), grant)
    with pytest.raises(InvalidJsonEnvelope):
        validate_operation_status_for_grant(Succeeded(ToolPayload.json(None)), grant)
    validate_operation_status_for_grant(Failed("x" * 4096), grant)
    validate_operation_status_for_grant(Running(), grant)
    validate_operation_status_for_grant(Cancelled(), grant)


def test_state_for_grant_lets_pending_pass() -> None:
    grant = CapabilityGrant("math.add", "json", max_output_bytes=1)
    validate_state_for_grant(Pending(), grant)
    with pytest.raises(OutputTooLarge):
        validate_state_for_grant(Succeeded(ToolPayload.json({})), grant)
    with pytest.raises(OperationFailureTooLarge):
        validate_state_for_grant(Failed("y" * 5000), grant)


# Reprs ----------------------------------------------------------------------------


def test_reprs_never_show_payloads_or_messages() -> None:
    secret = "hunter2-secret"
    for state in (
        Succeeded(ToolPayload.text(secret)),
        Succeeded(ToolPayload.json([secret])),
        Failed(secret),
    ):
        assert secret not in repr(state)
        assert secret not in str(state)
    assert repr(Running()) == "Running()"


def test_states_pickle_by_value() -> None:
    for state in (*CURRENT.values(), Failed("m")):
        assert pickle.loads(pickle.dumps(state)) == state
