"""The deterministic simulation in make test: a fixed range of seeds (so a failure
replays with ``python -m tests.sim.run --seed N``), each schedule checked against
the model's invariants (``tests/sim/sim.py``); ``make simulate`` runs long
random ranges."""

from __future__ import annotations

import pytest

from .run import run_range

pytestmark = pytest.mark.slow

FIRST_SEED = 1
SCHEDULES = 500


def test_every_schedule_of_the_fixed_seeds_keeps_the_invariants() -> None:
    done, failures = run_range(FIRST_SEED, SCHEDULES)
    assert done == SCHEDULES
    assert not failures, "\n\n".join(failures[:3])


def test_a_schedule_without_faults_ends_with_every_key_settled() -> None:
    # The settled part alone, as a baseline the checker must pass without faults.
    import asyncio
    import tempfile
    from pathlib import Path

    from .sim import KEYS, quiet_logs, run_schedule

    async def run() -> None:
        with tempfile.TemporaryDirectory(prefix="octo-sim-") as tmp:
            sim = await run_schedule(7, Path(tmp), faults=False)
        assert len(sim.keys) == KEYS
        assert sum(sim.adapter.calls.values()) == KEYS
        assert sim.budget == {}

    with quiet_logs():
        asyncio.run(run())
