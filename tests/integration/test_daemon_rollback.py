"""A restart after the journal's rows were edited never runs an adapter twice.

The attacker writes the journal file while the worker is stopped (no key):
an operation's row deleted, or a compensated operation's row put back to
its older sealed version (before the compensation). Before scope heads
committed to their rows, the restarted daemon admitted the key again and ran
the adapter a second time, or accepted a second compensation under a new
``cmp-`` key. Now the start is refused (``rollback_detected``) and the frames
waiting for the worker are never handled: real broker, real daemon, real
SQLite file.
"""

from __future__ import annotations

import secrets
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import RollbackDetected
from octo_common.messages import (
    CompensateOperation,
    CompensationResult,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter
from octo_worker.storage.journal_items import JournalItems

from .conftest import GRANT, TOOL, RawHost, RawSession, WorkerEnv, WorkerRunner
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key

pytestmark = pytest.mark.rabbitmq


class CountingFiles(FilesPublishAdapter):
    """``files.publish``, counting the effects it is asked to perform."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.dispatches = 0
        self.compensations = 0

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.dispatches += 1
        return await super().dispatch_operation(request, grant, context)

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.compensations += 1
        return await super().compensate_operation(request, grant, context)


def registry(adapter: CountingFiles) -> WorkerAdapterRegistry:
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    return adapters


def compensate_frame(session: RawSession, request_id: str, scope: str, key: str) -> bytes:
    binding = OperationCompensationBinding(
        TOOL, key, "cmp-" + secrets.token_hex(16), scope, GRANT.compensation_fingerprint()
    )
    request = OperationCompensationRequest(
        session.session_id,
        request_id,
        binding,
        ToolPayload.json({"undo": "publish", "name": "notes.txt"}),
    )
    return session.auth.seal(CompensateOperation(request))


def sql(path: Path, statement: str, parameters: tuple[object, ...] = ()) -> list[Any]:
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        return connection.execute(statement, parameters).fetchall()
    finally:
        connection.close()


async def test_a_restart_after_a_row_was_deleted_never_runs_the_adapter_again(
    workers: WorkerRunner, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapter = CountingFiles(worker_env)
    first = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, first)
    key = operation_key()
    stored = JournalItems(worker_env.config.storage_keyring()).item(raw_host.scope, key)
    frame = dispatch_frame(session, "d-1", key)
    await raw_host.publish(frame, headers=raw_host.headers(session, "d-1"), correlation_id="d-1")
    done = await answer(raw_host, session, "d-1")
    assert isinstance(done, OperationResult) and isinstance(done.result.status, Succeeded)
    assert adapter.dispatches == 1
    await workers.stop(first)

    journal = worker_env.config.journal_path
    assert sql(journal, "DELETE FROM items WHERE item = ? RETURNING revision", (stored,))
    # The host asks again about the key, as after a lost reply.
    retry = dispatch_frame(session, "d-2", key)
    await raw_host.publish(retry, headers=raw_host.headers(session, "d-2"), correlation_id="d-2")
    with pytest.raises(RollbackDetected):
        await workers.start(adapters=registry(adapter))
    assert adapter.dispatches == 1
    assert [m for m in raw_host.replies.items if m.correlation_id == "d-2"] == []


async def test_a_restart_after_a_compensated_row_was_put_back_accepts_no_second_compensation(
    workers: WorkerRunner, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapter = CountingFiles(worker_env)
    first = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, first)
    key = operation_key()
    stored = JournalItems(worker_env.config.storage_keyring()).item(raw_host.scope, key)
    scope = raw_host.scope
    journal = worker_env.config.journal_path
    await raw_host.publish(
        dispatch_frame(session, "d-1", key),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)
    # What the attacker keeps: the row before any compensation.
    ((revision, envelope),) = sql(
        journal, "SELECT revision, envelope FROM items WHERE item = ?", (stored,)
    )
    await raw_host.publish(
        compensate_frame(session, "c-1", scope, key),
        headers=raw_host.headers(session, "c-1"),
        correlation_id="c-1",
    )
    undone = await answer(raw_host, session, "c-1")
    assert isinstance(undone, CompensationResult), undone
    assert isinstance(undone.result.status, Succeeded)
    assert adapter.compensations == 1
    await workers.stop(first)

    sql(
        journal,
        "UPDATE items SET revision = ?, envelope = ? WHERE item = ?",
        (revision, envelope, stored),
    )
    # A second compensation of the same operation, under a new compensation key.
    await raw_host.publish(
        compensate_frame(session, "c-2", scope, key),
        headers=raw_host.headers(session, "c-2"),
        correlation_id="c-2",
    )
    with pytest.raises(RollbackDetected):
        await workers.start(adapters=registry(adapter))
    assert (adapter.dispatches, adapter.compensations) == (1, 1)
    assert [m for m in raw_host.replies.items if m.correlation_id == "c-2"] == []
