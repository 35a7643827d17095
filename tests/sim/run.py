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
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.sim.loop import Stuck, new_loop
from tests.sim.sim import Sim, Violation, quiet_logs

BLOCK = 1000  # schedules per progress line (and per task of a pool)


@dataclass
class RangeResult:
    """What a range of schedules did: how many ran, the failures (each with its seed
    and history), and where the worker processes died (``Boundaries.deaths``)."""

    done: int = 0
    failures: list[str] = field(default_factory=list)
    deaths: Counter[str] = field(default_factory=Counter)
    cpu: float = 0.0  # CPU seconds of the process(es) that ran them

    def add(self, other: RangeResult) -> None:
        self.done += other.done
        self.failures += other.failures
        self.deaths += other.deaths
        self.cpu += other.cpu


def _run_range(first: int, count: int) -> RangeResult:
    result = RangeResult()
    cpu = time.process_time()
    failures = result.failures
    # A memory file system where there is one: the journal's fsyncs cost nothing there.
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() else None
    runner = asyncio.Runner(loop_factory=new_loop)
    with tempfile.TemporaryDirectory(prefix="octo-sim-", dir=base) as tmp:
        for seed in range(first, first + count):
            directory = Path(tmp) / str(seed)
            directory.mkdir()
            sim = Sim(seed, directory)
            try:
                runner.run(sim.run())
            except Violation as exc:
                failures.append(str(exc))
            except Exception as exc:  # a schedule the sim could not finish is a finding too
                failures.append(sim.report(f"{type(exc).__name__}: {exc}"))
                if isinstance(exc, Stuck):  # its loop still holds the stuck tasks
                    runner = asyncio.Runner(loop_factory=new_loop)
            shutil.rmtree(directory)
            result.done += 1
            result.deaths += sim.boundaries.deaths
    runner.close()
    result.cpu = time.process_time() - cpu
    return result


def run_range(first: int, count: int) -> RangeResult:
    """Schedules ``first`` .. ``first + count - 1`` in this process."""
    with quiet_logs():
        return _run_range(first, count)


def _block(block: tuple[int, int]) -> RangeResult:
    return run_range(*block)


def run_blocks(
    first: int, count: int, *, processes: int = 1, block: int = BLOCK
) -> Iterator[RangeResult]:
    """Schedules ``first`` .. ``first + count - 1`` in blocks of ``block``, on a pool of
    ``processes`` (spawned) when more than one; each block's result as it ends."""
    blocks = [
        (start, min(block, first + count - start)) for start in range(first, first + count, block)
    ]
    if processes <= 1:
        yield from map(_block, blocks)
        return
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        yield from pool.imap(_block, blocks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--first", type=int, default=None, help="the first seed")
    parser.add_argument("--seed", type=int, default=None, help="replay one schedule")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--block", type=int, default=BLOCK, help="schedules per progress line")
    args = parser.parse_args(argv)
    if args.seed is not None:
        result = run_range(args.seed, 1)
        for failure in result.failures:
            print(failure)
        if not result.failures:
            print("\n  ".join([f"seed {args.seed} kept the invariants; deaths:", *_places(result)]))
    else:
        first = secrets.randbits(40) if args.first is None else args.first
        print(f"seeds {first} .. {first + args.schedules - 1}", flush=True)
        started = time.perf_counter()
        result = RangeResult()
        for block in run_blocks(first, args.schedules, processes=args.processes, block=args.block):
            result.add(block)
            for failure in block.failures:
                print(failure, flush=True)
            seconds = time.perf_counter() - started
            print(
                f"{result.done} schedules in {seconds:.0f} s ({result.done / seconds:.1f}/s; "
                f"{result.cpu / result.done * 1000:.1f} ms of CPU each), "
                f"{sum(result.deaths.values())} worker deaths, {len(result.failures)} failing",
                flush=True,
            )
        print("\n  ".join(["deaths by where they fell:", *_places(result)]))
    print(f"{len(result.failures)} failing schedule(s)")
    return 1 if result.failures else 0


def _places(result: RangeResult) -> list[str]:
    return [f"{count:>8} {place}" for place, count in sorted(result.deaths.items())]


if __name__ == "__main__":
    sys.exit(main())
