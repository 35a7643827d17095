"""Run simulation schedules (``make simulate``; ``tests/sim/sim.py``).

    python -m tests.sim.run --schedules 100000 --processes 2   # long runs
    python -m tests.sim.run --seed 1234                        # replay one schedule

Seeds run from ``--first`` upwards (``--first`` defaults to a random start,
printed); a failing seed is printed with its history and replays exactly with
``--seed``. Each process keeps one temporary directory per schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import secrets
import sys
import tempfile
import time
from pathlib import Path

from tests.sim.sim import Violation, quiet_logs, run_schedule


async def _run_range(first: int, count: int) -> tuple[int, list[str]]:
    failures: list[str] = []
    done = 0
    # A memory file system where there is one: the journal's fsyncs cost nothing there.
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() else None
    with tempfile.TemporaryDirectory(prefix="octo-sim-", dir=base) as tmp:
        for seed in range(first, first + count):
            directory = Path(tmp) / str(seed)
            directory.mkdir()
            try:
                await run_schedule(seed, directory)
            except Violation as exc:
                failures.append(str(exc))
            done += 1
    return done, failures


def run_range(first: int, count: int) -> tuple[int, list[str]]:
    """Schedules ``first`` .. ``first + count - 1`` in this process."""
    with quiet_logs():
        return asyncio.run(_run_range(first, count))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--first", type=int, default=None, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay one schedule")
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args(argv)
    if args.seed is not None:
        done, failures = run_range(args.seed, 1)
    else:
        first = secrets.randbits(40) if args.first is None else args.first
        print(f"seeds {first} .. {first + args.schedules - 1}", flush=True)
        started = time.perf_counter()
        chunks = max(1, args.processes)
        size = -(-args.schedules // chunks)
        ranges = [(first + i * size, min(size, args.schedules - i * size)) for i in range(chunks)]
        ranges = [r for r in ranges if r[1] > 0]
        if chunks == 1:
            results = [run_range(*ranges[0])]
        else:
            with multiprocessing.get_context("spawn").Pool(chunks) as pool:
                results = pool.starmap(run_range, ranges)
        done = sum(r[0] for r in results)
        failures = [f for r in results for f in r[1]]
        seconds = time.perf_counter() - started
        print(f"{done} schedules in {seconds:.1f} s ({done / seconds:.1f}/s)")
    for failure in failures:
        print(failure)
    print(f"{len(failures)} failing schedule(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
