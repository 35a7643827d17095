"""What the alert rules watch, from its real sources (deploy/prometheus-alerts.yml).

* The broker queue gauges (``octo_queue_messages``, ``octo_queue_consumers``)
  come from passive declares against the real broker: a running daemon
  reports its own consumer on its scope queue and the depth of
  ``octo.v5.dead``; a queue nobody consumes reports 0 consumers and its
  depth; a missing queue reports no depth and 0 consumers.
* ``octo_oldest_unresolved_pending_seconds`` counts a key a crash (here: an
  indeterminate adapter, then a restart) left pending in the journal from
  the restart on, before any request names it, until a reconciliation finds
  it terminal; and a compensation left pending likewise, until its lookup
  finds it terminal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection

from octo_common.messages import (
    CompensateOperation,
    CompensationReconcileRequest,
    DispatchOperation,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.runtime.broker import publish_envelope
from octo_common.states import Failed, Running
from octo_common.transport import DEAD_QUEUE, build_host_publish, reply_queue, worker_queue
from octo_worker.adapters.contract import AdapterIndeterminate, WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter
from octo_worker.config import MetricsConfig
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.daemon.queue_watch import refresh_queue_gauges
from octo_worker.daemon.topology import declare_topology

from .conftest import GRANT, TOOL, WAIT, RawHost, RawSession, WorkerEnv, unique, wait_session

pytestmark = pytest.mark.rabbitmq


class Daemons:
    """In-process daemons whose queue gauges refresh every 0.2 s."""

    def __init__(self, env: WorkerEnv) -> None:
        self.config = msgspec.structs.replace(
            env.config, metrics=MetricsConfig(queue_refresh_seconds=0.2)
        )
        self.running: dict[WorkerDaemon, asyncio.Task[None]] = {}

    async def start(self, adapters: WorkerAdapterRegistry | None = None) -> WorkerDaemon:
        daemon = WorkerDaemon(self.config, adapters=adapters)
        task = asyncio.create_task(daemon.run())
        self.running[daemon] = task
        await asyncio.wait_for(daemon.wait_ready(), timeout=15.0)
        return daemon

    async def stop(self, daemon: WorkerDaemon) -> None:
        task = self.running.pop(daemon)
        daemon.request_stop()
        await asyncio.wait_for(task, timeout=15.0)


@pytest.fixture
async def daemons(worker_env: WorkerEnv) -> AsyncIterator[Daemons]:
    started = Daemons(worker_env)
    yield started
    for daemon in list(started.running):
        await started.stop(daemon)


async def until(condition: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not condition():
        if loop.time() > deadline:
            raise AssertionError("condition never held")
        await asyncio.sleep(0.05)


def gauge(metrics: WorkerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def ready_count(channel: AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


async def test_a_running_daemon_reports_its_consumer_and_the_dead_letter_depth(
    daemons: Daemons, worker_env: WorkerEnv, channel: AbstractChannel
) -> None:
    daemon = await daemons.start()
    queue = worker_queue(worker_env.scope)
    await until(lambda: (gauge(daemon.metrics, "octo_queue_consumers", queue=queue) or 0) >= 1)
    refreshed = gauge(daemon.metrics, "octo_queue_refresh_timestamp_seconds")
    assert refreshed is not None and refreshed > 0
    # The dead-letter depth is the broker's own count. Other tests share the
    # queue and may change it at any moment (pytest-xdist workers, other
    # checkouts), so the count is read afresh for each comparison.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while gauge(daemon.metrics, "octo_queue_messages", queue=DEAD_QUEUE) != await ready_count(
        channel, DEAD_QUEUE
    ):
        if loop.time() > deadline:
            raise AssertionError("the dead-letter depth gauge never matched the broker's count")
        await asyncio.sleep(0.05)
    assert gauge(daemon.metrics, "octo_queue_messages", queue=queue) == 0


async def test_a_queue_nobody_consumes_and_a_missing_queue(
    broker: AbstractConnection, channel: AbstractChannel
) -> None:
    idle, missing = unique("t-idle"), unique("t-missing")
    await declare_topology(channel, [idle], delivery_limit=None)
    try:
        for n in range(3):
            envelope = build_host_publish(
                idle,
                "s",
                bytes(range(32)),
                f'{{"n":{n}}}'.encode(),
                reply_to=reply_queue("h"),
                correlation_id=None,
            )
            await publish_envelope(channel, envelope, timeout=5.0)
        metrics = WorkerMetrics()
        await refresh_queue_gauges(broker, [idle, missing], metrics)
        assert gauge(metrics, "octo_queue_consumers", queue=worker_queue(idle)) == 0
        assert gauge(metrics, "octo_queue_messages", queue=worker_queue(idle)) == 3
        assert gauge(metrics, "octo_queue_consumers", queue=worker_queue(missing)) == 0
        assert gauge(metrics, "octo_queue_messages", queue=worker_queue(missing)) is None
        assert gauge(metrics, "octo_queue_messages", queue=DEAD_QUEUE) is not None
    finally:
        await channel.queue_delete(worker_queue(idle))


class _Indeterminate(FilesPublishAdapter):
    """Cannot tell whether its effect ran: the key stays pending in the journal."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AdapterIndeterminate("lost the answer")


class _Lookup(FilesPublishAdapter):
    """Answers reconciliations from a script: still running, then failed."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.answers: list[Any] = [Running(), Failed("never published")]

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return self.answers.pop(0)


async def answer(raw_host: RawHost, session: RawSession, request_id: str) -> Any:
    reply = await raw_host.replies.wait_for(lambda m: m.correlation_id == request_id)
    return session.auth.open(reply.body)


async def test_a_key_a_restart_left_pending_counts_from_the_restart_until_a_lookup_settles_it(
    daemons: Daemons, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    first = WorkerAdapterRegistry()
    first.register(TOOL, _Indeterminate(worker_env))
    daemon = await daemons.start(first)
    session = raw_host.session()
    await raw_host.open(session, marker=unique("open"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    key = "op-stuck-" + unique("k")
    payload = ToolPayload.json({"name": "stuck.txt", "content": "x"})

    def dispatch(request_id: str) -> bytes:
        request = OperationDispatchRequest(session.session_id, request_id, TOOL, key, payload)
        return session.auth.seal(DispatchOperation(request))

    await raw_host.publish(
        dispatch("d-1"), headers=raw_host.headers(session, "d-1"), correlation_id="d-1"
    )
    refused = await answer(raw_host, session, "d-1")
    assert isinstance(refused, RequestRejected) and refused.code == "indeterminate_operation"
    await daemons.stop(daemon)

    # A new daemon (a restart): the pending row is in the journal, not in its memory.
    lookup = _Lookup(worker_env)
    second = WorkerAdapterRegistry()
    second.register(TOOL, lookup)
    restarted = await daemons.start(second)

    def age() -> float | None:
        return gauge(
            restarted.metrics, "octo_oldest_unresolved_pending_seconds", scope=raw_host.scope
        )

    # Counted at once: the restart found the row pending in the journal.
    assert (age() or 0) > 0
    # A request for the key: the journal answers that it is still pending.
    await raw_host.publish(
        dispatch("d-2"), headers=raw_host.headers(session, "d-2"), correlation_id="d-2"
    )
    pending = await answer(raw_host, session, "d-2")
    assert isinstance(pending, RequestRejected) and pending.code == "pending_operation"
    await until(lambda: (age() or 0) > 0)

    async def reconcile(request_id: str) -> Any:
        request = OperationReconcileRequest(session.session_id, request_id, TOOL, key)
        frame = session.auth.seal(ReconcileOperation(request))
        await raw_host.publish(
            frame, headers=raw_host.headers(session, request_id), correlation_id=request_id
        )
        return await answer(raw_host, session, request_id)

    still = await reconcile("r-1")
    assert isinstance(still, ReconciledOperation) and isinstance(still.result.status, Running)
    assert (age() or 0) > 0
    done = await reconcile("r-2")
    assert isinstance(done, ReconciledOperation) and isinstance(done.result.status, Failed)
    assert age() == 0.0
    assert lookup.answers == []


class _UndoIndeterminate(FilesPublishAdapter):
    """Publishes; its inverse's outcome is lost (indeterminate)."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AdapterIndeterminate("lost the answer")


class _UndoLookup(FilesPublishAdapter):
    """Answers compensation lookups from a script: still running, then failed."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.answers: list[Any] = [Running(), Failed("never removed")]

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        return self.answers.pop(0)


async def test_a_compensation_a_restart_left_pending_counts_until_its_lookup_settles_it(
    daemons: Daemons, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    # The counterpart of the scenario above for a compensation and its lookup.
    first = WorkerAdapterRegistry()
    first.register(TOOL, _UndoIndeterminate(worker_env))
    daemon = await daemons.start(first)
    session = raw_host.session()
    await raw_host.open(session, marker=unique("open"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    key = "op-undo-" + unique("k")
    payload = ToolPayload.json({"name": "undo.txt", "content": "x"})
    binding = OperationCompensationBinding(
        TOOL, key, "cmp-" + key, raw_host.scope, GRANT.compensation_fingerprint()
    )
    inverse = ToolPayload.json({"undo": "publish", "name": "undo.txt"})

    async def ask(request_id: str, message: Any) -> Any:
        frame = session.auth.seal(message)
        await raw_host.publish(
            frame, headers=raw_host.headers(session, request_id), correlation_id=request_id
        )
        return await answer(raw_host, session, request_id)

    def compensate(request_id: str) -> Any:
        request = OperationCompensationRequest(session.session_id, request_id, binding, inverse)
        return CompensateOperation(request)

    dispatch = OperationDispatchRequest(session.session_id, "d-1", TOOL, key, payload)
    assert not isinstance(await ask("d-1", DispatchOperation(dispatch)), RequestRejected)
    refused = await ask("c-1", compensate("c-1"))
    assert isinstance(refused, RequestRejected) and refused.code == "indeterminate_compensation"
    await daemons.stop(daemon)

    lookup = _UndoLookup(worker_env)
    second = WorkerAdapterRegistry()
    second.register(TOOL, lookup)
    restarted = await daemons.start(second)

    def age() -> float | None:
        return gauge(
            restarted.metrics, "octo_oldest_unresolved_pending_seconds", scope=raw_host.scope
        )

    # Counted at once: the restart found the row pending in the journal.
    assert (age() or 0) > 0
    pending = await ask("c-2", compensate("c-2"))
    assert isinstance(pending, RequestRejected) and pending.code == "pending_compensation"
    await until(lambda: (age() or 0) > 0)

    def look_up(request_id: str) -> Any:
        request = CompensationReconcileRequest(
            session.session_id,
            request_id,
            TOOL,
            key,
            binding.compensation_key,
            binding.tenant_scope,
            binding.grant_fingerprint,
        )
        return ReconcileCompensation(request)

    still = await ask("l-1", look_up("l-1"))
    assert isinstance(still, ReconciledCompensation) and isinstance(still.result.status, Running)
    assert (age() or 0) > 0
    done = await ask("l-2", look_up("l-2"))
    assert isinstance(done, ReconciledCompensation) and isinstance(done.result.status, Failed)
    assert age() == 0.0
    assert lookup.answers == []
