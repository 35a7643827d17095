"""One AMQP channel of the lean client: confirmed publishes, deliveries, settles, methods.

Owns :class:`Channel` (publisher confirms matched to their publish by
delivery tag, a mandatory publish's ``basic.return`` matched by message id,
deliveries assembled from their frames and handed to the consumer's
callback in the same loop callback, acks folded per loop pass, the
synchronous methods answered in order) and :class:`AmqpDelivery` (one
delivery with ``ack``, ``reject`` and ``nack``).

Acks of finished deliveries are written at the end of the loop pass
(``Connection.ack_later``): the leading run of finished deliveries goes as
one ``basic.ack`` with ``multiple`` set, never past a delivery still being
handled; a finished delivery behind one still being handled is acked
alone. Rejects and nacks go alone, at once, ahead of that pass's acks.

It must never settle a delivery twice or on a closed channel, resolve a
confirm that did not arrive, or raise into the connection from a consumer
callback.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from pamqp import commands
from pamqp import frame as pframe
from pamqp.base import Frame

from octo_common.runtime.amqp import codec
from octo_common.runtime.amqp.codec import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_METHOD,
    FrameError,
    Properties,
)
from octo_common.runtime.amqp.errors import AmqpError, ChannelClosed

if TYPE_CHECKING:
    from octo_common.runtime.amqp.connection import Connection

__all__ = ["ACKED", "CLOSED", "NACKED", "AmqpDelivery", "Channel", "unmarshal_method"]

ACKED: Final = 0
"""A confirm's outcome: the broker took the message (any positive value is the
reply code of its ``basic.return``, then confirmed)."""
NACKED: Final = -1
"""A confirm's outcome: ``basic.nack``."""
CLOSED: Final = -2
"""A confirm's outcome: the channel ended before the confirm arrived."""

_DELIVER: Final = b"\x00\x3c\x00\x3c"
_ACK: Final = b"\x00\x3c\x00\x50"
_NACK: Final = b"\x00\x3c\x00\x78"
_RETURN: Final = b"\x00\x3c\x00\x32"
_NO_HEADERS: Final[Mapping[str, Any]] = {}
# Consumer tags unique in this process and across processes (a broker
# reports a cancel by tag; a fresh connection's consumer must not reuse one).
_PROCESS_TAG: Final = secrets.token_hex(6)
_CONSUMERS: Final = itertools.count(1)


class AmqpDelivery:
    """One delivery of a manual-ack consumer: body, properties, tag, settle state.

    ``headers`` is the table the broker sent (empty when there was none),
    never a copy: readers must not change it.
    """

    __slots__ = (
        "_channel",
        "body",
        "delivery_tag",
        "exchange",
        "properties",
        "redelivered",
        "routing_key",
        "settled",
    )

    def __init__(
        self,
        channel: Channel,
        delivery_tag: int,
        redelivered: bool,
        exchange: str,
        routing_key: str,
        properties: Properties,
        body: bytes,
    ) -> None:
        self._channel = channel
        self.delivery_tag = delivery_tag
        self.redelivered = redelivered
        self.exchange = exchange
        self.routing_key: str | None = routing_key
        self.properties = properties
        self.body = body
        self.settled = False
        """Whether ``ack``, ``reject`` or ``nack`` was sent for this delivery."""

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def headers(self) -> Mapping[str, Any]:
        headers = self.properties.headers
        return headers if headers is not None else _NO_HEADERS

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self.properties.correlation_id

    @property
    def reply_to(self) -> str | None:
        return self.properties.reply_to

    @property
    def content_type(self) -> str | None:
        return self.properties.content_type

    @property
    def delivery_mode(self) -> int | None:
        return self.properties.delivery_mode

    def _check_unsettled(self) -> None:
        if self.settled:
            raise ValueError("the delivery was already settled")

    async def ack(self) -> None:
        """Ack with this loop pass's write (see the module docstring); raises on a
        closed channel and on a second settle. The broker confirms no ack: one
        lost with the connection is a redelivery either way."""
        self._check_unsettled()
        self._channel.ack(self.delivery_tag)
        self.settled = True

    async def reject(self, requeue: bool = False) -> None:
        """``basic.reject``, requeued or not: this delivery's handling failed (a
        quorum queue counts it toward its delivery limit); raises as ``ack``."""
        self._check_unsettled()
        self._channel.reject(self.delivery_tag, requeue=requeue)
        self.settled = True

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        """``basic.nack`` of this delivery alone: handed back unhandled; raises as
        ``ack``. ``multiple`` must stay False."""
        if multiple:
            raise ValueError("a delivery nacks itself alone")
        self._check_unsettled()
        self._channel.nack(self.delivery_tag, requeue=requeue)
        self.settled = True

    def __repr__(self) -> str:
        return f"AmqpDelivery(delivery_tag={self.delivery_tag}, routing_key={self.routing_key!r})"


class _Incoming:
    """A delivery or return whose content frames are still arriving."""

    __slots__ = ("body", "fields", "is_return", "properties", "size")

    def __init__(self, is_return: bool, fields: tuple[Any, ...]) -> None:
        self.is_return = is_return
        self.fields = fields
        self.size = -1
        self.properties: Properties | None = None
        self.body: list[bytes] = []


class Channel:
    """One channel of a :class:`~octo_common.runtime.amqp.connection.Connection`
    (see the module docstring); made by ``Connection.channel``."""

    def __init__(self, connection: Connection, number: int) -> None:
        self._connection = connection
        self._loop = asyncio.get_running_loop()
        self.number = number
        self.is_closed = False
        self.close_reason: AmqpError | None = None
        self.close_callbacks: set[Callable[[AmqpError | None], Any]] = set()
        """Called once with the reason when the channel ends (None: closed by us)."""
        self.on_consumer_cancel_callbacks: set[Callable[[str], Any]] = set()
        """Called with the consumer tag when the broker cancels a consumer."""
        self.publisher_confirms = False
        self._rpc: deque[tuple[tuple[type[Frame], ...], asyncio.Future[Frame]]] = deque()
        self._publish_tag = 0
        self._unconfirmed: dict[int, asyncio.Future[int]] = {}
        self._by_message_id: dict[str, int] = {}
        self._returned: dict[int, int] = {}
        self._consumers: dict[str, Callable[[AmqpDelivery], None]] = {}
        self._incoming: _Incoming | None = None
        # Deliveries in tag order (settled ones skipped when reached) and the
        # state of each unsettled one: True once its ack waits for the write.
        self._order: deque[int] = deque()
        self._unsettled: dict[int, bool] = {}
        self._finished: list[int] = []

    @property
    def connection(self) -> Connection:
        return self._connection

    # Opening, methods and closing ---------------------------------------------------

    async def open(self, *, publisher_confirms: bool) -> None:
        await self.rpc(commands.Channel.Open(), (commands.Channel.OpenOk,))
        if publisher_confirms:
            await self.rpc(commands.Confirm.Select(), (commands.Confirm.SelectOk,))
            self.publisher_confirms = True

    async def rpc(self, method: Frame, responses: tuple[type[Frame], ...]) -> Frame:
        """Send a synchronous method and wait for its answer (answers come in order)."""
        self._check_open()
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._rpc.append((responses, future))
        self._connection.send(pframe.marshal(method, self.number))
        return await future

    async def set_qos(self, prefetch_count: int) -> None:
        await self.rpc(commands.Basic.Qos(prefetch_count=prefetch_count), (commands.Basic.QosOk,))

    async def declare_exchange(self, name: str, exchange_type: str, *, durable: bool) -> None:
        await self.rpc(
            commands.Exchange.Declare(exchange=name, exchange_type=exchange_type, durable=durable),
            (commands.Exchange.DeclareOk,),
        )

    async def declare_queue(
        self,
        name: str,
        *,
        durable: bool = True,
        passive: bool = False,
        arguments: Mapping[str, Any] | None = None,
    ) -> commands.Queue.DeclareOk:
        answer = await self.rpc(
            commands.Queue.Declare(
                queue=name, durable=durable, passive=passive, arguments=dict(arguments or {})
            ),
            (commands.Queue.DeclareOk,),
        )
        assert isinstance(answer, commands.Queue.DeclareOk)
        return answer

    async def bind_queue(self, queue: str, exchange: str, routing_key: str) -> None:
        await self.rpc(
            commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=routing_key),
            (commands.Queue.BindOk,),
        )

    async def consume(self, queue: str, callback: Callable[[AmqpDelivery], None]) -> str:
        """``basic.consume`` with manual acks; ``callback`` gets each delivery and
        must only start its handling. Returns the consumer tag."""
        tag = f"octo.{_PROCESS_TAG}.{next(_CONSUMERS)}"
        self._consumers[tag] = callback
        try:
            await self.rpc(
                commands.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=False),
                (commands.Basic.ConsumeOk,),
            )
        except BaseException:
            self._consumers.pop(tag, None)
            raise
        return tag

    async def cancel(self, consumer_tag: str) -> None:
        """``basic.cancel``; deliveries already received stay to be settled."""
        await self.rpc(commands.Basic.Cancel(consumer_tag=consumer_tag), (commands.Basic.CancelOk,))
        self._consumers.pop(consumer_tag, None)

    async def close(self) -> None:
        """``channel.close`` and its answer; idempotent."""
        if self.is_closed:
            return
        try:
            await self.rpc(
                commands.Channel.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0),
                (commands.Channel.CloseOk,),
            )
        except AmqpError:
            pass
        self.closed_with(None)

    def _check_open(self) -> None:
        if self.is_closed:
            raise self.close_reason or ChannelClosed(200, "the channel is closed")

    def closed_with(self, reason: AmqpError | None) -> None:
        """End the channel: waiting methods fail, unconfirmed publishes end
        ``CLOSED``, the close callbacks run."""
        if self.is_closed:
            return
        self.is_closed = True
        self.close_reason = reason or ChannelClosed(200, "closed by the client")
        while self._rpc:
            _, future = self._rpc.popleft()
            if not future.done():
                future.set_exception(self.close_reason)
        for confirm in self._unconfirmed.values():
            if not confirm.done():
                confirm.set_result(CLOSED)
        self._unconfirmed.clear()
        self._by_message_id.clear()
        self._returned.clear()
        self._consumers.clear()
        self._unsettled.clear()
        self._order.clear()
        self._finished.clear()
        self._connection.channel_closed(self)
        for callback in list(self.close_callbacks):
            try:
                callback(reason)
            except Exception as exc:
                self._loop.call_exception_handler(
                    {"message": "channel close callback failed", "exception": exc}
                )

    # Publishing ---------------------------------------------------------------------

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Properties,
        *,
        mandatory: bool = True,
    ) -> asyncio.Future[int]:
        """Queue one publish for this loop pass's write; the future ends with its
        confirm's outcome (``ACKED``, ``NACKED``, ``CLOSED``, or a return's reply
        code). Needs confirm mode; raises on a closed channel. One message id
        must not be in flight twice on a channel (a return is matched by it)."""
        self._check_open()
        if not self.publisher_confirms:
            raise ValueError("publish needs a channel in confirm mode")
        frames = codec.encode_publish(
            self.number,
            exchange,
            routing_key,
            body,
            properties,
            mandatory=mandatory,
            frame_max=self._connection.frame_max,
        )
        self._publish_tag += 1
        tag = self._publish_tag
        future: asyncio.Future[int] = self._loop.create_future()
        self._unconfirmed[tag] = future
        if properties.message_id:
            self._by_message_id[properties.message_id] = tag
        self._connection.send(frames)
        return future

    def _confirmed(self, tag: int, multiple: bool, outcome: int) -> None:
        unconfirmed = self._unconfirmed
        if multiple:
            done = [t for t in unconfirmed if t <= tag]
        else:
            done = [tag] if tag in unconfirmed else []
        returned = self._returned
        for t in done:
            future = unconfirmed.pop(t)
            result = returned.pop(t, ACKED) if outcome == ACKED else outcome
            if not future.done():
                future.set_result(result)
        if self._by_message_id and done:
            for message_id in [m for m, t in self._by_message_id.items() if t not in unconfirmed]:
                del self._by_message_id[message_id]

    # Settling deliveries ------------------------------------------------------------

    def _settle_check(self, tag: int) -> None:
        self._check_open()
        if self._unsettled.get(tag) is not False:
            raise ValueError("the delivery was already settled, or is not of this channel")

    def ack(self, tag: int) -> None:
        self._settle_check(tag)
        self._unsettled[tag] = True
        self._finished.append(tag)
        self._connection.ack_later(self)

    def reject(self, tag: int, *, requeue: bool) -> None:
        self._settle_check(tag)
        del self._unsettled[tag]
        self._connection.send(codec.encode_reject(self.number, tag, requeue=requeue))

    def nack(self, tag: int, *, requeue: bool) -> None:
        self._settle_check(tag)
        del self._unsettled[tag]
        self._connection.send(codec.encode_nack(self.number, tag, requeue=requeue))

    def take_acks(self, out: list[bytes]) -> None:
        """Append this pass's acks to ``out`` (see the module docstring)."""
        if self.is_closed or not self._finished:
            return
        order, unsettled = self._order, self._unsettled
        last = 0
        count = 0
        while order:
            tag = order[0]
            state = unsettled.get(tag)
            if state is False:
                break  # still being handled: no ack goes past it
            order.popleft()
            if state:
                del unsettled[tag]
                last = tag
                count += 1
        if count:
            out.append(codec.encode_ack(self.number, last, multiple=count > 1))
        for tag in self._finished:
            if unsettled.get(tag):
                del unsettled[tag]
                out.append(codec.encode_ack(self.number, tag))
        self._finished.clear()
        if len(order) > 2 * len(unsettled) + 64:
            # Behind a delivery held long, settled tags pile up: keep the unsettled only.
            self._order = deque(unsettled)

    # Receiving ----------------------------------------------------------------------

    def frame_received(self, kind: int, payload: bytes) -> None:
        if kind == FRAME_METHOD:
            head = payload[:4]
            if head == _DELIVER:
                self._incoming = _Incoming(False, codec.decode_deliver(payload))
            elif head == _ACK:
                tag, multiple = codec.decode_confirm(payload)
                self._confirmed(tag, multiple, ACKED)
            elif head == _NACK:
                tag, multiple = codec.decode_confirm(payload)
                self._confirmed(tag, multiple, NACKED)
            elif head == _RETURN:
                self._incoming = _Incoming(True, codec.decode_return(payload))
            else:
                self._method(unmarshal_method(payload))
            return
        incoming = self._incoming
        if incoming is None:
            raise FrameError("a content frame without its method")
        if kind == FRAME_HEADER:
            incoming.size, incoming.properties = codec.decode_header(payload)
            if incoming.size == 0:
                self._complete(incoming)
        elif kind == FRAME_BODY:
            incoming.body.append(payload)
            incoming.size -= len(payload)
            if incoming.size <= 0:
                self._complete(incoming)
        else:
            raise FrameError(f"unexpected frame type {kind}")

    def _complete(self, incoming: _Incoming) -> None:
        self._incoming = None
        properties = incoming.properties
        assert properties is not None
        if incoming.is_return:
            tag = self._by_message_id.get(properties.message_id or "")
            if tag is not None:
                self._returned[tag] = incoming.fields[0]
            return
        consumer_tag, tag, redelivered, exchange, routing_key = incoming.fields
        body = incoming.body[0] if len(incoming.body) == 1 else b"".join(incoming.body)
        self._order.append(tag)
        self._unsettled[tag] = False
        callback = self._consumers.get(consumer_tag)
        if callback is None:
            return  # a cancelled consumer's: the broker requeues it when the channel ends
        delivery = AmqpDelivery(self, tag, redelivered, exchange, routing_key, properties, body)
        try:
            callback(delivery)
        except Exception as exc:
            self._loop.call_exception_handler(
                {"message": "delivery callback failed", "exception": exc}
            )

    def _method(self, method: Frame) -> None:
        if isinstance(method, commands.Channel.Close):
            self._connection.send(pframe.marshal(commands.Channel.CloseOk(), self.number))
            self.closed_with(ChannelClosed(method.reply_code or 0, method.reply_text or ""))
            return
        if isinstance(method, commands.Basic.Cancel):
            tag = method.consumer_tag or ""
            self._consumers.pop(tag, None)
            if not method.nowait:
                self._connection.send(
                    pframe.marshal(commands.Basic.CancelOk(consumer_tag=tag), self.number)
                )
            for callback in list(self.on_consumer_cancel_callbacks):
                try:
                    callback(tag)
                except Exception as exc:
                    self._loop.call_exception_handler(
                        {"message": "consumer cancel callback failed", "exception": exc}
                    )
            return
        if isinstance(method, commands.Channel.Flow):
            self._connection.send(
                pframe.marshal(commands.Channel.FlowOk(active=method.active), self.number)
            )
            return
        if self._rpc and isinstance(method, self._rpc[0][0]):
            _, future = self._rpc.popleft()
            if not future.done():
                future.set_result(method)
            return
        # An answer nobody waits for (its waiter was cancelled) is dropped.


def unmarshal_method(payload: bytes) -> Frame:
    index = int.from_bytes(payload[:4], "big")
    try:
        method: Frame = commands.INDEX_MAPPING[index]()
        method.unmarshal(payload[4:])
    except (KeyError, ValueError, TypeError) as error:
        raise FrameError(f"unknown or malformed method {index:#x}") from error
    return method
