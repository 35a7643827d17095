"""The daemon's side of poisoning (reload, fence, persist) with a fault at the store sessions use.

A commit that fails poisons its session: the host gets a refusal, committed
(its sequence and the status ``poisoned``) before it is published, the daemon
pauses the scope, reloads it under a freshly reserved fence, records the
session as ``poisoned`` if its refusal could not, and resumes. The adapter never runs for the failed
admission; a new session then dispatches the same key and the effect happens
exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from octo_common.errors import OctoError, StorageBackendError
from octo_common.messages import DispatchOperation, OperationDispatchRequest, RequestRejected
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import TOOL, WAIT, RawHost, RawSession, WorkerEnv, unique, wait_session

pytestmark = pytest.mark.rabbitmq


def _dispatch(session: RawSession, request_id: str, key: str) -> bytes:
    payload = ToolPayload.json({"name": "poison.txt", "content": "once"})
    request = OperationDispatchRequest(session.session_id, request_id, TOOL, key, payload)
    return session.auth.seal(DispatchOperation(request))


async def _ask(raw_host: RawHost, session: RawSession, request_id: str, key: str) -> Any:
    await raw_host.publish(
        _dispatch(session, request_id, key),
        headers=raw_host.headers(session, unique("m")),
        correlation_id=request_id,
    )
    reply = await raw_host.replies.wait_for(lambda m: m.correlation_id == request_id)
    return session.auth.open(reply.body)


async def _opened(daemon: WorkerDaemon, raw_host: RawHost, scope: str) -> RawSession:
    session = raw_host.session()
    await raw_host.open(session)
    await wait_session(daemon, scope, session.session_id)
    return session


def _fail_the_next_commit(daemon: WorkerDaemon) -> None:
    """Arm one failing commit at the store boundary the sessions use."""
    store = daemon.store
    real_commit = store.commit
    failures = 0

    async def failing_once(*args: Any) -> int:
        nonlocal failures
        if failures == 0:
            failures += 1
            raise StorageBackendError("injected")
        return await real_commit(*args)

    store.commit = failing_once  # type: ignore[method-assign]


async def _poisoned_session(
    workers: Any, raw_host: RawHost, scope: str
) -> tuple[WorkerDaemon, RawSession]:
    """A started worker and a session its first failed commit poisoned (stored so)."""
    daemon = await workers.start()
    session = await _opened(daemon, raw_host, scope)
    _fail_the_next_commit(daemon)
    first = await _ask(raw_host, session, "d-1", unique("op"))
    assert isinstance(first, RequestRejected) and first.code == "journal_persistence_failed"
    await wait_session(daemon, scope, session.session_id, status="poisoned")
    return daemon, session


async def _eventually(check: Callable[[], Awaitable[bool]]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not await check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_a_failed_admission_commit_poisons_and_the_scope_reloads(
    daemon: WorkerDaemon, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = worker_env.scope
    session = await _opened(daemon, raw_host, scope)
    lease = daemon._scopes[scope].lease
    assert lease is not None
    fence_before = lease.token

    _fail_the_next_commit(daemon)
    key = "op-poisoned-1"
    refused = await _ask(raw_host, session, "d-1", key)

    assert isinstance(refused, RequestRejected)
    assert refused.code == "journal_persistence_failed"
    assert read_effect_log(worker_env.effect_log) == []  # the adapter never ran

    # The daemon reloads the scope and records the session as poisoned.
    await wait_session(daemon, scope, session.session_id, status="poisoned")
    await _eventually(lambda: _consuming(daemon, scope))
    reloaded = daemon._scopes[scope].lease
    assert reloaded is not None and reloaded.token > fence_before  # a freshly reserved fence

    # The poisoned session keeps refusing; a new session reaches the same key.
    again = await _ask(raw_host, session, "d-2", key)
    assert isinstance(again, RequestRejected) and again.code == "session_poisoned"

    fresh = raw_host.session()
    await raw_host.open(fresh)
    await wait_session(daemon, scope, fresh.session_id)
    answer = await _ask(raw_host, fresh, "d-3", key)
    assert answer.result.status == Succeeded(answer.result.status.payload)
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]


async def _consuming(daemon: WorkerDaemon, scope: str) -> bool:
    state = daemon._scopes[scope]
    return state.consumer_tag is not None and not state.reloading


async def test_no_frame_meets_a_reloaded_session_before_it_is_marked_poisoned(
    daemon: WorkerDaemon, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = worker_env.scope
    session = await _opened(daemon, raw_host, scope)
    store = daemon.store
    real_commit = store.commit
    calls = 0
    gate_open_at_marking: list[bool] = []

    async def observed(*args: Any) -> int:
        nonlocal calls
        calls += 1
        if calls <= 2:
            # The admission, then the refusal's own commit: the refusal is
            # published best-effort, uncommitted.
            raise StorageBackendError("injected")
        if calls == 3:
            # The reload's first commit marks the session poisoned: the scope's
            # gate must still be shut, so no queued frame runs against the
            # reloaded session while it still reads "open".
            gate_open_at_marking.append(daemon._scopes[scope].running.is_set())
        return await real_commit(*args)

    store.commit = observed  # type: ignore[method-assign]
    refused = await _ask(raw_host, session, "d-1", "op-gated-1")
    assert isinstance(refused, RequestRejected) and refused.code == "journal_persistence_failed"
    await wait_session(daemon, scope, session.session_id, status="poisoned")
    await _eventually(lambda: _consuming(daemon, scope))
    assert gate_open_at_marking == [False]
    assert daemon._scopes[scope].running.is_set()


async def test_refusals_of_a_stored_poisoned_session_never_reuse_a_sequence_number(
    workers: Any, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = worker_env.scope
    daemon, session = await _poisoned_session(workers, raw_host, scope)
    # Stored as poisoned now: every later frame is refused with a new sequence number.
    second = await _ask(raw_host, session, "d-2", unique("op"))
    assert isinstance(second, RequestRejected) and second.code == "session_poisoned"

    # A restart loads the session from the store; its next refusal must not be
    # sealed with d-2's sequence (the host would drop it as a duplicate).
    await workers.stop(daemon)
    await workers.start()
    for request_id in ("d-3", "d-4"):
        refused = await _ask(raw_host, session, request_id, unique("op"))
        assert isinstance(refused, RequestRejected) and refused.code == "session_poisoned"
        assert refused.request_id == request_id
    assert read_effect_log(worker_env.effect_log) == []


async def test_a_failed_refusal_sequence_commit_reloads_the_scope_to_persist_it(
    workers: Any, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = worker_env.scope
    daemon, session = await _poisoned_session(workers, raw_host, scope)
    await _eventually(lambda: _consuming(daemon, scope))
    fence = daemon._scopes[scope].lease.token  # type: ignore[union-attr]

    # The commit persisting d-2's refusal sequence fails: the scope reloads.
    _fail_the_next_commit(daemon)
    second = await _ask(raw_host, session, "d-2", unique("op"))
    assert isinstance(second, RequestRejected) and second.code == "session_poisoned"
    await _eventually(
        lambda: _fenced_above(daemon, scope, fence)  # the reload's fresh fence
    )
    await _eventually(lambda: _consuming(daemon, scope))

    # After a restart the next refusal has a sequence the host has not seen.
    await workers.stop(daemon)
    await workers.start()
    third = await _ask(raw_host, session, "d-3", unique("op"))
    assert isinstance(third, RequestRejected) and third.code == "session_poisoned"


async def _fenced_above(daemon: WorkerDaemon, scope: str, fence: int) -> bool:
    lease = daemon._scopes[scope].lease
    return lease is not None and lease.token > fence


async def test_a_reload_waits_for_the_refusal_commit_of_a_stored_poisoned_session(
    workers: Any, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    """A stored-poisoned session's refusal is committed (its sequence with it)
    before it is published. A reload starting meanwhile
    (another session poisons) must wait for that commit: with a new fence
    under it, the commit would fail, and a commit refused by the daemon's own
    newer fence must never be taken for another worker's."""
    scope = worker_env.scope
    daemon = await workers.start()
    x1, x2, y = [await _opened(daemon, raw_host, scope) for _ in range(3)]
    for session in (x1, x2):
        _fail_the_next_commit(daemon)
        refused = await _ask(raw_host, session, unique("p"), unique("op"))
        assert isinstance(refused, RequestRejected)
        await wait_session(daemon, scope, session.session_id, status="poisoned")
        await _eventually(lambda: _consuming(daemon, scope))
    fence = daemon._scopes[scope].lease.token  # type: ignore[union-attr]

    # X1's refusal commit goes into a slow transaction (a slow fsync) and X2's
    # queues behind it, when Y's next commit fails and its reload starts.
    store = daemon.store
    apply_batch = store._writer.apply_batch

    def slow_for_x1(batch: Any) -> Any:
        if any(w.item == x1.session_id for pending in batch for w in pending.writes):
            time.sleep(0.5)
        return apply_batch(batch)

    store._writer.apply_batch = slow_for_x1  # type: ignore[method-assign]
    boundary = daemon.store
    commit = boundary.commit
    rejected: list[str] = []

    async def y_fails_once(scope_name: str, lease: Any, changes: Any) -> int:
        if y.session_id in changes.sessions and not rejected:
            rejected.append("y")
            raise StorageBackendError("injected")
        try:
            return await commit(scope_name, lease, changes)
        except OctoError as exc:
            rejected.append(exc.code)
            raise

    boundary.commit = y_fails_once  # type: ignore[method-assign]
    first = await _ask(raw_host, x1, unique("q"), unique("op"))
    second = asyncio.ensure_future(_ask(raw_host, x2, unique("q"), unique("op")))
    await asyncio.sleep(0.1)
    third = asyncio.ensure_future(_ask(raw_host, y, unique("q"), unique("op")))
    assert first.code == (await second).code == "session_poisoned"
    assert (await third).code == "journal_persistence_failed"
    state = daemon._scopes[scope]

    async def reloaded() -> bool:
        # The refusal may be published before the reload takes its new fence.
        lease = state.lease
        return lease is not None and lease.token > fence and await _consuming(daemon, scope)

    await _eventually(reloaded)
    assert state.lease is not None and state.lease.token == fence + 1  # the reload's
    assert rejected == ["y"]  # no commit of the daemon's own met the new fence
    assert not state.superseded and scope not in daemon._supersession.scopes
    assert daemon.healthy()
    await workers.stop(daemon)
    await workers.start()
    # X2's refusal sequence was persisted: its next refusal has a new one.
    again = await _ask(raw_host, x2, unique("q"), unique("op"))
    assert isinstance(again, RequestRejected) and again.code == "session_poisoned"


async def test_a_stop_during_a_reload_lets_it_record_the_session_poisoned(
    workers: Any, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    scope = worker_env.scope
    daemon = await workers.start()
    session = await _opened(daemon, raw_host, scope)
    boundary = daemon.store
    commit = boundary.commit
    failed: list[bool] = []

    async def fail_twice_then_slow_poisoned(scope_name: str, lease: Any, changes: Any) -> int:
        if len(failed) < 2:
            failed.append(True)  # the admission, then its refusal: published best-effort
            raise StorageBackendError("injected")
        if any(b'"status":"poisoned"' in d.state for d in changes.sessions.values()):
            await asyncio.sleep(0.5)  # recording it poisoned, slow
        return await commit(scope_name, lease, changes)

    boundary.commit = fail_twice_then_slow_poisoned  # type: ignore[method-assign]
    request_id = unique("d")
    await raw_host.publish(
        _dispatch(session, request_id, unique("op")),
        headers=raw_host.headers(session, unique("m")),
        correlation_id=request_id,
    )
    await _eventually(lambda: _reloading(daemon, scope))

    await workers.stop(daemon)  # SIGTERM while the reload runs

    restarted = await workers.start()
    stored = await restarted.store.load_sessions(scope)
    assert stored[session.session_id].status == "poisoned"
    # The frame was answered best-effort, and the next refusal is a new frame:
    # the reload persisted the session's counter past that refusal's sequence.
    reply = await raw_host.replies.wait_for(lambda m: m.correlation_id == request_id)
    refused = session.auth.open(reply.body)
    assert isinstance(refused, RequestRejected) and refused.code == "journal_persistence_failed"
    again = await _ask(raw_host, session, unique("d"), unique("op"))
    assert isinstance(again, RequestRejected) and again.code == "session_poisoned"


async def _reloading(daemon: WorkerDaemon, scope: str) -> bool:
    return daemon._scopes[scope].reloading
