"""Worker journal store benchmark (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/journal.py [--dir DIR] [--big 1000000] [--seconds 3]

One run measures, on the same disk:

* admissions/s through ``SqliteJournalStore`` with group commit at 1 and 64
  concurrent callers, and the same with one transaction per admission
  (``group_commit=False``). An admission is what a worker does for a new
  operation key: ``load_records`` for the key (absent), then ``commit`` of
  the new ``pending`` row together with the session's state document;
* raw SQLite ``synchronous=FULL`` single-row commits/s (the floor: one
  fsync per row, no Python store around it);
* admission latency (one caller) with 1e3 and 1e6 existing records; the big
  database is built with one bulk insert of sealed rows.

The machine may be shared, so rates run in interleaved rounds; the figures
printed last are medians (the ratio is taken per round) and, for the goal,
also the best round of each (the least disturbed measurement, as timeit does).

Goals: group commit at 64 callers >= 3x the raw single-commit rate;
latency(1e6) / latency(1e3) <= 1.5.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blake3

from octo_common.records import StorageKeyring, StorageRecordKey, seal_record
from octo_common.states import Pending
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.store import (
    SessionDocuments,
    SqliteJournalStore,
    WorkerCommit,
    WorkerJournalLease,
)

SCOPE = "tenant-bench"
SESSION = "sess-bench"
INSERT_ROW = "INSERT INTO items (namespace, name, item, revision, envelope) VALUES (?, ?, ?, ?, ?)"


def keyring() -> StorageKeyring:
    return StorageKeyring("storage-v1", bytes(range(32)))


def record(key: str) -> WorkerOperationRecord:
    return WorkerOperationRecord(
        "math.add", key, blake3.blake3(key.encode()).hexdigest(), Pending()
    )


def state_document(session_id: str, counter: int) -> bytes:
    return (
        f'{{"format_version":1,"scope":"{SCOPE}","session_id":"{session_id}",'
        f'"status":"open","next_outgoing":{counter}}}'
    ).encode()


def opening_document(session_id: str) -> bytes:
    return f'{{"format_version":1,"scope":"{SCOPE}","session_id":"{session_id}"}}'.encode()


class Admitter:
    """Admits new keys the way a session does, one session per caller."""

    def __init__(self, store: SqliteJournalStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix
        self.next_key = 0
        self.latencies: list[float] = []

    async def admit(
        self, lease: WorkerJournalLease, session_id: str, session_revision: int | None
    ) -> int:
        key = f"op-{self.prefix}-{self.next_key}"
        self.next_key += 1
        started = time.perf_counter()
        loaded = await self.store.load_records(SCOPE, [key])
        assert loaded[key] is None
        state = state_document(session_id, self.next_key)
        opening = opening_document(session_id) if session_revision is None else None
        revision = await self.store.commit(
            SCOPE,
            lease,
            WorkerCommit(
                JournalChangeset(SCOPE, {key: JournalRowChange(record(key), None)}),
                {session_id: SessionDocuments(state, opening, session_revision)},
            ),
        )
        self.latencies.append(time.perf_counter() - started)
        return revision


async def admissions_per_second(
    path: Path, callers: int, seconds: float, *, group_commit: bool
) -> tuple[float, float]:
    """Returns (admissions/s, change sets per transaction)."""
    store = SqliteJournalStore(path, keyring(), group_commit=group_commit)
    lease = await store.reserve_fence(SCOPE)
    admitter = Admitter(store, f"{callers}-{int(group_commit)}")
    deadline = time.perf_counter() + seconds
    count = 0

    async def caller(index: int) -> None:
        nonlocal count
        session_id = f"{SESSION}-{callers}-{int(group_commit)}-{index}"
        revision: int | None = None
        while time.perf_counter() < deadline:
            revision = await admitter.admit(lease, session_id, revision)
            count += 1

    started = time.perf_counter()
    before = store.stats
    await asyncio.gather(*(caller(i) for i in range(callers)))
    elapsed = time.perf_counter() - started
    stats = store.stats
    await store.close()
    transactions = stats.transactions - before.transactions
    return count / elapsed, (stats.committed_change_sets / transactions if transactions else 0.0)


def raw_commits_per_second(path: Path, seconds: float) -> float:
    """One fsynced transaction per inserted row, straight through sqlite3."""
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    connection.execute(
        "CREATE TABLE items (id INTEGER PRIMARY KEY, item TEXT UNIQUE, envelope BLOB)"
    )
    envelope = seal_record(
        keyring(), StorageRecordKey("worker-journal", SCOPE), 1, record("op-raw").to_row_json(SCOPE)
    )
    count = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(
            "INSERT INTO items (item, envelope) VALUES (?, ?)", (f"k{count}", envelope)
        )
        connection.execute("COMMIT")
        count += 1
    elapsed = time.perf_counter() - started
    connection.close()
    return count / elapsed


async def build_database(path: Path, records: int, progress: Callable[[str], None]) -> None:
    """A store database holding ``records`` sealed journal rows at revision 1."""
    store = SqliteJournalStore(path, keyring())
    lease = await store.reserve_fence(SCOPE)
    await store.commit(SCOPE, lease, WorkerCommit())  # head revision 1
    await store.close()
    ring = keyring()
    location = StorageRecordKey("worker-journal", SCOPE)
    connection = sqlite3.connect(path, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("BEGIN IMMEDIATE")
    batch: list[tuple[str, str, str, int, bytes]] = []
    step = max(records // 10, 1)
    for index in range(records):
        key = f"op-existing-{index}"
        envelope = seal_record(ring, location, 1, record(key).to_row_json(SCOPE))
        batch.append(("worker-journal", SCOPE, key, 1, envelope))
        if len(batch) == 10_000:
            connection.executemany(
                INSERT_ROW,
                batch,
            )
            batch.clear()
        if (index + 1) % step == 0:
            progress(f"  built {index + 1:>9,} / {records:,} rows")
    if batch:
        connection.executemany(
            INSERT_ROW,
            batch,
        )
    connection.execute("COMMIT")
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()


async def admission_latency(path: Path, admissions: int, run: int) -> tuple[float, float]:
    """(median, p99) seconds of one caller's admissions against ``path``."""
    store = SqliteJournalStore(path, keyring())
    lease = await store.reserve_fence(SCOPE)
    admitter = Admitter(store, f"latency-{run}")
    revision: int | None = None
    for _ in range(admissions):
        revision = await admitter.admit(lease, f"{SESSION}-latency-{run}", revision)
    await store.close()
    latencies = sorted(admitter.latencies[admissions // 10 :])  # drop warm-up
    return statistics.median(latencies), latencies[int(len(latencies) * 0.99) - 1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to put the databases")
    parser.add_argument("--big", type=int, default=1_000_000, help="records in the big database")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each rate run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="octo-bench-", dir=args.dir))

    def say(text: str) -> None:
        print(text, flush=True)

    configurations = [(True, 1), (True, 64), (False, 1), (False, 64)]
    try:
        say(
            f"octo journal store benchmark in {root} (python {sys.version.split()[0]}, "
            f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cpus); "
            f"{args.rounds} interleaved rounds of {args.seconds:g} s, medians at the end"
        )
        raw_rates: list[float] = []
        rates: dict[tuple[bool, int], list[float]] = {key: [] for key in configurations}
        batching: dict[tuple[bool, int], list[float]] = {key: [] for key in configurations}
        for round_number in range(args.rounds):
            raw_rates.append(raw_commits_per_second(root / f"raw-{round_number}.db", args.seconds))
            line = [f"round {round_number + 1}: raw {raw_rates[-1]:7,.0f}/s"]
            for group_commit, callers in configurations:
                rate, per_tx = await admissions_per_second(
                    root / f"rate-{round_number}-{int(group_commit)}-{callers}.db",
                    callers,
                    args.seconds,
                    group_commit=group_commit,
                )
                rates[(group_commit, callers)].append(rate)
                batching[(group_commit, callers)].append(per_tx)
                line.append(f"{'gc' if group_commit else 'tx'}@{callers} {rate:7,.0f}/s")
            say("  ".join(line))
        raw = statistics.median(raw_rates)
        say(f"raw sqlite synchronous=FULL single-row commits/s: {raw:10,.0f}")
        for group_commit, callers in configurations:
            label = "group commit" if group_commit else "one tx each "
            rate = statistics.median(rates[(group_commit, callers)])
            per_tx = statistics.median(batching[(group_commit, callers)])
            say(
                f"admissions/s, {label}, {callers:>2} callers: {rate:10,.0f}"
                f"   ({per_tx:5.1f} change sets per transaction)"
            )
        ratio = statistics.median(
            gc / floor for gc, floor in zip(rates[(True, 64)], raw_rates, strict=True)
        )
        best = max(rates[(True, 64)]) / max(raw_rates)
        say(
            f"group commit @64 / raw single commits: median of rounds {ratio:5.2f}x, "
            f"best of rounds {best:5.2f}x   (goal >= 3x)"
        )

        sizes = (1_000, args.big)
        for size in sizes:
            path = root / f"size-{size}.db"
            say(f"building a database with {size:,} records ...")
            started = time.perf_counter()
            await build_database(path, size, say)
            say(
                f"  built in {time.perf_counter() - started:5.1f} s "
                f"({path.stat().st_size / 1e6:,.0f} MB)"
            )
        medians: dict[int, list[float]] = {size: [] for size in sizes}
        for round_number in range(args.rounds):
            for size in sizes:
                median, p99 = await admission_latency(root / f"size-{size}.db", 2_000, round_number)
                medians[size].append(median)
                say(
                    f"admission latency with {size:>9,} records: median {median * 1e6:7.0f} us, "
                    f"p99 {p99 * 1e6:7.0f} us"
                )
        small, big = statistics.median(medians[1_000]), statistics.median(medians[args.big])
        say(
            f"latency ratio {args.big:,} / 1,000 records: {big / small:4.2f} "
            f"(medians {big * 1e6:.0f} / {small * 1e6:.0f} us)   (goal <= 1.5)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
