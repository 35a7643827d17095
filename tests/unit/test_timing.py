"""The waits of the tests scale with the machine (tests/timing.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.timing import MAX_FACTOR, machine_factor, scaled

REPO = Path(__file__).resolve().parents[2]


def test_a_bound_never_shrinks_and_stays_bounded() -> None:
    assert 1.0 <= machine_factor() <= MAX_FACTOR
    assert scaled(60.0) == 60.0 * machine_factor() >= 60.0


def _factor_with(value: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", "from tests.timing import machine_factor; print(machine_factor())"],
        cwd=REPO,
        env={"OCTO_TEST_TIME_SCALE": value, "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(done.stdout)


def test_the_factor_can_be_set_and_is_clamped() -> None:
    assert _factor_with("3") == 3.0
    assert _factor_with("0.1") == 1.0
    assert _factor_with("1000") == MAX_FACTOR
