"""The host's own RabbitMQ helpers: connect, declare its reply queue, consume it.

Owns the few broker operations the host client needs: a
plain (non-robust) connection, a channel in confirm mode, the idempotent
declaration of the ``octo.v5`` exchange and of this host's quorum reply
queue ``octo.v5.reply.<host-id>``, and its consumer. The confirmed publish and the
dead-letter copy are :mod:`octo_common.runtime.broker`, shared with the
worker. The host client's own link runs on the lean AMQP client
(:func:`connect_link`, :func:`declare_replies`, :func:`consume_replies`);
the aio-pika helpers serve the command-line tools and tests.

It must never: use ``connect_robust`` (a silently restored channel would hide
the lost confirms the client must see), import :mod:`octo_worker`, decide
anything about frames (that is :mod:`octo_common.transport` and the client),
or log credentials or frame bodies.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Final

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractQueue,
)
from pamqp.common import FieldTable

from octo_common.errors import OctoError
from octo_common.runtime import amqp
from octo_common.runtime.tls import tls_refusal
from octo_common.transport import (
    EXCHANGE,
    reply_queue,
)

__all__ = [
    "BrokerUnavailable",
    "connect",
    "connect_link",
    "consume_replies",
    "declare_replies",
    "declare_reply_queue",
    "open_confirm_channel",
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
    url: str,
    *,
    timeout: float = 10.0,
    name: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> AbstractConnection:
    """A plain aio-pika connection; its loss is final and visible to the caller."""
    properties: FieldTable | None = {"connection_name": name} if name else None
    try:
        return await aio_pika.connect(
            url, timeout=timeout, client_properties=properties, ssl_context=ssl_context
        )
    except (ValueError, *_BROKER_ERRORS) as error:
        # ValueError: a malformed URL. Only the class is named: the URL may hold a password.
        raise _cannot_connect(error, await tls_refusal(url, ssl_context, timeout, error)) from None


def _cannot_connect(error: BaseException, tls: str | None) -> BrokerUnavailable:
    """The failure's class, or its TLS cause (``tls_refusal``); never the URL (it
    may hold a password)."""
    if tls is not None:
        return BrokerUnavailable(f"cannot connect: {tls}")
    return BrokerUnavailable(f"cannot connect ({type(error).__name__})")


async def open_confirm_channel(connection: AbstractConnection) -> AbstractChannel:
    """A channel in publisher-confirm mode; a returned mandatory publish raises."""
    try:
        return await connection.channel(publisher_confirms=True, on_return_raises=True)
    except _BROKER_ERRORS as error:
        raise BrokerUnavailable(f"cannot open a channel ({type(error).__name__})") from None


async def declare_reply_queue(channel: AbstractChannel, host_id: str) -> str:
    """Declare ``octo.v5`` (durable, direct) and this host's quorum reply queue,
    bound to it under its own name. Idempotent; returns the queue name."""
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


# The lean client (the host client's hot path) -------------------------------------


async def connect_link(
    url: str,
    *,
    timeout: float = 10.0,
    name: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> amqp.Connection:
    """The host client's connection on the lean client; its loss is final and visible."""
    try:
        return await amqp.connect(url, timeout=timeout, name=name, ssl_context=ssl_context)
    except (ValueError, TimeoutError, OSError, amqp.AmqpError) as error:
        raise _cannot_connect(error, await tls_refusal(url, ssl_context, timeout, error)) from None


async def declare_replies(connection: amqp.Connection, host_id: str) -> amqp.Channel:
    """A confirm channel with ``octo.v5`` and this host's reply queue declared and
    bound on it (as :func:`declare_reply_queue`); returns the channel."""
    name = reply_queue(host_id)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_exchange(EXCHANGE, "direct", durable=True)
        await channel.declare_queue(name, durable=True, arguments=_QUORUM)
        await channel.bind_queue(name, EXCHANGE, name)
    except (TimeoutError, OSError, amqp.AmqpError) as error:
        raise BrokerUnavailable(
            f"reply queue declaration failed ({type(error).__name__})"
        ) from None
    return channel


async def consume_replies(
    connection: amqp.Connection,
    host_id: str,
    callback: Callable[[amqp.AmqpDelivery], None],
    *,
    prefetch_count: int,
) -> tuple[amqp.Channel, str]:
    """Consume this host's (declared) reply queue on a channel of its own with
    manual acks; returns the channel and the consumer tag. ``callback`` gets
    each delivery in the callback that read it and must only start its handling."""
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch_count)
        tag = await channel.consume(reply_queue(host_id), callback)
    except (TimeoutError, OSError, amqp.AmqpError) as error:
        raise BrokerUnavailable(
            f"cannot consume the reply queue ({type(error).__name__})"
        ) from None
    return channel, tag
