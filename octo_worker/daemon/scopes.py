"""The scopes a worker serves: their state and their lifecycle.

Owns :class:`ServedScope` (one scope's fence, sessions in memory, closed
session ids, handlers under way, consumer) and :class:`ScopeLifecycle`, the
part of ``WorkerDaemon`` that loads a scope under a freshly reserved fence
and restores its live sessions, republishes its outbox and releases the rows
the broker confirmed, reloads it after a failed commit (pause, drain, new
fence, reload, mark poisoned, resume), lets closed
sessions go, and gives the scope up when another worker's fence refused a
commit (it never takes the fence back).

What the status of a session makes the daemon do is decided by
:mod:`octo_worker.daemon.routes`. It must never decide what a frame gets,
reserve a fence after a fence rejection, or log keys or frames.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from octo_common.errors import FencingTokenRejected, OctoError, StorageBackendError, StorageError
from octo_common.frames import ScopeKey
from octo_common.runtime import amqp
from octo_common.transport import PublishChannelClosed, PublishFailed, build_worker_reply
from octo_worker.hooks import WorkerHooks
from octo_worker.journal import unresolved_record
from octo_worker.session.session import WorkerSession
from octo_worker.storage.interface import WorkerJournalLease

if TYPE_CHECKING:
    from octo_worker.adapters.contract import WorkerAdapterRegistry
    from octo_worker.session.session import WorkerSessionLimits
    from octo_worker.storage.base import JournalStoreBase

__all__ = [
    "CLOSED_REMEMBERED",
    "OutboxPublisher",
    "ScopeBroker",
    "ScopeLifecycle",
    "ServedScope",
    "Supersession",
    "remember_closed",
]

# Closed session ids remembered per scope (about 100 bytes each); beyond it
# the oldest is forgotten and looked up in the store again when needed.
CLOSED_REMEMBERED: Final = 65536


def remember_closed(scope: ServedScope, session_id: str) -> None:
    scope.closed.pop(session_id, None)
    scope.closed[session_id] = None
    if len(scope.closed) > CLOSED_REMEMBERED:
        del scope.closed[next(iter(scope.closed))]


@dataclass
class ServedScope:
    """What the daemon holds of one scope it serves: fence, sessions, handlers, consumer."""

    name: str
    key: ScopeKey
    semaphore: asyncio.Semaphore
    # Reply queues the configuration allows for sessions that sealed none.
    reply_queues: frozenset[str] = frozenset()
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
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    # Handlers past the pause gate: a reload waits for these only.
    active: set[asyncio.Task[Any]] = field(default_factory=set)
    # Sessions whose open_session is being handled: a frame for one of them
    # waits for the open's outcome (the session, or None if it failed).
    opening: dict[str, asyncio.Future[WorkerSession | None]] = field(default_factory=dict)
    # open_session deliveries received and not yet handled, by session id, with
    # the delivery: a frame of that session received after it waits for it too,
    # even when it would reach the routing first (a delivery that waited for
    # an activation resumes after one that arrived once the gate opened).
    opens_received: dict[str, tuple[object, asyncio.Future[None]]] = field(default_factory=dict)
    consumer_channel: amqp.Channel | None = None
    consumer_tag: str | None = None
    running: asyncio.Event = field(default_factory=asyncio.Event)
    reloading: bool = False
    superseded: bool = False
    # A commit of the scope met another worker's fence (``Supersession``): the
    # scope is given up (``superseded``) after the delivery that saw it.
    fence_refused: bool = False
    # A shared journal: the scope waits for the broker to make this
    # worker its single active consumer; its first delivery then activates
    # it (a fresh fence, the sessions restored, the outbox republished).
    # Until then it reserves, commits and publishes nothing.
    standby: bool = False
    activation: asyncio.Task[None] | None = None
    # Held by an activation and by a reload for their whole run: one at a
    # time loads the scope (fence, sessions) and republishes its outbox.
    lifecycle: asyncio.Lock = field(default_factory=asyncio.Lock)

    def serving(self) -> bool:
        """Neither in standby nor superseded: the scope may publish and release now."""
        return not (self.standby or self.superseded)


# Which scopes another worker took ------------------------------------------------


class Supersession(WorkerHooks):
    """Notes the scopes whose commits another worker's fence refused.

    A commit refused by a fence this daemon reserved itself (a reload
    overtook it) is not a supersession.
    """

    def __init__(self, scopes: Mapping[str, ServedScope]) -> None:
        self._served = scopes
        self.scopes: set[str] = set()

    def on_commit_failed(self, scope: str, error: OctoError) -> None:
        if isinstance(error, FencingTokenRejected) and not self._own_fence(scope, error.current):
            self.scopes.add(scope)
            served = self._served.get(scope)
            if served is not None:
                served.fence_refused = True

    def _own_fence(self, scope_name: str, fence: int) -> bool:
        scope = self._served.get(scope_name)
        if scope is None:
            return False
        # While a reservation is under way its token is not known yet; if
        # another worker took the scope meanwhile, the next commit under the
        # new lease meets that worker's fence and gives the scope up.
        return scope.reserving or (scope.lease is not None and scope.lease.token == fence)


class ScopeBroker(Protocol):
    """What a scope's lifecycle asks of the broker link."""

    @property
    def connected(self) -> bool: ...

    @property
    def consume_channel(self) -> amqp.Channel | None: ...

    async def start_consuming(self, scope: ServedScope) -> None: ...

    async def stop_consuming(self, scope: ServedScope | None = None) -> None: ...


class OutboxPublisher(Protocol):
    """What a scope's lifecycle republishes its outbox through (the broker link's publisher)."""

    async def publish(self, envelope: Any, *, await_reconnect: bool = True) -> None: ...


class ScopeLifecycle:
    """Each served scope's lifecycle for ``WorkerDaemon`` (see the module docstring).

    Built by the daemon once its store and adapters are ready, with the
    scopes it serves, the broker link (consume), its publisher and the
    daemon's ``spawn`` and ``request_stop``.
    """

    def __init__(
        self,
        scopes: dict[str, ServedScope],
        *,
        store: JournalStoreBase,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks,
        supersession: Supersession,
        broker: ScopeBroker,
        publisher: OutboxPublisher,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        request_stop: Callable[[OctoError | None], None],
        shared: bool,
        log: Any,
    ) -> None:
        self._scopes = scopes
        self._store = store
        self._adapters = adapters
        self._limits = limits
        self._hooks = hooks
        self._supersession = supersession
        self._broker = broker
        self._publisher = publisher
        self._spawn = spawn
        self._request_stop = request_stop
        # The journal is shared (PostgreSQL): scopes start as standby.
        self._shared = shared
        self._log = log

    async def load(self, scope: ServedScope, *, open_gate: bool = True) -> None:
        """Reserve a fence, then rebuild the sessions from the store.

        Closed sessions are not read at all (the store skips the ones its
        commits marked closed): restoring, or even reading, every session a
        long-lived worker ever closed would cost start-up time and memory
        without end. One with replies still in the outbox is restored, so they
        can be republished and released. A frame for a session not in memory
        looks its status up in the store (``_unknown_session_reason``), and
        the ids found closed are remembered (``scope.closed``, bounded).
        """
        store = self._store
        scope.reserving = True
        try:
            scope.lease = await store.reserve_fence(scope.name)
        finally:
            scope.reserving = False
        # What ``check`` and ``journal verify`` run too (one path).
        _, in_outbox, persisted = await store.load_scope(scope.name)
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
                hooks=self._hooks,
            )
            sessions[session_id] = session
        if closed:
            # Closed before the store marked closed sessions: mark them now,
            # so the next start does not read them again.
            try:
                await store.mark_closed(scope.name, closed)
            except OctoError as exc:
                self._log.warning("closed_sessions_mark_failed", scope=scope.name, error=exc.code)
        scope.sessions = sessions
        scope.closed = closed
        while len(scope.closed) > CLOSED_REMEMBERED:
            del scope.closed[next(iter(scope.closed))]
        await self._note_unresolved(scope)
        if open_gate:
            scope.running.set()
        self._log.info("scope_loaded", scope=scope.name, sessions=len(sessions), closed=len(closed))

    async def _note_unresolved(self, scope: ServedScope) -> None:
        """Hand the hooks every key the journal holds unresolved, with its row's last
        write, so that a key a crash left pending is counted at once (one read of
        the scope's rows per load)."""
        try:
            rows = await self._store.list_records(scope.name)
            metadata = await self._store.scope_metadata(scope.name)
        except OctoError as exc:
            self._log.warning("unresolved_keys_not_read", scope=scope.name, error=exc.code)
            return
        now = time.time()
        since: dict[str, float] = {}
        for record, _ in rows:
            if unresolved_record(record):
                key = record.operation_key
                written = metadata.written(self._store.journal_items(scope.name, key))
                since[key] = now if written is None else written
        self._hooks.after_unresolved_loaded(scope.name, since)

    def superseded(self, scope: ServedScope) -> bool:
        """Whether a commit of ``scope`` met another worker's fence (see ``Supersession``)."""
        return scope.fence_refused or scope.name in self._supersession.scopes

    async def republish_outbox(self, scope: ServedScope) -> list[WorkerSession]:
        """Every committed reply not yet confirmed, oldest first.

        Returns the sessions whose rows the broker confirmed: the caller
        releases those rows (:meth:`_release_outbox`) rather than leaving them
        to each session's next commit, which an idle, abandoned or closed
        session never makes.
        """
        if not scope.serving():
            return []  # another worker may own the scope: publish nothing
        entries = await self._store.load_outbox(scope.name)
        self._hooks.after_outbox_loaded(scope.name, len(entries))
        published = 0
        finished: dict[str, WorkerSession] = {}
        for entry in entries:
            if not scope.serving():
                # The connection was lost meanwhile: nothing more is published,
                # and nothing is released under a fence another worker may have
                # replaced (the owner republishes these rows).
                return []
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
                await self._publisher.publish(envelope, await_reconnect=False)
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
        if not scope.serving():
            return []
        return list(finished.values())

    def release_outbox_later(self, scope: ServedScope, sessions: list[WorkerSession]) -> None:
        """Run :meth:`_release_outbox` as a handler of the scope.

        Registered in ``scope.active`` from its creation, so a reload (which
        waits for every active handler before it reserves a new fence) never
        runs under it; none is started while a reload is pending (the reload
        republishes and releases itself).
        """
        if not sessions or scope.reloading or scope.superseded:
            return
        task = self._spawn(self.release_outbox(scope, sessions))
        scope.active.add(task)
        task.add_done_callback(scope.active.discard)

    async def release_outbox(
        self, scope: ServedScope, sessions: list[WorkerSession], *, handlers: int = 0
    ) -> None:
        """Delete the confirmed outbox rows of ``sessions`` now.

        The rows of a session otherwise go in its next commit, and an idle or
        abandoned session never makes one, nor does a closed one: without this
        its last replies would be republished at every start and reconnect, for
        ever. Run only where the scope's lease cannot change underneath (a
        registered handler, or the reload itself). Not for a session whose
        commit failed: its scope is being reloaded, and the reload releases
        the rows of the session it restores. Nothing is released while the
        scope is in standby or superseded: its lease may be another worker's
        past, and a commit under it would only meet that worker's fence.
        """
        store = self._store
        for session in sessions:
            if not scope.serving():
                return
            if scope.sessions.get(session.session_id) is not session:
                continue  # a reloaded scope has its own copy of the session
            if session.commit_failed:
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
                if self.superseded(scope):
                    await self.give_up(scope)  # another worker holds the fence
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

    async def _let_go_if_done(
        self, scope: ServedScope, session: WorkerSession, handlers: int
    ) -> None:
        """Hold a closed session by its id only once nothing of it is pending.

        ``handlers``: how many of its deliveries the caller is (1 from its last
        handler, 0 after a republish). A reply of it still in the outbox (its
        publish failed) keeps it, so the next reconnect republishes that reply.
        """
        sid = session.session_id
        if scope.handling.get(sid, 0) > handlers:
            return
        try:
            # This session's rows alone (indexed): a close costs what the
            # session left in the outbox, not the scope's whole outbox.
            entries = await self._store.load_outbox(scope.name, session_id=sid)
        except Exception:
            return  # kept; a later delivery or start tries again
        if entries:
            return
        if scope.handling.get(sid, 0) > handlers:
            return  # another delivery of it started meanwhile (dead-lettered: closed)
        self._forget_closed(scope, session)

    def _forget_closed(self, scope: ServedScope, session: WorkerSession) -> None:
        """Hold a closed session by its id only, from now on (its last handler calls this)."""
        if scope.sessions.get(session.session_id) is session:
            del scope.sessions[session.session_id]
            remember_closed(scope, session.session_id)

    async def unknown_session_reason(self, scope: ServedScope, session_id: str) -> str:
        """Why a frame of a session not in memory is dead-lettered: closed, or unknown.

        Looked up in the store (one authenticated row): closed sessions are
        not loaded at start. Nothing of the frame is acted on either way; a
        session the store holds live but the start did not load (its closed
        mark was edited) is logged and refused as unknown.
        """
        try:
            status = await self._store.session_status(scope.name, session_id)
        except OctoError as exc:
            self._log.error(
                "session_lookup_failed", scope=scope.name, session=session_id, error=exc.code
            )
            return "unknown_session"
        if status == "closed":
            remember_closed(scope, session_id)
            return "session_closed"
        if status is not None:
            self._log.error(
                "session_not_loaded", scope=scope.name, session=session_id, status=status
            )
        return "unknown_session"

    async def give_up(self, scope: ServedScope) -> None:
        if scope.superseded:
            return
        scope.superseded = True
        self._log.error(
            "scope_superseded",
            scope=scope.name,
            detail="another worker holds the scope's fence; this worker stops serving it",
        )
        await self._broker.stop_consuming(scope)
        if all(item.superseded for item in self._scopes.values()):
            self._log.error(
                "worker_superseded", detail="every scope is served by another worker; stopping"
            )
            self._request_stop(None)

    def stop_tampered(self, scope: ServedScope, failure: OctoError) -> None:
        """The journal's rows are not the loaded scope's (edited beside this worker): the
        request that met them was refused; stop with the storage status, fail closed."""
        self._log.error("journal_tampered", scope=scope.name, error=failure.code)
        self._request_stop(failure)

    def activate_later(self, scope: ServedScope, channel: amqp.Channel) -> asyncio.Task[None]:
        """The one activation of a standby scope at a time, started by a delivery on
        ``channel`` (a running one, maybe started on an earlier connection, is returned)."""
        if scope.activation is None or scope.activation.done():
            scope.activation = self._spawn(self._activate_scope(scope, channel))
        return scope.activation

    def _on_current_channel(self, channel: amqp.Channel) -> bool:
        """Whether ``channel`` is the open consume channel of the current connection."""
        return channel is self._broker.consume_channel and not channel.is_closed

    async def _activate_scope(self, scope: ServedScope, channel: amqp.Channel) -> None:
        """The broker made this worker the scope's active consumer: load the scope under
        a fresh fence and restore its sessions.

        A delivery on ``channel`` proves it for that connection only: the
        queue's single active consumer is this one, so any worker that served
        the scope before has lost its consumer. Handlers of an earlier
        connection finish first (their commits meet the fence they hold), then
        a fresh fence is reserved, the sessions are rebuilt from the shared
        store, the outbox is republished and released, and the gate opens.
        Exclusive with a reload (``scope.lifecycle``). The scope leaves
        standby only if ``channel`` is still the current, open consume
        channel once it is loaded: a connection lost meanwhile (another worker
        may have taken the queue and reserved a fence since) leaves it in
        standby, publishing and releasing nothing, until a delivery of a later
        connection activates it again. A scope whose commits another worker's
        fence refused is given up, never activated; a failure stops
        the worker (fail closed).
        """
        async with scope.lifecycle:
            scope.running.clear()
            try:
                while scope.active:
                    await asyncio.wait(list(scope.active))
                if scope.superseded or self.superseded(scope):
                    await self.give_up(scope)
                    return
                if not scope.standby or not self._on_current_channel(channel):
                    return  # already active, or that connection is gone
                await self.load(scope, open_gate=False)
                if not self._on_current_channel(channel):
                    self._log.warning(
                        "scope_activation_abandoned",
                        scope=scope.name,
                        detail="the connection was lost while the scope loaded; standby",
                    )
                    return
                scope.standby = False
                assert scope.lease is not None
                self._hooks.on_scope_role(scope.name, True)
                self._log.warning("scope_activated", scope=scope.name, fence=scope.lease.token)
                await self.release_outbox(scope, await self.republish_outbox(scope))
                if self.superseded(scope):
                    await self.give_up(scope)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                code = exc.code if isinstance(exc, OctoError) else type(exc).__name__
                self._log.error("scope_activation_failed", scope=scope.name, error=code)
                if self.superseded(scope):
                    await self.give_up(scope)
                else:
                    # Fail closed: the worker exits with the storage status, and
                    # a supervisor restarts it as a standby.
                    self._request_stop(_load_failure("activation", scope, exc))
            finally:
                scope.running.set()

    def stand_by(self) -> None:
        """A shared journal's scopes after a lost connection: standby until a delivery.

        Another worker may serve them meanwhile; what this one holds in memory
        is reloaded under a fresh fence when the broker makes it active again.
        """
        for scope in self._scopes.values():
            if not scope.superseded and not scope.standby:
                scope.standby = True
                self._hooks.on_scope_role(scope.name, False)

    def reload_later(self, scope: ServedScope) -> None:
        """Start the scope's reload unless one is under way."""
        if not scope.reloading:
            scope.reloading = True
            scope.reload = self._spawn(self.reload(scope))

    async def reload(self, scope: ServedScope) -> None:
        """Pause, drain, fresh fence, reload, mark poisoned, resume.

        On a shared journal the consumer is paused by the gate alone: cancelling
        it would hand the queue to a standby worker (single active consumer).
        Exclusive with an activation (``scope.lifecycle``). A scope in standby
        once its handlers are done reserves nothing (another worker may own it,
        and a fence reserved now would fence that owner out): its sessions in
        memory are dropped, and the activation that makes it active again
        loads them from the store under its own fence, as a restart would.
        """
        async with scope.lifecycle:
            try:
                scope.running.clear()
                if not self._shared:
                    await self._broker.stop_consuming(scope)
                # The handler that poisoned the session is done with it; wait for
                # every other running handler of the scope (their commits may fail too).
                while scope.active:
                    await asyncio.wait(list(scope.active))
                if scope.superseded or self.superseded(scope):
                    await self.give_up(scope)
                    return
                if scope.standby:
                    scope.sessions = {}
                    self._log.warning("scope_reload_left_to_activation", scope=scope.name)
                    return
                await self._reload_under_fresh_fence(scope)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                code = exc.code if isinstance(exc, OctoError) else type(exc).__name__
                self._log.error("scope_reload_failed", scope=scope.name, error=code)
                if self.superseded(scope):
                    await self.give_up(scope)
                else:
                    # Fail closed: the worker exits with the storage status, and
                    # a supervisor restarts it from durable state.
                    self._request_stop(_load_failure("reload", scope, exc))
            finally:
                scope.reloading = False
                scope.running.set()

    async def _reload_under_fresh_fence(self, scope: ServedScope) -> None:
        """The reload's fresh fence and reload for a scope this worker serves, then resume."""
        # Sessions poisoned in memory by a failed commit, with the sequence each
        # would seal next. Their refusals were committed before they were
        # published, which recorded most of them poisoned already; the others
        # (a refusal's own commit failed and it went out best-effort, or there
        # was none to send) are recorded so now, their outbound counter past
        # every sequence they sealed.
        poisoned = {
            sid: session.next_outgoing
            for sid, session in sorted(scope.sessions.items())
            if session.status == "poisoned" and session.commit_failed
        }
        # The gate stays shut until every poisoned session is marked
        # poisoned again (the caller opens it): a frame for one of them
        # must not meet the reloaded session while it still reads "open".
        await self.load(scope, open_gate=False)
        for session_id, reserve in poisoned.items():
            restored = scope.sessions.get(session_id)
            if restored is not None:
                # Past every sequence it sealed, its best-effort refusals included.
                await restored.persist_poisoned(self._store, reserve=reserve)
        self._log.warning("scope_reloaded", scope=scope.name, poisoned=sorted(poisoned))
        if self._broker.connected:
            await self.release_outbox(scope, await self.republish_outbox(scope))
            if self.superseded(scope):
                await self.give_up(scope)  # the release met another writer's fence
                return
            if not self._shared:
                await self._broker.start_consuming(scope)


def _load_failure(what: str, scope: ServedScope, exc: Exception) -> StorageError:
    """Why a scope's activation or reload stops the worker: its storage error, or one
    naming the failure (never its text)."""
    if isinstance(exc, StorageError):
        return exc
    code = exc.code if isinstance(exc, OctoError) else type(exc).__name__
    return StorageBackendError(f"scope {scope.name} {what} failed: {code}")
