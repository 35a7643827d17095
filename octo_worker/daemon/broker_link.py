"""The daemon's link to RabbitMQ: connect, set up, consume; the publisher's channel.

The link runs on Octo's lean AMQP client (:mod:`octo_common.runtime.amqp`):
deliveries reach the delivery path in the callback that read them, and
every frame of one loop pass goes out in one socket write.

:class:`BrokerLink` is the part of ``WorkerDaemon`` that owns the broker
connection: its reconnect loop (a plain connection, not aio-pika's
robust one: a delivery is acked only on the channel it came from, and a lost
channel simply means the broker redelivers what was not acked), the set-up
of each connection (channels, queues, outbox republish, one consumer per
scope), and its :class:`~octo_worker.transport.ConfirmedPublisher`, handed
each connection's publish channel (replies, the outbox republish and
dead-letter copies go through it). Every set-up call is bounded by the
configured timeout.

It must never decide what a frame gets, or log a URL, a key or a frame.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from octo_common.errors import OctoError
from octo_common.runtime import amqp
from octo_common.runtime.consumer import InboundMessage
from octo_common.transport import worker_queue
from octo_worker.daemon.scopes import ServedScope
from octo_worker.daemon.topology import connect_link, declare_queues
from octo_worker.transport import ConfirmedPublisher

if TYPE_CHECKING:
    from octo_worker.config import WorkerConfig
    from octo_worker.daemon.sdnotify import Notifier
    from octo_worker.hooks import WorkerHooks
    from octo_worker.session.session import WorkerSession

__all__ = ["BrokerLink", "Deliver", "OutboxOwner"]


Deliver = Callable[[ServedScope, InboundMessage, amqp.Channel], Coroutine[Any, Any, None]]


class OutboxOwner(Protocol):
    """What a fresh or lost connection asks of the scopes' lifecycle."""

    async def republish_outbox(self, scope: ServedScope) -> list[WorkerSession]: ...

    def release_outbox_later(self, scope: ServedScope, sessions: list[WorkerSession]) -> None: ...

    def stand_by(self) -> None: ...


class BrokerLink:
    """RabbitMQ for ``WorkerDaemon`` (see the module docstring).

    Owns the connection, its channels, whether it is connected, and the
    ``publisher`` of its publish channel; reads the configuration and the
    served scopes. ``serve`` runs the reconnect loop
    and hands each delivery to ``deliver`` and each fresh connection's
    outbox to ``outbox``.
    """

    def __init__(
        self,
        config: WorkerConfig,
        scopes: Mapping[str, ServedScope],
        *,
        hooks: WorkerHooks,
        notifier: Notifier,
        stopping: asyncio.Event,
        shared: bool,
        log: Any,
    ) -> None:
        self.config = config
        self._scopes = scopes
        self._hooks = hooks
        self._notifier = notifier
        self._stopping = stopping
        self._shared = shared
        self._log = log
        self._connection: amqp.Connection | None = None
        self._consume_channel: amqp.Channel | None = None
        self._connected = asyncio.Event()
        self.publisher = ConfirmedPublisher(
            timeout=config.broker.publish_timeout_seconds,
            connected=self._connected,
            stopping=stopping,
            hooks=hooks,
            log=log,
        )
        self.ready = asyncio.Event()
        self._consuming_since_connect = False
        self._outbox: OutboxOwner | None = None
        self._deliver: Deliver | None = None
        self._drain: Callable[[], Awaitable[None]] | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def consume_channel(self) -> amqp.Channel | None:
        """The current connection's consume channel (None between connections)."""
        return self._consume_channel

    def connection(self) -> amqp.Connection | None:
        """The connection while connected (the queue gauges read through it)."""
        return self._connection if self._connected.is_set() else None

    async def serve(
        self,
        *,
        deliver: Deliver,
        outbox: OutboxOwner,
        drain: Callable[[], Awaitable[None]],
    ) -> None:
        """Connect, serve and reconnect until stopped; ``drain`` runs once stopping."""
        self._deliver = deliver
        self._outbox = outbox
        self._drain = drain
        await self._connection_loop()

    async def _connection_loop(self) -> None:
        broker = self.config.broker
        delay = broker.reconnect_initial_seconds
        url = self.config.broker_url()
        tls = self.config.broker_tls_context()
        while not self._stopping.is_set():
            try:
                connection = await connect_link(
                    url,
                    timeout=broker.connect_timeout_seconds,
                    name="octo-worker",
                    heartbeat=broker.heartbeat_seconds,
                    ssl_context=tls,
                )
            except OctoError as exc:
                self._log.warning("broker_connect_failed", error=str(exc), retry_in=delay)
                await self.sleep_or_stop(delay)
                delay = min(delay * 2, broker.reconnect_max_seconds)
                continue
            self._consuming_since_connect = False
            try:
                await self._serve(connection)
            except asyncio.CancelledError:
                raise
            except OctoError as exc:
                # OctoError text carries codes and names, never the URL or a key.
                self._log.warning("broker_session_ended", error=exc.code, detail=str(exc))
            except Exception as exc:
                self._log.warning("broker_session_ended", error=type(exc).__name__)
            finally:
                await self.close()
            if not self._stopping.is_set():
                if self._consuming_since_connect:
                    # It served: a fresh loss, retried from the initial delay.
                    delay = broker.reconnect_initial_seconds
                self._log.warning("broker_connection_lost", retry_in=delay)
                await self.sleep_or_stop(delay)
                # A set-up that keeps failing after connecting backs off too.
                delay = min(delay * 2, broker.reconnect_max_seconds)

    async def sleep_or_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _serve(self, connection: amqp.Connection) -> None:
        self._connection = connection
        closed = asyncio.get_running_loop().create_future()

        def on_close(*_: Any) -> None:
            if not closed.done():
                closed.set_result(None)

        connection.close_callbacks.add(on_close)

        def on_blocked(reason: str | None) -> None:
            # A resource alarm: the broker holds publishes (replies then wait for
            # their confirms, up to the publish timeout) until it unblocks.
            if reason is None:
                self._log.info("broker_unblocked")
            else:
                self._log.warning("broker_blocked", reason=reason)

        connection.blocked_callbacks.add(on_blocked)
        # Every set-up call is bounded: a broker that accepts the connection
        # but never answers (a queue without quorum) must not hang the loop.
        bound = self.config.broker.connect_timeout_seconds
        async with asyncio.timeout(bound):
            consume = await connection.channel()
            await consume.set_qos(prefetch_count=self.config.broker.prefetch)
            publish = await connection.channel(publisher_confirms=True)
        consume.close_callbacks.add(on_close)
        publish.close_callbacks.add(on_close)

        def on_consumer_cancelled(tag: str) -> None:
            # The broker cancelled a consumer (its queue was deleted, or the
            # queue's leader moved away): serve again from a fresh connection,
            # which re-declares the queues and consumes them.
            for scope in self._scopes.values():
                if scope.consumer_tag is not None and scope.consumer_tag == tag:
                    self._log.warning("consumer_cancelled_by_broker", scope=scope.name)
                    scope.consumer_tag = None
                    on_close()

        consume.on_consumer_cancel_callbacks.add(on_consumer_cancelled)
        self._consume_channel = consume
        self.publisher.use(connection, publish, on_close)
        # Queues only: the delivery-limit policy belongs to `octo-worker topology
        # declare` (a sandboxed daemon may not be able to run rabbitmqctl).
        async with asyncio.timeout(bound * (1 + len(self._scopes))):
            await declare_queues(publish, list(self._scopes))
        self._connected.set()
        for scope in self._scopes.values():
            # A standby scope republishes when the broker makes it active.
            if not scope.superseded and not scope.standby:
                self._outbox_owner().release_outbox_later(
                    scope, await self._outbox_owner().republish_outbox(scope)
                )
        for scope in self._scopes.values():
            if not scope.superseded:
                async with asyncio.timeout(bound):
                    await self.start_consuming(scope)
        self._consuming_since_connect = True
        self.ready.set()
        self._notifier.ready(f"serving {len(self._scopes)} scope(s)")
        self._log.info("worker_consuming", scopes=len(self._scopes))
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([closed, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._stopping.is_set() and not closed.done() and self._drain is not None:
                await self._drain()
        finally:
            stop.cancel()
            self._connected.clear()

    async def close(self) -> None:
        """Close the connection (if any); a shared journal's scopes stand by."""
        self._connected.clear()
        if self._shared and self._outbox is not None:
            self._outbox.stand_by()
        for scope in self._scopes.values():
            scope.consumer_channel = None
            scope.consumer_tag = None
        self._set_consumers_gauge()
        connection, self._connection = self._connection, None
        self._consume_channel = None
        self.publisher.use(None, None)
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5.0)

    async def start_consuming(self, scope: ServedScope) -> None:
        channel = self._consume_channel
        if (
            channel is None
            or scope.consumer_tag is not None
            or scope.superseded
            or self._stopping.is_set()
        ):
            return
        tasks = scope.tasks
        loop = asyncio.get_running_loop()
        deliver = self._deliver
        assert deliver is not None, "serve() sets the delivery path"

        def on_message(message: amqp.AmqpDelivery) -> None:
            # Called in the callback that read the delivery: start its handling, return.
            task = loop.create_task(deliver(scope, message, channel))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        scope.consumer_channel = channel
        scope.consumer_tag = await channel.consume(worker_queue(scope.name), on_message)
        self._set_consumers_gauge()

    async def stop_consuming(self, scope: ServedScope | None = None) -> None:
        scopes = [scope] if scope is not None else list(self._scopes.values())
        for item in scopes:
            channel, tag = item.consumer_channel, item.consumer_tag
            item.consumer_tag = None
            if channel is not None and tag is not None and not channel.is_closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(channel.cancel(tag), timeout=5.0)
        self._set_consumers_gauge()

    def _outbox_owner(self) -> OutboxOwner:
        assert self._outbox is not None, "serve() sets the outbox owner"
        return self._outbox

    def _set_consumers_gauge(self) -> None:
        active = sum(1 for s in self._scopes.values() if s.consumer_tag is not None)
        self._hooks.on_consumers_changed(active)
