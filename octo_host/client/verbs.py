"""The host client's verbs: record, dispatch, reconcile, compensate, look a compensation up.

This module owns the per-kind table of the requests the client sends, the one
path every request takes (persist the ledger, seal under the run lock,
register, fault point, publish, await the reply), the decision of which key
may be dispatched directly, and the one retry loop that reconciles or
repeats a request until a terminal state as :mod:`octo_host.reactions` says.

It must never send a second ``dispatch_operation`` for a key the worker may
have admitted (only ``unknown_operation`` on reconcile, for a key the ledger
still holds ``pending``, proves it never did), create a new key to make
progress, publish a frame before the ledger revision that justifies it is
durable, seal a compensation without a fresh approval, or log keys'
payloads, nonces or adapter text (ids, fingerprints, codes and states only).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from structlog.typing import FilteringBoundLogger

from octo_common.errors import (
    InvalidScopeKey,
    OctoError,
    SessionClosed,
    WorkerRequestRejected,
    WriteConflict,
)
from octo_common.frames import SessionAuthenticator
from octo_common.messages import (
    CompensationReconcileRequest,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    Resolution,
    WorkerMessage,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.runtime.faults import FaultInjector
from octo_common.states import (
    TERMINAL_KINDS,
    OperationStatus,
    Pending,
    StateKind,
    WorkerOperationState,
)
from octo_common.transport import PublishChannelClosed
from octo_host.client.broker import HostBroker
from octo_host.client.runs import MAX_WRITE_ATTEMPTS, HostRun, RunCache
from octo_host.client.sessions import HostSession, ReplyCut, ReplyTimedOut, SessionRegistry
from octo_host.client.settings import ClientSettings
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.engine import OutboundFrame, WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperationLedger
from octo_host.reactions import Reaction, rejection_reaction

__all__ = ["HostVerbs", "new_request_id"]

# Consecutive unanswered requests after which the session itself is suspect
# (a refused open or a dead-lettered session shows up only as silence).
_TIMEOUTS_BEFORE_NEW_SESSION: Final = 3

# The one kill point of the host (OCTO_FAULT, see octo_common.runtime.faults).
_HOST_FAULT_POINT: Final = "host.after_ledger_commit"
_INTENT_FAULT_POINT: Final = "host.after_compensation_intent"


@dataclass(frozen=True, slots=True)
class _Kind:
    """How the client sends one kind of request (its reply: ``WorkflowEngine.apply_reply``)."""

    message_type: str
    """The request's message type: the key it is counted under in ``HostClient.published``."""
    request_id_prefix: str
    binds_route: bool = False
    """The key is bound to the session's scope, durably, before the first publish."""


# One row per kind (a new kind is a row here, in the engine's table and in the reactions').
_KINDS: Final[Mapping[RequestKind, _Kind]] = {
    RequestKind.DISPATCH: _Kind("dispatch_operation", "d", binds_route=True),
    RequestKind.RECONCILE: _Kind("reconcile_operation", "r"),
    RequestKind.COMPENSATE: _Kind("compensate_operation", "c"),
    RequestKind.RECONCILE_COMPENSATION: _Kind("reconcile_compensation", "k"),
}
_KIND_OF_REQUEST: Final[Mapping[type, RequestKind]] = {
    OperationDispatchRequest: RequestKind.DISPATCH,
    OperationReconcileRequest: RequestKind.RECONCILE,
    OperationCompensationRequest: RequestKind.COMPENSATE,
    CompensationReconcileRequest: RequestKind.RECONCILE_COMPENSATION,
}


class _SentBefore(Exception):
    """Internal to :meth:`HostVerbs.dispatch`: the key may have been sent; reconcile it."""


def new_request_id(kind: RequestKind) -> str:
    """A fresh request id for a request of ``kind``."""
    return f"{_KINDS[kind].request_id_prefix}-{int(time.time())}-{secrets.token_hex(6)}"


class HostVerbs:
    """The verbs of one host client, over its sessions, runs and broker."""

    def __init__(
        self,
        engine: WorkflowEngine,
        sessions: SessionRegistry,
        runs: RunCache,
        broker: HostBroker,
        settings: ClientSettings,
        log: FilteringBoundLogger,
    ) -> None:
        self._engine = engine
        self._sessions = sessions
        self._runs = runs
        self._broker = broker
        self._settings = settings
        self._log = log
        self._faults = FaultInjector()

    async def send(
        self,
        session: HostSession,
        outbound: OutboundFrame[Any],
    ) -> WorkerMessage:
        """Publish a frame built by the engine and return the authenticated reply.

        The reply is routed by correlation id and opened with the session's
        authenticator; it is not applied to any ledger (the verbs do that).
        Raises :class:`ReplyTimedOut` when nothing arrives in time.
        """
        if session.closed:
            raise SessionClosed(session.session_id)
        await self._broker.wait_connected()
        request_id = outbound.request.request_id
        waiter = self._sessions.register(session, request_id, None, outbound.request, None)
        message_type = _KINDS[_KIND_OF_REQUEST[type(outbound.request)]].message_type
        try:
            await self._broker.publish(session, outbound.frame, request_id, kind=message_type)
        except BaseException:
            session._waiters.pop(request_id, None)
            raise
        message: WorkerMessage = await self._sessions.await_reply(session, request_id, waiter)
        return message

    async def record_operation(
        self,
        run: HostRun,
        step_id: str,
        tool: str,
        payload: ToolPayload,
        nonce: bytes,
        *,
        operation_key: str | None = None,
        scope: str | None = None,
    ) -> str:
        """``HostClient.record_operation`` (its docstring is the contract)."""
        if scope is not None and not self._sessions.has_key(scope):
            raise InvalidScopeKey("missing")  # no key configured for this scope
        data = canonical_operation_input_bytes(payload)
        async with run._lock:
            for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
                # Decided on the ledger as stored: after a lost compare-and-swap, the
                # other host's intent for this step has the same derived key, and
                # recording it again raises DuplicateOperationKey.
                candidate = run._ledger.copy()
                if operation_key is None:
                    key = self._engine.record_derived_operation(
                        run.plan, candidate, step_id, tool, data, nonce
                    )
                else:
                    key = operation_key
                    self._engine.record_operation(run.plan, candidate, step_id, tool, key, data)
                routes = None
                if scope is not None:
                    routes = await self._runs.routes_with(run, key, scope)
                if await self._persisted(run, candidate, routes, attempt):
                    break
            run._unsent.add(key)
        # Per operation at debug: its one info line is the verb's outcome.
        self._log.debug("operation_recorded", run=run.name, operation_key=key, tool=tool)
        return key

    async def _persisted(
        self,
        run: HostRun,
        candidate: WorkflowOperationLedger,
        routes: dict[str, str] | None,
        attempt: int,
    ) -> bool:
        """Write ``candidate``; False when another host's write came first and the
        decision is to be taken again on the ledger the run now holds (the last
        attempt raises the ``WriteConflict``)."""
        try:
            await self._runs.persist_locked(run, candidate, routes)
        except WriteConflict:
            if attempt >= MAX_WRITE_ATTEMPTS:
                self._log.error("ledger_write_conflict", run=run.name, attempts=attempt)
                raise
            self._log.info("ledger_write_retried", run=run.name, attempt=attempt)
            return False
        return True

    async def record_compensation(
        self,
        run: HostRun,
        target: WorkflowCompensationTarget,
        payload: ToolPayload,
        nonce: bytes,
    ) -> str:
        """Record the one compensation intent (both verifiers run) and persist it."""
        data = canonical_operation_input_bytes(payload)
        async with run._lock:
            for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
                # As for an operation: the other host's intent is found on the stored
                # ledger (CompensationAlreadyRecorded), never a second one recorded.
                candidate = run._ledger.copy()
                compensation_key = self._engine.record_derived_compensation_with_action_verifier(
                    run.plan, candidate, target, data, nonce
                )
                if await self._persisted(run, candidate, None, attempt):
                    break
        self._faults.reach(_INTENT_FAULT_POINT)
        self._log.info(
            "compensation_recorded",
            run=run.name,
            operation_key=target.operation_key,
            compensation_key=compensation_key,
        )
        return compensation_key

    async def _send_prepared(
        self,
        session: HostSession,
        run: HostRun,
        kind: RequestKind,
        build: Any,
    ) -> OperationStatus:
        """Check the ledger is durable, seal (``build``), register, fault point, publish,
        await the reply.

        ``build(auth) -> OutboundFrame`` runs under the run lock on the durable
        ledger (every change is persisted before the run adopts it;
        :meth:`RunCache.require_durable` refuses any other), so an approval and
        its sealing see one revision,
        and a decision to send sees the ledger it is made from. While the
        broker reconnects, it first waits for the connection (at most one
        publish timeout, else ``BrokerUnavailable``). A publish cut by a lost
        connection raises :class:`ReplyCut`: the frame may have reached the
        worker, so it is never published again; the caller reconciles.
        """
        if session.closed:
            raise SessionClosed(session.session_id)
        await self._broker.wait_connected()
        async with run._lock:
            self._runs.require_durable(run)
            outbound = build(session.authenticator)
            request = outbound.request
            row = _KINDS[kind]
            if row.binds_route:
                # Durable before the first publish of the key, never changed.
                await self._runs.bind_route(run, request.operation_key, session.scope)
            waiter = self._sessions.register(session, request.request_id, kind, request, run)
        self._faults.reach(_HOST_FAULT_POINT)
        try:
            await self._broker.publish(
                session, outbound.frame, request.request_id, kind=row.message_type
            )
        except PublishChannelClosed:
            # Kept, given up on: a copy that did reach the worker is still applied.
            waiter.abandoned = True
            raise ReplyCut(request.request_id) from None
        except asyncio.CancelledError:
            # The caller left before the confirm, not before the broker: the
            # frame may be at the worker, so its reply is still applied.
            waiter.abandoned = True
            raise
        except BaseException:
            session._waiters.pop(request.request_id, None)
            raise
        state: OperationStatus = await self._sessions.await_reply(
            session, request.request_id, waiter
        )
        return state

    async def _dispatch_once(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        payload: ToolPayload,
        unknown: WorkerRequestRejected | None = None,
    ) -> OperationStatus:
        """One ``dispatch_operation``, decided under the run lock.

        Without ``unknown``, only a ``pending`` key this run recorded and never
        sent goes out; any other raises :class:`_SentBefore`. With ``unknown``
        (the worker's ``unknown_operation`` for the key), only a key the ledger
        still holds ``pending`` goes out; for any other the ledger says the
        worker saw the key and its journal has forgotten it, and a new dispatch
        could run the effect twice: ``unknown`` is raised (fail closed).
        """
        request_id = new_request_id(RequestKind.DISPATCH)

        def build(auth: SessionAuthenticator) -> OutboundFrame[OperationDispatchRequest]:
            state = run.state(operation_key)
            if unknown is None:
                if state != StateKind.PENDING or operation_key not in run._unsent or run._detached:
                    raise _SentBefore()
            elif state != StateKind.PENDING:
                self._log.error(
                    "dispatch_refused",
                    run=run.name,
                    operation_key=operation_key,
                    ledger_state=state.value,
                    code=unknown.rejection_code,
                )
                raise unknown
            outbound = self._engine.prepare_authenticated_operation_dispatch(
                run.plan, run._ledger, operation_key, payload, request_id, auth
            )
            run._unsent.discard(operation_key)
            return outbound

        return await self._send_prepared(session, run, RequestKind.DISPATCH, build)

    async def _reconcile_once(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        data: bytes | None,
        resolution: Resolution | None = None,
    ) -> OperationStatus:
        request_id = new_request_id(RequestKind.RECONCILE)

        def build(auth: SessionAuthenticator) -> OutboundFrame[OperationReconcileRequest]:
            return self._engine.prepare_authenticated_operation_reconciliation(
                run.plan, run._ledger, operation_key, data, request_id, auth, resolution=resolution
            )

        return await self._send_prepared(session, run, RequestKind.RECONCILE, build)

    async def _compensate_once(
        self,
        session: HostSession,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
    ) -> OperationStatus:
        data = canonical_operation_input_bytes(dispatch.payload)

        def build(auth: SessionAuthenticator) -> OutboundFrame[OperationCompensationRequest]:
            # A fresh approval right before sealing.
            approval = self._engine.approve_compensation(run.plan, run._ledger, target, data, auth)
            return self._engine.prepare_authenticated_operation_compensation(
                run.plan, run._ledger, target, dispatch, approval, auth
            )

        return await self._send_prepared(session, run, RequestKind.COMPENSATE, build)

    async def _reconcile_compensation_once(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        resolution: Resolution | None = None,
    ) -> OperationStatus:
        request_id = new_request_id(RequestKind.RECONCILE_COMPENSATION)

        def build(auth: SessionAuthenticator) -> OutboundFrame[CompensationReconcileRequest]:
            # A lookup performs no effect: no verifier, no approval, no input.
            return self._engine.prepare_authenticated_compensation_reconciliation(
                run.plan, run._ledger, operation_key, request_id, auth, resolution=resolution
            )

        return await self._send_prepared(session, run, RequestKind.RECONCILE_COMPENSATION, build)

    # -- verbs ---------------------------------------------------------------------------

    async def dispatch(
        self, session: HostSession, run: HostRun, operation_key: str, payload: ToolPayload
    ) -> WorkerOperationState:
        """``HostClient.dispatch`` (its docstring is the contract)."""
        session = session.current()
        data = canonical_operation_input_bytes(payload)
        try:
            state = await self._dispatch_once(session, run, operation_key, payload)
        except _SentBefore:
            return await self.settle(session, run, operation_key, data, payload, None)
        except (ReplyTimedOut, ReplyCut) as exc:
            return await self.settle(session, run, operation_key, data, payload, exc)
        except WorkerRequestRejected as exc:
            reaction = rejection_reaction(RequestKind.DISPATCH, exc.rejection_code)
            if reaction is not Reaction.RECONCILE and reaction is not Reaction.NEW_SESSION:
                raise
            return await self.settle(session, run, operation_key, data, payload, exc)
        self._log.info(
            "operation_observed", run=run.name, operation_key=operation_key, state=state.kind.value
        )
        return state

    async def reconcile(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        input: ToolPayload | bytes | None,
    ) -> WorkerOperationState:
        """``HostClient.reconcile`` (its docstring is the contract)."""
        session = session.current()
        if isinstance(input, ToolPayload):
            return await self.settle(
                session,
                run,
                operation_key,
                canonical_operation_input_bytes(input),
                None,
                None,
            )
        return await self.settle(session, run, operation_key, input, None, None)

    async def settle(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        data: bytes | None,
        payload: ToolPayload | None,
        cause: OctoError | None,
    ) -> WorkerOperationState:
        """Reconcile ``operation_key`` until a terminal state or the attempts run out.

        With ``payload``, ``unknown_operation`` (proof that the worker never
        admitted the key) lets the same key be dispatched again while the
        ledger still says ``pending``; for a key in any other state it is
        raised (the ledger says the worker did admit it).
        """
        timeouts = 1 if isinstance(cause, ReplyTimedOut) else 0
        new_session = False
        if isinstance(cause, WorkerRequestRejected):
            code = cause.rejection_code
            self._log.info("request_rejected", run=run.name, operation_key=operation_key, code=code)
            new_session = rejection_reaction(RequestKind.DISPATCH, code) is Reaction.NEW_SESSION

        async def reconcile(session: HostSession, number: int) -> OperationStatus:
            return await self._reconcile_once(session, run, operation_key, data)

        last, _ = await self._repeat(
            RequestKind.RECONCILE,
            session,
            run,
            operation_key,
            reconcile,
            payload,
            timeouts=timeouts,
            new_session=new_session,
        )
        self._log.info(
            "operation_observed",
            run=run.name,
            operation_key=operation_key,
            state=last.kind.value,
            ledger_state=run.state(operation_key).value,
        )
        return last

    async def resolve(
        self, session: HostSession, run: HostRun, key: str, resolution: Resolution
    ) -> WorkerOperationState:
        """Send an operator's decision for ``key`` (an operation key, or a compensation's
        ``cmp-`` key) and apply the worker's answer like a lookup's: the state its
        journal then holds (the decision, or a terminal state it already held)."""
        session = session.current()
        compensated = run.ledger.compensated_operation(key) if run.operation(key) is None else None
        if compensated is None:

            async def operation(session: HostSession, number: int) -> OperationStatus:
                return await self._reconcile_once(session, run, key, None, resolution)

            last, _ = await self._repeat(RequestKind.RECONCILE, session, run, key, operation, None)
        else:
            original = compensated.operation_key

            async def compensation(session: HostSession, number: int) -> OperationStatus:
                return await self._reconcile_compensation_once(session, run, original, resolution)

            kind = RequestKind.RECONCILE_COMPENSATION
            last, _ = await self._repeat(kind, session, run, original, compensation, None)
        self._log.info("resolution_observed", run=run.name, key=key, state=last.kind.value)
        return last

    async def compensate(
        self,
        session: HostSession,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
    ) -> WorkerOperationState:
        """``HostClient.compensate`` (its docstring is the contract)."""

        async def attempt(session: HostSession, number: int) -> OperationStatus:
            # A new request id for every repetition; the key and input stay.
            sent = dispatch
            if number:
                sent = WorkflowCompensationDispatch(
                    new_request_id(RequestKind.COMPENSATE), dispatch.payload
                )
            return await self._compensate_once(session, run, target, sent)

        last, _ = await self._repeat(
            RequestKind.COMPENSATE, session.current(), run, target.operation_key, attempt, None
        )
        self._log.info(
            "compensation_observed",
            run=run.name,
            operation_key=target.operation_key,
            state=last.kind.value,
        )
        return last

    async def reconcile_compensation(
        self, session: HostSession, run: HostRun, operation_key: str
    ) -> WorkerOperationState:
        """``HostClient.reconcile_compensation`` (its docstring is the contract)."""
        state, _ = await self.look_up_compensation(session, run, operation_key)
        return state

    async def look_up_compensation(
        self, session: HostSession, run: HostRun, operation_key: str
    ) -> tuple[WorkerOperationState, str | None]:
        """Look the compensation of ``operation_key`` up until a terminal state or the
        attempts run out; returns the last state observed and, when it is not
        terminal, the code of what left it so (a refusal, or ``reply_timed_out``).

        ``unknown_compensation`` (the worker never admitted the ``cmp-`` key) and
        every refusal the reactions table fails closed on are raised as
        :class:`WorkerRequestRejected`.
        """

        async def attempt(session: HostSession, number: int) -> OperationStatus:
            return await self._reconcile_compensation_once(session, run, operation_key)

        last, cause = await self._repeat(
            RequestKind.RECONCILE_COMPENSATION,
            session.current(),
            run,
            operation_key,
            attempt,
            None,
        )
        operation = run.operation(operation_key)
        compensation = None if operation is None else operation.compensation
        self._log.info(
            "compensation_observed",
            run=run.name,
            operation_key=operation_key,
            compensation_key=None if compensation is None else compensation.compensation_key,
            state=last.kind.value,
            ledger_state=None if compensation is None else compensation.state.value,
            lookup=True,
        )
        return last, cause

    async def _repeat(
        self,
        kind: RequestKind,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        attempt: Callable[[HostSession, int], Awaitable[OperationStatus]],
        same_key: ToolPayload | None,
        *,
        timeouts: int = 0,
        new_session: bool = False,
    ) -> tuple[WorkerOperationState, str | None]:
        """Run ``attempt`` (a request of ``kind``) until a terminal state or the attempts
        run out; returns the last state observed (``Pending`` if none) and, unless the
        last attempt observed a state, the code of what ended it (the refusal's code,
        or ``reply_timed_out``).

        A timeout, a connection lost while the request was out
        (``ReplyCut``), or a refusal the reactions table answers with
        ``RECONCILE``, leads to the next attempt (same key); ``NEW_SESSION``, or
        three timeouts in a row, first replaces the session. ``DISPATCH_SAME_KEY``
        dispatches ``operation_key`` again with the payload ``same_key``, in
        the same attempt, if one is given (the dispatch itself refuses unless
        the ledger still holds the key ``pending``). Any other refusal is raised
        (``COMPENSATE_SAME_KEY`` among them: only the caller holds the inverse input).
        """
        last: WorkerOperationState = Pending()
        cause: str | None = None
        for number in range(self._settings.max_attempts):
            if number:
                await self._backoff(number)
            if new_session or timeouts >= _TIMEOUTS_BEFORE_NEW_SESSION:
                reason = "rejection" if new_session else "timeouts"
                session = await self._sessions.replace(session, reason)
                new_session, timeouts = False, 0
            session = session.current()
            try:
                state = await attempt(session, number)
            except ReplyTimedOut as exc:
                timeouts += 1
                cause = exc.code
                continue
            except ReplyCut as cut:
                cause = cut.code  # the session is not suspect: the broker lost the connection
                continue
            except WorkerRequestRejected as exc:
                code = exc.rejection_code
                cause = code
                self._log.info(
                    "request_rejected", run=run.name, operation_key=operation_key, code=code
                )
                reaction = rejection_reaction(kind, code)
                if reaction is not Reaction.DISPATCH_SAME_KEY or same_key is None:
                    new_session = _new_session_or_raise(reaction, exc)
                    continue
                # Admission precedes every effect: the worker never saw the key.
                # Another verb may have replaced the session meanwhile.
                session = session.current()
                try:
                    state = await self._dispatch_once(
                        session, run, operation_key, same_key, unknown=exc
                    )
                except ReplyTimedOut as again_timeout:
                    timeouts += 1
                    cause = again_timeout.code
                    continue
                except ReplyCut as cut:
                    cause = cut.code
                    continue
                except WorkerRequestRejected as again:
                    cause = again.rejection_code
                    reaction = rejection_reaction(RequestKind.DISPATCH, again.rejection_code)
                    new_session = _new_session_or_raise(reaction, again)
                    continue
            timeouts = 0
            last, cause = state, None
            if state.kind in TERMINAL_KINDS:
                break
        return last, cause

    async def _backoff(self, attempt: int) -> None:
        settings = self._settings
        delay = min(settings.backoff_initial * (2 ** (attempt - 1)), settings.backoff_max)
        await asyncio.sleep(delay)


def _new_session_or_raise(reaction: Reaction, refusal: WorkerRequestRejected) -> bool:
    """True to go on in a new session, False to go on in this one; else ``refusal`` is raised."""
    if reaction is Reaction.NEW_SESSION:
        return True
    if reaction is Reaction.RECONCILE:
        return False
    raise refusal
