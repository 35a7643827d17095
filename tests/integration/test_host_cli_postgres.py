"""``octo-host`` with its ledger in PostgreSQL (``[storage] url``), as a user runs it.

Two host configurations (two host ids, as two machines) share one ledger
schema and the ledger key; the worker is the in-process daemon of
``conftest.py`` on the real broker. The ledger lives only in PostgreSQL:
no SQLite file is created.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from octo_worker.adapters.files import read_effect_log
from tests.postgres import PostgresSchema

from .conftest import Names, WorkerEnv
from .test_host_cli import RUN, HostCli, Result

pytestmark = pytest.mark.rabbitmq


def storage_section(place: PostgresSchema) -> str:
    return (
        f'\n[storage]\nurl = "{place.url}"\n'
        f'password_file = "{place.password_file}"\nschema = "{place.schema}"\n'
    )


@pytest.fixture
async def hosts(
    tmp_path: Path, names: Names, worker_env: WorkerEnv, postgres_schema: PostgresSchema
) -> tuple[HostCli, HostCli]:
    """Host A (provisioned) and host B (another host id, the same keys and ledger)."""
    first = HostCli(tmp_path / "host-a", names, worker_env)
    await first.provision()
    first.write_config(extra=storage_section(postgres_schema))
    second = HostCli(tmp_path / "host-b", names, worker_env)
    # Its own host id, so its own reply queue: two processes consuming one
    # reply queue would each be handed the other's replies.
    second.host_id = names.host("-b")
    shutil.copytree(first.keys, second.keys)
    second.write_config(extra=storage_section(postgres_schema))
    return first, second


def ok(result: Result) -> dict[str, object]:
    assert result.status == 0, result.stderr
    document: dict[str, object] = result.json()
    return document


async def test_two_hosts_dispatching_one_step_at_once_record_one_intent_in_postgresql(
    daemon: object,
    hosts: tuple[HostCli, HostCli],
    worker_env: WorkerEnv,
    postgres_schema: PostgresSchema,
) -> None:
    results = list(await asyncio.gather(*(host.dispatch() for host in hosts)))
    # Compare-and-swap decides: the host that lost a write takes its decision
    # again on the stored ledger and adopts the winner's intent (the same
    # derived key); neither stops with write_conflict.
    documents = [ok(result) for result in results]
    [key] = {document["operation_key"] for document in documents}
    assert sorted(document["newly_recorded"] is True for document in documents) == [False, True]
    assert all(document["ledger_state"] == "succeeded" for document in documents)
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]

    # Either host reads the one ledger: one operation, in PostgreSQL only.
    shown = ok(await hosts[1].run("ledger", "show", RUN, "--json"))
    operations = shown["operations"]
    assert isinstance(operations, list)
    assert [operation["operation_key"] for operation in operations] == [key]
    connection = await postgres_schema.connect()
    try:
        rows = await connection.fetch("SELECT namespace, name FROM items")
    finally:
        await connection.close()
    assert ("workflow-ledger", RUN) in [tuple(row) for row in rows]
    for host in hosts:
        assert not (host.root / "state" / "ledger.sqlite3").exists()
