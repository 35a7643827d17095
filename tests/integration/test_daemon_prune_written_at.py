"""A journal row's write time set back never gets its outcome pruned early.

``written_at`` (when a row was last written, which ``journal prune`` chooses
by) is sealed with the storage key at the row's revision. Set to 0 on a row
written seconds ago, beside the running daemon, it used to pass ``journal
verify``, and a routine ``journal prune --older-than 90d`` dropped the
outcome. Now prune refuses the row and prunes nothing, verify fails on it and
the next start is refused, before the key asked again reaches the adapter.
Real broker, real daemon, real ``octo-worker journal`` processes, a real
SQLite file (with a rollback anchor) or PostgreSQL schema.
"""

from __future__ import annotations

import subprocess

import pytest

from octo_common.errors import InvalidRecordAuthenticationTag
from octo_worker.storage.journal_items import JournalItems

from .conftest import RawHost, WorkerEnv, WorkerRunner
from .journal_backends import JournalDatabase
from .test_daemon_live_tamper import PYTHON, REPO, served_journal
from .test_daemon_rabbitmq import dispatch_frame, opened, operation_key
from .test_daemon_rollback import CountingFiles, registry
from .test_daemon_scope_rollback import dispatched
from .test_journal_verify_agrees import journal_verify

pytestmark = pytest.mark.rabbitmq

__all__ = ["served_journal"]


async def test_a_write_time_set_back_is_refused_by_prune_verify_and_start(
    workers: WorkerRunner,
    raw_host: RawHost,
    worker_env: WorkerEnv,
    served_journal: JournalDatabase,
) -> None:
    """A journal row's ``written_at`` set to 0 beside the running daemon (a row written
    seconds ago made to look old): a routine ``journal prune --older-than 90d`` (a
    real process) refuses it and prunes nothing, ``journal verify`` fails on it, and
    the next start is refused (``octo-worker run`` exits 4). The key asked again
    never reaches the adapter."""
    adapter = CountingFiles(worker_env)
    daemon = await workers.start(adapters=registry(adapter))
    session = await opened(raw_host, daemon)
    key = operation_key()
    stored = JournalItems(worker_env.config.storage_keyring()).item(raw_host.scope, key)
    await dispatched(raw_host, session, "d-1", key)
    envelope = await served_journal.envelope(stored)
    await served_journal.sql("UPDATE items SET written_at = 0 WHERE item = ?", stored)
    pruned = subprocess.run(
        [PYTHON, "-m", "octo_worker", "journal", "prune", "--older-than", "90d", "--config",
         str(worker_env.config_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )  # fmt: skip
    assert pruned.returncode == 4, (pruned.returncode, pruned.stderr)
    assert "invalid_record_authentication_tag" in pruned.stderr, pruned.stderr
    assert "Traceback" not in pruned.stderr
    assert await served_journal.envelope(stored) == envelope  # nothing pruned
    await workers.stop(daemon)
    assert adapter.dispatches == 1

    status, report = journal_verify(worker_env)
    assert status == 1, report
    assert "invalid_record_authentication_tag" in str(report["first_failure"]), report
    await raw_host.publish(
        dispatch_frame(session, "d-2", key),
        headers=raw_host.headers(session, "d-2"),
        correlation_id="d-2",
    )
    with pytest.raises(InvalidRecordAuthenticationTag):
        await workers.start(adapters=registry(adapter))
    assert adapter.dispatches == 1
    assert [m for m in raw_host.replies.items if m.correlation_id == "d-2"] == []
