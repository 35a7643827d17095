"""The independent conformance vectors for the protocol core (tests/vectors/public.json).

Every expected value comes from the vector file, computed by a reference
implementation Octo did not write; these tests compute each field with
Octo's code and compare byte for byte. Vector error names are mapped to our
classes one-to-one in ``ERRORS``. The file is found by ``tests.vectors``
(``OCTO_VECTORS`` when it is set, else tests/vectors/public.json);
the tests skip, saying so, only when it is absent.
"""

from __future__ import annotations

import json
import re
from typing import Any

import blake3
import pytest

from octo_common import errors
from octo_common.codec import compact_json, decode_struct, encode_struct, parse_json
from octo_common.digest import (
    compensation_key_for,
    ledger_input_fingerprint,
    operation_key_for,
    plan_fingerprint,
    worker_input_fingerprint,
)
from octo_common.errors import DuplicateFrame, OctoError, SerializationError
from octo_common.frames import (
    AuthenticatorState,
    SessionAuthenticator,
    SessionKey,
    SessionRole,
    decode_frame,
)
from octo_common.grants import CapabilityGrant, ResourceSelector
from octo_common.limits import MAX_JSON_NESTING
from octo_common.messages import DispatchOperation, decode_message, encode_message
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from tests.vectors import vectors_path

VECTORS_PATH = vectors_path()
_VECTORS: dict[str, Any] | None = (
    json.loads(VECTORS_PATH.read_text(encoding="utf-8")) if VECTORS_PATH.is_file() else None
)

# Vector error name -> our class. "Serialization" is the JSON decoder's refusal;
# "UnexpectedSequence" (a strict next-sequence receiver) is handled by
# ``_expected_open_outcome``: for an already-accepted sequence our replay window
# answers DuplicateFrame.
ERRORS: dict[str, type[OctoError]] = {
    "Serialization": errors.SerializationError,
    "InvalidJsonEnvelope": errors.InvalidJsonEnvelope,
    "JsonPayloadTooDeep": errors.JsonPayloadTooDeep,
    "InvalidGrant": errors.InvalidGrant,
    "TooManyResources": errors.TooManyResources,
    "TooManyGrants": errors.TooManyGrants,
    "DuplicateGrant": errors.DuplicateGrant,
    "InvalidToken": errors.InvalidToken,
    "InvalidAuthenticationTag": errors.InvalidAuthenticationTag,
    "UnexpectedSequence": errors.DuplicateFrame,
    "InvalidSequence": errors.InvalidSequence,
    "UnsupportedVersion": errors.UnsupportedVersion,
    "UnknownSession": errors.UnknownSession,
    "WireFrameTooLarge": errors.WireFrameTooLarge,
    "InvalidCompensationKey": errors.InvalidCompensationKey,
    "InvalidCompensationGrantFingerprint": errors.InvalidCompensationGrantFingerprint,
    "CancellationIdMatchesRequest": errors.CancellationIdMatchesRequest,
    "InvalidOperationFailure": errors.InvalidOperationFailure,
    "OperationFailureTooLarge": errors.OperationFailureTooLarge,
}


def test_error_mapping_is_one_to_one() -> None:
    assert len(set(ERRORS.values())) == len(ERRORS)


def _cases(category: str) -> list[Any]:
    if _VECTORS is None:
        return [
            pytest.param(
                None,
                id="vectors-absent",
                marks=pytest.mark.skip(reason=f"conformance vectors not found at {VECTORS_PATH}"),
            )
        ]
    return [pytest.param(case, id=case["id"]) for case in _VECTORS[category]]


def _check_error_fields(error: OctoError, case: dict[str, Any]) -> None:
    for name, value in case.get("error_fields", {}).items():
        # InvalidGrant carries its text as `.reason`.
        attribute = (
            "reason" if isinstance(error, errors.InvalidGrant) and name == "message" else name
        )
        assert getattr(error, attribute) == value, (name, value)


def _max_nesting(text: str) -> int:
    structure = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    depth = deepest = 0
    for char in structure:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _frame_tag(key: bytes, sender: str, sequence: int, session_id: str, message: bytes) -> str:
    tagged = (
        b'{"domain":"octo-worker-auth-v5","protocol_version":5,"sender":"'
        + sender.encode()
        + b'","sequence":'
        + str(sequence).encode()
        + b',"session_id":"'
        + session_id.encode()
        + b'","message":'
        + message
        + b"}"
    )
    return blake3.blake3(tagged, key=key).hexdigest()


def _dispatch_json(payload_json: bytes) -> bytes:
    return (
        b'{"type":"dispatch_operation","request":{"protocol_version":5,"session_id":"session-1",'
        b'"request_id":"dispatch-1","tool":"t","operation_key":"op-1","payload":'
        + payload_json
        + b"}}"
    )


def _payload_json(case: dict[str, Any]) -> bytes:
    """The payload object as it could arrive on the wire, the input spelled as given."""
    if case["format"] == "text":
        return b'{"format":"text","value":' + json.dumps(case["input"]).encode() + b"}"
    value: str = case["input"]
    return b'{"format":"json","value":' + value.encode("utf-8") + b"}"


# canonical_inputs ---------------------------------------------------------------


def _payload_of(case: dict[str, Any]) -> ToolPayload:
    if case["format"] == "text":
        return ToolPayload.text(case["input"])
    return ToolPayload.json(parse_json(case["input"]))


@pytest.mark.parametrize("case", _cases("canonical_inputs"))
def test_canonical_inputs(case: dict[str, Any]) -> None:
    payload = _payload_of(case)
    canonical = canonical_operation_input_bytes(payload)
    assert canonical.hex() == case["canonical_hex"]
    assert payload.validate_for(case["format"]) == case["payload_size"]
    assert worker_input_fingerprint(payload) == case["worker_input_fingerprint"]
    assert ledger_input_fingerprint(canonical) == case["workflow_input_fingerprint"]
    if case["format"] == "json":
        assert compact_json(payload.value) == case["canonical_json"].encode("utf-8")
    kind = case.get("number_kind")
    if kind is not None:
        (number,) = payload.value
        expected_type = float if kind == "f64" else int
        assert type(number) is expected_type
        if kind == "u64":
            assert number >= 0
        if kind == "i64":
            assert number < 0


@pytest.mark.parametrize("case", _cases("canonical_inputs"))
def test_canonical_inputs_inside_a_sealed_dispatch(case: dict[str, Any]) -> None:
    """The wire spelling opens; the tag covers the canonical re-encoding."""
    key = bytes(range(32))
    raw_message = _dispatch_json(_payload_json(case))
    canonical_payload = _payload_of(case)
    canonical_message = _dispatch_json(
        b'{"format":"'
        + case["format"].encode()
        + b'","value":'
        + compact_json(canonical_payload.value)
        + b"}"
    )
    tag = _frame_tag(key, "host", 1, "session-1", canonical_message)
    frame = b'{"sequence":1,"message":' + raw_message + b',"auth_tag":"' + tag.encode() + b'"}'
    worker = SessionAuthenticator("session-1", SessionKey.from_bytes(key), SessionRole.WORKER)
    opened = worker.open(frame)
    assert isinstance(opened, DispatchOperation)
    assert opened.request.payload == canonical_payload
    assert encode_message(opened) == canonical_message


# canonical_rejections ------------------------------------------------------------


@pytest.mark.parametrize("case", _cases("canonical_rejections"))
def test_canonical_rejections(case: dict[str, Any]) -> None:
    expected = ERRORS[case["error"]]
    if case["stage"] == "parse":
        assert expected is SerializationError
        with pytest.raises(SerializationError):
            parse_json(case["input"])
        return
    assert case["stage"] == "canonical"
    payload = ToolPayload(case["format"], parse_json(case["input"]))
    with pytest.raises(expected) as raised:
        payload.validate_for(case["format"])
    _check_error_fields(raised.value, case)
    with pytest.raises(expected):
        canonical_operation_input_bytes(payload)


@pytest.mark.parametrize("case", _cases("canonical_rejections"))
def test_canonical_rejections_inside_a_dispatch_frame(case: dict[str, Any]) -> None:
    message_json = _dispatch_json(_payload_json(case))
    frame = b'{"sequence":1,"message":' + message_json + b',"auth_tag":"' + b"0" * 64 + b'"}'
    expected = ERRORS[case["error"]]
    # The 128-container parse limit counts the whole frame text (vectors README).
    if _max_nesting(frame.decode("utf-8")) > MAX_JSON_NESTING:
        expected = SerializationError
    with pytest.raises(expected) as raised:
        decode_frame(frame)
    if expected is not SerializationError:
        _check_error_fields(raised.value, case)
    with pytest.raises(expected):
        decode_message(message_json)
    worker = SessionAuthenticator(
        "session-1", SessionKey.from_bytes(b"\x07" * 32), SessionRole.WORKER
    )
    with pytest.raises(expected):
        worker.open(frame)


# grant_fingerprints / grant_rejections ------------------------------------------


_GRANT_FIELDS = (
    "tool",
    "format",
    "max_calls",
    "max_input_bytes",
    "max_output_bytes",
    "max_compensations",
)


def _grant_from_object(grant: dict[str, Any]) -> CapabilityGrant:
    # Unknown keys are ignored on decode, so the object form may carry some too.
    fields = {name: grant[name] for name in _GRANT_FIELDS if name in grant}
    resources = tuple(ResourceSelector(r["kind"], r["id"]) for r in grant.get("resources", []))
    return CapabilityGrant(**fields, resources=resources)


@pytest.mark.parametrize("case", _cases("grant_fingerprints"))
def test_grant_fingerprints(case: dict[str, Any]) -> None:
    grant = decode_struct(case["input_json"], CapabilityGrant)
    grant.validate()
    assert encode_struct(grant) == case["canonical_json"].encode("utf-8")
    assert grant.compensation_fingerprint() == case["fingerprint"]
    built = _grant_from_object(case["grant"])
    assert built == grant
    assert built.compensation_fingerprint() == case["fingerprint"]


@pytest.mark.parametrize("case", _cases("grant_rejections"))
def test_grant_rejections(case: dict[str, Any]) -> None:
    expected = ERRORS[case["error"]]
    if case["stage"] == "decode":
        with pytest.raises(expected):
            decode_struct(case["input_json"], CapabilityGrant)
        return
    assert case["stage"] == "validate"
    grant = decode_struct(case["input_json"], CapabilityGrant)
    with pytest.raises(expected) as raised:
        grant.validate()
    _check_error_fields(raised.value, case)
    with pytest.raises(expected):
        grant.compensation_fingerprint()


# plan fingerprints and derived keys (digest layouts) -----------------------------


class _Step:
    def __init__(self, step: dict[str, str]) -> None:
        self.id = step["id"]
        self.source = step["source"]


@pytest.mark.parametrize("case", _cases("plan_fingerprints"))
def test_plan_fingerprints(case: dict[str, Any]) -> None:
    assert plan_fingerprint([_Step(s) for s in case["plan_steps"]]) == case["fingerprint"]


@pytest.mark.parametrize("case", _cases("operation_keys"))
def test_operation_keys(case: dict[str, Any]) -> None:
    assert plan_fingerprint([_Step(s) for s in case["plan_steps"]]) == case["plan_fingerprint"]
    key = operation_key_for(
        case["plan_fingerprint"],
        case["step_id"],
        case["tool"],
        bytes.fromhex(case["input_hex"]),
        bytes.fromhex(case["nonce_hex"]),
    )
    assert key == case["operation_key"]


@pytest.mark.parametrize("case", _cases("compensation_keys"))
def test_compensation_keys(case: dict[str, Any]) -> None:
    grant = decode_struct(case["grant_json"], CapabilityGrant)
    assert grant.compensation_fingerprint() == case["grant_fingerprint"]
    key = compensation_key_for(
        case["plan_fingerprint"],
        case["operation_key"],
        case["tool"],
        case["tenant_scope"],
        case["grant_fingerprint"],
        bytes.fromhex(case["input_hex"]),
        bytes.fromhex(case["nonce_hex"]),
    )
    assert key == case["compensation_key"]


# frames -----------------------------------------------------------------------------


def _peer(role: SessionRole) -> SessionRole:
    return SessionRole.WORKER if role is SessionRole.HOST else SessionRole.HOST


@pytest.mark.parametrize("case", _cases("frames"))
def test_frames_seal_byte_for_byte(case: dict[str, Any]) -> None:
    key = SessionKey.from_bytes(bytes.fromhex(case["key_hex"]))
    sender = SessionRole(case["sender"])
    message_json = case["message_json"].encode("utf-8")
    message = decode_message(message_json)
    assert encode_message(message) == message_json
    sealer = SessionAuthenticator.restore(
        case["session_id"], key, sender, AuthenticatorState(case["sequence"], 0, 0)
    )
    frame = sealer.seal(message)
    assert frame == case["frame_line"].encode("utf-8")
    assert sealer.export_state().next_outgoing == case["sequence"] + 1
    assert frame.endswith(b'"auth_tag":"' + case["auth_tag"].encode() + b'"}')


@pytest.mark.parametrize("case", _cases("frames"))
def test_frames_open_at_the_peer(case: dict[str, Any]) -> None:
    key = SessionKey.from_bytes(bytes.fromhex(case["key_hex"]))
    sender = SessionRole(case["sender"])
    receiver = SessionAuthenticator(case["session_id"], key, _peer(sender))
    opened = receiver.open(case["frame_line"].encode("utf-8"))
    assert encode_message(opened) == case["message_json"].encode("utf-8")
    assert receiver.export_state().inbound_highest == case["sequence"]
    # The sender's own role never accepts its frame (reflection).
    reflected = SessionAuthenticator(case["session_id"], key, sender)
    with pytest.raises(errors.InvalidAuthenticationTag):
        reflected.open(case["frame_line"].encode("utf-8"))


# frame_open_cases -----------------------------------------------------------------------


def _receiver(spec: dict[str, Any]) -> SessionAuthenticator:
    key = SessionKey.from_bytes(bytes.fromhex(spec["key_hex"]))
    role = SessionRole(spec["role"])
    opened_before = spec.get("opened_before", [])
    next_incoming = spec.get("next_incoming_sequence", 1)
    if not opened_before and next_incoming > 1:
        # A strict receiver accepted every sequence below next_incoming.
        highest = next_incoming - 1
        seen = (1 << min(highest, 1024)) - 1
        return SessionAuthenticator.restore(
            spec["session_id"], key, role, AuthenticatorState(1, highest, seen)
        )
    receiver = SessionAuthenticator(spec["session_id"], key, role)
    for line in opened_before:
        receiver.open(line.encode("utf-8"))
    assert receiver.export_state().inbound_highest == next_incoming - 1
    return receiver


def _expected_open_outcome(case: dict[str, Any]) -> type[OctoError] | None:
    """None for acceptance; the window answers UnexpectedSequence by its own policy."""
    if case["result"] == "ok":
        return None
    if case["error"] == "UnexpectedSequence":
        fields = case.get("error_fields", {})
        actual, expected = fields.get("actual"), fields.get("expected")
        if actual is not None and expected is not None and actual >= expected:
            return None  # a future sequence: a window accepts it
        return DuplicateFrame
    return ERRORS[case["error"]]


@pytest.mark.parametrize("case", _cases("frame_open_cases"))
def test_frame_open_cases(case: dict[str, Any]) -> None:
    receiver = _receiver(case["receiver"])
    frame = case["frame_line"].encode("utf-8")
    expected = _expected_open_outcome(case)
    before = receiver.export_state()

    decoded = True
    try:
        decode_frame(frame)
    except OctoError as exc:
        decoded = False
        assert case["result"] == "error"
        assert case["stage"] == "decode"
        assert isinstance(exc, ERRORS[case["error"]])

    tag_valid: bool | None
    if expected is None:
        message = receiver.open(frame)
        tag_valid = True
        if "message_json" in case:
            assert encode_message(message) == case["message_json"].encode("utf-8")
    else:
        with pytest.raises(expected) as raised:
            receiver.open(frame)
        assert receiver.export_state() == before  # nothing changes on error
        if not decoded:
            tag_valid = None
        elif isinstance(raised.value, errors.InvalidAuthenticationTag):
            tag_valid = False
        else:
            tag_valid = True  # DuplicateFrame and later checks run only after the tag
        if isinstance(raised.value, DuplicateFrame) and "message_json" in case:
            assert encode_message(raised.value.message) == case["message_json"].encode("utf-8")
    assert tag_valid == case["tag_valid"]
