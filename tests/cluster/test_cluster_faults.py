"""A real three-node RabbitMQ cluster under faults, with a worker and a host under load.

Each test (``make test-cluster``; root and network namespaces required, see
``tests/cluster/netns.py``) runs:

* the worker as ``octo-worker run`` in its own network namespace, its
  configuration naming the cluster by one host name that resolves there to
  the three nodes' addresses (the worker takes one broker URL; a lost
  connection is opened again to the first address that answers);
* the host (``tests/cluster/_host_load.py``: one ``HostClient``, three
  lanes of ``files.publish`` operations one after another) in a namespace of
  its own, resolving the same name;
* a probe in this process: confirmed publishes of numbered messages to a
  quorum queue of its own, through the node the worker uses first, then
  through the next node after each loss.

While the load runs, one fault hits the node the worker is connected to:

* ``kill``: SIGKILL of that node's Erlang VM; once the worker serves again
  through another node, the killed node is started again and rejoins;
* ``partition``: nftables rules in that node's namespace drop every packet
  to and from the two other nodes; the cut-off node pauses
  (``pause_minority``) and closes its clients' connections; once the worker
  serves through another node the rules are deleted and the node resumes;
* ``cut``: nftables rules in the worker's namespace drop every packet to
  and from its node (the node itself stays in the cluster and serves the
  host): the worker notices by its heartbeat, and its next connection
  attempts meet a node that never answers before they reach another.

Then the host stops its lanes and the same client recovers every run. What
must hold, counted over every operation the host recorded:

* every operation is terminal (succeeded) in the host's ledger and in the
  worker's journal, and recovery left nothing unresolved;
* 0 double effects: the effect log holds exactly one publish line per key,
  and the published files are exactly the keys' files;
* 0 lost frames: every probe message the cluster confirmed is in the probe
  queue afterwards (the quorum queues keep every confirmed frame), the
  worker queue is empty (no request frame left behind), no frame was
  dead-lettered by the broker itself (``delivery_limit``: a frame handed
  back too often never got the worker's decision), and every quorum queue
  has its three members online again. Frames the worker refused (a session
  the host had closed meanwhile) are dead-lettered with their reason and
  counted.

Each test prints one ``run: Report(...)`` line with its figures (pytest ``-s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aio_pika
import pytest

from octo_common.states import StateKind
from octo_common.transport import DEAD_QUEUE, HEADER_REASON, reply_queue, worker_queue
from octo_worker.adapters.files import read_effect_log
from tests.faults.conftest import CrashEnv, Runner, read_journal, read_ledger
from tests.timing import scaled

from .netns import Cluster, Node

pytestmark = [pytest.mark.cluster]

HERE: Final = Path(__file__).resolve().parent
HOST_LOAD: Final = HERE / "_host_load.py"
OCTO_WORKER: Final = Path(sys.executable).parent / "octo-worker"
PROBE_QUEUE: Final = "octo-cluster-probe"
LANES: Final = 3
KEYS_PER_RUN: Final = 40  # a lane's runs follow one another until the test stops the load
PACE: Final = 0.25  # seconds a lane waits between two operations (about 10 a second)
BEFORE_FAULT: Final = 20  # effects logged before the fault
AFTER_FAILOVER: Final = 20  # effects logged through another node before the heal
AFTER_HEAL: Final = 20  # effects logged after the heal, before the lanes stop
# A wait's bound: how long a broken run takes to fail (a loaded machine, more).
WAIT: Final = min(scaled(60.0), 180.0)
# Why the broker itself dead-letters a frame (x-first-death-reason).
# ("rejected" is the worker's refusal whose confirmed copy failed: it decided.)
BROKER_DEAD_REASONS: Final = frozenset({"delivery_limit", "expired", "maxlen"})


@dataclass
class Probe:
    """Numbered confirmed publishes to :data:`PROBE_QUEUE`, moving to the next node on a loss."""

    urls: list[str]
    confirmed: set[int] = field(default_factory=set)
    unconfirmed: set[int] = field(default_factory=set)
    losses: int = 0
    sequence: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        index = 0
        while not stop.is_set():
            url = self.urls[index % len(self.urls)]
            connection = None
            try:
                connection = await aio_pika.connect(url, timeout=3.0)
                channel = await connection.channel(publisher_confirms=True)
                while not stop.is_set():
                    self.sequence += 1
                    number = self.sequence
                    self.unconfirmed.add(number)
                    await channel.default_exchange.publish(
                        aio_pika.Message(str(number).encode(), delivery_mode=2),
                        routing_key=PROBE_QUEUE,
                        timeout=10.0,
                    )
                    self.unconfirmed.discard(number)
                    self.confirmed.add(number)
                    await asyncio.sleep(0.05)
            except Exception:  # the node went away: the next one
                self.losses += 1
                index += 1
                await asyncio.sleep(0.2)
            finally:
                if connection is not None:
                    with contextlib.suppress(Exception):
                        await connection.close()


async def declare_probe(url: str) -> None:
    connection = await aio_pika.connect(url, timeout=5.0)
    try:
        channel = await connection.channel()
        await channel.declare_queue(PROBE_QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        await connection.close()


async def drain_probe(url: str) -> Counter[int]:
    """Every message in the probe queue (consumed and acked), by number."""
    found: Counter[int] = Counter()
    connection = await aio_pika.connect(url, timeout=5.0)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(PROBE_QUEUE, passive=True)
        while (message := await queue.get(no_ack=False, fail=False, timeout=10.0)) is not None:
            found[int(message.body)] += 1
            await message.ack()
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()
    return found


async def drain_dead_letters(url: str) -> Counter[str]:
    """Take every letter out of ``octo.v5.dead`` (so the next run starts empty), by why
    it is there: the worker's ``octo-reason`` (a frame it refused, e.g. one of a
    session the host had closed), or the broker's own reason for a frame it
    dead-lettered itself (``delivery_limit``: handed back too often), or
    ``rejected`` (a refusal whose copy failed: the worker rejected it)."""
    found: Counter[str] = Counter()
    connection = await aio_pika.connect(url, timeout=5.0)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(DEAD_QUEUE, passive=True)
        while (message := await queue.get(no_ack=False, fail=False, timeout=10.0)) is not None:
            headers = message.headers or {}
            reason = headers.get(HEADER_REASON) or headers.get("x-first-death-reason") or "none"
            found[reason.decode() if isinstance(reason, bytes) else str(reason)] += 1
            await message.ack()
    finally:
        await connection.close()
    return found


def worker_config(env: CrashEnv) -> None:
    """The crash runs' worker configuration with a short AMQP heartbeat."""
    text = env.config_path.read_text("utf-8")
    text = text.replace(
        "reconnect_max_seconds = 1.0\n", "reconnect_max_seconds = 1.0\nheartbeat_seconds = 5\n"
    )
    env.config_path.write_text(text, "utf-8")


def start_in(namespace: str, argv: list[str], err: Path, *, stdin: bool) -> Runner:
    with open(err, "wb") as err_file:
        process = subprocess.Popen(  # fixed argv, no shell
            ["ip", "netns", "exec", namespace, *argv],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err_file,
            env={k: v for k, v in os.environ.items() if k != "OCTO_FAULT"},
        )
    return Runner(process, argv[0], None, err)


def trace(text: str) -> None:
    """One progress line on stderr (shown with ``pytest -s``, as make test-cluster runs it)."""
    sys.stderr.write(f"cluster {time.strftime('%H:%M:%S')} {text}\n")


async def until(condition: Callable[[], Awaitable[bool]], what: str, wait: float = WAIT) -> float:
    """Poll ``condition`` until it holds; the seconds it took."""
    started = time.monotonic()
    trace(f"waiting: {what}")
    while not await condition():
        if time.monotonic() - started > wait:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.2)
    trace(f"done in {time.monotonic() - started:.1f} s: {what}")
    return time.monotonic() - started


def diagnose(cluster: Cluster, runners: list[Runner | None]) -> None:
    """On a failure: each answering node's view of the queues and connections, the
    processes' last log lines."""
    for node in cluster.nodes:
        for args in (
            ("cluster_status",),
            ("list_queues", "name", "leader", "members", "online", "consumers", "messages"),
            ("list_connections", "peer_host", "pid", "state"),
        ):
            out = node.ctl(*args, check=False, timeout=20)
            trace(f"{node.name} {args[0]}:\n{out}")
    for runner in runners:
        if runner is not None:
            trace(f"{runner.kind} log tail:\n{runner.stderr()}")


@dataclass
class Report:
    fault: str
    seconds: float = 0.0
    failover_seconds: float = 0.0
    heal_seconds: float = 0.0
    operations: int = 0
    figures: dict[str, Any] = field(default_factory=dict)


Fault = Callable[[Cluster, Node], Awaitable[None]]


async def _kill(cluster: Cluster, node: Node) -> None:
    await asyncio.to_thread(cluster.kill, node)


async def _kill_heal(cluster: Cluster, node: Node) -> None:
    await asyncio.to_thread(cluster.restart, node)


async def _partition(cluster: Cluster, node: Node) -> None:
    others = [n.address for n in cluster.nodes if n is not node]
    await asyncio.to_thread(cluster.partition, node.namespace, others)


# How long a paused node may take to resume by itself once the partition heals.
RESUME_WAIT: Final = 60.0


async def _partition_heal(cluster: Cluster, node: Node) -> None:
    """Delete the rules; the paused node resumes by itself, or (RabbitMQ 3.10 on
    Erlang 25 sometimes leaves it paused for good) it is restarted, as an
    operator would, and that is reported."""
    await asyncio.to_thread(cluster.heal)

    async def resumed() -> bool:
        return await asyncio.to_thread(cluster.running_nodes_or_none, node) is not None

    try:
        await until(resumed, f"{node.name} resumes by itself", RESUME_WAIT)
    except AssertionError:
        trace(f"{node.name} stayed paused after the heal: restarted")
        RESTARTED.add(node.name)
        await asyncio.to_thread(cluster.kill, node)
        await asyncio.to_thread(cluster.restart, node)


RESTARTED: Final[set[str]] = set()  # nodes the heal had to restart (reported per run)


async def _cut(cluster: Cluster, node: Node) -> None:
    await asyncio.to_thread(cluster.partition, cluster.worker_namespace, [node.address])


FAULTS: Final[dict[str, tuple[Fault, Fault]]] = {
    "kill": (_kill, _kill_heal),
    "partition": (_partition, _partition_heal),
    "cut": (_cut, _partition_heal),
}


async def run_under_fault(cluster: Cluster, root: Path, fault: str) -> Report:
    started = time.monotonic()
    report = Report(fault)
    strike, heal = FAULTS[fault]
    RESTARTED.clear()
    env = CrashEnv.create(root, url=cluster.url)
    worker_config(env)
    queue = worker_queue(env.scope)
    host_id = env.new_host_id()
    worker = start_in(
        cluster.worker_namespace,
        [str(OCTO_WORKER), "run", "--config", str(env.config_path)],
        root / "worker.err",
        stdin=False,
    )
    host: Runner | None = None
    lanes_up = False  # the host's lanes run (it answers SIGUSR1 with their state)
    stop_probe = asyncio.Event()
    probe_task: asyncio.Task[None] | None = None
    try:

        async def consuming() -> bool:
            assert worker.process.poll() is None, worker.stderr()
            listed = await asyncio.to_thread(
                cluster.nodes[0].ctl, "list_queues", "name", "consumers", check=False
            )
            return f"{queue}\t1" in listed

        await until(consuming, "the worker consumes its queue")
        first = await asyncio.to_thread(
            cluster.connected_node, cluster.worker_address, cluster.nodes
        )
        assert first is not None, "the worker's connection is on no node"
        probe = Probe([first.url, *(n.url for n in cluster.nodes if n is not first)])
        await declare_probe(first.url)
        probe_task = asyncio.ensure_future(probe.run(stop_probe))
        host = start_in(
            cluster.host_namespace,
            [sys.executable, str(HOST_LOAD)],
            root / "host.err",
            stdin=True,
        )
        host.send(
            json.dumps(
                {
                    "url": cluster.url,
                    "host_id": host_id,
                    "scope": env.scope,
                    "scope_key_file": str(env.scope_key_file),
                    "ledger": str(env.ledger_path),
                    "key": env.host_storage_key.hex(),
                    "lanes": LANES,
                    "keys_per_run": KEYS_PER_RUN,
                    "pace": PACE,
                    "tag": fault,
                    "reply_timeout": 3.0,
                    "publish_timeout": 10.0,
                    "max_attempts": 8,
                }
            )
        )
        await host.expect("started", timeout=WAIT)
        lanes_up = True

        def effects() -> int:
            return len(read_effect_log(env.effect_log))

        async def grown(since: int, by: int) -> bool:
            assert host is not None and host.process.poll() is None, host.stderr()
            return effects() >= since + by

        await until(lambda: grown(0, BEFORE_FAULT), "the load started")
        # Every queue of the run has a replica on each node before the fault.
        for name in (queue, reply_queue(host_id), DEAD_QUEUE, PROBE_QUEUE):
            members = await asyncio.to_thread(cluster.queue_members, name, first)
            assert members == (3, 3), (name, members)
        target = await asyncio.to_thread(
            cluster.connected_node, cluster.worker_address, cluster.nodes
        )
        assert target is not None
        survivors = [n for n in cluster.nodes if n is not target]
        struck = time.monotonic()
        at_fault = effects()
        trace(f"{fault} of {target.name} (the worker's node) after {at_fault} effects")
        await strike(cluster, target)

        async def moved() -> bool:
            now = await asyncio.to_thread(cluster.connected_node, cluster.worker_address, survivors)
            return now is not None and now is not target and effects() >= at_fault + AFTER_FAILOVER

        report.failover_seconds = await until(moved, "the worker serves through another node")
        healing = time.monotonic()
        trace(f"healing {target.name} after {effects()} effects")
        await heal(cluster, target)

        async def whole() -> bool:
            for node in cluster.nodes:
                running = await asyncio.to_thread(cluster.running_nodes_or_none, node)
                if running != {n.name for n in cluster.nodes}:
                    return False
            for name in (queue, reply_queue(host_id), DEAD_QUEUE, PROBE_QUEUE):
                if await asyncio.to_thread(cluster.queue_members, name, target) != (3, 3):
                    return False
            return True

        await until(whole, "the cluster is whole again, every queue with 3 members online")
        report.heal_seconds = time.monotonic() - healing
        report.figures["restarted_after_heal"] = target.name in RESTARTED
        at_heal = effects()
        await until(lambda: grown(at_heal, AFTER_HEAL), "the load goes on after the heal")
        host.send("stop")
        line = ""
        while not line.startswith("RESULT "):
            line = await host.read_line(WAIT)
            assert line, host.stderr()
        result = json.loads(line.removeprefix("RESULT "))
        assert await host.wait_exit(WAIT) == 0, host.stderr()
        stop_probe.set()
        await probe_task
        exited = await worker.stop(timeout=30.0)
        assert exited == 0, worker.stderr()
        report.figures["struck_after"] = struck - started
        await _check(cluster, env, result, probe, report, host_id)
    except BaseException:
        trace(f"effects logged: {len(read_effect_log(env.effect_log))}")
        if lanes_up and host is not None and host.process.poll() is None:
            host.process.send_signal(signal.SIGUSR1)  # the lanes' state, on its stderr
            await asyncio.sleep(1.0)
        await asyncio.to_thread(diagnose, cluster, [worker, host])
        raise
    finally:
        stop_probe.set()
        if probe_task is not None:
            probe_task.cancel()
        for runner in (host, worker):
            if runner is not None:
                runner.kill_now()
    report.seconds = time.monotonic() - started
    trace(f"run: {report}")
    return report


async def _worker_queue_settled(cluster: Cluster, via: Node, queue: str) -> dict[str, int]:
    """Every queue's messages once the worker's queue is empty, or as it stands after
    30 s: a frame the host sent last (a session's close) may still be unacked."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        messages = await asyncio.to_thread(cluster.queue_messages, via)
        if messages.get(queue) == 0 or loop.time() > deadline:
            return messages
        await asyncio.sleep(0.5)


async def _check(
    cluster: Cluster,
    env: CrashEnv,
    result: dict[str, Any],
    probe: Probe,
    report: Report,
    host_id: str,
) -> None:
    runs: dict[str, list[str]] = result["runs"]
    keys = [key for run_keys in runs.values() for key in run_keys]
    report.operations = len(keys)
    assert result["unresolved"] == {}, result["errors"]
    states: Counter[str] = Counter()
    for run_name, run_keys in runs.items():
        ledger = await read_ledger(env, run_name)
        assert sorted(op.operation_key for op in ledger.operations) == sorted(run_keys)
        states.update(op.state.value for op in ledger.operations)
    journal = await read_journal(env, keys)
    journal_states = Counter(
        "missing" if row is None else row.state.kind.value for row in journal.values()
    )
    publishes = Counter(e["operation_key"] for e in read_effect_log(env.effect_log))
    doubles = sum(1 for count in publishes.values() if count > 1)
    missing_effects = sum(1 for key in keys if publishes[key] == 0)
    strangers = set(publishes) - set(keys)
    whole = cluster.nodes[0]
    messages = await _worker_queue_settled(cluster, whole, worker_queue(env.scope))
    found = await drain_probe(whole.url)
    lost = probe.confirmed - set(found)
    dead = await drain_dead_letters(whole.url)
    report.figures.update(
        ledger=dict(states),
        journal=dict(journal_states),
        double_effects=doubles,
        missing_effects=missing_effects,
        probe_confirmed=len(probe.confirmed),
        probe_unconfirmed=len(probe.unconfirmed),
        probe_lost=len(lost),
        probe_duplicated=sum(1 for c in found.values() if c > 1),
        probe_losses=probe.losses,
        worker_queue=messages.get(worker_queue(env.scope)),
        dead_letters=dict(dead),
        host_raised=result["raised"],
        host_returned=result["returned"],
        host_reconnects=result["reconnects"],
        recover_seconds=round(result["recover_seconds"], 2),
    )
    assert states == Counter({StateKind.SUCCEEDED.value: len(keys)}), states
    assert journal_states == Counter({StateKind.SUCCEEDED.value: len(keys)}), journal_states
    assert doubles == 0 and missing_effects == 0 and not strangers, (doubles, missing_effects)
    published = sorted(p.name for p in env.published.iterdir() if not p.name.startswith("."))
    assert published == sorted(f"{run}-{i}.txt" for run, ks in runs.items() for i in range(len(ks)))
    assert not lost, sorted(lost)[:20]
    assert messages.get(worker_queue(env.scope)) == 0, messages
    # A frame the broker dead-lettered itself never reached the worker's decision:
    # lost to the protocol. One the worker refused carries its reason (the host
    # settles its operation by another frame: every operation succeeded above).
    assert not {r for r in dead if r in BROKER_DEAD_REASONS}, dead
    await asyncio.to_thread(whole.ctl, "delete_queue", reply_queue(host_id), check=False)
    await asyncio.to_thread(whole.ctl, "delete_queue", worker_queue(env.scope), check=False)


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_worker_node_fault_under_load(cluster: Cluster, tmp_path: Path, fault: str) -> None:
    report = await run_under_fault(cluster, tmp_path, fault)
    assert report.operations >= BEFORE_FAULT + AFTER_FAILOVER + AFTER_HEAL
