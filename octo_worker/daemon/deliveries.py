"""The path of one delivery through the daemon: gate, status route, session, after.

Owns :class:`DeliveryPath`, the part of ``WorkerDaemon`` that takes one
delivery of a scope's queue, as a ``BrokerDelivery``
(:mod:`octo_worker.transport`: what the session acks, replies and
dead-letters through, without coming back here):

1. the scope's concurrency bound and pause gate;
2. the inbound gate (``octo_common.inbound.gate``): size, headers, session;
3. the route (``octo_worker.daemon.routes``): hand it to the session held
   in memory, open a session from an ``open_session``, or dead-letter it;
4. ``WorkerSession.handle`` (which may refuse it by the session's status
   and nonce), or ``WorkerSession.open``;
5. after the handling: release a closed session, reload a poisoned
   scope's sessions, give up a superseded scope.

It must never open a frame itself beyond telling an ``open_session`` apart,
answer a frame that did not authenticate, or log keys or frames.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from octo_common.errors import OctoError, SessionReplay
from octo_common.framecipher import is_envelope
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole, decode_frame
from octo_common.inbound import Refused, Routed, Unrouted, gate
from octo_common.messages import OpenSession
from octo_common.runtime import amqp
from octo_common.runtime.consumer import InboundMessage
from octo_common.transport import delivery_session_id, host_id_of_reply_queue
from octo_worker.daemon.routes import (
    AfterHandling,
    Route,
    after_handling,
    route_unknown,
)
from octo_worker.daemon.scopes import ScopeLifecycle, ServedScope, remember_closed
from octo_worker.session.session import Handled, WorkerSession
from octo_worker.transport import BrokerDelivery, ConfirmedPublisher

if TYPE_CHECKING:
    from octo_worker.adapters.contract import WorkerAdapterRegistry
    from octo_worker.hooks import WorkerHooks
    from octo_worker.session.session import WorkerSessionLimits
    from octo_worker.storage.base import JournalStoreBase

__all__ = ["DeliveryPath"]

# A delivery as the path hands it to a session (``session`` is the one it went to).
Handing = BrokerDelivery[WorkerSession]


class DeliveryPath:
    """One delivery's path for ``WorkerDaemon`` (see the module docstring).

    Built by the daemon once its store and adapters are ready; what happens
    to a scope after a handling is the scopes' lifecycle's, and every
    reply and dead-letter goes through the broker link's publisher.
    """

    def __init__(
        self,
        *,
        store: JournalStoreBase,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
        hooks: WorkerHooks,
        scopes: ScopeLifecycle,
        publisher: ConfirmedPublisher,
        stopping: asyncio.Event,
        log: Any,
    ) -> None:
        self._store = store
        self._adapters = adapters
        self._limits = limits
        self._hooks = hooks
        self._scopes = scopes
        self._publisher = publisher
        self._stopping = stopping
        self._log = log

    async def on_message(
        self,
        scope: ServedScope,
        message: InboundMessage,
        channel: amqp.Channel,
    ) -> None:
        # Called in the order the broker delivered: an open_session is noted
        # before any await, so a later frame of its session never overtakes it.
        received = _note_open(scope, message)
        try:
            await self._on_message(scope, message, channel)
        finally:
            if received is not None:
                _open_handled(scope, *received)

    async def _on_message(
        self,
        scope: ServedScope,
        message: InboundMessage,
        channel: amqp.Channel,
    ) -> None:
        async with scope.semaphore:
            # The broker delivers to the queue's single active consumer only:
            # this worker owns the scope now. An activation still running
            # for an earlier connection's delivery leaves the scope in standby;
            # this delivery then starts the one for its own connection.
            for _ in range(2):
                if not scope.standby or scope.superseded or channel.is_closed:
                    break
                if self._stopping.is_set():
                    break
                await asyncio.shield(self._scopes.activate_later(scope, channel))
            while not scope.running.is_set():
                await scope.running.wait()
            if self._stopping.is_set():
                return  # stopping: never started, never acked; the broker redelivers it
            if channel.is_closed:
                # Its channel is gone: the broker has put it back in the queue
                # (and may have handed the queue to another worker meanwhile).
                return
            if scope.superseded or scope.standby:
                # Another worker owns the scope now (or this one could not
                # take it): hand the delivery back, unhandled. A nack, not a
                # reject: no failure of this frame (RabbitMQ >= 4.3 does not
                # count it toward the delivery limit; older ones count every
                # return alike, a closed channel's too).
                with contextlib.suppress(Exception):
                    await message.nack(requeue=True)
                return
            delivery: Handing = BrokerDelivery(self._publisher, scope, message, channel)
            facts: Handled | None = None
            current = asyncio.current_task()
            if current is not None:
                scope.active.add(current)
            try:
                facts = await self._deliver(scope, message, delivery)
                handled = delivery.session
                if handled is not None and facts is None:
                    # Dead-lettered by its route, not handled: its status as it stands.
                    facts = Handled(handled.status, handled.commit_failed)
                if (
                    handled is not None
                    and facts is not None
                    and after_handling(
                        facts.status,
                        facts.commit_failed,
                        last_handler=scope.handling.get(handled.session_id) == 1,
                    )
                    is AfterHandling.LET_GO
                ):
                    # The last handler of a closed session: a reply confirmed
                    # after the close commit has no later commit to be deleted
                    # in, and nothing more of the session is needed in memory.
                    await self._scopes.release_outbox(scope, [handled], handlers=1)
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
            self._hooks.after_delivery(scope.name, delivery.outcome)
        await self._after_delivery(scope, delivery, facts)

    async def _deliver(
        self,
        scope: ServedScope,
        message: InboundMessage,
        delivery: Handing,
    ) -> Handled | None:
        """Route one delivery and hand it to its session; what the session was once it
        handled it (None when no session handled it)."""
        body = message.body
        routed = gate(len(body), message.headers, scope.sessions.get, scope=scope.name)
        if type(routed) is Refused:
            await delivery.dead_letter(routed.reason)
            return None
        if type(routed) is Routed:
            session: WorkerSession | None = routed.session
            session_id = routed.session.session_id
            key_nonce = routed.key_nonce
        else:
            assert type(routed) is Unrouted and routed.key_nonce is not None
            session = None
            session_id = routed.session_id
            key_nonce = routed.key_nonce
            while session is None:
                # The host gets no answer to open_session and may send the next
                # frame at once: wait for the open of this session in progress,
                # or received before this frame and not handled yet.
                # (shield: a cancelled waiter must not cancel the others' future.)
                waiting: asyncio.Future[Any] | None = scope.opening.get(session_id)
                if waiting is None:
                    received = scope.opens_received.get(session_id)
                    if received is None or received[0] is message:
                        break
                    waiting = received[1]
                await asyncio.shield(waiting)
                session = scope.sessions.get(session_id)
        # From the last lookup to registering an open in _open_session there is
        # no await, so no other handler can open this session id in between.
        opening = False
        # An envelope (a session's encrypted frame) is never an open_session.
        if not is_envelope(body) and (session is None or b"open_session" in body or b"\\u" in body):
            try:
                _, decoded, _, _ = decode_frame(body)
            except OctoError as exc:
                await delivery.dead_letter(exc.code)
                return None
            opening = isinstance(decoded, OpenSession)
        if session is None:
            # A forged reply_to could route replies into another queue.
            reply_queue = host_id_of_reply_queue(message.reply_to) is not None
            route = route_unknown(opening, session_id in scope.closed, reply_queue)
            if route is Route.OPEN:
                await self._open_session(scope, message, delivery, session_id, key_nonce)
            elif route is Route.LOOK_UP:
                await delivery.dead_letter(
                    await self._scopes.unknown_session_reason(scope, session_id)
                )
            else:
                await delivery.dead_letter(route.value)
            return None
        self._attach(scope, delivery, session)
        return await session.handle(
            body,
            self._store,
            delivery,
            opening=opening,
            nonce_matches=key_nonce == session.key_nonce,
        )

    async def _open_session(
        self,
        scope: ServedScope,
        message: InboundMessage,
        delivery: Handing,
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
                allowed_reply_queues=scope.reply_queues,
                store=self._store,
                lease=lease,
                adapters=self._adapters,
                limits=self._limits,
                hooks=self._hooks,
            )
            scope.sessions[session_id] = session
        except OctoError as exc:
            refused = exc.code
            if isinstance(exc, SessionReplay):
                # Its rows exist (closed: live ones are all in memory). A
                # replay of the same frame is refused from memory from now on.
                remember_closed(scope, session_id)
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

    @staticmethod
    def _attach(scope: ServedScope, delivery: Handing, session: WorkerSession) -> None:
        delivery.session = session
        sid = session.session_id
        scope.handling[sid] = scope.handling.get(sid, 0) + 1

    @staticmethod
    def _detach(scope: ServedScope, delivery: Handing) -> None:
        session = delivery.session
        if session is None:
            return
        sid = session.session_id
        left = scope.handling.get(sid, 0) - 1
        if left > 0:
            scope.handling[sid] = left
        else:
            scope.handling.pop(sid, None)

    async def _after_delivery(
        self, scope: ServedScope, delivery: Handing, facts: Handled | None
    ) -> None:
        if scope.fence_refused:
            await self._scopes.give_up(scope)
            return
        tampered = self._store.tampered
        if tampered is not None:
            self._scopes.stop_tampered(scope, tampered)
            return
        session = delivery.session
        if session is None:
            return
        if facts is None:  # its handling failed: its status as it stands
            facts = Handled(session.status, session.commit_failed)
        rule = after_handling(facts.status, facts.commit_failed, last_handler=False)
        if rule is AfterHandling.RELOAD:
            self._hooks.on_poisoned(scope.name, session.session_id)
            self._scopes.reload_later(scope)


def _note_open(
    scope: ServedScope, message: InboundMessage
) -> tuple[str, asyncio.Future[None]] | None:
    """Note a received open_session (the first one of its session id), before any await."""
    if b"open_session" not in message.body:
        return None
    session_id = delivery_session_id(message.headers or {})
    if session_id is None or session_id in scope.opens_received:
        return None
    handled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    scope.opens_received[session_id] = (message, handled)
    return session_id, handled


def _open_handled(scope: ServedScope, session_id: str, handled: asyncio.Future[None]) -> None:
    """The noted open_session is handled (opened, refused or handed back): its waiters go on."""
    noted = scope.opens_received.get(session_id)
    if noted is not None and noted[1] is handled:
        del scope.opens_received[session_id]
    if not handled.done():
        handled.set_result(None)
