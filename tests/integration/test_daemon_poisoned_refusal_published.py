"""A poisoned session's refusal that cannot be committed is still published, best-effort.

The journal (PostgreSQL, reached through a TCP relay in this process) is cut
while the daemon serves: the next admission's commit fails and poisons the
session, and so does the commit of its refusal. The refusal is then sealed
and published without a commit, so the host hears ``journal_persistence_failed``
at once (before, nothing was published: the delivery went back to the broker
and the host waited for its reply timeout); the adapter never runs for that
request. Real broker, real daemon, real PostgreSQL.
"""

from __future__ import annotations

import asyncio

import pytest

from octo_common.messages import OperationResult, RequestRejected
from octo_worker.config import load_config
from tests.faults.test_storage_lost import Relay
from tests.postgres import PostgresSchema

from .conftest import RawHost, WorkerEnv, WorkerRunner
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key
from .test_daemon_rollback import CountingFiles, registry

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]


async def test_the_refusal_of_a_commit_that_failed_twice_is_published(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    postgres_schema: PostgresSchema,
) -> None:
    relay = Relay(("127.0.0.1", 5432))
    url = postgres_schema.url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{relay.port}/")
    text = worker_env.config_path.read_text(encoding="utf-8").replace(
        'journal = "journal.sqlite3"',
        f'url = "{url}"\npassword_file = "{postgres_schema.password_file}"\n'
        f'schema = "{postgres_schema.schema}"',
    )
    worker_env.config_path.write_text(text, encoding="utf-8")
    worker_env.config = load_config(worker_env.config_path)
    adapter = CountingFiles(worker_env)
    try:
        daemon = await workers.start(adapters=registry(adapter))
        session = await opened(raw_host, daemon)
        await raw_host.publish(
            dispatch_frame(session, "d-1", operation_key()),
            headers=raw_host.headers(session, "d-1"),
            correlation_id="d-1",
        )
        assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)

        await relay.cut_now()
        await raw_host.publish(
            dispatch_frame(session, "d-2", operation_key()),
            headers=raw_host.headers(session, "d-2"),
            correlation_id="d-2",
        )
        refused = await asyncio.wait_for(answer(raw_host, session, "d-2"), 30.0)
        assert isinstance(refused, RequestRejected), refused
        assert refused.code == "journal_persistence_failed"
        assert adapter.dispatches == 1
    finally:
        relay.close()
