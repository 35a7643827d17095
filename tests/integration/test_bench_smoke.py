"""``bench/endurance.py`` at its smallest: the benchmark scripts still run against the code.

The endurance script drives both of Octo's processes through their public
entry points (the worker daemon in its own process, ``HostClient``,
``SqliteLedgerStore`` with its anchor, the worker's metrics endpoint), the
same set-up ``bench/e2e.py`` shares. This runs it with a few dozen
operations on the real broker and checks that every part of its report
comes out; it asserts no figure (a benchmark's verdicts are not a test).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ENDURANCE = Path(__file__).resolve().parents[2] / "bench" / "endurance.py"


def broker_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.skipif(not broker_answers(), reason="RabbitMQ is not reachable on 127.0.0.1:5672"),
]


def test_endurance_smallest_run_reports_every_part() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ENDURANCE),
            "--quick",
            *("--operations", "48", "--interval", "24", "--warmup", "8"),
            *("--in-flight", "4", "--ops-per-session", "5", "--close-sessions", "5"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    report = json.loads(lines[-1])
    intervals = report["intervals"]
    assert [item["operations"] for item in intervals] == [24, 48]
    assert all(item["ops_per_s"] > 0 and item["worker_rss_mb"] > 0 for item in intervals)
    # Lanes rotate their sessions and close the old ones: each lane holds one open
    # session, two while it rotates (the new one is opened before the old one closes).
    opened, closed = intervals[-1]["sessions_opened"], intervals[-1]["sessions_closed"]
    assert opened >= -(-56 // 5)  # 56 operations, at most 5 per session
    assert 4 <= opened - closed <= 8
    assert {check["check"] for check in report["checks"]} >= {
        "ops/s, last vs first interval",
        "host RSS MB, end vs first interval",
        "worker RSS MB, end vs first interval",
    }
    assert all(isinstance(check["met"], bool) for check in report["checks"])
    closing = report["close_sessions"]
    assert closing["sessions"] == 5
    assert closing["handled_s"] is not None  # the worker's counters saw every close
    assert closing["deliveries"].get("acked") == 5


def test_every_host_stage_bench_e2e_times_is_a_method_of_the_client() -> None:
    # bench/e2e.py --stages wraps these by name; a moved method would stop the run.
    from bench.e2e import host_stages

    stages = host_stages()
    assert len(stages) >= 10
    for owner, name, _ in stages:
        assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name}"


def test_every_worker_stage_the_e2e_peer_times_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench/_e2e_peer.py --stages wraps these by name in the worker's process; a
    # moved or removed one would stop the profiled pass of bench/e2e.py. The
    # script imports its siblings (``_loop``) from its own folder, as when run.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    from bench._e2e_peer import StageTimers, instrument_worker

    wrapped: list[str] = []

    class Checking(StageTimers):
        def wrap(self, owner: Any, name: str, label: str) -> None:
            assert callable(getattr(owner, name, None)), f"{owner.__name__}.{name}"
            wrapped.append(label)

    instrument_worker(Checking())
    assert len(wrapped) >= 10 and "input_fingerprint" in wrapped
