"""A served scope deleted whole, or put back whole, never runs an adapter twice (no anchor).

Someone with the database and without the key edits one scope while the
worker is stopped, the store's other scopes left as they are: every row and
the head row of the scope deleted, or its rows and head put back to the
sealed copies taken before its last dispatch. Each scope head still
committed to its own rows, so ``octo-worker journal verify`` (a real
process) passed, the daemon started, and the key asked again ran its
adapter a second time. The store head commits to every scope head: verify
reports ``rollback_detected`` and the start is refused before any frame is
handled. Real broker, real daemon, a real SQLite file (no anchor) or
PostgreSQL schema.
"""

from __future__ import annotations

import pytest

from octo_common.errors import RollbackDetected
from octo_common.messages import OperationResult

from .conftest import RawHost, RawSession, WorkerEnv, WorkerRunner
from .journal_backends import BACKENDS, JournalDatabase
from .test_daemon_live_tamper import configure_journal
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key
from .test_daemon_rollback import CountingFiles, registry
from .test_journal_verify_agrees import journal_verify
from .test_worker_store_head import copy_of, put_back

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(params=BACKENDS)
async def served_journal(request: pytest.FixtureRequest, worker_env: WorkerEnv) -> JournalDatabase:
    """The daemon's journal: its SQLite file without an anchor, or a PostgreSQL schema."""
    return await configure_journal(request, worker_env, anchor=False)


async def dispatched(raw_host: RawHost, session: RawSession, request_id: str, key: str) -> None:
    await raw_host.publish(
        dispatch_frame(session, request_id, key),
        headers=raw_host.headers(session, request_id),
        correlation_id=request_id,
    )
    assert isinstance(await answer(raw_host, session, request_id), OperationResult)


async def refused(
    workers: WorkerRunner,
    raw_host: RawHost,
    env: WorkerEnv,
    session: RawSession,
    adapter: CountingFiles,
    key: str,
) -> None:
    """Verify fails, and the key asked again never reaches the adapter: the start is
    refused before the waiting frame is handled."""
    status, report = journal_verify(env)
    assert status == 1, report
    assert "rollback_detected" in str(report["first_failure"]), report
    before = adapter.dispatches
    await raw_host.publish(
        dispatch_frame(session, "again", key),
        headers=raw_host.headers(session, "again"),
        correlation_id="again",
    )
    with pytest.raises(RollbackDetected):
        await workers.start(adapters=registry(adapter))
    assert adapter.dispatches == before
    assert [m for m in raw_host.replies.items if m.correlation_id == "again"] == []


async def test_a_served_scope_deleted_whole_is_refused(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
) -> None:
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    key = operation_key()
    await dispatched(raw_host, session, "d-1", key)
    await workers.stop(daemon)
    assert adapter.dispatches == 1

    await served_journal.sql("DELETE FROM items WHERE name = ?", raw_host.scope)
    await served_journal.sql("DELETE FROM heads WHERE name = ?", raw_host.scope)
    await refused(workers, raw_host, worker_env, session, adapter, key)


async def test_a_served_scope_put_back_whole_is_refused(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
) -> None:
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    await dispatched(raw_host, session, "d-1", operation_key())
    copy = await copy_of(served_journal, raw_host.scope)
    key = operation_key()
    await dispatched(raw_host, session, "d-2", key)
    await workers.stop(daemon)
    assert adapter.dispatches == 2

    await put_back(served_journal, raw_host.scope, copy)
    await refused(workers, raw_host, worker_env, session, adapter, key)
