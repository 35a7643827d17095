"""Broker disruption under load: every connection closed, the broker application restarted.

Real processes and a real broker, but never the shared one on 127.0.0.1:5672
(other tests run on it at the same time): this module starts a private
RabbitMQ node of its own (:class:`PrivateRabbit`: its own node name, ports,
Erlang cookie, database, logs and configuration under a temporary
directory), disrupts only that node with ``rabbitmqctl -n <node>``, and
stops it at the end.

Each test runs the worker runner (``tests/faults/_worker_main.py``, the real
daemon with ``files.publish``) as its own process and a :class:`HostClient`
here, dispatches a stream of publish operations over three lanes, and while
they run either closes every connection of the node (``rabbitmqctl
close_all_connections``) or stops and starts its application
(``stop_app`` / ``start_app``; the single-node quorum queues survive it). A
verb cut by the loss ends through reconciliation or raises; the load goes
on. Afterwards the same client, never restarted, recovers the run, and:

* every operation is ``succeeded`` in the ledger and the worker's journal,
  with exactly one publish line each in the effect log;
* the worker process that was disrupted is still the one serving (it saw the
  loss and reconnected by itself), and the client reconnected by itself
  (``HostClient.reconnects``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import pytest

from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.states import StateKind
from octo_common.transport import worker_queue
from octo_host.plan import WorkflowStep
from octo_worker.adapters.files import read_effect_log
from tests.private_rabbit import PrivateRabbit, running_node
from tests.timing import scaled

from .conftest import (
    TOOL,
    CrashEnv,
    Launcher,
    Runner,
    delete_queues,
    host_client,
    publish_payload,
    read_journal,
    read_ledger,
    start_worker,
)

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

LANES: Final = 3  # each lane dispatches the keys of its own run, one after another
KEYS_PER_LANE: Final = 40  # within a run's operation bound (MAX_WORKFLOW_OPERATIONS)
KEYS: Final = LANES * KEYS_PER_LANE
# Keys each lane holds back until the disruption command has returned: the
# load certainly goes on after the disruption, on the connections that came back.
RESERVE: Final = 4
DISRUPT_AFTER: Final = 8  # effects logged before the disruption is started
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=4 * KEYS)
STEPS: Final = [WorkflowStep(f"publish-{i}", f"publish file {i}") for i in range(KEYS_PER_LANE)]
WAIT: Final = scaled(30.0)


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRabbit]:
    with running_node(tmp_path_factory.mktemp("rabbit")) as node:
        yield node


@pytest.fixture(scope="module")
def runners(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    found = Launcher(tmp_path_factory.mktemp("disruption-runners"))
    found.prewarm("worker", None)
    yield found
    found.close()


async def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.05)


async def _disrupted_load(
    rabbit: PrivateRabbit, runners: Launcher, root: Path, disrupt: Callable[[], None]
) -> None:
    env = CrashEnv.create(root, url=rabbit.url)
    tag = secrets.token_hex(4)
    worker: Runner = await start_worker(runners, env, None)
    # A publish waits longer than the broker application's restart for the
    # connection to come back instead of failing.
    client = host_client(
        env, env.new_host_id(), reply_timeout=2.0, publish_timeout=15.0, max_attempts=8
    )
    try:
        await worker.expect("ready")
        await client.start()
        plan = client.engine.plan(STEPS)
        manifest = CapabilityManifest("manifest", [GRANT])
        runs = [await client.load_run(f"load-{lane}", plan) for lane in range(LANES)]
        # Key by global index (file-<index>.txt), each lane's keys in its own run.
        keys: list[str] = []
        for lane, run in enumerate(runs):
            for step in range(KEYS_PER_LANE):
                index = lane * KEYS_PER_LANE + step
                keys.append(
                    await client.record_operation(
                        run,
                        STEPS[step].id,
                        TOOL,
                        publish_payload(index, tag),
                        f"{tag}:{index}".encode(),
                    )
                )
        session = await client.open_session(env.scope, manifest)
        disrupted = asyncio.Event()
        raised: Counter[str] = Counter()

        async def lane(number: int) -> None:
            run = runs[number]
            todo = deque(range(number * KEYS_PER_LANE, (number + 1) * KEYS_PER_LANE))
            while todo:
                if len(todo) <= RESERVE and not disrupted.is_set():
                    await disrupted.wait()
                index = todo.popleft()
                try:
                    await client.dispatch(
                        session.current(), run, keys[index], publish_payload(index, tag)
                    )
                except Exception as exc:  # the loss may end a verb; recover settles it
                    raised[type(exc).__name__] += 1

        async def disruptor() -> None:
            try:
                await _until(
                    lambda: len(read_effect_log(env.effect_log)) >= DISRUPT_AFTER,
                    "the load started",
                )
                await asyncio.to_thread(disrupt)
            finally:
                disrupted.set()

        lanes = (lane(number) for number in range(LANES))
        await asyncio.wait_for(asyncio.gather(disruptor(), *lanes), scaled(60.0))
        await _until(lambda: client.reconnects >= 1, "the host client reconnected")
        # The worker process that lost its connection consumes its scope again.
        queue = worker_queue(env.scope)
        deadline = time.monotonic() + WAIT
        while await asyncio.to_thread(rabbit.consumers, queue) < 1:
            assert time.monotonic() < deadline, (
                f"the worker never consumed again: {worker.stderr()}"
            )
        assert worker.process.poll() is None, worker.stderr()
        log = worker.err_path.read_text("utf-8", "replace")
        assert "broker_connection_lost" in log, worker.stderr()

        # The same client and the same worker process, both reconnected by themselves.
        for number, run in enumerate(runs):
            indexes = range(number * KEYS_PER_LANE, (number + 1) * KEYS_PER_LANE)
            summary = await asyncio.wait_for(
                client.recover(
                    run.name,
                    plan,
                    env.scope,
                    manifest,
                    inputs={keys[i]: publish_payload(i, tag) for i in indexes},
                ),
                WAIT,
            )
            assert summary.unresolved == [], (summary.errors, dict(raised))
            await client.close_session(summary.session)
    finally:
        await client.close()
        await client.store.close()
        exited = await worker.stop()
    assert exited == 0, worker.stderr()
    for number in range(LANES):
        ledger = await read_ledger(env, f"load-{number}")
        assert [o.state for o in ledger.operations] == [StateKind.SUCCEEDED] * KEYS_PER_LANE
    journal = await read_journal(env, keys)
    assert all(
        row is not None and row.state.kind == StateKind.SUCCEEDED for row in journal.values()
    )
    publishes = Counter(e["operation_key"] for e in read_effect_log(env.effect_log))
    assert publishes == Counter(keys), publishes  # exactly one effect per operation
    assert sorted(p.name for p in env.published.iterdir()) == sorted(
        f"file-{i}.txt" for i in range(KEYS)
    )
    await delete_queues(env)


async def test_every_connection_closed_mid_load_ends_every_operation_once(
    rabbit: PrivateRabbit, runners: Launcher, tmp_path: Path
) -> None:
    def close_all() -> None:
        rabbit.ctl("close_all_connections", "closed by an octo fault test")

    await _disrupted_load(rabbit, runners, tmp_path, close_all)


async def test_broker_application_restarted_mid_load_ends_every_operation_once(
    rabbit: PrivateRabbit, runners: Launcher, tmp_path: Path
) -> None:
    def restart_app() -> None:
        rabbit.ctl("stop_app")  # returns once the application is down
        rabbit.ctl("start_app")  # returns once it serves again

    await _disrupted_load(rabbit, runners, tmp_path, restart_app)
