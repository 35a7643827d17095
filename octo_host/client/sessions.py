"""The host client's sessions and the requests waiting on them (H§16.1, H§16.4, H§16.5).

This module owns :class:`HostSession` (a fresh session id, a fresh 32-byte
key nonce, the derived key and a HOST authenticator per ``open_session``),
the waiter of each request sent and not yet answered, and
:class:`SessionRegistry`: open, close, replace (one fresh session for every
verb that saw the same failure) and retire sessions, register a request and
await its reply; a retired session's unanswered requests are kept (bounded)
for their late replies.

It must never persist or reuse a session, replace a session newer than the
one that failed, drop a waiter a caller still awaits while one given up on
remains, or log keys, nonces or frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from structlog.typing import FilteringBoundLogger

from octo_common.errors import InvalidScopeKey, OctoError
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.messages import CloseSession, OpenSession
from octo_common.transport import PublishNacked, PublishReturned
from octo_host.amqp import BrokerUnavailable
from octo_host.client.broker import HostBroker
from octo_host.client.settings import ClientSettings
from octo_host.kinds import RequestKind
from octo_host.plan import WorkflowPlan

if TYPE_CHECKING:
    from octo_host.client.runs import HostRun

__all__ = [
    "HostSession",
    "ReplyCut",
    "ReplyTimedOut",
    "RetiredRequest",
    "SessionRegistry",
    "Waiter",
]

# Waiters kept per session for late replies (their requests timed out, or the
# worker answered pending_* first); the oldest is dropped beyond this.
_MAX_WAITERS_PER_SESSION: Final = 1024
_MAX_SENT_REMEMBERED: Final = 4096
# Closed sessions let go of (their id and authenticator kept, to recognise a
# late reply of theirs): the oldest is forgotten beyond this.
_MAX_RETIRED_SESSIONS: Final = 4096
# Requests of sessions let go of that were never answered (kept so a late reply
# is still applied to the ledger): the oldest is forgotten beyond this.
_MAX_RETIRED_REQUESTS: Final = 1024


class ReplyTimedOut(OctoError):
    """No authenticated reply arrived in time. Never evidence either way (H§16.5)."""

    _fields = ("request_id", "timeout")
    _text = "no reply within the timeout"
    request_id: str
    timeout: float


class ReplyCut(OctoError):
    """The broker connection was lost while the request was out (or being published).

    Its reply may still come once the client has reconnected, or never: like a
    timeout, never evidence either way (H§16.5). The verb reconciles the same
    key on the new connection; a late reply is still applied.
    """

    _fields = ("request_id",)
    _text = "the broker connection was lost before the reply"
    request_id: str


@dataclass(eq=False)
class Waiter:
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


@dataclass(frozen=True, slots=True)
class RetiredRequest:
    """A request of a session let go of whose reply never came, kept for that reply.

    It names its run by name and plan, not by object, so retiring a session
    still lets go of the runs its waiters held: a late reply loads the run again.
    """

    kind: RequestKind
    request: Any
    run_name: str
    plan: WorkflowPlan


class HostSession:
    """One host session (H§16.1): scope, session id, key nonce, authenticator.

    Process-local; never persisted. When the client replaces a session (H§16.4)
    the old handle points to its successor, and every verb follows the chain
    (:meth:`current`). Its underscored attributes belong to the client.
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
        self._waiters: dict[str, Waiter] = {}
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


class SessionRegistry:
    """The sessions of one host client, by id, and the ids of those it let go of."""

    def __init__(
        self,
        scope_keys: Mapping[str, ScopeKey],
        broker: HostBroker,
        settings: ClientSettings,
        log: FilteringBoundLogger,
    ) -> None:
        self._scope_keys = dict(scope_keys)
        self._broker = broker
        self._settings = settings
        self._log = log
        self.by_id: dict[str, HostSession] = {}
        """Open sessions and closed ones not yet retired."""
        self.retired: dict[str, SessionAuthenticator] = {}
        """Session id -> authenticator of closed sessions let go of (see ``retire_closed``)."""
        self.retired_requests: dict[tuple[str, str], RetiredRequest] = {}
        """(session id, request id) -> a retired session's request still unanswered."""
        self._replace_lock = asyncio.Lock()

    def has_key(self, scope: str) -> bool:
        """Whether this client holds the key of ``scope``."""
        return scope in self._scope_keys

    async def open(self, scope: str, manifest: CapabilityManifest) -> HostSession:
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
        self.retire_closed()
        self.by_id[session_id] = session
        try:
            await self._broker.publish(session, frame, None, kind="open_session")
        except (PublishReturned, PublishNacked):
            # The broker took no copy: the worker never saw the open. Closed here,
            # so close_idle() sends nothing for it and it is let go of like any
            # closed session. (After a timeout or a lost channel the worker may
            # have it: the session stays, and close_idle() closes it at the worker.)
            session.closed = True
            session.closed_at = asyncio.get_running_loop().time()
            raise
        self._log.info("session_opened", scope=scope, session_id=session_id)
        return session

    async def close(self, session: HostSession) -> None:
        """Seal and publish ``close_session`` for the newest session of ``session``'s chain."""
        await self.close_exact(session.current())

    async def replace(self, session: HostSession, reason: str) -> HostSession:
        """H§16.4: open a new session under the same manifest; close the old one.

        ``session`` is the one that failed. If another call replaced it already,
        its successor is returned: concurrent verbs that saw the same failure
        open one fresh session, and a late failure of an old session never
        replaces (and closes) a newer one.
        """
        async with self._replace_lock:
            if session.replaced_by is not None:
                return session.current()
            fresh = await self.open(session.scope, session.manifest)
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
                await self.close_exact(session)
        return fresh

    def retire_closed(self) -> None:
        """Let go of closed sessions no caller waits on any more.

        A session closed for longer than a whole verb's retries (every attempt
        a reply timeout plus the longest backoff) whose waiters are all given
        up is dropped with its waiters (and the runs they hold). Its id and
        authenticator are kept, so a late reply of it is still authenticated
        (a forged one is dead-lettered), and so is each request still
        unanswered, by run name and plan (the newest ``_MAX_RETIRED_REQUESTS``
        over all sessions): its late reply is applied to the ledger like a
        live one. A long-lived client otherwise keeps every session it ever
        opened.
        """
        now = asyncio.get_running_loop().time()
        settings = self._settings
        grace = settings.max_attempts * (settings.reply_timeout + settings.backoff_max)
        for session_id, session in list(self.by_id.items()):
            closed_at = session.closed_at
            if closed_at is None or now - closed_at < grace:
                continue
            if any(not waiter.abandoned for waiter in session._waiters.values()):
                continue
            del self.by_id[session_id]
            self.retired[session_id] = session.authenticator
            if len(self.retired) > _MAX_RETIRED_SESSIONS:
                del self.retired[next(iter(self.retired))]
            self._keep_unanswered(session_id, session._waiters)
            self._log.info("session_retired", scope=session.scope, session_id=session_id)

    def _keep_unanswered(self, session_id: str, waiters: Mapping[str, Waiter]) -> None:
        kept = self.retired_requests
        for request_id, waiter in waiters.items():
            if waiter.kind is None or waiter.run is None:
                continue  # a raw send's reply is applied to nothing
            kept[(session_id, request_id)] = RetiredRequest(
                waiter.kind, waiter.request, waiter.run.name, waiter.run.plan
            )
            if len(kept) > _MAX_RETIRED_REQUESTS:
                del kept[next(iter(kept))]

    async def close_exact(self, session: HostSession) -> None:
        """Close exactly this session (not its successor)."""
        if session.closed:
            return
        frame = session.authenticator.seal(CloseSession(session.session_id))
        session.closed = True
        session.closed_at = asyncio.get_running_loop().time()
        await self._broker.publish(session, frame, None, kind="close_session")
        self._log.info("session_closed", scope=session.scope, session_id=session.session_id)

    async def close_idle(self) -> None:
        """Close, at the worker, every open session no caller awaits a reply on.

        Sessions are process-local (H§16.1): no later client can use them, and
        a session left open is kept (and restored at every start) by the
        worker for ever. A session with a request still awaited is left open:
        its ``close_session`` could overtake that request at the worker, which
        would then refuse it rather than run it. The others' ``close_session``
        frames are published best effort, within one publish timeout.
        """
        idle = [
            session
            for session in self.by_id.values()
            if not session.closed and all(w.abandoned for w in session._waiters.values())
        ]
        if not idle or not self._broker.can_publish:
            return
        closing = [asyncio.ensure_future(self.close_exact(session)) for session in idle]
        done, late = await asyncio.wait(closing, timeout=self._settings.publish_timeout)
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

    def register(
        self,
        session: HostSession,
        request_id: str,
        kind: RequestKind | None,
        request: Any,
        run: HostRun | None,
    ) -> Waiter:
        """Register a request before its publish; its reply is routed to the waiter."""
        lost = self._broker.replies_lost
        if lost is not None:
            raise BrokerUnavailable(f"no replies: {lost}")
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
        waiter = Waiter(kind, request, run, future)
        waiters[request_id] = waiter
        sent = session._sent
        sent[request_id] = None
        if len(sent) > _MAX_SENT_REMEMBERED:
            del sent[next(iter(sent))]
        return waiter

    async def await_reply(self, session: HostSession, request_id: str, waiter: Waiter) -> Any:
        """The waiter's outcome; :class:`ReplyTimedOut` after the reply timeout.

        A timed-out or cancelled waiter stays registered, given up on, so a late
        reply is still applied to the ledger.
        """
        timeout = self._settings.reply_timeout
        try:
            async with asyncio.timeout(timeout):
                # Shielded: a timeout leaves the waiter registered for a late reply.
                return await asyncio.shield(waiter.future)
        except TimeoutError:
            waiter.abandoned = True
            self._log.warning(
                "reply_timeout",
                scope=session.scope,
                session_id=session.session_id,
                request_id=request_id,
                type=waiter.kind or "raw",
            )
            raise ReplyTimedOut(request_id, timeout) from None
        except asyncio.CancelledError:
            # Given up on like a timeout: a late reply is still applied, but the
            # waiter no longer keeps its session open or its run cached.
            waiter.abandoned = True
            raise

    def fail_waiting(self, reason: str, unexpected: bool) -> None:
        """Release every waiting request at once: no reply can arrive on this connection.

        ``unexpected`` (a lost connection, channel or consumer; the broker
        reconnects): each waiter is given up on with :class:`ReplyCut`, so its
        verb reconciles on the new connection and a late reply is still
        applied. Otherwise (the client is closing) it fails with
        ``BrokerUnavailable``.
        """
        waiting = [
            (request_id, waiter)
            for session in self.by_id.values()
            for request_id, waiter in session._waiters.items()
            if not waiter.abandoned
        ]
        if unexpected:
            self._log.warning("replies_cut", reason=reason, waiting=len(waiting))
        for request_id, waiter in waiting:
            if unexpected:
                waiter.fail(ReplyCut(request_id))
                waiter.abandoned = True
            else:
                waiter.fail(BrokerUnavailable(f"no replies: {reason}"))

    def awaited_runs(self) -> set[int]:
        """The ids of the runs a caller awaits a reply for.

        A waiter given up on (timed out, cancelled, or kept after a pending_*
        refusal) does not count: no reply may ever come for it, and the
        worker's journal keeps what it would say.
        """
        return {
            id(waiter.run)
            for session in self.by_id.values()
            for waiter in session._waiters.values()
            if waiter.run is not None and not waiter.abandoned
        }


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
