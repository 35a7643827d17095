"""The SIGKILL crash matrix: every kill point, five runs each, real processes.

For each run the armed process (the worker runner, or the host runner for
``host.*`` points) kills itself at the chosen point and count;
the worker restarts without the fault on the same files; the host recovers
the run; and :func:`check_outcome` (see ``conftest.py``) asserts that every
key is terminal, every succeeded key has exactly one publish line in the effect
log (none otherwise), every compensation is terminal (a compensation lookup)
and none happened twice, and the journal and the ledger agree. For the
generic points counts 1-3 land on the dispatches, count 4 on the compensation
of the first key; the compensation points (after the host recorded the
compensation intent, after the worker committed its admission, after the
adapter's inverse effect) are reached once per run, at count 1. The fifth
run dispatches all keys at once. For worker faults, runs 1 and 3
also abandon the host's interrupted call and recover with a new
``HostClient`` (a host restart); the others let the same client's timeouts
lead to reconciliation and then call ``recover``.

The same matrix runs with the worker's journal in PostgreSQL, two runs
per point instead of five (``POSTGRES_RUNS``) to keep the suite short; each
such run has a schema of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from octo_common.states import StateKind
from tests.postgres import PostgresSchema

from .conftest import ALL_POINTS, Case, Launcher, Outcome, reaches_per_run, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

COUNTS = (1, 2, 3, 4, 2)
# The PostgreSQL variant runs two of the five per point, to keep the suite's
# time down: count 2 with a host restart, and all keys dispatched at once.
POSTGRES_RUNS = (1, 4)
# How the first key's compensation ends after a kill at a compensation point:
# an admitted compensation is never run again, so one killed before
# its inverse effect is settled by the lookup as not performed; one killed
# after it, as performed; one the worker never saw is sent again.
COMPENSATION_ENDS = {
    "worker.after_compensation_admission_commit": StateKind.FAILED,
    "worker.after_compensation_effect": StateKind.SUCCEEDED,
    "host.after_compensation_intent": StateKind.SUCCEEDED,
}


def case_for(point: str, run: int) -> Case:
    count = COUNTS[run] if reaches_per_run(point) > 1 else 1
    return Case(point, count, concurrent=run == len(COUNTS) - 1, restart_host=run % 2 == 1)


CASES = [(point, run) for point in ALL_POINTS for run in range(len(COUNTS))]


def _next_case(point: str, run: int) -> Case | None:
    index = CASES.index((point, run)) + 1
    return case_for(*CASES[index]) if index < len(CASES) else None


@pytest.mark.parametrize("run", range(len(COUNTS)))
@pytest.mark.parametrize("point", ALL_POINTS)
async def test_sigkill_at_every_point_leaves_every_key_known_and_effects_single(
    launcher: Launcher, tmp_path: Path, point: str, run: int
) -> None:
    case = case_for(point, run)
    following = _next_case(point, run)
    if following is not None:
        # Start the next run's armed interpreter while this one runs.
        launcher.prewarm(following.runner_kind, following.fault)

    outcome = await run_scenario(launcher, tmp_path, case)
    check_case(point, outcome)


@pytest.mark.parametrize("run", POSTGRES_RUNS)
@pytest.mark.parametrize("point", ALL_POINTS)
async def test_the_matrix_on_a_postgresql_journal(
    launcher: Launcher, tmp_path: Path, postgres_schema: PostgresSchema, point: str, run: int
) -> None:
    # The same scenario and checks with the worker's journal in PostgreSQL:
    # the restarted worker is a standby until the broker's first delivery.
    case = case_for(point, run)
    launcher.prewarm(case.runner_kind, case.fault)

    outcome = await run_scenario(launcher, tmp_path, case, postgres=postgres_schema)
    check_case(point, outcome)


def check_case(point: str, outcome: Outcome) -> None:
    """What a run of ``point`` must end with besides :func:`check_outcome`'s invariants."""
    assert len(outcome.keys) == 3
    if point in COMPENSATION_ENDS:
        assert set(outcome.states.values()) == {StateKind.SUCCEEDED}, outcome.states
        assert outcome.compensation == COMPENSATION_ENDS[point], outcome.compensation
