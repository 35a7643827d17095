"""The host client: sessions, durable runs, confirmed publishes and reply routing (H§16).

Owns, for one host id:

* the broker side of the host (plain connection, a confirm channel, the quorum
  reply queue ``octo.v5.reply.<host-id>`` and its consumer);
* :class:`HostSession` (H§16.1): a fresh session id, a fresh 32-byte key
  nonce, the derived key and a HOST authenticator per ``open_session``;
* :class:`HostRun`: one workflow run's ledger in an :class:`AuthenticatedStore`
  (``SqliteLedgerStore``, or ``PostgresLedgerStore`` shared by several hosts)
  (record key ``("workflow-ledger", run)``), loaded or created for a plan,
  validated against the revision this client last stored (the rollback
  watermark) and written with compare-and-swap;
* the verbs ``dispatch``, ``reconcile``, ``compensate`` and ``recover``,
  which persist the ledger before every send and after every applied reply,
  and react to timeouts and ``request_rejected`` as H§16.4 says;
* reply handling (H§16.3): size and headers, session lookup, routing by
  correlation id, ``DuplicateFrame`` dropped, a late outcome applied (also
  after a ``pending_*`` refusal of the same request), a stale ``running``
  for a terminal record acked and dropped, other refusals dead-lettered.

It must never: send a second ``dispatch_operation`` for a key the worker may
have admitted (only ``unknown_operation`` on reconcile, for a key the ledger
still holds ``pending``, proves it never did),
create a new key to make progress, publish a frame before the ledger
revision that justifies it is durable, seal a compensation without a fresh
approval, persist or reuse a session, or log keys, nonces, payloads or
adapter text (ids, fingerprints, codes and states only). It does not import
:mod:`octo_worker`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import msgspec
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)

from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    DuplicateFrame,
    InvalidAuthenticationTag,
    InvalidCompensationStateTransition,
    InvalidFrameHeaders,
    InvalidLedgerEncoding,
    InvalidScopeKey,
    InvalidStateTransition,
    OctoError,
    SessionClosed,
    StorageBackendError,
    UnexpectedMessage,
    UnknownOperation,
    WireFrameTooLarge,
    WorkerRequestRejected,
    WriteConflict,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.ids import is_token
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.messages import (
    CloseSession,
    CompensationReconcileRequest,
    OpenSession,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    WorkerMessage,
    message_type,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.peek import header_text
from octo_common.records import StorageRecordKey
from octo_common.runtime.broker import dead_letter_delivery, publish_envelope
from octo_common.runtime.faults import FaultInjector
from octo_common.states import (
    TERMINAL_KINDS,
    OperationStatus,
    Pending,
    Running,
    StateKind,
    WorkerOperationState,
)
from octo_common.transport import (
    HEADER_SESSION,
    PublishChannelClosed,
    PublishFailed,
    PublishNacked,
    PublishReturned,
    build_host_publish,
    check_delivery,
    reply_queue,
)
from octo_host.amqp import (
    BrokerUnavailable,
    connect,
    consume_reply_queue,
    declare_reply_queue,
    open_confirm_channel,
)
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.engine import OutboundFrame, WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan
from octo_host.reactions import Reaction, ReplyReaction, rejection_reaction, reply_reaction
from octo_host.store import AuthenticatedStore, ledger_record_key

__all__ = [
    "ROUTES_NAMESPACE",
    "DispatchScopeMismatch",
    "HostClient",
    "HostRun",
    "HostSession",
    "RecoverySummary",
    "ReplyTimedOut",
    "routes_record_key",
]

_log = structlog.get_logger("octo.host.client")

# Consecutive unanswered requests after which the session itself is suspect
# (a refused open or a dead-lettered session shows up only as silence, H§16.1).
_TIMEOUTS_BEFORE_NEW_SESSION: Final = 3
# Waiters kept per session for late replies (their requests timed out, or the
# worker answered pending_* first); the oldest is dropped beyond this.
_MAX_WAITERS_PER_SESSION: Final = 1024
_MAX_SENT_REMEMBERED: Final = 4096
# Closed sessions let go of (their id and authenticator kept, to recognise a
# late reply of theirs): the oldest is forgotten beyond this.
_MAX_RETIRED_SESSIONS: Final = 4096


class ReplyTimedOut(OctoError):
    """No authenticated reply arrived in time. Never evidence either way (H§16.5)."""

    _fields = ("request_id", "timeout")
    _text = "no reply within the timeout"
    request_id: str
    timeout: float


class DispatchScopeMismatch(OctoError):
    """The key was bound to another tenant scope by its first dispatch; nothing is sent.

    The ledger does not name a scope and worker journals are per scope, so
    an ``unknown_operation`` from a second scope is no evidence: dispatching
    there could run the effect twice (PROTOCOL.md §1, H§16.4). Fail closed.
    """

    _fields = ("operation_key", "bound_scope", "scope")
    _text = "operation key bound to another scope"
    operation_key: str
    bound_scope: str
    scope: str

    def __str__(self) -> str:
        return (
            f"{self.operation_key} was dispatched to scope {self.bound_scope}, "
            f"refused for scope {self.scope}"
        )


ROUTES_NAMESPACE: Final = "workflow-routes"
_ROUTES_FORMAT_VERSION: Final = 1


class _RoutesDoc(msgspec.Struct, forbid_unknown_fields=True):
    """``("workflow-routes", RUN)``: the scope each operation key is bound to.

    A key is bound before its first dispatch, or when it is recorded with a scope.
    """

    format_version: int
    run: str
    routes: dict[str, str]


def _routes_doc(run: HostRun, routes: dict[str, str]) -> bytes:
    return encode_struct(_RoutesDoc(_ROUTES_FORMAT_VERSION, run.name, routes))


def routes_record_key(run: str) -> StorageRecordKey:
    """The record key of a run's dispatch routes: ``("workflow-routes", run)``."""
    return StorageRecordKey(ROUTES_NAMESPACE, run)


# The one kill point of the host (OCTO_FAULT, see octo_common.runtime.faults).
_HOST_FAULT_POINT: Final = "host.after_ledger_commit"


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


# Sessions ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Waiter:
    """A request waiting for its reply (routed by correlation id = request id).

    ``kind`` is None for a frame sent with :meth:`HostClient.send`: its reply
    is handed over as it is, not applied to a ledger.
    """

    kind: RequestKind | None
    request: Any
    run: HostRun | None
    future: asyncio.Future[Any]
    abandoned: bool = False

    def resolve(self, value: Any) -> None:
        if not self.abandoned and not self.future.done():
            self.future.set_result(value)

    def fail(self, error: BaseException) -> None:
        if not self.abandoned and not self.future.done():
            self.future.set_exception(error)


class HostSession:
    """One host session (H§16.1): scope, session id, key nonce, authenticator.

    Process-local; never persisted. When the client replaces a session (H§16.4)
    the old handle points to its successor, and every verb follows the chain
    (:meth:`current`).
    """

    def __init__(
        self,
        scope: str,
        manifest: CapabilityManifest,
        key_nonce: bytes,
        authenticator: SessionAuthenticator,
    ) -> None:
        self.scope = scope
        self.manifest = manifest
        self.key_nonce = key_nonce
        self.authenticator = authenticator
        self.closed = False
        self.closed_at: float | None = None  # loop time of the close
        self.replaced_by: HostSession | None = None
        self._waiters: dict[str, _Waiter] = {}
        # Request ids this session sent (the newest _MAX_SENT_REMEMBERED, in
        # order): an authentic reply to one whose waiter is gone is a late or
        # repeated answer (W§10.7), dropped; one to any other id is unexpected.
        self._sent: dict[str, None] = {}

    @property
    def session_id(self) -> str:
        return self.authenticator.session_id

    def current(self) -> HostSession:
        """This session, or the newest session that replaced it."""
        session = self
        while session.replaced_by is not None:
            session = session.replaced_by
        return session

    def __repr__(self) -> str:
        return (
            f"HostSession(scope={self.scope!r}, session_id={self.session_id!r}, "
            f"closed={self.closed})"
        )


# Runs -------------------------------------------------------------------------------


class HostRun:
    """One workflow run's durable ledger (``("workflow-ledger", name)``).

    Built by :meth:`HostClient.load_run`. Every change goes through the client,
    which persists it with compare-and-swap before anything acts on it.
    """

    def __init__(
        self,
        name: str,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        stored_revision: int,
    ) -> None:
        self.name = name
        self.plan = plan
        self.record_key = ledger_record_key(name)
        self._ledger = ledger
        self._stored_revision = stored_revision
        self._durable_ledger_revision = ledger.revision
        self._lock = asyncio.Lock()
        # Keys this object recorded and sent no dispatch for (changed under the
        # lock): the only keys a dispatch_operation may go to directly. A key
        # read from the store, whatever its state, may have been sent before
        # (another process, a crash): it is reconciled first (H§16.5).
        self._unsent: set[str] = set()
        # Set when the client no longer holds this object as the run's (dropped
        # from its cache, or another object loaded for the run): from then on
        # it dispatches no key without reconciling first, ``_unsent`` or not.
        self._detached = False
        # ("workflow-routes", name): loaded on the first dispatch (None until then).
        self._routes: dict[str, str] | None = None
        self._routes_revision: int | None = None

    @property
    def ledger(self) -> WorkflowOperationLedger:
        """A copy of the current (durable) ledger."""
        return self._ledger.copy()

    @property
    def revision(self) -> int:
        return self._ledger.revision

    def operation(self, operation_key: str) -> WorkflowOperation | None:
        return self._ledger.operation(operation_key)

    def state(self, operation_key: str) -> StateKind:
        operation = self._ledger.operation(operation_key)
        if operation is None:
            raise UnknownOperation(operation_key)
        return operation.state

    def __repr__(self) -> str:
        return f"HostRun(name={self.name!r}, revision={self._ledger.revision})"


@dataclass
class RecoverySummary:
    """What :meth:`HostClient.recover` found and did, key by key.

    ``errors`` holds, for each key whose recovery failed (it is also in
    ``unresolved``), the error's code; for a worker refusal, the worker's
    rejection code (``unknown_operation``, ...).
    """

    run: HostRun
    session: HostSession
    operations: dict[str, StateKind] = field(default_factory=dict)
    compensations: dict[str, StateKind] = field(default_factory=dict)
    reconciled: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


class _SentBefore(Exception):
    """Internal to :meth:`HostClient.dispatch`: the key may have been sent; reconcile it."""


# The client ------------------------------------------------------------------------


class HostClient:
    """The host's broker client and durable-run driver (H§16)."""

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
        self._url = url
        self.host_id = host_id
        self.reply_queue = reply_queue(host_id)
        self._scope_keys = dict(scope_keys)
        self.store = store
        self.engine = engine or WorkflowEngine()
        self.reply_timeout = reply_timeout
        self.publish_timeout = publish_timeout
        self.max_attempts = max(1, max_attempts)
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._faults = FaultInjector()
        self._connection: AbstractConnection | None = None
        self._publish_channel: AbstractChannel | None = None
        self._consume_channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._sessions: dict[str, HostSession] = {}
        # Session id -> authenticator of closed sessions let go of (see _retire).
        self._retired: dict[str, SessionAuthenticator] = {}
        # Runs loaded, least recently loaded first; bounded (see _evict_runs).
        self._runs: dict[str, HostRun] = {}
        self.max_cached_runs = max(1, max_cached_runs)
        self._watermarks: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Why replies can no longer arrive (None while the consumer is alive).
        self._replies_lost: str | None = None
        self._replace_lock = asyncio.Lock()
        # Frames published, by message type (observability; tests read it).
        self.published: Counter[str] = Counter()
        self._log = _log.bind(host=host_id)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, declare the reply queue and start consuming replies.

        Raises :class:`~octo_host.amqp.BrokerUnavailable` when the broker cannot
        be reached, a channel cannot be opened or the queue cannot be declared
        or consumed (the client is closed again).
        """
        connection = await connect(
            self._url, timeout=self.publish_timeout, name=f"octo-host-{self.host_id}"
        )
        self._connection = connection
        self._replies_lost = None
        try:
            self._publish_channel = await open_confirm_channel(connection)
            await declare_reply_queue(self._publish_channel, self.host_id)
            consumer = await consume_reply_queue(
                connection, self.host_id, self._on_delivery, prefetch_count=64
            )
            self._consume_channel, self._queue, self._consumer_tag = consumer
            await self._watch_replies(connection, self._consume_channel)
        except BaseException:
            await self.close()
            raise
        self._log.info("host_client_started", reply_queue=self.reply_queue)

    async def _watch_replies(
        self, connection: AbstractConnection, channel: AbstractChannel
    ) -> None:
        """Fail every waiting call at once when no reply can arrive any more.

        The connection or the consume channel closed, or the broker cancelled
        the consumer (the reply queue was deleted): a caller would otherwise
        sit out its whole reply timeout and reconcile into the same silence.
        """

        def lost(reason: str) -> None:
            if self._replies_lost is not None:
                return
            self._replies_lost = reason
            waiting = [w for s in self._sessions.values() for w in s._waiters.values()]
            if self._consumer_tag is not None:  # not our own close()
                self._log.error("replies_lost", reason=reason, waiting=len(waiting))
            for waiter in waiting:
                waiter.fail(BrokerUnavailable(f"no replies: {reason}"))

        connection.close_callbacks.add(lambda *_: lost("the connection closed"))
        channel.close_callbacks.add(lambda *_: lost("the reply channel closed"))

        def cancelled(frame: Any) -> None:
            if getattr(frame, "consumer_tag", None) == self._consumer_tag:
                lost("the broker cancelled the reply consumer")

        underlay = await channel.get_underlay_channel()
        underlay.on_consumer_cancel_callbacks.add(cancelled)

    async def close(self) -> None:
        """Close this client's open sessions at the worker, stop consuming, let
        reply handlers finish, close the connection. Idempotent.

        Sessions are process-local (H§16.1): no later client can use them, and
        a session left open is kept (and restored at every start) by the
        worker for ever. A session with a request still awaited is left open:
        its ``close_session`` could overtake that request at the worker, which
        would then refuse it rather than run it. The others' ``close_session``
        frames are published best effort, within one publish timeout.
        """
        open_sessions = [
            s
            for s in self._sessions.values()
            if not s.closed and all(w.abandoned for w in s._waiters.values())
        ]
        if open_sessions and self._publish_channel is not None:
            closing = [asyncio.ensure_future(self._close_exact(s)) for s in open_sessions]
            done, late = await asyncio.wait(closing, timeout=self.publish_timeout)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late)
                self._log.warning("session_close_failed", sessions=len(late), error="timeout")
            for task in done:
                error = task.exception()
                if error is not None:
                    code = error.code if isinstance(error, OctoError) else type(error).__name__
                    self._log.warning("session_close_failed", sessions=1, error=code)
        queue, tag = self._queue, self._consumer_tag
        self._queue, self._consumer_tag = None, None
        if queue is not None and tag is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(queue.cancel(tag), timeout=5.0)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5.0)
        connection, self._connection = self._connection, None
        self._publish_channel = None
        self._consume_channel = None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), timeout=5.0)
        # Callers still waiting time out on their own and then fail to publish.

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

    # -- sessions (H§16.1) -----------------------------------------------------------

    async def open_session(self, scope: str, manifest: CapabilityManifest) -> HostSession:
        """Open a fresh session: new id, new nonce, derived key; no reply is expected.

        A scope this client has no key for raises ``InvalidScopeKey("missing")``.
        """
        scope_key = self._scope_keys.get(scope)
        if scope_key is None:
            raise InvalidScopeKey("missing")  # no key configured for this scope
        session_id = f"s-{secrets.token_hex(12)}"
        key_nonce = secrets.token_bytes(32)
        key = SessionKey.derive(scope_key, scope, session_id, key_nonce)
        authenticator = SessionAuthenticator(session_id, key, SessionRole.HOST)
        opening = CapabilityManifest(session_id, manifest.grants)
        session = HostSession(scope, opening, key_nonce, authenticator)
        frame = authenticator.seal(OpenSession(opening))
        self._retire_closed()
        self._sessions[session_id] = session
        try:
            await self.publish(session, frame, None, kind="open_session")
        except (PublishReturned, PublishNacked):
            # The broker took no copy: the worker never saw the open. Closed here,
            # so close() sends nothing for it and it is let go of like any closed
            # session. (After a timeout or a lost channel the worker may have it:
            # the session stays, and close() closes it at the worker.)
            session.closed = True
            session.closed_at = asyncio.get_running_loop().time()
            raise
        self._log.info("session_opened", scope=scope, session_id=session_id)
        return session

    async def close_session(self, session: HostSession) -> None:
        """Seal and publish ``close_session``; later sends on it are refused locally."""
        await self._close_exact(session.current())

    async def _replace_session(self, session: HostSession, reason: str) -> HostSession:
        """H§16.4: open a new session under the same manifest; close the old one.

        ``session`` is the one that failed. If another call replaced it already,
        its successor is returned: concurrent verbs that saw the same failure
        open one fresh session, and a late failure of an old session never
        replaces (and closes) a newer one.
        """
        async with self._replace_lock:
            if session.replaced_by is not None:
                return session.current()
            fresh = await self.open_session(session.scope, session.manifest)
            session.replaced_by = fresh
        self._log.warning(
            "session_replaced",
            scope=session.scope,
            session_id=session.session_id,
            new_session_id=fresh.session_id,
            reason=reason,
        )
        if not session.closed:
            with contextlib.suppress(OctoError):
                await self._close_exact(session)
        return fresh

    def _retire_closed(self) -> None:
        """Let go of closed sessions no caller waits on any more.

        A session closed for longer than a whole verb's retries (every attempt
        a reply timeout plus the longest backoff) whose waiters are all given
        up is dropped with its waiters (and the runs they hold); only its id
        and authenticator are kept, so a late reply of it is still recognised
        and dropped, not dead-lettered. A long-lived client otherwise keeps
        every session it ever opened.
        """
        now = asyncio.get_running_loop().time()
        grace = self.max_attempts * (self.reply_timeout + self._backoff_max)
        for session_id, session in list(self._sessions.items()):
            closed_at = session.closed_at
            if closed_at is None or now - closed_at < grace:
                continue
            if any(not waiter.abandoned for waiter in session._waiters.values()):
                continue
            del self._sessions[session_id]
            self._retired[session_id] = session.authenticator
            if len(self._retired) > _MAX_RETIRED_SESSIONS:
                del self._retired[next(iter(self._retired))]
            self._log.info("session_retired", scope=session.scope, session_id=session_id)

    async def _close_exact(self, session: HostSession) -> None:
        """Close exactly this session (not its successor)."""
        if session.closed:
            return
        frame = session.authenticator.seal(CloseSession(session.session_id))
        session.closed = True
        session.closed_at = asyncio.get_running_loop().time()
        await self.publish(session, frame, None, kind="close_session")
        self._log.info("session_closed", scope=session.scope, session_id=session.session_id)

    # -- publishing (H§16.2) ---------------------------------------------------------

    async def publish(
        self,
        session: HostSession,
        frame: bytes,
        correlation_id: str | None,
        *,
        kind: str = "frame",
        attempts: int = 3,
    ) -> None:
        """One confirmed publish of ``frame``; an unconfirmed one is retried with the
        same bytes (the worker treats a second copy as ``DuplicateFrame``).

        Low level: no reply is awaited and the session's state is not checked
        (``send`` and the verbs refuse closed sessions). Callers publish a
        durable request only once the ledger revision behind it is durable.
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
                await publish_envelope(channel, envelope, timeout=self.publish_timeout)
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

    def _register(
        self,
        session: HostSession,
        request_id: str,
        kind: RequestKind | None,
        request: Any,
        run: HostRun | None,
    ) -> _Waiter:
        if self._replies_lost is not None:
            raise BrokerUnavailable(f"no replies: {self._replies_lost}")
        waiters = session._waiters
        if len(waiters) >= _MAX_WAITERS_PER_SESSION:
            # The oldest one given up on goes first; a caller still waiting
            # loses its waiter only when every one has a caller.
            oldest = next((rid for rid, w in waiters.items() if w.abandoned), next(iter(waiters)))
            waiters.pop(oldest).abandoned = True
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A waiter given up on (timeout, cancelled verb) may still be failed by a
        # late routing; its outcome is read so it is never reported as lost.
        future.add_done_callback(_retrieve)
        waiter = _Waiter(kind, request, run, future)
        waiters[request_id] = waiter
        sent = session._sent
        sent[request_id] = None
        if len(sent) > _MAX_SENT_REMEMBERED:
            del sent[next(iter(sent))]
        return waiter

    async def _await(self, session: HostSession, request_id: str, waiter: _Waiter) -> Any:
        try:
            async with asyncio.timeout(self.reply_timeout):
                # Shielded: a timeout leaves the waiter registered for a late reply.
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            # Stay registered: a late reply is still applied to the ledger.
            waiter.abandoned = True
            self._log.warning(
                "reply_timeout",
                scope=session.scope,
                session_id=session.session_id,
                request_id=request_id,
                type=waiter.kind or "raw",
            )
            raise ReplyTimedOut(request_id, self.reply_timeout) from None
        except asyncio.CancelledError:
            # Given up on like a timeout: a late reply is still applied, but the
            # waiter no longer keeps its session open or its run cached.
            waiter.abandoned = True
            raise

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
        request_id = outbound.request.request_id
        waiter = self._register(session, request_id, None, outbound.request, None)
        message_type = _KINDS[_KIND_OF_REQUEST[type(outbound.request)]].message_type
        try:
            await self.publish(session, outbound.frame, request_id, kind=message_type)
        except BaseException:
            session._waiters.pop(request_id, None)
            raise
        message: WorkerMessage = await self._await(session, request_id, waiter)
        return message

    # -- runs --------------------------------------------------------------------------

    async def load_run(
        self, name: str, plan: WorkflowPlan, *, minimum_revision: int = 0
    ) -> HostRun:
        """Load (or create at revision 0) the ledger of run ``name`` for ``plan``.

        The ledger is validated for the plan and against the rollback watermark:
        the highest revision this client stored for the run, or ``minimum_revision``.
        """
        cached = self._runs.get(name)
        if (
            cached is not None
            and (cached.plan is plan or cached.plan.fingerprint == plan.fingerprint)
            and cached.revision >= minimum_revision
        ):
            del self._runs[name]
            self._runs[name] = cached  # most recently used
            return cached
        key = ledger_record_key(name)
        record = await self.store.load(key)
        if record is None:
            ledger = self.engine.operation_ledger(plan)
            record = await self.store.create(key, ledger.to_json().encode("utf-8"))
        else:
            ledger = WorkflowOperationLedger.from_json(record.payload)
        watermark = max(self._watermarks.get(name, 0), minimum_revision)
        self.engine.validate_operation_ledger_at_or_after(plan, ledger, watermark)
        self._watermarks[name] = ledger.revision
        run = HostRun(name, plan, ledger, record.revision)
        replaced = self._runs.pop(name, None)
        if replaced is not None:
            # Two objects for one run: neither may dispatch a key without reconciling.
            replaced._unsent.clear()
            replaced._detached = True
        self._runs[name] = run
        self._evict_runs()
        self._log.info("run_loaded", run=name, revision=ledger.revision, plan=plan.fingerprint)
        return run

    def _evict_runs(self) -> None:
        """Keep at most ``max_cached_runs`` runs loaded, dropping the least recently used.

        A long-lived client otherwise keeps the ledger of every run it ever
        loaded. Kept whatever the bound: the run just loaded, a run in use (its
        lock held, or a reply to a request of it awaited by a caller), and a
        run holding keys it recorded and never sent (a second
        object for the run could not tell them from sent ones). A dropped
        object is detached: if a caller still holds it, it reconciles every key
        before dispatching any, like the object loaded for the run next.
        """
        excess = len(self._runs) - self.max_cached_runs
        if excess <= 0:
            return
        # Runs a caller awaits a reply for. A waiter given up on (timed out, cancelled, or
        # kept after a pending_* refusal) does not pin its run: no reply may
        # ever come for it, and the worker's journal keeps what it would say.
        waited = {
            id(waiter.run)
            for session in self._sessions.values()
            for waiter in session._waiters.values()
            if waiter.run is not None and not waiter.abandoned
        }
        newest = next(reversed(self._runs))
        for name, run in list(self._runs.items()):
            if name == newest or run._lock.locked() or run._unsent or id(run) in waited:
                continue
            del self._runs[name]
            run._detached = True
            excess -= 1
            if excess <= 0:
                return

    async def _persist_locked(
        self,
        run: HostRun,
        candidate: WorkflowOperationLedger,
        routes: dict[str, str] | None = None,
    ) -> None:
        """Compare-and-swap ``candidate`` over the stored ledger; then adopt it.

        With ``routes`` (the run's routes with one binding added), the routes
        record is written in the same transaction: both or neither.
        """
        if (
            routes is None
            and candidate.revision == run._durable_ledger_revision
            and candidate == run._ledger
        ):
            return
        payload = candidate.to_json().encode("utf-8")
        # The write and the adoption of its outcome run to the end even if the
        # caller is cancelled, and the caller (who holds the run lock) waits
        # for them: otherwise the run's stored revision would fall behind the
        # database and every later write of the run would be a WriteConflict.
        task = asyncio.ensure_future(self._swap_and_adopt(run, candidate, payload, routes))
        cancelled = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True
            except BaseException:
                break  # the task is done: its outcome is raised below
        if cancelled:
            if not task.cancelled():
                task.exception()  # retrieved: the caller sees its cancellation
            raise asyncio.CancelledError()
        task.result()

    async def _swap_and_adopt(
        self,
        run: HostRun,
        candidate: WorkflowOperationLedger,
        payload: bytes,
        routes: dict[str, str] | None,
    ) -> None:
        try:
            if routes is None:
                record = await self.store.compare_and_swap(
                    run.record_key, run._stored_revision, payload
                )
            else:
                record, routes_record = await self.store.compare_and_swap_many(
                    [
                        (run.record_key, run._stored_revision, payload),
                        (
                            routes_record_key(run.name),
                            run._routes_revision,
                            _routes_doc(run, routes),
                        ),
                    ]
                )
                run._routes, run._routes_revision = routes, routes_record.revision
        except BaseException as exc:
            if routes is not None:
                run._routes = None  # reloaded from the store when next needed
            if isinstance(exc, WriteConflict | StorageBackendError):
                # The stored ledger is not what this run holds (another writer,
                # or a write reported failed after its commit): adopt what the
                # store holds, so the next verb starts from it instead of
                # failing forever.
                await self._resync(run)
            raise
        run._stored_revision = record.revision
        run._ledger = candidate
        run._durable_ledger_revision = candidate.revision
        self._watermarks[run.name] = candidate.revision
        self._log.debug("ledger_persisted", run=run.name, revision=candidate.revision)

    async def _resync(self, run: HostRun) -> None:
        """Adopt the stored ledger of ``run`` if it validates; else keep the run as is."""
        try:
            record = await self.store.load(run.record_key)
            if record is None or record.revision == run._stored_revision:
                return
            ledger = WorkflowOperationLedger.from_json(record.payload)
            watermark = self._watermarks.get(run.name, 0)
            self.engine.validate_operation_ledger_at_or_after(run.plan, ledger, watermark)
        except OctoError as exc:
            self._log.error("ledger_resync_failed", run=run.name, error=exc.code)
            return
        run._stored_revision = record.revision
        run._ledger = ledger
        run._durable_ledger_revision = ledger.revision
        run._unsent.clear()  # the other writer may have sent any key
        self._watermarks[run.name] = ledger.revision
        self._log.warning("ledger_resynced", run=run.name, revision=ledger.revision)

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
        if scope is not None and scope not in self._scope_keys:
            raise InvalidScopeKey("missing")  # no key configured for this scope
        data = canonical_operation_input_bytes(payload)
        async with run._lock:
            candidate = run._ledger.copy()
            if operation_key is None:
                operation_key = self.engine.record_derived_operation(
                    run.plan, candidate, step_id, tool, data, nonce
                )
            else:
                self.engine.record_operation(
                    run.plan, candidate, step_id, tool, operation_key, data
                )
            routes = None
            if scope is not None:
                routes = await self._routes_with(run, operation_key, scope)
            await self._persist_locked(run, candidate, routes)
            run._unsent.add(operation_key)
        self._log.info("operation_recorded", run=run.name, operation_key=operation_key, tool=tool)
        return operation_key

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
            candidate = run._ledger.copy()
            compensation_key = self.engine.record_derived_compensation_with_action_verifier(
                run.plan, candidate, target, data, nonce
            )
            await self._persist_locked(run, candidate)
        self._log.info(
            "compensation_recorded",
            run=run.name,
            operation_key=target.operation_key,
            compensation_key=compensation_key,
        )
        return compensation_key

    # -- one request each -------------------------------------------------------------

    async def _send_prepared(
        self,
        session: HostSession,
        run: HostRun,
        kind: RequestKind,
        build: Any,
    ) -> OperationStatus:
        """Persist, seal (``build``), register, fault point, publish, await the reply.

        ``build(auth) -> OutboundFrame`` runs under the run lock after the
        ledger is durable, so an approval and its sealing see one revision,
        and a decision to send sees the ledger it is made from.
        """
        if session.closed:
            raise SessionClosed(session.session_id)
        async with run._lock:
            await self._persist_locked(run, run._ledger)
            outbound = build(session.authenticator)
            request = outbound.request
            row = _KINDS[kind]
            if row.binds_route:
                # Durable before the first publish of the key, never changed.
                await self._bind_route(run, request.operation_key, session.scope)
            waiter = self._register(session, request.request_id, kind, request, run)
        self._faults.reach(_HOST_FAULT_POINT)
        try:
            await self.publish(session, outbound.frame, request.request_id, kind=row.message_type)
        except BaseException:
            session._waiters.pop(request.request_id, None)
            raise
        state: OperationStatus = await self._await(session, request.request_id, waiter)
        return state

    async def _bind_route(self, run: HostRun, operation_key: str, scope: str) -> None:
        """Bind ``operation_key`` to ``scope`` before its first ``dispatch_operation``.

        Raises :class:`DispatchScopeMismatch` when an earlier dispatch bound it
        to another scope. Called under the run lock.
        """
        routes = await self._routes_with(run, operation_key, scope)
        if routes is None:
            return
        try:
            record = await self.store.compare_and_swap(
                routes_record_key(run.name), run._routes_revision, _routes_doc(run, routes)
            )
        except BaseException:
            run._routes = None  # reloaded from the store on the next dispatch
            raise
        run._routes, run._routes_revision = routes, record.revision

    async def _routes_with(
        self, run: HostRun, operation_key: str, scope: str
    ) -> dict[str, str] | None:
        """The run's routes with ``operation_key`` bound to ``scope``; None if it is already.

        Raises :class:`DispatchScopeMismatch` when the key is bound to
        another scope. Called under the run lock; writes nothing.
        """
        if run._routes is None:
            record = await self.store.load(routes_record_key(run.name))
            if record is None:
                run._routes, run._routes_revision = {}, None
            else:
                doc = decode_struct(record.payload, _RoutesDoc, error=InvalidLedgerEncoding)
                if doc.format_version != _ROUTES_FORMAT_VERSION or doc.run != run.name:
                    raise InvalidLedgerEncoding("routes record of another run or version")
                run._routes, run._routes_revision = dict(doc.routes), record.revision
        bound = run._routes.get(operation_key)
        if bound == scope:
            return None
        if bound is not None:
            self._log.error(
                "dispatch_refused",
                run=run.name,
                operation_key=operation_key,
                code=DispatchScopeMismatch.code,
                bound_scope=bound,
                scope=scope,
            )
            raise DispatchScopeMismatch(operation_key, bound, scope)
        return {**run._routes, operation_key: scope}

    async def _dispatch_once(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        payload: ToolPayload,
        unknown: WorkerRequestRejected | None = None,
    ) -> OperationStatus:
        """One ``dispatch_operation``, decided under the run lock (H§16.4, H§16.5).

        Without ``unknown``, only a ``pending`` key this run recorded and never
        sent goes out; any other raises :class:`_SentBefore`. With ``unknown``
        (the worker's ``unknown_operation`` for the key), only a key the ledger
        still holds ``pending`` goes out; for any other the ledger says the
        worker saw the key and its journal has forgotten it, and a new dispatch
        could run the effect twice: ``unknown`` is raised (fail closed).
        """
        request_id = _request_id(_KINDS[RequestKind.DISPATCH].request_id_prefix)

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
            outbound = self.engine.prepare_authenticated_operation_dispatch(
                run.plan, run._ledger, operation_key, payload, request_id, auth
            )
            run._unsent.discard(operation_key)
            return outbound

        return await self._send_prepared(session, run, RequestKind.DISPATCH, build)

    async def _reconcile_once(
        self, session: HostSession, run: HostRun, operation_key: str, data: bytes
    ) -> OperationStatus:
        request_id = _request_id(_KINDS[RequestKind.RECONCILE].request_id_prefix)

        def build(auth: SessionAuthenticator) -> OutboundFrame[OperationReconcileRequest]:
            return self.engine.prepare_authenticated_operation_reconciliation(
                run.plan, run._ledger, operation_key, data, request_id, auth
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
            # A fresh approval right before sealing (H§12.6-12.7, H§14).
            approval = self.engine.approve_compensation(run.plan, run._ledger, target, data, auth)
            return self.engine.prepare_authenticated_operation_compensation(
                run.plan, run._ledger, target, dispatch, approval, auth
            )

        return await self._send_prepared(session, run, RequestKind.COMPENSATE, build)

    # -- verbs ---------------------------------------------------------------------------

    async def dispatch(
        self, session: HostSession, run: HostRun, operation_key: str, payload: ToolPayload
    ) -> WorkerOperationState:
        """Dispatch a recorded operation and return its observed state.

        Only a ``pending`` key this run recorded and never sent is dispatched
        directly. Any other key (read from the store, sent before, no longer
        ``pending``) is reconciled instead, and dispatched again only if the
        worker answers ``unknown_operation`` while the ledger still says
        ``pending``; otherwise that refusal is raised. A timeout or a
        ``pending``/``indeterminate``/``adapter_error`` refusal leads to
        reconciliation of the same key (H§16.4).
        """
        session = session.current()
        data = canonical_operation_input_bytes(payload)
        try:
            state = await self._dispatch_once(session, run, operation_key, payload)
        except _SentBefore:
            return await self._settle(session, run, operation_key, data, payload, None)
        except ReplyTimedOut as exc:
            return await self._settle(session, run, operation_key, data, payload, exc)
        except WorkerRequestRejected as exc:
            reaction = rejection_reaction(RequestKind.DISPATCH, exc.rejection_code)
            if reaction is not Reaction.RECONCILE and reaction is not Reaction.NEW_SESSION:
                raise
            return await self._settle(session, run, operation_key, data, payload, exc)
        self._log.info(
            "operation_observed", run=run.name, operation_key=operation_key, state=state.kind.value
        )
        return state

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
        session = session.current()
        if isinstance(input, ToolPayload):
            return await self._settle(
                session,
                run,
                operation_key,
                canonical_operation_input_bytes(input),
                None,
                None,
            )
        return await self._settle(session, run, operation_key, input, None, None)

    async def _settle(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        data: bytes,
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

        last = await self._repeat(
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
        prefix = _KINDS[RequestKind.COMPENSATE].request_id_prefix

        async def attempt(session: HostSession, number: int) -> OperationStatus:
            # A new request id for every repetition; the key and input stay.
            sent = dispatch
            if number:
                sent = WorkflowCompensationDispatch(_request_id(prefix), dispatch.payload)
            return await self._compensate_once(session, run, target, sent)

        last = await self._repeat(
            RequestKind.COMPENSATE, session.current(), run, target.operation_key, attempt, None
        )
        self._log.info(
            "compensation_observed",
            run=run.name,
            operation_key=target.operation_key,
            state=last.kind.value,
        )
        return last

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
    ) -> WorkerOperationState:
        """Run ``attempt`` (a request of ``kind``) until a terminal state or the attempts
        run out; returns the last state observed (``Pending`` if none).

        H§16.4-16.5: a timeout, or a refusal the reactions table answers with
        ``RECONCILE``, leads to the next attempt (same key); ``NEW_SESSION``, or
        three timeouts in a row, first replaces the session. ``DISPATCH_SAME_KEY``
        dispatches ``operation_key`` again with the payload ``same_key``, in
        the same attempt, if one is given (the dispatch itself refuses unless
        the ledger still holds the key ``pending``). Any other refusal is raised.
        """
        last: WorkerOperationState = Pending()
        for number in range(self.max_attempts):
            if number:
                await self._backoff(number)
            if new_session or timeouts >= _TIMEOUTS_BEFORE_NEW_SESSION:
                reason = "rejection" if new_session else "timeouts"
                session = await self._replace_session(session, reason)
                new_session, timeouts = False, 0
            session = session.current()
            try:
                state = await attempt(session, number)
            except ReplyTimedOut:
                timeouts += 1
                continue
            except WorkerRequestRejected as exc:
                code = exc.rejection_code
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
                except ReplyTimedOut:
                    timeouts += 1
                    continue
                except WorkerRequestRejected as again:
                    reaction = rejection_reaction(RequestKind.DISPATCH, again.rejection_code)
                    new_session = _new_session_or_raise(reaction, again)
                    continue
            timeouts = 0
            last = state
            if state.kind in TERMINAL_KINDS:
                break
        return last

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
        reconcile every operation and compensation that is not terminal (H§16.5).

        The ledger keeps only fingerprints, so the host supplies each
        unfinished operation's payload in ``inputs`` (by operation key) and each
        unfinished compensation's target and inverse payload in
        ``compensations``. Keys without them are reported in ``unresolved``.
        An operation the worker never admitted (``unknown_operation``) is
        dispatched again under its same key if the ledger still says
        ``pending``. A key whose recovery raises an :class:`OctoError`
        (a verifier's refusal, a wrong input, a worker refusal, a failed
        publish or ledger write) is reported in ``unresolved`` with its code in
        ``errors``, and recovery goes on with the next key. The fresh session
        is handed to the caller in the summary; if recovery itself fails, it
        is closed before the error is raised.
        """
        inputs = inputs or {}
        compensations = compensations or {}
        run = await self.load_run(run_name, plan, minimum_revision=minimum_revision)
        session = await self.open_session(scope, manifest)
        summary = RecoverySummary(run, session)
        try:
            for operation in run.ledger.operations:
                key = operation.operation_key
                if operation.state not in TERMINAL_KINDS:
                    payload = inputs.get(key)
                    if payload is None:
                        summary.unresolved.append(key)
                        continue
                    try:
                        await self._settle(
                            session,
                            run,
                            key,
                            canonical_operation_input_bytes(payload),
                            payload,
                            None,
                        )
                    except OctoError as exc:
                        session = session.current()
                        self._recovery_failed(summary, key, exc)
                        failed = run.operation(key)
                        if failed is not None:
                            summary.operations[key] = failed.state
                        continue
                    summary.reconciled.append(key)
                    session = session.current()
                current = run.operation(key)
                if current is None:
                    continue
                summary.operations[key] = current.state
                if current.state not in TERMINAL_KINDS:
                    summary.unresolved.append(key)
                compensation = current.compensation
                if compensation is None:
                    continue
                if compensation.state not in TERMINAL_KINDS:
                    entry = compensations.get(key)
                    if entry is None:
                        summary.unresolved.append(compensation.compensation_key)
                        summary.compensations[key] = compensation.state
                        continue
                    target, inverse = entry
                    try:
                        await self.compensate(
                            session,
                            run,
                            target,
                            WorkflowCompensationDispatch(_request_id("c"), inverse),
                        )
                    except OctoError as exc:
                        session = session.current()
                        self._recovery_failed(summary, compensation.compensation_key, exc)
                        failed = run.operation(key)
                        if failed is not None and failed.compensation is not None:
                            summary.compensations[key] = failed.compensation.state
                        continue
                    session = session.current()
                    summary.reconciled.append(compensation.compensation_key)
                final = run.operation(key)
                if final is not None and final.compensation is not None:
                    summary.compensations[key] = final.compensation.state
                    if final.compensation.state not in TERMINAL_KINDS:
                        summary.unresolved.append(final.compensation.compensation_key)
        except BaseException:
            # Not a key's failure (a defect, a cancellation): no summary to hand over.
            with contextlib.suppress(OctoError):
                await self.close_session(session)
            raise
        summary.session = session
        self._log.info(
            "run_recovered",
            run=run_name,
            revision=run.revision,
            reconciled=len(summary.reconciled),
            unresolved=len(summary.unresolved),
        )
        return summary

    def _recovery_failed(self, summary: RecoverySummary, key: str, error: OctoError) -> None:
        code = error.rejection_code if isinstance(error, WorkerRequestRejected) else error.code
        summary.unresolved.append(key)
        summary.errors[key] = code
        self._log.warning("recovery_key_failed", run=summary.run.name, key=key, error=code)

    async def _backoff(self, attempt: int) -> None:
        delay = min(self._backoff_initial * (2 ** (attempt - 1)), self._backoff_max)
        await asyncio.sleep(delay)

    # -- replies (H§16.3) ---------------------------------------------------------------

    async def _on_delivery(self, message: AbstractIncomingMessage) -> None:
        task = asyncio.ensure_future(self._handle_delivery(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_delivery(self, message: AbstractIncomingMessage) -> None:
        try:
            await self._route(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Unexpected: keep a copy for the operator rather than redelivering
            # it forever (the reply queue has no delivery limit).
            self._log.error("reply_handling_failed", error=type(exc).__name__)
            with contextlib.suppress(Exception):
                await self._dead_letter(message, "host_internal_error")

    async def _route(self, message: AbstractIncomingMessage) -> None:
        body = message.body
        if len(body) > MAX_WIRE_FRAME_BYTES:
            await self._dead_letter(message, WireFrameTooLarge.code)
            return
        headers = message.headers or {}
        session_id = header_text(headers.get(HEADER_SESSION))
        if session_id is None or not is_token(session_id):
            await self._dead_letter(message, InvalidFrameHeaders.code)
            return
        session = self._sessions.get(session_id)
        if session is None:
            retired = self._retired.get(session_id)
            if retired is None:
                await self._dead_letter(message, "unknown_session")
                return
            await self._retired_reply(retired, message)
            return
        try:
            checked = check_delivery(session.scope, len(body), headers)
        except OctoError as exc:
            await self._dead_letter(message, exc.code)
            return
        if checked.key_nonce != session.key_nonce:
            await self._dead_letter(message, InvalidAuthenticationTag.code)
            return
        correlation_id = message.correlation_id
        waiter = None if correlation_id is None else session._waiters.get(correlation_id)
        if waiter is None:
            await self._unrequested(session, message)
            return
        kind = waiter.kind
        if kind is None or waiter.run is None:
            await self._deliver_raw(session, message, waiter, str(correlation_id))
            return
        await self._apply(session, message, waiter, kind, str(correlation_id))

    async def _open_or_settle(
        self, authenticator: SessionAuthenticator, message: AbstractIncomingMessage
    ) -> WorkerMessage | None:
        """Open a reply; None once it is settled (a duplicate acked, a bad frame dead-lettered)."""
        try:
            opened: WorkerMessage = authenticator.open(message.body)
        except DuplicateFrame:
            await self._ack(message)
            return None
        except OctoError as exc:
            await self._dead_letter(message, exc.code)
            return None
        return opened

    async def _drop_reply(
        self, session_id: str, opened: WorkerMessage, message: AbstractIncomingMessage, reason: str
    ) -> None:
        """An authentic reply with nothing to apply: logged, acked."""
        self._log.info(
            "reply_dropped",
            session_id=session_id,
            type=message_type(opened),
            request_id=message.correlation_id,
            reason=reason,
        )
        await self._ack(message)

    async def _retired_reply(
        self, authenticator: SessionAuthenticator, message: AbstractIncomingMessage
    ) -> None:
        """A reply of a session let go of: authentic ones are dropped (too late to apply)."""
        opened = await self._open_or_settle(authenticator, message)
        if opened is None:
            return
        await self._drop_reply(authenticator.session_id, opened, message, "session_retired")

    async def _unrequested(self, session: HostSession, message: AbstractIncomingMessage) -> None:
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
        await self._dead_letter(message, UnexpectedMessage.code)

    async def _deliver_raw(
        self,
        session: HostSession,
        message: AbstractIncomingMessage,
        waiter: _Waiter,
        correlation_id: str,
    ) -> None:
        opened = await self._open_or_settle(session.authenticator, message)
        if opened is None:
            return
        session._waiters.pop(correlation_id, None)
        await self._ack(message)
        waiter.resolve(opened)

    async def _apply(
        self,
        session: HostSession,
        message: AbstractIncomingMessage,
        waiter: _Waiter,
        kind: RequestKind,
        correlation_id: str,
    ) -> None:
        run = waiter.run
        assert run is not None
        if run._detached:
            # Dropped from the cache while its request was out: when the run was
            # loaded again, the reply goes to that object, or its next write
            # would meet this one's revision (WriteConflict).
            run = self._runs.get(run.name, run)
        async with run._lock:
            candidate = run._ledger.copy()
            try:
                state = self.engine.apply_reply(
                    kind, run.plan, candidate, waiter.request, session.authenticator, message.body
                )
            except OctoError as exc:
                await self._not_applied(session, message, waiter, kind, correlation_id, run, exc)
                return
            try:
                await self._persist_locked(run, candidate)
            except OctoError as exc:
                session._waiters.pop(correlation_id, None)
                self._log.error("ledger_persist_failed", run=run.name, error=exc.code)
                await self._dead_letter(message, exc.code)
                waiter.fail(exc)
                return
        session._waiters.pop(correlation_id, None)
        await self._ack(message)
        self._log.info(
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

    async def _not_applied(
        self,
        session: HostSession,
        message: AbstractIncomingMessage,
        waiter: _Waiter,
        kind: RequestKind,
        correlation_id: str,
        run: HostRun,
        error: OctoError,
    ) -> None:
        """Settle an authentic reply the ledger did not take, as :func:`reply_reaction` says."""
        match reply_reaction(kind, error):
            case ReplyReaction.DROP:
                await self._ack(message)
            case ReplyReaction.KEEP_WAITING:
                # Stay registered, abandoned, so the outcome is applied (H§16.3);
                # _register bounds these.
                waiter.fail(error)
                waiter.abandoned = True
                await self._ack(message)
            case ReplyReaction.REFUSED:
                session._waiters.pop(correlation_id, None)
                waiter.fail(error)
                await self._ack(message)
            case ReplyReaction.STALE if isinstance(
                error, InvalidStateTransition | InvalidCompensationStateTransition
            ):
                session._waiters.pop(correlation_id, None)
                await self._ack(message)
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
                await self._refused_by_ledger(session, message, waiter, correlation_id, error)
            case _:
                await self._dead_letter(message, error.code)

    async def _refused_by_ledger(
        self,
        session: HostSession,
        message: AbstractIncomingMessage,
        waiter: _Waiter,
        correlation_id: str,
        error: OctoError,
    ) -> None:
        """Authentic but inconsistent with the ledger: fail closed (dead-letter)."""
        session._waiters.pop(correlation_id, None)
        self._log.error(
            "reply_refused_by_ledger",
            run=waiter.run.name if waiter.run is not None else None,
            request_id=correlation_id,
            error=error.code,
        )
        await self._dead_letter(message, error.code)
        waiter.fail(error)

    async def _ack(self, message: AbstractIncomingMessage) -> None:
        with contextlib.suppress(Exception):
            await message.ack()

    async def _dead_letter(self, message: AbstractIncomingMessage, reason: str) -> None:
        """W§12.3 for the host: a confirmed copy with ``octo-reason``, then ack."""
        self._log.info("reply_dead_lettered", reason=reason, request_id=message.correlation_id)
        with contextlib.suppress(Exception):  # settling on a lost channel: the broker redelivers
            await dead_letter_delivery(
                message, self._publish_channel, reason, timeout=self.publish_timeout, log=self._log
            )


def _new_session_or_raise(reaction: Reaction, refusal: WorkerRequestRejected) -> bool:
    """True to go on in a new session, False to go on in this one; else ``refusal`` is raised."""
    if reaction is Reaction.NEW_SESSION:
        return True
    if reaction is Reaction.RECONCILE:
        return False
    raise refusal


def _request_id(prefix: str) -> str:
    return f"{prefix}-{int(time.time())}-{secrets.token_hex(6)}"


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
