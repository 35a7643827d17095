"""End-to-end durable dispatch round trips, host and worker in separate processes.

    .venv/bin/python bench/e2e.py [--total 2000] [--runs 5] [--in-flight 1 64]
                                  [--loop uvloop|asyncio] [--profile DIR]
                                  [--no-baselines] [--json]

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
``--ops-per-session`` operations (default 100; a session remembers at most
1024 request ids, and the worker's session document, written twice per
operation, grows with every request id it remembers); ``--sessions`` spreads
the lanes over that many concurrent sessions (default 1). At more than 1 in
flight a second Octo row, ``octo_lanes``, gives every lane its own session
(as concurrent workflow runs would have). A worker session's state document
is one compare-and-swap chain; the worker pipelines it (each commit is
submitted on top of the one in flight, and they share a transaction), so
lanes sharing one session cost little more than separate sessions.

Beside Octo, in the same run and at the same concurrency, the two baselines
of ``bench/baselines.py``: the plain aio-pika request/reply ceiling (no
persistence at all) and Celery (acks late, rpc backend). ``--durable-ceiling``
adds the same aio-pika request/reply on quorum queues (Octo's own topology),
the floor under any durable design here. ``--loop`` (default uvloop, the
worker daemon's default event loop) applies to every asyncio process alike:
Octo's host and worker and both aio-pika peers. Each figure is the
median of ``--runs`` measurements with min-max; the ratios the acceptance
criteria name are printed at the end.

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
import logging
import os
import pstats
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import structlog

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Succeeded
from octo_common.transport import reply_queue, worker_queue
from octo_host.client import HostClient, HostSession
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _loop  # noqa: E402
import baselines  # noqa: E402
from _e2e_peer import StageTimers  # noqa: E402

URL = os.environ.get("OCTO_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/")
PEER = HERE / "_e2e_peer.py"
TOOL = "octo.noop"
OPS_PER_SESSION = 100
GRANT = CapabilityGrant(TOOL, "json", max_calls=1024)
STEP = WorkflowStep("noop", "benchmark no-op")


# Worker process ----------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


class WorkerFiles:
    """worker.toml, keys and state directory of the benchmark's worker."""

    def __init__(self, root: Path, in_flight: int) -> None:
        self.root = root
        self.scope = f"bench-{uuid.uuid4().hex[:10]}"
        self.scope_key_bytes = secrets.token_bytes(32)
        _write_private(root / "keys" / "scope.key", self.scope_key_bytes)
        _write_private(root / "keys" / "storage.key", secrets.token_bytes(32).hex().encode())
        self.config = root / "worker.toml"
        # max_concurrency: the daemon's default (32) would cap 64 in flight.
        self.config.write_text(
            f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 5.0
log_level = "warning"

[broker]
url = "{URL}"
prefetch = {max(in_flight, 64)}

[storage]
journal = "journal.sqlite3"
key = {{ id = "bench-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{self.scope}"
key_file = "keys/scope.key"
max_concurrency = {max(in_flight, 64)}

[adapters]
enabled = ["{TOOL}"]
""",
            encoding="utf-8",
        )

    @property
    def scope_key(self) -> ScopeKey:
        return ScopeKey.from_bytes(self.scope_key_bytes)


class WorkerProcess:
    def __init__(self, files: WorkerFiles, stages: Path | None, profile: Path | None) -> None:
        argv = [sys.executable, str(PEER), str(files.config)]
        if stages is not None:
            argv += ["--stages", str(stages)]
        if profile is not None:
            argv += ["--profile", str(profile)]
        self.stages = stages
        self.profile = profile
        self.dumps = 0
        with open(files.root / "worker.err", "ab") as err:
            self.process = subprocess.Popen(  # fixed argv, no shell
                argv, stdout=subprocess.PIPE, stderr=err
            )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            self.process.wait(5)
            tail = (files.root / "worker.err").read_text("utf-8", "replace")[-2000:]
            raise RuntimeError(f"the worker did not start:\n{tail}")

    def checkpoint(self) -> None:
        """Dump the worker's stage timers / profile so far and reset them (SIGUSR1)."""
        self.process.send_signal(signal.SIGUSR1)
        self.dumps += 1
        time.sleep(0.2)

    def last_stages(self) -> dict[str, list[float]]:
        if self.stages is None:
            return {}
        lines = self.stages.read_text("utf-8").splitlines()
        return dict(json.loads(lines[-1])) if lines else {}

    def last_profile(self) -> Path | None:
        return None if self.profile is None else Path(f"{self.profile}-{self.dumps}.prof")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the worker process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


# The Octo measurement -------------------------------------------------------------------


class Sessions:
    """``count`` concurrent host sessions, each replaced after ``per_session`` operations.

    Lane ``i`` uses session ``i % count``. A worker session's commits are
    one chain, pipelined (see the module docstring).
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


def instrument_host(timers: StageTimers) -> None:
    """The host pipeline's stages (wall clock, this process only)."""
    from octo_host import client, engine, ledger, store

    timers.wrap(client.HostClient, "record_operation", "record_intent")
    timers.wrap(client.HostClient, "dispatch", "dispatch_total")
    timers.wrap(client.HostClient, "_send_prepared", "persist_seal_publish_await")
    timers.wrap(client.HostClient, "publish", "publish_confirmed")
    timers.wrap(client.HostClient, "_await", "await_reply")
    timers.wrap(client.HostClient, "_apply", "reply_apply_total")
    timers.wrap(store.SqliteLedgerStore, "compare_and_swap", "ledger_cas")
    timers.wrap(ledger.WorkflowOperationLedger, "to_json", "ledger_to_json")
    timers.wrap(ledger.WorkflowOperationLedger, "copy", "ledger_copy")
    timers.wrap(engine.WorkflowEngine, "prepare_authenticated_operation_dispatch", "seal")
    timers.wrap(
        engine.WorkflowEngine, "apply_authenticated_operation_dispatch_result", "open_apply"
    )


async def measure_octo(
    files: WorkerFiles,
    worker: WorkerProcess,
    in_flight: int,
    total: int,
    *,
    ledger_dir: Path,
    sessions_count: int = 1,
    per_session: int = OPS_PER_SESSION,
    host_timers: StageTimers | None = None,
    host_profile: Path | None = None,
) -> dict[str, float]:
    tag = uuid.uuid4().hex[:8]
    store = SqliteLedgerStore(
        ledger_dir / f"ledger-{tag}.sqlite3", StorageKeyring("host-k1", secrets.token_bytes(32))
    )
    host_id = f"bench-host-{tag}"
    client = HostClient(
        URL,
        host_id=host_id,
        scope_keys={files.scope: files.scope_key},
        store=store,
        reply_timeout=30.0,
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
        host_cpu, worker_cpu = time.process_time(), worker.cpu_seconds()
        elapsed = await phase(measured_runs, latencies)
        host_cpu, worker_cpu = time.process_time() - host_cpu, worker.cpu_seconds() - worker_cpu
        if profiler is not None:
            profiler.disable()
            assert host_profile is not None
            profiler.dump_stats(host_profile)
        worker.checkpoint()
        figures = baselines.summarize(latencies, elapsed)
        figures["run_create_ms"] = round(statistics.median(creation) * 1000, 3)
        # CPU per operation, all threads (the host's includes its SQLite thread).
        figures["host_cpu_us"] = round(host_cpu / total * 1e6, 1)
        figures["worker_cpu_us"] = round(worker_cpu / total * 1e6, 1)
        return figures
    finally:
        await client.close()
        await store.close()
        await _delete_queue(reply_queue(host_id))


async def _delete_queue(name: str) -> None:
    from octo_host.amqp import connect

    connection = await connect(URL, timeout=5.0, name="octo-bench-cleanup")
    try:
        channel = await connection.channel()
        await channel.queue_delete(name)
    finally:
        await connection.close()


# The ceiling on Octo's own topology --------------------------------------------------------


async def durable_ceiling(in_flight: int, total: int) -> dict[str, float]:
    """The aio-pika request/reply of ``bench/baselines.py`` on quorum queues.

    Same peer and driver as the plain ceiling; only the queues differ: the
    request queue and the reply queue are quorum queues, as Octo's worker and
    reply queues are (W§12.5), so every message is replicated to the Raft log
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


# Reporting --------------------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def _spread_ms(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def print_table(results: dict[str, list[dict[str, float]]], in_flights: list[int]) -> None:
    print()
    print(f"{'system':<22}{'in flight':>10}  {'ops/s median (min-max)':<26}", end="")
    print(f"{'p50 ms':<24}{'p99 ms':<24}")
    for in_flight in in_flights:
        for system in ("octo", "octo_lanes", "aiopika_ceiling", "aiopika_quorum", "celery"):
            runs = results.get(f"{system}@{in_flight}")
            if not runs:
                continue
            print(
                f"{system:<22}{in_flight:>10}  "
                f"{_spread([r['ops_per_s'] for r in runs]):<26}"
                f"{_spread_ms([r['p50_ms'] for r in runs]):<24}"
                f"{_spread_ms([r['p99_ms'] for r in runs]):<24}"
            )
    octo_create = [
        r["run_create_ms"] for k, v in results.items() if k.startswith("octo") for r in v
    ]
    if octo_create:
        median = statistics.median(octo_create)
        print(f"(run creation, outside the latency window: median {median:.2f} ms)")
    for in_flight in in_flights:
        runs = results.get(f"octo@{in_flight}")
        if runs and "host_cpu_us" in runs[0]:
            host = statistics.median(r["host_cpu_us"] for r in runs)
            worker = statistics.median(r["worker_cpu_us"] for r in runs)
            print(
                f"(octo@{in_flight} CPU per operation: host {host:.0f} us, worker {worker:.0f} us;"
                " all threads of each process)"
            )


def ratios(results: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    def median(key: str, field: str) -> float | None:
        runs = results.get(key)
        return statistics.median(r[field] for r in runs) if runs else None

    found: dict[str, float] = {}
    octo64 = median("octo@64", "ops_per_s")
    ceiling64 = median("aiopika_ceiling@64", "ops_per_s")
    celery64 = median("celery@64", "ops_per_s")
    octo1 = median("octo@1", "p50_ms")
    ceiling1 = median("aiopika_ceiling@1", "p50_ms")
    lanes64 = median("octo_lanes@64", "ops_per_s")
    if octo64 and ceiling64:
        found["octo_vs_ceiling_ops@64"] = round(octo64 / ceiling64, 3)
    if octo64 and celery64:
        found["octo_vs_celery_ops@64"] = round(octo64 / celery64, 3)
    if lanes64 and ceiling64:
        found["octo_lanes_vs_ceiling_ops@64"] = round(lanes64 / ceiling64, 3)
    if lanes64 and celery64:
        found["octo_lanes_vs_celery_ops@64"] = round(lanes64 / celery64, 3)
    if octo1 and ceiling1:
        found["octo_vs_ceiling_p50@1"] = round(octo1 / ceiling1, 3)
    return found


def print_ratios(found: dict[str, float]) -> None:
    targets = {
        "octo_vs_ceiling_ops@64": (">=", 0.85),
        "octo_vs_celery_ops@64": (">=", 1.3),
        "octo_lanes_vs_ceiling_ops@64": (">=", 0.85),
        "octo_lanes_vs_celery_ops@64": (">=", 1.3),
        "octo_vs_ceiling_p50@1": ("<=", 1.5),
    }
    print()
    for name, value in found.items():
        sign, target = targets[name]
        ok = value >= target if sign == ">=" else value <= target
        print(f"{name:<30}{value:>8.3f}   target {sign} {target}   {'met' if ok else 'NOT met'}")


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


def _quiet_logs() -> None:
    # The client logs every operation at info; production would ship those lines,
    # a benchmark measures the protocol.
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=2000, help="operations per measurement")
    parser.add_argument("--runs", type=int, default=5, help="measurements per figure")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--sessions", type=int, default=1, help="concurrent host sessions")
    parser.add_argument("--ops-per-session", type=int, default=OPS_PER_SESSION)
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument(
        "--no-lane-sessions",
        action="store_true",
        help="skip the second Octo row (one session per lane) at more than 1 in flight",
    )
    parser.add_argument(
        "--durable-ceiling",
        action="store_true",
        help="also measure the aio-pika ceiling on quorum queues (Octo's topology)",
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
    os.environ["OCTO_BENCH_LOOP"] = args.loop  # inherited by every peer process
    print(f"event loop: {args.loop} (every process of Octo and of the aio-pika baselines)")
    _quiet_logs()
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="octo-e2e-") as tmp:
        root = Path(tmp)
        files = WorkerFiles(root / "worker", max(args.in_flight))
        worker = WorkerProcess(files, None, None)
        try:
            for run in range(args.runs):
                for in_flight in args.in_flight:
                    # "octo": --sessions sessions; "octo_lanes": one session per lane.
                    variants = [("octo", args.sessions)]
                    if in_flight > 1 and not args.no_lane_sessions:
                        variants.append(("octo_lanes", in_flight))
                    line = f"run {run + 1}:"
                    for name, sessions in variants:
                        octo = _loop.run(
                            measure_octo(
                                files,
                                worker,
                                in_flight,
                                args.total,
                                ledger_dir=root,
                                sessions_count=sessions,
                                per_session=args.ops_per_session,
                            )
                        )
                        results.setdefault(f"{name}@{in_flight}", []).append(octo)
                        line += f" {name}@{in_flight} {octo}"
                    if not args.no_baselines:
                        ceiling = baselines.run_aiopika_ceiling(in_flight, args.total, url=URL)
                        celery = baselines.run_celery(in_flight, args.total, url=URL)
                        results.setdefault(f"aiopika_ceiling@{in_flight}", []).append(ceiling)
                        results.setdefault(f"celery@{in_flight}", []).append(celery)
                        line += f" ceiling {ceiling} celery {celery}"
                    if args.durable_ceiling:
                        durable = _loop.run(durable_ceiling(in_flight, args.total))
                        results.setdefault(f"aiopika_quorum@{in_flight}", []).append(durable)
                        line += f" quorum-ceiling {durable}"
                    print(line, flush=True)
        finally:
            worker.stop()
            _loop.run(_delete_queue(worker_queue(files.scope)))
        print_table(results, args.in_flight)
        found = ratios(results)
        print_ratios(found)
        if args.profile is not None:
            profile_pass(args, root)
    if args.json:
        print(json.dumps({"results": results, "ratios": found}, sort_keys=True))
    return 0


def profile_pass(args: argparse.Namespace, root: Path) -> None:
    """One extra measurement per concurrency with timers and profilers on both sides."""
    out: Path = args.profile
    out.mkdir(parents=True, exist_ok=True)
    host_timers = StageTimers()
    instrument_host(host_timers)
    for in_flight in args.in_flight:
        files = WorkerFiles(root / f"profiled-{in_flight}", in_flight)
        worker = WorkerProcess(
            files, out / f"worker-stages-{in_flight}.jsonl", out / f"worker-{in_flight}"
        )
        host_profile = out / f"host-{in_flight}.prof"
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
                    host_timers=host_timers,
                    host_profile=host_profile,
                )
            )
        finally:
            worker.stop()
            _loop.run(_delete_queue(worker_queue(files.scope)))
        print(f"\n=== profiled pass, {in_flight} in flight (profilers slow it): {figures}")
        print_stages("host stages", host_timers.totals, args.total)
        print_stages("worker stages", worker.last_stages(), args.total)
        print_profile("host cProfile", host_profile, args.total)
        worker_profile = worker.last_profile()
        if worker_profile is not None and worker_profile.exists():
            print_profile("worker cProfile", worker_profile, args.total)


if __name__ == "__main__":
    sys.exit(main())
