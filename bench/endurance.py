"""Endurance: does Octo's cost per operation and memory stay flat over a long run?

    .venv/bin/python bench/endurance.py [--operations 100000] [--interval 10000]
                                        [--in-flight 64] [--ops-per-session 100]
                                        [--warmup 1000] [--no-anchor] [--loop uvloop|asyncio]
                                        [--close-sessions N [--close-ops 1]] [--json]

    smoke run (seconds, no figures): --quick   (600 operations in intervals of 200,
                                               8 in flight, a session every 10
                                               operations, --close-sessions 30)

The worker is ``bench/_e2e_peer.py`` (the daemon as ``octo-worker run`` runs
it) in its own process; the host is a ``HostClient`` in this process, as in
``bench/e2e.py``. Both run with their rollback anchors on (``--no-anchor``
turns both off): the host ledger's ``anchor_path`` and the worker's
``[storage] anchor``, each initialised empty before the first open.

The run works as a real host would: every operation is a new workflow run
(its creation is one more fsynced ledger write, inside the measured
throughput), recorded and dispatched on the lane's session; each of the
``--in-flight`` lanes opens a new session every ``--ops-per-session``
operations and closes the one it used (``HostClient.close_session``), so
sessions are opened and closed all along. ``--warmup`` operations run
first and are not counted. Every ``--interval`` operations one row is
printed: ops/s over the interval, latency p50, CPU per operation of the host
and of the worker (user + system, all threads of each process; the host's
includes its SQLite thread) and their sum, RSS of each process, and the
sizes of the worker journal and of the host ledger and its anchor. The
baseline of each figure is the same run's first interval. At the end the
first-versus-last ratios are printed with these thresholds:

* last interval ops/s >= 0.9x the first;
* CPU per operation of the last interval <= 1.1x the first (host, worker,
  and their sum, each);
* RSS of each process after the run <= 1.2x its RSS after the first interval.

``--close-sessions N`` (default 1,000; 0 skips it) then measures, on the
same worker with the journal the long run left (or alone, with
``--operations 0``), closing N sessions at once: N fresh sessions each carry
``--close-ops`` operations, the worker is let go idle, then the host
publishes the N ``close_session`` frames together. Printed: seconds until
the worker has handled all N (its ``octo_deliveries_total`` on its metrics
endpoint), seconds until it is idle again, and the worker's peak RSS during
the close (``/proc`` VmHWM reset before, and RSS sampled every 50 ms),
against these thresholds: under 100 MB and under 5 s.

The host commit cost against the number of ledger records (the anchor's
share) is measured by ``bench/anchor.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import _loop
import _octo
from _octo import GRANT, MB, STEP, TOOL, URL, WorkerFiles, WorkerProcess

from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_common.transport import reply_queue, worker_queue
from octo_host.client import HostClient, HostSession
from octo_host.store import SqliteLedgerStore

QUICK = {
    "operations": 600,
    "interval": 200,
    "in_flight": 8,
    "ops_per_session": 10,
    "warmup": 60,
    "close_sessions": 30,
}
DEFAULTS = {
    "operations": 100_000,
    "interval": 10_000,
    "in_flight": 64,
    "ops_per_session": 100,
    "warmup": 1000,
    "close_sessions": 1000,
}
OPS_RATIO_MIN = 0.9
CPU_RATIO_MAX = 1.1
RSS_RATIO_MAX = 1.2
CLOSE_RSS_MAX_MB = 100.0
CLOSE_SECONDS_MAX = 5.0


@dataclass
class Snapshot:
    """Cumulative figures at one point of the run."""

    operations: int
    at: float
    host_cpu: float
    worker_cpu: float
    host_rss: int
    worker_rss: int
    journal_bytes: int
    ledger_bytes: int
    anchor_bytes: int
    sessions_opened: int
    sessions_closed: int


@dataclass
class Interval:
    """One printed row: the figures between two snapshots."""

    index: int
    operations: int  # measured operations at its end, cumulative
    count: int  # operations in this interval
    ops_per_s: float
    p50_ms: float
    host_cpu_us: float
    worker_cpu_us: float
    total_cpu_us: float
    host_rss_mb: float
    worker_rss_mb: float
    journal_mb: float
    ledger_mb: float
    anchor_mb: float
    sessions_opened: int
    sessions_closed: int


def _size(path: Path | None) -> int:
    if path is None:
        return 0
    total = 0
    for suffix in ("", "-wal"):
        candidate = Path(f"{path}{suffix}")
        if candidate.exists():
            total += candidate.stat().st_size
    return total


class Host:
    """The host side: one ``HostClient`` over a fresh ledger (anchor on or off)."""

    def __init__(self, root: Path, files: WorkerFiles, *, anchor: bool, reply_timeout: float):
        tag = uuid.uuid4().hex[:8]
        self.ledger_path = root / f"ledger-{tag}.sqlite3"
        self.anchor_path = (
            self.ledger_path.with_name(self.ledger_path.name + ".anchor") if anchor else None
        )
        self.store: SqliteLedgerStore = _octo.ledger_store(self.ledger_path, anchor=anchor)
        self.host_id = f"bench-endurance-{tag}"
        self.scope = files.scope
        self.client = HostClient(
            URL,
            host_id=self.host_id,
            scope_keys={files.scope: files.scope_key},
            store=self.store,
            reply_timeout=reply_timeout,
        )
        self.plan = self.client.engine.plan([STEP])
        self.names = itertools.count()
        self.opened = 0
        self.closed = 0

    async def start(self) -> None:
        await self.client.start()

    async def open_session(self) -> HostSession:
        session = await self.client.open_session(self.scope, CapabilityManifest("bench", [GRANT]))
        self.opened += 1
        return session

    async def close_session(self, session: HostSession) -> None:
        await self.client.close_session(session)
        self.closed += 1

    async def operation(self, session: HostSession) -> float:
        """One new workflow run, one operation recorded and dispatched; returns its latency."""
        name = f"r{next(self.names)}"
        run = await self.client.load_run(name, self.plan)  # creates it: one fsynced write
        payload = ToolPayload.json({"run": name})
        started = time.perf_counter()
        key = await self.client.record_operation(
            run, STEP.id, TOOL, payload, name.encode(), scope=self.scope
        )
        state = await self.client.dispatch(session, run, key, payload)
        if not isinstance(state, Succeeded):
            raise RuntimeError(f"operation ended {state.kind.value}")
        return time.perf_counter() - started

    async def close(self) -> None:
        try:
            await self.client.close()
            await self.store.close()
        finally:
            await _octo.delete_queue(reply_queue(self.host_id))


# The long run ---------------------------------------------------------------------------------


def snapshot(host: Host, worker: WorkerProcess, operations: int) -> Snapshot:
    return Snapshot(
        operations=operations,
        at=time.perf_counter(),
        host_cpu=_octo.host_cpu_seconds(),
        worker_cpu=worker.cpu_seconds(),
        host_rss=_octo.host_rss_bytes(),
        worker_rss=worker.rss_bytes(),
        journal_bytes=_size(worker.files.root / "state" / "journal.sqlite3"),
        ledger_bytes=_size(host.ledger_path),
        anchor_bytes=_size(host.anchor_path),
        sessions_opened=host.opened,
        sessions_closed=host.closed,
    )


def interval(index: int, before: Snapshot, after: Snapshot, latencies: list[float]) -> Interval:
    ops = after.operations - before.operations
    host = (after.host_cpu - before.host_cpu) / ops * 1e6
    work = (after.worker_cpu - before.worker_cpu) / ops * 1e6
    return Interval(
        index=index,
        operations=after.operations,
        count=ops,
        ops_per_s=ops / (after.at - before.at),
        p50_ms=statistics.median(latencies) * 1000 if latencies else 0.0,
        host_cpu_us=host,
        worker_cpu_us=work,
        total_cpu_us=host + work,
        host_rss_mb=after.host_rss / MB,
        worker_rss_mb=after.worker_rss / MB,
        journal_mb=after.journal_bytes / MB,
        ledger_mb=after.ledger_bytes / MB,
        anchor_mb=after.anchor_bytes / MB,
        sessions_opened=after.sessions_opened,
        sessions_closed=after.sessions_closed,
    )


HEADER = (
    f"{'#':>3}{'operations':>12}{'ops/s':>9}{'p50 ms':>9}"
    f"{'host us/op':>12}{'worker us/op':>14}{'sum us/op':>11}"
    f"{'host RSS MB':>13}{'worker RSS MB':>15}{'journal MB':>12}{'ledger MB':>11}"
    f"{'anchor MB':>11}{'sessions open/closed':>22}"
)


def row(item: Interval) -> str:
    return (
        f"{item.index:>3}{item.operations:>12,}{item.ops_per_s:>9,.0f}{item.p50_ms:>9.1f}"
        f"{item.host_cpu_us:>12,.0f}{item.worker_cpu_us:>14,.0f}{item.total_cpu_us:>11,.0f}"
        f"{item.host_rss_mb:>13.1f}{item.worker_rss_mb:>15.1f}{item.journal_mb:>12.1f}"
        f"{item.ledger_mb:>11.1f}{item.anchor_mb:>11.2f}"
        f"{f'{item.sessions_opened:,}/{item.sessions_closed:,}':>22}"
    )


async def long_run(
    root: Path, files: WorkerFiles, worker: WorkerProcess, args: argparse.Namespace
) -> list[Interval]:
    host = Host(root, files, anchor=args.anchor, reply_timeout=args.reply_timeout)
    await host.start()
    intervals: list[Interval] = []
    try:
        total = args.warmup + args.operations
        indices = iter(range(total))
        stop_at = None if args.max_minutes is None else time.perf_counter() + args.max_minutes * 60
        done = 0
        latencies: list[float] = []
        boundary = args.warmup + args.interval
        last: Snapshot | None = snapshot(host, worker, 0) if args.warmup == 0 else None
        if last is not None:
            print(HEADER, flush=True)

        def completed(latency: float) -> None:
            nonlocal done, boundary, last
            done += 1
            if done <= args.warmup:
                if done == args.warmup:
                    last = snapshot(host, worker, 0)
                    print(HEADER, flush=True)
                return
            latencies.append(latency)
            if done == boundary:
                close_interval()
                boundary += args.interval

        def close_interval() -> None:
            nonlocal last
            assert last is not None
            now = snapshot(host, worker, done - args.warmup)
            intervals.append(interval(len(intervals) + 1, last, now, latencies))
            print(row(intervals[-1]), flush=True)
            latencies.clear()
            last = now

        async def lane() -> None:
            session: HostSession | None = None
            uses = 0
            for _ in indices:
                if stop_at is not None and time.perf_counter() > stop_at:
                    break
                if session is None or uses >= args.ops_per_session:
                    fresh = await host.open_session()
                    if session is not None:
                        await host.close_session(session)  # its operations are all answered
                    session, uses = fresh, 0
                uses += 1
                completed(await host.operation(session))

        async with asyncio.TaskGroup() as lanes:
            for _ in range(args.in_flight):
                lanes.create_task(lane())
        if latencies:  # a last, shorter interval (--operations not a multiple, or --max-minutes)
            close_interval()
        if done < total:
            print(f"(stopped by --max-minutes after {done - args.warmup:,} operations)")
    finally:
        await host.close()  # closes each lane's last session at the worker
    settle = await _octo.wait_idle(worker)
    print(
        f"(after the run the worker was idle again {settle:.1f} s after the host closed "
        f"its last {args.in_flight} sessions)",
        flush=True,
    )
    return intervals


def verdicts(intervals: list[Interval]) -> list[dict[str, Any]]:
    """The first-versus-last checks, with the thresholds of the docstring above."""
    # A last interval shorter than half the others is too noisy to compare.
    full = [item for item in intervals if item.count * 2 >= intervals[0].count]
    if len(full) < 2:
        return []
    first, last = full[0], full[-1]
    found: list[dict[str, Any]] = []

    def check(name: str, a: float, b: float, bound: float, at_least: bool) -> None:
        ratio = b / a if a else float("inf")
        met = ratio >= bound if at_least else ratio <= bound
        found.append(
            {
                "check": name,
                "first": round(a, 2),
                "last": round(b, 2),
                "ratio": round(ratio, 3),
                "threshold": f"{'>=' if at_least else '<='} {bound}x",
                "met": met,
                "intervals": [first.index, last.index],
            }
        )

    check("ops/s, last vs first interval", first.ops_per_s, last.ops_per_s, OPS_RATIO_MIN, True)
    check(
        "host CPU us/op, last vs first", first.host_cpu_us, last.host_cpu_us, CPU_RATIO_MAX, False
    )
    check(
        "worker CPU us/op, last vs first",
        first.worker_cpu_us,
        last.worker_cpu_us,
        CPU_RATIO_MAX,
        False,
    )
    check(
        "host + worker CPU us/op, last vs first",
        first.total_cpu_us,
        last.total_cpu_us,
        CPU_RATIO_MAX,
        False,
    )
    check(
        "host RSS MB, end vs first interval",
        first.host_rss_mb,
        last.host_rss_mb,
        RSS_RATIO_MAX,
        False,
    )
    check(
        "worker RSS MB, end vs first interval",
        first.worker_rss_mb,
        last.worker_rss_mb,
        RSS_RATIO_MAX,
        False,
    )
    return found


def print_verdicts(found: list[dict[str, Any]], intervals: list[Interval]) -> None:
    if not found:
        print("\n(fewer than two intervals: no first-versus-last ratios)")
        return
    first, last = (intervals[i - 1] for i in found[0]["intervals"])
    print(
        f"\ninterval {first.index} (operations 1-{first.operations:,}) vs interval "
        f"{last.index} ({last.operations - last.count + 1:,}-{last.operations:,}); "
        "one run, no medians"
    )
    for item in found:
        verdict = "met" if item["met"] else "NOT met"
        print(
            f"  {item['check']:<42}{item['first']:>12,.2f}{item['last']:>12,.2f}"
            f"{item['ratio']:>9.3f}x   {item['threshold']:<9}{verdict}"
        )


# Closing many sessions at once ----------------------------------------------------------------


async def close_many(
    root: Path, files: WorkerFiles, worker: WorkerProcess, args: argparse.Namespace
) -> dict[str, Any]:
    count = args.close_sessions
    host = Host(root, files, anchor=args.anchor, reply_timeout=args.reply_timeout)
    await host.start()
    try:
        print(
            f"\nclosing {count:,} sessions at once: opening them, {args.close_ops} operation(s) "
            f"each, {args.in_flight} at a time ...",
            flush=True,
        )
        gate = asyncio.Semaphore(args.in_flight)

        async def prepare() -> HostSession:
            async with gate:
                session = await host.open_session()
                for _ in range(args.close_ops):
                    await host.operation(session)
                return session

        sessions = await asyncio.gather(*(prepare() for _ in range(count)))
        await _octo.wait_idle(worker)
        before = worker.deliveries()
        rss_before = worker.rss_bytes()
        peak_reset = _octo.reset_peak_rss(worker.pid)
        sampled = rss_before
        started = time.perf_counter()
        await asyncio.gather(*(host.close_session(session) for session in sessions))
        published = time.perf_counter() - started
        target = sum(before.values()) + count
        handled: float | None = None
        deadline = started + args.close_timeout
        while time.perf_counter() < deadline:
            sampled = max(sampled, worker.rss_bytes())
            if sum(worker.deliveries().values()) >= target:
                handled = time.perf_counter() - started
                break
            await asyncio.sleep(0.05)
        sampler_stop = asyncio.Event()

        async def sample() -> None:
            nonlocal sampled
            while not sampler_stop.is_set():
                sampled = max(sampled, worker.rss_bytes())
                await asyncio.sleep(0.05)

        sampler = asyncio.ensure_future(sample())
        await _octo.wait_idle(worker, timeout=args.close_timeout)
        sampler_stop.set()
        await sampler
        idle = time.perf_counter() - started
        peak = max(sampled, _octo.peak_rss_bytes(worker.pid) if peak_reset else 0)
        after = worker.deliveries()
        outcomes = {
            outcome: int(after.get(outcome, 0) - before.get(outcome, 0))
            for outcome in sorted(set(after) | set(before))
            if after.get(outcome, 0) != before.get(outcome, 0)
        }
        return {
            "sessions": count,
            "ops_each": args.close_ops,
            "published_s": round(published, 3),
            "handled_s": None if handled is None else round(handled, 3),
            "idle_s": round(idle, 3),
            "rss_before_mb": round(rss_before / MB, 1),
            "peak_rss_mb": round(peak / MB, 1),
            "peak_from": "VmHWM and samples" if peak_reset else "samples every 50 ms",
            "deliveries": outcomes,
        }
    finally:
        await host.close()


def print_close(found: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    handled = found["handled_s"]
    print(
        f"closing {found['sessions']:,} sessions ({found['ops_each']} operation(s) each): "
        f"published in {found['published_s']:.2f} s; worker handled all "
        + (f"in {handled:.2f} s" if handled is not None else f"NOT within {timeout:.0f} s")
        + f", idle again after {found['idle_s']:.2f} s; worker RSS {found['rss_before_mb']:.1f} MB "
        f"before, peak {found['peak_rss_mb']:.1f} MB ({found['peak_from']}); "
        f"deliveries by outcome {found['deliveries']}"
    )
    checks = [
        {
            "check": f"close {found['sessions']:,} sessions: worker peak RSS",
            "value": f"{found['peak_rss_mb']:.1f} MB",
            "threshold": f"< {CLOSE_RSS_MAX_MB:.0f} MB",
            "met": found["peak_rss_mb"] < CLOSE_RSS_MAX_MB,
        },
        {
            "check": f"close {found['sessions']:,} sessions: time until all handled",
            "value": "not finished" if handled is None else f"{handled:.2f} s",
            "threshold": f"< {CLOSE_SECONDS_MAX:.0f} s",
            "met": handled is not None and handled < CLOSE_SECONDS_MAX,
        },
    ]
    for item in checks:
        verdict = "met" if item["met"] else "NOT met"
        print(f"  {item['check']:<50}{item['value']:>14}   {item['threshold']:<9}{verdict}")
    return checks


# Main -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke mode (see above)")
    parser.add_argument("--operations", type=int, help="measured operations (default 100,000)")
    parser.add_argument("--interval", type=int, help="operations per printed row (10,000)")
    parser.add_argument("--in-flight", type=int, help="concurrent lanes (64)")
    parser.add_argument("--ops-per-session", type=int, help="a lane's new session every N (100)")
    parser.add_argument("--warmup", type=int, help="operations before the first interval (1,000)")
    parser.add_argument(
        "--close-sessions", type=int, help="then close N sessions at once (1,000; 0: skip)"
    )
    parser.add_argument("--close-ops", type=int, default=1, help="operations per closed session")
    parser.add_argument(
        "--close-timeout", type=float, default=600.0, help="seconds to wait for the closes"
    )
    parser.add_argument(
        "--max-minutes", type=float, help="stop the long run after this long (default: none)"
    )
    parser.add_argument("--reply-timeout", type=float, default=60.0, help="HostClient's")
    parser.add_argument(
        "--no-anchor", dest="anchor", action="store_false", help="rollback anchors off"
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON document")
    parser.add_argument(
        "--loop",
        choices=_loop.CHOICES,
        default=os.environ.get("OCTO_BENCH_LOOP", "uvloop"),
        help="event loop of both processes (default uvloop, the worker daemon's)",
    )
    args = parser.parse_args(argv)
    chosen = QUICK if args.quick else DEFAULTS
    for name, value in chosen.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.operations < 0 or args.interval < 1 or args.in_flight < 1 or args.warmup < 0:
        parser.error("--operations >= 0, --interval >= 1, --in-flight >= 1, --warmup >= 0")
    if args.ops_per_session < 1 or args.close_sessions < 0 or args.close_ops < 1:
        parser.error("--ops-per-session >= 1, --close-sessions >= 0, --close-ops >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OCTO_BENCH_LOOP"] = args.loop
    _octo.quiet_logs()
    plan = [f"anchors {'on' if args.anchor else 'off'}, loop {args.loop}"]
    if args.operations:
        plan.append(
            f"{args.operations:,} operations (+{args.warmup:,} warm-up) in intervals of "
            f"{args.interval:,}, {args.in_flight} in flight, a new session every "
            f"{args.ops_per_session} operations per lane (old ones closed)"
        )
    if args.close_sessions:
        plan.append(f"then close {args.close_sessions:,} sessions at once")
    print("endurance: " + "; ".join(plan), flush=True)
    document: dict[str, Any] = {"arguments": dict(vars(args))}
    with tempfile.TemporaryDirectory(prefix="octo-endurance-") as tmp:
        root = Path(tmp)
        files = WorkerFiles(
            root / "worker", args.in_flight, anchor=args.anchor, metrics_port=_octo.free_port()
        )
        worker = WorkerProcess(files)
        try:
            if args.operations > 0:
                intervals = _loop.run(long_run(root, files, worker, args))
                found = verdicts(intervals)
                print_verdicts(found, intervals)
                document["intervals"] = [asdict(item) for item in intervals]
                document["checks"] = found
            if args.close_sessions > 0:
                closing = _loop.run(close_many(root, files, worker, args))
                document["close_sessions"] = closing
                document["close_checks"] = print_close(closing, args.close_timeout)
            if not worker.alive():
                raise RuntimeError(f"the worker exited:\n{worker.error_tail()}")
        finally:
            worker.stop()
            _loop.run(_octo.delete_queue(worker_queue(files.scope)))
    if args.json:
        print(json.dumps(document, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
