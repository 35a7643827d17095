"""Soak the crash scenario: random kill points and counts, by hand.

    .venv/bin/python tests/faults/soak.py --kills 100 [--seed N] [--point P --count N]

Runs the crash-matrix scenario (``tests/faults/conftest.py``) once per kill
with a random point (worker points and ``host.after_ledger_commit``), a
random count (1-4: the three dispatches and the compensation) and a random
dispatch pattern, checks the same invariants after every kill, and prints a
summary: kills per point, final states, compensations, failures, time per
run. Exit status 1 if any run broke an invariant. Needs RabbitMQ on
127.0.0.1:5672.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from octo_common.states import StateKind
from tests.faults.conftest import (
    HOST_POINT,
    REQUESTS_PER_RUN,
    WORKER_POINTS,
    Case,
    Launcher,
    Outcome,
    broker_reachable,
    run_scenario,
)


async def soak(kills: int, seed: int, point: str | None, count: int | None) -> int:
    rng = random.Random(seed)
    points = [*WORKER_POINTS, HOST_POINT]
    cases = [
        Case(
            point or rng.choice(points),
            count or rng.randint(1, REQUESTS_PER_RUN),
            concurrent=rng.random() < 0.3,
            restart_host=rng.random() < 0.5,
        )
        for _ in range(kills)
    ]
    with tempfile.TemporaryDirectory(prefix="octo-soak-") as tmp:
        root = Path(tmp)
        launcher = Launcher(root / "runners")
        outcomes: list[Outcome] = []
        failures: list[tuple[Case, str]] = []
        started = time.perf_counter()
        try:
            for index, case in enumerate(cases):
                following = cases[index + 1] if index + 1 < len(cases) else None
                if following is not None:
                    kind = "host" if following.point == HOST_POINT else "worker"
                    launcher.prewarm(kind, following.fault)
                try:
                    outcome = await run_scenario(launcher, root / f"run-{index}", case)
                except Exception:
                    failures.append((case, traceback.format_exc(limit=6)))
                    print(f"[{index + 1}/{kills}] {case}: FAILED", flush=True)
                    continue
                outcomes.append(outcome)
                print(
                    f"[{index + 1}/{kills}] {case}: "
                    f"{'/'.join(s.value for s in outcome.states.values())} "
                    f"cmp={outcome.compensation.value if outcome.compensation else '-'} "
                    f"{outcome.seconds:.2f}s",
                    flush=True,
                )
        finally:
            launcher.close()
        elapsed = time.perf_counter() - started
    _summary(outcomes, failures, elapsed)
    return 1 if failures else 0


def _summary(outcomes: list[Outcome], failures: list[tuple[Case, str]], elapsed: float) -> None:
    print()
    print(f"kills: {len(outcomes) + len(failures)}  ok: {len(outcomes)}  failed: {len(failures)}")
    print(f"wall time: {elapsed:.1f} s")
    if outcomes:
        seconds = [o.seconds for o in outcomes]
        print(
            f"per run: median {statistics.median(seconds):.2f} s, "
            f"min {min(seconds):.2f} s, max {max(seconds):.2f} s"
        )
    by_point = Counter(o.case.point for o in outcomes)
    print("kills per point: " + ", ".join(f"{p}={n}" for p, n in sorted(by_point.items())))
    states = Counter(s.value for o in outcomes for s in o.states.values())
    print("final operation states: " + ", ".join(f"{k}={n}" for k, n in sorted(states.items())))
    compensations = Counter(o.compensation.value if o.compensation else "none" for o in outcomes)
    print("first-key compensations: " + ", ".join(f"{k}={n}" for k, n in compensations.items()))
    stuck = Counter(o.case.point for o in outcomes if o.compensation == StateKind.PENDING)
    if stuck:
        print(
            "compensations left pending (admitted, outcome unknown), by kill point: "
            + ", ".join(f"{p}={n}" for p, n in sorted(stuck.items()))
        )
    errors = Counter(o.flow_error for o in outcomes if o.flow_error)
    if errors:
        print("interrupted host calls raised: " + ", ".join(f"{k}={n}" for k, n in errors.items()))
    for case, text in failures:
        print(f"\nFAILED {case}:\n{text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--point", choices=[*WORKER_POINTS, HOST_POINT])
    parser.add_argument("--count", type=int)
    args = parser.parse_args()
    if not broker_reachable():
        print("RabbitMQ is not reachable on 127.0.0.1:5672", file=sys.stderr)
        return 2
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"seed {seed}")
    return asyncio.run(soak(args.kills, seed, args.point, args.count))


if __name__ == "__main__":
    sys.exit(main())
