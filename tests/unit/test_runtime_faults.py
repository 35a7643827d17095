"""Parsing of OCTO_FAULT and the points that never fire (no process is killed here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from octo_common.runtime.faults import FAULT_POINTS, FaultInjector


def test_the_points_cover_worker_and_host() -> None:
    assert "host.after_ledger_commit" in FAULT_POINTS
    assert {point.split(".")[0] for point in FAULT_POINTS} == {"worker", "host"}


@pytest.mark.parametrize("spec", [None, ""])
def test_without_a_spec_nothing_is_armed(spec: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OCTO_FAULT", raising=False)
    faults = FaultInjector(spec)
    assert not faults.active
    for point in FAULT_POINTS:
        faults.reach(point)  # would kill this test run if anything were armed


@pytest.mark.parametrize("spec", ["worker.nowhere", "worker.after_ack@x", "worker.after_ack@-1"])
def test_a_malformed_spec_is_ignored_with_a_warning(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    faults = FaultInjector(spec)
    assert not faults.active
    assert "ignoring unknown OCTO_FAULT value" in capsys.readouterr().err


def test_an_armed_point_ignores_every_other_point(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OCTO_FAULT", "worker.after_reply@3")
    faults = FaultInjector()
    assert faults.active
    for point in FAULT_POINTS - {"worker.after_reply"}:
        faults.reach(point)
    faults.reach("worker.after_reply")  # 1 of 3
    faults.reach("worker.after_reply")  # 2 of 3: still alive


def test_reach_flushed_lets_the_loop_run_then_kills(tmp_path: Path) -> None:
    # An armed reach_flushed lets callbacks already scheduled run (a queued ack
    # is written), then dies by SIGKILL; any other point returns at once.
    script = tmp_path / "flushed.py"
    script.write_text(
        "import asyncio, sys\n"
        "from octo_common.runtime.faults import FaultInjector\n"
        "async def main():\n"
        "    faults = FaultInjector()\n"
        "    await faults.reach_flushed('host.after_ledger_commit')\n"
        "    asyncio.get_running_loop().call_soon(lambda: print('flushed', flush=True))\n"
        "    await faults.reach_flushed('host.after_reply_applied', settle=0.05)\n"
        "    print('survived', flush=True)\n"
        "asyncio.run(main())\n",
        encoding="utf-8",
    )
    env = {**os.environ, "OCTO_FAULT": "host.after_reply_applied"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert done.stdout.split() == ["flushed"]
    assert "SIGKILL at host.after_reply_applied" in done.stderr
