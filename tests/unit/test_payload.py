"""Tool payloads: validate_for, depth, canonical input bytes, equality.

Scenarios follow the check order of a payload, every depth rule and the
canonical input bytes. Expected bytes are written by hand.
"""

from __future__ import annotations

import contextlib
import copy
import pickle
from typing import Any

import pytest

from octo_common import payload as payload_module
from octo_common.errors import (
    InvalidJsonEnvelope,
    JsonPayloadTooDeep,
    PayloadFormatMismatch,
    SerializationError,
)
from octo_common.payload import (
    ToolPayload,
    canonical_operation_input_bytes,
    compact_json,
    parse_json,
)


def _arrays(levels: int, inner: Any) -> Any:
    value = inner
    for _ in range(levels):
        value = [value]
    return value


def _be64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_payload_module_re_exports_the_codec_functions() -> None:
    assert payload_module.parse_json("[1]") == [1]
    assert compact_json(parse_json('{"b":1,"a":2}')) == b'{"a":2,"b":1}'


def test_builders_set_format_and_value() -> None:
    text = ToolPayload.text("release")
    assert (text.format, text.value) == ("text", "release")
    js = ToolPayload.json({"a": [1, 2]})
    assert (js.format, js.value) == ("json", {"a": [1, 2]})


# Check order ----------------------------------------------------------


def test_format_mismatch_is_checked_first() -> None:
    # The payload would also fail the envelope and depth checks: the format wins.
    with pytest.raises(PayloadFormatMismatch) as raised:
        ToolPayload.json(1).validate_for("text")
    assert (raised.value.expected, raised.value.actual) == ("text", "json")
    with pytest.raises(PayloadFormatMismatch) as raised:
        ToolPayload.text("x").validate_for("json")
    assert (raised.value.expected, raised.value.actual) == ("json", "text")
    with pytest.raises(PayloadFormatMismatch):
        ToolPayload.json(_arrays(40, [])).validate_for("text")


def test_text_size_is_the_utf8_byte_count() -> None:
    assert ToolPayload.text("").validate_for("text") == 0
    assert ToolPayload.text("release").validate_for("text") == 7
    assert ToolPayload.text("é").validate_for("text") == 2
    assert ToolPayload.text("東京\U0001f600").validate_for("text") == 10


def test_text_is_not_otherwise_checked() -> None:
    assert ToolPayload.text("[" * 200 + "\x00").validate_for("text") == 201


@pytest.mark.parametrize("root", [1, 1.5, "release", True, False, None])
def test_a_scalar_json_root_is_an_invalid_envelope(root: Any) -> None:
    with pytest.raises(InvalidJsonEnvelope):
        ToolPayload.json(root).validate_for("json")


def test_envelope_is_checked_before_size() -> None:
    with pytest.raises(InvalidJsonEnvelope):
        ToolPayload.json("x" * 100_000).validate_for("json")


def test_json_size_is_the_compact_encoding_length() -> None:
    assert ToolPayload.json({}).validate_for("json") == 2
    assert ToolPayload.json([]).validate_for("json") == 2
    assert ToolPayload.json(parse_json('{ "b" : 2 , "a" : 1 }')).validate_for("json") == 13
    assert ToolPayload.json({"é": "€"}).validate_for("json") == len('{"é":"€"}'.encode())
    assert ToolPayload.json(parse_json("[1e2]")).validate_for("json") == len(b"[100.0]")


# Depth, every rule ----------------------------------------------------


def test_empty_object_wrapped_in_32_arrays_fails() -> None:
    with pytest.raises(JsonPayloadTooDeep) as raised:
        ToolPayload.json(_arrays(32, {})).validate_for("json")
    assert raised.value.maximum == 32


def test_32_nested_arrays_with_an_empty_innermost_array_pass() -> None:
    value = _arrays(31, [])  # 32 arrays in all
    assert ToolPayload.json(value).validate_for("json") == 64


def test_32_nested_arrays_whose_innermost_holds_a_number_fail() -> None:
    with pytest.raises(JsonPayloadTooDeep):
        ToolPayload.json(_arrays(32, 0)).validate_for("json")


def test_31_nested_arrays_around_a_number_pass() -> None:
    assert ToolPayload.json(_arrays(31, 0)).validate_for("json") == 63


def test_object_keys_do_not_count_towards_depth() -> None:
    value: Any = 0
    for _ in range(31):
        value = {"k": value}
    assert ToolPayload.json(value).validate_for("json") > 0
    with pytest.raises(JsonPayloadTooDeep):
        ToolPayload.json({"k": value}).validate_for("json")


def test_depth_is_the_deepest_branch_not_the_first() -> None:
    value = [1, 2, {"a": [3]}, _arrays(31, 0)]  # the last branch reaches depth 33
    with pytest.raises(JsonPayloadTooDeep):
        ToolPayload.json(value).validate_for("json")


def test_a_wide_shallow_payload_passes() -> None:
    value = [[i] for i in range(200)]
    assert ToolPayload.json(value).validate_for("json") == len(compact_json(value))


# Canonical operation input bytes ---------------------------------------


def test_canonical_bytes_of_text() -> None:
    assert canonical_operation_input_bytes(ToolPayload.text("release")) == (
        b"text" + _be64(7) + b"release"
    )
    assert canonical_operation_input_bytes(ToolPayload.text("")) == b"text" + _be64(0)
    assert (
        canonical_operation_input_bytes(ToolPayload.text("é")) == b"text" + _be64(2) + "é".encode()
    )


def test_canonical_bytes_of_json_sort_keys() -> None:
    payload = ToolPayload.json(parse_json('{"b":2,"a":1}'))
    assert canonical_operation_input_bytes(payload) == b"json" + _be64(13) + b'{"a":1,"b":2}'


def test_canonical_bytes_of_json_duplicate_keys_last_wins() -> None:
    payload = ToolPayload.json(parse_json('{"a":1,"a":2}'))
    assert canonical_operation_input_bytes(payload) == b"json" + _be64(7) + b'{"a":2}'


def test_canonical_bytes_of_an_empty_object() -> None:
    assert canonical_operation_input_bytes(ToolPayload.json({})) == b"json" + _be64(2) + b"{}"


def test_canonical_bytes_apply_no_unicode_normalisation() -> None:
    nfd = ToolPayload.json(["cafe\u0301"])
    nfc = ToolPayload.json(["caf\u00e9"])
    assert canonical_operation_input_bytes(nfd) != canonical_operation_input_bytes(nfc)
    assert canonical_operation_input_bytes(nfd).endswith('["cafe\u0301"]'.encode())


def test_canonical_bytes_validate_envelope_and_depth_first() -> None:
    with pytest.raises(InvalidJsonEnvelope):
        canonical_operation_input_bytes(ToolPayload.json(42))
    with pytest.raises(JsonPayloadTooDeep):
        canonical_operation_input_bytes(ToolPayload.json(_arrays(32, {})))


# Equality, hashing, repr, immutability ----------------------------------------


def test_one_and_one_point_zero_are_different_payloads() -> None:
    assert ToolPayload.json([1]) != ToolPayload.json([1.0])
    assert ToolPayload.json(parse_json("[1]")) != ToolPayload.json(parse_json("[1.0]"))


def test_key_order_does_not_matter_for_equality_or_hash() -> None:
    first = ToolPayload.json({"a": 1, "b": [1, {"c": 2, "d": 3}]})
    second = ToolPayload.json(parse_json('{"b":[1,{"d":3,"c":2}],"a":1}'))
    assert first == second
    assert hash(first) == hash(second)
    assert len({first, second}) == 1


def test_format_is_part_of_equality() -> None:
    assert ToolPayload.text("[1]") != ToolPayload.json([1])
    assert ToolPayload.text("x") == ToolPayload.text("x")
    assert ToolPayload.text("x") != ToolPayload.text("y")
    assert ToolPayload.text("x") != "x"


def test_equal_values_by_canonical_form() -> None:
    assert ToolPayload.json([2**64]) == ToolPayload.json([1.8446744073709552e19])
    assert ToolPayload.json((1, 2)) == ToolPayload.json([1, 2])


def test_repr_and_str_never_show_the_value() -> None:
    for payload in (
        ToolPayload.text("hunter2-secret"),
        ToolPayload.json({"token": "hunter2-secret"}),
    ):
        assert "hunter2" not in repr(payload)
        assert "hunter2" not in str(payload)
        assert "redacted" in repr(payload)


def test_payloads_refuse_attribute_changes() -> None:
    payload = ToolPayload.json({"a": 1})
    for name in ("format", "value", "_value", "_format", "other"):
        with pytest.raises(AttributeError):
            setattr(payload, name, "text")
    with pytest.raises(AttributeError):
        del payload._value
    assert payload == ToolPayload.json({"a": 1})


def test_the_builder_copies_its_argument() -> None:
    source: dict[str, Any] = {"a": [1]}
    payload = ToolPayload.json(source)
    source["a"].append(2)
    source["b"] = 3
    assert payload == ToolPayload.json({"a": [1]})
    assert payload.value == {"a": [1]}


def test_the_value_cannot_be_changed_through_the_accessor() -> None:
    payload = ToolPayload.json({"a": [1]})
    with contextlib.suppress(TypeError):
        payload.value["b"] = 1
    with contextlib.suppress(TypeError, AttributeError):
        payload.value["a"].append(2)
    assert payload.value == {"a": [1]}


def test_pickle_and_copy_keep_the_value() -> None:
    payload = ToolPayload.json({"a": [1, 1.0]})
    assert pickle.loads(pickle.dumps(payload)) == payload
    assert copy.copy(payload) == payload
    assert copy.deepcopy(payload) == payload


def test_builders_reject_values_that_are_not_json() -> None:
    with pytest.raises(SerializationError):
        ToolPayload.text(1)  # type: ignore[arg-type]
    for value in (float("nan"), [float("inf")], {1: "a"}, {"a": object()}, ["\udc00"]):
        with pytest.raises(SerializationError):
            ToolPayload.json(value)
