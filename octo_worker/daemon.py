"""The worker daemon: RabbitMQ deliveries -> sessions -> journal -> adapters -> replies.

One process serves the tenant scopes of its configuration (W§12, ARCHITECTURE
decisions 1–8). For each delivery on ``octo.v5.worker.<scope>``:

    size bound -> headers -> session lookup -> session.handle
      (durable commit -> ack -> adapter -> durable observation with the reply
       in the outbox -> confirmed publish -> marked published)

Unauthenticated or undecodable frames are copied to ``octo.v5.dead`` with an
``octo-reason`` header and never answered. At start and after every reconnect
the outbox of each scope is republished (same bytes; the host drops what it
already has), and the rows the broker confirmed are then deleted at once
rather than in their session's next commit, which an idle, abandoned or
closed session never makes (so no reply is republished at every start). A
commit failure poisons its session; the daemon then pauses the scope, lets
its handlers finish, reserves a fresh fence, reloads the scope from the
store and resumes (W§10.9 steps 3–5). A commit refused with
``FencingTokenRejected`` means another worker took the scope: this one stops
serving it and never takes the fence back.

The daemon owns its reconnect loop (a plain connection, not aio-pika's robust
one): a delivery is acked only on the channel it came from, and a lost channel
simply means the broker redelivers what was not acked. SIGTERM stops
consuming, lets running handlers finish up to a grace period, and closes.

This module holds no protocol rule of its own: sessions decide, the store
persists. It never logs keys, payloads or adapter text.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)

from octo_common.errors import (
    FencingTokenRejected,
    InvalidFrameHeaders,
    OctoError,
    SessionReplay,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole, decode_frame
from octo_common.inbound import Refused, Routed, Unrouted, gate
from octo_common.messages import OpenSession
from octo_common.runtime.broker import dead_letter_delivery, publish_envelope
from octo_common.runtime.faults import FaultInjector
from octo_common.transport import (
    PublishChannelClosed,
    PublishFailed,
    build_worker_reply,
    host_id_of_reply_queue,
    worker_queue,
)
from octo_worker.adapters import (
    WorkerAdapterRegistry,
    load_adapters,
)
from octo_worker.config import InvalidConfiguration, WorkerConfig
from octo_worker.faults import FaultHooks
from octo_worker.hooks import WorkerHooks, combine_hooks
from octo_worker.metrics import WorkerMetrics
from octo_worker.queue_watch import watch_queues
from octo_worker.sdnotify import Notifier, watchdog_interval
from octo_worker.session import WorkerSession, WorkerSessionLimits
from octo_worker.store import (
    SqliteJournalStore,
    WorkerJournalLease,
)
from octo_worker.topology import connect, declare_topology, open_confirm_channel

__all__ = ["WorkerDaemon"]

_log = structlog.get_logger("octo.worker.daemon")


# Which scopes another worker took ------------------------------------------------


class _Supersession(WorkerHooks):
    """Notes the scopes whose commits another worker's fence refused (W§11.3).

    A commit refused by a fence this daemon reserved itself (a reload
    overtook it) is not a supersession.
    """

    def __init__(self, own_fence: Callable[[str, int], bool]) -> None:
        self._own_fence = own_fence
        self.scopes: set[str] = set()

    def on_commit_failed(self, scope: str, error: OctoError) -> None:
        if isinstance(error, FencingTokenRejected) and not self._own_fence(scope, error.current):
            self.scopes.add(scope)


# Per-scope state -------------------------------------------------------------------

# Closed session ids remembered per scope (about 100 bytes each); beyond it
# the oldest is forgotten and looked up in the store again when needed.
_CLOSED_REMEMBERED: Final = 65536


def _remember_closed(scope: _Scope, session_id: str) -> None:
    scope.closed.pop(session_id, None)
    scope.closed[session_id] = None
    if len(scope.closed) > _CLOSED_REMEMBERED:
        del scope.closed[next(iter(scope.closed))]


@dataclass
class _Scope:
    name: str
    key: ScopeKey
    semaphore: asyncio.Semaphore
    lease: WorkerJournalLease | None = None
    reserving: bool = False
    reload: asyncio.Task[Any] | None = None
    sessions: dict[str, WorkerSession] = field(default_factory=dict)
    # Closed sessions known by id only, most recent last (see _load_scope,
    # _forget_closed and _unknown_session_reason); bounded, the store is the truth.
    closed: dict[str, None] = field(default_factory=dict)
    # Deliveries being handled, per session id (a closed session is let go of
    # by the last one, so no reply of it is committed after that).
    handling: dict[str, int] = field(default_factory=dict)
    persisted_poisoned: set[str] = field(default_factory=set)
    # Of those, the highest refusal sequence persisted as sealed (W§10.11 rule 2).
    poisoned_sealed: dict[str, int] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Handlers past the pause gate: a reload waits for these only.
    active: set[asyncio.Task[Any]] = field(default_factory=set)
    # Sessions whose open_session is being handled: a frame for one of them
    # waits for the open's outcome (the session, or None if it failed).
    opening: dict[str, asyncio.Future[WorkerSession | None]] = field(default_factory=dict)
    queue: AbstractQueue | None = None
    consumer_tag: str | None = None
    running: asyncio.Event = field(default_factory=asyncio.Event)
    reloading: bool = False
    superseded: bool = False


# One delivery ---------------------------------------------------------------------


class _Delivery:
    """The ``Delivery`` a session acts through (W§12.3–12.4); remembers how it was settled."""

    def __init__(
        self,
        daemon: WorkerDaemon,
        scope: _Scope,
        message: AbstractIncomingMessage,
        channel: AbstractChannel,
    ) -> None:
        self._daemon = daemon
        self._scope = scope
        self._message = message
        self._channel = channel
        self.session: WorkerSession | None = None
        self.outcome = "unsettled"

    async def ack(self) -> None:
        if self._channel.is_closed:
            # Never ack on a dead channel: the broker redelivers instead.
            raise PublishChannelClosed(self._scope.name)
        await self._message.ack()
        self.outcome = "acked"

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        session = self.session
        if session is None:
            raise PublishChannelClosed(self._scope.name)
        envelope = build_worker_reply(
            self._scope.name,
            session.session_id,
            session.key_nonce,
            frame,
            reply_to=session.reply_to,
            correlation_id=correlation_id,
        )
        await self._daemon.publish(envelope)

    async def dead_letter(self, reason: str) -> None:
        await self._daemon.dead_letter(self._scope, self._message, self._channel, reason)
        self.outcome = "dead_lettered"

    async def requeue(self) -> None:
        if self._channel.is_closed:
            return
        # reject, not nack: only reject counts toward a quorum queue's delivery limit.
        await self._message.reject(requeue=True)
        self.outcome = "requeued"


# The daemon ----------------------------------------------------------------------------


class WorkerDaemon:
    """Serves the configured scopes until stopped (``run``)."""

    def __init__(
        self,
        config: WorkerConfig,
        *,
        adapters: WorkerAdapterRegistry | None = None,
        metrics: WorkerMetrics | None = None,
        notifier: Notifier | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or WorkerMetrics()
        self.faults = faults or FaultInjector()
        self._supersession = _Supersession(self._own_fence)
        # Metrics first: at a point both use, a fault kills after counting.
        self.hooks = combine_hooks(
            self.metrics,
            self._supersession,
            *((FaultHooks(self.faults),) if self.faults.active else ()),
        )
        self._notifier = notifier or Notifier()
        self._given_adapters = adapters
        self._adapters = WorkerAdapterRegistry()
        self._limits = WorkerSessionLimits(
            per_tool=config.limits.reconciliations_per_tool,
            per_session=config.limits.reconciliations_per_session,
        )
        self._store: SqliteJournalStore | None = None
        self._scopes: dict[str, _Scope] = {}
        self._connection: AbstractConnection | None = None
        self._consume_channel: AbstractChannel | None = None
        self._publish_channel: AbstractChannel | None = None
        self._connected = asyncio.Event()
        self._stopping = asyncio.Event()
        self._ready = asyncio.Event()
        self._consuming_since_connect = False
        self._background: set[asyncio.Task[Any]] = set()
        self._log = _log.bind(worker=config.worker.state_dir)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def store(self) -> SqliteJournalStore:
        if self._store is None:
            raise RuntimeError("the daemon has not started")
        return self._store

    async def wait_ready(self) -> None:
        """Returns once every scope is loaded and consuming."""
        await self._ready.wait()

    def request_stop(self) -> None:
        """Begin a graceful stop (what SIGTERM does)."""
        self._stopping.set()

    async def run(self, *, install_signal_handlers: bool = False) -> None:
        """Start, serve until stopped, then close. Raises on a fatal start-up error."""
        loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, self.request_stop)
        try:
            await self._start()
            watchdog = self._spawn(self._watchdog())
            queues = self._spawn(
                watch_queues(
                    self.metrics,
                    list(self._scopes),
                    interval=self.config.metrics.queue_refresh_seconds,
                    timeout=self.config.broker.connect_timeout_seconds,
                    connection=lambda: self._connection if self._connected.is_set() else None,
                    stopping=self._stopping,
                )
            )
            try:
                await self._connection_loop()
            finally:
                watchdog.cancel()
                queues.cancel()
        finally:
            await self._shutdown()

    async def _start(self) -> None:
        config = self.config
        keys = config.scope_keys()
        keyring = config.storage_keyring()
        data_keyring = config.data_keyring()
        self._adapters = self._load_adapters().with_default_deadline(
            config.adapters.deadline_seconds
        )
        journal = config.journal_path
        journal.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        anchor = config.anchor_path
        store = SqliteJournalStore(
            journal,
            keyring,
            anchor_path=anchor,
            data_keyring=data_keyring,
            on_batch=self.hooks.after_transaction,
        )
        self._store = store
        for scope_config in config.scopes:
            scope = _Scope(
                scope_config.name,
                keys[scope_config.name],
                asyncio.Semaphore(scope_config.max_concurrency),
            )
            self._scopes[scope.name] = scope
            await self._load_scope(scope)
        self._log.info(
            "worker_started",
            scopes=len(self._scopes),
            adapters=self._adapters.tools(),
            broker=config.redacted_broker_url(),
        )

    def _load_adapters(self) -> WorkerAdapterRegistry:
        if self._given_adapters is not None:
            return self._given_adapters
        adapters = self.config.adapters
        options = {
            name: {k: self._option_value(v) for k, v in values.items()}
            for name, values in adapters.options.items()
        }
        try:
            return load_adapters(list(adapters.enabled), options=options)
        except OctoError as exc:
            raise InvalidConfiguration(f"adapters.enabled: {exc.code} ({exc})") from None

    def _option_value(self, value: Any) -> Any:
        # Adapter options that look like relative paths are relative to the state dir.
        if isinstance(value, str) and value.startswith("./"):
            return str(self.config.state_path(value[2:]))
        return value

    async def _load_scope(self, scope: _Scope, *, open_gate: bool = True) -> None:
        """Reserve a fence, then rebuild the sessions from the store (W§10.10).

        Closed sessions are not read at all (the store skips the ones its
        commits marked closed): restoring, or even reading, every session a
        long-lived worker ever closed would cost start-up time and memory
        without end. One with replies still in the outbox is restored, so they
        can be republished and released. A frame for a session not in memory
        looks its status up in the store (``_unknown_session_reason``), and
        the ids found closed are remembered (``scope.closed``, bounded).
        """
        store = self.store
        scope.reserving = True
        try:
            scope.lease = await store.reserve_fence(scope.name)
        finally:
            scope.reserving = False
        in_outbox = {entry.session_id for entry in await store.load_outbox(scope.name)}
        persisted = await store.load_sessions(scope.name, skip_closed_except=in_outbox)
        sessions: dict[str, WorkerSession] = {}
        closed: dict[str, None] = {}
        for session_id, record in persisted.items():
            if record.status == "closed" and session_id not in in_outbox:
                # Closed before the store marked closed sessions (schema 3).
                closed[session_id] = None
                continue
            session = await WorkerSession.restore(
                record,
                scope_key=scope.key,
                scope=scope.name,
                store=store,
                lease=scope.lease,
                adapters=self._adapters,
                limits=self._limits,
                hooks=self.hooks,
            )
            sessions[session_id] = session
            if session.status == "poisoned":
                scope.persisted_poisoned.add(session_id)
        if closed:
            # Closed before the store marked closed sessions: mark them now,
            # so the next start does not read them again.
            try:
                await store.mark_closed(scope.name, closed)
            except OctoError as exc:
                self._log.warning("closed_sessions_mark_failed", scope=scope.name, error=exc.code)
        scope.sessions = sessions
        scope.closed = closed
        while len(scope.closed) > _CLOSED_REMEMBERED:
            del scope.closed[next(iter(scope.closed))]
        if open_gate:
            scope.running.set()
        self._log.info("scope_loaded", scope=scope.name, sessions=len(sessions), closed=len(closed))

    def _superseded(self, scope: _Scope) -> bool:
        """Whether a commit of ``scope`` met another worker's fence (see ``_Supersession``)."""
        return scope.name in self._supersession.scopes

    async def _drain(self) -> None:
        """Stop consuming, then let running handlers finish within the grace period.

        Runs while the connection is still open (when there is one), so the
        handlers that finish can still ack, publish their replies and mark
        them published. Deliveries that had not started never start (see
        ``_on_message``): unacked, the broker redelivers them.
        """
        self._notifier.stopping()
        self._stopping.set()
        await self._stop_consuming()
        tasks = [t for scope in self._scopes.values() for t in scope.tasks]
        if tasks:
            grace = self.config.worker.shutdown_grace_seconds
            self._log.info("worker_draining", handlers=len(tasks), grace_seconds=grace)
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                self._log.warning("worker_drain_cut", handlers=len(pending))
                await asyncio.wait(pending, timeout=5.0)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.worker.shutdown_grace_seconds
        await self._drain()
        # A reload under way records its poisoned sessions as poisoned (W§10.9
        # step 4) and persists their refusal sequences: let it finish, within
        # what is left of the grace period (at least a second), or a restart
        # could reuse a sequence (W§10.11 rule 2). It waited for the same
        # handlers as the drain, so it is usually done at once.
        reloads = [s.reload for s in self._scopes.values() if s.reload and not s.reload.done()]
        if reloads:
            self._log.info("worker_waiting_for_reload", scopes=len(reloads))
            _, pending = await asyncio.wait(reloads, timeout=max(1.0, deadline - loop.time()))
            if pending:
                self._log.warning("worker_reload_cut", scopes=len(pending))
        for task in list(self._background):
            task.cancel()
        await self._close_connection()
        if self._store is not None:
            await self._store.close()
        self._log.info("worker_stopped")

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # -- broker connection ---------------------------------------------------------

    async def _connection_loop(self) -> None:
        broker = self.config.broker
        delay = broker.reconnect_initial_seconds
        url = self.config.broker_url()
        while not self._stopping.is_set():
            try:
                connection = await connect(
                    url, timeout=broker.connect_timeout_seconds, name="octo-worker"
                )
            except OctoError as exc:
                self._log.warning("broker_connect_failed", error=str(exc), retry_in=delay)
                await self._sleep_or_stop(delay)
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
                await self._close_connection()
            if not self._stopping.is_set():
                if self._consuming_since_connect:
                    # It served: a fresh loss, retried from the initial delay.
                    delay = broker.reconnect_initial_seconds
                self._log.warning("broker_connection_lost", retry_in=delay)
                await self._sleep_or_stop(delay)
                # A set-up that keeps failing after connecting backs off too.
                delay = min(delay * 2, broker.reconnect_max_seconds)

    async def _sleep_or_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=seconds)

    async def _serve(self, connection: AbstractConnection) -> None:
        self._connection = connection
        closed = asyncio.get_running_loop().create_future()

        def on_close(*_: Any) -> None:
            if not closed.done():
                closed.set_result(None)

        connection.close_callbacks.add(on_close)
        # Every set-up call is bounded: a broker that accepts the connection
        # but never answers (a queue without quorum) must not hang the loop.
        bound = self.config.broker.connect_timeout_seconds
        async with asyncio.timeout(bound):
            consume = await connection.channel(publisher_confirms=False)
            await consume.set_qos(prefetch_count=self.config.broker.prefetch)
            publish = await open_confirm_channel(connection)
        consume.close_callbacks.add(on_close)
        publish.close_callbacks.add(on_close)

        def on_consumer_cancelled(frame: Any) -> None:
            # The broker cancelled a consumer (its queue was deleted, or the
            # queue's leader moved away): serve again from a fresh connection,
            # which re-declares the queues and consumes them.
            tag = getattr(frame, "consumer_tag", None)
            for scope in self._scopes.values():
                if scope.consumer_tag is not None and scope.consumer_tag == tag:
                    self._log.warning("consumer_cancelled_by_broker", scope=scope.name)
                    scope.consumer_tag = None
                    on_close()

        underlay = await consume.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(on_consumer_cancelled)
        self._consume_channel = consume
        self._publish_channel = publish
        # Queues only: the delivery-limit policy belongs to `octo-worker topology
        # declare` (a sandboxed daemon may not be able to run rabbitmqctl).
        async with asyncio.timeout(bound * (1 + len(self._scopes))):
            await declare_topology(publish, list(self._scopes), delivery_limit=None)
        self._connected.set()
        for scope in self._scopes.values():
            if not scope.superseded:
                self._release_outbox_later(scope, await self._republish_outbox(scope))
        for scope in self._scopes.values():
            if not scope.superseded:
                async with asyncio.timeout(bound):
                    await self._start_consuming(scope)
        self._consuming_since_connect = True
        self._ready.set()
        self._notifier.ready(f"serving {len(self._scopes)} scope(s)")
        self._log.info("worker_consuming", scopes=len(self._scopes))
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait([closed, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._stopping.is_set() and not closed.done():
                await self._drain()
        finally:
            stop.cancel()
            self._connected.clear()

    async def _close_connection(self) -> None:
        self._connected.clear()
        for scope in self._scopes.values():
            scope.queue = None
            scope.consumer_tag = None
        self._set_consumers_gauge()
        connection, self._connection = self._connection, None
        self._consume_channel = None
        self._publish_channel = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5.0)

    async def _start_consuming(self, scope: _Scope) -> None:
        channel = self._consume_channel
        if (
            channel is None
            or scope.consumer_tag is not None
            or scope.superseded
            or self._stopping.is_set()
        ):
            return
        queue = await channel.get_queue(worker_queue(scope.name), ensure=False)

        async def on_message(message: AbstractIncomingMessage) -> None:
            task = asyncio.ensure_future(self._on_message(scope, message, channel))
            scope.tasks.add(task)
            task.add_done_callback(scope.tasks.discard)

        scope.queue = queue
        scope.consumer_tag = await queue.consume(on_message, no_ack=False)
        self._set_consumers_gauge()

    async def _stop_consuming(self, scope: _Scope | None = None) -> None:
        scopes = [scope] if scope is not None else list(self._scopes.values())
        for item in scopes:
            queue, tag = item.queue, item.consumer_tag
            item.consumer_tag = None
            if queue is not None and tag is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(queue.cancel(tag), timeout=5.0)
        self._set_consumers_gauge()

    def _set_consumers_gauge(self) -> None:
        active = sum(1 for s in self._scopes.values() if s.consumer_tag is not None)
        self.hooks.on_consumers_changed(active)

    # -- publishing ------------------------------------------------------------------------

    async def publish(self, envelope: Any, *, await_reconnect: bool = True) -> None:
        """A confirmed publish that survives a reconnect (same bytes, current channel).

        With ``await_reconnect=False`` a closed channel fails at once (the
        outbox republish runs on the connection being set up: waiting for a
        reconnect there would wait for itself).
        """
        loop = asyncio.get_running_loop()
        timeout = self.config.broker.publish_timeout_seconds
        deadline = loop.time() + 3 * timeout
        while True:
            channel = self._publish_channel
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

    async def dead_letter(
        self,
        scope: _Scope,
        message: AbstractIncomingMessage,
        channel: AbstractChannel,
        reason: str,
    ) -> None:
        """W§12.3: a confirmed copy to ``octo.v5.dead`` with ``octo-reason``, then ack."""
        self.hooks.on_dead_letter(scope.name, reason)
        self._log.info("frame_dead_lettered", scope=scope.name, reason=reason)
        await dead_letter_delivery(
            message,
            self._publish_channel,
            reason,
            timeout=self.config.broker.publish_timeout_seconds,
            log=self._log,
            consume_channel=channel,
            routing_key=worker_queue(scope.name),
        )

    async def _republish_outbox(self, scope: _Scope) -> list[WorkerSession]:
        """W§11.4: every committed reply not yet confirmed, oldest first.

        Returns the sessions whose rows the broker confirmed: the caller
        releases those rows (:meth:`_release_outbox`) rather than leaving them
        to each session's next commit, which an idle, abandoned or closed
        session never makes.
        """
        entries = await self.store.load_outbox(scope.name)
        self.hooks.after_outbox_loaded(scope.name, len(entries))
        published = 0
        finished: dict[str, WorkerSession] = {}
        for entry in entries:
            session = scope.sessions.get(entry.session_id)
            if session is None:
                continue
            envelope = build_worker_reply(
                scope.name,
                entry.session_id,
                session.key_nonce,
                entry.frame,
                reply_to=entry.reply_to,
                correlation_id=entry.correlation_id,
            )
            try:
                await self.publish(envelope, await_reconnect=False)
            except PublishChannelClosed:
                self._log.warning(
                    "outbox_republish_failed", scope=scope.name, error=PublishChannelClosed.code
                )
                return list(finished.values())  # the next connection republishes from here
            except PublishFailed as exc:
                # Returned (the reply queue is gone), nacked or timed out: this
                # row stays in the outbox for the next start; the rest go on.
                self._log.warning(
                    "outbox_republish_failed",
                    scope=scope.name,
                    session=entry.session_id,
                    error=exc.code,
                )
                continue
            session.confirm_published(entry.message_id)
            published += 1
            finished[session.session_id] = session
        if published:
            self._log.info("outbox_republished", scope=scope.name, frames=published)
        return list(finished.values())

    @staticmethod
    def _attach(scope: _Scope, delivery: _Delivery, session: WorkerSession) -> None:
        delivery.session = session
        sid = session.session_id
        scope.handling[sid] = scope.handling.get(sid, 0) + 1

    @staticmethod
    def _detach(scope: _Scope, delivery: _Delivery) -> None:
        session = delivery.session
        if session is None:
            return
        sid = session.session_id
        left = scope.handling.get(sid, 0) - 1
        if left > 0:
            scope.handling[sid] = left
        else:
            scope.handling.pop(sid, None)

    def _forget_closed(self, scope: _Scope, session: WorkerSession) -> None:
        """Hold a closed session by its id only, from now on (its last handler calls this)."""
        if scope.sessions.get(session.session_id) is session:
            del scope.sessions[session.session_id]
            _remember_closed(scope, session.session_id)

    async def _unknown_session_reason(self, scope: _Scope, session_id: str) -> str:
        """Why a frame of a session not in memory is dead-lettered: closed, or unknown.

        Looked up in the store (one authenticated row): closed sessions are
        not loaded at start. Nothing of the frame is acted on either way; a
        session the store holds live but the start did not load (its closed
        mark was edited) is logged and refused as unknown.
        """
        try:
            status = await self.store.session_status(scope.name, session_id)
        except OctoError as exc:
            self._log.error(
                "session_lookup_failed", scope=scope.name, session=session_id, error=exc.code
            )
            return "unknown_session"
        if status == "closed":
            _remember_closed(scope, session_id)
            return "session_closed"
        if status is not None:
            self._log.error(
                "session_not_loaded", scope=scope.name, session=session_id, status=status
            )
        return "unknown_session"

    def _release_outbox_later(self, scope: _Scope, sessions: list[WorkerSession]) -> None:
        """Run :meth:`_release_outbox` as a handler of the scope.

        Registered in ``scope.active`` from its creation, so a reload (which
        waits for every active handler before it reserves a new fence) never
        runs under it; none is started while a reload is pending (the reload
        republishes and releases itself).
        """
        if not sessions or scope.reloading or scope.superseded:
            return
        task = self._spawn(self._release_outbox(scope, sessions))
        scope.active.add(task)
        task.add_done_callback(scope.active.discard)

    async def _release_outbox(
        self, scope: _Scope, sessions: list[WorkerSession], *, handlers: int = 0
    ) -> None:
        """Delete the confirmed outbox rows of ``sessions`` now (W§11.4).

        The rows of a session otherwise go in its next commit, and an idle or
        abandoned session never makes one, nor does a closed one: without this
        its last replies would be republished at every start and reconnect, for
        ever. Run only where the scope's lease cannot change underneath (a
        registered handler, or the reload itself). A session poisoned in memory
        commits nothing (W§10.9); one stored as poisoned may.
        """
        store = self.store
        for session in sessions:
            if scope.superseded or scope.sessions.get(session.session_id) is not session:
                continue  # a reloaded scope has its own copy of the session
            if session.status == "poisoned" and session.session_id not in scope.persisted_poisoned:
                continue
            try:
                released = await session.release_confirmed(store)
            except Exception as exc:
                # The rows stay; the next start republishes them and tries again.
                code = exc.code if isinstance(exc, OctoError) else type(exc).__name__
                self._log.warning(
                    "outbox_release_failed",
                    scope=scope.name,
                    session=session.session_id,
                    error=code,
                )
                if self._superseded(scope):
                    await self._give_up_scope(scope)  # another worker holds the fence
                    return
                continue
            if released:
                self._log.info(
                    "outbox_released",
                    scope=scope.name,
                    session=session.session_id,
                    frames=released,
                )
            if session.status == "closed":
                await self._let_go_if_done(scope, session, handlers)

    async def _let_go_if_done(self, scope: _Scope, session: WorkerSession, handlers: int) -> None:
        """Hold a closed session by its id only once nothing of it is pending.

        ``handlers``: how many of its deliveries the caller is (1 from its last
        handler, 0 after a republish). A reply of it still in the outbox (its
        publish failed) keeps it, so the next reconnect republishes that reply.
        """
        sid = session.session_id
        if scope.handling.get(sid, 0) > handlers:
            return
        try:
            entries = await self.store.load_outbox(scope.name)
        except Exception:
            return  # kept; a later delivery or start tries again
        if any(entry.session_id == sid for entry in entries):
            return
        if scope.handling.get(sid, 0) > handlers:
            return  # another delivery of it started meanwhile (dead-lettered: closed)
        self._forget_closed(scope, session)

    # -- deliveries --------------------------------------------------------------------

    async def _on_message(
        self, scope: _Scope, message: AbstractIncomingMessage, channel: AbstractChannel
    ) -> None:
        async with scope.semaphore:
            while not scope.running.is_set():
                await scope.running.wait()
            if self._stopping.is_set():
                return  # stopping: never started, never acked; the broker redelivers it
            if scope.superseded:
                # Another worker owns the scope now: hand the delivery back.
                if not channel.is_closed:
                    with contextlib.suppress(Exception):
                        await message.reject(requeue=True)
                return
            delivery = _Delivery(self, scope, message, channel)
            current = asyncio.current_task()
            if current is not None:
                scope.active.add(current)
            try:
                await self._deliver(scope, message, delivery)
                closed = delivery.session
                if (
                    closed is not None
                    and closed.status == "closed"
                    and scope.handling.get(closed.session_id) == 1
                ):
                    # The last handler of a closed session: a reply confirmed
                    # after the close commit has no later commit to be deleted
                    # in, and nothing more of the session is needed in memory.
                    await self._release_outbox(scope, [closed], handlers=1)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._log.error("delivery_failed", scope=scope.name, error=type(exc).__name__)
                with contextlib.suppress(Exception):
                    await delivery.requeue()
            finally:
                if current is not None:
                    scope.active.discard(current)
                self._detach(scope, delivery)
            self.hooks.after_delivery(scope.name, delivery.outcome)
        await self._after_delivery(scope, delivery)

    async def _deliver(
        self, scope: _Scope, message: AbstractIncomingMessage, delivery: _Delivery
    ) -> None:
        body = message.body
        routed = gate(len(body), message.headers, scope.sessions.get, scope=scope.name)
        if type(routed) is Refused:
            await delivery.dead_letter(routed.reason)
            return
        if type(routed) is Routed:
            session: WorkerSession | None = routed.session
            session_id = routed.session.session_id
            key_nonce = routed.key_nonce
        else:
            assert type(routed) is Unrouted and routed.key_nonce is not None
            session = None
            session_id = routed.session_id
            key_nonce = routed.key_nonce
            while session is None and session_id in scope.opening:
                # The host gets no answer to open_session and may send the next
                # frame at once: wait for the open of this session in progress.
                # (shield: a cancelled waiter must not cancel the others' future.)
                await asyncio.shield(scope.opening[session_id])
                session = scope.sessions.get(session_id)
        # From the last lookup to registering an open in _open_session there is
        # no await, so no other handler can open this session id in between.
        opening = False
        if session is None or b"open_session" in body or b"\\u" in body:
            try:
                _, decoded, _, _ = decode_frame(body)
            except OctoError as exc:
                await delivery.dead_letter(exc.code)
                return
            opening = isinstance(decoded, OpenSession)
        if session is None:
            if session_id in scope.closed:
                await delivery.dead_letter(SessionReplay.code if opening else "session_closed")
                return
            if not opening:
                await delivery.dead_letter(await self._unknown_session_reason(scope, session_id))
                return
            if not message.reply_to or host_id_of_reply_queue(message.reply_to) is None:
                # A forged reply_to could route replies into another queue.
                await delivery.dead_letter(InvalidFrameHeaders.code)
                return
            await self._open_session(scope, message, delivery, session_id, key_nonce)
            return
        self._attach(scope, delivery, session)
        if opening:
            if session.status in ("open", "poisoned") and key_nonce == session.key_nonce:
                await session.handle(body, self.store, delivery)
            else:
                await delivery.dead_letter(SessionReplay.code)
            return
        if session.status == "closed":
            # Dead-lettered by the session once its close is durable (a close
            # still in flight may fail, and the frame is then requeued).
            await session.handle(body, self.store, delivery)
            return
        if key_nonce != session.key_nonce:
            await delivery.dead_letter("invalid_authentication_tag")
            return
        await session.handle(body, self.store, delivery)

    async def _open_session(
        self,
        scope: _Scope,
        message: AbstractIncomingMessage,
        delivery: _Delivery,
        session_id: str,
        key_nonce: bytes,
    ) -> None:
        # Called with no await since the caller found neither the session nor
        # an open of it in progress: registering here makes this the one open.
        if (
            session_id in scope.sessions
            or session_id in scope.opening
            or session_id in scope.closed
        ):
            await delivery.dead_letter(SessionReplay.code)
            return
        pending: asyncio.Future[WorkerSession | None] = asyncio.get_running_loop().create_future()
        scope.opening[session_id] = pending
        session: WorkerSession | None = None
        refused: str | None = None
        try:
            lease = scope.lease
            assert lease is not None
            key = SessionKey.derive(scope.key, scope.name, session_id, key_nonce)
            authenticator = SessionAuthenticator(session_id, key, SessionRole.WORKER)
            session = await WorkerSession.open(
                authenticator,
                message.body,
                scope=scope.name,
                key_nonce=key_nonce,
                reply_to=str(message.reply_to),
                store=self.store,
                lease=lease,
                adapters=self._adapters,
                limits=self._limits,
                hooks=self.hooks,
            )
            scope.sessions[session_id] = session
        except OctoError as exc:
            refused = exc.code
            if isinstance(exc, SessionReplay):
                # Its rows exist (closed: live ones are all in memory). A
                # replay of the same frame is refused from memory from now on.
                _remember_closed(scope, session_id)
        finally:
            # Waiters look the session up again once this resolves (also when
            # the open failed or this handler was cancelled).
            del scope.opening[session_id]
            pending.set_result(session)
        if session is None:
            await delivery.dead_letter(refused or SessionReplay.code)
            return
        self._attach(scope, delivery, session)
        try:
            await delivery.ack()
        except Exception as exc:
            self._log.warning("delivery_ack_failed", scope=scope.name, error=type(exc).__name__)

    async def _after_delivery(self, scope: _Scope, delivery: _Delivery) -> None:
        if self._superseded(scope):
            await self._give_up_scope(scope)
            return
        session = delivery.session
        if session is None or session.status != "poisoned":
            return
        if session.session_id in scope.persisted_poisoned:
            await self._persist_refusal_sequence(scope, session)
            return
        self.hooks.on_poisoned(scope.name, session.session_id)
        if not scope.reloading:
            scope.reloading = True
            scope.reload = self._spawn(self._reload_scope(scope))

    def _own_fence(self, scope_name: str, fence: int) -> bool:
        scope = self._scopes.get(scope_name)
        if scope is None:
            return False
        # While a reservation is under way its token is not known yet; if
        # another worker took the scope meanwhile, the next commit under the
        # new lease meets that worker's fence and gives the scope up.
        return scope.reserving or (scope.lease is not None and scope.lease.token == fence)

    async def _persist_refusal_sequence(self, scope: _Scope, session: WorkerSession) -> None:
        """A stored-poisoned session sealed a ``session_poisoned`` refusal: persist
        ``next_outgoing`` past it, so no later refusal (after a restart or a
        reload, which load the session from the store) reuses its sequence
        number for other bytes (W§10.11 rule 2); the host would drop that one
        as a duplicate and wait for its timeout."""
        high = session.best_effort_sequence_high
        if high <= scope.poisoned_sealed.get(session.session_id, 0):
            return
        scope.poisoned_sealed[session.session_id] = high
        # A commit like a handler's: a reload waits for it before it takes a
        # new fence (its handler has already left ``scope.active``; nothing
        # awaited since).
        current = asyncio.current_task()
        if current is not None:
            scope.active.add(current)
        try:
            await session.persist_poisoned(self.store, sealed_through=high)
        except Exception as exc:
            scope.poisoned_sealed.pop(session.session_id, None)
            code = exc.code if isinstance(exc, OctoError) else type(exc).__name__
            self._log.warning(
                "poisoned_sequence_persist_failed",
                scope=scope.name,
                session=session.session_id,
                error=code,
            )
            # The store refused it (and may hold it all the same): reload the
            # scope, whose first commit under a fresh fence persists the sequence
            # (W§10.11 rule 2), rather than retry on the next frame.
            if not scope.reloading and not self._stopping.is_set():
                scope.reloading = True
                scope.reload = self._spawn(self._reload_scope(scope))
        finally:
            if current is not None:
                scope.active.discard(current)

    async def _give_up_scope(self, scope: _Scope) -> None:
        if scope.superseded:
            return
        scope.superseded = True
        self._log.error(
            "scope_superseded",
            scope=scope.name,
            detail="another worker holds the scope's fence; this worker stops serving it",
        )
        await self._stop_consuming(scope)
        if all(item.superseded for item in self._scopes.values()):
            self._log.error(
                "worker_superseded", detail="every scope is served by another worker; stopping"
            )
            self.request_stop()

    async def _reload_scope(self, scope: _Scope) -> None:
        """W§10.9 steps 3–5: pause, drain, fresh fence, reload, mark poisoned, resume."""
        try:
            scope.running.clear()
            await self._stop_consuming(scope)
            # The handler that poisoned the session is done with it; wait for
            # every other running handler of the scope (their commits may fail too).
            while scope.active:
                await asyncio.wait(list(scope.active))
            if scope.superseded or self._superseded(scope):
                await self._give_up_scope(scope)
                return
            # Poisoned in memory, and stored poisoned with a refusal sealed
            # since: both get next_outgoing persisted past what they sealed.
            poisoned = {
                sid: session.best_effort_sequence_high
                for sid, session in scope.sessions.items()
                if session.status == "poisoned"
                and (
                    sid not in scope.persisted_poisoned
                    or session.best_effort_sequence_high > scope.poisoned_sealed.get(sid, 0)
                )
            }
            scope.persisted_poisoned = set()
            scope.poisoned_sealed = {}
            # The gate stays shut until every poisoned session is marked
            # poisoned again (the finally opens it): a frame for one of them
            # must not meet the reloaded session while it still reads "open".
            await self._load_scope(scope, open_gate=False)
            for session_id, sealed in poisoned.items():
                restored = scope.sessions.get(session_id)
                if restored is None:
                    continue
                await restored.persist_poisoned(self.store, sealed_through=sealed)
                scope.persisted_poisoned.add(session_id)
            self._log.warning("scope_reloaded", scope=scope.name, poisoned=sorted(poisoned))
            if self._connected.is_set():
                await self._release_outbox(scope, await self._republish_outbox(scope))
                if self._superseded(scope):
                    await self._give_up_scope(scope)  # the release met another writer's fence
                    return
                await self._start_consuming(scope)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._log.error("scope_reload_failed", scope=scope.name, error=type(exc).__name__)
            if self._superseded(scope):
                await self._give_up_scope(scope)
            else:
                self.request_stop()  # fail closed: a supervisor restarts from durable state
        finally:
            scope.reloading = False
            scope.running.set()

    # -- health ------------------------------------------------------------------------

    def healthy(self) -> bool:
        """Consuming every live scope, or (re)connecting; False when stalled."""
        if self._stopping.is_set():
            return True
        live = [s for s in self._scopes.values() if not s.superseded]
        if not self._connected.is_set():
            return False
        return all(s.consumer_tag is not None or s.reloading for s in live)

    async def _watchdog(self) -> None:
        interval = watchdog_interval()
        if interval is None:
            return
        stall = self.config.worker.watchdog_stall_seconds
        unhealthy_since: float | None = None
        while not self._stopping.is_set():
            now = time.monotonic()
            if self.healthy():
                unhealthy_since = None
            elif unhealthy_since is None:
                unhealthy_since = now
            if unhealthy_since is None or now - unhealthy_since < stall:
                self._notifier.watchdog()
            await self._sleep_or_stop(interval)
