"""Row-level rollback of the worker journal, on real SQLite files.

An attacker with write access to the journal file but no key can delete a
row, put a row back to its own older sealed version, or copy a sealed row in
from another scope: every row stays authentic, only the set of rows is
wrong. Each scope's sealed head commits to that set, so each of these edits
is refused when the scope is loaded (a fence reservation: every start and
reload), by ``verify_scope``, by ``octo-worker run``, ``journal verify`` and
``check``, with and without the rollback anchor (the anchor alone cannot
see them: the head revision does not move). The store-level check runs on
both backends (``journal_db``); the daemon and the verbs on SQLite files.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest

from octo_common.errors import RollbackDetected
from octo_common.payload import ToolPayload
from octo_common.states import Pending, Succeeded
from octo_worker.config import WorkerConfig, load_config
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.storage.journal_items import JournalItems
from octo_worker.store import SqliteJournalStore, WorkerCommit

from .journal_backends import JournalDatabase

REPO = Path(__file__).resolve().parents[2]
SCOPE = "tenant-release"
OTHER = "tenant-audit"
EMPTY_ANCHOR = b'{"format_version":1,"records":[]}'


def record(key: str, done: bool = False) -> WorkerOperationRecord:
    state = Succeeded(ToolPayload.json({"key": key})) if done else Pending()
    return WorkerOperationRecord("math.add", key, blake3.blake3(key.encode()).hexdigest(), state)


def change(scope: str, item: WorkerOperationRecord, base: int | None) -> WorkerCommit:
    return WorkerCommit(JournalChangeset(scope, {item.operation_key: JournalRowChange(item, base)}))


def sql(
    path: Path, statement: str, parameters: tuple[object, ...] = ()
) -> list[tuple[object, ...]]:
    """Edit the database behind the store's back, as the attacker does."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        return connection.execute(statement, parameters).fetchall()
    finally:
        connection.close()


@dataclass
class Journal:
    """A worker configuration and the journal it names (scopes SCOPE and OTHER)."""

    config_path: Path
    config: WorkerConfig
    anchored: bool

    @property
    def path(self) -> Path:
        return self.config.journal_path

    def item(self, scope: str, key: str) -> str:
        """The item ``key``'s journal row is stored under (a keyed hash)."""
        return JournalItems(self.config.storage_keyring()).item(scope, key)

    def store(self, *, read_only: bool = False) -> SqliteJournalStore:
        return SqliteJournalStore(
            self.path,
            self.config.storage_keyring(),
            anchor_path=self.config.anchor_path,
            read_only=read_only,
        )


def make_journal(root: Path, anchored: bool) -> Journal:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in (
        ("scope.key", secrets.token_bytes(32)),
        ("other.key", secrets.token_bytes(32)),
        ("storage.key", secrets.token_bytes(32).hex().encode() + b"\n"),
    ):
        fd = os.open(root / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
    (root / "state").mkdir(mode=0o700)
    anchor = 'anchor = "journal.anchor"\n' if anchored else ""
    if anchored:
        (root / "state" / "journal.anchor").write_bytes(EMPTY_ANCHOR)
    config_path = root / "worker.toml"
    config_path.write_text(
        f"""
[worker]
state_dir = "state"

[broker]
url = "amqp://127.0.0.1:5672/"
connect_timeout_seconds = 3.0

[storage]
journal = "journal.sqlite3"
key = {{ id = "worker-k1", key_file = "storage.key" }}
{anchor}
[[scopes]]
name = "{SCOPE}"
key_file = "scope.key"

[[scopes]]
name = "{OTHER}"
key_file = "other.key"
""",
        encoding="utf-8",
    )
    return Journal(config_path, load_config(config_path), anchored)


async def fill(journal: Journal) -> bytes:
    """op-1 (pending at 1, then succeeded at 3) and op-2 in SCOPE, op-9 in OTHER.

    Returns op-1's sealed row as it was at revision 1 (what the attacker kept).
    """
    store = journal.store()
    try:
        lease = await store.reserve_fence(SCOPE)
        other = await store.reserve_fence(OTHER)
        await store.commit(SCOPE, lease, change(SCOPE, record("op-1"), None))
        ((older,),) = sql(
            journal.path,
            "SELECT envelope FROM items WHERE item = ?",
            (journal.item(SCOPE, "op-1"),),
        )
        await store.commit(SCOPE, lease, change(SCOPE, record("op-2"), None))
        await store.commit(SCOPE, lease, change(SCOPE, record("op-1", done=True), 1))
        await store.commit(OTHER, other, change(OTHER, record("op-9", done=True), None))
        check = await store.verify_scope(SCOPE)
        assert (check.revision, check.rows, check.digests) == (3, 2, True)
    finally:
        await store.close()
    assert isinstance(older, bytes)
    return older


def delete_row(journal: Journal, older: bytes) -> None:
    sql(
        journal.path,
        "DELETE FROM items WHERE name = ? AND item = ?",
        (SCOPE, journal.item(SCOPE, "op-1")),
    )


def put_back_older_self(journal: Journal, older: bytes) -> None:
    sql(
        journal.path,
        "UPDATE items SET revision = 1, envelope = ? WHERE name = ? AND item = ?",
        (older, SCOPE, journal.item(SCOPE, "op-1")),
    )


def copy_in_from_other_scope(journal: Journal, older: bytes) -> None:
    sql(
        journal.path,
        "INSERT INTO items (namespace, name, item, revision, envelope, written_at) "
        "SELECT namespace, ?, ?, revision, envelope, written_at FROM items "
        "WHERE name = ? AND item = ?",
        (SCOPE, journal.item(SCOPE, "op-9"), OTHER, journal.item(OTHER, "op-9")),
    )


TAMPERING: dict[str, Callable[[Journal, bytes], None]] = {
    "row deleted": delete_row,
    "row replaced by its older self": put_back_older_self,
    "row copied from another scope": copy_in_from_other_scope,
}
CASES = [
    pytest.param(
        name, anchored, id=f"{name.replace(' ', '-')}-{'anchor' if anchored else 'no-anchor'}"
    )
    for name in TAMPERING
    for anchored in (True, False)
]


def octo_worker(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "octo_worker", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
    )


@pytest.mark.parametrize(("tampering", "anchored"), CASES)
async def test_a_tampered_set_of_rows_is_refused_at_start_and_by_journal_verify(
    tmp_path: Path, tampering: str, anchored: bool
) -> None:
    journal = make_journal(tmp_path, anchored)
    older = await fill(journal)
    TAMPERING[tampering](journal, older)

    store = journal.store()
    try:
        with pytest.raises(RollbackDetected):
            await store.reserve_fence(SCOPE)  # what every start and reload does first
        with pytest.raises(RollbackDetected):
            await store.verify_scope(SCOPE)
        # The other scope's rows are its head's: it can still be served.
        lease = await store.reserve_fence(OTHER)
        await store.commit(OTHER, lease, change(OTHER, record("op-10"), None))
    finally:
        await store.close()

    # The daemon's start: refused before the broker is ever reached.
    with pytest.raises(RollbackDetected):
        await WorkerDaemon(journal.config).run()

    verify = octo_worker("journal", "verify", "--json", config=journal.config_path)
    assert verify.returncode == 1, verify.stderr
    report = json.loads(verify.stdout)
    assert report["first_failure"].startswith(
        f"scope {SCOPE}: rows against the sealed head: rollback_detected"
    )
    assert report["scopes"][OTHER]["rows"] == 2


async def test_run_and_check_refuse_a_deleted_row_with_exit_4(tmp_path: Path) -> None:
    journal = make_journal(tmp_path, anchored=True)
    older = await fill(journal)
    delete_row(journal, older)

    run = octo_worker("run", config=journal.config_path)
    assert run.returncode == 4, run.stderr
    assert "journal storage: rollback_detected" in run.stderr
    assert f'"scope": "{SCOPE}"' in run.stderr and "scope_load_failed" in run.stderr

    check = octo_worker("check", "--json", config=journal.config_path)
    assert check.returncode == 4, check.stdout
    (line,) = [c for c in json.loads(check.stdout)["checks"] if c["name"] == "journal"]
    assert not line["ok"] and f"scope {SCOPE}: rollback_detected" in line["detail"]


# The same edits on either backend, through the store alone (no anchor). ---------------


async def _fill_store(journal_db: JournalDatabase) -> bytes:
    store = journal_db.store()
    try:
        lease = await store.reserve_fence(SCOPE)
        other = await store.reserve_fence(OTHER)
        await store.commit(SCOPE, lease, change(SCOPE, record("op-1"), None))
        older = await journal_db.envelope("op-1")
        await store.commit(SCOPE, lease, change(SCOPE, record("op-2"), None))
        await store.commit(SCOPE, lease, change(SCOPE, record("op-1", done=True), 1))
        await store.commit(OTHER, other, change(OTHER, record("op-9", done=True), None))
    finally:
        await store.close()
    return older


async def _tamper(journal_db: JournalDatabase, tampering: str, older: bytes) -> None:
    if tampering == "row deleted":
        op_1 = await journal_db.journal_item(SCOPE, "op-1")
        await journal_db.sql("DELETE FROM items WHERE name = ? AND item = ?", SCOPE, op_1)
    elif tampering == "row replaced by its older self":
        await journal_db.sql(
            "UPDATE items SET revision = 1, envelope = ? WHERE name = ? AND item = ?",
            older,
            SCOPE,
            await journal_db.journal_item(SCOPE, "op-1"),
        )
    else:
        await journal_db.copy_row("op-9", OTHER, to_scope=SCOPE, to_item="op-9")


@pytest.mark.parametrize("tampering", list(TAMPERING))
async def test_a_tampered_set_of_rows_is_refused_by_either_backend(
    journal_db: JournalDatabase, tampering: str
) -> None:
    older = await _fill_store(journal_db)
    await _tamper(journal_db, tampering, older)
    store = journal_db.store()
    try:
        with pytest.raises(RollbackDetected):
            await store.reserve_fence(SCOPE)  # what every start, reload and takeover does
        with pytest.raises(RollbackDetected):
            await store.verify_scope(SCOPE)
        lease = await store.reserve_fence(OTHER)
        await store.commit(OTHER, lease, change(OTHER, record("op-10"), None))
    finally:
        await store.close()
