"""Worker failover on a shared PostgreSQL journal, with real processes.

Two worker daemons (``_worker_main.py``) serve one scope from one PostgreSQL
journal and publish with ``files.publish`` into one shared directory; the
first one consumes (the broker's single active consumer), the other stands
by. A host in this process dispatches 64 operations at once, then:

* SIGKILL of the owner mid-load (64 operations in flight in two runs, the
  steps' retry policy on): the standby becomes the active consumer,
  reserves the next fence, restores the session, answers; ``recover``
  settles the ambiguous ones and replaces each attempt proven not to have
  happened by a new one: every operation ends succeeded, with exactly one
  effect line each;
* SIGSTOP of the owner mid-load: after the heartbeat the broker hands the
  queue to the standby, which finishes the run; the host is closed, then
  SIGCONT wakes the old owner: its late commits are refused with
  ``fencing_token_rejected`` (it gives the scope up and stops), it sends no
  reply, and a second recovery leaves exactly one effect per succeeded key.

Each test has its own scope, queues, host ledger and PostgreSQL schema.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections import Counter
from pathlib import Path

import pytest

from octo_common.states import StateKind
from octo_common.transport import reply_queue
from octo_host.plan import RetryPolicy
from tests.postgres import PostgresSchema
from tests.timing import scaled

from .conftest import Launcher, Runner, queue_depth
from .failover import (
    FailoverEnv,
    check_effects,
    dispatch_all,
    read_ledger,
    record_run,
    recover,
    steps,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

OPERATIONS = 64
RETRY_RUNS = ("failover-run-a", "failover-run-b")
PER_RUN = OPERATIONS // len(RETRY_RUNS)
RETRY = RetryPolicy(attempts=4, backoff_seconds=0.05)
# Effect lines the owner writes before it is disturbed: mid-load.
BEFORE_FAULT = 8


async def start_worker(launcher: Launcher, env: FailoverEnv, index: int) -> Runner:
    runner = await launcher.take("worker", None)
    runner.send(str(env.configs[index]))
    await runner.expect("ready")
    return runner


async def start_pair(
    launcher: Launcher, root: Path, place: PostgresSchema
) -> tuple[FailoverEnv, str, Runner, Runner]:
    """The scope's files, a tag for this run's contents, the owner (consuming
    first: the single active consumer) and its standby."""
    env = FailoverEnv.create(root, place)
    owner = await start_worker(launcher, env, 0)
    standby = await start_worker(launcher, env, 1)
    return env, uuid.uuid4().hex[:8], owner, standby


async def test_sigkill_of_the_owner_mid_load_hands_the_scope_to_the_standby(
    launcher: Launcher, tmp_path: Path, postgres_schema: PostgresSchema
) -> None:
    # 64 in flight as two runs of 32 (a run's ledger holds 64 operations, retries
    # included), the steps' retry policy on: every operation the kill cut before
    # its effect is proven not to have happened and replaced by a new attempt.
    env, tag, owner, standby = await start_pair(launcher, tmp_path, postgres_schema)
    client = env.client()
    runs = []
    try:
        await client.start()
        for index, name in enumerate(RETRY_RUNS):
            first = index * PER_RUN
            plan, run, keys = await record_run(
                client, PER_RUN, tag, name=name, first=first, retry=RETRY
            )
            runs.append((name, first, plan, run, keys))
        flow = asyncio.gather(
            *(
                dispatch_all(client, env, run, keys, tag, first=first)
                for _, first, _, run, keys in runs
            )
        )
        await wait_for(
            lambda: env.effects() >= BEFORE_FAULT, scaled(30.0), "the owner's first effects"
        )
        owner.kill_now()
        assert owner.process.returncode == -signal.SIGKILL
        await asyncio.wait_for(flow, scaled(120.0))
        for name, first, plan, _, keys in runs:
            summary = await asyncio.wait_for(
                recover(client, env, plan, keys, tag, name=name, first=first), scaled(120.0)
            )
            assert summary.unresolved == [], summary.errors
    finally:
        await client.close()
        await client.store.close()
        await standby.stop()
    states: Counter[StateKind] = Counter()
    retried = 0
    for name, first, _, _, keys in runs:
        states += await check_effects(env, keys, name=name, first=first)
        retried += len((await read_ledger(env, name)).operations) - len(keys)
    print(f"SIGKILL failover: {dict(states)}, {retried} retries, {env.effects()} effect lines")
    # Exactly once: every operation succeeded, one effect each.
    assert states == Counter({StateKind.SUCCEEDED: OPERATIONS})
    assert env.effects() == OPERATIONS
    # The owner reserved fence 1 at its first delivery, the standby fence 2.
    assert await env.fence() == 2
    assert "scope_activated" in standby.stderr()
    await env.delete_queues()


async def test_sigstop_of_the_owner_then_sigcont_publishes_nothing_and_commits_nothing(
    launcher: Launcher, tmp_path: Path, postgres_schema: PostgresSchema
) -> None:
    env, tag, owner, standby = await start_pair(launcher, tmp_path, postgres_schema)
    client = env.client()
    paused = False
    try:
        await client.start()
        plan, run, keys = await record_run(client, OPERATIONS, tag)
        flow = asyncio.ensure_future(dispatch_all(client, env, run, keys, tag))
        await wait_for(
            lambda: env.effects() >= BEFORE_FAULT, scaled(30.0), "the owner's first effects"
        )
        os.kill(owner.pid, signal.SIGSTOP)
        paused = True
        # The broker drops the silent owner after its heartbeat (2 s); the
        # standby takes the queue and the host's retries and lookups finish.
        await asyncio.wait_for(flow, scaled(60.0))
        first = await asyncio.wait_for(recover(client, env, plan, keys, tag), scaled(60.0))
        # Only a publication the paused owner was inside of can stay open (its lock).
        assert len(first.unresolved) <= 1, first.errors
        await client.close()
        await client.store.close()
        await asyncio.sleep(1.0)  # late duplicates of the standby's answers land first
        answers = reply_queue(env.host_ids[0])
        replies_before = await queue_depth(answers)
        os.kill(owner.pid, signal.SIGCONT)
        paused = False
        # Woken up, its handlers' commits meet the standby's fence: it gives the
        # scope up and stops, having published nothing.
        assert await owner.wait_exit(20.0) == 0, owner.stderr()
        assert "scope_superseded" in owner.stderr()
        assert await queue_depth(answers) == replies_before
        client = env.client()
        await client.start()
        plan = client.engine.plan(steps(OPERATIONS))
        second = await asyncio.wait_for(recover(client, env, plan, keys, tag), scaled(60.0))
        assert second.unresolved == [], second.errors
    finally:
        if paused:
            os.kill(owner.pid, signal.SIGCONT)
        await client.close()
        await client.store.close()
        await standby.stop()
        await owner.stop()
    states = await check_effects(env, keys)
    print(f"SIGSTOP failover: {dict(states)}, {env.effects()} effect lines")
    assert sum(states.values()) == OPERATIONS
    assert await env.fence() == 2
    await env.delete_queues()
