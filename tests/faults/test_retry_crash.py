"""A step's retry survives a host SIGKILL between recording it and sending it.

Real processes, the real broker and SQLite files, as in the crash matrix:

1. the worker runner is armed with ``worker.after_ack@1``: the first
   publication is admitted and acked, and the worker dies before its effect;
2. the host runner (``_host_main.py`` in ``execute`` mode, the steps' retry
   policy on) is armed with ``host.after_retry_intent@1``: once the restarted
   worker's lookup proves the first attempt did not happen (``failed``,
   ``not_happened``: ``files.publish`` fenced the key), it records the next
   attempt under its derived key and dies before sending it;
3. a new ``HostClient`` recovers the run: the recorded attempt (``pending``,
   chained to the first) is sent under that same key, after the worker
   proves it never admitted it, and succeeds.

The chain in the ledger is exactly: the first key ``failed``/``not_happened``,
then its retry ``succeeded`` (``retry_of`` the first, attempt 2); the effect
log holds one publication, by the retry's key; the journal agrees key by key.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

import pytest

from octo_common.states import FailureCode, StateKind
from octo_worker.adapters.files import read_effect_log

from .conftest import (
    HOST_MAIN,
    RUN_NAME,
    STEPS,
    CrashEnv,
    Launcher,
    delete_queues,
    host_arguments,
    host_client,
    manifest,
    publish_payload,
    read_journal,
    read_ledger,
    start_worker,
)

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

DEATH_TIMEOUT = 60.0


async def test_a_retry_recorded_then_cut_by_a_host_crash_is_sent_by_recover(
    launcher: Launcher, tmp_path: Path
) -> None:
    assert HOST_MAIN.exists()
    env = CrashEnv.create(tmp_path)
    tag = uuid.uuid4().hex[:8]
    steps = STEPS[:1]
    worker = await start_worker(launcher, env, "worker.after_ack@1")
    restarted = None
    try:
        await worker.expect("ready")
        host = await launcher.take("host", "host.after_retry_intent@1")
        host.send(
            host_arguments(
                env,
                tag,
                steps,
                execute=True,
                reply_timeout=2.0,
                # However long the worker takes to come back on a busy machine.
                max_attempts=30,
            )
        )
        # The worker dies after acking the first dispatch, before its effect.
        assert await worker.wait_exit(DEATH_TIMEOUT) == -signal.SIGKILL, worker.stderr()
        assert "SIGKILL at worker.after_ack" in worker.stderr()
        restarted = await start_worker(launcher, env, None)
        await restarted.expect("ready")
        # The host's lookup proves it did not happen; it records the retry and dies.
        assert await host.wait_exit(DEATH_TIMEOUT) == -signal.SIGKILL, host.stderr()
        assert "SIGKILL at host.after_retry_intent" in host.stderr()

        cut = await read_ledger(env)
        [first, retry] = cut.operations
        assert (first.state, first.failure) == (StateKind.FAILED, FailureCode.NOT_HAPPENED)
        assert (retry.state, retry.retry_of, retry.attempt) == (
            StateKind.PENDING,
            first.operation_key,
            2,
        )
        assert read_effect_log(env.effect_log) == []

        client = host_client(env, env.new_host_id())
        await client.start()
        try:
            plan = client.engine.plan(steps)
            summary = await asyncio.wait_for(
                client.recover(
                    RUN_NAME,
                    plan,
                    env.scope,
                    manifest(),
                    inputs={first.operation_key: publish_payload(0, tag)},
                ),
                60.0,
            )
        finally:
            await client.close()
            await client.store.close()
        assert summary.unresolved == [], summary.errors
        assert summary.retried == [retry.operation_key]
    finally:
        for runner in (worker, restarted):
            if runner is not None:
                await runner.stop()

    ledger = await read_ledger(env)
    chain = ledger.attempts(first.operation_key)
    assert [op.operation_key for op in chain] == [first.operation_key, retry.operation_key]
    assert [op.state for op in chain] == [StateKind.FAILED, StateKind.SUCCEEDED]
    assert chain[0].failure == FailureCode.NOT_HAPPENED
    assert len(ledger.operations) == 2  # no third attempt, no second retry of the first
    effects = read_effect_log(env.effect_log)
    assert [(e["effect"], e["operation_key"]) for e in effects] == [
        ("publish", retry.operation_key)
    ]
    assert (env.published / "file-0.txt").exists()
    journal = await read_journal(env, [first.operation_key, retry.operation_key])
    assert {key: row.state.kind for key, row in journal.items() if row is not None} == {
        first.operation_key: StateKind.FAILED,
        retry.operation_key: StateKind.SUCCEEDED,
    }
    await delete_queues(env)
