"""The host client's reply path: route each reply to its waiting request and apply it.

For each delivery on the host's reply queue, :class:`ReplyRouter`:

1. passes it through the inbound gate (:func:`octo_common.inbound.gate`: size,
   ``octo-session``, the session lookup, ``octo-scope``, the nonce header);
   a refusal, an unknown session or another nonce is dead-lettered; a reply
   of a retired session is opened with its kept authenticator and applied
   like a live one when it answers a request kept unanswered (dropped when
   it answers nothing kept: a repeated answer);
2. finds the waiting request by correlation id (none: a late or repeated
   answer to a request this session sent is dropped, anything else is
   dead-lettered as unexpected);
3. opens and applies the reply with the engine under the run lock, persists
   the ledger (compare-and-swap; a write that lost to another host sharing
   the ledger applies the same answer again to what the store holds, a
   bounded number of times) and only then acks the delivery and releases
   the caller; a reply the ledger does not take is settled as
   :func:`octo_host.reactions.reply_reaction` says.

It must never ack a reply before the ledger change it carries is durable,
apply a reply to a run other than the one loaded for its name, or log frame
bodies, keys or nonces.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Final

from structlog.typing import FilteringBoundLogger

from octo_common.errors import (
    DuplicateFrame,
    InvalidAuthenticationTag,
    InvalidCompensationStateTransition,
    InvalidStateTransition,
    OctoError,
    ReplyCorrelationMismatch,
    UnexpectedMessage,
    WriteConflict,
)
from octo_common.frames import SessionAuthenticator
from octo_common.inbound import Refused, Unrouted, gate
from octo_common.messages import WorkerMessage, message_type, request_id_of
from octo_common.runtime.consumer import InboundMessage
from octo_common.runtime.faults import FaultInjector
from octo_common.states import Running
from octo_host.client.broker import HostBroker
from octo_host.client.runs import MAX_WRITE_ATTEMPTS, HostRun, RunCache
from octo_host.client.sessions import HostSession, RetiredRequest, SessionRegistry, Waiter
from octo_host.engine import WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.reactions import ReplyReaction, reply_reaction

__all__ = ["ReplyRouter"]

# The crash tests' kill point between applying a reply and persisting it
# (OCTO_FAULT, see octo_common.runtime.faults).
_APPLIED_FAULT_POINT: Final = "host.after_reply_applied"


class ReplyRouter:
    """Routes the replies of one host client's sessions to their waiting requests."""

    def __init__(
        self,
        engine: WorkflowEngine,
        sessions: SessionRegistry,
        runs: RunCache,
        broker: HostBroker,
        log: FilteringBoundLogger,
    ) -> None:
        self._engine = engine
        self._sessions = sessions
        self._runs = runs
        self._broker = broker
        self._log = log
        self._tasks: set[asyncio.Task[None]] = set()
        self._faults = FaultInjector()

    def on_delivery(self, message: InboundMessage) -> None:
        """The reply consumer's callback: each delivery is handled in a task of its own."""
        task = asyncio.get_running_loop().create_task(self._handle(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait_idle(self, timeout: float) -> None:
        """Let the replies being handled finish, for at most ``timeout`` seconds."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def _handle(self, message: InboundMessage) -> None:
        try:
            await self._route(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Unexpected: keep a copy for the operator rather than redelivering
            # it forever (the reply queue has no delivery limit).
            self._log.error("reply_handling_failed", error=type(exc).__name__)
            with contextlib.suppress(Exception):
                await self._broker.dead_letter(message, "host_internal_error")

    async def _route(self, message: InboundMessage) -> None:
        routed = gate(len(message.body), message.headers, self._sessions.by_id.get)
        if isinstance(routed, Refused):
            await self._broker.dead_letter(message, routed.reason)
            return
        if isinstance(routed, Unrouted):
            retired = self._sessions.retired.get(routed.session_id)
            if retired is None:
                await self._broker.dead_letter(message, "unknown_session")
                return
            key = (routed.session_id, str(message.correlation_id))
            kept = self._sessions.retired_requests.get(key)
            if kept is None:
                await self._retired_reply(retired, message)
                return
            await self._apply_retired(retired, message, kept, key)
            return
        if not routed.nonce_matches:
            await self._broker.dead_letter(message, InvalidAuthenticationTag.code)
            return
        session = routed.session
        correlation_id = message.correlation_id
        waiter = None if correlation_id is None else session._waiters.get(correlation_id)
        if waiter is None:
            await self._unrequested(session, message)
            return
        kind = waiter.kind
        if kind is None or waiter.run is None:
            await self._deliver_raw(session, message, waiter, str(correlation_id))
            return
        request_id = str(correlation_id)

        def forget() -> None:
            session._waiters.pop(request_id, None)

        await self._apply(session.authenticator, message, waiter, kind, request_id, forget)

    async def _open_or_settle(
        self, authenticator: SessionAuthenticator, message: InboundMessage
    ) -> WorkerMessage | None:
        """Open a reply; None once it is settled (a duplicate acked, a bad frame dead-lettered)."""
        try:
            opened: WorkerMessage = authenticator.open(message.body)
        except DuplicateFrame:
            await self._broker.ack(message)
            return None
        except OctoError as exc:
            await self._broker.dead_letter(message, exc.code)
            return None
        return opened

    async def _drop_reply(
        self, session_id: str, opened: WorkerMessage, message: InboundMessage, reason: str
    ) -> None:
        """An authentic reply with nothing to apply: logged, acked."""
        self._log.info(
            "reply_dropped",
            session_id=session_id,
            type=message_type(opened),
            request_id=message.correlation_id,
            reason=reason,
        )
        await self._broker.ack(message)

    async def _retired_reply(
        self, authenticator: SessionAuthenticator, message: InboundMessage
    ) -> None:
        """A reply of a session let go of that answers nothing kept: an authentic one is
        a repeated answer to a request already answered (dropped); a forged one is
        dead-lettered."""
        opened = await self._open_or_settle(authenticator, message)
        if opened is None:
            return
        await self._drop_reply(authenticator.session_id, opened, message, "session_retired")

    async def _apply_retired(
        self,
        authenticator: SessionAuthenticator,
        message: InboundMessage,
        kept: RetiredRequest,
        key: tuple[str, str],
    ) -> None:
        """A late reply to a retired session's unanswered request: applied like a live one.

        The run is loaded again by name and plan (the retired session let go
        of the object); the reply is authenticated with the retired session's
        authenticator and goes through the same checks, transition and
        persist as a live reply (:meth:`_apply`).
        """
        try:
            run = await self._runs.load(kept.run_name, kept.plan)
        except OctoError as exc:
            # As for a ledger that cannot be written: a copy for the operator.
            self._log.error("ledger_load_failed", run=kept.run_name, error=exc.code)
            await self._broker.dead_letter(message, exc.code)
            return
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiter = Waiter(kept.kind, kept.request, run, future, abandoned=True)

        def forget() -> None:
            self._sessions.retired_requests.pop(key, None)

        await self._apply(authenticator, message, waiter, kept.kind, key[1], forget)

    async def _unrequested(self, session: HostSession, message: InboundMessage) -> None:
        """An authenticated reply nobody waits for: a duplicate is dropped."""
        opened = await self._open_or_settle(session.authenticator, message)
        if opened is None:
            return
        if message.correlation_id is not None and message.correlation_id in session._sent:
            # The worker answers each copy of a request (a publish retried
            # after a lost confirm, a redelivery), and a reply may come after
            # its caller gave up (the key is then reconciled): not an attack,
            # nothing to apply twice.
            await self._drop_reply(session.session_id, opened, message, "answered_or_abandoned")
            return
        self._log.warning(
            "reply_unrequested",
            session_id=session.session_id,
            type=message_type(opened),
            request_id=message.correlation_id,
        )
        await self._broker.dead_letter(message, UnexpectedMessage.code)

    async def _deliver_raw(
        self,
        session: HostSession,
        message: InboundMessage,
        waiter: Waiter,
        correlation_id: str,
    ) -> None:
        opened = await self._open_or_settle(session.authenticator, message)
        if opened is None:
            return
        if request_id_of(opened) != correlation_id:
            # The correlation id is not authenticated: a reply whose sealed
            # request id is another's never reaches this waiter.
            self._log.warning(
                "reply_correlation_mismatch",
                session_id=session.session_id,
                type=message_type(opened),
                request_id=correlation_id,
            )
            await self._broker.dead_letter(message, ReplyCorrelationMismatch.code)
            return
        session._waiters.pop(correlation_id, None)
        await self._broker.ack(message)
        waiter.resolve(opened)

    async def _apply(
        self,
        authenticator: SessionAuthenticator,
        message: InboundMessage,
        waiter: Waiter,
        kind: RequestKind,
        correlation_id: str,
        forget: Callable[[], None],
    ) -> None:
        """Open and apply a reply to ``waiter``'s request, persist, then ack and release.

        ``forget`` unregisters the request (it is answered, or refused for good).
        """
        run = waiter.run
        assert run is not None
        if run._detached:
            # Dropped from the cache while its request was out: when the run was
            # loaded again, the reply goes to that object, or its next write
            # would meet this one's revision (WriteConflict).
            run = self._runs.current(run)
        async with run._lock:
            try:
                result = self._engine.open_reply(kind, waiter.request, authenticator, message.body)
            except OctoError as exc:
                await self._not_applied(message, waiter, kind, correlation_id, run, exc, forget)
                return
            for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
                candidate = run._ledger.copy()
                try:
                    state = self._engine.apply_opened_reply(
                        kind, run.plan, candidate, waiter.request, result
                    )
                except OctoError as exc:
                    await self._not_applied(message, waiter, kind, correlation_id, run, exc, forget)
                    return
                await self._faults.reach_flushed(_APPLIED_FAULT_POINT)
                try:
                    await self._runs.persist_locked(run, candidate)
                except WriteConflict as exc:
                    # Another host wrote the run (a shared ledger): the run now holds
                    # what the store holds; apply the same answer to that.
                    if attempt < MAX_WRITE_ATTEMPTS:
                        self._log.info("reply_reapplied", run=run.name, attempt=attempt)
                        continue
                    await self._persist_failed(message, waiter, run, exc, forget)
                    return
                except OctoError as exc:
                    await self._persist_failed(message, waiter, run, exc, forget)
                    return
                break
        forget()
        await self._broker.ack(message)
        # Per reply at debug: the verb logs the operation's outcome at info.
        self._log.debug(
            "reply_applied",
            run=run.name,
            type=kind,
            request_id=correlation_id,
            operation_key=getattr(waiter.request, "operation_key", None),
            state=state.kind.value,
            revision=run.revision,
            late=waiter.abandoned,
        )
        waiter.resolve(state)

    async def _persist_failed(
        self,
        message: InboundMessage,
        waiter: Waiter,
        run: HostRun,
        error: OctoError,
        forget: Callable[[], None],
    ) -> None:
        """The ledger change a reply carries cannot be made durable: a copy for the operator."""
        forget()
        self._log.error("ledger_persist_failed", run=run.name, error=error.code)
        await self._broker.dead_letter(message, error.code)
        waiter.fail(error)

    async def _not_applied(
        self,
        message: InboundMessage,
        waiter: Waiter,
        kind: RequestKind,
        correlation_id: str,
        run: HostRun,
        error: OctoError,
        forget: Callable[[], None],
    ) -> None:
        """Settle an authentic reply the ledger did not take, as :func:`reply_reaction` says."""
        match reply_reaction(kind, error):
            case ReplyReaction.DROP:
                await self._broker.ack(message)
            case ReplyReaction.KEEP_WAITING:
                # Stay registered, abandoned, so the outcome is applied;
                # _register bounds these.
                waiter.fail(error)
                waiter.abandoned = True
                await self._broker.ack(message)
            case ReplyReaction.REFUSED:
                forget()
                waiter.fail(error)
                await self._broker.ack(message)
            case ReplyReaction.STALE if isinstance(
                error, InvalidStateTransition | InvalidCompensationStateTransition
            ):
                forget()
                await self._broker.ack(message)
                # A warning: after an operator's decision (octo-host resolve) a
                # `running` is also what an effect still going on would send.
                self._log.warning(
                    "reply_stale",
                    run=run.name,
                    type=kind,
                    request_id=correlation_id,
                    operation_key=getattr(waiter.request, "operation_key", None),
                    state=error.observed.value,
                    ledger_state=error.current.value,
                )
                # The caller sees what it was told.
                waiter.resolve(Running())
            case ReplyReaction.FAIL_CLOSED:
                forget()
                await self._refused_by_ledger(message, waiter, correlation_id, error)
            case _:
                await self._broker.dead_letter(message, error.code)

    async def _refused_by_ledger(
        self,
        message: InboundMessage,
        waiter: Waiter,
        correlation_id: str,
        error: OctoError,
    ) -> None:
        """Authentic but inconsistent with the ledger: fail closed (dead-letter)."""
        self._log.error(
            "reply_refused_by_ledger",
            run=waiter.run.name if waiter.run is not None else None,
            request_id=correlation_id,
            error=error.code,
        )
        await self._broker.dead_letter(message, error.code)
        waiter.fail(error)
