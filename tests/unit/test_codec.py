"""Strict JSON parsing, number canonicalisation and compact encoding.

Also the struct decoder's rules: duplicate keys rejected in every
struct but last-wins inside a payload value, the Struct's own unknown-field
policy, and no booleans or floats where an integer is expected. Every
expected value is written out by hand from the spec tables.
"""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from octo_common.codec import compact_json, decode_struct, encode_struct, parse_json
from octo_common.errors import OctoError, SerializationError
from octo_common.payload import ToolPayload


def _nested(levels: int, inner: str = "") -> str:
    return "[" * levels + inner + "]" * levels


# Strict parsing -------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "NaN",
        "[NaN]",
        "Infinity",
        '{"a":Infinity}',
        "-Infinity",
        "[-Infinity]",
    ],
)
def test_non_finite_constants_are_rejected(text: str) -> None:
    with pytest.raises(SerializationError):
        parse_json(text)
    with pytest.raises(SerializationError):
        parse_json(text.encode())


@pytest.mark.parametrize(
    "text",
    [
        r'"\ud800"',  # lone high surrogate at the end
        r'["\ud83d"]',
        r'"\ud800\u0041"',  # high surrogate followed by a non-surrogate escape
        r'"\ud800x"',  # high surrogate followed by a plain character
        r'"\udc00"',  # lone low surrogate
        r'"a\ude00b"',
        r'"\udc00\ud800"',  # low then high: both lone
        r'{"\ud800":1}',  # in a key
    ],
)
def test_lone_surrogate_escapes_are_rejected(text: str) -> None:
    with pytest.raises(SerializationError):
        parse_json(text)


def test_a_paired_surrogate_escape_is_accepted() -> None:
    assert parse_json(r'"\ud83d\ude00"') == "\U0001f600"
    assert parse_json(rb'{"k":"\uD83D\uDE00"}') == {"k": "\U0001f600"}


@pytest.mark.parametrize("code", [*range(0x20)])
def test_raw_control_characters_inside_strings_are_rejected(code: int) -> None:
    with pytest.raises(SerializationError):
        parse_json('"a' + chr(code) + 'b"')


def test_escaped_control_characters_and_del_are_accepted() -> None:
    assert parse_json(r'"\u0000\u001f\n"') == "\x00\x1f\n"
    assert parse_json('"\x7f"') == "\x7f"


def test_nesting_of_128_is_accepted_and_129_rejected() -> None:
    value = parse_json(_nested(128))
    depth = 0
    while isinstance(value, list):
        depth += 1
        value = value[0] if value else None
    assert depth == 128
    with pytest.raises(SerializationError):
        parse_json(_nested(129))


def test_nesting_counts_objects_and_arrays_together() -> None:
    text_128 = '{"a":' * 64 + _nested(64) + "}" * 64
    text_129 = '{"a":' * 64 + _nested(65) + "}" * 64
    assert isinstance(parse_json(text_128), dict)
    with pytest.raises(SerializationError):
        parse_json(text_129)


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = '["' + "[" * 500 + '"]'
    assert parse_json(text) == ["[" * 500]


def test_many_sequential_containers_are_not_nesting() -> None:
    assert parse_json("[" + ",".join(["[]"] * 300) + "]") == [[]] * 300


def test_overflowing_numbers_are_rejected() -> None:
    for text in ("1E400", "[1E400]", "-1e400", "1e309", "[123.456e999]"):
        with pytest.raises(SerializationError):
            parse_json(text)


def test_underflowing_numbers_become_zero() -> None:
    value = parse_json("1e-400")
    assert isinstance(value, float)
    assert value == 0.0
    assert math.copysign(1.0, value) == 1.0
    assert compact_json(parse_json("[1e-400]")) == b"[0.0]"


@pytest.mark.parametrize(
    "text",
    ["[1] x", "{} {}", "[1],", '"a"b', "1 2", "[]\x00", "nul", "[1,]", '{"a":1,}', "01", "+1", ""],
)
def test_trailing_garbage_and_malformed_text_are_rejected(text: str) -> None:
    with pytest.raises(SerializationError):
        parse_json(text)


def test_surrounding_json_whitespace_is_accepted() -> None:
    assert parse_json(" \t\r\n[1]\n\r\t ") == [1]
    assert parse_json(b"\n{}\n") == {}


def test_non_json_whitespace_around_the_value_is_rejected() -> None:
    for text in ("\u00a0[1]", "[1]\u2028", "\ufeff[1]", "\x0b[1]"):
        with pytest.raises(SerializationError):
            parse_json(text)


def test_duplicate_keys_are_last_wins_in_parse_json() -> None:
    assert parse_json('{"a":1,"a":2}') == {"a": 2}
    assert parse_json('{"a":{"x":1},"b":0,"a":[3]}') == {"a": [3], "b": 0}


def test_parse_json_accepts_any_root_value() -> None:
    assert parse_json("1") == 1
    assert parse_json('"s"') == "s"
    assert parse_json("true") is True
    assert parse_json("false") is False
    assert parse_json("null") is None


def test_invalid_utf8_is_a_serialization_error() -> None:
    with pytest.raises(SerializationError):
        parse_json(b'"\xff"')
    with pytest.raises(SerializationError):
        parse_json(b'"\xed\xa0\x80"')  # an encoded surrogate is not UTF-8


# Number canonicalisation ---------------------------------------------

# Every case of the number rules, plus the boundaries they name.
NUMBER_TABLE = [
    ("1", b"1"),
    ("1.0", b"1.0"),
    ("1e2", b"100.0"),
    ("1E2", b"100.0"),
    ("-0", b"-0.0"),
    ("0.1", b"0.1"),
    ("1.5e-7", b"1.5e-7"),
    ("0.000001", b"1e-6"),
    ("123.456e3", b"123456.0"),
    ("1e15", b"1000000000000000.0"),
    ("1e16", b"1e16"),
    ("1.0e16", b"1e16"),
    ("100000000000000000000.0", b"1e20"),
    ("12345678901234567890", b"12345678901234567890"),
    ("18446744073709551616", b"1.8446744073709552e19"),
    ("123456789012345678901234567890", b"1.2345678901234568e29"),
    ("-9223372036854775808", b"-9223372036854775808"),
    ("3.14159", b"3.14159"),
]

NUMBER_BOUNDARIES = [
    ("0", b"0"),
    ("-0.0", b"-0.0"),
    ("0.0", b"0.0"),
    ("0e10", b"0.0"),
    ("18446744073709551615", b"18446744073709551615"),  # 2^64-1 stays exact
    ("-9223372036854775809", b"-9.223372036854776e18"),  # below -2^63: a double
    ("0.00001", b"0.00001"),  # kk = -4: still positional
    ("1e-5", b"0.00001"),
    ("2.5e-5", b"0.000025"),
    ("1e-7", b"1e-7"),
    ("5e-324", b"5e-324"),
    ("123.456", b"123.456"),
    ("1.5E+3", b"1500.0"),
    ("-1.5", b"-1.5"),
    ("1e21", b"1e21"),
    ("1.7976931348623157e308", b"1.7976931348623157e308"),
    ("9007199254740993.0", b"9007199254740992.0"),  # nearest double
    ("1234567890123456.7", b"1234567890123456.8"),
    ("12345678901234567.0", b"1.2345678901234568e16"),
]


@pytest.mark.parametrize(("text", "written"), NUMBER_TABLE + NUMBER_BOUNDARIES)
def test_numbers_are_canonicalised_by_value(text: str, written: bytes) -> None:
    assert compact_json(parse_json(text)) == written
    assert compact_json(parse_json("[" + text + "]")) == b"[" + written + b"]"


def test_exact_integers_parse_to_int_and_others_to_float() -> None:
    assert type(parse_json("12345678901234567890")) is int
    assert type(parse_json("-9223372036854775808")) is int
    assert type(parse_json("1.0")) is float
    assert type(parse_json("1e2")) is float
    assert type(parse_json("18446744073709551616")) is float
    value = parse_json("-0")
    assert type(value) is float
    assert math.copysign(1.0, value) == -1.0


def test_python_values_are_canonicalised_when_written() -> None:
    assert compact_json(2**64) == b"1.8446744073709552e19"
    assert compact_json(2**64 - 1) == b"18446744073709551615"
    assert compact_json(-(2**63)) == b"-9223372036854775808"
    assert compact_json(-(2**63) - 1) == b"-9.223372036854776e18"
    assert compact_json(1e16) == b"1e16"
    assert compact_json(-0.0) == b"-0.0"
    assert compact_json((1, 2.5)) == b"[1,2.5]"


def test_non_finite_python_values_are_rejected() -> None:
    for value in (float("nan"), float("inf"), -float("inf"), [float("nan")]):
        with pytest.raises(SerializationError):
            compact_json(value)


def test_an_integer_beyond_the_double_range_is_a_serialization_error() -> None:
    with pytest.raises(SerializationError):
        compact_json(10**400)


def test_values_that_are_not_json_are_rejected() -> None:
    for value in ({1: 2}, {"a": object()}, b"bytes", {"a": {1, 2}}, "\ud800"):
        with pytest.raises(SerializationError):
            compact_json(value)


# Compact encoding -------------------------------------------------------


def test_compact_encoding_has_no_whitespace_and_sorts_object_keys() -> None:
    value = parse_json('{ "b" : [ 1 , { "d" : null , "c" : true } ] , "a" : false }')
    assert compact_json(value) == b'{"a":false,"b":[1,{"c":true,"d":null}]}'


def test_object_keys_sort_by_utf8_bytes_not_utf16() -> None:
    value = {"\U0001f600": 1, "\uffff": 2, "é": 3, "B": 4, "a": 5, "aa": 6}
    assert compact_json(value) == ('{"B":4,"a":5,"aa":6,"é":3,"\uffff":2,"\U0001f600":1}'.encode())


def test_string_escaping_short_forms_and_lowercase_u_escapes() -> None:
    assert compact_json('"') == b'"\\""'
    assert compact_json("\\") == b'"\\\\"'
    assert compact_json("\b\f\n\r\t") == b'"\\b\\f\\n\\r\\t"'
    assert (
        compact_json("\x00\x01\x0b\x0e\x1a\x1f") == b'"\\u0000\\u0001\\u000b\\u000e\\u001a\\u001f"'
    )


def test_everything_else_is_written_as_raw_utf8() -> None:
    text = "/\x7f\u2028\u2029é東京\U0001f600 "
    assert compact_json(text) == b'"' + text.encode("utf-8") + b'"'


def test_string_escaping_equals_json_dumps_without_ascii_escaping() -> None:
    text = "".join(chr(c) for c in range(0x80)) + "\u2028\u00e9\U0001f600"
    assert compact_json(text) == json.dumps(text, ensure_ascii=False).encode("utf-8")


def test_literals_are_written_as_json_literals() -> None:
    assert compact_json([True, False, None]) == b"[true,false,null]"


# decode_struct (the decode rules) ------------------------------------------


class _StrictDoc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    count: int
    payload: ToolPayload


class _LaxDoc(msgspec.Struct, frozen=True):
    count: int
    name: str = "default"


class _Outer(msgspec.Struct, frozen=True):
    inner: _LaxDoc


def test_decode_struct_builds_the_struct() -> None:
    doc = decode_struct(b'{"count":3,"payload":{"format":"text","value":"x"}}', _StrictDoc)
    assert doc == _StrictDoc(3, ToolPayload.text("x"))
    assert decode_struct('{"count":3}', _LaxDoc) == _LaxDoc(3)


def test_duplicate_keys_are_rejected_in_a_struct() -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"count":1,"count":1}', _LaxDoc)
    with pytest.raises(SerializationError):
        decode_struct('{"inner":{"count":1,"count":2}}', _Outer)


def test_duplicate_keys_are_rejected_in_the_payload_envelope() -> None:
    text = '{"count":1,"payload":{"format":"text","format":"text","value":"x"}}'
    with pytest.raises(SerializationError):
        decode_struct(text, _StrictDoc)


def test_duplicate_keys_inside_a_payload_value_are_last_wins() -> None:
    text = (
        '{"count":1,"payload":{"format":"json",'
        '"value":{"a":1,"b":{"c":1,"c":[{"d":1,"d":2}]},"a":2}}}'
    )
    doc = decode_struct(text, _StrictDoc)
    assert doc.payload == ToolPayload.json({"a": 2, "b": {"c": [{"d": 2}]}})
    assert encode_struct(doc) == (
        b'{"count":1,"payload":{"format":"json","value":{"a":2,"b":{"c":[{"d":2}]}}}}'
    )


def test_unknown_fields_follow_the_struct_policy() -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"count":1,"payload":{"format":"text","value":""},"x":1}', _StrictDoc)
    assert decode_struct('{"count":1,"extra":[1,{"y":2}]}', _LaxDoc) == _LaxDoc(1)


@pytest.mark.parametrize("bad", ["true", "false", "1.0", "1e0", "10E-1", '"1"', "null", "[1]"])
def test_integer_fields_refuse_booleans_floats_and_other_types(bad: str) -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"count":' + bad + "}", _LaxDoc)


def test_missing_required_fields_are_rejected() -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"name":"x"}', _LaxDoc)
    with pytest.raises(SerializationError):
        decode_struct('{"count":1}', _StrictDoc)


@pytest.mark.parametrize(
    "payload",
    [
        '{"format":"text","value":1}',
        '{"format":"xml","value":"x"}',
        '{"format":"json"}',
        '{"value":"x"}',
        '"x"',
    ],
)
def test_malformed_payloads_are_serialization_errors(payload: str) -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"count":1,"payload":' + payload + "}", _StrictDoc)


def test_decode_struct_applies_the_strict_parse_rules() -> None:
    for text in (
        '{"count":1} x',
        '{"count":NaN}',
        '{"count":1,"name":"\\ud800"}',
        '{"count":1,"name":"a\x01"}',
        '{"count":1,"extra":' + _nested(128) + "}",
    ):
        with pytest.raises(SerializationError):
            decode_struct(text, _LaxDoc)


def test_decode_struct_never_raises_a_non_octo_error() -> None:
    for text in (b"", b"\xff", b"[", b"{}", b"null", b'{"count":99999999999999999999999}'):
        with pytest.raises(OctoError):
            decode_struct(text, _LaxDoc)


def test_encode_struct_keeps_declaration_order_and_canonical_payloads() -> None:
    doc = _StrictDoc(7, ToolPayload.json({"z": 1.0, "a": [2**64]}))
    assert encode_struct(doc) == (
        b'{"count":7,"payload":{"format":"json","value":{"a":[1.8446744073709552e19],"z":1.0}}}'
    )
