"""``octo-host`` on a PostgreSQL ledger: a record deleted with its digest set to NULL.

The SQLite ledger's store head refused this already; the PostgreSQL ledger
had none: a run's record deleted (its row and its head row) beside a
``store_head`` digest set to NULL, as if the migration had left it to be
built, was taken as it was, and the run's step was dispatched again. Now
the open refuses it (``rollback_detected``, status 4) and the adapter runs
once. Real ``octo-host`` processes, real broker and daemon, real PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from octo_worker.adapters.files import read_effect_log
from tests.postgres import PostgresSchema

from .conftest import Names, WorkerEnv
from .test_host_cli import RUN, HostCli, assert_one_line_error

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


@pytest.fixture
async def host(tmp_path: Path, names: Names, worker_env: WorkerEnv) -> HostCli:
    cli = HostCli(tmp_path / "host", names, worker_env)
    await cli.provision()
    return cli


async def test_a_head_digest_set_to_null_hides_no_deleted_record_on_postgresql(
    daemon: object, host: HostCli, worker_env: WorkerEnv, postgres_schema: PostgresSchema
) -> None:
    cli = host
    cli.write_config(
        extra=f'\n[storage]\nurl = "{postgres_schema.url}"\n'
        f'password_file = "{postgres_schema.password_file}"\n'
        f'schema = "{postgres_schema.schema}"\n'
    )
    dispatched = await cli.dispatch()
    assert dispatched.status == 0, dispatched.stderr
    connection = await postgres_schema.connect()
    try:
        for table in ("items", "heads"):
            deleted = await connection.fetch(
                f"DELETE FROM {table} WHERE namespace = 'workflow-ledger' AND name = $1 "
                "RETURNING name",
                RUN,
            )
            assert deleted
        await connection.execute("UPDATE store_head SET digest = NULL WHERE id = 1")
    finally:
        await connection.close()
    again = await cli.dispatch()
    assert again.status == 4, again.stderr
    assert_one_line_error(again, "rollback_detected")
    assert len(read_effect_log(worker_env.effect_log)) == 1
