"""The host client's session registry: letting go of closed sessions costs what it lets go of.

No broker: the registry's bookkeeping (``retire_closed``, the replacement
chain) is exercised on sessions built in memory.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from typing import Any, cast

import structlog

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_host.client.broker import HostBroker
from octo_host.client.sessions import HostSession, SessionRegistry, Waiter
from octo_host.client.settings import ClientSettings
from octo_host.kinds import RequestKind

SCOPE = "tenant-a"
QUIET = structlog.wrap_logger(
    structlog.ReturnLogger(), wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR)
)


def registry() -> SessionRegistry:
    settings = ClientSettings(
        reply_timeout=1.0,
        publish_timeout=1.0,
        max_attempts=2,
        backoff_initial=0.1,
        backoff_max=0.5,
        max_cached_runs=16,
    )
    # retire_closed and current() never publish: no broker.
    return SessionRegistry({}, cast(HostBroker, None), settings, QUIET)


def session() -> HostSession:
    session_id, nonce = f"s-{secrets.token_hex(12)}", secrets.token_bytes(32)
    key = SessionKey.derive(ScopeKey(bytes([5]) * 32), SCOPE, session_id, nonce)
    authenticator = SessionAuthenticator(session_id, key, SessionRole.HOST)
    return HostSession(SCOPE, CapabilityManifest(session_id, []), nonce, authenticator)


async def test_retiring_looks_only_at_sessions_closed_long_enough() -> None:
    sessions = registry()
    now = asyncio.get_running_loop().time()
    grace = 2 * (1.0 + 0.5)
    open_ones = [session() for _ in range(500)]
    for item in open_ones:
        sessions.by_id[item.session_id] = item
    old, waited, recent = session(), session(), session()
    for item in (old, waited, recent):
        sessions.by_id[item.session_id] = item
        # Each closes with a request it sent still unanswered.
        pending: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        item._waiters["d-0"] = Waiter(RequestKind.DISPATCH, None, None, pending)
        item._waiters["d-0"].abandoned = True
        sessions._mark_closed(item)
    old.closed_at = waited.closed_at = now - grace - 1.0
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waited._waiters["d-1"] = Waiter(RequestKind.DISPATCH, None, None, future)
    # Only the closed sessions are candidates, oldest close first.
    assert list(sessions._closing) == [old.session_id, waited.session_id, recent.session_id]

    sessions.retire_closed()
    assert old.session_id not in sessions.by_id and old.session_id in sessions.retired
    # Still awaited, or closed too recently: kept, and still the only candidates.
    assert waited.session_id in sessions.by_id and recent.session_id in sessions.by_id
    assert list(sessions._closing) == [waited.session_id, recent.session_id]
    assert all(item.session_id in sessions.by_id for item in open_ones)

    waited._waiters["d-1"].abandoned = True  # its caller timed out
    sessions.retire_closed()
    assert waited.session_id in sessions.retired
    assert list(sessions._closing) == [recent.session_id]
    assert len(sessions.by_id) == 500 + 1


async def test_a_handle_kept_across_replacements_reaches_the_newest_in_one_step() -> None:
    chain = [session() for _ in range(50)]
    for older, newer in itertools.pairwise(chain):
        older.replaced_by = newer
    first = chain[0]
    assert first.current() is chain[-1]
    # Walked once: every session of the chain now points to the newest.
    assert all(item.replaced_by is chain[-1] for item in chain[:-1])
    assert chain[-1].replaced_by is None and chain[-1].current() is chain[-1]


async def test_a_session_closed_with_every_request_answered_is_let_go_at_once() -> None:
    sessions = registry()
    answered, unanswered = session(), session()
    for item in (answered, unanswered):
        sessions.by_id[item.session_id] = item
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    unanswered._waiters["d-1"] = Waiter(RequestKind.DISPATCH, None, None, future)
    unanswered._waiters["d-1"].abandoned = True

    sessions._mark_closed(answered)
    sessions._mark_closed(unanswered)
    # No grace for a session nothing is waited on: only its authenticator is kept,
    # so a repeated reply is still authenticated (and a forged one dead-lettered).
    assert answered.session_id not in sessions.by_id
    assert sessions.retired[answered.session_id] is answered.authenticator
    # One with a request still unanswered waits for the grace, as before.
    assert unanswered.session_id in sessions.by_id
    assert list(sessions._closing) == [unanswered.session_id]


async def test_closing_many_answered_sessions_holds_none_of_them() -> None:
    sessions = registry()
    for _ in range(5_000):
        item = session()
        sessions.by_id[item.session_id] = item
        sessions._mark_closed(item)
    assert sessions.by_id == {} and not sessions._closing
    # The ids kept for late replies are bounded too.
    assert 0 < len(sessions.retired) <= 4096
