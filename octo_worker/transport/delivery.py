"""One delivery as a session settles it, and the confirmed publish it goes through.

Owns :class:`BrokerDelivery`, an AMQP delivery as the ``Delivery`` a
session settles (``octo_worker.session.steps.Delivery``): ack on the
channel it came on, reply to the session's reply queue, dead-letter,
requeue. The daemon's delivery path builds one per delivery and hands it
to ``WorkerSession.handle``, whose driver calls it directly.

Owns :class:`ConfirmedPublisher`, the confirmed publish that survives a
reconnect (same bytes, current channel), through which a delivery's reply
and dead-letter copy and the outbox republish go. The daemon's broker link
builds it and hands it each connection's publish channel (``use``); it
opens no connection of its own.

Neither holds a scope's or a session's state: a delivery reads of its
scope only whether this worker may publish for it now, and of its session
only where replies go. It must never ack a delivery on a channel other than
its own, publish for a scope this worker may no longer own, or log a key
or a frame.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from octo_common.runtime import amqp
from octo_common.runtime.broker import (
    dead_letter_delivery,
    publish_envelope,
    renew_confirm_channel,
)
from octo_common.runtime.consumer import InboundMessage
from octo_common.transport import (
    PublishChannelClosed,
    PublishNacked,
    PublishTimedOut,
    build_worker_reply,
    worker_queue,
)
from octo_worker.hooks import WorkerHooks

__all__ = ["BrokerDelivery", "ConfirmedPublisher", "ReplyAddress", "ScopeView"]


class ConfirmedPublisher:
    """Confirmed publishes on the broker link's current publish channel."""

    def __init__(
        self,
        *,
        timeout: float,
        connected: asyncio.Event,
        stopping: asyncio.Event,
        hooks: WorkerHooks,
        log: Any,
    ) -> None:
        # ``connected`` and ``stopping`` are the broker link's and the daemon's:
        # read here, never set.
        self._timeout = timeout
        self._connected = connected
        self._stopping = stopping
        self._hooks = hooks
        self._log = log
        self._connection: amqp.Connection | None = None
        self._channel: amqp.Channel | None = None
        # The connection's channel-close callback, moved to a renewed channel.
        self._on_closed: Callable[..., None] | None = None
        self._renewing = asyncio.Lock()

    def use(
        self,
        connection: amqp.Connection | None,
        channel: amqp.Channel | None,
        on_closed: Callable[..., None] | None = None,
    ) -> None:
        """Publish on ``channel`` of ``connection`` from now on (None: no channel, between
        connections); a renewed channel gets ``on_closed`` in place of this one."""
        self._connection = connection
        self._channel = channel
        self._on_closed = on_closed

    async def publish(self, envelope: Any, *, await_reconnect: bool = True) -> None:
        """A confirmed publish that survives a reconnect (same bytes, current channel).

        A nack or a missing confirm replaces the publish channel
        (:func:`renew_confirm_channel`: the broker may nack, or never confirm,
        everything a channel publishes to a quorum queue that changed leader)
        and the same bytes go again on the new one, until the deadline; then
        that failure is raised. With ``await_reconnect=False`` a
        closed channel fails at once (the outbox republish runs on the
        connection being set up: waiting for a reconnect there would wait for
        itself).
        """
        loop = asyncio.get_running_loop()
        timeout = self._timeout
        deadline = loop.time() + 3 * timeout
        while True:
            channel = self._channel
            if channel is None or channel.is_closed:
                remaining = deadline - loop.time()
                if (
                    not await_reconnect
                    or remaining <= 0
                    or (self._stopping.is_set() and not self._connected.is_set())
                ):
                    raise PublishChannelClosed(envelope.routing_key)
                if self._connected.is_set():
                    # The channel died before the connection loop noticed:
                    # wait for it to clear the flag (never spin on a set event).
                    await asyncio.sleep(min(remaining, 0.1))
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._connected.wait(), timeout=min(remaining, 1.0))
                continue
            try:
                await publish_envelope(channel, envelope, timeout=timeout)
                return
            except PublishChannelClosed:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.1)
            except (PublishNacked, PublishTimedOut):
                if loop.time() >= deadline:
                    raise
                await self._renew(channel)
                await asyncio.sleep(0.1)

    async def _renew(self, nacked: amqp.Channel) -> None:
        """Put a new confirm channel in place of ``nacked`` if it is still the current
        one (concurrent nacks renew it once); a failure to open one is left to
        the next publish (a closed connection reconnects)."""
        async with self._renewing:
            connection, closed = self._connection, self._on_closed
            if nacked is not self._channel or connection is None or connection.is_closed:
                return
            try:
                fresh = await renew_confirm_channel(connection, nacked, timeout=self._timeout)
            except (amqp.AmqpError, TimeoutError, OSError) as exc:
                self._log.warning("publish_channel_renew_failed", error=type(exc).__name__)
                return
            if closed is not None:
                nacked.close_callbacks.discard(closed)
                fresh.close_callbacks.add(closed)
            self._channel = fresh
            self._log.warning("publish_channel_renewed")

    async def dead_letter(
        self,
        scope: str,
        message: InboundMessage,
        consume_channel: amqp.Channel,
        reason: str,
    ) -> None:
        """A confirmed copy to ``octo.v5.dead`` with ``octo-reason``, then ack."""
        self._hooks.on_dead_letter(scope, reason)
        self._log.info("frame_dead_lettered", scope=scope, reason=reason)
        await dead_letter_delivery(
            message,
            self._channel,
            reason,
            timeout=self._timeout,
            log=self._log,
            consume_channel=consume_channel,
            routing_key=worker_queue(scope),
        )


class ScopeView(Protocol):
    """What a delivery reads of its scope: its name, and whether another worker may own it."""

    @property
    def name(self) -> str: ...

    @property
    def standby(self) -> bool: ...

    @property
    def superseded(self) -> bool: ...


class ReplyAddress(Protocol):
    """Where a session's replies go, fixed at its ``open_session``."""

    @property
    def session_id(self) -> str: ...

    @property
    def key_nonce(self) -> bytes: ...

    @property
    def reply_to(self) -> str: ...


S = TypeVar("S", bound=ReplyAddress)


class BrokerDelivery(Generic[S]):
    """The ``Delivery`` a session acts through; remembers how it was settled.

    ``session`` is the session the delivery path handed it to (None until
    then, and for a delivery no session takes): replies go to its queue.
    """

    def __init__(
        self,
        publisher: ConfirmedPublisher,
        scope: ScopeView,
        message: InboundMessage,
        channel: amqp.Channel,
    ) -> None:
        self._publisher = publisher
        self._scope = scope
        self._message = message
        self._channel = channel
        self.session: S | None = None
        self.outcome = "unsettled"

    async def ack(self) -> None:
        if self._channel.is_closed:
            # Never ack on a dead channel: the broker redelivers instead.
            raise PublishChannelClosed(self._scope.name)
        await self._message.ack()
        self.outcome = "acked"

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        session = self.session
        if session is None or self._scope.standby or self._scope.superseded:
            # A scope this worker may no longer own publishes nothing: the
            # reply stays in the outbox, for the owner's republish.
            raise PublishChannelClosed(self._scope.name)
        envelope = build_worker_reply(
            self._scope.name,
            session.session_id,
            session.key_nonce,
            frame,
            reply_to=session.reply_to,
            correlation_id=correlation_id,
        )
        await self._publisher.publish(envelope)

    async def dead_letter(self, reason: str) -> None:
        await self._publisher.dead_letter(self._scope.name, self._message, self._channel, reason)
        self.outcome = "dead_lettered"

    async def requeue(self) -> None:
        """Put back a delivery whose handling failed: ``reject``, which a quorum queue
        counts toward its delivery limit (a frame that keeps failing is
        dead-lettered by the broker). A delivery this worker only hands back
        unhandled is nacked instead (``DeliveryPath.on_message``)."""
        if self._channel.is_closed:
            return
        await self._message.reject(requeue=True)
        self.outcome = "requeued"
