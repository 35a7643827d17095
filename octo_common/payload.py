"""Tool payloads and canonical operation input bytes.

``ToolPayload`` is an immutable value: a format (``"text"`` or ``"json"``)
and a value. JSON values are held in canonical form, so two payloads
are equal exactly when their canonical encodings are equal (``1`` and
``1.0`` differ; key order does not matter). A payload's repr never shows
its value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from octo_common.codec import (
    canonical_value,
    compact_json,
    encode_value,
    parse_json,
    register_custom_type,
)
from octo_common.errors import (
    InvalidJsonEnvelope,
    JsonPayloadTooDeep,
    PayloadFormatMismatch,
    SerializationError,
)
from octo_common.limits import MAX_JSON_PAYLOAD_DEPTH

__all__ = [
    "PayloadFormat",
    "ToolPayload",
    "canonical_operation_input_bytes",
    "compact_json",
    "parse_json",
]

PayloadFormat = Literal["text", "json"]
_FORMATS: Final = ("text", "json")
_VALUE_DECODER: Final = msgspec.json.Decoder()
_UNSET: Final[Any] = object()


def _depth_exceeds(value: Any, limit: int) -> bool:
    """True when a value node lies deeper than ``limit`` (root is depth 1)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
    return False


class ToolPayload:
    """A tool payload: ``ToolPayload.text(s)`` or ``ToolPayload.json(obj)``."""

    __slots__ = ("_deep", "_encoded", "_format", "_value", "_value_bytes")

    _format: str
    _value: Any
    _value_bytes: bytes | None
    _encoded: bytes | None
    _deep: bool | None

    def __init__(self, format: str, value: Any) -> None:
        if format == "text":
            if not isinstance(value, str):
                raise SerializationError("a text payload's value must be a string")
            value_bytes: bytes | None = encode_value(value)
            deep: bool | None = False
        elif format == "json":
            value = canonical_value(value)
            value_bytes = None
            deep = None
        else:
            raise SerializationError("payload format must be text or json")
        self._init(format, value, value_bytes, deep)

    def _init(self, fmt: str, value: Any, value_bytes: bytes | None, deep: bool | None) -> None:
        _set_format(self, fmt)
        _set_value(self, value)
        _set_value_bytes(self, value_bytes)
        _set_encoded(self, None)
        _set_deep(self, deep)

    @classmethod
    def text(cls, value: str) -> ToolPayload:
        return cls("text", value)

    @classmethod
    def json(cls, value: Any) -> ToolPayload:
        return cls("json", value)

    @classmethod
    def _trusted(cls, fmt: str, value: Any) -> ToolPayload:
        """A payload from a strictly decoded value (already canonical)."""
        obj = cls.__new__(cls)
        obj._init(fmt, value, None, False if fmt == "text" else None)
        return obj

    @property
    def format(self) -> str:
        return self._format

    @property
    def value(self) -> Any:
        """The value; a JSON value is a fresh copy each time (the payload is immutable)."""
        if self._format == "text":
            return self._value
        return _VALUE_DECODER.decode(self.value_bytes())

    def _too_deep(self) -> bool:
        deep = self._deep
        if deep is None:
            try:
                data: bytes | None = self.value_bytes()
            except SerializationError:
                data = None
            # With at most 31 containers in the whole encoding, no node can lie
            # deeper than 32: the walk is needed only for bigger payloads.
            if data is not None and data.count(b"[") + data.count(b"{") < MAX_JSON_PAYLOAD_DEPTH:
                deep = False
            else:
                deep = _depth_exceeds(self._value, MAX_JSON_PAYLOAD_DEPTH)
            _set_deep(self, deep)
        return deep

    def value_bytes(self) -> bytes:
        """Compact canonical encoding of the value."""
        data = self._value_bytes
        if data is None:
            data = encode_value(self._value)
            _set_value_bytes(self, data)
        return data

    def encoded(self) -> bytes:
        """The payload object as written on the wire: ``{"format":..,"value":..}``."""
        data = self._encoded
        if data is None:
            data = b'{"format":"' + self._format.encode() + b'","value":' + self.value_bytes()
            data += b"}"
            _set_encoded(self, data)
        return data

    def validate_for(self, expected_format: str) -> int:
        """Format, envelope, depth; returns the size checked against limits."""
        if self._format != expected_format:
            raise PayloadFormatMismatch(expected_format, self._format)
        if self._format == "text":
            return len(self._value.encode("utf-8"))
        if not isinstance(self._value, dict | list):
            raise InvalidJsonEnvelope()
        if self._too_deep():
            raise JsonPayloadTooDeep(MAX_JSON_PAYLOAD_DEPTH)
        return len(self.value_bytes())

    def canonical_bytes(self) -> bytes:
        """``canonical_operation_input_bytes`` of this payload."""
        return canonical_operation_input_bytes(self)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ToolPayload is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("ToolPayload is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ToolPayload):
            return NotImplemented
        if self._format != other._format:
            return False
        if self._format == "text":
            return bool(self._value == other._value)
        return self.value_bytes() == other.value_bytes()

    def __hash__(self) -> int:
        if self._format == "text":
            return hash(("text", self._value))
        return hash(("json", self.value_bytes()))

    def __repr__(self) -> str:
        return f"ToolPayload(format={self._format!r}, value=[redacted])"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ToolPayload, (self._format, self._value))

    def __copy__(self) -> ToolPayload:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> ToolPayload:
        return self


# Slot descriptors: direct stores that bypass the immutability guard.
def _slot_setter(name: str) -> Callable[[ToolPayload, Any], None]:
    descriptor: Any = ToolPayload.__dict__[name]
    return descriptor.__set__  # type: ignore[no-any-return]


_set_format = _slot_setter("_format")
_set_value = _slot_setter("_value")
_set_value_bytes = _slot_setter("_value_bytes")
_set_encoded = _slot_setter("_encoded")
_set_deep = _slot_setter("_deep")


def canonical_operation_input_bytes(payload: ToolPayload) -> bytes:
    """``b"text" ‖ u64_be(len) ‖ utf8`` or ``b"json" ‖ u64_be(len) ‖ C``."""
    payload.validate_for(payload.format)
    if payload.format == "text":
        data = str(payload.value).encode("utf-8")
        return b"text" + len(data).to_bytes(8, "big") + data
    compact = payload.value_bytes()
    return b"json" + len(compact).to_bytes(8, "big") + compact


# Codec registration: how a payload is written inside structs and read back.


def _encode_payload(payload: ToolPayload) -> msgspec.Raw:
    return msgspec.Raw(payload.encoded())


def _decode_payload(natural: Any) -> ToolPayload:
    if not isinstance(natural, dict):
        raise SerializationError("payload must be an object")
    fmt = natural.get("format", _UNSET)
    if fmt not in _FORMATS:
        raise SerializationError("payload format must be text or json")
    if "value" not in natural:
        raise SerializationError("payload value is missing")
    value = natural["value"]
    if fmt == "text" and not isinstance(value, str):
        raise SerializationError("a text payload's value must be a string")
    return ToolPayload._trusted(fmt, value)


register_custom_type(ToolPayload, _encode_payload, _decode_payload)
