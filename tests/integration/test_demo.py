"""``make demo`` end to end: ``demo/demo.py`` as a subprocess on the real broker.

The script starts its own worker daemon, so these tests run it exactly as
``make demo`` does (same interpreter) and read only its output, exit status
and the files it leaves with ``--keep``. One test imports the script to show
that a daemon that cannot start fails step 1 with the daemon's own words.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

DEMO = Path(__file__).resolve().parents[2] / "demo" / "demo.py"
STEPS = 6
HEADER_DIR = re.compile(r"private dir (\S+) \(0700\)")


def broker_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


needs_broker = pytest.mark.skipif(
    not broker_answers(), reason="RabbitMQ is not reachable on 127.0.0.1:5672"
)


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def step_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"\[\d/\d\] ", line)]


def private_dir(stdout: str) -> Path:
    found = HEADER_DIR.search(stdout)
    assert found is not None, stdout
    return Path(found.group(1))


def load_demo_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("octo_demo_script", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and annotations resolve through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.rabbitmq
@needs_broker
def test_demo_passes_every_step_and_cleans_up() -> None:
    done = run_demo()

    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stdout
    lines = step_lines(done.stdout)
    assert [line[:5] for line in lines] == [f"[{n}/{STEPS}]" for n in range(1, STEPS + 1)]
    up, publish, again, compensate, second, stop = lines
    assert "READY=1" in up and "topology declared" in up
    assert "-> succeeded" in publish and "file present" in publish
    assert publish.endswith("effect log: 1 publish")
    assert "published twice" in again and "unchanged" in again
    assert again.endswith("effect log: 1 publish")
    assert "-> succeeded" in compensate and "file gone" in compensate
    assert compensate.endswith("effect log: 1 publish + 1 remove")
    assert "compensation_already_recorded" in second
    assert "request_rejected compensation_budget_exhausted (same session)" in second
    assert "compensation_identity_mismatch (fresh session)" in second
    assert second.endswith("effect log: 1 publish + 1 remove")
    assert "STOPPING=1, exited 0" in stop
    assert done.stdout.splitlines()[-1].startswith(f"OK: all {STEPS} steps matched")
    # The private directory (keys included) is gone.
    assert not private_dir(done.stdout).exists()


@pytest.mark.rabbitmq
@needs_broker
def test_keep_leaves_private_keys_journal_and_effect_log() -> None:
    done = run_demo("--keep")
    root = private_dir(done.stdout)
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        keys = sorted((root / "keys").iterdir())
        assert [key.name for key in keys] == [
            "host-ledger.key",
            "scope.key",
            "worker-storage.key",
        ]
        for key in keys:
            assert stat.S_IMODE(key.stat().st_mode) == 0o600
            # A key never appears in the demo's output.
            secret = key.read_text().strip()
            assert secret not in done.stdout and secret not in done.stderr
        assert (root / "worker" / "journal.sqlite3").is_file()
        assert (root / "host" / "ledger.sqlite3").is_file()
        effects = (root / "worker" / "effects.log").read_text().splitlines()
        assert [json.loads(line)["effect"] for line in effects] == ["publish", "remove"]
        published = root / "worker" / "published"
        assert published.is_dir()
        assert list(published.rglob("release-42.txt")) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.rabbitmq
@needs_broker
def test_sigterm_during_the_host_steps_stops_the_daemon_and_cleans_up() -> None:
    process = subprocess.Popen(
        [sys.executable, str(DEMO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if line.startswith(f"[1/{STEPS}]"):
                break
        # The daemon is up and the host steps are starting: interrupt them.
        process.send_signal(signal.SIGTERM)
        rest, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    out = "".join(seen) + rest

    assert process.returncode == 128 + signal.SIGTERM, out + errors
    assert "interrupted: stopping the daemon and cleaning up" in out
    assert f"[{STEPS}/{STEPS}]" not in out and "FAILED" not in out
    found = re.search(r"octo-worker run pid (\d+)", seen[-1])
    assert found is not None, out
    with pytest.raises(ProcessLookupError):
        os.kill(int(found.group(1)), 0)  # stopped and reaped by the demo
    assert not private_dir(out).exists()


@pytest.mark.rabbitmq
@needs_broker
def test_a_daemon_killed_mid_run_fails_the_step_with_exit_status_one() -> None:
    process = subprocess.Popen(
        [sys.executable, str(DEMO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            seen.append(line)
            if line.startswith(f"[1/{STEPS}]"):
                break
        found = re.search(r"octo-worker run pid (\d+)", seen[-1])
        assert found is not None, "".join(seen)
        os.kill(int(found.group(1)), signal.SIGKILL)
        rest, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    out = "".join(seen) + rest

    assert process.returncode == 1, out + errors
    failed = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert failed == [
        f"FAILED: [2/{STEPS}] publish: expected the worker daemon to keep running, "
        "got it exited with status -9; its last lines:"
    ]
    assert f"[2/{STEPS}]" not in "".join(step_lines(out))
    assert not private_dir(out).exists()


def test_a_daemon_that_cannot_start_fails_step_one_with_its_log(tmp_path: Path) -> None:
    demo_module = load_demo_module()
    root = tmp_path / "demo"
    root.mkdir(mode=0o700)
    demo = demo_module.DemoDir(root)
    demo.provision()
    demo.scope_key.chmod(0o644)  # the daemon refuses a key readable by others

    try:
        with pytest.raises(demo_module.StepFailed) as failed:
            demo_module.start_daemon(demo, "[1/6] worker up")
    finally:
        demo_module.close_notify(demo)

    assert failed.value.expected == "the worker daemon to report READY=1"
    assert "exited with status 2" in failed.value.got
    assert "scope.key" in failed.value.got and "chmod 600" in failed.value.got
    assert demo.process is not None and demo.process.poll() == 2
