"""End-to-end durable dispatch round trips, host and worker in separate processes.

    .venv/bin/python bench/e2e.py [--total 2000] [--runs 5] [--in-flight 1 64]
                                  [--parts octo lanes pg lean quorum classic celery commit flat]
                                  [--loop uvloop|asyncio] [--anchor] [--profile DIR] [--json]

    smoke run (seconds, no figures): --runs 1 --total 200 --parts octo commit

One Octo operation, as measured here (latency window in brackets):

    [host: record the intent (ledger CAS, fsync)
     -> seal dispatch_operation -> confirmed publish
     -> worker: open frame -> authorize -> admission commit (journal, fsync) -> ack
        -> adapter ``octo.noop`` -> observation commit with the reply in the
        outbox (fsync) -> confirmed reply publish -> outbox mark
     -> host: open reply -> apply to the ledger -> ledger CAS (fsync)]

The worker is ``bench/_e2e_peer.py`` (the daemon exactly as ``octo-worker
run`` runs it) in its own process; the host is a ``HostClient`` in this
process. Every operation is its own workflow run (one ledger record per
run); the runs are created before the measured phase (a run's creation is
one more fsynced write, reported separately). Sessions are rotated every
``--ops-per-session`` operations (default 100); ``--sessions`` spreads the
lanes over that many concurrent sessions (default 1). After each Octo
measurement the host client closes its sessions and the benchmark waits
until the worker is idle again, so the next measurement does not share the
CPU with those closes (the wait is printed when it exceeds a second).

Parts (``--parts``, all by default; each is measured in every one of the
``--runs`` rounds, interleaved, at every ``--in-flight``):

* ``octo``: Octo, ``--sessions`` sessions shared by the lanes;
* ``clear``: Octo as ``octo`` does it with the payload codec off (frames
  in the clear on the broker), measured right after ``octo`` in every
  round: the cost of the codec, which ``octo`` has on as the host client
  does by default;
* ``lanes``: Octo, one session per lane (as concurrent workflow runs have),
  at more than 1 in flight;
* ``pg``: Octo as ``octo`` does it, with a second worker whose journal is
  in PostgreSQL (the test database of ``deploy/ensure-postgres.sh``,
  a schema of its own, dropped at the end), measured right after ``octo``
  in every round;
* ``lean``: the durable ceiling: request/reply on quorum queues (Octo's own
  topology, persistent messages, every one replicated and fsynced by the
  broker, no persistence of our own) on the lean AMQP client Octo itself
  runs on (``octo_common.runtime.amqp``; the peer is ``bench/_lean_peer.py``);
* ``quorum``: the same request/reply on aio-pika (a reference row: the
  durable ceiling as that client reaches it);
* ``classic``: the same aio-pika request/reply on classic queues with
  transient messages (``bench/baselines.py``): the plain ceiling;
* ``celery``: Celery, acks late, rpc backend (``bench/baselines.py``);
* ``commit``: the p50 of one fsynced single-row SQLite commit with the
  stores' pragmas (WAL, ``synchronous=FULL``; ``bench/_commit.py``) in this
  run's directory, ``--commit-samples`` commits per round;
* ``flat``: Octo at ``--flat-in-flight`` with one session rotated every 10
  and every 1,000 operations, ``--flat-total`` operations each.

``--loop`` (default uvloop, the worker daemon's default event loop) applies
to every asyncio process alike: Octo's host and worker and both aio-pika
peers. ``--anchor`` turns the rollback anchor on for the host ledger and the
worker journal (off by default, as before). Each figure is the median of
``--runs`` measurements with min-max. CPU per operation is user + system
time of all threads of each process over the measured phase; the host's
includes its SQLite thread. Per Octo and lean-ceiling operation the tables
also give the socket writes to the broker of the host (the client side)
and of the worker (the peer), and the broker's CPU: the user + system time
of the process listening on the broker's port, from /proc, over the
measured phase (on a broker shared with other work, that work is in it).
At the end the goals are printed with their thresholds, the same-run
values and met / NOT met:

1. 64 in flight, session per lane: >= 1.3x Celery's ops/s;
2. CPU per operation at 64 in flight, host plus worker: <= 1.3 ms;
3. 1 in flight: Octo's p50 <= 3.5 ms;
4. ops/s with 1,000 operations per session >= 0.9x ops/s with 10 per
   session (the journal-size half is ``bench/journal.py``);
5. the moonshot: 1,000 durable ops/s (the best Octo row's median), and
   that row >= 0.5x the lean durable ceiling at the same concurrency;
6. 64 in flight on a PostgreSQL journal >= 0.8x SQLite's ops/s.

``--profile DIR`` adds one extra pass per concurrency with wall-clock stage
timers on both sides and cProfile in both processes (not mixed into the
figures above) and prints where the time goes per operation.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_common.transport import reply_queue, worker_queue
from octo_host.client import HostClient, HostSession

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _commit  # noqa: E402
import _loop  # noqa: E402
import _octo  # noqa: E402
import baselines  # noqa: E402
from _e2e_peer import StageTimers  # noqa: E402
from _octo import GRANT, STEP, TOOL, URL, WorkerFiles, WorkerProcess  # noqa: E402
from _pg import PgPlace  # noqa: E402

OPS_PER_SESSION = 100
PARTS = (
    "octo",
    "clear",
    "lanes",
    "pg",
    "lean",
    "quorum",
    "classic",
    "celery",
    "commit",
    "flat",
)
LEAN_PEER = HERE / "_lean_peer.py"
FLAT_SMALL, FLAT_LARGE = 10, 1000  # operations per session compared by goal 4


# The Octo measurement -------------------------------------------------------------------


class Sessions:
    """``count`` concurrent host sessions, each replaced after ``per_session`` operations.

    Lane ``i`` uses session ``i % count``. A worker session's commits are
    one chain, pipelined (each commit is submitted on top of the one in
    flight and they share a transaction), so lanes sharing one session cost
    little more than separate sessions. A replaced session is left to the
    client's ``close()``, which closes it at the worker.
    """

    def __init__(self, client: HostClient, scope: str, count: int, per_session: int) -> None:
        self.client, self.scope = client, scope
        self.per_session = per_session
        self.current: list[HostSession | None] = [None] * count
        self.uses = [0] * count
        self.locks = [asyncio.Lock() for _ in range(count)]

    async def get(self, lane: int) -> HostSession:
        slot = lane % len(self.current)
        async with self.locks[slot]:
            session = self.current[slot]
            if session is None or self.uses[slot] >= self.per_session:
                session = await self.client.open_session(
                    self.scope, CapabilityManifest("bench", [GRANT])
                )
                self.current[slot] = session
                self.uses[slot] = 0
            self.uses[slot] += 1
            return session


def host_stages() -> list[tuple[Any, str, str]]:
    """The host pipeline's stages: (class, method, label), where each method is defined."""
    from octo_host import engine, ledger, store
    from octo_host.client import broker, facade, replies, sessions, verbs

    return [
        (facade.HostClient, "record_operation", "record_intent"),
        (facade.HostClient, "dispatch", "dispatch_total"),
        (verbs.HostVerbs, "_send_prepared", "persist_seal_publish_await"),
        (broker.HostBroker, "publish", "publish_confirmed"),
        (sessions.SessionRegistry, "await_reply", "await_reply"),
        (replies.ReplyRouter, "_apply", "reply_apply_total"),
        (store.SqliteLedgerStore, "compare_and_swap", "ledger_cas"),
        (ledger.WorkflowOperationLedger, "to_json", "ledger_to_json"),
        (ledger.WorkflowOperationLedger, "copy", "ledger_copy"),
        (engine.WorkflowEngine, "prepare_authenticated_operation_dispatch", "seal"),
        (engine.WorkflowEngine, "apply_reply", "open_apply"),
    ]


def instrument_host(timers: StageTimers) -> None:
    """The host pipeline's stages (wall clock, this process only)."""
    for owner, name, label in host_stages():
        timers.wrap(owner, name, label)


async def measure_octo(
    files: WorkerFiles,
    worker: WorkerProcess,
    in_flight: int,
    total: int,
    *,
    ledger_dir: Path,
    sessions_count: int = 1,
    per_session: int = OPS_PER_SESSION,
    anchor: bool = False,
    host_timers: StageTimers | None = None,
    host_profile: Path | None = None,
    payload_codec: bool = True,
) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    store = _octo.ledger_store(ledger_dir / f"ledger-{tag}.sqlite3", anchor=anchor)
    host_id = f"bench-host-{tag}"
    client = HostClient(
        URL,
        host_id=host_id,
        scope_keys={files.scope: files.scope_key},
        store=store,
        reply_timeout=30.0,
        payload_codec=payload_codec,
    )
    await client.start()
    try:
        plan = client.engine.plan([STEP])
        sessions = Sessions(client, files.scope, min(sessions_count, in_flight), per_session)
        warmup = baselines._warmup_count(total, in_flight)
        names = itertools.count()
        creation: list[float] = []

        async def create_runs(count: int) -> list[str]:
            created = []
            for _ in range(count):
                name = f"r{next(names)}"
                started = time.perf_counter()
                await client.load_run(name, plan)
                creation.append(time.perf_counter() - started)
                created.append(name)
            return created

        async def operation(lane: int, name: str, latencies: list[float] | None) -> None:
            session = await sessions.get(lane)
            run = await client.load_run(name, plan)  # cached: created beforehand
            payload = ToolPayload.json({"run": name})
            started = time.perf_counter()
            key = await client.record_operation(
                run, STEP.id, TOOL, payload, name.encode(), scope=files.scope
            )
            state = await client.dispatch(session, run, key, payload)
            if latencies is not None:
                latencies.append(time.perf_counter() - started)
            if not isinstance(state, Succeeded):
                raise RuntimeError(f"operation ended {state.kind.value}")

        async def phase(runs: list[str], latencies: list[float] | None) -> float:
            queue = iter(runs)

            async def lane(index: int) -> None:
                for name in queue:
                    await operation(index, name, latencies)

            started = time.perf_counter()
            await asyncio.gather(*(lane(i) for i in range(in_flight)))
            return time.perf_counter() - started

        await phase(await create_runs(warmup), None)
        measured_runs = await create_runs(total)
        worker.checkpoint()  # the worker's timers start with the measured phase
        if host_timers is not None:
            host_timers.reset()
        profiler = cProfile.Profile() if host_profile is not None else None
        latencies: list[float] = []
        if profiler is not None:
            profiler.enable()
        worker_writes = worker.socket_writes()
        host_writes = client._broker.socket_writes
        broker = _octo.broker_pid()
        broker_cpu = _octo.cpu_seconds(broker) if broker is not None else 0.0
        host_cpu, worker_cpu = _octo.host_cpu_seconds(), worker.cpu_seconds()
        elapsed = await phase(measured_runs, latencies)
        host_cpu = _octo.host_cpu_seconds() - host_cpu
        worker_cpu = worker.cpu_seconds() - worker_cpu
        broker_cpu = _octo.cpu_seconds(broker) - broker_cpu if broker is not None else -1.0
        host_writes = client._broker.socket_writes - host_writes
        if profiler is not None:
            profiler.disable()
            assert host_profile is not None
            profiler.dump_stats(host_profile)
        worker.checkpoint()
        worker_writes = worker.socket_writes() - worker_writes
        figures = baselines.summarize(latencies, elapsed)
        figures["host_writes"] = round(host_writes / total, 3)
        figures["worker_writes"] = round(worker_writes / total, 3)
        if broker_cpu >= 0:
            figures["broker_cpu_us"] = round(broker_cpu / total * 1e6, 1)
        figures["run_create_ms"] = round(statistics.median(creation) * 1000, 3)
        # CPU per operation, all threads (the host's includes its SQLite thread).
        figures["host_cpu_us"] = round(host_cpu / total * 1e6, 1)
        figures["worker_cpu_us"] = round(worker_cpu / total * 1e6, 1)
        figures["total_cpu_us"] = round((host_cpu + worker_cpu) / total * 1e6, 1)
    finally:
        await client.close()
        await store.close()
        await _octo.delete_queue(reply_queue(host_id))
    # The client's close() closed its sessions at the worker: let it finish.
    figures["worker_settle_s"] = round(await _octo.wait_idle(worker), 2)
    return figures


# The ceiling on Octo's own topology --------------------------------------------------------


async def durable_ceiling(in_flight: int, total: int) -> dict[str, float]:
    """The aio-pika request/reply of ``bench/baselines.py`` on quorum queues.

    Same peer and driver as the plain ceiling; only the queues differ: the
    request queue and the reply queue are quorum queues, as Octo's worker and
    reply queues are, so every message is replicated to the Raft log
    and fsynced before it is confirmed or delivered. Octo adds its journal,
    ledger and frames on top of exactly this.
    """
    import aio_pika

    request_queue = f"octo.bench.qrpc.{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(URL, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=max(in_flight * 2, 16))
        quorum: dict[str, Any] = {"x-queue-type": "quorum"}
        await channel.declare_queue(request_queue, durable=True, arguments=quorum)
        replies = await channel.declare_queue(
            f"{request_queue}.reply", durable=True, arguments=quorum
        )
        peer = await baselines._start_peer(URL, request_queue, prefetch=in_flight)
        try:
            return await baselines._drive_aiopika(
                channel, request_queue, replies, in_flight, total, baselines.BODY_BYTES
            )
        finally:
            await baselines._stop_peer(peer)
            # Close the consuming channel first: deleting a queue under its own
            # consumer makes the broker cancel it, which aio-pika reports.
            await channel.close()
            cleanup = await connection.channel()
            await cleanup.queue_delete(request_queue)
            await cleanup.queue_delete(replies.name)
    finally:
        await connection.close()


async def lean_ceiling(in_flight: int, total: int) -> dict[str, float]:
    """The durable ceiling on the lean client Octo runs on.

    Request/reply between this process and ``bench/_lean_peer.py`` on two
    quorum queues, persistent messages, every publish mandatory and
    confirmed, every delivery acked (the peer acks a request once its reply
    is confirmed): Octo's round trip without journal, ledger or frames.
    """
    from pamqp import commands

    from octo_common.runtime import amqp

    request_queue = f"octo.bench.lean.{uuid.uuid4().hex[:12]}"
    reply_name = f"{request_queue}.reply"
    connection = await amqp.connect(URL, name="octo-bench-lean")
    try:
        publish = await connection.channel(publisher_confirms=True)
        quorum: dict[str, Any] = {"x-queue-type": "quorum"}
        await publish.declare_queue(request_queue, durable=True, arguments=quorum)
        await publish.declare_queue(reply_name, durable=True, arguments=quorum)
        consume = await connection.channel()
        await consume.set_qos(prefetch_count=max(in_flight * 2, 16))
        loop = asyncio.get_running_loop()
        waiting: dict[str, asyncio.Future[None]] = {}

        def on_reply(delivery: amqp.AmqpDelivery) -> None:
            consume.ack(delivery.delivery_tag)
            future = waiting.pop(delivery.correlation_id or "", None)
            if future is not None and not future.done():
                future.set_result(None)

        await consume.consume(reply_name, on_reply)
        peer = await baselines._start_peer(URL, request_queue, in_flight, LEAN_PEER)
        body = b"x" * baselines.BODY_BYTES
        ids = itertools.count()
        latencies: list[float] = []

        async def round_trip(record: bool) -> None:
            correlation_id = str(next(ids))
            answered: asyncio.Future[None] = loop.create_future()
            waiting[correlation_id] = answered
            started = time.perf_counter()
            properties = amqp.Properties(
                delivery_mode=2, correlation_id=correlation_id, reply_to=reply_name
            )
            if await publish.publish("", request_queue, body, properties) != amqp.ACKED:
                raise RuntimeError("a request was not confirmed")
            await asyncio.wait_for(answered, 30)
            if record:
                latencies.append(time.perf_counter() - started)

        async def run(count: int, record: bool) -> float:
            counter = iter(range(count))

            async def lane() -> None:
                for _ in counter:
                    await round_trip(record)

            started = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(in_flight)))
            return time.perf_counter() - started

        try:
            await run(baselines._warmup_count(total, in_flight), record=False)
            broker = _octo.broker_pid()
            broker_cpu = _octo.cpu_seconds(broker) if broker is not None else 0.0
            client_cpu, peer_cpu = _octo.host_cpu_seconds(), _octo.cpu_seconds(peer.pid)
            writes = connection.writes
            elapsed = await run(total, record=True)
            writes = connection.writes - writes
            client_cpu = _octo.host_cpu_seconds() - client_cpu
            peer_cpu = _octo.cpu_seconds(peer.pid) - peer_cpu
            figures = baselines.summarize(latencies, elapsed)
            figures["host_writes"] = round(writes / total, 3)
            figures["host_cpu_us"] = round(client_cpu / total * 1e6, 1)
            figures["worker_cpu_us"] = round(peer_cpu / total * 1e6, 1)
            figures["total_cpu_us"] = round((client_cpu + peer_cpu) / total * 1e6, 1)
            if broker is not None:
                broker_cpu = _octo.cpu_seconds(broker) - broker_cpu
                figures["broker_cpu_us"] = round(broker_cpu / total * 1e6, 1)
            return figures
        finally:
            await baselines._stop_peer(peer)
            await consume.close()
            for name in (request_queue, reply_name):
                await publish.rpc(commands.Queue.Delete(queue=name), (commands.Queue.DeleteOk,))
    finally:
        await connection.close()


def commit_probe(directory: Path, samples: int) -> dict[str, float]:
    """p50 / p99 of single-row fsynced commits in ``directory`` (see ``bench/_commit.py``)."""
    latencies = sorted(
        _commit.single_row_commit_latencies(
            directory / f"commit-{uuid.uuid4().hex[:8]}.db", samples
        )
    )
    return {
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(latencies[max(int(len(latencies) * 0.99) - 1, 0)] * 1000, 3),
    }


# Reporting --------------------------------------------------------------------------------

Results = dict[str, list[dict[str, float]]]
ROWS = (
    ("octo", "Octo, one session"),
    ("octo_clear", "Octo, one session, codec off"),
    ("octo_lanes", "Octo, session per lane"),
    ("octo_pg", "Octo, one session, PostgreSQL"),
    ("lean_quorum", "lean client, quorum (durable ceiling)"),
    ("aiopika_quorum", "aio-pika, quorum (reference)"),
    ("aiopika_ceiling", "aio-pika, classic, transient"),
    ("celery", "Celery, acks late, rpc"),
)


def _median(results: Results, key: str, field: str) -> float | None:
    runs = results.get(key)
    return statistics.median(r[field] for r in runs) if runs else None


def _spread(values: list[float], digits: int = 1) -> str:
    return (
        f"{statistics.median(values):,.{digits}f} "
        f"({min(values):,.{digits}f}-{max(values):,.{digits}f})"
    )


def _optional(rows: list[dict[str, float]], field: str, digits: int = 0) -> str:
    values = [r[field] for r in rows if field in r]
    return _spread(values, digits) if values else "-"


def _writes(rows: list[dict[str, float]]) -> str:
    host = [r["host_writes"] for r in rows if "host_writes" in r]
    worker = [r["worker_writes"] for r in rows if "worker_writes" in r]
    return (
        (f"{statistics.median(host):.2f}" if host else "-")
        + "/"
        + (f"{statistics.median(worker):.2f}" if worker else "-")
    )


def print_table(results: Results, in_flights: list[int], runs: int) -> None:
    print(f"\nmedians of {runs} run(s), (min-max)")
    print(f"{'system':<36}{'in flight':>9}  {'ops/s':<26}{'p50 ms':<24}{'p99 ms':<24}")
    for in_flight in in_flights:
        for system, label in ROWS:
            rows = results.get(f"{system}@{in_flight}")
            if not rows:
                continue
            print(
                f"{label:<36}{in_flight:>9}  "
                f"{_spread([r['ops_per_s'] for r in rows]):<26}"
                f"{_spread([r['p50_ms'] for r in rows], 2):<24}"
                f"{_spread([r['p99_ms'] for r in rows], 2):<24}"
            )
    octo_create = [
        r["run_create_ms"] for k, v in results.items() if k.startswith("octo") for r in v
    ]
    if octo_create:
        median = statistics.median(octo_create)
        print(f"(Octo run creation, outside the latency window: median {median:.2f} ms)")
    commits = results.get("commit")
    if commits:
        print(
            "one fsynced single-row SQLite commit (WAL, synchronous=FULL), p50 ms: "
            f"{_spread([r['p50_ms'] for r in commits], 3)}"
        )
    print(
        "\nper operation: CPU us (user + system, all threads of each process; for the lean "
        "ceiling its client and peer), socket writes to the broker (host / worker), and the "
        "broker's CPU us"
    )
    print(
        f"{'system':<36}{'in flight':>9}  {'host':<22}{'worker':<22}{'host + worker':<22}"
        f"{'writes h/w':<12}{'broker':<18}"
    )
    for in_flight in in_flights:
        for system, label in ROWS[:4]:
            rows = results.get(f"{system}@{in_flight}")
            if not rows:
                continue
            print(
                f"{label:<36}{in_flight:>9}  "
                f"{_spread([r['host_cpu_us'] for r in rows], 0):<22}"
                f"{_spread([r['worker_cpu_us'] for r in rows], 0):<22}"
                f"{_spread([r['total_cpu_us'] for r in rows], 0):<22}"
                f"{_writes(rows):<12}{_optional(rows, 'broker_cpu_us'):<18}"
            )
    flat = [key for key in results if key.startswith("octo_flat")]
    if flat:
        print("\nflat cost: Octo, one session rotated every N operations")
        for key in sorted(flat, key=lambda k: int(k.split("@")[0].removeprefix("octo_flat"))):
            rows = results[key]
            per_session, in_flight = key.removeprefix("octo_flat").split("@")
            print(
                f"  {int(per_session):>5} ops per session, {in_flight} in flight: "
                f"{_spread([r['ops_per_s'] for r in rows])} ops/s, "
                f"host + worker CPU {_spread([r['total_cpu_us'] for r in rows], 0)} us/op"
            )
    settles = [
        (k, r["worker_settle_s"])
        for k, v in results.items()
        for r in v
        if r.get("worker_settle_s", 0.0) > 1.0
    ]
    if settles:
        worst = max(settles, key=lambda item: item[1])
        print(
            f"(the worker stayed busy after {len(settles)} Octo measurement(s) while closing "
            f"their sessions; longest {worst[1]:.1f} s after {worst[0]})"
        )


def ratios(results: Results) -> dict[str, float]:
    """Same-run ratios against the baselines (informational)."""
    found: dict[str, float] = {}
    pairs = {
        "octo_vs_ceiling_ops@64": ("octo@64", "aiopika_ceiling@64", "ops_per_s"),
        "octo_vs_quorum_ops@64": ("octo@64", "aiopika_quorum@64", "ops_per_s"),
        "octo_vs_lean_ops@64": ("octo@64", "lean_quorum@64", "ops_per_s"),
        "octo_lanes_vs_lean_ops@64": ("octo_lanes@64", "lean_quorum@64", "ops_per_s"),
        "lean_vs_aiopika_quorum_ops@64": ("lean_quorum@64", "aiopika_quorum@64", "ops_per_s"),
        "octo_vs_celery_ops@64": ("octo@64", "celery@64", "ops_per_s"),
        "octo_lanes_vs_ceiling_ops@64": ("octo_lanes@64", "aiopika_ceiling@64", "ops_per_s"),
        "octo_lanes_vs_quorum_ops@64": ("octo_lanes@64", "aiopika_quorum@64", "ops_per_s"),
        "octo_lanes_vs_celery_ops@64": ("octo_lanes@64", "celery@64", "ops_per_s"),
        "octo_vs_ceiling_p50@1": ("octo@1", "aiopika_ceiling@1", "p50_ms"),
        "octo_vs_quorum_p50@1": ("octo@1", "aiopika_quorum@1", "p50_ms"),
    }
    for name, (ours, theirs, field) in pairs.items():
        a, b = _median(results, ours, field), _median(results, theirs, field)
        if a and b:
            found[name] = round(a / b, 3)
    return found


def goals(results: Results, flat_in_flight: int) -> list[dict[str, Any]]:
    """The goals: name, threshold, measured value (text) and met (None: not measured)."""
    out: list[dict[str, Any]] = []

    def add(name: str, threshold: str, value: str, met: bool | None) -> None:
        out.append({"goal": name, "threshold": threshold, "value": value, "met": met})

    def ratio(name: str, ours: str, theirs: str, minimum: float, missing: str) -> None:
        a, b = _median(results, ours, "ops_per_s"), _median(results, theirs, "ops_per_s")
        if a and b:
            add(name, f">= {minimum:.2f}x", f"{a:,.0f} / {b:,.0f} ops/s = {a / b:.2f}x",
                a / b >= minimum)  # fmt: skip
        else:
            add(name, f">= {minimum:.2f}x", f"not measured ({missing})", None)

    ratio("1.  64 in flight, session per lane vs Celery", "octo_lanes@64", "celery@64",
          1.3, "parts lanes, celery at 64 in flight")  # fmt: skip
    for system, label in (("octo_lanes", "session per lane"), ("octo", "one session")):
        name = f"2.  CPU/op at 64 in flight, host + worker ({label})"
        cpu = _median(results, f"{system}@64", "total_cpu_us")
        host = _median(results, f"{system}@64", "host_cpu_us")
        work = _median(results, f"{system}@64", "worker_cpu_us")
        if cpu is None or host is None or work is None:
            add(name, "<= 1.30 ms", f"not measured (part {system.replace('octo_', '')})", None)
        else:
            add(name, "<= 1.30 ms",
                f"{cpu / 1000:.2f} ms (host {host / 1000:.2f} + worker {work / 1000:.2f})",
                cpu <= 1300.0)  # fmt: skip
    octo1 = _median(results, "octo@1", "p50_ms")
    if octo1:
        add("3.  1 in flight: Octo p50", "<= 3.50 ms", f"{octo1:.2f} ms", octo1 <= 3.5)
    else:
        add("3.  1 in flight: Octo p50", "<= 3.50 ms", "not measured (part octo at 1)", None)
    ratio(f"4.  ops/s, {FLAT_LARGE:,} vs {FLAT_SMALL} operations per session "
          f"({flat_in_flight} in flight)", f"octo_flat{FLAT_LARGE}@{flat_in_flight}",
          f"octo_flat{FLAT_SMALL}@{flat_in_flight}", 0.9, "part flat")  # fmt: skip
    best = [
        (_median(results, key, "ops_per_s") or 0.0, key)
        for key in results
        if key.startswith(("octo@", "octo_lanes@"))
    ]
    if best:
        value, key = max(best)
        add("5a. moonshot: durable ops/s (best Octo row)", ">= 1,000",
            f"{value:,.0f} ops/s ({key})", value >= 1000.0)  # fmt: skip
        in_flight = key.split("@")[1]
        ratio(f"5b. moonshot: that row vs the lean durable ceiling at {in_flight} in flight",
              key, f"lean_quorum@{in_flight}", 0.5, "part lean")  # fmt: skip
    else:
        add("5a. moonshot: durable ops/s (best Octo row)", ">= 1,000", "not measured", None)
    ratio("6.  64 in flight, PostgreSQL journal vs SQLite (one session)", "octo_pg@64",
          "octo@64", 0.8, "parts octo, pg at 64 in flight")  # fmt: skip
    return out


def print_goals(found_ratios: dict[str, float], found_goals: list[dict[str, Any]]) -> None:
    if found_ratios:
        print("\nsame-run ratios (medians)")
        for name, value in found_ratios.items():
            print(f"  {name:<32}{value:>8.3f}")
    print("\ngoals (same run, medians)")
    for goal in found_goals:
        verdict = {True: "met", False: "NOT met", None: "-"}[goal["met"]]
        print(f"  {goal['goal']:<66}{goal['threshold']:<28}{verdict:<9}{goal['value']}")


def print_stages(title: str, stages: dict[str, list[float]], ops: int) -> None:
    print(f"\n{title} (wall clock per operation; nested stages overlap their parents)")
    for label, (count, seconds) in sorted(stages.items(), key=lambda item: -item[1][1]):
        print(
            f"  {label:<30}{seconds / ops * 1e6:>10.0f} us/op"
            f"{int(count) / ops:>8.2f} calls/op{seconds / max(count, 1) * 1e6:>10.0f} us/call"
        )


def print_profile(title: str, path: Path, ops: int, limit: int = 25) -> None:
    stats = pstats.Stats(str(path), stream=io.StringIO())
    entries = stats.stats.items()  # type: ignore[attr-defined]
    idle = sum(
        v[2] for (_, _, name), v in entries if name == "<method 'poll' of 'select.epoll' objects>"
    )
    busy = sum(v[2] for v in stats.stats.values()) - idle  # type: ignore[attr-defined]
    print(
        f"\n{title}: busy {busy / ops * 1e6:.0f} us/op (idle in epoll {idle / ops * 1e6:.0f}"
        " us/op); top functions by own time"
    )
    rows = sorted(entries, key=lambda item: -item[1][2])
    for (filename, line, name), (_, calls, own, cumulative, _) in rows[:limit]:
        where = f"{Path(filename).parent.name}/{Path(filename).name}:{line}"
        if filename == "~":
            where = "builtin"
        print(
            f"  {own / ops * 1e6:>8.1f} us/op own {cumulative / ops * 1e6:>9.1f} cum "
            f"{calls / ops:>7.2f}/op  {name} ({where})"
        )


# Main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--runs", type=int, default=5, help="measurements per figure (medians)")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to measure (default: all)",
    )
    parser.add_argument("--sessions", type=int, default=1, help="concurrent host sessions")
    parser.add_argument("--ops-per-session", type=int, default=OPS_PER_SESSION)
    parser.add_argument(
        "--commit-samples", type=int, default=200, help="single-row commits per round (commit)"
    )
    parser.add_argument("--flat-total", type=int, default=2000, help="operations (flat)")
    parser.add_argument("--flat-in-flight", type=int, default=64, help="concurrency (flat)")
    parser.add_argument(
        "--anchor", action="store_true", help="rollback anchors on (host ledger, worker journal)"
    )
    parser.add_argument("--no-baselines", action="store_true", help="drop classic and celery")
    parser.add_argument("--no-lane-sessions", action="store_true", help="drop lanes")
    parser.add_argument(
        "--durable-ceiling",
        action="store_true",
        help="kept for old command lines: both ceilings are part of the default parts",
    )
    parser.add_argument("--profile", type=Path, help="directory for the profiling pass")
    parser.add_argument("--json", action="store_true", help="also print one JSON document")
    parser.add_argument(
        "--loop",
        choices=_loop.CHOICES,
        default=os.environ.get("OCTO_BENCH_LOOP", "uvloop"),
        help="event loop of every process: Octo's host and worker and the aio-pika baselines",
    )
    args = parser.parse_args(argv)
    parts = set(args.parts)
    if args.no_baselines:
        parts -= {"classic", "celery"}
    if args.no_lane_sessions:
        parts.discard("lanes")
    if args.durable_ceiling:
        parts |= {"lean", "quorum"}
    args.parts = parts
    if args.total < max(args.in_flight) or args.flat_total < args.flat_in_flight:
        parser.error("each total must be at least its number in flight")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OCTO_BENCH_LOOP"] = args.loop  # inherited by every peer process
    parts = args.parts
    print(
        f"event loop: {args.loop} (every process of Octo and of the aio-pika baselines); "
        f"parts: {' '.join(p for p in PARTS if p in parts)}; {args.runs} run(s) of "
        f"{args.total} operations at {args.in_flight} in flight; "
        f"anchors {'on' if args.anchor else 'off'}",
        flush=True,
    )
    _octo.quiet_logs()
    results: Results = {}
    in_flights = args.in_flight + ([args.flat_in_flight] if "flat" in parts else [])
    with tempfile.TemporaryDirectory(prefix="octo-e2e-") as tmp:
        root = Path(tmp)
        files = WorkerFiles(root / "worker", max(in_flights), anchor=args.anchor)
        worker = WorkerProcess(files)
        place: PgPlace | None = None
        pg: tuple[WorkerFiles, WorkerProcess] | None = None
        if "pg" in parts:
            place = PgPlace(root / "pg")
            pg_files = WorkerFiles(
                root / "worker-pg", max(in_flights), storage=place.storage_toml()
            )
            pg = (pg_files, WorkerProcess(pg_files))

        def octo(
            in_flight: int,
            total: int,
            sessions: int,
            per_session: int,
            on: tuple[WorkerFiles, WorkerProcess] = (files, worker),
            payload_codec: bool = True,
        ) -> dict[str, float]:
            return _loop.run(
                measure_octo(
                    on[0],
                    on[1],
                    in_flight,
                    total,
                    ledger_dir=root,
                    sessions_count=sessions,
                    per_session=per_session,
                    anchor=args.anchor,
                    payload_codec=payload_codec,
                )
            )

        def record(key: str, figures: dict[str, float], line: list[str]) -> None:
            results.setdefault(key, []).append(figures)
            line.append(f"{key} {figures}")

        try:
            for run in range(args.runs):
                line = [f"run {run + 1}:"]
                if "commit" in parts:
                    record("commit", commit_probe(root, args.commit_samples), line)
                for in_flight in args.in_flight:
                    # "octo": --sessions sessions; "octo_lanes": one session per lane.
                    if "octo" in parts:
                        figures = octo(in_flight, args.total, args.sessions, args.ops_per_session)
                        record(f"octo@{in_flight}", figures, line)
                    if "clear" in parts:
                        figures = octo(
                            in_flight,
                            args.total,
                            args.sessions,
                            args.ops_per_session,
                            payload_codec=False,
                        )
                        record(f"octo_clear@{in_flight}", figures, line)
                    if pg is not None:
                        figures = octo(
                            in_flight, args.total, args.sessions, args.ops_per_session, pg
                        )
                        record(f"octo_pg@{in_flight}", figures, line)
                    if "lanes" in parts and in_flight > 1:
                        figures = octo(in_flight, args.total, in_flight, args.ops_per_session)
                        record(f"octo_lanes@{in_flight}", figures, line)
                    if "classic" in parts:
                        figures = baselines.run_aiopika_ceiling(in_flight, args.total, url=URL)
                        record(f"aiopika_ceiling@{in_flight}", figures, line)
                    if "celery" in parts:
                        figures = baselines.run_celery(in_flight, args.total, url=URL)
                        record(f"celery@{in_flight}", figures, line)
                    if "lean" in parts:
                        figures = _loop.run(lean_ceiling(in_flight, args.total))
                        record(f"lean_quorum@{in_flight}", figures, line)
                    if "quorum" in parts:
                        figures = _loop.run(durable_ceiling(in_flight, args.total))
                        record(f"aiopika_quorum@{in_flight}", figures, line)
                if "flat" in parts:
                    for per_session in (FLAT_SMALL, FLAT_LARGE):
                        figures = octo(args.flat_in_flight, args.flat_total, 1, per_session)
                        record(f"octo_flat{per_session}@{args.flat_in_flight}", figures, line)
                print("\n  ".join(line), flush=True)
        finally:
            worker.stop()
            _loop.run(_octo.delete_queue(worker_queue(files.scope)))
            if pg is not None:
                pg[1].stop()
                _loop.run(_octo.delete_queue(worker_queue(pg[0].scope)))
            if place is not None:
                _loop.run(place.drop())
        print_table(results, args.in_flight, args.runs)
        found = ratios(results)
        found_goals = goals(results, args.flat_in_flight)
        print_goals(found, found_goals)
        if args.profile is not None:
            profile_pass(args, root)
    if args.json:
        document = {"results": results, "ratios": found, "goals": found_goals}
        print(json.dumps(document, sort_keys=True))
    return 0


def profile_pass(args: argparse.Namespace, root: Path) -> None:
    """One extra measurement per concurrency with timers and profilers on both sides;
    with the part ``pg``, one more with the worker's journal in PostgreSQL."""
    out: Path = args.profile
    out.mkdir(parents=True, exist_ok=True)
    host_timers = StageTimers()
    instrument_host(host_timers)
    journals: list[str | None] = [None]
    place: PgPlace | None = None
    if "pg" in args.parts:
        place = PgPlace(root / "pg-profiled")
        journals.append(place.storage_toml())
    try:
        for storage in journals:
            for in_flight in args.in_flight:
                _profile_one(args, root, out, host_timers, in_flight, storage)
    finally:
        if place is not None:
            _loop.run(place.drop())


def _profile_one(
    args: argparse.Namespace,
    root: Path,
    out: Path,
    host_timers: StageTimers,
    in_flight: int,
    storage: str | None,
) -> None:
    journal = "sqlite" if storage is None else "pg"
    files = WorkerFiles(
        root / f"profiled-{journal}-{in_flight}", in_flight, anchor=args.anchor, storage=storage
    )
    worker = WorkerProcess(
        files,
        out / f"worker-stages-{journal}-{in_flight}.jsonl",
        out / f"worker-{journal}-{in_flight}",
    )
    host_profile = out / f"host-{journal}-{in_flight}.prof"
    try:
        figures = _loop.run(
            measure_octo(
                files,
                worker,
                in_flight,
                args.total,
                ledger_dir=root,
                sessions_count=args.sessions,
                per_session=args.ops_per_session,
                anchor=args.anchor,
                host_timers=host_timers,
                host_profile=host_profile,
            )
        )
    finally:
        worker.stop()
        _loop.run(_octo.delete_queue(worker_queue(files.scope)))
    print(
        f"\n=== profiled pass, {journal} journal, {in_flight} in flight "
        f"(profilers slow it): {figures}"
    )
    print_stages("host stages", host_timers.totals, args.total)
    print_stages("worker stages", worker.last_stages(), args.total)
    print_profile("host cProfile", host_profile, args.total)
    worker_profile = worker.last_profile()
    if worker_profile is not None and worker_profile.exists():
        print_profile("worker cProfile", worker_profile, args.total)


if __name__ == "__main__":
    sys.exit(main())
