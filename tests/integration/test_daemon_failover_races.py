"""A worker daemon on a shared PostgreSQL journal when its connection is lost at
the wrong moment: during an activation, before a reload, while a handler runs.

One in-process daemon on the real broker and a PostgreSQL schema of the
test's own; "another worker" is a second store object on the same schema
that reserves the scope's fence, as a standby taking the queue over would.
The interleavings are driven by events at the store boundary and by closing
the daemon's own connection (never the broker's others): no sleeps decide
an order.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import StorageBackendError
from octo_common.messages import RequestRejected
from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.daemon.scopes import ServedScope
from octo_worker.storage.configured import configured_store
from tests.postgres import PostgresSchema

from .conftest import WAIT, Names, RawHost, WorkerEnv, unique, wait_session, write_worker_env
from .test_daemon_lifecycle import _until
from .test_daemon_poisoning import _ask, _dispatch, _fail_the_next_commit, _opened

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.fixture
def worker_env(tmp_path: Path, names: Names, postgres_schema: PostgresSchema) -> WorkerEnv:
    """This module's worker keeps its journal in PostgreSQL: a shared journal."""
    env = write_worker_env(tmp_path, names.scope)
    place = postgres_schema
    text = env.config_path.read_text(encoding="utf-8")
    shared = (
        f'url = "{place.url}"\npassword_file = "{place.password_file}"\nschema = "{place.schema}"\n'
    )
    text = text.replace('journal = "journal.sqlite3"\n', shared)
    text = text.replace(
        "publish_timeout_seconds = 5.0\n",
        "publish_timeout_seconds = 5.0\nreconnect_initial_seconds = 0.1\n",
    )
    env.config_path.write_text(text, encoding="utf-8")
    env.config = load_config(env.config_path)
    assert env.config.shared_journal
    return env


async def _lose_connection(daemon: WorkerDaemon) -> None:
    """Close the daemon's own connection; return once it has reconnected and consumes."""
    before = daemon._broker.consume_channel
    connection = daemon._broker._connection
    assert connection is not None and before is not None
    await connection.close()
    await _until(
        lambda: (
            daemon._broker.consume_channel is not None
            and daemon._broker.consume_channel is not before
            and all(s.consumer_tag is not None for s in daemon._scopes.values())
        ),
        "the daemon's reconnection",
    )


async def _take_over(env: WorkerEnv) -> int:
    """Another worker on the same journal reserves the scope's fence; returns it."""
    other = configured_store(env.config)
    try:
        lease = await other.reserve_fence(env.scope)
    finally:
        await other.close()
    return lease.token


async def _stored_fence(daemon: WorkerDaemon, scope: str) -> int:
    return (await daemon.store.scope_metadata(scope)).fence


def _hold_first(daemon: WorkerDaemon, method: str) -> tuple[asyncio.Event, asyncio.Event]:
    """The next call of the store's ``method`` signals ``entered`` and waits for ``release``."""
    store: Any = daemon.store
    real = getattr(store, method)
    entered, release = asyncio.Event(), asyncio.Event()
    armed = [True]

    async def held(*args: Any, **kwargs: Any) -> Any:
        if armed[0]:
            armed[0] = False
            entered.set()
            await release.wait()
        return await real(*args, **kwargs)

    setattr(store, method, held)
    return entered, release


async def test_an_activation_whose_connection_was_lost_while_it_loaded_stays_standby(
    daemon: WorkerDaemon, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = daemon._scopes[worker_env.scope]
    assert scope.standby
    loading, release = _hold_first(daemon, "load_sessions")
    session = raw_host.session()
    await raw_host.open(session)  # the first delivery activates the scope: fence 1
    await asyncio.wait_for(loading.wait(), WAIT)
    assert await _stored_fence(daemon, worker_env.scope) == 1

    # The connection drops while the scope loads; another worker takes the
    # queue meanwhile and reserves fence 2. The open, never acked, comes back
    # on the new connection and waits for the activation under way.
    await _lose_connection(daemon)
    assert await _take_over(worker_env) == 2
    release.set()

    # That activation leaves the scope in standby; the redelivered open
    # activates it under a fresh fence, and the session opens.
    await wait_session(daemon, worker_env.scope, session.session_id)
    assert not scope.standby and not scope.superseded
    assert scope.lease is not None and scope.lease.token == 3
    assert await _stored_fence(daemon, worker_env.scope) == 3
    assert not daemon._stopping.is_set()


async def test_a_reload_of_a_scope_in_standby_reserves_no_fence(
    daemon: WorkerDaemon, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = daemon._scopes[worker_env.scope]
    session = await _opened(daemon, raw_host, worker_env.scope)  # activated: fence 1
    assert scope.lease is not None and scope.lease.token == 1
    # A handler of the scope still running: the reload waits for it.
    busy = asyncio.Event()
    handler = asyncio.ensure_future(busy.wait())
    scope.active.add(handler)
    try:
        _fail_the_next_commit(daemon)
        refused = await _ask(raw_host, session, "d-1", unique("op"))
        assert isinstance(refused, RequestRejected)
        assert refused.code == "journal_persistence_failed"
        await _until(lambda: scope.reload is not None, "the reload")
        # The connection drops; another worker takes the scope (fence 2).
        await _lose_connection(daemon)
        assert scope.standby
        assert await _take_over(worker_env) == 2
    finally:
        busy.set()
        await handler
        scope.active.discard(handler)
    reload = scope.reload
    assert reload is not None
    await asyncio.wait_for(reload, WAIT)

    # The reload reserved nothing: the other worker's fence stands.
    assert await _stored_fence(daemon, worker_env.scope) == 2
    assert scope.standby and not scope.superseded
    assert scope.sessions == {}
    assert not daemon._stopping.is_set()

    # A delivery makes this worker active again, under a fence of its own.
    fresh = await _opened(daemon, raw_host, worker_env.scope)
    assert fresh.session_id in scope.sessions
    assert scope.lease is not None and scope.lease.token == 3
    assert not scope.standby and not scope.superseded


def _fail_the_next_commit_when_released(
    daemon: WorkerDaemon,
) -> tuple[asyncio.Event, asyncio.Event]:
    """The next commit signals ``entered``, waits for ``release``, then fails."""
    store: Any = daemon.store
    real = store.commit
    entered, release = asyncio.Event(), asyncio.Event()
    armed = [True]

    async def commit(*args: Any) -> Any:
        if armed[0]:
            armed[0] = False
            entered.set()
            await release.wait()
            raise StorageBackendError("injected")
        return await real(*args)

    store.commit = commit
    return entered, release


class _WatchedLock(asyncio.Lock):
    """A lock that says when a second task started waiting for it."""

    def __init__(self) -> None:
        super().__init__()
        self.contended = asyncio.Event()

    async def acquire(self) -> bool:
        if self.locked():
            self.contended.set()
        return await super().acquire()


def _watch_loads(
    daemon: WorkerDaemon, scope: ServedScope
) -> tuple[asyncio.Event, asyncio.Event, asyncio.Event]:
    """The next ``ScopeLifecycle.load`` of ``scope`` waits for ``release``; a second one started
    meanwhile sets ``overlapped``. Returns (first entered, overlapped, release)."""
    lifecycle = daemon._scopes_lifecycle()
    real = lifecycle.load
    entered, overlapped, release = asyncio.Event(), asyncio.Event(), asyncio.Event()
    calls = [0]

    async def load(target: ServedScope, *, open_gate: bool = True) -> None:
        calls[0] += 1
        if calls[0] == 1:
            entered.set()
            await release.wait()
        elif not release.is_set():
            overlapped.set()
        await real(target, open_gate=open_gate)

    lifecycle.load = load  # type: ignore[method-assign]
    return entered, overlapped, release


async def test_a_reload_and_an_activation_never_load_the_scope_at_once(
    daemon: WorkerDaemon, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = daemon._scopes[worker_env.scope]
    session = await _opened(daemon, raw_host, worker_env.scope)  # activated: fence 1
    lock = _WatchedLock()
    scope.lifecycle = lock
    committing, release_commit = _fail_the_next_commit_when_released(daemon)
    key = unique("op")
    await raw_host.publish(
        _dispatch(session, "d-1", key),
        headers=raw_host.headers(session, unique("m")),
        correlation_id="d-1",
    )
    await asyncio.wait_for(committing.wait(), WAIT)  # its admission commit is held
    # The connection drops with the dispatch unacked: it comes back on the new
    # connection and activates the scope, which waits for the held handler.
    first_load, overlapped, release_load = _watch_loads(daemon, scope)
    await _lose_connection(daemon)
    await _until(
        lambda: scope.activation is not None and not scope.activation.done(), "the activation"
    )
    release_commit.set()  # the commit fails: the session is poisoned, a reload starts
    await asyncio.wait_for(first_load.wait(), WAIT)
    await _until(lambda: scope.reload is not None, "the reload")
    waiting = asyncio.ensure_future(lock.contended.wait())
    overlap = asyncio.ensure_future(overlapped.wait())
    try:
        await asyncio.wait({waiting, overlap}, timeout=WAIT, return_when="FIRST_COMPLETED")
        assert not overlapped.is_set(), "the reload loaded the scope during the activation"
        assert lock.contended.is_set()
    finally:
        for task in (waiting, overlap):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        release_load.set()
    reload = scope.reload
    assert reload is not None
    await asyncio.wait_for(reload, WAIT)

    # Activation (fence 2), then the reload (fence 3): every session in memory
    # holds the scope's lease, and the poisoned session is stored so.
    assert not scope.standby and not scope.superseded
    assert scope.lease is not None and scope.lease.token == 3
    assert await _stored_fence(daemon, worker_env.scope) == 3
    await wait_session(daemon, worker_env.scope, session.session_id, status="poisoned")
    assert not daemon._stopping.is_set()
