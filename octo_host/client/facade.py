"""``HostClient``: the host's public client, one object over the client's parts.

This module owns the client's lifecycle (start, close) and its public
methods, each handed to the part that does the work:

* :mod:`~octo_host.client.broker`: the connection, confirmed publishes and
  the reply consumer;
* :mod:`~octo_host.client.sessions`: sessions and the requests waiting on them;
* :mod:`~octo_host.client.runs`: each run's durable ledger and routes;
* :mod:`~octo_host.client.verbs`: record, dispatch, reconcile, compensate,
  look a compensation up;
* :mod:`~octo_host.client.replies`: routing and applying replies;
* :mod:`~octo_host.client.recovery`: ``recover`` after a restart;
* :mod:`~octo_host.client.pools`: the sessions the client manages, a pool per scope;
* :mod:`~octo_host.client.shortcuts`: the verbs that take a run and a key instead
  of a session, ``execute`` and ``undo``.

``HostClient.from_config`` builds a client from ``host.toml`` (the file
``octo-host`` reads): keys, manifests, ledger store and compensation
verifiers, the store owned (opened by ``start``, closed by ``close``).

It must never hold behaviour of its own beyond wiring the parts and the
order of ``start`` and ``close``, or import :mod:`octo_worker`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from types import TracebackType
from typing import Any, overload

from octo_common.errors import InvalidConfiguration
from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityManifest
from octo_common.messages import Resolution, WorkerMessage
from octo_common.payload import ToolPayload
from octo_common.runtime.logs import library_logger
from octo_common.runtime.tls import TlsSettings
from octo_common.states import WorkerOperationState
from octo_host.client.broker import HostBroker
from octo_host.client.pools import PoolStats, SessionPools
from octo_host.client.recovery import Recovery, RecoverySummary
from octo_host.client.replies import ReplyRouter
from octo_host.client.retrying import Retries
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.settings import ClientSettings
from octo_host.client.shortcuts import CompensationVerifiers, PooledVerbs
from octo_host.client.verbs import HostVerbs
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.config import ConfiguredActionVerifier, ConfiguredGrantVerifier, load_config
from octo_host.engine import OutboundFrame, WorkflowEngine
from octo_host.plan import WorkflowPlan
from octo_host.policy import WorkflowCompensationPolicy
from octo_host.storage.postgres import PostgresLedgerStore
from octo_host.store import AuthenticatedStore, SqliteLedgerStore

__all__ = ["HostClient"]


class HostClient:
    """The host's broker client and durable-run driver.

    ``reply_timeout``, ``publish_timeout``, ``max_attempts`` and
    ``max_cached_runs`` may be changed at any time; every part reads them.

    ``manifests`` (scope -> manifest) lets the client manage sessions itself:
    the verbs called with a run and a key instead of a session, ``execute``
    and ``undo``, borrow one from the scope's pool (``session_rotate_after``,
    ``session_max_in_flight``, ``session_pool_size``: see ``SessionPools``).
    ``compensation_verifiers`` gives ``undo`` its grant and action verifiers.
    ``broker_tls`` (CA file, client certificate and key, server name) is
    how an ``amqps://`` URL's broker is verified and verifies this client.
    ``payload_codec`` (on by default) encrypts every frame of a new session
    after its ``open_session``, both ways, so the broker and its dead-letter
    queue hold no input, output or failure text.
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
        manifests: Mapping[str, CapabilityManifest] | None = None,
        compensation_verifiers: CompensationVerifiers | None = None,
        session_rotate_after: int = 768,
        session_max_in_flight: int = 256,
        session_pool_size: int = 4,
        payload_codec: bool = True,
        broker_tls: TlsSettings | None = None,
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
            session_rotate_after=max(1, session_rotate_after),
            session_max_in_flight=max(1, session_max_in_flight),
            session_pool_size=max(1, session_pool_size),
            payload_codec=payload_codec,
        )
        self._owned_store: SqliteLedgerStore | PostgresLedgerStore | None = None
        self._connect_timeout: float | None = None  # from_config: [broker] connect_timeout
        self._plans: dict[str, WorkflowPlan] = {}
        log = library_logger("octo.host.client").bind(host=host_id)
        self._log = log
        self._broker = HostBroker(
            url,
            host_id,
            self._settings,
            log,
            None if broker_tls is None else broker_tls.client_context(),
        )
        self._sessions = SessionRegistry(scope_keys, self._broker, self._settings, log)
        self._runs = RunCache(store, self.engine, self._settings, log)
        self._replies = ReplyRouter(self.engine, self._sessions, self._runs, self._broker, log)
        self._verbs = HostVerbs(
            self.engine, self._sessions, self._runs, self._broker, self._settings, log
        )
        retries = self._retries = Retries(self._verbs, self._runs, log)
        self._recovery = Recovery(self._verbs, self._runs, self._sessions, retries, log)
        self._pools = SessionPools(manifests or {}, self._sessions, self._settings, log)
        self._pooled = PooledVerbs(self._verbs, self._runs, self._pools, retries, log)
        self._pooled.verifiers = compensation_verifiers

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike[str],
        *,
        engine: WorkflowEngine | None = None,
        session_rotate_after: int = 768,
        session_max_in_flight: int = 256,
        session_pool_size: int = 4,
    ) -> HostClient:
        """A client configured by ``host.toml`` (the file ``octo-host`` reads), not started.

        Every ``[[scopes]]`` key, a pool per scope with ``[[grants]]`` (its
        manifest), the ledger store (``[ledger]`` or ``[storage]``; opened by
        ``start`` and closed by ``close``), the broker's timeouts and attempts,
        the ``[[plans]]`` (``load_run`` takes their names) and the configured
        compensation verifiers; the session tunables as for the constructor.
        Use it as ``async with HostClient.from_config(path) as client:``. A bad
        file raises ``InvalidConfiguration`` naming the key.
        """
        config = load_config(path)
        config.check_key_roles()
        scopes = [entry.name for entry in config.scopes]
        broker = config.broker

        def verifiers(
            original: ToolPayload | None,
        ) -> tuple[ConfiguredGrantVerifier, ConfiguredActionVerifier]:
            return ConfiguredGrantVerifier(config), ConfiguredActionVerifier(config, original)

        store = config.ledger_store()
        client = cls(
            config.broker_url(),
            host_id=config.host.host_id,
            scope_keys={scope: config.scope_key(scope) for scope in scopes},
            store=store,
            engine=engine,
            reply_timeout=broker.reply_timeout_seconds,
            publish_timeout=broker.publish_timeout_seconds,
            max_attempts=broker.max_attempts,
            backoff_initial=broker.backoff_initial_seconds,
            backoff_max=broker.backoff_max_seconds,
            manifests={
                scope: config.manifest(scope) for scope in scopes if config.grants_of(scope)
            },
            compensation_verifiers=verifiers,
            session_rotate_after=session_rotate_after,
            session_max_in_flight=session_max_in_flight,
            session_pool_size=session_pool_size,
            payload_codec=config.host.payload_codec,
            broker_tls=config.broker_tls(config.broker),
        )
        client._owned_store = store
        client._connect_timeout = broker.connect_timeout_seconds
        client._plans = {
            plan.name: client.engine.plan([step.step() for step in plan.steps])
            for plan in config.plans
        }
        return client

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
            if self._owned_store is not None:
                await self._owned_store.integrity_check()  # opens it, checks its rollback guard
            publish_timeout = self._settings.publish_timeout
            if self._connect_timeout is not None:
                # The connect timeout governs the start; the publish timeout publishes.
                self._settings.publish_timeout = min(publish_timeout, self._connect_timeout)
            try:
                await self._broker.start(self._replies.on_delivery, self._sessions.fail_waiting)
            finally:
                self._settings.publish_timeout = publish_timeout
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
        if self._owned_store is not None:
            await self._owned_store.close()

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

    # -- sessions ------------------------------------------------------

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
        self, name: str, plan: WorkflowPlan | str, *, minimum_revision: int = 0
    ) -> HostRun:
        """Load (or create at revision 0) the ledger of run ``name`` for ``plan``.

        ``plan`` is a plan built by ``engine.plan``, or the name of a
        configured ``[[plans]]`` entry (``from_config``). The ledger is
        validated for the plan and against the rollback watermark: the
        highest revision this client stored for the run, or ``minimum_revision``.
        """
        if isinstance(plan, str):
            named = self._plans.get(plan)
            if named is None:
                raise InvalidConfiguration(f"plans: no [[plans]] entry named {plan!r}")
            plan = named
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

    @overload
    async def dispatch(
        self, session: HostSession, run: HostRun, operation_key: str, payload: ToolPayload, /
    ) -> WorkerOperationState: ...

    @overload
    async def dispatch(
        self, run: HostRun, operation_key: str, payload: ToolPayload, /
    ) -> WorkerOperationState: ...

    async def dispatch(self, *args: Any) -> WorkerOperationState:
        """Dispatch a recorded operation and return its observed state.

        ``dispatch(session, run, key, payload)`` on a session of the caller's;
        ``dispatch(run, key, payload)`` on a session of the pool of the scope
        the key is bound to (``OperationScopeUnbound`` if it is bound to none).

        Only a ``pending`` key this run recorded and never sent is dispatched
        directly. Any other key (read from the store, sent before, no longer
        ``pending``) is reconciled instead, and dispatched again only if the
        worker answers ``unknown_operation`` while the ledger still says
        ``pending``; otherwise that refusal is raised. A timeout, a broker
        connection lost while the request was out, or a
        ``pending``/``indeterminate``/``adapter_error`` refusal leads to
        reconciliation of the same key, on the new connection.
        """
        if isinstance(args[0], HostRun):
            return await self._pooled.dispatch(*args)
        return await self._verbs.dispatch(*args)

    @overload
    async def reconcile(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        input: ToolPayload | bytes | None,
        /,
    ) -> WorkerOperationState: ...

    @overload
    async def reconcile(
        self, run: HostRun, operation_key: str, input: ToolPayload | bytes | None, /
    ) -> WorkerOperationState: ...

    async def reconcile(self, *args: Any) -> WorkerOperationState:
        """Reconcile a recorded operation (retries, new sessions as the reactions table says);
        without a session, on one of the pool of the key's scope.

        ``unknown_operation`` is raised as ``WorkerRequestRejected``: the
        worker never admitted the key (or has forgotten it); ``dispatch``
        sends it again only while the ledger says ``pending``. The request
        carries no input: ``input`` (None: what the ledger holds is enough)
        is only checked against the recorded fingerprint.
        """
        if isinstance(args[0], HostRun):
            return await self._pooled.reconcile(*args)
        return await self._verbs.reconcile(*args)

    async def resolve(
        self, session: HostSession, run: HostRun, key: str, resolution: Resolution
    ) -> WorkerOperationState:
        """Send an operator's decision for a stuck key (an operation key, or a
        compensation's ``cmp-`` key) to the worker and record its answer.

        The worker records the decision in its journal for a key it holds
        ``pending`` or ``running`` (no adapter is called, no effect runs or
        runs again) and answers the state its journal then holds, which is
        applied to the ledger like a lookup's answer: the decision, or a
        terminal state the journal already held. The audit entry is the
        caller's (:func:`octo_host.audit.record_decision`), written first.
        """
        return await self._verbs.resolve(session, run, key, resolution)

    @overload
    async def compensate(
        self,
        session: HostSession,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
        /,
    ) -> WorkerOperationState: ...

    @overload
    async def compensate(
        self,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
        /,
    ) -> WorkerOperationState: ...

    async def compensate(self, *args: Any) -> WorkerOperationState:
        """Send the recorded compensation under a fresh approval; return its state
        (without a session, on one of the pool of the original key's scope).

        The engine refuses before anything is sealed when the original is not
        ``succeeded`` or a verifier says no. A timeout or a pending /
        indeterminate / adapter refusal repeats the same ``cmp-`` key and input
        under a new approval (the worker answers from its journal).
        """
        if isinstance(args[0], HostRun):
            return await self._pooled.compensate(*args)
        return await self._verbs.compensate(*args)

    @overload
    async def reconcile_compensation(
        self, session: HostSession, run: HostRun, operation_key: str, /
    ) -> WorkerOperationState: ...

    @overload
    async def reconcile_compensation(
        self, run: HostRun, operation_key: str, /
    ) -> WorkerOperationState: ...

    async def reconcile_compensation(self, *args: Any) -> WorkerOperationState:
        """Look up the recorded compensation of ``operation_key`` at the worker;
        without a session, on one of the pool of the key's scope.

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
        if isinstance(args[0], HostRun):
            return await self._pooled.reconcile_compensation(*args)
        return await self._verbs.reconcile_compensation(*args)

    async def execute(
        self,
        run: HostRun,
        step_id: str,
        tool: str,
        payload: ToolPayload,
        nonce: bytes,
        scope: str | None = None,
    ) -> WorkerOperationState:
        """Record the intent and dispatch it, in one call; returns the (last attempt's) state.

        Exactly ``record_operation(run, step_id, tool, payload, nonce, scope=scope)``
        then ``dispatch(run, key, payload)``, on a session of ``scope``'s pool
        (``scope`` may be left out when one scope has a manifest). Called again
        for the same job (same run, step, tool, payload and nonce), it finds the
        key the first call recorded (``DuplicateOperationKey`` is not raised)
        and reconciles it before anything is sent again, so the effect runs at
        most once. An outcome the worker has not told comes back ``pending`` or
        ``running``: never dispatch again; ``reconcile`` (or ``recover`` after
        a restart) settles it. A step's retry policy is followed (``follow_retries``).
        """
        if scope is None:
            scope = self._only_scope()
        return await self._pooled.execute(run, step_id, tool, payload, nonce, scope)

    async def follow_retries(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        payload: ToolPayload,
        state: WorkerOperationState,
    ) -> tuple[str, WorkerOperationState]:
        """After ``dispatch`` of ``operation_key`` on ``session`` ended in ``state``: its
        step's retry policy followed there; returns the last attempt's key and state."""
        return await self._retries.follow_in(session, run, operation_key, payload, state)

    async def undo(
        self,
        run: HostRun,
        operation_key: str,
        inverse: ToolPayload,
        nonce: bytes,
        policy: WorkflowCompensationPolicy | None = None,
        *,
        original: ToolPayload | None = None,
    ) -> WorkerOperationState:
        """Record the one compensation of a succeeded operation and send it, in one call.

        Exactly ``record_compensation`` (the grant and action verifiers run)
        then ``compensate`` under a fresh approval (both verifiers run again
        right before sealing), on a session of the pool of the key's scope.
        ``policy`` defaults to the key's scope and its grant in that scope's
        manifest; ``original`` is the original input, for verifiers that
        match fields of it (``[[actions]] match``). Called again after an
        unfinished attempt with the same inverse, the recorded compensation is
        sent again under the same ``cmp-`` key (the worker answers from its
        journal); a finished one, or another inverse, raises
        ``CompensationAlreadyRecorded``. An outcome not known comes back
        ``pending`` or ``running``.
        """
        return await self._pooled.undo(run, operation_key, inverse, nonce, policy, original)

    @property
    def pool_stats(self) -> PoolStats:
        """Sessions the pools opened, rotated out and closed, and those active now."""
        return self._pools.stats

    def _only_scope(self) -> str:
        scopes = self._pools.scopes()
        if len(scopes) != 1:
            raise InvalidConfiguration(f"scope: required ({len(scopes)} scopes have a manifest)")
        return scopes[0]

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
        reconcile every operation and compensation that is not terminal.

        Every unfinished operation is looked up (a lookup carries no input).
        One the worker never admitted (``unknown_operation``) is dispatched
        again under its same key if the ledger still says ``pending`` and
        ``inputs`` holds its payload (by operation key; the ledger keeps only
        fingerprints); without it, it is reported in ``unresolved``.

        Every compensation that is not terminal is first looked up
        (``reconcile_compensation``): no input, approval or verifier is
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
