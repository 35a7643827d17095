"""The shared (PostgreSQL) journal's rollback anchor: a file every worker of it writes.

The store head catches one scope deleted or put back whole; the whole schema
put back to an earlier copy (every scope head and the store head together)
matches itself. A PostgreSQL journal used to refuse an anchor. Now
``[storage] anchor`` beside ``url`` names a file on storage every worker
mounts: each commit's worker raises it to the store head revision it
committed (never lowering it, whichever worker writes last), and every check
reads it before its snapshot. Real PostgreSQL schema, real files; two store
objects stand for two machines; the daemon test runs the real daemon and
``octo-worker journal init-anchor`` / ``journal verify`` processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import RollbackAnchorMissing, RollbackDetected
from octo_common.records import StorageRecordKey
from octo_common.runtime.anchorfile import read_anchor
from octo_worker.config import load_config
from octo_worker.storage.postgres import PostgresJournalStore
from tests.postgres import PostgresSchema

from .conftest import RawHost, WorkerEnv, WorkerRunner
from .journal_backends import POSTGRES
from .test_daemon_live_tamper import configure_journal
from .test_daemon_rabbitmq import opened, operation_key
from .test_daemon_rollback import CountingFiles, registry
from .test_daemon_scope_rollback import dispatched, refused
from .test_worker_store import OTHER_SCOPE, SCOPE, pending, rows, storage_keyring, succeeded

TABLES = ("heads", "items", "store_head")
COLUMNS = {
    "heads": "namespace, name, revision, fence, row_count, digest, key_id, auth_tag",
    "items": "namespace, name, item, revision, envelope, written_at, closed, session",
    "store_head": "id, revision, row_count, digest, key_id, auth_tag",
}
REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


def machine(place: PostgresSchema, anchor: Path | None) -> PostgresJournalStore:
    """One worker's store on the shared schema (``anchor``: the shared file, or none)."""
    return PostgresJournalStore(
        place.url,
        storage_keyring(),
        password_file=place.password_file,
        schema=place.schema,
        anchor_path=anchor,
    )


async def whole_copy(place: PostgresSchema) -> dict[str, list[Any]]:
    """Every row of every table of the schema: a backup of the whole journal."""
    connection = await place.connect()
    try:
        return {
            table: [
                tuple(r) for r in await connection.fetch(f"SELECT {COLUMNS[table]} FROM {table}")
            ]
            for table in TABLES
        }
    finally:
        await connection.close()


async def restore(place: PostgresSchema, copy: dict[str, list[Any]]) -> None:
    connection = await place.connect()
    try:
        for table in TABLES:
            await connection.execute(f"DELETE FROM {table}")
            columns = COLUMNS[table]
            marks = ", ".join(f"${i + 1}" for i in range(len(columns.split(", "))))
            for row in copy[table]:
                await connection.execute(f"INSERT INTO {table} ({columns}) VALUES ({marks})", *row)
    finally:
        await connection.close()


@pytest.mark.postgres
async def test_two_workers_raise_one_anchor_and_a_whole_restore_is_refused(
    postgres_schema: PostgresSchema, tmp_path: Path
) -> None:
    anchor = tmp_path / "shared" / "journal.anchor"
    anchor.parent.mkdir()
    first, second = machine(postgres_schema, anchor), machine(postgres_schema, anchor)
    try:
        with pytest.raises(RollbackAnchorMissing):
            await first.reserve_fence(SCOPE)  # configured, never initialised
        assert await first.initialize_anchor() >= 0
        lease = await first.reserve_fence(SCOPE)
        other = await second.reserve_fence(OTHER_SCOPE)
        await first.commit(SCOPE, lease, rows(SCOPE, (pending("op-1"), None)))
        await second.commit(OTHER_SCOPE, other, rows(OTHER_SCOPE, (pending("op-9"), None)))
        backup = await whole_copy(postgres_schema)
        await first.commit(SCOPE, lease, rows(SCOPE, (succeeded("op-1"), 1)))
        await second.commit(OTHER_SCOPE, other, rows(OTHER_SCOPE, (succeeded("op-9"), 1)))
    finally:
        await first.close()
        await second.close()
    revision = (await whole_copy(postgres_schema))["store_head"][0][1]
    anchored = read_anchor(anchor)[StorageRecordKey("worker-journal-store", postgres_schema.schema)]
    assert anchored == revision == 6  # 2 reservations + 4 commits, by two workers

    await restore(postgres_schema, backup)
    unanchored = machine(postgres_schema, None)
    try:
        assert await unanchored.verify_store() == 2  # the copy matches itself
    finally:
        await unanchored.close()
    anchored_store = machine(postgres_schema, anchor)
    try:
        with pytest.raises(RollbackDetected):
            await anchored_store.verify_store()
        with pytest.raises(RollbackDetected):
            await anchored_store.verify_scope(SCOPE)
    finally:
        await anchored_store.close()


@pytest.fixture(params=[POSTGRES])
async def anchored_journal(request: pytest.FixtureRequest, worker_env: WorkerEnv) -> Path:
    """The daemon's journal in a PostgreSQL schema with a shared anchor file, initialised
    by ``octo-worker journal init-anchor`` (a real process)."""
    await configure_journal(request, worker_env, anchor=False)
    anchor = worker_env.root / "shared" / "journal.anchor"
    anchor.parent.mkdir()
    text = worker_env.config_path.read_text(encoding="utf-8")
    text = text.replace('schema = "', f'anchor = "{anchor}"\nschema = "', 1)
    worker_env.config_path.write_text(text, encoding="utf-8")
    worker_env.config = load_config(worker_env.config_path)
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "octo_worker",
            "journal",
            "init-anchor",
            "--config",
            str(worker_env.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert anchor.exists()
    return anchor


@pytest.mark.rabbitmq
async def test_a_shared_journal_restored_whole_is_refused_by_its_anchor(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    anchored_journal: Path,
    postgres_schema: PostgresSchema,
) -> None:
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    await dispatched(raw_host, session, "d-1", operation_key())
    backup = await whole_copy(postgres_schema)
    key = operation_key()
    await dispatched(raw_host, session, "d-2", key)
    await workers.stop(daemon)
    assert adapter.dispatches == 2

    await restore(postgres_schema, backup)
    await refused(workers, raw_host, worker_env, session, adapter, key)
