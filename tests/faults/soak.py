"""Soak the crash scenario: random kill points and counts, by hand.

    .venv/bin/python tests/faults/soak.py --kills 100 [--seed N] [--point P --count N]

Runs the crash-matrix scenario (``tests/faults/conftest.py``) once per kill
with a random point (every point of the matrix: the generic worker points,
``host.after_ledger_commit`` and the compensation points), a random count
(generic points 1-4: the three dispatches and the compensation; compensation
points 1) and a random dispatch pattern, checks the same invariants after
every kill (``check_outcome``), and prints a summary: kills per point, final
states of the logical steps and compensations, the retries, failures, time
per run. The steps' retry policy is on (``conftest.RETRY``): an attempt a
crash cut before its effect is replaced by the next one, so every step must
end ``succeeded`` with exactly one publication over its attempts. A
compensation or operation left ``pending`` or ``running`` after ``recover``
is an invariant failure (``files.publish`` implements the compensation
lookup). Exit status 1 if any run broke an invariant. Needs RabbitMQ on
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

from octo_common.states import TERMINAL_KINDS
from tests.faults.conftest import (
    ALL_POINTS,
    Case,
    Launcher,
    Outcome,
    broker_reachable,
    check_outcome,
    delete_queues,
    play_scenario,
    reaches_per_run,
)

# A run that broke: its case, "run" (the scenario raised) or "invariant", the traceback.
Failure = tuple[Case, str, str]


async def soak(kills: int, seed: int, point: str | None, count: int | None) -> int:
    rng = random.Random(seed)
    cases = []
    for _ in range(kills):
        chosen = point or rng.choice(ALL_POINTS)
        cases.append(
            Case(
                chosen,
                count or rng.randint(1, reaches_per_run(chosen)),
                concurrent=rng.random() < 0.3,
                restart_host=rng.random() < 0.5,
            )
        )
    with tempfile.TemporaryDirectory(prefix="octo-soak-") as tmp:
        root = Path(tmp)
        launcher = Launcher(root / "runners")
        outcomes: list[Outcome] = []
        failures: list[Failure] = []
        started = time.perf_counter()
        try:
            for index, case in enumerate(cases):
                following = cases[index + 1] if index + 1 < len(cases) else None
                if following is not None:
                    launcher.prewarm(following.runner_kind, following.fault)
                try:
                    outcome = await play_scenario(launcher, root / f"run-{index}", case)
                except Exception:
                    failures.append((case, "run", traceback.format_exc(limit=6)))
                    print(f"[{index + 1}/{kills}] {case}: FAILED", flush=True)
                    continue
                outcomes.append(outcome)
                line = (
                    f"[{index + 1}/{kills}] {case}: "
                    f"{'/'.join(s.value for s in outcome.states.values())} "
                    f"cmp={outcome.compensation.value if outcome.compensation else '-'} "
                    f"{outcome.seconds:.2f}s"
                )
                assert outcome.env is not None and outcome.ledger is not None
                try:
                    await check_outcome(outcome.env, outcome, outcome.ledger)
                except Exception:
                    failures.append((case, "invariant", traceback.format_exc(limit=6)))
                    line += " INVARIANT FAILED"
                await delete_queues(outcome.env)
                print(line, flush=True)
        finally:
            launcher.close()
        elapsed = time.perf_counter() - started
    _summary(outcomes, failures, elapsed)
    return 1 if failures else 0


def _summary(
    outcomes: list[Outcome], failures: list[tuple[Case, str, str]], elapsed: float
) -> None:
    print()
    unfinished = sum(1 for _, kind, _ in failures if kind == "run")
    print(
        f"kills: {len(outcomes) + unfinished}  runs finished: {len(outcomes)}  "
        f"runs that raised: {unfinished}  invariant failures: {len(failures) - unfinished}"
    )
    print(f"wall time: {elapsed:.1f} s")
    if outcomes:
        seconds = [o.seconds for o in outcomes]
        print(
            f"per run: median {statistics.median(seconds):.2f} s, "
            f"min {min(seconds):.2f} s, max {max(seconds):.2f} s"
        )
    by_point = Counter(o.case.point for o in outcomes)
    print("kills per point:")
    for point in ALL_POINTS:
        print(f"  {point}: {by_point.get(point, 0)}")
    states = Counter(s.value for o in outcomes for s in o.states.values())
    print("final step states: " + ", ".join(f"{k}={n}" for k, n in sorted(states.items())))
    retries = Counter(
        len(o.ledger.attempts(key)) - 1 for o in outcomes if o.ledger is not None for key in o.keys
    )
    print(
        "retries per logical step: "
        + ", ".join(f"{k} retries={n}" for k, n in sorted(retries.items()))
    )
    compensations = Counter(o.compensation.value if o.compensation else "none" for o in outcomes)
    print(
        "final first-key compensation states: "
        + ", ".join(f"{k}={n}" for k, n in sorted(compensations.items()))
    )
    unsettled = (s for o in outcomes for s in o.states.values() if s not in TERMINAL_KINDS)
    left = Counter(f"operation {s.value}" for s in unsettled) + Counter(
        f"compensation {o.compensation.value}"
        for o in outcomes
        if o.compensation is not None and o.compensation not in TERMINAL_KINDS
    )
    print(
        "left pending/running after recover (each an invariant failure): "
        + (", ".join(f"{k}={n}" for k, n in sorted(left.items())) or "none")
    )
    by_end = Counter(
        (o.case.point, o.compensation.value if o.compensation else "none") for o in outcomes
    )
    print("first-key compensation by kill point:")
    for point in ALL_POINTS:
        ends = {end: n for (p, end), n in sorted(by_end.items()) if p == point}
        print(f"  {point}: " + (", ".join(f"{e}={n}" for e, n in ends.items()) or "-"))
    errors = Counter(o.flow_error for o in outcomes if o.flow_error)
    if errors:
        print("interrupted host calls raised: " + ", ".join(f"{k}={n}" for k, n in errors.items()))
    for case, kind, text in failures:
        print(f"\nFAILED ({kind}) {case}:\n{text}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--point", choices=ALL_POINTS)
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
