"""Manual-ack consumption at the channel level, the same for worker and host.

Owns :class:`Received` (one delivery as the broker sent it: body, the AMQP
properties read from the frame on access, the delivery tag and a settle
state, with ``ack``, ``reject`` and ``nack`` on the channel it came on),
:class:`InboundMessage` (what the delivery paths and the dead-letter copy
read of a delivery; an aio-pika message has the same shape) and
:func:`consume_queue` (``basic.consume`` with manual acks on the queue's
own channel, each delivery handed to a plain callback as a
:class:`Received`).

A delivery costs one small object here instead of an aio-pika
``IncomingMessage`` and the task aio-pika adds around each callback. The
callback runs inside the task the AMQP client creates for the delivery,
which is cancelled when the channel closes: it must only start the handling
(its own task) and return, never await the handling itself.

It must never ack or reject a delivery twice or on another channel than the
one it came on, open or reopen channels (the callers own reconnection), or
log anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from aio_pika.abc import AbstractQueue
from aio_pika.exceptions import MessageProcessError
from aiormq.abc import AbstractChannel as LowChannel
from aiormq.abc import DeliveredMessage
from pamqp.commands import Basic

__all__ = ["InboundMessage", "Received", "consume_queue"]


class InboundMessage(Protocol):
    """What Octo reads of a delivery and how it settles it (manual acks)."""

    @property
    def body(self) -> bytes: ...

    @property
    def headers(self) -> Mapping[str, Any]: ...

    @property
    def message_id(self) -> str | None: ...

    @property
    def correlation_id(self) -> str | None: ...

    @property
    def reply_to(self) -> str | None: ...

    @property
    def routing_key(self) -> str | None: ...

    async def ack(self) -> None: ...

    async def reject(self, requeue: bool = False) -> None: ...

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None: ...


_NO_HEADERS: Mapping[str, Any] = {}


class Received:
    """One delivery of a manual-ack consumer (see the module docstring).

    ``headers`` is the table the broker sent (empty when there was none),
    never a copy: readers must not change it. The other properties are
    None when absent, as AMQP leaves them.
    """

    __slots__ = (
        "_channel",
        "_properties",
        "body",
        "delivery_tag",
        "redelivered",
        "routing_key",
        "settled",
    )

    def __init__(self, delivered: DeliveredMessage) -> None:
        deliver = delivered.delivery
        if not isinstance(deliver, Basic.Deliver) or deliver.delivery_tag is None:
            raise ValueError("a consumer is handed basic.deliver frames with a delivery tag")
        self.body: bytes = delivered.body
        self._properties = delivered.header.properties
        self._channel: LowChannel = delivered.channel
        self.delivery_tag: int = deliver.delivery_tag
        self.routing_key: str | None = deliver.routing_key
        self.redelivered: bool = bool(deliver.redelivered)
        self.settled = False
        """Whether ``ack``, ``reject`` or ``nack`` was sent for this delivery."""

    @property
    def headers(self) -> Mapping[str, Any]:
        headers = self._properties.headers
        return headers if headers is not None else _NO_HEADERS

    @property
    def message_id(self) -> str | None:
        return self._properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self._properties.correlation_id

    @property
    def reply_to(self) -> str | None:
        return self._properties.reply_to

    @property
    def content_type(self) -> str | None:
        return self._properties.content_type

    @property
    def delivery_mode(self) -> int | None:
        return self._properties.delivery_mode

    def _check_unsettled(self) -> None:
        if self.settled:
            raise MessageProcessError("Message already processed", self)

    async def ack(self) -> None:
        """``basic.ack`` on the delivery's channel; raises on a closed channel and on
        a second settle (the state is set only once the ack was handed to the
        connection, so a failed ack can be followed by a reject).

        Returns once the ack is queued on the connection, ahead of every later
        frame of this process (the connection's bounded write queue still
        holds a caller back), without waiting for the socket to take it: the
        broker confirms no ack, and one lost with the connection is a
        redelivery either way.
        """
        self._check_unsettled()
        await self._channel.basic_ack(self.delivery_tag, wait=False)
        self.settled = True

    async def reject(self, requeue: bool = False) -> None:
        """``basic.reject`` on the delivery's channel, requeued or not; raises as ``ack``.

        Says the handling of this delivery failed: a quorum queue counts it
        toward its delivery limit on every RabbitMQ version.
        """
        self._check_unsettled()
        await self._channel.basic_reject(self.delivery_tag, requeue=requeue)
        self.settled = True

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        """``basic.nack`` of this delivery alone on its channel; raises as ``ack``.

        Hands a delivery back that was not handled (the consumer could not take
        it), which is no failure of it: from RabbitMQ 4.3 on a quorum queue
        does not count a requeueing nack toward its delivery limit (before 4.3
        it counts every return, a nack, a reject or a closed channel alike).
        ``multiple`` must stay False: one delivery settles only itself.
        """
        if multiple:
            raise ValueError("a delivery nacks itself alone")
        self._check_unsettled()
        await self._channel.basic_nack(self.delivery_tag, multiple=False, requeue=requeue)
        self.settled = True

    def __repr__(self) -> str:
        return f"Received(delivery_tag={self.delivery_tag}, routing_key={self.routing_key!r})"


async def consume_queue(
    queue: AbstractQueue, on_message: Callable[[Received], None], *, timeout: float | None = None
) -> str:
    """Consume ``queue`` with manual acks on its channel; returns the consumer tag.

    ``on_message`` is called once per delivery with a :class:`Received`; it
    must start whatever handles the delivery and return (see the module
    docstring). Cancel with ``queue.cancel(tag)``.
    """

    async def deliver(delivered: DeliveredMessage) -> None:
        on_message(Received(delivered))

    channel = await queue.channel.get_underlay_channel()
    result = await channel.basic_consume(queue.name, deliver, no_ack=False, timeout=timeout)
    tag = result.consumer_tag
    if tag is None:  # pamqp types it optional; the broker always names the consumer
        raise RuntimeError("the broker named no consumer tag")
    return tag
