"""A pooled session's first frames never race its open: shared journal, real broker.

The host's session pool opens a session and sends its first frames right
behind the open. With a shared PostgreSQL journal, a worker once handled
such frames before the open was committed and dead-lettered them
``unknown_session`` (at the start of a load, a few frames in some rounds;
each operation then waited the whole reply timeout). Here many pooled
sessions open during a load of concurrent requests (the pool rotates every
8 requests, 32 in flight), over several rounds against a real daemon on a
real PostgreSQL schema and the real broker: every request succeeds, no
frame is dead-lettered, no session is refused.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog.testing

from octo_common.payload import ToolPayload
from octo_common.states import StateKind
from octo_host.client import HostClient
from octo_worker.config import load_config
from tests.postgres import PostgresSchema

from .conftest import Names, WorkerEnv, WorkerRunner, write_worker_env
from .test_client_pools import NOOP, PUBLISH, STEPS, write_host

pytestmark = [pytest.mark.rabbitmq, pytest.mark.postgres]

ROUNDS = 4
RUNS = 4  # per round: RUNS * STEPS requests


@pytest.fixture
async def shared_worker(tmp_path: Path, names: Names, postgres_schema: PostgresSchema) -> WorkerEnv:
    env = write_worker_env(tmp_path, names.scope, tools=(NOOP, PUBLISH))
    text = env.config_path.read_text(encoding="utf-8")
    text = text.replace(
        'journal = "journal.sqlite3"',
        f'url = "{postgres_schema.url}"\npassword_file = "{postgres_schema.password_file}"\n'
        f'schema = "{postgres_schema.schema}"',
    )
    env.config_path.write_text(text, encoding="utf-8")
    env.config = load_config(env.config_path)
    assert env.config.shared_journal
    return env


async def test_the_first_frames_of_new_pooled_sessions_never_race_their_open(
    tmp_path: Path, names: Names, shared_worker: WorkerEnv
) -> None:
    runner = WorkerRunner(shared_worker)
    await runner.start()
    config = write_host(tmp_path, names.host(), shared_worker, max_calls=100_000)
    in_flight = asyncio.Semaphore(32)
    try:
        with structlog.testing.capture_logs() as logs:
            for round_number in range(ROUNDS):
                async with HostClient.from_config(config, session_rotate_after=8) as client:
                    loaded = [
                        await client.load_run(f"batch-{round_number}-{r}", "batch")
                        for r in range(RUNS)
                    ]

                    async def one(run_number: int, step: int) -> StateKind:
                        async with in_flight:
                            state = await client.execute(
                                loaded[run_number],  # noqa: B023
                                f"s{step}",
                                NOOP,
                                ToolPayload.json({"n": step}),
                                b"once",
                            )
                            return state.kind

                    states = await asyncio.gather(
                        *(one(r, s) for r in range(RUNS) for s in range(STEPS))
                    )
                    opened = client.pool_stats.opened
                assert states == [StateKind.SUCCEEDED] * (RUNS * STEPS), round_number
                assert opened >= RUNS * STEPS // 8 - 1
        events = [entry["event"] for entry in logs]
        dead = [entry for entry in logs if entry["event"] == "frame_dead_lettered"]
        assert dead == []
        assert "request_rejected" not in events
        assert "session_replaced" not in events
    finally:
        await runner.stop_all()
