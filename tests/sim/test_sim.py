"""The deterministic simulation in make test: a fixed range of seeds (so a failure
replays with ``python -m tests.sim.run --seed N``), each schedule checked against
the model's invariants (``tests/sim/sim.py``); ``make simulate`` runs long
random ranges."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from .fingerprint import fingerprints
from .loop import new_loop
from .run import RangeResult, run_blocks
from .sim import COMPENSATION_KILL_POINTS, KEYS, KILL_POINTS, Sim, quiet_logs
from .world import PLACES

pytestmark = pytest.mark.slow

FIRST_SEED = 1
SCHEDULES = 2000
PROCESSES = 2  # two halves side by side (a schedule costs about 15 ms of CPU)


def test_every_schedule_of_the_fixed_seeds_keeps_the_invariants() -> None:
    result = RangeResult()
    for block in run_blocks(FIRST_SEED, SCHEDULES, processes=PROCESSES, block=SCHEDULES // 2):
        result.add(block)
    assert result.done == SCHEDULES
    assert not result.failures, "\n\n".join(result.failures[:3])
    # The deaths fell at every kind of boundary and at every kill point.
    for place in [*PLACES, *KILL_POINTS, *COMPENSATION_KILL_POINTS, "between steps"]:
        assert result.deaths[place] > 0, (place, result.deaths)


def run_one(seed: int, *, faults: bool = True) -> Sim:
    with quiet_logs(), tempfile.TemporaryDirectory(prefix="octo-sim-") as tmp:
        sim = Sim(seed, Path(tmp), faults=faults)
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(sim.run())
    return sim


def test_a_schedule_without_faults_ends_with_every_key_settled() -> None:
    # The settled part alone, as a baseline the checker must pass without faults.
    sim = run_one(7, faults=False)
    assert len(sim.keys) == KEYS
    assert sum(sim.external.calls.values()) == KEYS
    assert sim.budget == {}
    assert not sim.boundaries.deaths


def test_a_seed_replays_the_same_schedule() -> None:
    # What `python -m tests.sim.run --seed N` relies on: one seed, one history.
    first, again = run_one(11), run_one(11)
    assert first.boundaries.deaths, "seed 11 kills the worker"
    assert first.history == again.history
    assert first.boundaries.deaths == again.boundaries.deaths
    assert first.external.calls == again.external.calls


def test_a_fingerprint_is_the_same_for_a_replay_and_tells_seeds_apart() -> None:
    # What `python -m tests.sim.fingerprint --compare` relies on to show that a change
    # to the simulation's machinery leaves every seed's schedule as it was.
    first, again, other = (list(fingerprints(seed, 1)) for seed in (11, 11, 12))
    assert first == again
    assert first[0][1] != other[0][1]
