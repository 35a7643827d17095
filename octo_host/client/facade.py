"""``HostClient``: the host's public client, one object over the client's parts (H§16).

This module owns the client's lifecycle (start, close) and its public
methods, each handed to the part that does the work:

* :mod:`~octo_host.client.broker`: the connection, confirmed publishes and
  the reply consumer;
* :mod:`~octo_host.client.sessions`: sessions and the requests waiting on them;
* :mod:`~octo_host.client.runs`: each run's durable ledger and routes;
* :mod:`~octo_host.client.verbs`: record, dispatch, reconcile, compensate,
  look a compensation up;
* :mod:`~octo_host.client.replies`: routing and applying replies;
* :mod:`~octo_host.client.recovery`: ``recover`` after a restart.

It must never hold behaviour of its own beyond wiring the parts and the
order of ``start`` and ``close``, or import :mod:`octo_worker`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import structlog

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityManifest
from octo_common.messages import WorkerMessage
from octo_common.payload import ToolPayload
from octo_common.states import WorkerOperationState
from octo_host.client.broker import HostBroker
from octo_host.client.recovery import Recovery, RecoverySummary
from octo_host.client.replies import ReplyRouter
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.settings import ClientSettings
from octo_host.client.verbs import HostVerbs
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.engine import OutboundFrame, WorkflowEngine
from octo_host.plan import WorkflowPlan
from octo_host.store import AuthenticatedStore

__all__ = ["HostClient"]

_log = structlog.get_logger("octo.host.client")


class HostClient:
    """The host's broker client and durable-run driver (H§16).

    ``reply_timeout``, ``publish_timeout``, ``max_attempts`` and
    ``max_cached_runs`` may be changed at any time; every part reads them.
    """

    def __init__(
        self,
        url: str,
        *,
        host_id: str,
        scope_keys: Mapping[str, ScopeKey],
        store: AuthenticatedStore,
        engine: WorkflowEngine | None = None,
        reply_timeout: float = 10.0,
        publish_timeout: float = 10.0,
        max_attempts: int = 6,
        backoff_initial: float = 0.1,
        backoff_max: float = 2.0,
        max_cached_runs: int = 4096,
    ) -> None:
        self.host_id = host_id
        self.store = store
        self.engine = engine or WorkflowEngine()
        self._settings = ClientSettings(
            reply_timeout=reply_timeout,
            publish_timeout=publish_timeout,
            max_attempts=max(1, max_attempts),
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            max_cached_runs=max(1, max_cached_runs),
        )
        log = _log.bind(host=host_id)
        self._log = log
        self._broker = HostBroker(url, host_id, self._settings, log)
        self._sessions = SessionRegistry(scope_keys, self._broker, self._settings, log)
        self._runs = RunCache(store, self.engine, self._settings, log)
        self._replies = ReplyRouter(self.engine, self._sessions, self._runs, self._broker, log)
        self._verbs = HostVerbs(
            self.engine, self._sessions, self._runs, self._broker, self._settings, log
        )
        self._recovery = Recovery(self._verbs, self._runs, self._sessions, log)

    # -- settings and counters ----------------------------------------------------------

    @property
    def reply_queue(self) -> str:
        """This host's reply queue, ``octo.v5.reply.<host-id>``."""
        return self._broker.reply_queue

    @property
    def connection_name(self) -> str:
        """The ``connection_name`` client property of this client's broker connections."""
        return self._broker.connection_name

    @property
    def reconnects(self) -> int:
        """How often the client connected again after losing its connection."""
        return self._broker.reconnects

    @property
    def published(self) -> Counter[str]:
        """Frames published, by message type (observability)."""
        return self._broker.published

    @property
    def reply_timeout(self) -> float:
        return self._settings.reply_timeout

    @reply_timeout.setter
    def reply_timeout(self, value: float) -> None:
        self._settings.reply_timeout = value

    @property
    def publish_timeout(self) -> float:
        return self._settings.publish_timeout

    @publish_timeout.setter
    def publish_timeout(self, value: float) -> None:
        self._settings.publish_timeout = value

    @property
    def max_attempts(self) -> int:
        return self._settings.max_attempts

    @max_attempts.setter
    def max_attempts(self, value: int) -> None:
        self._settings.max_attempts = value

    @property
    def max_cached_runs(self) -> int:
        return self._settings.max_cached_runs

    @max_cached_runs.setter
    def max_cached_runs(self, value: int) -> None:
        self._settings.max_cached_runs = value

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, declare the reply queue and start consuming replies.

        Raises :class:`~octo_host.amqp.BrokerUnavailable` when the broker cannot
        be reached, a channel cannot be opened or the queue cannot be declared
        or consumed (the client is closed again). Once started, the client
        reconnects by itself after a lost connection (closed by the broker or
        an operator, a lost reply channel or consumer), with backoff from
        ``backoff_initial`` to ``backoff_max``, and consumes the same reply
        queue again. Verbs wait for it (at most one publish timeout each); a
        request cut by the loss is reconciled on the new connection, never
        sent again as it was.
        """
        try:
            await self._broker.start(self._replies.on_delivery, self._sessions.fail_waiting)
        except BaseException:
            await self.close()
            raise
        self._log.info("host_client_started", reply_queue=self.reply_queue)

    async def close(self) -> None:
        """Close this client's idle sessions at the worker, stop consuming, let
        reply handlers finish, close the connection. Idempotent.

        A session with a request still awaited is left open (see
        ``SessionRegistry.close_idle``). Callers still waiting time out on
        their own and then fail to publish.
        """
        await self._sessions.close_idle()
        await self._broker.stop_consuming()
        await self._replies.wait_idle(5.0)
        await self._broker.disconnect()

    async def __aenter__(self) -> HostClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- sessions (H§16.1, H§16.2) ------------------------------------------------------

    async def open_session(self, scope: str, manifest: CapabilityManifest) -> HostSession:
        """Open a fresh session: new id, new nonce, derived key; no reply is expected.

        A scope this client has no key for raises ``InvalidScopeKey("missing")``.
        """
        return await self._sessions.open(scope, manifest)

    async def close_session(self, session: HostSession) -> None:
        """Seal and publish ``close_session``; later sends on it are refused locally."""
        await self._sessions.close(session)

    async def publish(
        self,
        session: HostSession,
        frame: bytes,
        correlation_id: str | None,
        *,
        kind: str = "frame",
        attempts: int = 3,
    ) -> None:
        """Low level: ``HostBroker.publish`` on this client's channel. No reply is
        awaited and the session's state is not checked (``send`` and the verbs
        refuse closed sessions); publish a durable request only once the ledger
        revision behind it is durable."""
        await self._broker.publish(session, frame, correlation_id, kind=kind, attempts=attempts)

    async def send(self, session: HostSession, outbound: OutboundFrame[Any]) -> WorkerMessage:
        """Publish a frame built by the engine and return the authenticated reply.

        The reply is routed by correlation id and opened with the session's
        authenticator; it is not applied to any ledger (the verbs do that).
        Raises :class:`~octo_host.client.ReplyTimedOut` when nothing arrives in time.
        """
        return await self._verbs.send(session, outbound)

    # -- runs and verbs -----------------------------------------------------------------

    async def load_run(
        self, name: str, plan: WorkflowPlan, *, minimum_revision: int = 0
    ) -> HostRun:
        """Load (or create at revision 0) the ledger of run ``name`` for ``plan``.

        The ledger is validated for the plan and against the rollback watermark:
        the highest revision this client stored for the run, or ``minimum_revision``.
        """
        return await self._runs.load(name, plan, minimum_revision=minimum_revision)

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
        """Record a pending operation (derived ``op-`` key unless one is given) and
        persist the ledger; returns the key.

        With ``scope`` (a scope this client has a key for), the key is also
        bound to that scope in the same commit: the binding ``dispatch``
        would otherwise write, in a commit of its own, before the key's first
        publish. A later dispatch of the key to another scope is refused with
        ``DispatchScopeMismatch``, as is this call when the key is already
        bound to another scope (then nothing is written).
        """
        return await self._verbs.record_operation(
            run, step_id, tool, payload, nonce, operation_key=operation_key, scope=scope
        )

    async def record_compensation(
        self,
        run: HostRun,
        target: WorkflowCompensationTarget,
        payload: ToolPayload,
        nonce: bytes,
    ) -> str:
        """Record the one compensation intent (both verifiers run) and persist it."""
        return await self._verbs.record_compensation(run, target, payload, nonce)

    async def dispatch(
        self, session: HostSession, run: HostRun, operation_key: str, payload: ToolPayload
    ) -> WorkerOperationState:
        """Dispatch a recorded operation and return its observed state.

        Only a ``pending`` key this run recorded and never sent is dispatched
        directly. Any other key (read from the store, sent before, no longer
        ``pending``) is reconciled instead, and dispatched again only if the
        worker answers ``unknown_operation`` while the ledger still says
        ``pending``; otherwise that refusal is raised. A timeout, a broker
        connection lost while the request was out, or a
        ``pending``/``indeterminate``/``adapter_error`` refusal leads to
        reconciliation of the same key (H§16.4), on the new connection.
        """
        return await self._verbs.dispatch(session, run, operation_key, payload)

    async def reconcile(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        input: ToolPayload | bytes,
    ) -> WorkerOperationState:
        """Reconcile a recorded operation (retries, new sessions as H§16.4 says).

        ``unknown_operation`` is raised as ``WorkerRequestRejected``: the
        worker never admitted the key (or has forgotten it); ``dispatch``
        sends it again only while the ledger says ``pending``.
        """
        return await self._verbs.reconcile(session, run, operation_key, input)

    async def compensate(
        self,
        session: HostSession,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
    ) -> WorkerOperationState:
        """Send the recorded compensation under a fresh approval; return its state.

        The engine refuses before anything is sealed when the original is not
        ``succeeded`` or a verifier says no. A timeout or a pending /
        indeterminate / adapter refusal repeats the same ``cmp-`` key and input
        under a new approval (the worker answers from its journal).
        """
        return await self._verbs.compensate(session, run, target, dispatch)

    async def reconcile_compensation(
        self, session: HostSession, run: HostRun, operation_key: str
    ) -> WorkerOperationState:
        """Look up the recorded compensation of ``operation_key`` at the worker (D11).

        ``reconcile_compensation`` names the compensation exactly as the ledger
        recorded it; the worker's adapter looks it up by its ``cmp-`` key and
        performs nothing, so no approval, no verifier and no inverse input are
        needed. The answer moves a ``pending`` or ``running`` compensation to
        what was observed (never a terminal one) and is persisted before this
        returns; retries and new sessions as for ``reconcile``. Returns the
        last state observed (``Pending`` when every attempt was refused with a
        code that asks to try again, such as ``adapter_error`` from an adapter
        without the lookup). ``unknown_compensation`` (the worker never
        admitted the key: ``compensate`` may send it) is raised as
        ``WorkerRequestRejected``, as is every refusal that fails closed.
        """
        return await self._verbs.reconcile_compensation(session, run, operation_key)

    async def recover(
        self,
        run_name: str,
        plan: WorkflowPlan,
        scope: str,
        manifest: CapabilityManifest,
        *,
        inputs: Mapping[str, ToolPayload] | None = None,
        compensations: Mapping[str, tuple[WorkflowCompensationTarget, ToolPayload]] | None = None,
        minimum_revision: int = 0,
    ) -> RecoverySummary:
        """After a host restart: load and validate the ledger, open a fresh session,
        reconcile every operation and compensation that is not terminal (H§16.5, D11).

        The ledger keeps only fingerprints, so the host supplies each
        unfinished operation's payload in ``inputs`` (by operation key);
        operations without one are reported in ``unresolved``. An operation
        the worker never admitted (``unknown_operation``) is dispatched again
        under its same key if the ledger still says ``pending``.

        Every compensation that is not terminal is first looked up
        (``reconcile_compensation``, D11): no input, approval or verifier is
        needed, and the observed state is persisted before anything else.
        When the lookup leaves it unresolved and ``compensations`` holds its
        target and inverse payload (by operation key), the same ``cmp-`` key
        is sent under a fresh approval: when the worker never admitted it
        (``unknown_compensation``, only while the ledger still says
        ``pending``), or when the lookup could not settle it (an adapter
        without the lookup answers ``adapter_error``: the worker then answers
        from its journal). A compensation still unfinished is reported in
        ``unresolved``, with the code of what left it so in ``errors``.
        A key whose recovery raises an :class:`OctoError`
        (a verifier's refusal, a wrong input, a worker refusal, a failed
        publish or ledger write) is reported in ``unresolved`` with its code in
        ``errors``, and recovery goes on with the next key. The fresh session
        is handed to the caller in the summary; if recovery itself fails, it
        is closed before the error is raised.
        """
        return await self._recovery.recover(
            run_name,
            plan,
            scope,
            manifest,
            inputs=inputs,
            compensations=compensations,
            minimum_revision=minimum_revision,
        )
