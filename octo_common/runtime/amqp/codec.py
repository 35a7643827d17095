"""The AMQP 0-9-1 frames of the hot path, packed and unpacked with ``struct``.

Owns the byte layout of what Octo sends and receives per message: a
``basic.publish`` with its content header and body frames, the client's
``basic.ack`` / ``basic.nack`` / ``basic.reject``, and the broker's
``basic.deliver``, ``basic.ack`` / ``basic.nack`` (confirms),
``basic.return`` and content headers; the field tables of the headers
property (:func:`encode_table`, :func:`decode_table`); and
:class:`FrameReader`, which cuts a received byte stream into frames.

Every encoding is byte for byte what pamqp produces for the same values
(tests/unit/test_amqp_codec.py compares them); anything unusual (a table
value type beyond strings, integers, booleans, byte arrays and void, a
timestamp or cluster-id property, a key longer than 128 bytes) goes through
pamqp itself. Pure: no I/O.

It must never accept a frame whose end octet is wrong, or decode a table
differently from pamqp (a long string that is not UTF-8 stays ``bytes``).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

from pamqp import commands as _commands
from pamqp import decode as _decode
from pamqp import encode as _encode
from pamqp import header as _header

__all__ = [
    "FRAME_BODY",
    "FRAME_END",
    "FRAME_HEADER",
    "FRAME_HEARTBEAT",
    "FRAME_METHOD",
    "HEARTBEAT_FRAME",
    "FrameError",
    "FrameReader",
    "Properties",
    "decode_confirm",
    "decode_deliver",
    "decode_header",
    "decode_return",
    "decode_table",
    "encode_ack",
    "encode_header",
    "encode_nack",
    "encode_properties",
    "encode_publish",
    "encode_reject",
    "encode_table",
]

FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
HEARTBEAT_FRAME: Final = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_BASIC: Final = 60
_FRAME_HEAD = struct.Struct(">BHI")
_METHOD_HEAD = struct.Struct(">BHIHH")  # frame head, then class and method ids
_TAG_BITS = struct.Struct(">QB")
_HEADER_HEAD = struct.Struct(">BHIHHQH")  # frame head, class, weight, body size, flags
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_U64 = struct.Struct(">Q")
_DELIVER_TAGS = struct.Struct(">QB")


class FrameError(ValueError):
    """A frame that breaks the AMQP framing (wrong end octet, truncated field)."""


# Properties ----------------------------------------------------------------------------

# (name, flag, kind) in AMQP order; kind: s shortstr, t table, o octet, q timestamp.
_PROPERTIES: Final = (
    ("content_type", 0x8000, "s"),
    ("content_encoding", 0x4000, "s"),
    ("headers", 0x2000, "t"),
    ("delivery_mode", 0x1000, "o"),
    ("priority", 0x0800, "o"),
    ("correlation_id", 0x0400, "s"),
    ("reply_to", 0x0200, "s"),
    ("expiration", 0x0100, "s"),
    ("message_id", 0x0080, "s"),
    ("timestamp", 0x0040, "q"),
    ("message_type", 0x0020, "s"),
    ("user_id", 0x0010, "s"),
    ("app_id", 0x0008, "s"),
    ("cluster_id", 0x0004, "s"),
)
_UNUSUAL_FLAGS: Final = 0x0040 | 0x0004 | 0x0001  # timestamp, cluster id, more flag words


class Properties:
    """The basic-class properties of one message, named as pamqp names them;
    None where absent."""

    __slots__ = tuple(name for name, _, _ in _PROPERTIES)

    content_type: str | None
    content_encoding: str | None
    headers: dict[str, Any] | None
    delivery_mode: int | None
    priority: int | None
    correlation_id: str | None
    reply_to: str | None
    expiration: str | None
    message_id: str | None
    timestamp: Any
    message_type: str | None
    user_id: str | None
    app_id: str | None
    cluster_id: str | None

    def __init__(self, **values: Any) -> None:
        for name, _, _ in _PROPERTIES:
            setattr(self, name, values.pop(name, None))
        if values:
            raise TypeError(f"unknown properties: {sorted(values)}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Properties):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n, _, _ in _PROPERTIES)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{n}={getattr(self, n)!r}" for n, _, _ in _PROPERTIES if getattr(self, n) is not None
        )
        return f"Properties({shown})"


def _pack_shortstr(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 255:
        raise TypeError("string exceeds maximum length of 255 bytes")
    return _U8.pack(len(raw)) + raw


def encode_properties(properties: Properties) -> bytes:
    """The property flags and list of a content header, as pamqp marshals them
    (a property that is None or ``''`` is absent)."""
    flags = 0
    parts: list[bytes] = []
    for name, flag, kind in _PROPERTIES:
        value = getattr(properties, name)
        if value is None or (isinstance(value, str) and value == ""):
            continue
        if kind == "s":
            parts.append(_pack_shortstr(value))
        elif kind == "t":
            parts.append(encode_table(value))
        elif kind == "o":
            parts.append(_U8.pack(value))
        else:
            parts.append(_encode.timestamp(value))
        flags |= flag
    return _U16.pack(flags) + b"".join(parts)


def _to_pamqp(properties: Properties) -> _commands.Basic.Properties:
    values = {n: getattr(properties, n) for n, _, _ in _PROPERTIES}
    return _commands.Basic.Properties(**values)


def _from_pamqp(properties: _commands.Basic.Properties) -> Properties:
    return Properties(**{n: getattr(properties, n) for n, _, _ in _PROPERTIES})


# Field tables ---------------------------------------------------------------------------


def _table_integer(value: int) -> bytes:
    if -128 <= value <= 127:
        return b"b" + _I8.pack(value)
    if -32768 <= value <= 32767:
        return b"s" + _I16.pack(value)
    if 0 <= value <= 65535:
        return b"u" + _U16.pack(value)
    if -2147483648 <= value <= 2147483647:
        return b"I" + _I32.pack(value)
    if 0 <= value <= 4294967295:
        return b"i" + _U32.pack(value)
    if -9223372036854775808 <= value <= 9223372036854775807:
        return b"l" + _I64.pack(value)
    raise TypeError(f"Unsupported numeric value: {value}")


def encode_table(table: Mapping[str, Any] | None) -> bytes:
    """A field table as pamqp encodes it (keys sorted); pamqp itself for any
    value type but ``str``, ``bool``, ``int``, ``bytearray`` and None."""
    if not table:
        return b"\x00\x00\x00\x00"
    if _encode.DEPRECATED_RABBITMQ_SUPPORT:
        return _encode.field_table(dict(table))
    parts: list[bytes] = []
    for key, value in sorted(table.items()):
        raw_key = key.encode("utf-8")
        if len(raw_key) > 128:
            return _encode.field_table(dict(table))
        parts.append(_U8.pack(len(raw_key)))
        parts.append(raw_key)
        kind = type(value)
        if kind is str:
            raw = value.encode("utf-8")
            parts.append(b"S" + _U32.pack(len(raw)))
            parts.append(raw)
        elif kind is bool:
            parts.append(b"t\x01" if value else b"t\x00")
        elif kind is int:
            parts.append(_table_integer(value))
        elif kind is bytearray:
            parts.append(b"x" + _U32.pack(len(value)))
            parts.append(bytes(value))
        elif value is None:
            parts.append(b"V")
        else:
            return _encode.field_table(dict(table))
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


_SIMPLE_INTEGERS: Final = {
    0x62: (_I8, 1),  # b
    0x42: (_U8, 1),  # B
    0x73: (_I16, 2),  # s
    0x75: (_U16, 2),  # u
    0x49: (_I32, 4),  # I
    0x69: (_U32, 4),  # i
    0x6C: (_I64, 8),  # l
    0x4C: (_I64, 8),  # L (pamqp reads it signed)
}


def decode_table(data: bytes, offset: int) -> tuple[dict[str, Any], int]:
    """The field table at ``offset``; returns it and the offset after it.

    Decodes as pamqp does (a long string that is not UTF-8 is ``bytes``, a
    byte array a ``bytearray``); pamqp itself for any other value type."""
    try:
        (length,) = _U32.unpack_from(data, offset)
    except struct.error:
        raise FrameError("truncated field table") from None
    start = offset + 4
    end = start + length
    if end > len(data):
        raise FrameError("field table length exceeds the frame")
    table: dict[str, Any] = {}
    pos = start
    try:
        while pos < end:
            key_length = data[pos]
            pos += 1
            key = data[pos : pos + key_length].decode("utf-8")
            pos += key_length
            kind = data[pos]
            pos += 1
            if kind == 0x53:  # S
                (size,) = _U32.unpack_from(data, pos)
                raw = data[pos + 4 : pos + 4 + size]
                pos += 4 + size
                try:
                    table[key] = raw.decode("utf-8")
                except UnicodeDecodeError:
                    table[key] = bytes(raw)
            elif kind == 0x74:  # t
                table[key] = bool(data[pos])
                pos += 1
            elif kind in _SIMPLE_INTEGERS:
                packer, size = _SIMPLE_INTEGERS[kind]
                (table[key],) = packer.unpack_from(data, pos)
                pos += size
            elif kind == 0x78:  # x
                (size,) = _U32.unpack_from(data, pos)
                table[key] = bytearray(data[pos + 4 : pos + 4 + size])
                pos += 4 + size
            elif kind in (0x56, 0x00):  # V, and the undocumented NUL pamqp accepts
                table[key] = None
            else:
                return _pamqp_table(data, offset, end)
    except (IndexError, struct.error, UnicodeDecodeError):
        raise FrameError("malformed field table") from None
    if pos != end:
        raise FrameError("field table overruns its length")
    return table, end


def _pamqp_table(data: bytes, offset: int, end: int) -> tuple[dict[str, Any], int]:
    try:
        _, table = _decode.field_table(bytes(data[offset:end]))
    except ValueError as error:
        raise FrameError(f"malformed field table ({error})") from None
    return dict(table), end


def _shortstr(data: bytes, pos: int) -> tuple[str, int]:
    size = data[pos]
    end = pos + 1 + size
    if end > len(data):
        raise FrameError("truncated short string")
    return data[pos + 1 : end].decode("utf-8"), end


# Outbound frames ------------------------------------------------------------------------


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return _FRAME_HEAD.pack(kind, channel, len(payload)) + payload + b"\xce"


def encode_header(channel: int, body_size: int, properties: Properties) -> bytes:
    """A content header frame of the basic class."""
    flags_and_list = encode_properties(properties)
    payload = _U16.pack(_BASIC) + b"\x00\x00" + _U64.pack(body_size) + flags_and_list
    return _frame(FRAME_HEADER, channel, payload)


def encode_publish(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: Properties,
    *,
    mandatory: bool,
    frame_max: int,
) -> bytes:
    """``basic.publish``, its content header and its body frames (each at most
    ``frame_max`` bytes with framing), as one bytes object."""
    method = (
        b"\x00\x3c\x00\x28\x00\x00"
        + _pack_shortstr(exchange)
        + _pack_shortstr(routing_key)
        + (b"\x01" if mandatory else b"\x00")
    )
    parts = [_frame(FRAME_METHOD, channel, method), encode_header(channel, len(body), properties)]
    chunk = frame_max - 8
    if len(body) <= chunk:
        if body:
            parts.append(_frame(FRAME_BODY, channel, body))
    else:
        view = memoryview(body)
        for start in range(0, len(body), chunk):
            parts.append(_frame(FRAME_BODY, channel, bytes(view[start : start + chunk])))
    return b"".join(parts)


def _settle(channel: int, method: int, tag: int, bits: int) -> bytes:
    return (
        _METHOD_HEAD.pack(FRAME_METHOD, channel, 13, _BASIC, method)
        + _TAG_BITS.pack(tag, bits)
        + b"\xce"
    )


def encode_ack(channel: int, delivery_tag: int, *, multiple: bool = False) -> bytes:
    """``basic.ack`` of one delivery, or of every one up to it with ``multiple``."""
    return _settle(channel, 80, delivery_tag, 1 if multiple else 0)


def encode_reject(channel: int, delivery_tag: int, *, requeue: bool) -> bytes:
    """``basic.reject`` of one delivery."""
    return _settle(channel, 90, delivery_tag, 1 if requeue else 0)


def encode_nack(channel: int, delivery_tag: int, *, multiple: bool = False, requeue: bool) -> bytes:
    """``basic.nack`` (bit 0 multiple, bit 1 requeue)."""
    return _settle(channel, 120, delivery_tag, (1 if multiple else 0) | (2 if requeue else 0))


# Inbound frames -------------------------------------------------------------------------


def decode_deliver(payload: bytes) -> tuple[str, int, bool, str, str]:
    """``basic.deliver`` (after its class and method ids): consumer tag,
    delivery tag, redelivered, exchange, routing key."""
    try:
        consumer_tag, pos = _shortstr(payload, 4)
        tag, redelivered = _DELIVER_TAGS.unpack_from(payload, pos)
        exchange, pos = _shortstr(payload, pos + 9)
        routing_key, pos = _shortstr(payload, pos)
    except (IndexError, struct.error, UnicodeDecodeError):
        raise FrameError("malformed basic.deliver") from None
    return consumer_tag, tag, bool(redelivered & 1), exchange, routing_key


def decode_confirm(payload: bytes) -> tuple[int, bool]:
    """The broker's ``basic.ack`` or ``basic.nack``: delivery tag, multiple."""
    try:
        tag, bits = _TAG_BITS.unpack_from(payload, 4)
    except struct.error:
        raise FrameError("malformed confirm") from None
    return tag, bool(bits & 1)


def decode_return(payload: bytes) -> tuple[int, str, str, str]:
    """``basic.return``: reply code, reply text, exchange, routing key."""
    try:
        (code,) = _U16.unpack_from(payload, 4)
        text, pos = _shortstr(payload, 6)
        exchange, pos = _shortstr(payload, pos)
        routing_key, pos = _shortstr(payload, pos)
    except (IndexError, struct.error, UnicodeDecodeError):
        raise FrameError("malformed basic.return") from None
    return code, text, exchange, routing_key


def decode_header(payload: bytes) -> tuple[int, Properties]:
    """A content header frame's payload: the body size and the properties."""
    try:
        _, _, body_size, flags = struct.unpack_from(">HHQH", payload, 0)
    except struct.error:
        raise FrameError("truncated content header") from None
    if flags & _UNUSUAL_FLAGS:
        content = _header.ContentHeader()
        try:
            content.unmarshal(bytes(payload))
        except (struct.error, ValueError) as error:
            raise FrameError(f"malformed content header ({error})") from None
        return content.body_size, _from_pamqp(content.properties)
    properties = Properties()
    pos = 14
    try:
        for name, flag, kind in _PROPERTIES:
            if not flags & flag:
                continue
            if kind == "s":
                value, pos = _shortstr(payload, pos)
                setattr(properties, name, value)
            elif kind == "t":
                table, pos = decode_table(payload, pos)
                setattr(properties, name, table)
            else:  # octet
                setattr(properties, name, payload[pos])
                pos += 1
    except (IndexError, UnicodeDecodeError):
        raise FrameError("malformed content header") from None
    return body_size, properties


class FrameReader:
    """Cuts a byte stream into frames: ``feed`` bytes, then take ``(kind,
    channel, payload)`` triples from ``frames`` until it yields none."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def frames(self) -> list[tuple[int, int, bytes]]:
        """Every complete frame received so far, in order; raises :class:`FrameError`
        on a frame whose end octet is not 0xCE."""
        buffer = self._buffer
        pos = 0
        size = len(buffer)
        out: list[tuple[int, int, bytes]] = []
        while size - pos >= 8:
            kind, channel, length = _FRAME_HEAD.unpack_from(buffer, pos)
            end = pos + 7 + length
            if end >= size:
                break
            if buffer[end] != FRAME_END:
                raise FrameError("frame end octet missing")
            out.append((kind, channel, bytes(buffer[pos + 7 : end])))
            pos = end + 1
        if pos:
            del buffer[:pos]
        return out
