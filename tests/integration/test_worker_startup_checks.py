"""``octo-worker check`` reports what ``run`` would refuse before the broker.

Each case runs the real ``run`` and ``check`` side by side on the same
configuration: ``run`` must refuse it (exit 2, one line naming the key) and
``check`` must report the same refusal on its own line. The broker URL
points nowhere: every refusal here comes before ``run`` would reach it.
"""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from octo_worker.config import load_config
from octo_worker.daemon.startup import create_state_directories, state_directories
from tests.integration.test_worker_cli import (
    PYTHON,
    REPO,
    WorkerFiles,
    json_out,
    octo_worker_each,
    run_error,
)

SCOPE = "tenant-startup"
NOWHERE = "amqp://127.0.0.1:1/"


def check_line(result: subprocess.CompletedProcess[str], name: str) -> dict[str, Any]:
    (line,) = [c for c in json_out(result)["checks"] if c["name"] == name]
    return dict(line)


def run_and_check(files: WorkerFiles) -> tuple[subprocess.CompletedProcess[str], ...]:
    run, check = octo_worker_each(["run"], ["check", "--json"], config=files.config)
    return run, check


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A local port another socket listens on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield int(taken.getsockname()[1])


def test_a_state_dir_whose_parent_is_missing_is_refused_not_created(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path / "worker", NOWHERE, SCOPE)
    files.write(
        files.config.read_text().replace('state_dir = "state"', 'state_dir = "mistyped/state"')
    )
    run, check = run_and_check(files)

    assert run.returncode == 2, run.stderr
    line = run_error(run.stderr)
    assert "worker.state_dir" in line and "mistyped" in line, line
    assert not (tmp_path / "worker" / "mistyped").exists()  # no fresh empty journal
    assert check.returncode == 2, check.stdout
    journal = check_line(check, "journal")
    assert not journal["ok"] and journal["exit_status"] == 2
    assert "worker.state_dir" in journal["detail"] and "mistyped" in journal["detail"]


def test_a_journal_outside_the_state_dir_under_a_missing_directory_is_refused(
    tmp_path: Path,
) -> None:
    files = WorkerFiles(tmp_path / "worker", NOWHERE, SCOPE)
    journal = tmp_path / "nowhere" / "deeper" / "journal.sqlite3"
    files.write(
        files.config.read_text().replace('journal = "journal.sqlite3"', f'journal = "{journal}"')
    )
    run, check = run_and_check(files)

    assert run.returncode == 2, run.stderr
    assert "storage.journal" in run_error(run.stderr)
    assert not (tmp_path / "nowhere").exists()
    assert check.returncode == 2
    assert "storage.journal" in check_line(check, "journal")["detail"]


def test_a_missing_state_dir_under_an_existing_parent_is_created(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path / "worker", NOWHERE, SCOPE)
    config = load_config(files.config)
    state = tmp_path / "worker" / "state"
    assert state_directories(config) == [state]
    create_state_directories(config)
    assert state.is_dir() and (state.stat().st_mode & 0o777) == 0o700
    assert state_directories(config) == []


def test_a_console_port_in_use_is_refused_by_run_and_reported_by_check(
    tmp_path: Path, taken_port: int
) -> None:
    files = WorkerFiles(
        tmp_path, NOWHERE, SCOPE, extra=f'[console]\nlisten = "127.0.0.1:{taken_port}"'
    )
    run, check = run_and_check(files)

    expected = f"console: cannot listen on 127.0.0.1:{taken_port}"
    assert run.returncode == 2, run.stderr
    assert expected in run_error(run.stderr)
    assert check.returncode == 2
    console = check_line(check, "console")
    assert not console["ok"] and expected in console["detail"]
    assert check_line(check, "journal")["ok"]


def test_a_remote_console_without_a_token_is_refused_by_run_and_reported_by_check(
    tmp_path: Path,
) -> None:
    files = WorkerFiles(
        tmp_path, NOWHERE, SCOPE, extra='[console]\nlisten = "0.0.0.0:9465"\nallow_remote = true'
    )
    run, check = run_and_check(files)

    assert run.returncode == 2, run.stderr
    assert "needs an access token" in run_error(run.stderr)
    assert check.returncode == 2
    assert "needs an access token" in check_line(check, "console")["detail"]


def test_a_metrics_port_in_use_is_reported_by_check_as_run_refuses_it(
    tmp_path: Path, taken_port: int
) -> None:
    files = WorkerFiles(tmp_path, NOWHERE, SCOPE, metrics_listen=f"127.0.0.1:{taken_port}")
    run, check = run_and_check(files)

    expected = f"metrics.listen: cannot listen on 127.0.0.1:{taken_port}"
    assert run.returncode == 2
    assert expected in run_error(run.stderr)
    assert check.returncode == 2
    metrics = check_line(check, "metrics")
    assert not metrics["ok"] and expected in metrics["detail"]


# ``find_spec`` answers None for a module set to None in sys.modules, and an
# import of it fails: what a machine without uvloop sees.
WITHOUT_UVLOOP = (
    "import sys; sys.modules['uvloop'] = None; "
    "from octo_worker.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_a_missing_uvloop_is_refused_by_run_and_reported_by_check(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path, NOWHERE, SCOPE)
    files.write(
        files.config.read_text().replace(
            'log_level = "info"', 'log_level = "info"\nevent_loop = "uvloop"'
        )
    )
    processes = [
        subprocess.Popen(
            [PYTHON, "-c", WITHOUT_UVLOOP, *argv, "--config", str(files.config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for argv in (["run"], ["check", "--json"])
    ]
    (_, run_err), (check_out, _) = (p.communicate(timeout=60) for p in processes)

    assert processes[0].returncode == 2
    assert "worker.event_loop: uvloop is not installed" in run_err
    assert processes[1].returncode == 2
    (config,) = [c for c in json.loads(check_out)["checks"] if c["name"] == "config"]
    assert not config["ok"]
    assert "worker.event_loop: uvloop is not installed" in config["detail"]
