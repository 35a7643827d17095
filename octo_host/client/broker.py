"""The host client's AMQP side: one connection, confirmed publishes, the reply consumer.

This module owns, for one host id (H§16.2, W§12.5): the plain connection,
the confirm channel every frame is published on, the quorum reply queue
``octo.v5.reply.<host-id>`` and its consumer on a channel of its own, the
watch that reports when no reply can arrive any more, and the settling of a
reply delivery (ack, or a confirmed dead-letter copy with ``octo-reason``).
The topology helpers are :mod:`octo_host.amqp`; the confirmed publish and
the dead-letter copy are :mod:`octo_common.runtime.broker`.

It must never decide anything about a frame (the reply router and the verbs
do), retry a publish with other bytes than the first, or log frame bodies,
nonces or the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue
from structlog.typing import FilteringBoundLogger

from octo_common.runtime.broker import dead_letter_delivery, publish_envelope
from octo_common.transport import (
    PublishChannelClosed,
    PublishFailed,
    PublishReturned,
    build_host_publish,
    reply_queue,
)
from octo_host.amqp import connect, consume_reply_queue, declare_reply_queue, open_confirm_channel
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
    """The host's connection to RabbitMQ: publish with confirms, consume replies."""

    def __init__(
        self, url: str, host_id: str, settings: ClientSettings, log: FilteringBoundLogger
    ) -> None:
        self._url = url
        self.host_id = host_id
        self.reply_queue = reply_queue(host_id)
        self._settings = settings
        self._log = log
        self._connection: AbstractConnection | None = None
        self._publish_channel: AbstractChannel | None = None
        self._consume_channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self.replies_lost: str | None = None
        """Why replies can no longer arrive (None while the consumer is alive)."""
        self.published: Counter[str] = Counter()
        """Frames published, by message type."""

    @property
    def can_publish(self) -> bool:
        """Whether a publish channel is open (between ``start`` and ``disconnect``)."""
        return self._publish_channel is not None

    async def start(
        self,
        on_delivery: Callable[[AbstractIncomingMessage], Awaitable[None]],
        on_lost: Callable[[str, bool], None],
    ) -> None:
        """Connect, declare the reply queue and consume it with ``on_delivery``.

        ``on_lost(reason, unexpected)`` is called once when no reply can arrive
        any more (``unexpected`` is False during :meth:`stop_consuming`'s own
        shutdown). Raises :class:`~octo_host.amqp.BrokerUnavailable`; the
        caller then disconnects.
        """
        connection = await connect(
            self._url, timeout=self._settings.publish_timeout, name=f"octo-host-{self.host_id}"
        )
        self._connection = connection
        self.replies_lost = None
        self._publish_channel = await open_confirm_channel(connection)
        await declare_reply_queue(self._publish_channel, self.host_id)
        consumer = await consume_reply_queue(
            connection, self.host_id, on_delivery, prefetch_count=64
        )
        self._consume_channel, self._queue, self._consumer_tag = consumer
        await self._watch(connection, self._consume_channel, on_lost)

    async def _watch(
        self,
        connection: AbstractConnection,
        channel: AbstractChannel,
        on_lost: Callable[[str, bool], None],
    ) -> None:
        """Report at once when no reply can arrive any more.

        The connection or the consume channel closed, or the broker cancelled
        the consumer (the reply queue was deleted): a caller would otherwise
        sit out its whole reply timeout and reconcile into the same silence.
        """

        def lost(reason: str) -> None:
            if self.replies_lost is not None:
                return
            self.replies_lost = reason
            on_lost(reason, self._consumer_tag is not None)  # None: our own shutdown

        connection.close_callbacks.add(lambda *_: lost("the connection closed"))
        channel.close_callbacks.add(lambda *_: lost("the reply channel closed"))

        def cancelled(frame: Any) -> None:
            if getattr(frame, "consumer_tag", None) == self._consumer_tag:
                lost("the broker cancelled the reply consumer")

        underlay = await channel.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(cancelled)

    async def stop_consuming(self) -> None:
        """Cancel the reply consumer (best effort, at most 5 s); idempotent."""
        queue, tag = self._queue, self._consumer_tag
        self._queue, self._consumer_tag = None, None
        if queue is not None and tag is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.cancel(tag), timeout=5.0)

    async def disconnect(self) -> None:
        """Close the connection (best effort, at most 5 s); idempotent."""
        connection, self._connection = self._connection, None
        self._publish_channel = None
        self._consume_channel = None
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
            raise PublishChannelClosed(envelope.routing_key)
        for attempt in range(1, attempts + 1):
            try:
                await publish_envelope(channel, envelope, timeout=self._settings.publish_timeout)
            except (PublishChannelClosed, PublishReturned):
                raise  # no retry can help: a dead channel or no worker queue
            except PublishFailed as exc:
                self._log.warning("publish_unconfirmed", type=kind, attempt=attempt, error=exc.code)
                if attempt == attempts:
                    raise
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

    async def ack(self, message: AbstractIncomingMessage) -> None:
        """Ack a reply delivery; a lost channel is not an error (the broker redelivers)."""
        with contextlib.suppress(Exception):
            await message.ack()

    async def dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        """W§12.3 for the host: a confirmed copy with ``octo-reason``, then ack."""
        self._log.info("reply_dead_lettered", reason=reason, request_id=message.correlation_id)
        with contextlib.suppress(Exception):  # settling on a lost channel: the broker redelivers
            await dead_letter_delivery(
                message,
                self._publish_channel,
                reason,
                timeout=self._settings.publish_timeout,
                log=self._log,
            )
