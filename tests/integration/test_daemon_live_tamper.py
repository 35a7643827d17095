"""The journal edited beside a running daemon never runs an adapter twice.

The scope is checked whole against its sealed head when it loads; these
edits come after, while the daemon serves it: an operation's row deleted
(the host asks about the key again), or a compensated operation's row put
back to its sealed copy from before the compensation (a second compensation
under a new ``cmp-`` key). Before the loaded scope's live index, the first
was admitted as new and dispatched a second time, the second accepted a
second compensation. Now each is refused (``rollback_detected``) before the
adapter runs: real broker, real daemon, a real SQLite file (with a rollback
anchor) or PostgreSQL schema.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from octo_common.errors import RollbackDetected
from octo_common.messages import CompensationResult, OperationResult, RequestRejected
from octo_common.states import Succeeded
from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.storage.configured import configured_store
from octo_worker.storage.journal_items import JournalItems
from octo_worker.store import SqliteJournalStore
from tests.postgres import PostgresSchema

from .conftest import RawHost, WorkerEnv, WorkerRunner
from .journal_backends import BACKENDS, JournalDatabase
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key
from .test_daemon_rollback import CountingFiles, compensate_frame, registry

pytestmark = pytest.mark.rabbitmq

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


@pytest.fixture(params=BACKENDS)
async def served_journal(request: pytest.FixtureRequest, worker_env: WorkerEnv) -> JournalDatabase:
    """The daemon's journal: its SQLite file with an anchor, or a PostgreSQL schema."""
    return await configure_journal(request, worker_env, anchor=True)


async def configure_journal(
    request: pytest.FixtureRequest, worker_env: WorkerEnv, *, anchor: bool
) -> JournalDatabase:
    """``worker_env``'s journal on the backend ``request.param`` names: SQLite (with
    a rollback anchor, initialised, or without) or a PostgreSQL schema of its own."""
    text = worker_env.config_path.read_text(encoding="utf-8")
    if request.param == "sqlite":
        if anchor:
            text = text.replace(
                'journal = "journal.sqlite3"',
                'journal = "journal.sqlite3"\nanchor = "journal.anchor"',
            )
        database = JournalDatabase("sqlite", worker_env.state_dir / "journal.sqlite3", None)
    else:
        place: PostgresSchema = request.getfixturevalue("postgres_schema")
        text = text.replace(
            'journal = "journal.sqlite3"',
            f'url = "{place.url}"\npassword_file = "{place.password_file}"\n'
            f'schema = "{place.schema}"',
        )
        database = JournalDatabase("postgres", worker_env.root / "unused", place)
    worker_env.config_path.write_text(text, encoding="utf-8")
    worker_env.config = load_config(worker_env.config_path)
    if anchor and not database.postgres:
        worker_env.state_dir.mkdir(parents=True, exist_ok=True)
        store = configured_store(worker_env.config)
        assert isinstance(store, SqliteJournalStore)
        try:
            await store.initialize_anchor()
        finally:
            await store.close()
    return database


async def stopped_tampered(workers: WorkerRunner, daemon: WorkerDaemon) -> None:
    """The daemon stops by itself once it met the edit, its run ending with the
    storage error (so ``octo-worker run`` exits 4)."""
    task = workers._running.pop(daemon)
    with pytest.raises(RollbackDetected):
        await asyncio.wait_for(task, timeout=30.0)


async def test_a_row_deleted_beside_the_daemon_is_refused_before_the_adapter(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
) -> None:
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    key = operation_key()
    stored = JournalItems(worker_env.config.storage_keyring()).item(raw_host.scope, key)
    await raw_host.publish(
        dispatch_frame(session, "d-1", key),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    done = await answer(raw_host, session, "d-1")
    assert isinstance(done, OperationResult) and isinstance(done.result.status, Succeeded)
    assert adapter.dispatches == 1

    assert await served_journal.sql("DELETE FROM items WHERE item = ? RETURNING revision", stored)
    # The host asks again about the key, as after a lost reply.
    await raw_host.publish(
        dispatch_frame(session, "d-2", key),
        headers=raw_host.headers(session, "d-2"),
        correlation_id="d-2",
    )
    refused = await answer(raw_host, session, "d-2")
    assert isinstance(refused, RequestRejected), refused
    assert refused.code == "rollback_detected"
    assert adapter.dispatches == 1
    await stopped_tampered(workers, daemon)


async def test_a_row_put_back_beside_the_daemon_accepts_no_second_compensation(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
) -> None:
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    key = operation_key()
    stored = JournalItems(worker_env.config.storage_keyring()).item(raw_host.scope, key)
    scope = raw_host.scope
    await raw_host.publish(
        dispatch_frame(session, "d-1", key),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)
    # What the attacker keeps: the row before any compensation.
    ((revision, envelope),) = await served_journal.sql(
        "SELECT revision, envelope FROM items WHERE item = ?", stored
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

    await served_journal.sql(
        "UPDATE items SET revision = ?, envelope = ? WHERE item = ?", revision, envelope, stored
    )
    # A second compensation of the same operation, under a new compensation
    # key, in a new session (whose budget allows one).
    again = await opened(raw_host, daemon)
    await raw_host.publish(
        compensate_frame(again, "c-2", scope, key),
        headers=raw_host.headers(again, "c-2"),
        correlation_id="c-2",
    )
    refused = await answer(raw_host, again, "c-2")
    assert isinstance(refused, RequestRejected), refused
    assert refused.code == "rollback_detected"
    assert (adapter.dispatches, adapter.compensations) == (1, 1)
    await stopped_tampered(workers, daemon)
