"""Manual-ack consumption at the channel level (runtime/consumer.py), on the real broker.

A delivery arrives as a ``Received`` with the body and properties the
publisher sent (the same values an aio-pika message shows), is settled once
on its own channel (ack removes it, reject or nack with requeue redelivers
it, reject without requeue dead-letters it), and a second settle raises.
"""

from __future__ import annotations

import asyncio

import aio_pika  # noqa: F401
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractQueue
from aio_pika.exceptions import MessageProcessError

from octo_common.runtime.broker import publish_confirmed
from octo_common.runtime.consumer import Received, consume_queue
from octo_common.transport import CONTENT_TYPE, DELIVERY_MODE_PERSISTENT

from .test_runtime_broker import Source, source  # noqa: F401  (the fixture)

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def consumed(source: Source) -> Source:  # noqa: F811  (the imported fixture)
    """A private queue whose rejected deliveries go to a private ``rejected`` queue."""
    return source


WAIT = 5.0


async def _publish(channel: AbstractChannel, queue: AbstractQueue, marker: str) -> None:
    await publish_confirmed(
        channel,
        "",
        queue.name,
        b"frame-" + marker.encode(),
        message_id=f"m-{marker}",
        correlation_id=f"c-{marker}",
        reply_to="octo.v5.reply.h-test",
        headers={"octo-scope": "s-1", "x-test-marker": marker},
        timeout=WAIT,
    )


async def _consume(queue: AbstractQueue) -> tuple[asyncio.Queue[Received], str]:
    got: asyncio.Queue[Received] = asyncio.Queue()
    tag = await consume_queue(queue, got.put_nowait)
    return got, tag


async def _first(
    channel: AbstractChannel, queue: AbstractQueue, marker: str
) -> tuple[asyncio.Queue[Received], str, Received]:
    """Consume ``queue``, publish one frame to it and wait for its delivery."""
    got, tag = await _consume(queue)
    await _publish(channel, queue, marker)
    return got, tag, await asyncio.wait_for(got.get(), WAIT)


async def test_a_delivery_carries_what_was_published(
    channel: AbstractChannel, consumed: Source
) -> None:
    queue = consumed.queue
    _, tag, message = await _first(channel, queue, "props")
    assert (message.body, message.message_id, message.correlation_id, message.reply_to) == (
        b"frame-props",
        "m-props",
        "c-props",
        "octo.v5.reply.h-test",
    )
    assert dict(message.headers) == {"octo-scope": "s-1", "x-test-marker": "props"}
    assert (message.content_type, message.delivery_mode) == (CONTENT_TYPE, DELIVERY_MODE_PERSISTENT)
    assert message.routing_key == queue.name and not message.redelivered
    assert not message.settled
    await message.ack()
    assert message.settled
    await queue.cancel(tag)


async def test_ack_removes_the_delivery_and_a_second_settle_raises(
    channel: AbstractChannel, consumed: Source
) -> None:
    queue, rejected = consumed.queue, consumed.rejected
    _, tag, message = await _first(channel, queue, "ack")
    await message.ack()
    with pytest.raises(MessageProcessError):
        await message.ack()
    with pytest.raises(MessageProcessError):
        await message.reject(requeue=True)
    await queue.cancel(tag)
    await asyncio.sleep(0.2)
    assert await queue.get(no_ack=True, fail=False) is None
    assert await rejected.get(no_ack=True, fail=False) is None


async def test_reject_with_requeue_redelivers_and_without_dead_letters(
    channel: AbstractChannel, consumed: Source
) -> None:
    queue, rejected = consumed.queue, consumed.rejected
    got, tag, first = await _first(channel, queue, "again")
    await first.reject(requeue=True)
    second = await asyncio.wait_for(got.get(), WAIT)
    assert second.body == b"frame-again" and second.redelivered
    assert second.delivery_tag != first.delivery_tag
    await second.reject()
    await queue.cancel(tag)
    await asyncio.sleep(0.2)
    dead = await rejected.get(no_ack=True, fail=False)
    assert dead is not None and dead.body == b"frame-again"
    assert await queue.get(no_ack=True, fail=False) is None


async def test_a_delivery_on_a_closed_channel_cannot_be_settled(
    broker: AbstractConnection,
    channel: AbstractChannel,
    consumed: Source,
) -> None:
    queue = consumed.queue
    own = await broker.channel()
    mine = await own.get_queue(queue.name, ensure=False)
    _, _, message = await _first(channel, mine, "closed")
    await own.close()
    with pytest.raises(Exception, match="closed"):
        await message.ack()
    assert not message.settled
    # Never acked: the broker holds it for the next consumer.
    again, tag = await _consume(queue)
    redelivered = await asyncio.wait_for(again.get(), WAIT)
    assert redelivered.body == b"frame-closed" and redelivered.redelivered
    await redelivered.ack()
    await queue.cancel(tag)


async def test_nack_with_requeue_hands_the_delivery_back_once(
    channel: AbstractChannel, consumed: Source
) -> None:
    queue, rejected = consumed.queue, consumed.rejected
    got, tag, first = await _first(channel, queue, "back")
    with pytest.raises(ValueError):
        await first.nack(multiple=True)  # one delivery settles only itself
    assert not first.settled
    await first.nack(requeue=True)
    assert first.settled
    with pytest.raises(MessageProcessError):
        await first.nack(requeue=True)
    second = await asyncio.wait_for(got.get(), WAIT)
    assert second.body == b"frame-back" and second.redelivered
    await second.ack()
    await queue.cancel(tag)
    assert await rejected.get(no_ack=True, fail=False) is None
