"""Canonical numbers on every path that canonicalises a payload.

An integer written without fraction or exponent stays exact only inside
[-2^63, 2^64-1]; every other number is the nearest double written in the
shortest round-trip form, and a number that overflows to infinity is rejected. The rule
must hold the same way wherever Octo turns JSON into canonical bytes:
``parse_json``/``compact_json``, message and frame decoding (both the
canonical fast path and the strict path), the tag a frame is checked
against, journal rows, payload sizes, canonical input bytes and both input
fingerprints, and payloads built from Python values.

Expected values come from ``tests.number_reference`` (the number rules
written from the protocol's text with Python's own number conversion) and from
the independent conformance vectors; never from Octo's codec.
"""

from __future__ import annotations

import json
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octo_common.codec import compact_json, parse_json
from octo_common.digest import ledger_input_fingerprint, worker_input_fingerprint
from octo_common.errors import InvalidAuthenticationTag, SerializationError
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole, decode_frame
from octo_common.messages import (
    DispatchOperation,
    OperationDispatchRequest,
    decode_message,
    encode_message,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_worker.journal import WorkerOperationRecord
from tests.number_reference import reference_number, reference_python_int
from tests.vectors import vectors_path

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = bytes(range(7, 39))
FINGERPRINT = "ab" * 32
SCOPE = "tenant-a"

# Boundaries the rules name, with the spelling they prescribe (None: rejected).
BOUNDARIES: list[tuple[str, str | None]] = [
    ("18446744073709551615", "18446744073709551615"),  # 2^64-1: exact
    ("18446744073709551616", "1.8446744073709552e19"),  # 2^64: a double
    ("-9223372036854775808", "-9223372036854775808"),  # -2^63: exact
    ("-9223372036854775809", "-9.223372036854776e18"),  # -2^63-1: a double
    ("-9999999999999999999", "-1e19"),  # 19 digits, below -2^63
    ("-1000000000000000000", "-1000000000000000000"),  # 19 digits, inside
    ("9999999999999999999", "9999999999999999999"),  # 19 digits, inside
    ("-18446744073709551615", "-1.8446744073709552e19"),
    ("99999999999999999999", "1e20"),
    ("123456789012345678901234567890", "1.2345678901234568e29"),
    ("1" + "0" * 308, "1e308"),  # a 309-digit integer still fits a double
    ("-" + "1" + "0" * 308, "-1e308"),
    ("1" + "0" * 309, None),  # 1e309 overflows: rejected, never infinity
    ("-" + "1" + "0" * 309, None),
    ("9" * 400, None),
    ("1E400", None),
    ("-1e400", None),
    ("1e-400", "0.0"),  # underflow is zero, not an error
    ("-0", "-0.0"),
    ("-0.0", "-0.0"),
    ("0", "0"),
    ("1e16", "1e16"),
    ("1e15", "1000000000000000.0"),
]


def _row(value_json: str) -> str:
    return (
        '{"format_version":2,"scope":"' + SCOPE + '","record":{"tool":"t","operation_key":"op-1",'
        '"input_fingerprint":"' + FINGERPRINT + '","state":{"state":"succeeded","payload":'
        '{"format":"json","value":' + value_json + '}},"compensation":null}}'
    )


def _dispatch(value_json: str) -> bytes:
    return (
        '{"type":"dispatch_operation","request":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"dispatch-1","tool":"t","operation_key":"op-1","payload":'
        '{"format":"json","value":' + value_json + "}}}"
    ).encode("utf-8")


def _tag(message_bytes: bytes) -> str:
    tagged = (
        b'{"domain":"octo-worker-auth-v5","protocol_version":5,"sender":"host","sequence":1,'
        b'"session_id":"session-1","message":' + message_bytes + b"}"
    )
    return blake3.blake3(tagged, key=KEY).hexdigest()


def _frame(message_bytes: bytes, tag: str) -> bytes:
    return b'{"sequence":1,"message":' + message_bytes + b',"auth_tag":"' + tag.encode() + b'"}'


def _worker() -> SessionAuthenticator:
    return SessionAuthenticator("session-1", SessionKey.from_bytes(KEY), SessionRole.WORKER)


def _spellings(value_json: str) -> list[str]:
    """The value as given, and with JSON whitespace (which forces the strict path)."""
    return [value_json, " " + value_json.replace(",", " , ") + " "]


def _check_every_path(value_json: str, canonical: bytes) -> None:
    """Every decode and canonicalisation path writes ``canonical`` for this payload value."""
    canonical_input = b"json" + len(canonical).to_bytes(8, "big") + canonical
    expected_worker_fp = blake3.blake3(b"octo-worker-operation-input-v1" + canonical_input)
    expected_ledger_fp = blake3.blake3(
        b"octo-workflow-operation-input-v1" + len(canonical_input).to_bytes(8, "big")
    )
    expected_ledger_fp.update(canonical_input)
    canonical_message = _dispatch(canonical.decode("utf-8"))
    for spelling in _spellings(value_json):
        assert compact_json(parse_json(spelling)) == canonical
        message = decode_message(_dispatch(spelling))
        assert isinstance(message, DispatchOperation)
        payload = message.request.payload
        assert payload.value_bytes() == canonical
        assert compact_json(payload.value) == canonical
        assert payload.validate_for("json") == len(canonical)
        assert canonical_operation_input_bytes(payload) == canonical_input
        assert worker_input_fingerprint(payload) == expected_worker_fp.hexdigest()
        assert ledger_input_fingerprint(canonical_input) == expected_ledger_fp.hexdigest()
        assert encode_message(message) == canonical_message
        # The frame tag covers the canonical message, whatever the wire spelling.
        frame = _frame(_dispatch(spelling), _tag(canonical_message))
        assert decode_frame(frame)[3] == canonical_message
        opened = _worker().open(frame)
        assert isinstance(opened, DispatchOperation)
        assert opened.request.payload == payload
        # A journal row holding this payload reads back and is written canonically.
        record = WorkerOperationRecord.from_row_json(_row(spelling), SCOPE, "op-1")
        assert record.to_row_json(SCOPE) == _row(canonical.decode("utf-8")).encode("utf-8")


def _check_rejected_everywhere(value_json: str) -> None:
    for spelling in _spellings(value_json):
        with pytest.raises(SerializationError):
            parse_json(spelling)
        with pytest.raises(SerializationError):
            decode_message(_dispatch(spelling))
        with pytest.raises(SerializationError):
            decode_frame(_frame(_dispatch(spelling), "0" * 64))
        with pytest.raises(SerializationError):
            WorkerOperationRecord.from_row_json(_row(spelling), SCOPE, "op-1")


@pytest.mark.parametrize(("lexeme", "written"), BOUNDARIES, ids=[b[0][:24] for b in BOUNDARIES])
def test_boundaries_on_every_path(lexeme: str, written: str | None) -> None:
    # The table is the documents'; the independent reference must agree with it.
    assert reference_number(lexeme) == written
    value_json = "[" + lexeme + "]"
    if written is None:
        _check_rejected_everywhere(value_json)
        _check_rejected_everywhere('{"n":' + lexeme + "}")
        return
    _check_every_path(value_json, ("[" + written + "]").encode())
    _check_every_path('{"n":' + lexeme + "}", ('{"n":' + written + "}").encode())


def test_a_frame_tagged_over_the_exact_spelling_of_an_out_of_range_integer_is_refused() -> None:
    # A sender that kept -2^63-1 exact computed its tag over bytes the worker
    # never produces: the frame must not authenticate.
    raw = _dispatch("[-9223372036854775809]")
    with pytest.raises(InvalidAuthenticationTag):
        _worker().open(_frame(raw, _tag(raw)))


def test_python_integers_outside_the_range_become_doubles_in_payloads() -> None:
    for value in (2**64 - 1, 2**64, -(2**63), -(2**63) - 1, -(10**19) + 1, 10**300):
        written = reference_python_int(value)
        assert written is not None
        canonical = ("[" + written + "]").encode()
        payload = ToolPayload.json([value])
        assert payload.value_bytes() == canonical
        assert payload.validate_for("json") == len(canonical)
        assert compact_json([value]) == canonical
        request = OperationDispatchRequest("session-1", "dispatch-1", "t", "op-1", payload)
        assert encode_message(DispatchOperation(request)) == _dispatch(canonical.decode())
    with pytest.raises(SerializationError):
        ToolPayload.json([10**400])
    with pytest.raises(SerializationError):
        compact_json([-(10**400)])


# Generated numbers ----------------------------------------------------------------------

INTEGERS = st.one_of(
    st.integers(min_value=-(2**63) - 2000, max_value=-(2**63) + 2000),
    st.integers(min_value=2**64 - 2000, max_value=2**64 + 2000),
    st.integers(min_value=-(10**19), max_value=-(10**18)),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.integers(min_value=10**305, max_value=10**311),
    st.integers(min_value=-(10**311), max_value=-(10**305)),
)


@FAST
@given(INTEGERS)
def test_generated_integers_follow_d1_on_every_path(value: int) -> None:
    lexeme = str(value)
    written = reference_number(lexeme)
    if written is None:
        _check_rejected_everywhere("[" + lexeme + "]")
    else:
        _check_every_path("[" + lexeme + "]", ("[" + written + "]").encode())
    expected_python = reference_python_int(value)
    if expected_python is None:
        with pytest.raises(SerializationError):
            ToolPayload.json([value])
    else:
        assert ToolPayload.json([value]).value_bytes() == ("[" + expected_python + "]").encode()


NUMBER_LEXEMES = st.builds(
    lambda sign, whole, fraction, exponent: sign + whole + fraction + exponent,
    st.sampled_from(["", "-"]),
    st.one_of(st.just("0"), st.from_regex(r"[1-9][0-9]{0,24}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{1,20}", fullmatch=True)),
    st.one_of(st.just(""), st.from_regex(r"[eE][+-]?[0-9]{1,3}", fullmatch=True)),
)


@FAST
@given(st.lists(NUMBER_LEXEMES, min_size=1, max_size=4))
def test_generated_number_spellings_follow_d1_on_every_path(lexemes: list[str]) -> None:
    written = [reference_number(lexeme) for lexeme in lexemes]
    value_json = "[" + ",".join(lexemes) + "]"
    if any(w is None for w in written):
        _check_rejected_everywhere(value_json)
        return
    _check_every_path(value_json, ("[" + ",".join(w for w in written if w) + "]").encode())


# The independent vectors ------------------------------------------------------------------


def _vector_cases() -> list[Any]:
    path = vectors_path()
    if not path.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no vectors at {path}"))]
    cases = json.loads(path.read_text(encoding="utf-8"))["canonical_inputs"]
    return [pytest.param(case, id=case["id"]) for case in cases if case["format"] == "json"]


@pytest.mark.parametrize("case", _vector_cases())
def test_vector_inputs_on_every_path(case: dict[str, Any]) -> None:
    canonical = case["canonical_json"].encode("utf-8")
    assert canonical_input_hex(canonical) == case["canonical_hex"]
    _check_every_path(case["input"], canonical)
    # The canonical spelling itself is a fixed point (this is the fast path).
    _check_every_path(case["canonical_json"], canonical)
    message = decode_message(_dispatch(case["input"]))
    assert isinstance(message, DispatchOperation)
    payload = message.request.payload
    assert payload.validate_for("json") == case["payload_size"]
    assert worker_input_fingerprint(payload) == case["worker_input_fingerprint"]
    assert (
        ledger_input_fingerprint(canonical_operation_input_bytes(payload))
        == case["workflow_input_fingerprint"]
    )
    kind = case.get("number_kind")
    if kind is not None:
        (number,) = payload.value
        assert type(number) is (float if kind == "f64" else int)


def canonical_input_hex(canonical: bytes) -> str:
    return (b"json" + len(canonical).to_bytes(8, "big") + canonical).hex()
