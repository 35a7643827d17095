"""Strict JSON text <-> values and structs.

Every JSON text Octo reads goes through this module:

* ``parse_json`` parses with strict rules (no NaN/Infinity, no
  lone surrogates, no raw control characters, at most 128 open containers,
  numbers canonicalised by value) and returns native values.
* ``decode_struct`` turns a text into a msgspec ``Struct`` type, rejecting
  duplicate keys in every object except inside a payload ``value``.
* ``encode_struct`` and ``compact_json`` write the compact canonical form.

Decoding has two paths with one meaning. The fast path lets msgspec decode
and then re-encodes the result: when the re-encoding equals the input byte
for byte, the input was already canonical (no duplicate keys, no unknown
fields, canonical numbers) and the msgspec result is exactly what the strict
parser would produce. Anything else takes the strict path, which is the
definition. This module never raises anything but Octo errors for bad input.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from octo_common.errors import OctoError, SerializationError
from octo_common.limits import MAX_EXACT_INT, MAX_JSON_NESTING, MIN_EXACT_INT

T = TypeVar("T")

__all__ = [
    "compact_json",
    "decode_struct",
    "encode_struct",
    "parse_json",
    "register_custom_type",
]


class _Reject(Exception):
    """Internal: a strict-parse rule was broken (becomes the caller's error)."""


# Custom types (ToolPayload) -------------------------------------------------

_ENCODERS: dict[type, Callable[[Any], Any]] = {}
_DECODERS: dict[type, Callable[[Any], Any]] = {}


def register_custom_type(
    cls: type, encode: Callable[[Any], Any], decode: Callable[[Any], Any]
) -> None:
    """Teach the codec a non-Struct type (the payload module registers ToolPayload).

    ``encode(obj)`` returns a value msgspec can encode (usually ``msgspec.Raw``);
    ``decode(natural)`` builds the object from the decoded JSON value and raises
    ``ValueError``/``TypeError``/an Octo error when the shape is wrong.
    """
    _ENCODERS[cls] = encode
    _DECODERS[cls] = decode


def _enc_hook(obj: Any) -> Any:
    encoder = _ENCODERS.get(type(obj))
    if encoder is None:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    return encoder(obj)


def _dec_hook(type_: type, obj: Any) -> Any:
    decoder = _DECODERS.get(type_)
    if decoder is None:
        raise TypeError(f"cannot decode {type_!r}")
    return decoder(obj)


_ENCODER = msgspec.json.Encoder(enc_hook=_enc_hook, order="deterministic")
_VALUE_ENCODER = msgspec.json.Encoder(order="deterministic")
_DECODERS_BY_TYPE: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder_for(type_: Any) -> msgspec.json.Decoder[Any]:
    decoder = _DECODERS_BY_TYPE.get(type_)
    if decoder is None:
        decoder = msgspec.json.Decoder(type_, dec_hook=_dec_hook)
        _DECODERS_BY_TYPE[type_] = decoder
    return decoder


# Strict parsing -------------------------------------------------------------

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_STRUCTURAL = bytes(range(256)).translate(None, b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# One translation serves every fast-path check: digits become "0", container
# openers become "[", the minus sign stays "-", everything else a space.
_FAST_CHECK_TABLE = bytes(
    0x30 if 0x30 <= b <= 0x39 else 0x5B if b in (0x5B, 0x7B) else 0x2D if b == 0x2D else 0x20
    for b in range(256)
)
# An integer is kept exact only in [-2^63, 2^64-1]. Every integer outside that
# range has at least 20 digits, or is negative with 19 (-2^63-1 has 19), while
# msgspec keeps any integer exact: text holding such a run takes the strict path.
_LONG_DIGIT_RUN = b"0" * 20
_LONG_NEGATIVE_RUN = b"-" + b"0" * 19


def _nesting_exceeds(data: bytes, limit: int) -> bool:
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    structure = _STRING.sub(b"", data).translate(None, _STRUCTURAL)
    depth = 0
    for ch in structure:
        if ch in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _parse_int(lexeme: str) -> int | float:
    if lexeme == "-0":
        return -0.0
    if len(lexeme) <= 21:
        value = int(lexeme)
        if MIN_EXACT_INT <= value <= MAX_EXACT_INT:
            return value
    number = float(lexeme)
    if math.isinf(number):
        raise _Reject("number out of range")
    return number


def _parse_float(lexeme: str) -> float:
    number = float(lexeme)
    if math.isinf(number):
        raise _Reject("number out of range")
    return number


def _parse_constant(lexeme: str) -> Any:
    raise _Reject(f"{lexeme} is not JSON")


class _Parse:
    """One strict parse; remembers which objects repeated a key."""

    __slots__ = ("duplicated",)

    def __init__(self) -> None:
        self.duplicated: set[int] = set()

    def pairs(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            self.duplicated.add(id(obj))
        return obj

    def run(self, data: bytes | str) -> Any:
        if isinstance(data, str):
            try:
                raw = data.encode("utf-8")
            except UnicodeEncodeError:
                raise _Reject("text is not valid UTF-8") from None
        elif isinstance(data, bytes | bytearray | memoryview):
            raw = bytes(data)
        else:
            raise _Reject("JSON input must be bytes or str")
        if _nesting_exceeds(raw, MAX_JSON_NESTING):
            raise _Reject("more than 128 nested containers")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject("text is not valid UTF-8") from None
        try:
            value = json.loads(
                text,
                object_pairs_hook=self.pairs,
                parse_int=_parse_int,
                parse_float=_parse_float,
                parse_constant=_parse_constant,
            )
        except _Reject:
            raise
        except (ValueError, RecursionError) as exc:
            raise _Reject(f"malformed JSON ({type(exc).__name__})") from None
        if _SURROGATE_ESCAPE.search(raw) is not None:
            try:
                _VALUE_ENCODER.encode(value)
            except UnicodeEncodeError:
                raise _Reject("lone surrogate escape") from None
        return value


def parse_json(data: bytes | str) -> Any:
    """Parse any JSON value strictly; duplicate keys are last-wins.

    Returns native values: ``int`` for an integer kept exact (in [-2^63, 2^64-1]), ``float``
    for every other number, ``str``, ``bool``, ``None``, ``list``, ``dict``.
    Raises ``SerializationError`` for every violation.
    """
    try:
        return _Parse().run(data)
    except _Reject as exc:
        raise SerializationError(str(exc)) from None


# Canonical values -----------------------------------------------------------


def canonical_value(value: Any) -> Any:
    """Copy a Python JSON value into canonical form, or raise.

    Integers outside [-2^63, 2^64-1] become doubles; tuples become lists;
    keys must be strings; NaN and infinities, and anything that is not a
    JSON value, raise ``SerializationError``. Iterative, so depth is bounded
    by memory only (depth rules are checked elsewhere).
    """
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]
    while stack:
        item, parent, slot = stack.pop()
        kind = type(item)
        if item is None or kind is bool or kind is str:
            if kind is str:
                _check_text(item)
            parent[slot] = item
        elif kind is int:
            if MIN_EXACT_INT <= item <= MAX_EXACT_INT:
                parent[slot] = item
            else:
                try:
                    parent[slot] = float(item)
                except OverflowError:
                    raise SerializationError("number out of range") from None
        elif kind is float:
            if not math.isfinite(item):
                raise SerializationError("NaN and infinities are not JSON")
            parent[slot] = item
        elif isinstance(item, dict):
            out: dict[str, Any] = {}
            parent[slot] = out
            for key, child in item.items():
                if not isinstance(key, str):
                    raise SerializationError("object keys must be strings")
                _check_text(key)
                out[key] = None
                stack.append((child, out, key))
        elif isinstance(item, list | tuple):
            seq: list[Any] = [None] * len(item)
            parent[slot] = seq
            for index, child in enumerate(item):
                stack.append((child, seq, index))
        elif isinstance(item, bool):
            parent[slot] = bool(item)
        elif isinstance(item, int):
            stack.append((int(item), parent, slot))
        elif isinstance(item, float):
            stack.append((float(item), parent, slot))
        elif isinstance(item, str):
            stack.append((str(item), parent, slot))
        else:
            raise SerializationError(f"{kind.__name__} is not a JSON value")
    return root[0]


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SerializationError("lone surrogate in text") from None


def encode_value(value: Any) -> bytes:
    """Compact encoding of a canonical value (keys sorted, numbers in shortest round-trip form)."""
    try:
        return _VALUE_ENCODER.encode(value)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError, RecursionError) as exc:
        raise SerializationError(f"cannot encode value ({type(exc).__name__})") from None


def compact_json(value: Any) -> bytes:
    """The compact canonical encoding of a JSON value or an Octo struct."""
    if isinstance(value, msgspec.Struct) or type(value) in _ENCODERS:
        return encode_struct(value)
    return encode_value(canonical_value(value))


# Structs --------------------------------------------------------------------


def encode_struct(obj: Any) -> bytes:
    """Compact encoding: Struct fields in declaration order, payloads canonical."""
    try:
        return _ENCODER.encode(obj)
    except OctoError:
        raise
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError, RecursionError) as exc:
        raise SerializationError(f"cannot encode ({type(exc).__name__})") from None


def _fast_candidate(raw: bytes) -> bool:
    shape = raw.translate(_FAST_CHECK_TABLE)
    # Few openers means no deep nesting; no long digit run means every integer
    # lies inside the exact range.
    return (
        shape.count(b"[") <= MAX_JSON_NESTING
        and _LONG_DIGIT_RUN not in shape
        and _LONG_NEGATIVE_RUN not in shape
    )


def _reject_struct_duplicates(tree: Any, duplicated: set[int]) -> None:
    """Duplicate keys are errors in every object but a payload's ``value``."""
    if not duplicated:
        return
    stack: list[Any] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if id(node) in duplicated:
                raise _Reject("duplicate key in a struct")
            for key, child in node.items():
                if key == "payload" and isinstance(child, dict):
                    if id(child) in duplicated:
                        raise _Reject("duplicate key in a struct")
                    # A payload's value is a map: last-wins.
                    stack.extend(v for k, v in child.items() if k != "value")
                else:
                    stack.append(child)
        elif isinstance(node, list):
            stack.extend(node)


def decode_fast(raw: bytes, type_: Any) -> Any | None:
    """Fast path only: the decoded value when ``raw`` is canonical, else None."""
    if not _fast_candidate(raw):
        return None
    try:
        value = _decoder_for(type_).decode(raw)
        if encode_struct(value) != raw:
            return None
    except (msgspec.MsgspecError, OctoError, ValueError, TypeError, RecursionError):
        return None
    return value


def parse_tree(data: bytes | str, *, error: type[OctoError] = SerializationError) -> Any:
    """Strict parse for struct decoding: duplicate struct keys rejected."""
    parse = _Parse()
    try:
        tree = parse.run(data)
        _reject_struct_duplicates(tree, parse.duplicated)
    except _Reject as exc:
        raise error(str(exc)) from None
    return tree


def convert_tree(tree: Any, type_: Any, *, error: type[OctoError] = SerializationError) -> Any:
    """Convert a strictly parsed tree into ``type_`` (types, ranges, fields)."""
    try:
        return msgspec.convert(tree, type_, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OctoError) and error is SerializationError:
            raise SerializationError(str(cause)) from None
        raise error(_detail(exc)) from None
    except OctoError as exc:
        raise error(str(exc)) from None
    except (TypeError, ValueError) as exc:
        raise error(type(exc).__name__) from None


def _detail(exc: Exception) -> str:
    text = str(exc)
    # msgspec's message names the path (`$.field`) and the rule, never values
    # beyond enum spellings; still keep it short.
    return text[:200]


def decode_struct(
    data: bytes | str, type_: type[T], *, error: type[OctoError] = SerializationError
) -> T:
    """Strictly decode one JSON document into ``type_`` (a msgspec Struct).

    Duplicate keys are rejected in every object except a payload ``value``;
    unknown fields follow the Struct's ``forbid_unknown_fields``; missing
    fields, wrong types, booleans or floats for integers raise ``error``.
    """
    if isinstance(data, str):
        try:
            raw = data.encode("utf-8")
        except UnicodeEncodeError:
            raise error("text is not valid UTF-8") from None
    elif isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
    else:
        raise error("JSON input must be bytes or str")
    value = decode_fast(raw, type_)
    if value is not None:
        return value  # type: ignore[no-any-return]
    tree = parse_tree(raw, error=error)
    return convert_tree(tree, type_, error=error)  # type: ignore[no-any-return]
