"""Host ledger commit cost against the number of records, rollback anchor on.

    .venv/bin/python bench/anchor.py [--records 1000 100000] [--commits 100] [--rounds 3]
                                     [--payload-bytes 1024] [--batch 1000] [--no-baseline]
                                     [--dir DIR] [--json]

    smoke run (seconds, no figures): --records 100 2000 --commits 30 --rounds 1

For each ``--records`` count, one ``SqliteLedgerStore`` database with that
many records is built through the store itself (``create`` in concurrent
batches of ``--batch``, so the store head's digest covers every record)
with its rollback anchor on. Then, in ``--rounds`` interleaved rounds, each database is opened
with its anchor and ``--commits`` single-caller commits are timed: a
``replace`` of one of 100 records in turn (a ledger compare-and-swap,
exactly what the host does per ledger write), wall-clock latency and CPU
time of this process (all threads, the store's SQLite thread included).
The same database is then opened without the anchor and measured again
(the baseline: what a commit costs without the anchor; ``--no-baseline``
skips it).

Printed per size: commit p50 / p99 latency, CPU per commit, the open (the
first load: anchor check and the digest recomputed over every record) and
the anchor file's size, medians over the rounds; then the ratios of the largest
database to the smallest against the threshold (host commit cost
with the anchor on at 1e5 records within 1.2x of 1e3, same run), for the
latency p50 and for the CPU per commit, each met / NOT met.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _loop
import _octo

from octo_common.records import StorageKeyring
from octo_host.store import SqliteLedgerStore, ledger_record_key

RATIO_MAX = 1.2
TOUCHED = 100  # records the timed commits rotate over


async def build(
    path: Path, anchor: Path, keyring: StorageKeyring, records: int, batch: int, payload: bytes
) -> dict[str, int]:
    """A ledger database of ``records`` records at revision 1, anchor on."""
    _octo.write_private(anchor, _octo.EMPTY_ANCHOR)
    store = SqliteLedgerStore(path, keyring, anchor_path=anchor)
    try:
        step = max(records // 10, batch)
        for start in range(0, records, batch):
            stop = min(start + batch, records)
            await asyncio.gather(
                *(store.create(ledger_record_key(f"r{i}"), payload) for i in range(start, stop))
            )
            if records >= 10_000 and stop % step < batch:
                print(f"  built {stop:>9,} / {records:,} records", flush=True)
    finally:
        await store.close()
    return {f"r{i}": 1 for i in range(min(TOUCHED, records))}


async def measure(
    path: Path,
    anchor: Path | None,
    keyring: StorageKeyring,
    commits: int,
    revisions: dict[str, int],
    payload: bytes,
) -> dict[str, float]:
    """p50 / p99 latency and CPU per commit of ``commits`` replaces, one caller; the open."""
    store = SqliteLedgerStore(path, keyring, anchor_path=anchor)
    names = list(revisions)
    latencies: list[float] = []
    try:
        opened = time.perf_counter()
        await store.load(ledger_record_key(names[0]))  # opens the database, checks the anchor
        opened = time.perf_counter() - opened
        cpu = time.process_time()
        for index in range(commits):
            name = names[index % len(names)]
            started = time.perf_counter()
            written = await store.replace(ledger_record_key(name), revisions[name], payload)
            latencies.append(time.perf_counter() - started)
            revisions[name] = written.revision
        cpu = time.process_time() - cpu
    finally:
        await store.close()
    ordered = sorted(latencies)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[max(int(len(ordered) * 0.99) - 1, 0)] * 1000,
        "cpu_ms": cpu / commits * 1000,
        "open_ms": opened * 1000,
    }


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    keyring = StorageKeyring("host-k1", secrets.token_bytes(32))
    payload = os.urandom(args.payload_bytes // 2).hex().encode()
    sizes = sorted(set(args.records))
    databases: dict[int, tuple[Path, Path, dict[str, int]]] = {}
    for size in sizes:
        path, anchor = root / f"ledger-{size}.sqlite3", root / f"ledger-{size}.anchor"
        print(f"building a ledger of {size:,} records (anchor on) ...", flush=True)
        started = time.perf_counter()
        revisions = await build(path, anchor, keyring, size, args.batch, payload)
        print(
            f"  built in {time.perf_counter() - started:.1f} s; database "
            f"{path.stat().st_size / _octo.MB:.1f} MB, anchor {anchor.stat().st_size:,} bytes",
            flush=True,
        )
        databases[size] = (path, anchor, revisions)
    modes = ["anchor"] + ([] if args.no_baseline else ["none"])
    found: dict[str, list[dict[str, float]]] = {}
    for round_number in range(args.rounds):
        line = [f"round {round_number + 1}:"]
        for size in sizes:
            path, anchor, revisions = databases[size]
            for mode in modes:
                figures = await measure(
                    path,
                    anchor if mode == "anchor" else None,
                    keyring,
                    args.commits,
                    revisions,
                    payload,
                )
                found.setdefault(f"{mode}@{size}", []).append(figures)
                line.append(f"{mode}@{size:,} p50 {figures['p50_ms']:.2f} ms")
        print("  ".join(line), flush=True)
    medians = {
        key: {field: statistics.median(r[field] for r in runs) for field in runs[0]}
        for key, runs in found.items()
    }
    print(f"\nmedians of {args.rounds} round(s), {args.commits} commits each, one caller")
    print(
        f"{'records':>10}  {'anchor':<7}{'p50 ms':>9}{'p99 ms':>9}{'CPU ms/commit':>15}"
        f"{'open ms':>10}"
    )
    for size in sizes:
        for mode in modes:
            m = medians[f"{mode}@{size}"]
            print(
                f"{size:>10,}  {'on' if mode == 'anchor' else 'off':<7}{m['p50_ms']:>9.2f}"
                f"{m['p99_ms']:>9.2f}{m['cpu_ms']:>15.3f}{m['open_ms']:>10.1f}"
            )
    for size in sizes:
        anchor_file = databases[size][1]
        print(f"anchor file at {size:,} records: {anchor_file.stat().st_size:,} bytes")
    checks: list[dict[str, Any]] = []
    if len(sizes) >= 2:
        small, big = sizes[0], sizes[-1]
        print(f"\nhost commit cost with the anchor on, {big:,} vs {small:,} records")
        for field, label in (("p50_ms", "commit latency p50"), ("cpu_ms", "CPU per commit")):
            a, b = medians[f"anchor@{small}"][field], medians[f"anchor@{big}"][field]
            ratio = b / a if a else float("inf")
            met = ratio <= RATIO_MAX
            checks.append({"check": label, "small": a, "big": b, "ratio": ratio, "met": met})
            print(
                f"  {label:<22}{a:>9.3f} ms -> {b:>9.3f} ms  {ratio:6.2f}x   <= {RATIO_MAX}x   "
                f"{'met' if met else 'NOT met'}"
            )
    return {"medians": medians, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--commits", type=int, default=100, help="timed commits per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--payload-bytes", type=int, default=1024, help="bytes per record")
    parser.add_argument("--batch", type=int, default=1000, help="concurrent creates when building")
    parser.add_argument("--no-baseline", action="store_true", help="skip the anchor-off runs")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the databases")
    parser.add_argument("--json", action="store_true", help="also print one JSON document")
    parser.add_argument(
        "--loop",
        choices=_loop.CHOICES,
        default=os.environ.get("OCTO_BENCH_LOOP", "uvloop"),
        help="event loop (default uvloop)",
    )
    args = parser.parse_args(argv)
    if min(args.records) < 1 or args.commits < 1 or args.rounds < 1 or args.batch < 1:
        parser.error("--records, --commits, --rounds and --batch must be >= 1")
    os.environ["OCTO_BENCH_LOOP"] = args.loop
    _octo.quiet_logs()
    root = Path(tempfile.mkdtemp(prefix="octo-anchor-", dir=args.dir))
    print(
        f"host ledger commit cost, anchor on (and off as the baseline) in {root}; "
        f"records {', '.join(f'{n:,}' for n in sorted(set(args.records)))}; loop {args.loop}",
        flush=True,
    )
    try:
        document = _loop.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(document, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
