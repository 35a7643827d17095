"""The fsync floor every Octo store commit stands on: one single-row SQLite commit.

Used by ``bench/e2e.py`` (goal 3 bounds Octo's 1-in-flight p50 by
four of these) and ``bench/journal.py``. The connection is configured with
the pragmas both stores use (``octo_worker.store`` and ``octo_host.store``):
WAL, ``synchronous=FULL``, a 5 s busy timeout, foreign keys on. One commit
is ``BEGIN IMMEDIATE`` + one ``INSERT`` of a row about the size of a sealed
journal row + ``COMMIT`` (one fsync of the WAL), straight through the stdlib
``sqlite3`` with no store, thread or event loop around it.

It must never measure in a directory other than the one the figure is
compared against (the disk is the figure).
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

ROW_BYTES = 600  # about one sealed worker journal row
BUSY_TIMEOUT_MS = 5000


def configure(connection: sqlite3.Connection) -> None:
    """The stores' pragmas: WAL, synchronous=FULL, busy timeout 5 s, foreign keys on."""
    mode = connection.execute("PRAGMA journal_mode=WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise RuntimeError(f"journal_mode is {mode}, not wal")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    connection.execute("PRAGMA foreign_keys=ON")


def single_row_commit_latencies(path: Path, count: int, *, warmup: int = 20) -> list[float]:
    """Seconds of each of ``count`` single-row fsynced commits into a fresh database at ``path``."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        configure(connection)
        connection.execute(
            "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, item TEXT UNIQUE, "
            "envelope BLOB)"
        )
        envelope = os.urandom(ROW_BYTES)
        latencies: list[float] = []
        for index in range(warmup + count):
            started = time.perf_counter()
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO items (item, envelope) VALUES (?, ?)", (f"k{index}", envelope)
            )
            connection.execute("COMMIT")
            if index >= warmup:
                latencies.append(time.perf_counter() - started)
        return latencies
    finally:
        connection.close()
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
