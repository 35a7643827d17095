"""The client's own sessions: ``HostClient.from_config``, the pools, ``execute`` and ``undo``.

A real worker daemon serves this test's scope with ``octo.noop`` (and
``files.publish``) on the real broker; the host is built from a real
``host.toml`` by ``HostClient.from_config``, with a real SQLite ledger.
One test sends more than 1,024 requests on one scope through the
pooled client, 64 in flight: the pool rotates its sessions before the
worker's request-id bound, and the worker refuses nothing.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog.testing

from octo_common.errors import (
    AdapterIndeterminate,
    CompensationAlreadyRecorded,
    DuplicateOperationKey,
    OctoError,
)
from octo_common.limits import MAX_SESSION_REQUEST_IDS
from octo_common.payload import ToolPayload
from octo_common.states import StateKind
from octo_host.client import HostClient
from octo_host.client.shortcuts import OperationScopeUnbound
from octo_worker.adapters.contract import DurableOperationContract, WorkerAdapterRegistry
from octo_worker.adapters.files import read_effect_log
from octo_worker.adapters.functions import AdapterCall, FunctionAdapter
from octo_worker.testing import CountingAdapter

from .conftest import Names, WorkerEnv, WorkerRunner, write_host_toml, write_worker_env

pytestmark = pytest.mark.rabbitmq

NOOP = "octo.noop"
PUBLISH = "files.publish"
STEPS = 40  # operations per run (a run holds at most 64)


def write_host(root: Path, host_id: str, worker: WorkerEnv, *, max_calls: int) -> Path:
    """``host.toml`` for ``worker``'s scope: both tools granted, one plan of STEPS steps."""
    steps = ", ".join(f'{{ id = "s{n}", source = "step {n}" }}' for n in range(STEPS))
    return write_host_toml(
        root / "host",
        host_id,
        worker,
        f"""
[[grants]]
scope = "{worker.scope}"
tool = "{NOOP}"
format = "json"
max_calls = {max_calls}
max_compensations = 1

[[grants]]
scope = "{worker.scope}"
tool = "{PUBLISH}"
format = "json"
max_calls = 2
max_compensations = 1

[[actions]]
tool = "{PUBLISH}"
inverse = {{ undo = "publish" }}
match = ["name"]

[[plans]]
name = "batch"
steps = [{steps}]
""",
    )


@pytest.fixture
async def noop_worker(tmp_path: Path, names: Names) -> WorkerEnv:
    return write_worker_env(tmp_path, names.scope, tools=(NOOP, PUBLISH))


async def test_the_pool_rotates_sessions_across_more_than_1024_requests_without_refusal(
    tmp_path: Path, names: Names, noop_worker: WorkerEnv
) -> None:
    runner = WorkerRunner(noop_worker)
    daemon = await runner.start()
    config = write_host(tmp_path, names.host(), noop_worker, max_calls=100_000)
    runs, total = 28, 28 * STEPS
    assert total > MAX_SESSION_REQUEST_IDS
    in_flight = asyncio.Semaphore(64)
    try:
        with structlog.testing.capture_logs() as logs:
            # Rotated at 256 requests: several rotations, quickly.
            async with HostClient.from_config(config, session_rotate_after=256) as client:
                loaded = [await client.load_run(f"batch-{r}", "batch") for r in range(runs)]

                async def one(run_number: int, step: int) -> StateKind:
                    async with in_flight:
                        run = loaded[run_number]
                        state = await client.execute(
                            run, f"s{step}", NOOP, ToolPayload.json({"n": step}), b"once"
                        )
                        return state.kind

                states = await asyncio.gather(
                    *(one(r, s) for r in range(runs) for s in range(STEPS))
                )
                stats = client.pool_stats
        assert states == [StateKind.SUCCEEDED] * total
        # No refusal of any kind, so no session replaced by the verbs.
        events = [entry["event"] for entry in logs]
        assert "request_rejected" not in events
        assert "session_replaced" not in events
        assert stats.rotated >= total // 256 - 1, stats
        assert stats.opened >= stats.rotated, stats
        # The worker saw every pooled session, each under the bound, all closed.
        sessions = await daemon.store.load_sessions(noop_worker.scope)
        assert len(sessions) == stats.opened
        assert all(record.status == "closed" for record in sessions.values())
    finally:
        await runner.stop_all()


async def test_execute_and_undo_persist_what_the_long_form_does_and_run_once(
    tmp_path: Path, names: Names, noop_worker: WorkerEnv
) -> None:
    runner = WorkerRunner(noop_worker)
    await runner.start()
    config = write_host(tmp_path, names.host(), noop_worker, max_calls=4)
    payload = ToolPayload.json({"name": "notes.txt", "content": "1.2.3"})
    effects = noop_worker.state_dir / "effects.log"
    try:
        async with HostClient.from_config(config) as client:
            run = await client.load_run("release", "batch")
            first = await client.execute(run, "s0", PUBLISH, payload, b"n1")
            assert first.kind == StateKind.SUCCEEDED
            key = run.ledger.operations[0].operation_key
            # The same job again: the recorded key, reconciled, never a second effect.
            again = await client.execute(run, "s0", PUBLISH, payload, b"n1")
            assert again.kind == StateKind.SUCCEEDED
            assert len(read_effect_log(effects)) == 1
            # The long form would have raised DuplicateOperationKey here.
            with pytest.raises(DuplicateOperationKey):
                await client.record_operation(run, "s0", PUBLISH, payload, b"n1")
            # Run-and-key verbs: the key's bound scope picks the pool.
            looked = await client.reconcile(run, key, payload)
            assert looked.kind == StateKind.SUCCEEDED

            inverse = ToolPayload.json({"undo": "publish", "name": "notes.txt"})
            undone = await client.undo(run, key, inverse, b"u1", original=payload)
            assert undone.kind == StateKind.SUCCEEDED
            operation = run.operation(key)
            assert operation is not None and operation.compensation is not None
            assert operation.compensation.state == StateKind.SUCCEEDED
            assert not (noop_worker.state_dir / "published" / names.scope / "notes.txt").exists()
            # The one compensation is finished: a second undo is refused, nothing sent.
            published = client.published["compensate_operation"]
            with pytest.raises(CompensationAlreadyRecorded):
                await client.undo(run, key, inverse, b"u1", original=payload)
            assert client.published["compensate_operation"] == published
            lookup = await client.reconcile_compensation(run, key)
            assert lookup.kind == StateKind.SUCCEEDED
            # A key recorded without a scope has none to pick a pool by.
            unbound = await client.record_operation(run, "s1", NOOP, ToolPayload.json({}), b"n2")
            with pytest.raises(OperationScopeUnbound):
                await client.dispatch(run, unbound, ToolPayload.json({}))
        # The ledger as the long form leaves it, read back by a fresh client.
        async with HostClient.from_config(config) as reread:
            stored = await reread.load_run("release", "batch")
            assert stored.state(key) == StateKind.SUCCEEDED
            assert stored.state(unbound) == StateKind.PENDING
    finally:
        await runner.stop_all()


async def test_undo_refuses_an_inverse_the_configured_verifier_does_not_allow(
    tmp_path: Path, names: Names, noop_worker: WorkerEnv
) -> None:
    runner = WorkerRunner(noop_worker)
    await runner.start()
    config = write_host(tmp_path, names.host(), noop_worker, max_calls=4)
    payload = ToolPayload.json({"name": "a.txt", "content": "a"})
    try:
        async with HostClient.from_config(config) as client:
            run = await client.load_run("release", "batch")
            assert (await client.execute(run, "s0", PUBLISH, payload, b"n")).kind == (
                StateKind.SUCCEEDED
            )
            key = run.ledger.operations[0].operation_key
            wrong = ToolPayload.json({"undo": "publish", "name": "other.txt"})
            with pytest.raises(OctoError) as refused:
                await client.undo(run, key, wrong, b"u", original=payload)
            assert refused.value.code == "compensation_action_denied"
            assert client.published["compensate_operation"] == 0
            operation = run.operation(key)
            assert operation is not None and operation.compensation is None
    finally:
        await runner.stop_all()


async def test_the_pool_rotates_before_a_grant_runs_out_of_calls(
    tmp_path: Path, names: Names, noop_worker: WorkerEnv
) -> None:
    runner = WorkerRunner(noop_worker)
    await runner.start()
    config = write_host(tmp_path, names.host(), noop_worker, max_calls=3)
    try:
        with structlog.testing.capture_logs() as logs:
            async with HostClient.from_config(config) as client:
                run = await client.load_run("small", "batch")
                states = [
                    (await client.execute(run, f"s{n}", NOOP, ToolPayload.json({}), b"n")).kind
                    for n in range(10)
                ]
                stats = client.pool_stats
        assert states == [StateKind.SUCCEEDED] * 10
        # Three dispatches a session (max_calls = 3): four sessions, never a refusal.
        assert stats.opened == 4 and stats.rotated == 3, stats
        events = [entry["event"] for entry in logs]
        assert "request_rejected" not in events
        assert "session_replaced" not in events
    finally:
        await runner.stop_all()


async def test_execute_returns_an_ambiguous_outcome_unresolved_and_never_dispatches_again(
    tmp_path: Path, names: Names, noop_worker: WorkerEnv
) -> None:
    adapter = FunctionAdapter(
        "test.flaky", contract=DurableOperationContract.RECONCILIATION, input=dict
    )

    @adapter.dispatch
    async def cut(value: dict[str, object], call: AdapterCall[None]) -> None:
        raise AdapterIndeterminate("the provider did not answer")

    @adapter.lookup
    async def not_seen(call: AdapterCall[None]) -> None:
        return None  # proves nothing: the key stays unresolved

    counting = CountingAdapter(adapter())
    registry = WorkerAdapterRegistry()
    registry.register("test.flaky", counting)
    runner = WorkerRunner(noop_worker)
    await runner.start(adapters=registry)
    config = write_host_toml(
        tmp_path / "host",
        names.host(),
        noop_worker,
        f"""
[[grants]]
scope = "{noop_worker.scope}"
tool = "test.flaky"
format = "json"
max_calls = 4

[[plans]]
name = "one"
steps = [{{ id = "go", source = "go" }}]
""",
        broker="max_attempts = 3\nbackoff_initial_seconds = 0.05",
    )
    unresolved = (StateKind.PENDING, StateKind.RUNNING)
    try:
        async with HostClient.from_config(config) as client:
            run = await client.load_run("flaky", "one")
            state = await client.execute(run, "go", "test.flaky", ToolPayload.json({}), b"n")
            assert state.kind in unresolved
            # Run again, as a retried job would: reconciled, never dispatched again.
            again = await client.execute(run, "go", "test.flaky", ToolPayload.json({}), b"n")
            assert again.kind in unresolved
            assert run.state(run.ledger.operations[0].operation_key) in unresolved
        assert counting.calls["dispatch_operation"] == 1
        assert counting.calls["reconcile_operation"] >= 2
    finally:
        await runner.stop_all()
