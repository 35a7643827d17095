"""The host client's AMQP side: one connection, confirmed publishes, the reply consumer.

This module owns, for one host id: the plain connection
(client property ``connection_name`` = ``octo-host-<host-id>``), the confirm
channel every frame is published on, the quorum reply queue
``octo.v5.reply.<host-id>`` and its consumer on a channel of its own, the
watch that reports when no reply can arrive any more, the reconnection after
a loss (with backoff, the same reply queue consumed again, as the worker
daemon's connection loop does), and the settling of a reply delivery (ack,
or a confirmed dead-letter copy with ``octo-reason``).
The connection is Octo's lean AMQP client (:mod:`octo_common.runtime.amqp`);
the topology helpers are :mod:`octo_host.amqp`; the confirmed publish and
the dead-letter copy are :mod:`octo_common.runtime.broker`.

It must never decide anything about a frame (the reply router and the verbs
do), retry a publish with other bytes than the first, publish again on a new
connection a frame whose publish the lost one cut (the caller reconciles), or
log frame bodies, nonces or the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from structlog.typing import FilteringBoundLogger

from octo_common.runtime import amqp
from octo_common.runtime.broker import (
    dead_letter_delivery,
    publish_envelope,
    renew_confirm_channel,
)
from octo_common.runtime.consumer import InboundMessage
from octo_common.transport import (
    PublishChannelClosed,
    PublishFailed,
    PublishNacked,
    PublishReturned,
    PublishTimedOut,
    build_host_publish,
    reply_queue,
)
from octo_host.amqp import BrokerUnavailable, connect_link, consume_replies, declare_replies
from octo_host.client.settings import ClientSettings

__all__ = ["HostBroker", "SessionAddress"]


class SessionAddress(Protocol):
    """What a publish reads of a session: where its frames go and the nonce they carry."""

    @property
    def scope(self) -> str: ...

    @property
    def session_id(self) -> str: ...

    @property
    def key_nonce(self) -> bytes: ...


class HostBroker:
    """The host's connection to RabbitMQ: publish with confirms, consume replies, reconnect."""

    def __init__(
        self,
        url: str,
        host_id: str,
        settings: ClientSettings,
        log: FilteringBoundLogger,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._url = url
        self._ssl_context = ssl_context
        self.host_id = host_id
        self.reply_queue = reply_queue(host_id)
        self.connection_name = f"octo-host-{host_id}"
        """The ``connection_name`` client property of every connection this broker opens."""
        self._settings = settings
        self._log = log
        self._connection: amqp.Connection | None = None
        self._publish_channel: amqp.Channel | None = None
        self._renewing = asyncio.Lock()
        self._consume_channel: amqp.Channel | None = None
        self._consumer_tag: str | None = None
        self._on_delivery: Callable[[amqp.AmqpDelivery], None] | None = None
        self._on_lost: Callable[[str, bool], None] | None = None
        # Each connection's callbacks act only while it is the current one.
        self._generation = 0
        self._connected = asyncio.Event()
        self._stopping = False
        self._reconnecting: asyncio.Task[None] | None = None
        self.replies_lost: str | None = None
        """Why replies cannot arrive now (None while the consumer is alive)."""
        self.reconnects = 0
        """Connections opened again after a loss (observability)."""
        self.published: Counter[str] = Counter()
        """Frames published, by message type."""

    @property
    def socket_writes(self) -> int:
        """Socket writes of the current connection so far (0 without one): what a
        benchmark divides by its operations."""
        return 0 if self._connection is None else self._connection.writes

    @property
    def can_publish(self) -> bool:
        """Whether a publish channel is open (connected, between ``start`` and ``disconnect``)."""
        return self._publish_channel is not None

    async def start(
        self,
        on_delivery: Callable[[amqp.AmqpDelivery], None],
        on_lost: Callable[[str, bool], None],
    ) -> None:
        """Connect, declare the reply queue and consume it with ``on_delivery``
        (called once per delivery; it starts the delivery's handling and returns).

        ``on_lost(reason, unexpected)`` is called once per connection when no
        reply can arrive on it any more: ``unexpected`` is False during
        :meth:`stop_consuming`'s own shutdown; otherwise the broker reconnects
        by itself (:meth:`_reconnect`) and consumes the same reply queue again.
        Raises :class:`~octo_host.amqp.BrokerUnavailable` when this first
        connection fails; the caller then disconnects.
        """
        self._on_delivery, self._on_lost = on_delivery, on_lost
        self._stopping = False
        await self._open()

    async def _open(self) -> None:
        """One connection: confirm channel, reply queue declared, consumer, watch."""
        assert self._on_delivery is not None
        self._generation += 1
        generation = self._generation
        connection = await connect_link(
            self._url,
            timeout=self._settings.publish_timeout,
            name=self.connection_name,
            ssl_context=self._ssl_context,
        )
        self._connection = connection
        try:
            publish = await declare_replies(connection, self.host_id)
            consumer = await consume_replies(
                connection, self.host_id, self._on_delivery, prefetch_count=64
            )
            self._consume_channel, self._consumer_tag = consumer
            self._watch(generation, connection, self._consume_channel)
        except BaseException:
            self._generation += 1  # this connection's own close is no loss to report
            self._connection = self._consume_channel = None
            self._consumer_tag = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5.0)
            raise
        self._publish_channel = publish
        self.replies_lost = None
        self._connected.set()

    def _watch(self, generation: int, connection: amqp.Connection, channel: amqp.Channel) -> None:
        """Report at once when no reply can arrive on this connection any more.

        The connection or the consume channel closed, or the broker cancelled
        the consumer (the reply queue was deleted): a caller would otherwise
        sit out its whole reply timeout and reconcile into the same silence.
        """

        def lost(reason: str) -> None:
            if generation != self._generation or self.replies_lost is not None:
                return  # an older connection's close, or already reported
            self.replies_lost = reason
            self._connected.clear()
            self._publish_channel = None
            unexpected = self._consumer_tag is not None and not self._stopping
            if self._on_lost is not None:
                self._on_lost(reason, unexpected)  # not unexpected: our own shutdown
            if unexpected:
                self._log.warning("broker_connection_lost", reason=reason)
                self._reconnecting = asyncio.ensure_future(self._reconnect(connection))

        connection.close_callbacks.add(lambda *_: lost("the connection closed"))

        def blocked(reason: str | None) -> None:
            # A resource alarm: publishes wait for their confirms until it ends.
            if generation != self._generation:
                return
            if reason is None:
                self._log.info("broker_unblocked")
            else:
                self._log.warning("broker_blocked", reason=reason)

        connection.blocked_callbacks.add(blocked)
        channel.close_callbacks.add(lambda *_: lost("the reply channel closed"))

        def cancelled(tag: str) -> None:
            if tag == self._consumer_tag:
                lost("the broker cancelled the reply consumer")

        channel.on_consumer_cancel_callbacks.add(cancelled)

    async def _reconnect(self, lost: amqp.Connection) -> None:
        """Connect again with backoff (``backoff_initial`` doubling to ``backoff_max``)
        until connected or stopped; the reply queue is declared and consumed again.

        Replies the broker held meanwhile, and deliveries the lost channel never
        acked, arrive on the new consumer (a copy already opened is a
        ``DuplicateFrame``, dropped).
        """
        self._consumer_tag = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(lost.close(), timeout=5.0)
        settings = self._settings
        delay = settings.backoff_initial
        while not self._stopping:
            try:
                await self._open()
            except Exception as exc:
                error = exc.reason if isinstance(exc, BrokerUnavailable) else type(exc).__name__
                self._log.warning("broker_reconnect_failed", error=error, retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, max(settings.backoff_max, settings.backoff_initial))
                continue
            self.reconnects += 1
            self._log.info("broker_reconnected", reply_queue=self.reply_queue)
            return

    async def wait_connected(self) -> None:
        """Until a connection is up again, for at most one publish timeout.

        Returns at once while connected; raises
        :class:`~octo_host.amqp.BrokerUnavailable` when no connection came
        back in time, or the client is stopping.
        """
        if self._connected.is_set():
            return
        if self._stopping or self._on_delivery is None:
            raise BrokerUnavailable("not connected")
        try:
            await asyncio.wait_for(self._connected.wait(), self._settings.publish_timeout)
        except TimeoutError:
            raise BrokerUnavailable(f"not reconnected: {self.replies_lost}") from None

    async def stop_consuming(self) -> None:
        """Cancel the reply consumer (best effort, at most 5 s) and stop reconnecting;
        idempotent."""
        self._stopping = True
        channel, tag = self._consume_channel, self._consumer_tag
        self._consumer_tag = None
        if channel is not None and tag is not None and not channel.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.cancel(tag), timeout=5.0)

    async def disconnect(self) -> None:
        """Stop reconnecting and close the connection (best effort, at most 5 s); idempotent."""
        self._stopping = True
        reconnecting, self._reconnecting = self._reconnecting, None
        if reconnecting is not None and not reconnecting.done():
            reconnecting.cancel()
            with contextlib.suppress(BaseException):
                await reconnecting
        connection, self._connection = self._connection, None
        self._publish_channel = None
        self._consume_channel = None
        self._connected.clear()
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5.0)

    async def publish(
        self,
        session: SessionAddress,
        frame: bytes,
        correlation_id: str | None,
        *,
        kind: str = "frame",
        attempts: int = 3,
    ) -> None:
        """One confirmed publish of ``frame``; an unconfirmed one is retried with the
        same bytes (the worker treats a second copy as ``DuplicateFrame``).

        No reply is awaited and the session's state is not checked. Callers
        publish a durable request only once the ledger revision behind it is
        durable.
        """
        envelope = build_host_publish(
            session.scope,
            session.session_id,
            session.key_nonce,
            frame,
            reply_to=self.reply_queue,
            correlation_id=correlation_id,
        )
        channel = self._publish_channel
        if channel is None:
            # Nothing was sent yet: wait for the reconnection, then publish first.
            with contextlib.suppress(BrokerUnavailable):
                await self.wait_connected()
            channel = self._publish_channel
            if channel is None:
                raise PublishChannelClosed(envelope.routing_key)
        # A publish cut by a lost channel is not repeated on the next connection:
        # the frame may have reached the broker, and the caller reconciles.
        for attempt in range(1, attempts + 1):
            try:
                await publish_envelope(channel, envelope, timeout=self._settings.publish_timeout)
            except (PublishChannelClosed, PublishReturned):
                raise  # no retry can help: a dead channel or no worker queue
            except PublishFailed as exc:
                self._log.warning("publish_unconfirmed", type=kind, attempt=attempt, error=exc.code)
                if attempt == attempts:
                    raise
                if isinstance(exc, (PublishNacked, PublishTimedOut)):
                    channel = await self._renew_publish_channel(channel)
                continue
            break
        self.published[kind] += 1
        self._log.debug(
            "frame_published",
            type=kind,
            scope=session.scope,
            session_id=session.session_id,
            request_id=correlation_id,
            message_id=envelope.message_id,
        )

    async def _renew_publish_channel(self, nacked: amqp.Channel) -> amqp.Channel:
        """The channel to publish on after ``nacked`` nacked a publish or left it
        unconfirmed: a new one on
        the same connection in its place (once for concurrent nacks), or
        ``nacked`` itself when none can be opened now (the next attempt says)."""
        async with self._renewing:
            current, connection = self._publish_channel, self._connection
            if current is not None and current is not nacked:
                return current  # another publish renewed it already
            if current is None or connection is None or connection.is_closed:
                return nacked
            try:
                fresh = await renew_confirm_channel(
                    connection, nacked, timeout=self._settings.publish_timeout
                )
            except (amqp.AmqpError, TimeoutError, OSError) as exc:
                self._log.warning("publish_channel_renew_failed", error=type(exc).__name__)
                return nacked
            if self._publish_channel is not nacked:
                # A reconnection replaced it meanwhile: publish on the new connection's.
                return self._publish_channel or fresh
            self._publish_channel = fresh
            self._log.warning("publish_channel_renewed")
            return fresh

    async def ack(self, message: InboundMessage) -> None:
        """Ack a reply delivery; a lost channel is not an error (the broker redelivers)."""
        with contextlib.suppress(Exception):
            await message.ack()

    async def dead_letter(self, message: InboundMessage, reason: str) -> None:
        """Dead-letter a reply: a confirmed copy with ``octo-reason``, then ack."""
        self._log.info("reply_dead_lettered", reason=reason, request_id=message.correlation_id)
        with contextlib.suppress(Exception):  # settling on a lost channel: the broker redelivers
            await dead_letter_delivery(
                message,
                self._publish_channel,
                reason,
                timeout=self._settings.publish_timeout,
                log=self._log,
            )
