"""The lean client's channel and connection logic, fed frames without a socket:
folded acks, confirms, returns, heartbeats, blocked state."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pamqp import body as pbody
from pamqp import commands
from pamqp import frame as pframe
from pamqp import header as pheader

from octo_common.runtime.amqp import ACKED, CLOSED, NACKED, AmqpDelivery, Channel, Properties
from octo_common.runtime.amqp.codec import FrameReader
from octo_common.runtime.amqp.connection import Connection


class FakeConnection:
    """What a channel calls on its connection, recorded."""

    frame_max = 131072

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.acking: set[Channel] = set()

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def ack_later(self, channel: Channel) -> None:
        self.acking.add(channel)

    def channel_closed(self, channel: Channel) -> None:
        """The connection's callback for a closed channel: this fake keeps nothing per channel."""

    def flush(self) -> list[Any]:
        """What one loop pass would write, decoded by pamqp."""
        out = list(self.sent)
        self.sent.clear()
        for channel in self.acking:
            channel.take_acks(out)
        self.acking.clear()
        reader = FrameReader()
        reader.feed(b"".join(out))
        return [pframe.unmarshal(_frame(k, c, p))[2] for k, c, p in reader.frames()]


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return (
        bytes([kind])
        + channel.to_bytes(2, "big")
        + len(payload).to_bytes(4, "big")
        + payload
        + b"\xce"
    )


def feed(channel: Channel, *values: Any) -> None:
    reader = FrameReader()
    reader.feed(b"".join(pframe.marshal(v, channel.number) for v in values))
    for kind, _, payload in reader.frames():
        channel.frame_received(kind, payload)


def deliver(channel: Channel, tag: int, consumer: str, body: bytes = b"b") -> None:
    feed(
        channel,
        commands.Basic.Deliver(
            consumer_tag=consumer, delivery_tag=tag, exchange="", routing_key="q"
        ),
        pheader.ContentHeader(0, len(body), commands.Basic.Properties(message_id=f"m{tag}")),
        pbody.ContentBody(body),
    )


async def consuming(count: int) -> tuple[FakeConnection, Channel, list[AmqpDelivery]]:
    fake = FakeConnection()
    channel = Channel(fake, 1)  # type: ignore[arg-type]
    got: list[AmqpDelivery] = []
    channel._consumers["c"] = got.append
    for tag in range(1, count + 1):
        deliver(channel, tag, "c")
    return fake, channel, got


def acks(frames: list[Any]) -> list[tuple[int, bool]]:
    return [(f.delivery_tag, f.multiple) for f in frames if isinstance(f, commands.Basic.Ack)]


async def test_a_leading_run_of_finished_deliveries_is_one_multiple_ack() -> None:
    fake, _, got = await consuming(5)
    assert [d.delivery_tag for d in got] == [1, 2, 3, 4, 5]
    for d in got[:3]:
        await d.ack()
    assert acks(fake.flush()) == [(3, True)]
    await got[4].ack()  # 4 is still being handled: 5 goes alone
    assert acks(fake.flush()) == [(5, False)]
    await got[3].ack()
    assert acks(fake.flush()) == [(4, False)]


async def test_no_ack_goes_past_a_delivery_still_being_handled() -> None:
    fake, _, got = await consuming(6)
    for i in (0, 1, 3, 4):  # 3 (tag 3) is still being handled
        await got[i].ack()
    frames = fake.flush()
    assert acks(frames) == [(2, True), (4, False), (5, False)]
    await got[2].ack()
    await got[5].ack()
    assert acks(fake.flush()) == [(6, True)]  # 3 and 6; 4 and 5 were acked already


async def test_rejects_and_nacks_go_alone_ahead_of_the_acks() -> None:
    fake, _, got = await consuming(4)
    await got[0].ack()
    await got[1].reject(requeue=False)
    await got[2].nack(requeue=True)
    await got[3].ack()
    frames = fake.flush()
    kinds = [type(f).__name__ for f in frames]
    assert kinds == ["Reject", "Nack", "Ack"]
    assert frames[1].multiple is False and frames[1].requeue is True
    assert frames[0].requeue is False
    assert acks(frames) == [(4, True)]  # 1 and 4: 2 and 3 were settled before it


async def test_a_delivery_settles_once_and_never_on_a_closed_channel() -> None:
    _, channel, got = await consuming(2)
    await got[0].ack()
    with pytest.raises(ValueError):
        await got[0].ack()
    with pytest.raises(ValueError):
        await got[0].nack(multiple=True)
    channel.closed_with(None)
    with pytest.raises(Exception, match="closed"):
        await got[1].ack()
    assert not got[1].settled


async def test_confirms_resolve_by_tag_and_a_return_by_message_id() -> None:
    fake = FakeConnection()
    channel = Channel(fake, 2)  # type: ignore[arg-type]
    channel.publisher_confirms = True
    futures = [channel.publish("", "q", b"x", Properties(message_id=f"m{i}")) for i in range(1, 6)]
    feed(
        channel,
        commands.Basic.Return(reply_code=312, reply_text="NO_ROUTE", exchange="", routing_key="q"),
        pheader.ContentHeader(0, 1, commands.Basic.Properties(message_id="m2")),
    )
    feed(channel, pbody.ContentBody(b"x"))
    feed(channel, commands.Basic.Ack(delivery_tag=3, multiple=True))
    feed(channel, commands.Basic.Nack(delivery_tag=4, multiple=False))
    results = [f.result() if f.done() else None for f in futures]
    assert results == [ACKED, 312, ACKED, NACKED, None]
    channel.closed_with(None)
    assert futures[4].result() == CLOSED


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_heartbeats_go_out_when_idle_and_a_silent_broker_ends_the_connection() -> None:
    loop = asyncio.get_running_loop()
    connection = Connection(loop)
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    transport.written.clear()
    connection._heartbeat = 1
    lost: list[Any] = []
    connection.close_callbacks.add(lost.append)
    connection._written_since_check = False
    connection._received_since_check = False
    connection._beat()  # half an interval, nothing written: a heartbeat
    await asyncio.sleep(0)
    assert transport.written == [b"\x08\x00\x00\x00\x00\x00\x00\xce"]
    for _ in range(3):  # two whole intervals without a byte from the broker
        connection._beat()
    assert connection.is_closed and transport.closed
    assert lost and "heartbeat" in str(lost[0])


async def test_a_blocked_connection_is_visible_until_unblocked() -> None:
    connection = Connection(asyncio.get_running_loop())
    connection.connection_made(FakeTransport())  # type: ignore[arg-type]
    connection._opened = True
    told: list[str | None] = []
    connection.blocked_callbacks.add(told.append)
    connection.data_received(pframe.marshal(commands.Connection.Blocked(reason="low on disk"), 0))
    assert connection.blocked == "low on disk"
    connection.data_received(pframe.marshal(commands.Connection.Unblocked(), 0))
    assert connection.blocked is None
    assert told == ["low on disk", None]


async def test_frames_of_one_pass_go_out_in_one_write() -> None:
    connection = Connection(asyncio.get_running_loop())
    transport = FakeTransport()
    connection.connection_made(transport)  # type: ignore[arg-type]
    before = connection.writes
    for _ in range(10):
        connection.send(b"x")
    await asyncio.sleep(0)
    assert connection.writes == before + 1
    assert transport.written[-1] == b"x" * 10


async def test_a_delivery_held_long_does_not_grow_the_channel_without_bound() -> None:
    fake, channel, got = await consuming(1)
    for tag in range(2, 2002):
        deliver(channel, tag, "c")
        await got[-1].ack()
        fake.flush()
    assert len(got) == 2001
    assert len(channel._order) < 200  # the held one and what piled up since the last pass
    await got[0].ack()
    assert acks(fake.flush()) == [(1, False)]
    assert not channel._unsettled


async def test_a_confirm_past_its_deadline_is_a_timeout_and_ends_nothing_when_it_comes() -> None:
    from octo_common.runtime.broker import publish_confirmed
    from octo_common.transport import PublishTimedOut

    fake = FakeConnection()
    channel = Channel(fake, 3)  # type: ignore[arg-type]
    channel.publisher_confirms = True
    with pytest.raises(PublishTimedOut):
        await publish_confirmed(
            channel,
            "",
            "q",
            b"{}",
            message_id="m-late",
            correlation_id=None,
            reply_to=None,
            headers={},
            timeout=0.05,
        )
    assert [type(f).__name__ for f in fake.flush()] == ["Publish", "ContentHeader", "ContentBody"]
    feed(channel, commands.Basic.Ack(delivery_tag=1, multiple=False))  # the late confirm
    assert not channel._unconfirmed and not channel.is_closed
