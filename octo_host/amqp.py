"""The host's own RabbitMQ helpers: connect, declare its reply queue, confirmed publish.

Owns the few broker operations the host client needs (W§12.1, W§12.5,
H§16.2): a plain (non-robust) aio-pika connection, a channel in confirm mode
whose mandatory publishes raise when returned, the idempotent declaration of
the ``octo.v5`` exchange and of this host's quorum reply queue
``octo.v5.reply.<host-id>`` and its consumer, one persistent, mandatory, publisher-confirmed
publish of a :class:`~octo_common.transport.FrameEnvelope`, and the
dead-letter copy of a reply the host refuses (W§12.3 applied to the host).

It must never: use ``connect_robust`` (a silently restored channel would hide
the lost confirms the client must see), import :mod:`octo_worker`, decide
anything about frames (that is :mod:`octo_common.transport` and the client),
or log credentials or frame bodies.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)
from pamqp.commands import Basic
from pamqp.common import FieldTable

from octo_common.errors import OctoError
from octo_common.transport import (
    CONTENT_TYPE,
    DEAD_EXCHANGE,
    EXCHANGE,
    FrameEnvelope,
    PublishChannelClosed,
    PublishNacked,
    PublishReturned,
    PublishTimedOut,
    reply_queue,
)

__all__ = [
    "BrokerUnavailable",
    "connect",
    "consume_reply_queue",
    "declare_reply_queue",
    "open_confirm_channel",
    "publish_confirmed",
    "publish_dead_letter",
    "publish_envelope",
]

_QUORUM: Final[FieldTable] = {"x-queue-type": "quorum"}
# What a broker operation raises when the broker, the connection or the
# channel fails (aio-pika reports a closed connection or channel as a
# RuntimeError, aiormq's ChannelInvalidStateError among them).
_BROKER_ERRORS: Final = (TimeoutError, OSError, RuntimeError, aiormq.exceptions.AMQPError)


class BrokerUnavailable(OctoError):
    """The broker could not be reached (or the URL is malformed), or refused a
    channel, a declaration or a consume.

    ``reason`` names the failure's class only (a URL may carry a password).
    """

    _fields = ("reason",)
    _text = "broker unavailable"
    reason: str


async def connect(
    url: str, *, timeout: float = 10.0, name: str | None = None
) -> AbstractConnection:
    """A plain aio-pika connection; its loss is final and visible to the caller."""
    properties: FieldTable | None = {"connection_name": name} if name else None
    try:
        return await aio_pika.connect(url, timeout=timeout, client_properties=properties)
    except (ValueError, *_BROKER_ERRORS) as error:
        # ValueError: a malformed URL. Only the class is named: the URL may hold a password.
        raise BrokerUnavailable(f"cannot connect ({type(error).__name__})") from None


async def open_confirm_channel(connection: AbstractConnection) -> AbstractChannel:
    """A channel in publisher-confirm mode; a returned mandatory publish raises."""
    try:
        return await connection.channel(publisher_confirms=True, on_return_raises=True)
    except _BROKER_ERRORS as error:
        raise BrokerUnavailable(f"cannot open a channel ({type(error).__name__})") from None


async def consume_reply_queue(
    connection: AbstractConnection,
    host_id: str,
    callback: Callable[[AbstractIncomingMessage], Awaitable[Any]],
    *,
    prefetch_count: int,
) -> tuple[AbstractChannel, AbstractQueue, str]:
    """Consume this host's (declared) reply queue on a channel of its own, with
    manual acks; returns the channel, the queue and the consumer tag."""
    try:
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=prefetch_count)
        queue = await channel.get_queue(reply_queue(host_id), ensure=False)
        tag = await queue.consume(callback, no_ack=False)
    except _BROKER_ERRORS as error:
        raise BrokerUnavailable(
            f"cannot consume the reply queue ({type(error).__name__})"
        ) from None
    return channel, queue, tag


async def declare_reply_queue(channel: AbstractChannel, host_id: str) -> str:
    """Declare ``octo.v5`` (durable, direct) and this host's quorum reply queue,
    bound to it under its own name (W§12.5). Idempotent; returns the queue name."""
    name = reply_queue(host_id)
    try:
        exchange = await channel.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        queue: AbstractQueue = await channel.declare_queue(
            name, durable=True, arguments=dict(_QUORUM)
        )
        await queue.bind(exchange, routing_key=name)
    except _BROKER_ERRORS as error:
        raise BrokerUnavailable(
            f"reply queue declaration failed ({type(error).__name__})"
        ) from None
    return name


# Same-id publishes on one channel go one at a time: aiormq matches a
# basic.return to its publish by message_id, so two in-flight copies of the
# same frame could confirm the wrong one.
_IN_FLIGHT: weakref.WeakKeyDictionary[AbstractChannel, dict[str, asyncio.Future[None]]] = (
    weakref.WeakKeyDictionary()
)


async def publish_confirmed(
    channel: AbstractChannel,
    exchange: str,
    routing_key: str,
    body: bytes,
    *,
    message_id: str,
    correlation_id: str | None,
    reply_to: str | None,
    headers: Mapping[str, Any],
    timeout: float,
) -> None:
    """One persistent, mandatory publish, returning only on the broker's ``basic.ack``.

    Raises ``PublishReturned`` (unroutable), ``PublishNacked``,
    ``PublishTimedOut`` (the frame may or may not be enqueued) or
    ``PublishChannelClosed``: each is a failed publish (W§12.1) that the
    caller may retry with the same bytes (H§16.2).
    """
    # Straight to aiormq: an aio_pika.Message and an Exchange object per
    # publish cost about a fifth of the publish's CPU (measured).
    properties = aiormq.spec.Basic.Properties(
        content_type=CONTENT_TYPE,
        delivery_mode=2,  # persistent
        headers=dict(headers),
        message_id=message_id,
        correlation_id=correlation_id,
        reply_to=reply_to,
    )
    in_flight = _IN_FLIGHT.setdefault(channel, {})
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (earlier := in_flight.get(message_id)) is not None:
        try:
            await asyncio.wait_for(asyncio.shield(earlier), max(deadline - loop.time(), 0.0))
        except TimeoutError:
            raise PublishTimedOut(routing_key, timeout) from None
    done: asyncio.Future[None] = loop.create_future()
    in_flight[message_id] = done
    try:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise PublishTimedOut(routing_key, timeout)
        try:
            if channel.is_closed:  # as aio-pika's Exchange.publish checks
                raise aiormq.exceptions.ChannelInvalidStateError()
            underlay = await channel.get_underlay_channel()
            result = await underlay.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=True,
                timeout=remaining,
            )
        except aiormq.exceptions.PublishError as error:
            code = getattr(error.frame, "reply_code", 312)
            raise PublishReturned(routing_key, code if isinstance(code, int) else 312) from None
        except aiormq.exceptions.DeliveryError:
            raise PublishNacked(routing_key) from None
        except TimeoutError:
            raise PublishTimedOut(routing_key, timeout) from None
        except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, OSError):
            raise PublishChannelClosed(routing_key) from None
        if not isinstance(result, Basic.Ack):
            raise PublishReturned(routing_key)
    finally:
        del in_flight[message_id]
        done.set_result(None)


async def publish_envelope(
    channel: AbstractChannel, envelope: FrameEnvelope, *, timeout: float
) -> None:
    """:func:`publish_confirmed` for an envelope built by :mod:`octo_common.transport`."""
    await publish_confirmed(
        channel,
        envelope.exchange,
        envelope.routing_key,
        envelope.body,
        message_id=envelope.message_id,
        correlation_id=envelope.correlation_id,
        reply_to=envelope.reply_to,
        headers=envelope.headers,
        timeout=timeout,
    )


async def publish_dead_letter(
    channel: AbstractChannel,
    body: bytes,
    *,
    message_id: str | None,
    correlation_id: str | None,
    headers: Mapping[str, Any],
    timeout: float,
) -> None:
    """The confirmed copy of a refused delivery to ``octo.v5.dead`` (fanout)."""
    await publish_confirmed(
        channel,
        DEAD_EXCHANGE,
        "",
        body,
        message_id=message_id or "",
        correlation_id=correlation_id,
        reply_to=None,
        headers=headers,
        timeout=timeout,
    )
