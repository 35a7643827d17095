"""OCTO_FAULT kills a real process with SIGKILL at the n-th time it reaches the point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys
from octo_common.runtime.faults import FaultInjector
faults = FaultInjector()
for n in range(1, 4):
    faults.reach("worker.after_ack")
    print(f"reached worker.after_ack {n}", flush=True)
    faults.reach("host.after_ledger_commit", settle=0.01)
    print(f"reached host.after_ledger_commit {n}", flush=True)
"""


def run(spec: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "OCTO_FAULT"}
    if spec is not None:
        env["OCTO_FAULT"] = spec
    return subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.mark.parametrize(
    ("spec", "last_line"),
    [
        ("host.after_ledger_commit@2", "reached worker.after_ack 2"),
        ("worker.after_ack", None),
        ("worker.after_ack@3", "reached host.after_ledger_commit 2"),
    ],
)
def test_the_process_dies_at_the_chosen_reach(spec: str, last_line: str | None) -> None:
    result = run(spec)
    assert result.returncode == -signal.SIGKILL
    lines = result.stdout.splitlines()
    assert (lines[-1] if lines else None) == last_line
    assert f"fault injection: SIGKILL at {spec.partition('@')[0]}" in result.stderr


def test_without_the_variable_the_process_runs_to_the_end() -> None:
    result = run(None)
    assert result.returncode == 0
    assert result.stdout.splitlines()[-1] == "reached host.after_ledger_commit 3"
