"""The hot-frame codec against pamqp, byte for byte, both ways."""

from __future__ import annotations

import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader

from octo_common.runtime.amqp import codec
from octo_common.runtime.amqp.codec import FrameError, FrameReader, Properties

OCTO_HEADERS = {
    "octo-protocol": "octo.v5",
    "octo-scope": "tenant-a",
    "octo-session": "s" * 43,
    "octo-key-nonce": "n" * 22,
}


def pamqp_props(**values: object) -> commands.Basic.Properties:
    return commands.Basic.Properties(**values)  # type: ignore[arg-type]


def octo_props(**values: object) -> Properties:
    return Properties(**values)


def marshal(value: object, channel: int) -> bytes:
    return pframe.marshal(value, channel)  # type: ignore[arg-type]


PROPERTY_CASES = [
    {},
    {
        "content_type": "application/octo+json",
        "delivery_mode": 2,
        "headers": OCTO_HEADERS,
        "message_id": "m" * 43,
        "correlation_id": "r-1",
        "reply_to": "octo.v5.reply.host-a",
    },
    {"headers": {}, "content_type": "", "message_id": "x"},
    {"headers": {"n": 1, "big": 70000, "neg": -5, "huge": 2**40, "u": 40000, "t": True}},
    {"headers": {"f": False, "v": None, "bin": bytearray(b"\x00\xff")}},
    {"priority": 3, "expiration": "60000", "message_type": "t", "user_id": "guest", "app_id": "a"},
    {"headers": {"nested": {"a": 1}, "list": [1, "x"], "float": 1.5}},  # pamqp's own path
]


@pytest.mark.parametrize("values", PROPERTY_CASES)
def test_a_publish_is_what_pamqp_marshals(values: dict[str, object]) -> None:
    body = b'{"frame": 1}' * 5
    ours = codec.encode_publish(
        7,
        "octo.v5",
        "octo.v5.worker.tenant-a",
        body,
        octo_props(**values),
        mandatory=True,
        frame_max=131072,
    )
    theirs = (
        marshal(
            commands.Basic.Publish(
                exchange="octo.v5", routing_key="octo.v5.worker.tenant-a", mandatory=True
            ),
            7,
        )
        + marshal(pheader.ContentHeader(0, len(body), pamqp_props(**values)), 7)
        + marshal(pbody.ContentBody(body), 7)
    )
    assert ours == theirs


def test_a_body_past_the_frame_size_is_split_as_pamqp_frames_it() -> None:
    body = bytes(range(256)) * 40
    ours = codec.encode_publish(1, "", "q", body, Properties(), mandatory=False, frame_max=4096)
    chunks = [body[i : i + 4088] for i in range(0, len(body), 4088)]
    theirs = (
        marshal(commands.Basic.Publish(exchange="", routing_key="q", mandatory=False), 1)
        + marshal(pheader.ContentHeader(0, len(body), pamqp_props()), 1)
        + b"".join(marshal(pbody.ContentBody(c), 1) for c in chunks)
    )
    assert ours == theirs
    assert len(chunks) == 3


def test_an_empty_body_has_no_body_frame() -> None:
    ours = codec.encode_publish(1, "", "q", b"", Properties(), mandatory=True, frame_max=4096)
    theirs = marshal(
        commands.Basic.Publish(exchange="", routing_key="q", mandatory=True), 1
    ) + marshal(pheader.ContentHeader(0, 0, pamqp_props()), 1)
    assert ours == theirs


@pytest.mark.parametrize("tag", [1, 255, 2**40])
def test_settles_are_what_pamqp_marshals(tag: int) -> None:
    for multiple in (False, True):
        assert codec.encode_ack(3, tag, multiple=multiple) == marshal(
            commands.Basic.Ack(delivery_tag=tag, multiple=multiple), 3
        )
        for requeue in (False, True):
            assert codec.encode_nack(3, tag, multiple=multiple, requeue=requeue) == marshal(
                commands.Basic.Nack(delivery_tag=tag, multiple=multiple, requeue=requeue), 3
            )
    for requeue in (False, True):
        assert codec.encode_reject(3, tag, requeue=requeue) == marshal(
            commands.Basic.Reject(delivery_tag=tag, requeue=requeue), 3
        )


def payload_of(frame: bytes) -> bytes:
    reader = FrameReader()
    reader.feed(frame)
    [(_, _, payload)] = reader.frames()
    return payload


@pytest.mark.parametrize("redelivered", [False, True])
def test_a_deliver_reads_as_pamqp_wrote_it(redelivered: bool) -> None:
    frame = marshal(
        commands.Basic.Deliver(
            consumer_tag="ctag-1.é",
            delivery_tag=2**33 + 5,
            redelivered=redelivered,
            exchange="octo.v5",
            routing_key="octo.v5.reply.h",
        ),
        2,
    )
    assert codec.decode_deliver(payload_of(frame)) == (
        "ctag-1.é",
        2**33 + 5,
        redelivered,
        "octo.v5",
        "octo.v5.reply.h",
    )


def test_confirms_and_returns_read_as_pamqp_wrote_them() -> None:
    ack = marshal(commands.Basic.Ack(delivery_tag=9, multiple=True), 1)
    nack = marshal(commands.Basic.Nack(delivery_tag=10, multiple=False, requeue=True), 1)
    assert codec.decode_confirm(payload_of(ack)) == (9, True)
    assert codec.decode_confirm(payload_of(nack)) == (10, False)
    returned = marshal(
        commands.Basic.Return(
            reply_code=312, reply_text="NO_ROUTE", exchange="octo.v5", routing_key="k"
        ),
        1,
    )
    assert codec.decode_return(payload_of(returned)) == (312, "NO_ROUTE", "octo.v5", "k")


@pytest.mark.parametrize("values", PROPERTY_CASES)
def test_a_content_header_reads_as_pamqp_reads_it(values: dict[str, object]) -> None:
    frame = marshal(pheader.ContentHeader(0, 1234, pamqp_props(**values)), 1)
    size, props = codec.decode_header(payload_of(frame))
    expected = pamqp_props(**values)
    assert size == 1234
    for name in Properties.__slots__:
        assert getattr(props, name) == getattr(expected, name) or (
            getattr(expected, name) == "" and getattr(props, name) is None
        ), name


def test_a_timestamp_property_goes_through_pamqp() -> None:
    stamp = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    frame = marshal(pheader.ContentHeader(0, 1, pamqp_props(timestamp=stamp, message_id="m")), 1)
    _, props = codec.decode_header(payload_of(frame))
    assert props.timestamp == stamp
    assert props.message_id == "m"
    assert codec.encode_header(1, 1, octo_props(timestamp=stamp, message_id="m")) == frame


def test_a_long_string_that_is_not_utf8_stays_bytes_as_in_pamqp() -> None:
    raw = b"\x00\x00\x00\x08" + b"\x01k" + b"S\x00\x00\x00\x01\xff"
    ours, end = codec.decode_table(raw, 0)
    assert ours == {"k": b"\xff"}
    assert end == len(raw)


def test_a_table_value_pamqp_cannot_encode_fails_the_same_way() -> None:
    with pytest.raises(TypeError):
        codec.encode_table({"b": b"bytes are not a field value"})
    with pytest.raises(TypeError):
        commands.Basic.Properties(headers={"b": b"x"}).marshal()  # type: ignore[dict-item]


table_values = st.one_of(
    st.text(max_size=40),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(max_size=20).map(bytearray),
    st.none(),
)
tables = st.dictionaries(st.text(min_size=1, max_size=20), table_values, max_size=8)


@given(tables)
def test_tables_round_trip_byte_for_byte_with_pamqp(table: dict[str, object]) -> None:
    from pamqp import decode, encode

    ours = codec.encode_table(table)
    assert ours == encode.field_table(table)  # type: ignore[arg-type]
    decoded, end = codec.decode_table(ours, 0)
    assert end == len(ours)
    assert decoded == decode.field_table(ours)[1]


def test_the_reader_cuts_frames_across_feeds_and_refuses_a_bad_end() -> None:
    one = codec.encode_ack(1, 5)
    two = codec.HEARTBEAT_FRAME
    stream = one + two
    reader = FrameReader()
    reader.feed(stream[:10])
    assert reader.frames() == []
    reader.feed(stream[10:])
    frames = reader.frames()
    assert [(k, c) for k, c, _ in frames] == [(1, 1), (8, 0)]
    assert reader.frames() == []
    bad = FrameReader()
    bad.feed(one[:-1] + b"\x00")
    with pytest.raises(FrameError):
        bad.frames()
