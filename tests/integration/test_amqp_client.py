"""The lean AMQP client (octo_common/runtime/amqp) on the real broker: confirms,
returns, deliveries and their settles, a passive declare of a missing queue,
a consumer cancelled by the broker, heartbeats, the connection's close, a
host name with several addresses."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
from pamqp import commands

from octo_common.runtime import amqp

pytestmark = pytest.mark.rabbitmq

URL = "amqp://guest:guest@127.0.0.1:5672/"
WAIT = 10.0


@pytest.fixture
async def connection() -> AsyncIterator[amqp.Connection]:
    link = await amqp.connect(URL, name="octo-test-lean", timeout=WAIT)
    yield link
    await link.close()


@pytest.fixture
async def queue(connection: amqp.Connection) -> AsyncIterator[str]:
    name = f"octo.test.lean.{uuid.uuid4().hex[:12]}"
    channel = await connection.channel()
    await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    yield name
    if not connection.is_closed:
        cleanup = await connection.channel()
        await cleanup.rpc(commands.Queue.Delete(queue=name), (commands.Queue.DeleteOk,))
        await cleanup.close()


def props(marker: str) -> amqp.Properties:
    return amqp.Properties(
        content_type="application/octo+json",
        delivery_mode=2,
        headers={"octo-scope": "s-1", "x-marker": marker, "n": 7},
        message_id=f"m-{marker}",
        correlation_id=f"c-{marker}",
        reply_to="octo.v5.reply.h-test",
    )


async def collect(
    connection: amqp.Connection, queue: str, prefetch: int = 16
) -> tuple[amqp.Channel, asyncio.Queue[amqp.AmqpDelivery], str]:
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=prefetch)
    got: asyncio.Queue[amqp.AmqpDelivery] = asyncio.Queue()
    tag = await channel.consume(queue, got.put_nowait)
    return channel, got, tag


async def test_a_confirmed_publish_arrives_with_its_properties(
    connection: amqp.Connection, queue: str
) -> None:
    publish = await connection.channel(publisher_confirms=True)
    assert await publish.publish("", queue, b"frame-1", props("1")) == amqp.ACKED
    _, got, _ = await collect(connection, queue)
    delivery = await asyncio.wait_for(got.get(), WAIT)
    assert delivery.body == b"frame-1"
    assert dict(delivery.headers) == {"octo-scope": "s-1", "x-marker": "1", "n": 7}
    assert (delivery.message_id, delivery.correlation_id, delivery.reply_to) == (
        "m-1",
        "c-1",
        "octo.v5.reply.h-test",
    )
    assert (delivery.content_type, delivery.delivery_mode) == ("application/octo+json", 2)
    assert delivery.routing_key == queue and not delivery.redelivered
    await delivery.ack()


async def test_an_unroutable_mandatory_publish_is_returned_and_a_missing_exchange_closes(
    connection: amqp.Connection,
) -> None:
    publish = await connection.channel(publisher_confirms=True)
    missing = f"octo.test.none.{uuid.uuid4().hex[:8]}"
    assert await publish.publish("", missing, b"x", props("r")) == 312
    assert await publish.publish(missing, "k", b"x", props("e")) == amqp.CLOSED
    assert publish.is_closed
    assert isinstance(publish.close_reason, amqp.ChannelClosed)
    assert publish.close_reason.reply_code == 404
    with pytest.raises(amqp.ChannelClosed):
        publish.publish("", missing, b"x", props("after"))


async def test_a_large_body_goes_in_several_frames_and_arrives_whole(
    connection: amqp.Connection, queue: str
) -> None:
    body = bytes(range(256)) * 2048  # 512 KiB, past one frame
    publish = await connection.channel(publisher_confirms=True)
    assert await publish.publish("", queue, body, props("big")) == amqp.ACKED
    _, got, _ = await collect(connection, queue)
    delivery = await asyncio.wait_for(got.get(), WAIT)
    assert delivery.body == body
    await delivery.ack()


async def test_acks_rejects_and_nacks_settle_exactly_their_deliveries(
    connection: amqp.Connection, queue: str
) -> None:
    publish = await connection.channel(publisher_confirms=True)
    confirms = [publish.publish("", queue, f"{i}".encode(), props(str(i))) for i in range(6)]
    assert await asyncio.gather(*confirms) == [amqp.ACKED] * 6
    consume, got, _ = await collect(connection, queue)
    first = [await asyncio.wait_for(got.get(), WAIT) for _ in range(6)]
    # 0, 1, 2 acked (one folded ack), 3 still handled, 4 nacked back, 5 acked alone.
    for d in first[:3]:
        await d.ack()
    await first[4].nack(requeue=True)
    await first[5].ack()
    again = await asyncio.wait_for(got.get(), WAIT)
    assert again.body == b"4" and again.redelivered
    await again.reject(requeue=False)  # gone (no dead-letter exchange on this queue)
    await consume.close()  # 3 was never settled: the broker puts it back
    _, got2, _ = await collect(connection, queue)
    back = await asyncio.wait_for(got2.get(), WAIT)
    assert back.body == b"3" and back.redelivered
    await back.ack()
    await asyncio.sleep(0.3)
    check = await connection.channel()
    state = await check.declare_queue(queue, passive=True)
    assert state.message_count == 0


async def test_a_missing_queue_closes_the_channel_with_404(connection: amqp.Connection) -> None:
    channel = await connection.channel()
    with pytest.raises(amqp.ChannelClosed) as closed:
        await channel.declare_queue(f"octo.test.none.{uuid.uuid4().hex[:8]}", passive=True)
    assert closed.value.reply_code == 404
    assert channel.is_closed and not connection.is_closed


async def test_the_broker_cancels_the_consumer_of_a_deleted_queue(
    connection: amqp.Connection, queue: str
) -> None:
    channel, _, tag = await collect(connection, queue)
    cancelled: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    channel.on_consumer_cancel_callbacks.add(cancelled.set_result)
    other = await connection.channel()
    await other.rpc(commands.Queue.Delete(queue=queue), (commands.Queue.DeleteOk,))
    assert await asyncio.wait_for(cancelled, WAIT) == tag
    assert not channel.is_closed


async def test_an_idle_connection_with_heartbeats_stays_open() -> None:
    link = await amqp.connect(URL, name="octo-test-heartbeat", heartbeat=1, timeout=WAIT)
    try:
        await asyncio.sleep(3.5)  # the broker closes a peer silent for two intervals
        assert not link.is_closed
        channel = await link.channel()
        await channel.close()
    finally:
        await link.close()


async def test_close_ends_every_channel_and_calls_back_once(connection: amqp.Connection) -> None:
    channel = await connection.channel(publisher_confirms=True)
    seen: list[object] = []
    connection.close_callbacks.add(seen.append)
    channel.close_callbacks.add(seen.append)
    await connection.close()
    assert connection.is_closed and channel.is_closed
    assert len(seen) == 2
    with pytest.raises(amqp.ConnectionClosed):
        await connection.channel()


async def test_bad_credentials_and_urls_fail_without_naming_them() -> None:
    with pytest.raises(Exception) as refused:
        await amqp.connect("amqp://guest:wrong-secret@127.0.0.1:5672/", timeout=WAIT)
    assert "wrong-secret" not in str(refused.value)
    with pytest.raises(ValueError) as bad:
        await amqp.connect("amqp://guest:secret@127.0.0.1:5672/?heartbeat=5")
    assert "secret" not in str(bad.value)


async def test_publish_confirmed_on_the_lean_client_raises_each_failure(
    connection: amqp.Connection, queue: str
) -> None:
    from octo_common.runtime.broker import publish_confirmed
    from octo_common.transport import PublishChannelClosed, PublishReturned

    channel = await connection.channel(publisher_confirms=True)

    async def publish(exchange: str, key: str, message_id: str, timeout: float = WAIT) -> None:
        await publish_confirmed(
            channel,
            exchange,
            key,
            b"{}",
            message_id=message_id,
            correlation_id="c",
            reply_to=None,
            headers={"octo-scope": "s"},
            timeout=timeout,
        )

    await publish("", queue, "m-ok")
    with pytest.raises(PublishReturned) as returned:
        await publish("", f"{queue}.nobody", "m-returned")
    assert returned.value.reply_code == 312
    await publish("", queue, "m-after")
    with pytest.raises(PublishChannelClosed):
        await publish(f"octo.test.none.{uuid.uuid4().hex[:8]}", "k", "m-closed")
    with pytest.raises(PublishChannelClosed):
        await publish("", queue, "m-dead")
    check = await connection.channel()
    state = await check.declare_queue(queue, passive=True)
    assert state.message_count == 2  # ok and after


async def test_a_name_with_several_addresses_skips_one_that_never_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cluster's name resolving to a node that accepts TCP but never speaks AMQP
    (cut off, or paused without closing its listener) and then a live one: the
    first costs one timeout, the connection is made to the second (a single
    timeout over every address left the client on the silent one for good)."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the TCP handshake; nobody ever answers
    addresses = [silent.getsockname(), ("127.0.0.1", 5672)]
    real = socket.getaddrinfo

    def resolve(host: str, port: object, *args: object, **kwargs: object) -> list[object]:
        if host != "octo-nodes.test":
            return real(host, port, *args, **kwargs)  # type: ignore[arg-type]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", a) for a in addresses]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    try:
        link = await amqp.connect(
            "amqp://guest:guest@octo-nodes.test:5672/", name="octo-test-nodes", timeout=1.0
        )
        try:
            channel = await link.channel()
            await channel.close()
        finally:
            await link.close()
        with pytest.raises(TimeoutError):
            addresses.pop()  # the silent node alone: one timeout, then the failure
            await amqp.connect("amqp://octo-nodes.test:5672/", timeout=0.5)
    finally:
        silent.close()
