"""The database thread and the schema migration both stores use.

The thread is exercised with plain functions (no database), the migration
and the database files (private, never through a link) on real SQLite files.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import StorageBackendError, WriteConflict
from octo_common.runtime.sqlite import (
    DatabaseThread,
    Outcome,
    check_database_files,
    migrate_schema,
    prepare_database_files,
    run_each,
)

WAIT = 5.0


def plain(name: str = "octo-test-db") -> DatabaseThread[Callable[[], Any]]:
    return DatabaseThread(name, run_each)


async def test_work_runs_in_order_on_its_own_named_thread() -> None:
    thread = plain("octo-test-named")
    seen: list[tuple[int, str]] = []

    def step(n: int) -> int:
        seen.append((n, threading.current_thread().name))
        return n * 10

    results = await asyncio.gather(*(thread.submit(lambda n=n: step(n)) for n in range(5)))
    thread.close()
    await thread.wait_closed()
    assert results == [0, 10, 20, 30, 40]
    assert seen == [(n, "octo-test-named") for n in range(5)]


async def test_work_waiting_together_is_handed_over_as_one_batch() -> None:
    gate, entered = threading.Event(), threading.Event()
    batches: list[list[str]] = []

    def run_batch(batch: list[str]) -> list[Outcome]:
        batches.append(list(batch))
        if batch == ["first"]:
            entered.set()
            gate.wait(WAIT)
        return [(True, item.upper()) for item in batch]

    thread: DatabaseThread[str] = DatabaseThread("octo-test-batch", run_batch)
    first = thread.submit("first")
    await asyncio.to_thread(entered.wait, WAIT)
    rest = [thread.submit(name) for name in ("a", "b", "c")]
    gate.set()
    assert await first == "FIRST"
    assert await asyncio.gather(*rest) == ["A", "B", "C"]
    assert batches == [["first"], ["a", "b", "c"]]  # group commit happens here
    thread.close()
    await thread.wait_closed()


async def test_each_item_keeps_its_own_failure() -> None:
    thread = plain()

    def boom() -> None:
        raise ValueError("this caller only")

    outcomes = await asyncio.gather(
        thread.submit(lambda: 1),
        thread.submit(boom),
        thread.submit(lambda: 3),
        return_exceptions=True,
    )
    thread.close()
    assert outcomes[0] == 1 and outcomes[2] == 3
    assert isinstance(outcomes[1], ValueError)


async def test_a_defect_in_run_batch_fails_that_batch_and_the_thread_serves_on() -> None:
    calls = 0

    def run_batch(batch: list[int]) -> list[Outcome]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("defect")
        if calls == 2:
            return []  # the wrong number of outcomes is a defect too
        return [(True, item) for item in batch]

    thread: DatabaseThread[int] = DatabaseThread("octo-test-defect", run_batch)
    with pytest.raises(RuntimeError, match="defect"):
        await asyncio.wait_for(thread.submit(1), WAIT)
    with pytest.raises(RuntimeError, match="wrong number"):
        await asyncio.wait_for(thread.submit(2), WAIT)
    assert await asyncio.wait_for(thread.submit(3), WAIT) == 3
    thread.close()


async def test_one_refusal_shared_by_a_batch_reaches_each_caller_as_its_own_instance() -> None:
    gate, entered = threading.Event(), threading.Event()
    refusal = WriteConflict(3, 4)

    def run_batch(batch: list[str]) -> list[Outcome]:
        if batch == ["hold"]:
            entered.set()
            gate.wait(WAIT)
            return [(True, None)]
        return [(False, refusal) for _ in batch]

    thread: DatabaseThread[str] = DatabaseThread("octo-test-shared", run_batch)
    hold = thread.submit("hold")
    await asyncio.to_thread(entered.wait, WAIT)
    futures = [thread.submit("x"), thread.submit("y")]
    gate.set()
    await hold
    errors = await asyncio.gather(*futures, return_exceptions=True)
    thread.close()
    assert all(
        isinstance(error, WriteConflict) and error.code == "write_conflict" for error in errors
    )
    assert errors[0] is not errors[1]
    assert [(e.expected, e.actual) for e in errors] == [(3, 4), (3, 4)]  # type: ignore[union-attr]


async def test_close_runs_what_is_queued_then_refuses_new_work() -> None:
    thread = plain()
    done: list[str] = []
    queued = [thread.submit(lambda n=n: done.append(f"w{n}")) for n in range(3)]
    last = thread.close(lambda: done.append("last"))
    assert last is not None
    await asyncio.gather(*queued, last)
    await thread.wait_closed()
    assert done == ["w0", "w1", "w2", "last"]
    assert thread.close(lambda: None) is None  # idempotent: nothing more runs
    with pytest.raises(StorageBackendError, match="store is closed"):
        thread.submit(lambda: None)


async def test_closing_a_thread_that_never_started_runs_nothing() -> None:
    thread = plain()
    ran: list[int] = []
    assert thread.close(lambda: ran.append(1)) is None
    await asyncio.wait_for(thread.wait_closed(), WAIT)
    assert ran == [] and thread.closed


async def test_a_cancelled_caller_does_not_stop_the_work() -> None:
    gate = threading.Event()
    ran = threading.Event()
    thread = plain()

    def slow() -> None:
        gate.wait(WAIT)
        ran.set()

    task = asyncio.ensure_future(thread.submit(slow))
    await asyncio.sleep(0)
    task.cancel()
    gate.set()
    assert await thread.submit(lambda: "after") == "after"
    assert ran.is_set()
    thread.close()


def test_event_loops_in_several_threads_share_one_database_thread() -> None:
    thread = plain("octo-test-shared-loops")
    results: dict[str, list[Any]] = {}

    def client(name: str) -> None:
        async def main() -> list[Any]:
            loop = asyncio.get_running_loop()

            def work(n: int) -> tuple[str, int]:
                return (name, n)

            values = await asyncio.gather(*(thread.submit(lambda n=n: work(n)) for n in range(20)))
            assert asyncio.get_running_loop() is loop
            return list(values)

        results[name] = asyncio.run(main())

    workers = [threading.Thread(target=client, args=(f"loop-{i}",)) for i in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(WAIT)
    assert {name: len(values) for name, values in results.items()} == {
        "loop-0": 20,
        "loop-1": 20,
        "loop-2": 20,
    }
    for name, values in results.items():
        assert values == [(name, n) for n in range(20)]


# Schema migration ---------------------------------------------------------------------------

MIGRATIONS: Sequence[Sequence[str]] = (
    ("CREATE TABLE a (x INTEGER)",),
    ("CREATE TABLE b (y INTEGER)", "INSERT INTO b VALUES (1)"),
)


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def version(connection: sqlite3.Connection) -> list[tuple[int]]:
    return connection.execute("SELECT version FROM schema_version").fetchall()


def test_migration_moves_forward_once_and_is_idempotent(tmp_path: Path) -> None:
    connection = connect(tmp_path / "db.sqlite3")
    migrate_schema(connection, MIGRATIONS[:1])
    assert version(connection) == [(1,)]
    migrate_schema(connection, MIGRATIONS)
    migrate_schema(connection, MIGRATIONS)
    assert version(connection) == [(2,)]
    assert connection.execute("SELECT y FROM b").fetchall() == [(1,)]
    assert not connection.in_transaction


def test_a_newer_or_malformed_schema_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    connection = connect(tmp_path / "db.sqlite3")
    migrate_schema(connection, MIGRATIONS)
    with pytest.raises(StorageBackendError, match="schema version 2 is newer"):
        migrate_schema(connection, MIGRATIONS[:1])
    connection.execute("INSERT INTO schema_version VALUES (1)")
    with pytest.raises(StorageBackendError, match="malformed schema_version"):
        migrate_schema(connection, MIGRATIONS)
    assert not connection.in_transaction


def test_a_failing_migration_is_rolled_back_whole(tmp_path: Path) -> None:
    connection = connect(tmp_path / "db.sqlite3")
    broken = (("CREATE TABLE a (x INTEGER)",), ("CREATE TABLE c (z)", "NOT SQL"))
    with pytest.raises(sqlite3.Error):
        migrate_schema(connection, broken)
    assert not connection.in_transaction
    tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert tables == set()


def test_a_migration_step_may_be_a_function_run_in_the_same_transaction(tmp_path: Path) -> None:
    connection = connect(tmp_path / "db.sqlite3")
    assert migrate_schema(connection, MIGRATIONS[:1]) == 0

    def build(inside: sqlite3.Connection) -> None:
        assert inside.in_transaction
        inside.execute("INSERT INTO a VALUES (7)")

    def fail(inside: sqlite3.Connection) -> None:
        inside.execute("INSERT INTO a VALUES (8)")
        raise StorageBackendError("cannot build")

    with pytest.raises(StorageBackendError, match="cannot build"):
        migrate_schema(connection, (*MIGRATIONS[:1], ("CREATE TABLE c (z INTEGER)", fail)))
    assert version(connection) == [(1,)]  # nothing of the failed step stayed
    assert connection.execute("SELECT x FROM a").fetchall() == []
    assert migrate_schema(connection, (*MIGRATIONS[:1], ("CREATE TABLE c (z INTEGER)", build))) == 1
    assert connection.execute("SELECT x FROM a").fetchall() == [(7,)]
    assert version(connection) == [(2,)]


# Database files -------------------------------------------------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def loose_umask() -> Iterator[None]:
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def test_database_files_are_created_private_even_under_a_loose_umask(
    tmp_path: Path, loose_umask: None
) -> None:
    database = tmp_path / "state" / "db.sqlite3"
    assert prepare_database_files(database) is None
    assert mode_of(database.parent) == 0o700
    assert mode_of(database) == 0o600
    connection = connect(database)
    try:
        assert connection.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
        connection.execute("CREATE TABLE t (x INTEGER)")
        check_database_files(database)  # SQLite gave its side files the database's mode
        assert mode_of(Path(f"{database}-wal")) == 0o600
    finally:
        connection.close()


def test_loose_files_are_made_private_and_a_loose_directory_is_reported(tmp_path: Path) -> None:
    directory = tmp_path / "shared"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    database = directory / "db.sqlite3"
    for path in (database, Path(f"{database}-wal")):
        path.touch()
        path.chmod(0o644)
    assert prepare_database_files(database) == 0o755
    assert mode_of(database) == 0o600
    assert mode_of(Path(f"{database}-wal")) == 0o600
    assert mode_of(directory) == 0o755  # reported (the caller warns), never changed


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm"])
def test_a_link_at_a_database_path_is_refused_and_never_followed(
    tmp_path: Path, suffix: str
) -> None:
    database = tmp_path / "db.sqlite3"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.touch()
    elsewhere.chmod(0o644)
    if suffix:
        database.touch()
        database.chmod(0o600)
    os.symlink(elsewhere, f"{database}{suffix}")
    with pytest.raises(StorageBackendError, match="symbolic link"):
        prepare_database_files(database)
    with pytest.raises(StorageBackendError, match="not a regular file"):
        check_database_files(database)
    assert mode_of(elsewhere) == 0o644  # the link's target was never touched


def test_a_database_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    occupied = tmp_path / "occupied"
    occupied.write_text("not a directory")
    with pytest.raises(OSError):
        prepare_database_files(occupied / "db.sqlite3")


def test_preparing_the_files_of_an_open_database_keeps_its_connection_s_locks(
    tmp_path: Path,
) -> None:
    # Closing any descriptor of a database file drops every POSIX lock this
    # process holds on it, SQLite's included: another process that writes and
    # closes would then take itself for the last connection, checkpoint and
    # delete the WAL under the open ones, and no new reader would ever see
    # their later commits.
    database = tmp_path / "db.sqlite3"
    prepare_database_files(database)
    writer = connect(database)
    reader: sqlite3.Connection | None = None
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("CREATE TABLE t (x INTEGER)")
        writer.execute("INSERT INTO t VALUES (1)")
        prepare_database_files(database)  # what a second store of this process does
        check_database_files(database)
        reader = connect(database)
        assert reader.execute("SELECT count(*) FROM t").fetchone() == (1,)
        subprocess.run(  # another process writes, then closes the database
            [
                sys.executable,
                "-c",
                f"import sqlite3; c = sqlite3.connect({str(database)!r}, isolation_level=None); "
                "c.execute('INSERT INTO t VALUES (2)'); c.close()",
            ],
            check=True,
            timeout=30,
        )
        writer.execute("INSERT INTO t VALUES (3)")
        seen = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sqlite3; "
                f"print(sqlite3.connect({str(database)!r}).execute('SELECT count(*) FROM t')"
                ".fetchone()[0])",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        if reader is not None:
            reader.close()
        writer.close()
    assert seen.stdout.strip() == "3"
