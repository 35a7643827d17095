"""The host client's sessions and the requests waiting on them.

This module owns :class:`HostSession` (a fresh session id, a fresh 32-byte
key nonce, the derived key and a HOST authenticator per ``open_session``),
the waiter of each request sent and not yet answered (:class:`Waiter`, in
its session's :class:`WaiterTable`), and :class:`SessionRegistry`: open,
close, replace (one fresh session for every verb that saw the same failure)
and retire sessions, register a request and await its reply; a retired
session's unanswered requests are kept (bounded) for their late replies.

A waiter a caller awaits pins its run in the client's run cache: the count
is kept on the run as waiters are registered, given up on and removed, so
no part ever scans the sessions' waiters to learn which runs are awaited.

It must never persist or reuse a session, replace a session newer than the
one that failed, drop a waiter a caller still awaits while one given up on
remains, cost more per request than the request's own waiter (no loop over
every session or waiter), or log keys, nonces or frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import ItemsView, Iterator, Mapping, MutableMapping, ValuesView
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from structlog.typing import FilteringBoundLogger

from octo_common.errors import InvalidScopeKey, OctoError
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.limits import PAYLOAD_CODEC
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
    "WaiterTable",
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
    """No authenticated reply arrived in time. Never evidence either way."""

    _fields = ("request_id", "timeout")
    _text = "no reply within the timeout"
    request_id: str
    timeout: float


class ReplyCut(OctoError):
    """The broker connection was lost while the request was out (or being published).

    Its reply may still come once the client has reconnected, or never: like a
    timeout, never evidence either way. The verb reconciles the same
    key on the new connection; a late reply is still applied.
    """

    _fields = ("request_id",)
    _text = "the broker connection was lost before the reply"
    request_id: str


class Waiter:
    """A request waiting for its reply (routed by correlation id = request id).

    ``kind`` is None for a frame sent with :meth:`HostClient.send`: its reply
    is handed over as it is, not applied to a ledger. While it sits in its
    session's :class:`WaiterTable` and is not given up on (``abandoned``), a
    caller awaits it and it pins ``run`` in the run cache. ``abandoned``
    only ever goes from False to True.
    """

    __slots__ = (
        "_abandoned",
        "_pinning",
        "_request_id",
        "_table",
        "future",
        "kind",
        "request",
        "run",
    )

    def __init__(
        self,
        kind: RequestKind | None,
        request: Any,
        run: HostRun | None,
        future: asyncio.Future[Any],
        abandoned: bool = False,
    ) -> None:
        self.kind = kind
        self.request = request
        self.run = run
        self.future = future
        self._abandoned = abandoned
        self._pinning = False  # counted in run._awaited
        self._table: WaiterTable | None = None
        self._request_id = ""

    @property
    def abandoned(self) -> bool:
        """Given up on (timed out, cancelled, kept for a late reply): no caller awaits it."""
        return self._abandoned

    @abandoned.setter
    def abandoned(self, value: bool) -> None:
        if not value:
            if self._abandoned:
                raise ValueError("a waiter given up on stays given up on")
            return
        if self._abandoned:
            return
        self._abandoned = True
        if self._table is not None:
            self._table._given_up[self._request_id] = None
        self._unpin()

    def resolve(self, value: Any) -> None:
        if not self._abandoned and not self.future.done():
            self.future.set_result(value)

    def fail(self, error: BaseException) -> None:
        if not self._abandoned and not self.future.done():
            self.future.set_exception(error)

    def _unpin(self) -> None:
        if self._pinning:
            self._pinning = False
            assert self.run is not None
            self.run._release_pin()

    def __repr__(self) -> str:
        return f"Waiter(kind={self.kind!r}, abandoned={self._abandoned})"


class WaiterTable(MutableMapping[str, Waiter]):
    """One session's waiters by request id, oldest first.

    Adding a waiter a caller awaits pins its run (``HostRun._awaited``);
    removing it or giving it up unpins it. The request ids of the waiters
    given up on are kept in the order they were given up, so the one to
    drop from a full session is found without a scan.
    """

    __slots__ = ("_given_up", "_items")

    def __init__(self) -> None:
        self._items: dict[str, Waiter] = {}
        self._given_up: dict[str, None] = {}

    def __getitem__(self, request_id: str) -> Waiter:
        return self._items[request_id]

    def __setitem__(self, request_id: str, waiter: Waiter) -> None:
        if waiter._table is not None:
            raise ValueError("a waiter belongs to one session's table")
        if request_id in self._items:
            del self[request_id]
        self._items[request_id] = waiter
        waiter._table = self
        waiter._request_id = request_id
        if waiter._abandoned:
            self._given_up[request_id] = None
        elif waiter.run is not None:
            waiter.run._awaited += 1
            waiter._pinning = True

    def __delitem__(self, request_id: str) -> None:
        waiter = self._items.pop(request_id)
        self._given_up.pop(request_id, None)
        waiter._table = None
        waiter._unpin()

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def get(self, request_id: str, default: Any = None) -> Any:
        return self._items.get(request_id, default)

    def values(self) -> ValuesView[Waiter]:
        return self._items.values()

    def items(self) -> ItemsView[str, Waiter]:
        return self._items.items()

    @property
    def awaited(self) -> int:
        """How many of these waiters a caller still awaits."""
        return len(self._items) - len(self._given_up)

    def first_given_up(self) -> str | None:
        """The request id of the waiter given up on first, None if none is."""
        return next(iter(self._given_up), None)

    def oldest(self) -> str:
        return next(iter(self._items))


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
    """One host session: scope, session id, key nonce, authenticator.

    Process-local; never persisted. When the client replaces a session
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
        self.requests = 0
        """Requests registered on this session (each retains one request id at the worker)."""
        self._waiters = WaiterTable()
        # Request ids this session sent (the newest _MAX_SENT_REMEMBERED, in
        # order): an authentic reply to one whose waiter is gone is a late or
        # repeated answer, dropped; one to any other id is unexpected.
        self._sent: dict[str, None] = {}

    @property
    def session_id(self) -> str:
        return self.authenticator.session_id

    def current(self) -> HostSession:
        """This session, or the newest session that replaced it.

        The chain is shortened as it is walked (each session passed points
        to the newest one): a handle kept across many replacements costs one
        step, and does not keep every session between alive.
        """
        newest = self
        while newest.replaced_by is not None:
            newest = newest.replaced_by
        session = self
        while session.replaced_by is not None and session.replaced_by is not newest:
            session.replaced_by, session = newest, session.replaced_by
        return newest

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
        self._closing: dict[str, HostSession] = {}
        """The closed sessions of ``by_id``, in the order they were closed."""
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
        # The reply queue is sealed in: a copy of this frame republished with
        # another queue's name gets no reply there. So is the payload codec:
        # every later frame of the session, both ways, is encrypted.
        codec = PAYLOAD_CODEC if self._settings.payload_codec else None
        frame = authenticator.seal(
            OpenSession(opening, reply_to=self._broker.reply_queue, payload_codec=codec)
        )
        if codec is not None:
            authenticator.use_payload_codec()
        self.retire_closed()
        self.by_id[session_id] = session
        try:
            await self._broker.publish(session, frame, None, kind="open_session")
        except (PublishReturned, PublishNacked):
            # The broker took no copy: the worker never saw the open. Closed here,
            # so close_idle() sends nothing for it and it is let go of like any
            # closed session. (After a timeout or a lost channel the worker may
            # have it: the session stays, and close_idle() closes it at the worker.)
            self._mark_closed(session)
            raise
        self._log.info("session_opened", scope=scope, session_id=session_id)
        return session

    async def close(self, session: HostSession) -> None:
        """Seal and publish ``close_session`` for the newest session of ``session``'s chain."""
        await self.close_exact(session.current())

    async def replace(self, session: HostSession, reason: str) -> HostSession:
        """Open a new session under the same manifest; close the old one.

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

        Only the sessions closed for longer than that are looked at (the
        oldest closes first): the cost is the sessions let go of plus those
        a caller still waits on, never every session held. A session closed
        with no waiter left (every request answered) never waits for the
        grace: ``_mark_closed`` lets it go at once.
        """
        now = asyncio.get_running_loop().time()
        settings = self._settings
        grace = settings.max_attempts * (settings.reply_timeout + settings.backoff_max)
        due: list[HostSession] = []
        for session in self._closing.values():
            closed_at = session.closed_at
            if closed_at is not None and now - closed_at < grace:
                break
            if session._waiters.awaited:
                continue
            due.append(session)
        for session in due:
            self._retire(session)

    def _retire(self, session: HostSession) -> None:
        """Let go of a closed session: keep its authenticator and unanswered requests."""
        session_id = session.session_id
        self._closing.pop(session_id, None)
        if self.by_id.get(session_id) is not session:
            return
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
        self._mark_closed(session)
        await self._broker.publish(session, frame, None, kind="close_session")
        self._log.info("session_closed", scope=session.scope, session_id=session.session_id)

    def _mark_closed(self, session: HostSession) -> None:
        session.closed = True
        session.closed_at = asyncio.get_running_loop().time()
        if self.by_id.get(session.session_id) is session:
            if not session._waiters:
                # Nothing can still be answered on it but repeats: let it go now,
                # so a busy client does not hold a grace period's worth of sessions.
                self._retire(session)
                return
            self._closing[session.session_id] = session

    async def close_idle(self) -> None:
        """Close, at the worker, every open session no caller awaits a reply on.

        Sessions are process-local: no later client can use them, and
        a session left open is kept (and restored at every start) by the
        worker for ever. A session with a request still awaited is left open:
        its ``close_session`` could overtake that request at the worker, which
        would then refuse it rather than run it. The others' ``close_session``
        frames are published best effort, within one publish timeout.
        """
        idle = [
            session
            for session in self.by_id.values()
            if not session.closed and not session._waiters.awaited
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
            # The first one given up on goes first; a caller still waiting
            # loses its waiter only when every one has a caller.
            oldest = waiters.first_given_up() or waiters.oldest()
            waiters.pop(oldest).abandoned = True
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A waiter given up on (timeout, cancelled verb) may still be failed by a
        # late routing; its outcome is read so it is never reported as lost.
        future.add_done_callback(_retrieve)
        waiter = Waiter(kind, request, run, future)
        waiters[request_id] = waiter
        session.requests += 1
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


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
