"""The worker daemon: RabbitMQ deliveries -> sessions -> journal -> adapters -> replies.

One process serves the tenant scopes of its configuration (see
docs/architecture.md). For each delivery on ``octo.v5.worker.<scope>``:

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
store and resumes. A commit refused with
``FencingTokenRejected`` means another worker took the scope: this one stops
serving it and never takes the fence back; once every scope is taken it
stops (``superseded``), and a supervisor's restart comes back as a standby.

With a shared journal (PostgreSQL) several daemons serve the same
scopes: each consumes the scope's single-active-consumer queue from the
start but reserves nothing; the broker's first delivery to it makes it the
owner (a fresh fence, sessions restored, outbox republished, see
``ScopeLifecycle._activate_scope``), and a lost connection puts it back in
standby, since another worker may serve the scope meanwhile.

The daemon owns its reconnect loop (a plain connection, not aio-pika's robust
one): a delivery is acked only on the channel it came from, and a lost channel
simply means the broker redelivers what was not acked. SIGTERM stops
consuming, lets running handlers finish up to a grace period, and closes.

This module holds no protocol rule of its own: sessions decide, the store
persists. It never logs keys, payloads or adapter text.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable
from typing import Any

import structlog

from octo_common.errors import (
    OctoError,
)
from octo_common.runtime.faults import FaultInjector
from octo_worker.adapters.contract import (
    WorkerAdapterRegistry,
    load_adapters,
)
from octo_worker.config import InvalidConfiguration, WorkerConfig
from octo_worker.daemon.broker_link import BrokerLink
from octo_worker.daemon.deliveries import DeliveryPath
from octo_worker.daemon.faults import FaultHooks
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.daemon.queue_watch import watch_queues
from octo_worker.daemon.scopes import ScopeLifecycle, ServedScope, Supersession
from octo_worker.daemon.sdnotify import Notifier, watchdog_interval
from octo_worker.daemon.startup import create_state_directories
from octo_worker.hooks import combine_hooks
from octo_worker.session.session import WorkerSessionLimits
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.configured import configured_store

__all__ = ["WorkerDaemon"]

_log = structlog.get_logger("octo.worker.daemon")


# The daemon ----------------------------------------------------------------------------


class WorkerDaemon:
    """Serves the configured scopes until stopped (``run``).

    Owns its parts, each built with what it needs and called through its
    own methods: the broker link (:mod:`octo_worker.daemon.broker_link`:
    connection, consumers, and the confirmed publisher replies and
    dead-letters go through, :mod:`octo_worker.transport`), the scopes'
    lifecycle (:mod:`octo_worker.daemon.scopes`) and the delivery path
    (:mod:`octo_worker.daemon.deliveries`), the last two built once the
    store and the adapters are ready. It starts, stops and watches the
    process.
    """

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
        self._scopes: dict[str, ServedScope] = {}
        self._supersession = Supersession(self._scopes)
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
        self._store: JournalStoreBase | None = None
        self._stopping = asyncio.Event()
        self._failure: OctoError | None = None
        self._shared = config.shared_journal
        self._background: set[asyncio.Task[Any]] = set()
        self._log = _log.bind(worker=config.worker.state_dir)
        self._broker = BrokerLink(
            config,
            self._scopes,
            hooks=self.hooks,
            notifier=self._notifier,
            stopping=self._stopping,
            shared=self._shared,
            log=self._log,
        )
        self._lifecycle: ScopeLifecycle | None = None
        self._deliveries: DeliveryPath | None = None

    @property
    def superseded(self) -> bool:
        """Whether another worker's fence took every scope (the daemon then stops)."""
        return bool(self._scopes) and all(s.superseded for s in self._scopes.values())

    @property
    def store(self) -> JournalStoreBase:
        if self._store is None:
            raise RuntimeError("the daemon has not started")
        return self._store

    async def wait_ready(self) -> None:
        """Returns once every scope is loaded and consuming."""
        await self._broker.ready.wait()

    def request_stop(self, failure: OctoError | None = None) -> None:
        """Begin a graceful stop (what SIGTERM does); with ``failure``, :meth:`run`
        raises it once stopped (the first one given), so the command exits with
        its status (storage: 4) and a supervisor restarts the worker."""
        if failure is not None and self._failure is None:
            self._failure = failure
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
                    connection=self._broker.connection,
                    stopping=self._stopping,
                )
            )
            try:
                await self._broker.serve(
                    deliver=self._path().on_message,
                    outbox=self._scopes_lifecycle(),
                    drain=self._drain,
                )
            finally:
                watchdog.cancel()
                queues.cancel()
        finally:
            await self._shutdown()
        if self._failure is not None:
            raise self._failure

    async def _start(self) -> None:
        config = self.config
        config.check_key_roles()  # the key files' problems before anything else
        keys = config.scope_keys()
        config.storage_keyring()
        config.data_keyring()
        self._adapters = self._load_adapters().with_default_deadline(
            config.adapters.deadline_seconds
        )
        if not config.shared_journal:
            # A missing state directory whose parent is missing too is refused
            # (InvalidConfiguration): a mistyped path, not a fresh journal.
            create_state_directories(config)
        self._store = configured_store(config, on_batch=self.hooks.after_transaction)
        lifecycle = self._lifecycle = ScopeLifecycle(
            self._scopes,
            store=self._store,
            adapters=self._adapters,
            limits=self._limits,
            hooks=self.hooks,
            supersession=self._supersession,
            broker=self._broker,
            publisher=self._broker.publisher,
            spawn=self._spawn,
            request_stop=self.request_stop,
            shared=self._shared,
            log=self._log,
        )
        self._deliveries = DeliveryPath(
            store=self._store,
            adapters=self._adapters,
            limits=self._limits,
            hooks=self.hooks,
            scopes=lifecycle,
            publisher=self._broker.publisher,
            stopping=self._stopping,
            log=self._log,
        )
        for scope_config in config.scopes:
            scope = ServedScope(
                scope_config.name,
                keys[scope_config.name],
                asyncio.Semaphore(scope_config.max_concurrency),
                frozenset(scope_config.reply_queues),
            )
            self._scopes[scope.name] = scope
            try:
                if self._shared:
                    # Standby until the broker makes this worker the queue's
                    # single active consumer; the scope's rows are
                    # checked against its sealed head now, so a start fails
                    # closed as the SQLite start does.
                    await self.store.verify_scope(scope.name)
                    await self.store.load_scope(scope.name)  # what an activation reads
                    scope.standby = True
                    self.hooks.on_scope_role(scope.name, False)
                else:
                    await lifecycle.load(scope)
            except OctoError as exc:
                # A scope whose rows are not its sealed head's (rollback_detected)
                # or that cannot be read stops the start: fail closed, say which.
                self._log.error("scope_load_failed", scope=scope.name, error=exc.code)
                raise
        self._log.info(
            "worker_started",
            scopes=len(self._scopes),
            adapters=self._adapters.tools(),
            broker=config.redacted_broker_url(),
        )

    def _scopes_lifecycle(self) -> ScopeLifecycle:
        if self._lifecycle is None:
            raise RuntimeError("the daemon has not started")
        return self._lifecycle

    def _path(self) -> DeliveryPath:
        if self._deliveries is None:
            raise RuntimeError("the daemon has not started")
        return self._deliveries

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

    async def _drain(self) -> None:
        """Stop consuming, then let running handlers finish within the grace period.

        Runs while the connection is still open (when there is one), so the
        handlers that finish can still ack, publish their replies and mark
        them published. Deliveries that had not started never start (see
        ``_on_message``): unacked, the broker redelivers them.
        """
        self._notifier.stopping()
        self._stopping.set()
        await self._broker.stop_consuming()
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
        # A reload under way records as poisoned the sessions whose refusals
        # could not do it themselves: let it finish, within
        # what is left of the grace period (at least a second). It waited for
        # the same handlers as the drain, so it is usually done at once.
        reloads = [s.reload for s in self._scopes.values() if s.reload and not s.reload.done()]
        if reloads:
            self._log.info("worker_waiting_for_reload", scopes=len(reloads))
            _, pending = await asyncio.wait(reloads, timeout=max(1.0, deadline - loop.time()))
            if pending:
                self._log.warning("worker_reload_cut", scopes=len(pending))
        for task in list(self._background):
            task.cancel()
        await self._broker.close()
        if self._store is not None:
            await self._store.close()
        self._log.info("worker_stopped")

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def healthy(self) -> bool:
        """Consuming every live scope, or (re)connecting; False when stalled."""
        if self._stopping.is_set():
            return True
        live = [s for s in self._scopes.values() if not s.superseded]
        if not self._broker.connected:
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
            await self._broker.sleep_or_stop(interval)
