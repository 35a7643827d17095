"""Worker journal store benchmark (run by hand; prints figures, asserts nothing).

    .venv/bin/python bench/journal.py [--parts rates backends sizes postgres] [--seconds 2]
                                      [--rounds 5] [--small 1000] [--big 1000000]
                                      [--admissions 2000] [--dir DIR] [--loop uvloop|asyncio]

    smoke run (seconds, no figures):
        --seconds 0.3 --rounds 1 --big 2000 --admissions 200

Parts (all by default), every rate in interleaved rounds on the same disk:

* ``rates``: admissions/s through ``SqliteJournalStore`` with group commit at
  1 and 64 concurrent callers, and the same with one transaction per
  admission (``group_commit=False``). An admission is what a worker does for
  a new operation key: ``load_records`` for the key (absent), then
  ``commit`` of the new ``pending`` row together with the session's state
  document. Baseline: raw SQLite single-row commits/s with the stores'
  pragmas (WAL, ``synchronous=FULL``; one fsync per row, no store around
  it). Goal: group commit at 64 callers >= 3x the raw rate.
* ``backends``: the stores' way to reach SQLite (the stdlib ``sqlite3`` on
  a thread of their own) against aiosqlite (the usual asyncio
  wrapper; decide by measurement). Both run the same statements on one
  connection with the same pragmas: a commit is one ``INSERT`` of a sealed
  row plus a compare-and-swap ``UPDATE`` of the caller's head row whose
  row count is checked, in a transaction. With one caller each commit is
  its own transaction; with 64 callers each backend batches the commits
  waiting while a transaction runs into the next one (group commit): the
  thread drains its queue, aiosqlite is driven by one flusher task.
  aiosqlite hands every statement to its thread and back (four hand-offs
  per commit: BEGIN, INSERT, UPDATE, COMMIT), the own thread one per
  batch. Printed: commits/s, latency p50/p99, CPU per commit of this
  process (all threads), commits per transaction, and the ratios.
  aiosqlite comes with the ``bench`` extra (``pip install -e '.[bench]'``).
* ``sizes``: admission latency (one caller) with ``--small`` and ``--big``
  existing records; each database is built with one bulk insert of sealed
  rows (and the scope head's digest over them, sealed as the store keeps
  it). Goal: latency(big) / latency(small) <= 1.5. Also printed: the time
  to load the scope (``reserve_fence``, which checks every row of the scope
  against its sealed head: O(rows), once per start or reload), the bytes per
  loaded row of the scope's live index (goal <= 32 at 1e6 rows), and the
  admission latency with the live checks against the same run's baseline (the
  same store with the live index dropped after the load; goal <= 1.1x).

* ``postgres``: admissions/s with group commit at 1 and 64 callers through
  ``PostgresJournalStore`` (the test database of
  ``deploy/ensure-postgres.sh``, a schema of its own per measurement,
  dropped at the end) beside ``SqliteJournalStore`` in the same rounds, and
  the ratio PostgreSQL / SQLite per round.

The machine may be shared, so rates run in interleaved rounds; the figures
printed last are medians (a ratio is taken per round) and, for the rates
goal, also the best round of each (the least disturbed measurement, as
timeit does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import shutil
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _commit
import _loop
import blake3
from _pg import PgPlace

from octo_common.records import StorageKeyring, StorageRecordKey, seal_record
from octo_common.states import Pending
from octo_worker.journal import JournalChangeset, JournalRowChange, WorkerOperationRecord
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.postgres import PostgresJournalStore
from octo_worker.storage.sqlite_heads import read_head, update_head
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

    def __init__(self, store: JournalStoreBase, prefix: str) -> None:
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
    path: Path | PgPlace, callers: int, seconds: float, *, group_commit: bool
) -> tuple[float, float]:
    """Returns (admissions/s, change sets per transaction); a ``PgPlace`` is PostgreSQL."""
    store: JournalStoreBase
    if isinstance(path, PgPlace):
        store = PostgresJournalStore(
            path.url,
            keyring(),
            password_file=path.password_file,
            schema=path.schema,
            group_commit=group_commit,
        )
    else:
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
    _commit.configure(connection)
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
    """A store database holding ``records`` sealed journal rows at revision 1, and the
    scope head's digest over them (what the store's commits would have left)."""
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
    head = read_head(connection, SCOPE)
    assert head is not None
    digest = head.digest.copy()
    step = max(records // 10, 1)
    for index in range(records):
        key = f"op-existing-{index}"
        envelope = seal_record(ring, location, 1, record(key).to_row_json(SCOPE))
        batch.append(("worker-journal", SCOPE, key, 1, envelope))
        digest.add("worker-journal", key, 1)
        if len(batch) == 10_000:
            connection.executemany(
                INSERT_ROW,
                batch,
            )
            batch.clear()
        if records >= 100_000 and (index + 1) % step == 0:
            progress(f"  built {index + 1:>9,} / {records:,} rows")
    if batch:
        connection.executemany(
            INSERT_ROW,
            batch,
        )
    update_head(connection, head.sealed(ring, digest=digest))
    connection.execute("COMMIT")
    connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    connection.close()


async def admission_latency(
    path: Path, admissions: int, run: str, *, live: bool = True
) -> tuple[float, float, float, float]:
    """(median, p99) seconds of one caller's admissions against ``path``, the
    seconds ``reserve_fence`` took (the scope checked against its sealed head,
    its live index built) and the live index's bytes per loaded row.

    ``live=False``: the baseline, the same store with the scope's live index
    dropped after the load, so no read or commit is checked against it.
    """
    store = SqliteJournalStore(path, keyring())
    await store.scopes()  # open (and migrate) first: not part of the load
    started = time.perf_counter()
    lease = await store.reserve_fence(SCOPE)
    load = time.perf_counter() - started
    index = store._live[SCOPE]
    per_row = index.nbytes() / max(len(index), 1)
    if not live:
        store._live.clear()
    admitter = Admitter(store, f"latency-{run}")
    revision: int | None = None
    for _ in range(admissions):
        revision = await admitter.admit(lease, f"{SESSION}-latency-{run}", revision)
    await store.close()
    latencies = sorted(admitter.latencies[admissions // 10 :])  # drop warm-up
    return statistics.median(latencies), latencies[int(len(latencies) * 0.99) - 1], load, per_row


# stdlib sqlite3 on its own thread vs aiosqlite ------------------------------------------------

BACKEND_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY, item TEXT UNIQUE, envelope BLOB)",
    "CREATE TABLE IF NOT EXISTS heads (name TEXT PRIMARY KEY, revision INTEGER NOT NULL)",
)
INSERT_ITEM = "INSERT INTO items (item, envelope) VALUES (?, ?)"
HEAD_ROW = "INSERT INTO heads (name, revision) VALUES (?, 0)"
ADVANCE_HEAD = "UPDATE heads SET revision = ? WHERE name = ? AND revision = ?"
ENVELOPE = os.urandom(_commit.ROW_BYTES)


class HeadMoved(Exception):
    """A compare-and-swap of a head row found another revision (never expected here)."""


class ThreadBackend:
    """The stores' pattern: one thread owns the connection; waiting commits share a transaction."""

    name = "stdlib sqlite3, own thread"

    def __init__(self, path: Path, heads: int) -> None:
        self.path, self.heads = path, heads
        self.transactions = 0
        self.queue: queue.SimpleQueue[tuple[str, str, int, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._main, name="bench-sqlite", daemon=True)
        self.ready = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def open(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()
        await asyncio.to_thread(self.ready.wait)

    async def commit(self, head: str, item: str, expected: int) -> None:
        assert self.loop is not None
        future: asyncio.Future[None] = self.loop.create_future()
        self.queue.put((head, item, expected, future))
        await future

    async def close(self) -> None:
        self.queue.put(None)
        await asyncio.to_thread(self.thread.join)

    def _main(self) -> None:
        connection = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        _commit.configure(connection)
        _create_heads(connection, self.heads)
        self.ready.set()
        assert self.loop is not None
        stop = False
        while not stop:
            first = self.queue.get()
            if first is None:
                break
            batch = [first]
            while True:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            error: BaseException | None = None
            try:
                connection.execute("BEGIN IMMEDIATE")
                for head, item, expected, _ in batch:
                    connection.execute(INSERT_ITEM, (item, ENVELOPE))
                    moved = connection.execute(ADVANCE_HEAD, (expected + 1, head, expected))
                    if moved.rowcount != 1:
                        raise HeadMoved(head)
                connection.execute("COMMIT")
            except BaseException as exc:
                error = exc
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
            self.transactions += 1
            self.loop.call_soon_threadsafe(_settle, [work[3] for work in batch], error)
        connection.close()


class AiosqliteBackend:
    """One aiosqlite connection; with ``group``, one flusher task batches waiting commits."""

    name = "aiosqlite"

    def __init__(self, path: Path, heads: int, *, group: bool) -> None:
        self.path, self.heads, self.group = path, heads, group
        self.transactions = 0
        self.connection: Any = None
        self.pending: list[tuple[str, str, int, asyncio.Future[None]]] = []
        self.flusher: asyncio.Task[None] | None = None

    async def open(self) -> None:
        import aiosqlite

        self.connection = connection = await aiosqlite.connect(self.path, isolation_level=None)
        # The same pragmas and schema as the thread backend (_commit.configure, _create_heads).
        cursor = await connection.execute("PRAGMA journal_mode=WAL")
        mode = await cursor.fetchone()
        if mode is None or str(mode[0]).lower() != "wal":
            raise RuntimeError(f"journal_mode is {mode}, not wal")
        await connection.execute("PRAGMA synchronous=FULL")
        await connection.execute(f"PRAGMA busy_timeout={_commit.BUSY_TIMEOUT_MS}")
        await connection.execute("PRAGMA foreign_keys=ON")
        for statement in BACKEND_SCHEMA:
            await connection.execute(statement)
        await connection.executemany(HEAD_ROW, [(f"h{i}",) for i in range(self.heads)])

    async def _transaction(self, batch: list[tuple[str, str, int]]) -> None:
        connection = self.connection
        self.transactions += 1
        await connection.execute("BEGIN IMMEDIATE")
        try:
            for head, item, expected in batch:
                await connection.execute(INSERT_ITEM, (item, ENVELOPE))
                moved = await connection.execute(ADVANCE_HEAD, (expected + 1, head, expected))
                if moved.rowcount != 1:
                    raise HeadMoved(head)
            await connection.execute("COMMIT")
        except BaseException:
            if connection.in_transaction:
                await connection.execute("ROLLBACK")
            raise

    async def commit(self, head: str, item: str, expected: int) -> None:
        if not self.group:
            await self._transaction([(head, item, expected)])
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending.append((head, item, expected, future))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.ensure_future(self._flush())
        await future

    async def _flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending, []
            error: BaseException | None = None
            try:
                await self._transaction([(h, i, e) for h, i, e, _ in batch])
            except Exception as exc:
                error = exc
            _settle([work[3] for work in batch], error)

    async def close(self) -> None:
        await self.connection.close()


def _create_heads(connection: sqlite3.Connection, heads: int) -> None:
    for statement in BACKEND_SCHEMA:
        connection.execute(statement)
    connection.executemany(HEAD_ROW, [(f"h{i}",) for i in range(heads)])


def _settle(futures: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        if future.done():
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


async def backend_rates(
    backend: ThreadBackend | AiosqliteBackend, callers: int, seconds: float
) -> dict[str, float]:
    """commits/s, p50/p99 us, CPU us per commit (this process) and commits per transaction."""
    await backend.open()
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def caller(index: int) -> None:
        head, revision = f"h{index}", 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await backend.commit(head, f"{head}-{revision}", revision)
            latencies.append(time.perf_counter() - started)
            revision += 1

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(callers)))
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu
    await backend.close()
    ordered = sorted(latencies)
    return {
        "rate": len(ordered) / elapsed,
        "p50_us": statistics.median(ordered) * 1e6,
        "p99_us": ordered[max(int(len(ordered) * 0.99) - 1, 0)] * 1e6,
        "cpu_us": cpu / len(ordered) * 1e6,
        "per_tx": len(ordered) / max(backend.transactions, 1),
    }


BACKEND_CASES = (("thread", 1), ("aiosqlite", 1), ("thread", 64), ("aiosqlite", 64))


async def compare_backends(
    root: Path, rounds: int, seconds: float, say: Callable[[str], None]
) -> None:
    try:
        import aiosqlite  # noqa: F401
    except ImportError:
        say("backends: aiosqlite is not installed (pip install -e '.[bench]'); part skipped")
        return
    figures: dict[tuple[str, int], list[dict[str, float]]] = {case: [] for case in BACKEND_CASES}
    for round_number in range(rounds):
        line = [f"backends round {round_number + 1}:"]
        for kind, callers in BACKEND_CASES:
            path = root / f"backend-{kind}-{callers}-{round_number}.db"
            backend: ThreadBackend | AiosqliteBackend = (
                ThreadBackend(path, callers)
                if kind == "thread"
                else AiosqliteBackend(path, callers, group=callers > 1)
            )
            found = await backend_rates(backend, callers, seconds)
            figures[(kind, callers)].append(found)
            line.append(f"{kind}@{callers} {found['rate']:7,.0f}/s")
        say("  ".join(line))
    say(
        f"\n{'backend':<30}{'callers':>8}{'commits/s':>12}{'p50 us':>10}{'p99 us':>10}"
        f"{'CPU us/commit':>15}{'commits/tx':>12}"
    )
    medians: dict[tuple[str, int], dict[str, float]] = {}
    for kind, callers in BACKEND_CASES:
        runs = figures[(kind, callers)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        medians[(kind, callers)] = median
        name = ThreadBackend.name if kind == "thread" else AiosqliteBackend.name
        say(
            f"{name:<30}{callers:>8}{median['rate']:>12,.0f}{median['p50_us']:>10,.0f}"
            f"{median['p99_us']:>10,.0f}{median['cpu_us']:>15,.0f}{median['per_tx']:>12.1f}"
        )
    for callers in (1, 64):
        own, theirs = medians[("thread", callers)], medians[("aiosqlite", callers)]
        say(
            f"aiosqlite / own thread, {callers:>2} caller(s): commits/s "
            f"{theirs['rate'] / own['rate']:.2f}x, p50 {theirs['p50_us'] / own['p50_us']:.2f}x, "
            f"CPU per commit {theirs['cpu_us'] / own['cpu_us']:.2f}x"
        )


def say_rate(
    say: Callable[[str], None], label: str, callers: int, rates: list[float], per_tx: list[float]
) -> None:
    """One medians line: admissions/s and change sets per transaction."""
    say(
        f"admissions/s, {label}, {callers:>2} callers: {statistics.median(rates):10,.0f}"
        f"   ({statistics.median(per_tx):5.1f} change sets per transaction)"
    )


async def rates(root: Path, rounds: int, seconds: float, say: Callable[[str], None]) -> None:
    configurations = [(True, 1), (True, 64), (False, 1), (False, 64)]
    raw_rates: list[float] = []
    found: dict[tuple[bool, int], list[float]] = {key: [] for key in configurations}
    batching: dict[tuple[bool, int], list[float]] = {key: [] for key in configurations}
    for round_number in range(rounds):
        raw_rates.append(raw_commits_per_second(root / f"raw-{round_number}.db", seconds))
        line = [f"round {round_number + 1}: raw {raw_rates[-1]:7,.0f}/s"]
        for group_commit, callers in configurations:
            rate, per_tx = await admissions_per_second(
                root / f"rate-{round_number}-{int(group_commit)}-{callers}.db",
                callers,
                seconds,
                group_commit=group_commit,
            )
            found[(group_commit, callers)].append(rate)
            batching[(group_commit, callers)].append(per_tx)
            line.append(f"{'gc' if group_commit else 'tx'}@{callers} {rate:7,.0f}/s")
        say("  ".join(line))
    raw = statistics.median(raw_rates)
    say(f"raw sqlite synchronous=FULL single-row commits/s: {raw:10,.0f}")
    for group_commit, callers in configurations:
        label = "group commit" if group_commit else "one tx each "
        say_rate(
            say, label, callers, found[(group_commit, callers)], batching[(group_commit, callers)]
        )
    ratio = statistics.median(
        gc / floor for gc, floor in zip(found[(True, 64)], raw_rates, strict=True)
    )
    best = max(found[(True, 64)]) / max(raw_rates)
    say(
        f"group commit @64 / raw single commits: median of rounds {ratio:5.2f}x, "
        f"best of rounds {best:5.2f}x   (goal >= 3x)"
    )


async def postgres_rates(
    root: Path, rounds: int, seconds: float, say: Callable[[str], None]
) -> None:
    """Group-commit admissions/s on PostgreSQL beside SQLite, interleaved, same run."""
    callers = (1, 64)
    backends = ("sqlite", "pg")
    found: dict[tuple[str, int], list[float]] = {(b, c): [] for b in backends for c in callers}
    batching: dict[tuple[str, int], list[float]] = {key: [] for key in found}
    places: list[PgPlace] = []
    try:
        for round_number in range(rounds):
            line = [f"round {round_number + 1}:"]
            for count in callers:
                place = PgPlace(root / "pg")
                places.append(place)
                for backend, where in (
                    ("sqlite", root / f"pgcmp-{round_number}-{count}.db"),
                    ("pg", place),
                ):
                    rate, per_tx = await admissions_per_second(
                        where, count, seconds, group_commit=True
                    )
                    found[(backend, count)].append(rate)
                    batching[(backend, count)].append(per_tx)
                    line.append(f"{backend}@{count} {rate:7,.0f}/s")
            say("  ".join(line))
    finally:
        for place in places:
            await place.drop()
    for count in callers:
        for backend in backends:
            label = f"group commit, {backend:>6}"
            say_rate(say, label, count, found[(backend, count)], batching[(backend, count)])
        ratio = statistics.median(
            pg / lite
            for pg, lite in zip(found[("pg", count)], found[("sqlite", count)], strict=True)
        )
        say(f"PostgreSQL / SQLite admissions at {count:>2} callers: median of rounds {ratio:5.2f}x")


async def sizes(
    root: Path, rounds: int, small: int, big: int, admissions: int, say: Callable[[str], None]
) -> None:
    databases = (("small", small), ("big", big))
    for label, size in databases:
        path = root / f"size-{label}.db"
        say(f"building the {label} database with {size:,} records ...")
        started = time.perf_counter()
        await build_database(path, size, say)
        say(
            f"  built in {time.perf_counter() - started:5.1f} s "
            f"({path.stat().st_size / 1e6:,.0f} MB)"
        )
    medians: dict[str, list[float]] = {label: [] for label, _ in databases}
    ratios: dict[str, list[float]] = {label: [] for label, _ in databases}
    for round_number in range(rounds):
        for label, size in databases:
            path = root / f"size-{label}.db"
            # The same run's baseline (the live index dropped after the load),
            # before or after the live run in turn.
            runs = {}
            for live in (False, True) if round_number % 2 == 0 else (True, False):
                runs[live] = await admission_latency(
                    path, admissions, f"{round_number}-{int(live)}", live=live
                )
            base = runs[False][0]
            median, p99, load, per_row = runs[True]
            medians[label].append(median)
            ratios[label].append(median / base)
            say(
                f"admission latency with {size:>9,} records: median {median * 1e6:7.0f} us "
                f"(baseline without live checks {base * 1e6:7.0f} us, {median / base:4.2f}x), "
                f"p99 {p99 * 1e6:7.0f} us; scope load (reserve_fence) {load:6.2f} s; "
                f"live index {per_row:4.1f} bytes per loaded row"
            )
    for label, size in databases:
        say(
            f"live checks / baseline at {size:,} records: median of rounds "
            f"{statistics.median(ratios[label]):4.2f}x   (goal <= 1.1)"
        )
    low, high = statistics.median(medians["small"]), statistics.median(medians["big"])
    say(
        f"latency ratio {big:,} / {small:,} records: {high / low:4.2f} "
        f"(medians {high * 1e6:.0f} / {low * 1e6:.0f} us)   (goal <= 1.5)"
    )


PARTS = ("rates", "backends", "sizes", "postgres")


async def main(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="octo-bench-", dir=args.dir))

    def say(text: str) -> None:
        print(text, flush=True)

    try:
        say(
            f"octo journal store benchmark in {root} (python {sys.version.split()[0]}, "
            f"sqlite {sqlite3.sqlite_version}, {os.cpu_count()} cpus, loop {args.loop}); "
            f"parts {' '.join(p for p in PARTS if p in args.parts)}; "
            f"{args.rounds} interleaved rounds of {args.seconds:g} s, medians at the end"
        )
        if "rates" in args.parts:
            await rates(root, args.rounds, args.seconds, say)
        if "backends" in args.parts:
            await compare_backends(root, args.rounds, args.seconds, say)
        if "sizes" in args.parts:
            await sizes(root, args.rounds, args.small, args.big, args.admissions, say)
        if "postgres" in args.parts:
            await postgres_rates(root, args.rounds, args.seconds, say)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--dir", type=Path, default=None, help="where to put the databases")
    parser.add_argument("--seconds", type=float, default=2.0, help="duration of each rate run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--small", type=int, default=1_000, help="records, small database")
    parser.add_argument("--big", type=int, default=1_000_000, help="records, big database")
    parser.add_argument(
        "--admissions", type=int, default=2_000, help="admissions per latency measurement"
    )
    parser.add_argument(
        "--loop",
        choices=_loop.CHOICES,
        default=os.environ.get("OCTO_BENCH_LOOP", "uvloop"),
        help="event loop (default uvloop, the worker daemon's)",
    )
    args = parser.parse_args(argv)
    if min(args.small, args.big) < 0 or args.admissions < 10:
        parser.error("record counts must be >= 0 and --admissions >= 10")
    return args


if __name__ == "__main__":
    arguments = parse_args()
    os.environ["OCTO_BENCH_LOOP"] = arguments.loop
    _loop.run(main(arguments))
