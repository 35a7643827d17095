"""``journal verify`` fails wherever the daemon's start fails: one code path.

Two edits a start refused while verify passed: a scope's head row deleted
(verify listed scopes by their heads, so it saw "0 scopes"), and a session
request row's ``session`` column set to NULL (verify read sessions without
reading them back as a restore does). Now verify checks every scope the
store holds, heads or not, with the calls a load makes (``verify_scope``
then ``load_scope``): both edits fail ``octo-worker journal verify`` (a real
process) with ``rollback_detected``, and the daemon refuses to start. Real
broker, real daemon, a real SQLite file or PostgreSQL schema.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from octo_common.errors import RollbackDetected
from octo_common.messages import OperationResult

from .conftest import RawHost, WorkerEnv, WorkerRunner
from .journal_backends import BACKENDS, JournalDatabase
from .test_daemon_live_tamper import configure_journal
from .test_daemon_rabbitmq import answer, dispatch_frame, opened, operation_key
from .test_daemon_rollback import CountingFiles, registry

pytestmark = pytest.mark.rabbitmq

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


@pytest.fixture(params=BACKENDS)
async def served_journal(request: pytest.FixtureRequest, worker_env: WorkerEnv) -> JournalDatabase:
    """The daemon's journal: its SQLite file without an anchor, or a PostgreSQL schema."""
    return await configure_journal(request, worker_env, anchor=False)


def journal_verify(env: WorkerEnv) -> tuple[int, dict[str, object]]:
    result = subprocess.run(
        [
            PYTHON,
            "-m",
            "octo_worker",
            "journal",
            "verify",
            "--json",
            "--config",
            str(env.config_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


async def served_once(workers: WorkerRunner, raw_host: RawHost, env: WorkerEnv) -> None:
    """One open session with one dispatch (so a request row), then the daemon stopped."""
    daemon = await workers.start(adapters=registry(CountingFiles(env)))
    session = await opened(raw_host, daemon)
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)
    await workers.stop(daemon)
    status, report = journal_verify(env)
    assert status == 0 and report["ok"], report


@pytest.mark.parametrize(
    "edit",
    [
        "DELETE FROM heads WHERE name = ?",
        "UPDATE items SET session = NULL WHERE namespace = 'worker-session-request' AND name = ?",
    ],
    ids=["head-row-deleted", "request-session-null"],
)
async def test_verify_fails_where_the_daemon_refuses_to_start(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
    edit: str,
) -> None:
    await served_once(workers, raw_host, worker_env)
    await served_journal.sql(edit, raw_host.scope)

    status, report = journal_verify(worker_env)
    assert status == 1, report
    assert not report["ok"]
    assert str(report["first_failure"]).startswith(f"scope {raw_host.scope}: ")
    assert "rollback_detected" in str(report["first_failure"])
    with pytest.raises(RollbackDetected):
        await workers.start(adapters=registry(CountingFiles(worker_env)))
