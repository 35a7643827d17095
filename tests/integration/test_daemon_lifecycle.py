"""The daemon's stop, broker-side consumer loss and supersession on the real broker.

SIGTERM (``request_stop``) stops consuming first, lets the handlers already
running finish while the connection is still open (their replies reach the
host), and never starts a delivery that was still waiting: the broker
redelivers it to the next worker. A consumer the broker cancels (its queue
deleted) is restored by serving again from a fresh connection.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection

from octo_common.grants import CapabilityManifest
from octo_common.messages import (
    CloseSession,
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    OperationResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_common.transport import FrameEnvelope, PublishChannelClosed, worker_queue
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.daemon.topology import TopologyError

from .conftest import (
    GRANT,
    TOOL,
    WAIT,
    Inbox,
    Names,
    RawHost,
    RawSession,
    WorkerEnv,
    WorkerRunner,
    marker_of,
    reason_of,
    wait_session,
)
from .test_daemon_rabbitmq import _SlowFiles, answer, dispatch_frame, opened, operation_key

pytestmark = pytest.mark.rabbitmq


def _publish_frame(session: RawSession, request_id: str, key: str, name: str) -> bytes:
    payload = ToolPayload.json({"name": name, "content": "hello"})
    request = OperationDispatchRequest(session.session_id, request_id, TOOL, key, payload)
    return session.auth.seal(DispatchOperation(request))


async def _until(condition: Any, what: str, timeout: float = WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_stop_lets_the_running_handler_reply_and_starts_no_waiting_delivery(
    raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    # One handler at a time: the second delivery waits for the first.
    config = msgspec.structs.replace(
        worker_env.config,
        scopes=tuple(
            msgspec.structs.replace(scope, max_concurrency=1) for scope in worker_env.config.scopes
        ),
    )
    adapter = _SlowFiles(worker_env, delay=0.8)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    first = WorkerDaemon(config, adapters=adapters)
    task = asyncio.create_task(first.run())
    await asyncio.wait_for(first.wait_ready(), WAIT)
    session = await opened(raw_host, first)
    keys = [operation_key(), operation_key()]
    for index, key in enumerate(keys):
        request_id = f"d-{index}"
        await raw_host.publish(
            _publish_frame(session, request_id, key, f"notes-{index}.txt"),
            headers=raw_host.headers(session, request_id),
            correlation_id=request_id,
        )
    await _until(lambda: adapter.dispatches == 1, "the first effect to start")
    first.request_stop()
    await asyncio.wait_for(task, 15.0)

    # The running handler finished inside the grace period and its reply was
    # published on the still-open connection.
    reply = await asyncio.wait_for(answer(raw_host, session, "d-0"), WAIT)
    assert isinstance(reply, OperationResult)
    assert isinstance(reply.result.status, Succeeded)
    # The waiting delivery never started: no admission, no effect.
    assert adapter.dispatches == 1
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert [r.operation_key for r in raw_host.replies.items if r.correlation_id == "d-1"] == []

    # The broker redelivers it to the next worker, which runs it once.
    runner = WorkerRunner(worker_env)
    second = await runner.start()
    try:
        late = await asyncio.wait_for(answer(raw_host, session, "d-1"), WAIT)
        assert isinstance(late, OperationResult)
        assert isinstance(late.result.status, Succeeded)
        assert len(read_effect_log(worker_env.effect_log)) == 2
        records = {r.operation_key for r, _ in await second.store.list_records(raw_host.scope)}
        assert set(keys) <= records
    finally:
        await runner.stop_all()


async def test_a_consumer_cancelled_by_the_broker_is_restored(
    broker: AbstractConnection, raw_host: RawHost, workers: WorkerRunner
) -> None:
    daemon = await workers.start()
    scope = raw_host.scope
    before = daemon._scopes[scope].consumer_tag
    assert before is not None

    # Deleting the queue makes the broker cancel the daemon's consumer.
    channel = await broker.channel()
    await channel.queue_delete(worker_queue(scope))
    await channel.close()

    # The daemon serves again from a fresh connection: queue re-declared, consumed.
    await _until(
        lambda: daemon._scopes[scope].consumer_tag not in (None, before),
        "the consumer to be restored",
    )
    assert daemon.healthy()
    session = await opened(raw_host, daemon)
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    reply = await asyncio.wait_for(answer(raw_host, session, "d-1"), WAIT)
    assert isinstance(reply, OperationResult)


async def test_a_worker_superseded_in_its_only_scope_stops_and_the_new_owner_serves(
    raw_host: RawHost, worker_env: WorkerEnv, workers: WorkerRunner
) -> None:
    old = WorkerDaemon(worker_env.config)
    old_task = asyncio.create_task(old.run())
    try:
        await asyncio.wait_for(old.wait_ready(), WAIT)
        session = await opened(raw_host, old)
        # A second worker on the same journal reserves a newer fence; the
        # broker keeps delivering to the old one (single active consumer).
        new = await workers.start()
        await raw_host.publish(
            _publish_frame(session, "d-1", operation_key(), "a.txt"),
            headers=raw_host.headers(session, "d-1"),
            correlation_id="d-1",
        )
        # The old worker's commit meets the newer fence: it fails closed and
        # stops by itself, handing its deliveries back.
        await asyncio.wait_for(old_task, WAIT)
    finally:
        if not old_task.done():
            old.request_stop()
            await asyncio.wait_for(old_task, 15.0)
    assert old._scopes[raw_host.scope].superseded
    await _until(lambda: new._scopes[raw_host.scope].consumer_tag is not None, "the new owner")
    await raw_host.publish(
        _publish_frame(session, "d-2", operation_key(), "b.txt"),
        headers=raw_host.headers(session, "d-2"),
        correlation_id="d-2",
    )
    reply = await asyncio.wait_for(answer(raw_host, session, "d-2"), WAIT)
    assert isinstance(reply, OperationResult)
    assert isinstance(reply.result.status, Succeeded)


async def test_an_undeliverable_outbox_row_does_not_hold_back_the_rows_after_it(
    broker: AbstractConnection,
    channel: AbstractChannel,
    names: Names,
    raw_host: RawHost,
    worker_env: WorkerEnv,
) -> None:
    gone = raw_host
    other = RawHost(channel, names.scope, names.host("-other"), worker_env.scope_key)
    await other.start(broker)
    runner = WorkerRunner(worker_env)
    first = await runner.start()
    try:
        lost = await opened(gone, first)
        kept = await opened(other, first)
        # Both reply queues vanish: both replies stay in the outbox, oldest first.
        admin = await broker.channel()
        for queue in (gone.reply_queue, other.reply_queue):
            await admin.queue_delete(queue)
        for host, session, request_id, name in (
            (gone, lost, "d-lost", "lost.txt"),
            (other, kept, "d-kept", "kept.txt"),
        ):
            await host.publish(
                _publish_frame(session, request_id, operation_key(), name),
                headers=host.headers(session, request_id),
                correlation_id=request_id,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while len(await first.store.load_outbox(names.scope)) < 2:
            assert loop.time() < deadline, "the two replies never reached the outbox"
            await asyncio.sleep(0.05)
        assert len(read_effect_log(worker_env.effect_log)) == 2
    finally:
        await runner.stop_all()

    # Only the second host comes back. At the next start the first row is
    # returned (its queue is gone for good); the second is still republished.
    await other.start(broker)
    second = await runner.start()
    try:
        reply = await asyncio.wait_for(answer(other, kept, "d-kept"), WAIT)
        assert isinstance(reply, OperationResult)
        assert isinstance(reply.result.status, Succeeded)
    finally:
        await runner.stop_all()
        await admin.close()
    assert second is not None


async def test_a_publish_on_a_dead_channel_waits_without_spinning(
    broker: AbstractConnection, worker_env: WorkerEnv
) -> None:
    config = msgspec.structs.replace(
        worker_env.config,
        broker=msgspec.structs.replace(worker_env.config.broker, publish_timeout_seconds=0.4),
    )
    daemon = WorkerDaemon(config)
    dead = await broker.channel()
    await dead.close()
    # The channel died and the connection loop has not noticed yet.
    publisher = daemon._broker.publisher
    publisher.use(None, dead)
    daemon._broker._connected.set()
    envelope = FrameEnvelope(b"{}", "m-1", None, None, {}, "octo.v5.reply.nobody")

    # The outbox republish fails at once: it runs on the connection being set up.
    with pytest.raises(PublishChannelClosed):
        await asyncio.wait_for(publisher.publish(envelope, await_reconnect=False), 1.0)

    # A live reply waits for a reconnect up to 3 publish timeouts, sleeping.
    cpu = time.process_time()
    wall = time.monotonic()
    with pytest.raises(PublishChannelClosed):
        await asyncio.wait_for(publisher.publish(envelope), 5.0)
    assert time.monotonic() - wall >= 1.0
    assert time.process_time() - cpu < 0.5  # it slept; it did not spin for 1.2 s


async def test_a_set_up_that_keeps_failing_after_connecting_backs_off(
    worker_env: WorkerEnv,
) -> None:
    config = msgspec.structs.replace(
        worker_env.config,
        broker=msgspec.structs.replace(
            worker_env.config.broker, reconnect_initial_seconds=0.1, reconnect_max_seconds=5.0
        ),
    )
    daemon = WorkerDaemon(config)
    attempts = 0

    async def failing_set_up(connection: Any) -> None:
        nonlocal attempts
        attempts += 1
        daemon._broker._connection = connection
        raise TopologyError("queue declared with other arguments")

    daemon._broker._serve = failing_set_up  # type: ignore[method-assign]
    task = asyncio.create_task(daemon.run())
    await asyncio.sleep(2.0)
    daemon.request_stop()
    await asyncio.wait_for(task, 15.0)
    # 0.1 + 0.2 + 0.4 + 0.8 s of back-off fit in 2 s; a fixed 0.1 s would allow ~20.
    assert 2 <= attempts <= 6, attempts


async def test_a_republished_reply_leaves_the_outbox_and_is_not_republished_at_every_start(
    names: Names, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    runner = WorkerRunner(worker_env)
    first = await runner.start()
    try:
        session = await opened(raw_host, first)
        await raw_host.publish(
            _publish_frame(session, "d-idle", operation_key(), "idle.txt"),
            headers=raw_host.headers(session, "d-idle"),
            correlation_id="d-idle",
        )
        reply = await asyncio.wait_for(answer(raw_host, session, "d-idle"), WAIT)
        assert isinstance(reply, OperationResult)
        # The session goes idle: the reply's row waits for a next commit that
        # never comes (the host went away, or just has nothing more to send).
        assert len(await first.store.load_outbox(names.scope)) == 1
    finally:
        await runner.stop_all()

    def copies() -> int:
        return len(raw_host.replies.matching(lambda m: m.correlation_id == "d-idle"))

    second = await runner.start()
    try:
        # Republished once at the start (the host drops it as a duplicate),
        # then deleted: nothing is left to republish.
        await _until(lambda: copies() == 2, "the republished copy")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while await second.store.load_outbox(names.scope):
            assert loop.time() < deadline, "the confirmed row was never deleted"
            await asyncio.sleep(0.05)
    finally:
        await runner.stop_all()

    third = await runner.start()
    try:
        await asyncio.sleep(0.5)
        assert copies() == 2
        assert await third.store.load_outbox(names.scope) == []
    finally:
        await runner.stop_all()
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def _close(raw_host: RawHost, daemon: WorkerDaemon, scope: str, session: RawSession) -> None:
    await raw_host.publish(
        session.auth.seal(CloseSession(session.session_id)),
        headers=raw_host.headers(session, "close"),
    )
    await wait_session(daemon, scope, session.session_id, "closed")


async def _opened_and_closed(raw_host: RawHost, daemon: WorkerDaemon, scope: str) -> RawSession:
    session = await opened(raw_host, daemon)
    await _close(raw_host, daemon, scope, session)
    return session


async def test_a_closed_session_is_held_by_its_id_only_and_still_refuses_every_frame(
    names: Names, raw_host: RawHost, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    runner = WorkerRunner(worker_env)
    first = await runner.start()
    try:
        session = await _opened_and_closed(raw_host, first, names.scope)
        scope = first._scopes[names.scope]
        await _until(lambda: session.session_id in scope.closed, "the session to be let go")
        # Nothing of it is kept but its id (a long-lived worker closes many).
        assert session.session_id not in scope.sessions
    finally:
        await runner.stop_all()
    open_frame = session.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )

    second = await runner.start()
    try:
        scope = second._scopes[names.scope]
        # Not even read at start: looked up in the store when a frame of it comes.
        assert session.session_id not in scope.closed
        assert session.session_id not in scope.sessions
        head = await second.store.head_revision(names.scope)
        # A replayed open first: the store refuses it (the id exists), and the
        # id is remembered, so the late frame is refused from memory.
        await raw_host.publish(open_frame, headers=raw_host.headers(session, "reopen"))
        assert reason_of(await dead_letters.wait_for(marker_of("reopen"))) == "session_replay"
        assert session.session_id in scope.closed
        await raw_host.publish(
            _publish_frame(session, "d-late", operation_key(), "late.txt"),
            headers=raw_host.headers(session, "late"),
            correlation_id="d-late",
        )
        assert reason_of(await dead_letters.wait_for(marker_of("late"))) == "session_closed"
        failures = second.metrics.registry.get_sample_value(
            "octo_journal_commit_failures_total", {"code": "session_replay"}
        )
        assert not failures  # a replayed open is no journal failure (no alert)
        assert await second.store.head_revision(names.scope) == head
        assert raw_host.replies.matching(lambda m: m.correlation_id == "d-late") == []
        persisted = await second.store.load_sessions(names.scope)
        assert persisted[session.session_id].status == "closed"
    finally:
        await runner.stop_all()
    assert read_effect_log(worker_env.effect_log) == []


async def test_a_session_closed_while_a_handler_runs_is_let_go_of_after_that_handler(
    names: Names, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapter = _SlowFiles(worker_env, delay=0.8)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    runner = WorkerRunner(worker_env)
    daemon = await runner.start(adapters=adapters)
    try:
        session = await opened(raw_host, daemon)
        await raw_host.publish(
            _publish_frame(session, "d-slow", operation_key(), "slow.txt"),
            headers=raw_host.headers(session, "d-slow"),
            correlation_id="d-slow",
        )
        await _until(lambda: adapter.dispatches == 1, "the effect to start")
        await _close(raw_host, daemon, names.scope, session)
        scope = daemon._scopes[names.scope]
        # Its dispatch is still running: the session is kept for it.
        assert session.session_id in scope.sessions
        reply = await asyncio.wait_for(answer(raw_host, session, "d-slow"), WAIT)
        assert isinstance(reply, OperationResult)
        assert isinstance(reply.result.status, Succeeded)
        # The dispatch's reply, confirmed after the close commit, leaves the
        # outbox; then the session is held by its id only.
        await _until(lambda: session.session_id in scope.closed, "the session to be let go")
        assert session.session_id not in scope.sessions
        assert await daemon.store.load_outbox(names.scope) == []
    finally:
        await runner.stop_all()
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_letting_a_closed_session_go_reads_only_its_own_outbox_rows(
    names: Names, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    runner = WorkerRunner(worker_env)
    daemon = await runner.start()
    try:
        # Twelve sessions each leave their last reply in the outbox: confirmed,
        # deleted only by the session's next commit.
        sessions = [await opened(raw_host, daemon) for _ in range(12)]
        for number, session in enumerate(sessions):
            request_id = f"d-{number}"
            await raw_host.publish(
                _publish_frame(session, request_id, operation_key(), f"{number}.txt"),
                headers=raw_host.headers(session, request_id),
                correlation_id=request_id,
            )
            assert isinstance(
                await asyncio.wait_for(answer(raw_host, session, request_id), WAIT),
                OperationResult,
            )
        scope = daemon._scopes[names.scope]
        for session in sessions:
            held = scope.sessions[session.session_id]
            await _until(lambda held=held: len(held._commits.confirmed) == 1, "the confirm")
        assert len(await daemon.store.load_outbox(names.scope)) == 12
        before = daemon.store.stats.rows_opened
        for session in sessions[:4]:
            # (Waited for in memory: polling the store would read rows too.)
            await raw_host.publish(
                session.auth.seal(CloseSession(session.session_id)),
                headers=raw_host.headers(session, "close"),
            )
            await _until(lambda s=session: s.session_id in scope.closed, "the session let go")
        # Each close deleted its own row in its commit and looked up its own
        # rows only: none left, none of the other sessions' rows read.
        assert daemon.store.stats.rows_opened == before
        remaining = await daemon.store.load_outbox(names.scope)
        assert sorted(e.session_id for e in remaining) == sorted(s.session_id for s in sessions[4:])
    finally:
        await runner.stop_all()


async def test_an_outbox_release_meeting_a_newer_fence_gives_the_scope_up(
    raw_host: RawHost, worker_env: WorkerEnv, workers: WorkerRunner
) -> None:
    old = WorkerDaemon(worker_env.config)
    old_task = asyncio.create_task(old.run())
    try:
        await asyncio.wait_for(old.wait_ready(), WAIT)
        session = await opened(raw_host, old)
        await raw_host.publish(
            _publish_frame(session, "d-1", operation_key(), "a.txt"),
            headers=raw_host.headers(session, "d-1"),
            correlation_id="d-1",
        )
        assert isinstance(
            await asyncio.wait_for(answer(raw_host, session, "d-1"), WAIT), OperationResult
        )
        scope = old._scopes[raw_host.scope]
        held = scope.sessions[session.session_id]
        await _until(lambda: len(held._commits.confirmed) == 1, "the reply's confirm")
        # A second worker on the same journal reserves a newer fence; the old
        # one then releases its confirmed row (as after a reconnect's republish).
        await workers.start()
        await old._scopes_lifecycle().release_outbox(scope, [held])
        # The commit met the newer fence: the old worker gives the scope up and,
        # with no other scope, stops by itself.
        assert scope.superseded
        await asyncio.wait_for(old_task, WAIT)
    finally:
        if not old_task.done():
            old.request_stop()
            await asyncio.wait_for(old_task, 15.0)


async def test_a_closed_session_whose_last_reply_is_unsent_is_kept_for_the_republish(
    broker: AbstractConnection, names: Names, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapter = _SlowFiles(worker_env, delay=0.8)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    runner = WorkerRunner(worker_env)
    daemon = await runner.start(adapters=adapters)
    admin = await broker.channel()
    try:
        session = await opened(raw_host, daemon)
        await raw_host.publish(
            _publish_frame(session, "d-lost", operation_key(), "lost.txt"),
            headers=raw_host.headers(session, "d-lost"),
            correlation_id="d-lost",
        )
        await _until(lambda: adapter.dispatches == 1, "the effect to start")
        # The host closes the session and its reply queue vanishes: the
        # dispatch's reply, committed after the close, cannot be published.
        await _close(raw_host, daemon, names.scope, session)
        await admin.queue_delete(raw_host.reply_queue)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while not await daemon.store.load_outbox(names.scope):
            assert loop.time() < deadline, "the reply never reached the outbox"
            await asyncio.sleep(0.05)
        scope = daemon._scopes[names.scope]
        await _until(lambda: not scope.handling, "its handlers to finish")
        # Its reply is still to be sent: the session is kept, so the next
        # reconnect (not only the next start) republishes it.
        assert session.session_id in scope.sessions
        assert session.session_id not in scope.closed
        (entry,) = await daemon.store.load_outbox(names.scope)
        assert entry.session_id == session.session_id
    finally:
        await runner.stop_all()
        await admin.close()
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_a_frame_of_a_closed_session_not_in_memory_is_looked_up_and_refused(
    names: Names, raw_host: RawHost, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    runner = WorkerRunner(worker_env)
    first = await runner.start()
    try:
        session = await _opened_and_closed(raw_host, first, names.scope)
    finally:
        await runner.stop_all()
    second = await runner.start()
    try:
        scope = second._scopes[names.scope]
        assert session.session_id not in scope.closed  # nothing of it read at start
        await raw_host.publish(
            _publish_frame(session, "d-late", operation_key(), "late.txt"),
            headers=raw_host.headers(session, "late"),
            correlation_id="d-late",
        )
        assert reason_of(await dead_letters.wait_for(marker_of("late"))) == "session_closed"
        assert session.session_id in scope.closed
        assert raw_host.replies.matching(lambda m: m.correlation_id == "d-late") == []
    finally:
        await runner.stop_all()
    assert read_effect_log(worker_env.effect_log) == []
