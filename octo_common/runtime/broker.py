"""Confirmed publish and the dead-letter copy, the same for worker and host.

Owns :func:`publish_confirmed` (one persistent, mandatory,
publisher-confirmed publish that returns only on the broker's ``basic.ack``
and raises one of the ``PublishFailed`` errors of
:mod:`octo_common.transport` otherwise), :func:`publish_envelope` (the same
for a :class:`~octo_common.transport.FrameEnvelope`) and
:func:`dead_letter_delivery` (a refused delivery's confirmed copy to
``octo.v5.dead`` with ``octo-reason``, then ack; when the copy fails in any
way, reject without requeue so the queue's own dead-letter exchange takes
it), and :func:`renew_confirm_channel` (a fresh confirm channel on the same
connection in place of one whose publish was nacked or never confirmed).

It must never: open or reopen connections (the callers own reconnection),
decide whether a frame is refused or why (the session and the client do),
or log credentials, headers or frame bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Mapping
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel
from pamqp.commands import Basic

from octo_common.runtime import amqp
from octo_common.runtime.consumer import InboundMessage
from octo_common.transport import (
    CONTENT_TYPE,
    DEAD_EXCHANGE,
    DELIVERY_MODE_PERSISTENT,
    FrameEnvelope,
    PublishChannelClosed,
    PublishFailed,
    PublishNacked,
    PublishReturned,
    PublishTimedOut,
    build_dead_letter_headers,
)

__all__ = [
    "Channel",
    "copy_to_dead_letter",
    "dead_letter_delivery",
    "frame_properties",
    "publish_confirmed",
    "publish_envelope",
    "renew_confirm_channel",
]

# Returns are matched to publishes by message_id (inside aiormq, and by the
# lean client's channel); two in-flight
# publishes with the same id (the same frame bytes) on one channel could let a
# return fail the wrong one and report the returned one as confirmed. Same-id
# publishes on a channel therefore go one at a time.
Channel = AbstractChannel | amqp.Channel
"""A confirm channel of either client: aio-pika's, or the lean client's (the hot path)."""

_IN_FLIGHT: weakref.WeakKeyDictionary[Channel, dict[str, asyncio.Future[None]]] = (
    weakref.WeakKeyDictionary()
)
_NO_ROUTE = 312  # AMQP reply code of a returned mandatory publish


def frame_properties(
    message_id: str,
    correlation_id: str | None,
    reply_to: str | None,
    headers: Mapping[str, Any],
) -> aiormq.spec.Basic.Properties:
    """The AMQP properties of one Octo publish: what an ``aio_pika.Message`` with the
    same fields would send, persistent, with :data:`CONTENT_TYPE`.

    The frame goes straight to aiormq: an ``aio_pika.Message`` and an
    ``Exchange`` object per publish cost about a fifth of the publish's CPU
    (measured). ``headers`` is copied (the encoder needs a ``dict``).
    """
    return aiormq.spec.Basic.Properties(
        content_type=CONTENT_TYPE,
        delivery_mode=DELIVERY_MODE_PERSISTENT,
        headers=dict(headers),
        message_id=message_id,
        correlation_id=correlation_id,
        reply_to=reply_to,
    )


async def publish_confirmed(
    channel: Channel,
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
    """Publish once, persistent and mandatory, and wait for the broker's confirm.

    Returns only on ``basic.ack`` for a routed message. Raises
    ``PublishReturned`` (no queue bound: ``basic.return``), ``PublishNacked``,
    ``PublishTimedOut`` (no confirm within ``timeout`` seconds: the frame may
    or may not be enqueued) or ``PublishChannelClosed`` (channel or
    connection lost, or publishing to a missing exchange). Every one of them
    is a failed publish that the caller may retry with the same
    bytes. The channel must be in confirm mode with ``on_return_raises``.
    """
    if not channel.publisher_confirms:
        raise ValueError("publish_confirmed needs a channel with publisher confirms")
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
        if isinstance(channel, amqp.Channel):
            await _publish_lean(
                channel,
                exchange,
                routing_key,
                body,
                amqp.Properties(
                    content_type=CONTENT_TYPE,
                    delivery_mode=DELIVERY_MODE_PERSISTENT,
                    headers=dict(headers),
                    message_id=message_id,
                    correlation_id=correlation_id,
                    reply_to=reply_to,
                ),
                remaining=remaining,
                timeout=timeout,
            )
        else:
            await _publish_once(
                channel,
                exchange,
                routing_key,
                body,
                frame_properties(message_id, correlation_id, reply_to, headers),
                remaining=remaining,
                timeout=timeout,
            )
    finally:
        del in_flight[message_id]
        done.set_result(None)


async def _publish_lean(
    channel: amqp.Channel,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: amqp.Properties,
    *,
    remaining: float,
    timeout: float,
) -> None:
    if remaining <= 0:
        raise PublishTimedOut(routing_key, timeout)
    try:
        confirm = channel.publish(exchange, routing_key, body, properties, mandatory=True)
    except amqp.AmqpError:
        raise PublishChannelClosed(routing_key) from None
    # The confirm's own future ends at the deadline (no wait_for task per publish).
    expiry = asyncio.get_running_loop().call_later(remaining, _expire, confirm)
    try:
        outcome = await confirm
    finally:
        expiry.cancel()
    if outcome == _EXPIRED:
        raise PublishTimedOut(routing_key, timeout)
    if outcome == amqp.ACKED:
        return
    if outcome == amqp.NACKED:
        raise PublishNacked(routing_key)
    if outcome == amqp.CLOSED:
        raise PublishChannelClosed(routing_key)
    raise PublishReturned(routing_key, outcome)


_EXPIRED = -100  # a confirm outcome of this module's own: the deadline passed first


def _expire(confirm: asyncio.Future[int]) -> None:
    if not confirm.done():
        confirm.set_result(_EXPIRED)


async def _publish_once(
    channel: AbstractChannel,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: aiormq.spec.Basic.Properties,
    *,
    remaining: float,
    timeout: float,
) -> None:
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
        code = getattr(error.frame, "reply_code", _NO_ROUTE)
        raise PublishReturned(routing_key, code if isinstance(code, int) else _NO_ROUTE) from None
    except aiormq.exceptions.DeliveryError:
        raise PublishNacked(routing_key) from None
    except TimeoutError:
        raise PublishTimedOut(routing_key, timeout) from None
    except (aiormq.exceptions.AMQPError, aiormq.exceptions.ChannelInvalidStateError, OSError):
        raise PublishChannelClosed(routing_key) from None
    if not isinstance(result, Basic.Ack):
        # A channel without on_return_raises hands back the returned message.
        raise PublishReturned(routing_key)


# Channels replaced after a nack, until they are closed (a task must be referenced).
_RETIRING: set[asyncio.Task[None]] = set()


async def renew_confirm_channel(
    connection: amqp.Connection, nacked: amqp.Channel, *, timeout: float
) -> amqp.Channel:
    """A new confirm channel on ``connection`` to publish on in place of ``nacked``.

    A nack, or a confirm that never comes, may be the channel's, not the
    queue's: RabbitMQ (3.10, measured on a three-node cluster) leaves a
    channel opened while a quorum queue had no reachable leader (its
    leader's node had just died, or was cut off) nacking, or never
    confirming, every later publish to that queue for as long as the channel
    lives, while a channel opened after the election publishes to it at
    once. A publisher therefore answers either with a new channel before it
    publishes again. ``nacked`` is closed
    after ``timeout`` seconds (the confirms still in flight on it end by
    then); its close callbacks are the caller's to remove first. Raises what
    opening a channel raises (``TimeoutError`` after ``timeout``).
    """
    fresh = await asyncio.wait_for(connection.channel(publisher_confirms=True), timeout)
    loop = asyncio.get_running_loop()

    def close() -> None:
        task = loop.create_task(_close_quietly(nacked))
        _RETIRING.add(task)
        task.add_done_callback(_RETIRING.discard)

    loop.call_later(timeout, close)
    return fresh


async def _close_quietly(channel: amqp.Channel) -> None:
    if not channel.is_closed:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(channel.close(), timeout=5.0)


async def publish_envelope(channel: Channel, envelope: FrameEnvelope, *, timeout: float) -> None:
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


# Dead-lettering -----------------------------------------------------------


async def copy_to_dead_letter(
    channel: Channel | None,
    message: InboundMessage,
    reason: str,
    *,
    timeout: float,
    log: Any,
    routing_key: str = "",
) -> bool:
    """Publish the confirmed copy of ``message`` to ``octo.v5.dead``; True once confirmed.

    The copy carries the delivery's body and properties and its headers
    plus ``octo-reason: <reason>`` (header values pamqp decoded as ``bytes``
    go out as byte arrays). ``routing_key`` stands in for a delivery that
    has none. Without an open channel it returns False at once; a failed
    publish or a header the encoder refuses returns False after one
    ``dead_letter_copy_failed`` warning on ``log`` naming the error class or
    code only.
    """
    if channel is None or channel.is_closed:
        return False
    try:
        await publish_confirmed(
            channel,
            DEAD_EXCHANGE,
            message.routing_key or routing_key,
            message.body,
            message_id=message.message_id or "",
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            headers=build_dead_letter_headers(message.headers, reason),
            timeout=timeout,
        )
    except PublishFailed as exc:
        log.warning("dead_letter_copy_failed", reason=reason, error=exc.code)
        return False
    except Exception as exc:  # a header the encoder refuses, say: the caller rejects instead
        log.warning("dead_letter_copy_failed", reason=reason, error=type(exc).__name__)
        return False
    return True


async def dead_letter_delivery(
    message: InboundMessage,
    publish_channel: Channel | None,
    reason: str,
    *,
    timeout: float,
    log: Any,
    consume_channel: Channel | None = None,
    routing_key: str = "",
) -> bool:
    """The confirmed copy, then ack; without a confirmed copy, reject (no requeue).

    Returns whether the copy was confirmed. When ``consume_channel`` (the
    channel the delivery came on) is closed, the delivery is left unsettled:
    the broker redelivers it. A failing ack or reject raises.
    """
    copied = await copy_to_dead_letter(
        publish_channel, message, reason, timeout=timeout, log=log, routing_key=routing_key
    )
    if consume_channel is not None and consume_channel.is_closed:
        return copied
    if copied:
        await message.ack()
    else:
        # The queue's own dead-letter exchange takes it (without octo-reason).
        await message.reject(requeue=False)
    return copied
