"""The dead-letter copy and the confirmed publish both processes use.

On the real broker: a refused delivery is copied, with its body, properties
and headers plus ``octo-reason``, to ``octo.v5.dead`` and then acked; when
the copy fails in any way (no channel, a closed one, a header the encoder
refuses) the delivery is rejected without requeue instead, so the queue's own
dead-letter exchange takes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import pytest
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from octo_common.runtime.broker import (
    copy_to_dead_letter,
    dead_letter_delivery,
    publish_confirmed,
)
from octo_common.transport import HEADER_REASON

from .conftest import Inbox, Names, RawLongString, marker_of, reason_of, unique

pytestmark = pytest.mark.rabbitmq

WAIT = 5.0


@dataclass
class Source:
    """A private queue whose rejected deliveries go to a private ``rejected`` queue."""

    channel: AbstractChannel
    queue: AbstractQueue
    rejected: AbstractQueue


@pytest.fixture
async def source(broker: AbstractConnection, names: Names) -> AsyncIterator[Source]:
    channel = await broker.channel()
    rejects = await channel.declare_exchange(
        unique("octo.t.rejects"), aio_pika.ExchangeType.FANOUT, auto_delete=True
    )
    rejected = await channel.declare_queue(exclusive=True)
    await rejected.bind(rejects)
    queue = await channel.declare_queue(
        names.queue("octo.t.source"),
        exclusive=True,
        arguments={"x-dead-letter-exchange": rejects.name},
    )
    yield Source(channel, queue, rejected)
    if not channel.is_closed:
        await channel.close()


async def deliver(channel: AbstractChannel, source: Source, marker: str, **headers: Any) -> None:
    await channel.default_exchange.publish(
        aio_pika.Message(
            b"frame-" + marker.encode(),
            message_id=f"m-{marker}",
            correlation_id=f"c-{marker}",
            reply_to="octo.v5.reply.h-test",
            headers={"x-test-marker": marker, **headers},
        ),
        routing_key=source.queue.name,
    )


async def take(queue: AbstractQueue) -> AbstractIncomingMessage:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while (message := await queue.get(no_ack=False, fail=False)) is None:
        assert loop.time() < deadline, "no delivery arrived in time"
        await asyncio.sleep(0.02)
    return message


async def settled_to(source: Source) -> str:
    """Where the last delivery went: ``rejected``, or ``acked`` (gone without a trace)."""
    await asyncio.sleep(0.2)
    if await source.rejected.get(no_ack=True, fail=False) is not None:
        return "rejected"
    assert await source.queue.get(no_ack=True, fail=False) is None
    return "acked"


async def test_a_confirmed_copy_keeps_body_properties_and_headers_then_acks(
    channel: AbstractChannel, source: Source, dead_letters: Inbox
) -> None:
    await deliver(channel, source, "copy", **{"x-extra": "kept", HEADER_REASON: "forged"})
    message = await take(source.queue)
    with structlog.testing.capture_logs() as logs:
        copied = await dead_letter_delivery(
            message,
            channel,
            "scope_mismatch",
            timeout=WAIT,
            log=structlog.get_logger(),
            consume_channel=source.channel,
        )
    assert copied and logs == []
    dead = await dead_letters.wait_for(marker_of("copy"))
    assert (dead.body, dead.message_id, dead.correlation_id, dead.reply_to) == (
        b"frame-copy",
        "m-copy",
        "c-copy",
        "octo.v5.reply.h-test",
    )
    assert dead.routing_key == source.queue.name
    assert dead.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert reason_of(dead) == "scope_mismatch"  # replaces the reason the delivery carried
    assert (dead.headers or {})["x-extra"] == "kept"
    assert await settled_to(source) == "acked"


async def test_a_header_pamqp_decoded_as_bytes_is_copied_as_a_byte_array(
    channel: AbstractChannel,
    source: Source,
    dead_letters: Inbox,
    raw_long_strings: type[RawLongString],
) -> None:
    await deliver(channel, source, "raw", **{"x-raw": raw_long_strings(b"\xff\xfe")})
    message = await take(source.queue)
    assert isinstance((message.headers or {})["x-raw"], bytes)
    assert await dead_letter_delivery(
        message, channel, "invalid_frame_headers", timeout=WAIT, log=structlog.get_logger()
    )
    dead = await dead_letters.wait_for(marker_of("raw"))
    assert bytes((dead.headers or {})["x-raw"]) == b"\xff\xfe"  # type: ignore[arg-type]
    assert await settled_to(source) == "acked"


@pytest.mark.parametrize("publish", ["none", "closed"])
async def test_without_an_open_publish_channel_the_delivery_is_rejected(
    broker: AbstractConnection,
    channel: AbstractChannel,
    source: Source,
    dead_letters: Inbox,
    publish: str,
) -> None:
    await deliver(channel, source, f"nochan-{publish}")
    message = await take(source.queue)
    publish_channel: AbstractChannel | None = None
    if publish == "closed":
        publish_channel = await broker.channel(publisher_confirms=True)
        await publish_channel.close()
    copied = await dead_letter_delivery(
        message, publish_channel, "unknown_session", timeout=WAIT, log=structlog.get_logger()
    )
    assert not copied
    assert await settled_to(source) == "rejected"
    assert dead_letters.matching(marker_of(f"nochan-{publish}")) == []


@dataclass
class _StubDelivery:
    """A delivery whose headers no AMQP encoder accepts (settlement is recorded)."""

    headers: dict[str, Any]
    body: bytes = b"frame"
    routing_key: str | None = "octo.v5.worker.t"
    message_id: str | None = "m-stub"
    correlation_id: str | None = None
    reply_to: str | None = None
    settled: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append(f"reject(requeue={requeue})")


async def test_a_header_the_encoder_refuses_fails_the_copy_and_rejects(
    channel: AbstractChannel,
) -> None:
    delivery = _StubDelivery(headers={"x-odd": object()})
    with structlog.testing.capture_logs() as logs:
        copied = await dead_letter_delivery(
            delivery,  # type: ignore[arg-type]
            channel,
            "scope_mismatch",
            timeout=WAIT,
            log=structlog.get_logger(),
        )
    assert not copied
    assert delivery.settled == ["reject(requeue=False)"]
    assert [(e["event"], e["reason"]) for e in logs] == [
        ("dead_letter_copy_failed", "scope_mismatch")
    ]
    assert not channel.is_closed  # the refusal happened before anything was sent


async def test_a_closed_consume_channel_leaves_the_delivery_to_the_broker(
    broker: AbstractConnection, channel: AbstractChannel, source: Source, dead_letters: Inbox
) -> None:
    await deliver(channel, source, "gone")
    message = await take(source.queue)
    await source.channel.close()
    copied = await dead_letter_delivery(
        message,
        channel,
        "session_closed",
        timeout=WAIT,
        log=structlog.get_logger(),
        consume_channel=source.channel,
    )
    assert copied  # the copy went out; the original was neither acked nor rejected
    await dead_letters.wait_for(marker_of("gone"))
    again = await broker.channel()
    queue = await again.get_queue(source.queue.name, ensure=False)
    redelivered = await take(queue)
    assert redelivered.redelivered and redelivered.message_id == "m-gone"
    await redelivered.ack()
    await again.close()


async def test_copy_to_dead_letter_uses_the_fallback_routing_key_only_without_one(
    channel: AbstractChannel, names: Names, dead_letters: Inbox
) -> None:
    fallback = names.queue("octo.v5.worker.fallback")
    delivery = _StubDelivery(headers={"x-test-marker": "fallback"}, routing_key=None)
    assert await copy_to_dead_letter(
        channel,
        delivery,  # type: ignore[arg-type]
        "wire_frame_too_large",
        timeout=WAIT,
        log=structlog.get_logger(),
        routing_key=fallback,
    )
    dead = await dead_letters.wait_for(marker_of("fallback"))
    assert dead.routing_key == fallback
    assert delivery.settled == []  # copying never settles


async def test_publish_confirmed_needs_a_confirm_channel(broker: AbstractConnection) -> None:
    plain = await broker.channel(publisher_confirms=False)
    try:
        with pytest.raises(ValueError, match="publisher confirms"):
            await publish_confirmed(
                plain,
                "",
                "nowhere",
                b"{}",
                message_id="m",
                correlation_id=None,
                reply_to=None,
                headers={},
                timeout=WAIT,
            )
    finally:
        await plain.close()
