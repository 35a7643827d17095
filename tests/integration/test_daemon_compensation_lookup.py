"""A compensation cut short on the real broker, found again by its lookup.

The compensation counterparts of the reconciliation scenarios of
``test_daemon_rabbitmq.py``: a hand-made host seals frames and publishes
them raw to the in-process daemon, which serves the real ``files.publish``
adapter (slowed or made to lose its answer by a subclass, a real plug-in).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.messages import (
    CompensateOperation,
    CompensationReconcileRequest,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationResult,
    ReconcileCompensation,
    ReconciledCompensation,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.states import Failed, Succeeded
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import GRANT, TOOL, WAIT, RawHost, RawSession, WorkerEnv, WorkerRunner
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key

pytestmark = pytest.mark.rabbitmq

UNDO = ToolPayload.json({"undo": "publish", "name": "notes.txt"})


def binding(raw_host: RawHost, key: str) -> OperationCompensationBinding:
    return OperationCompensationBinding(
        TOOL, key, "cmp-" + key, raw_host.scope, GRANT.compensation_fingerprint()
    )


def compensate_frame(raw_host: RawHost, session: RawSession, request_id: str, key: str) -> bytes:
    request = OperationCompensationRequest(
        session.session_id, request_id, binding(raw_host, key), UNDO
    )
    return session.auth.seal(CompensateOperation(request))


def lookup_frame(raw_host: RawHost, session: RawSession, request_id: str, key: str) -> bytes:
    bound = binding(raw_host, key)
    request = CompensationReconcileRequest(
        session.session_id,
        request_id,
        TOOL,
        key,
        bound.compensation_key,
        bound.tenant_scope,
        bound.grant_fingerprint,
    )
    return session.auth.seal(ReconcileCompensation(request))


async def ask(raw_host: RawHost, session: RawSession, request_id: str, frame: bytes) -> Any:
    await raw_host.publish(
        frame, headers=raw_host.headers(session, request_id), correlation_id=request_id
    )
    return await answer(raw_host, session, request_id)


async def published(raw_host: RawHost, session: RawSession, key: str) -> None:
    done = await ask(raw_host, session, "d-1", dispatch_frame(session, "d-1", key))
    assert isinstance(done, OperationResult) and isinstance(done.result.status, Succeeded)


class _SlowUndo(FilesPublishAdapter):
    def __init__(self, env: WorkerEnv, delay: float) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.delay = delay
        self.compensations = 0

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.compensations += 1
        await asyncio.sleep(self.delay)
        return await super().compensate_operation(request, grant, context)


async def test_worker_stopped_during_a_compensation_leaves_it_pending_for_its_lookup(
    raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    # A short grace: the stop cancels the handler while the inverse still sleeps.
    config = msgspec.structs.replace(
        worker_env.config,
        worker=msgspec.structs.replace(worker_env.config.worker, shutdown_grace_seconds=0.2),
    )
    adapter = _SlowUndo(worker_env, delay=3.0)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    runner = WorkerRunner(worker_env)
    first = WorkerDaemon(config, adapters=adapters)
    task = asyncio.create_task(first.run())
    key = operation_key()
    try:
        await asyncio.wait_for(first.wait_ready(), WAIT)
        session = await opened(raw_host, first)
        await published(raw_host, session, key)
        frame = compensate_frame(raw_host, session, "c-1", key)
        await raw_host.publish(
            frame, headers=raw_host.headers(session, "c-1"), correlation_id="c-1"
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while adapter.compensations == 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert adapter.compensations == 1
    finally:
        first.request_stop()
        await asyncio.wait_for(task, 15.0)
    assert [e["effect"] for e in read_effect_log(worker_env.effect_log)] == ["publish"]

    second = await runner.start()
    try:
        records = {r.operation_key: r for r, _ in await second.store.list_records(raw_host.scope)}
        compensation = records[key].compensation
        assert compensation is not None and compensation.state.kind.value == "pending"
        # The same frame again: still pending at the worker, never run again.
        await raw_host.publish(
            frame, headers=raw_host.headers(session, "c-1-again"), correlation_id="c-1"
        )
        refused = await answer(raw_host, session, "c-1")
        assert isinstance(refused, RequestRejected), refused
        assert refused.code == "pending_compensation"
        # The lookup settles it from the adapter's own record: the inverse never ran.
        found = await ask(raw_host, session, "l-1", lookup_frame(raw_host, session, "l-1", key))
        assert isinstance(found, ReconciledCompensation)
        assert found.result.status == Failed("not removed")
        assert found.result.compensation_key == "cmp-" + key
        assert adapter.compensations == 1
        assert (worker_env.shelf / "notes.txt").exists()
        assert [e["effect"] for e in read_effect_log(worker_env.effect_log)] == ["publish"]
        records = {r.operation_key: r for r, _ in await second.store.list_records(raw_host.scope)}
        compensation = records[key].compensation
        assert compensation is not None and compensation.state == Failed("not removed")
    finally:
        await runner.stop_all()


class _LostUndoAnswer(FilesPublishAdapter):
    """Removes the file, then cannot tell whether it did (indeterminate)."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        await super().compensate_operation(request, grant, context)
        raise AdapterIndeterminate("lost the answer")


async def test_a_compensation_left_pending_counts_in_the_oldest_pending_gauge_until_found(
    workers: WorkerRunner, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, _LostUndoAnswer(worker_env))
    daemon = await workers.start(adapters=adapters)
    session = await opened(raw_host, daemon)
    key = operation_key()
    await published(raw_host, session, key)
    refused = await ask(raw_host, session, "c-1", compensate_frame(raw_host, session, "c-1", key))
    assert isinstance(refused, RequestRejected) and refused.code == "indeterminate_compensation"

    def age() -> float:
        sample = daemon.metrics.registry.get_sample_value(
            "octo_oldest_unresolved_pending_seconds", {"scope": raw_host.scope}
        )
        assert sample is not None
        return sample

    first = age()
    assert first > 0
    await asyncio.sleep(0.2)
    assert age() >= first + 0.2
    found = await ask(raw_host, session, "l-1", lookup_frame(raw_host, session, "l-1", key))
    assert isinstance(found, ReconciledCompensation)
    assert found.result.status == Succeeded(
        ToolPayload.json({"name": "notes.txt", "removed": True})
    )
    assert age() == 0.0
    assert [e["effect"] for e in read_effect_log(worker_env.effect_log)] == ["publish", "remove"]
    assert not (worker_env.shelf / "notes.txt").exists()
