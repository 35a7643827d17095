"""PostgreSQL driver comparison: asyncpg vs psycopg 3 (async), in one run.

    .venv/bin/python bench/pg_driver.py [--url URL] [--seconds 1.5] [--rounds 5]

Needs both drivers (``pip install asyncpg 'psycopg[binary]'``) and the test
database of ``deploy/ensure-postgres.sh``. Prints figures, asserts nothing.

Two workloads, each on one connection with ``synchronous_commit = on`` (every
COMMIT waits for the WAL flush), statements prepared once:

* ``single``: one conditional upsert per transaction, committed alone (the
  floor: one WAL flush per write);
* ``group64``: ``BEGIN``, 64 such upserts awaited one after the other (as a
  group-commit transaction runs its callers' writes), ``COMMIT``; reported
  as writes/s;
* ``batch64``: the same 64 upserts sent without waiting for each answer:
  asyncpg's ``executemany`` (no per-row outcome) and psycopg's pipeline
  mode (each statement still has its own result).

The upsert is the shape of a ledger write: insert a row, or replace it when
its stored revision is the expected one. The machine may be shared, so the
drivers run in interleaved rounds and the medians are printed, with the
best round of each beside them. Everything runs in a schema of its own,
dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

DEFAULT_URL = "postgresql://octo_test@127.0.0.1:5432/octo_test"
DEFAULT_PASSWORD = "octo-test"  # the public test password of deploy/ensure-postgres.sh
GROUP = 64
WORKLOADS = ("single", "group64", "batch64")
ENVELOPE = b"x" * 300  # about the size of a small sealed ledger record

UPSERT = (
    "INSERT INTO {schema}.rows (name, revision, envelope) VALUES ($1, $2, $3) "
    "ON CONFLICT (name) DO UPDATE SET revision = excluded.revision, envelope = excluded.envelope "
    "WHERE rows.revision = excluded.revision - 1"
)


async def setup(url: str, password: str, schema: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url, password=password)
    try:
        await connection.execute(f"CREATE SCHEMA {schema}")
        await connection.execute(
            f"CREATE TABLE {schema}.rows (name TEXT PRIMARY KEY, revision BIGINT NOT NULL, "
            "envelope BYTEA NOT NULL)"
        )
    finally:
        await connection.close()


async def teardown(url: str, password: str, schema: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url, password=password)
    try:
        await connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await connection.close()


class Counter:
    """Names of fresh rows: every write inserts revision 1 of a new name."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.next = 0

    def take(self) -> str:
        self.next += 1
        return f"{self.prefix}-{self.next}"


async def timed(seconds: float, step: Callable[[], Awaitable[int]]) -> float:
    """Writes/s of ``step`` (which returns how many writes it committed) over ``seconds``."""
    writes = 0
    started = time.perf_counter()
    deadline = started + seconds
    while time.perf_counter() < deadline:
        writes += await step()
    return writes / (time.perf_counter() - started)


async def asyncpg_rates(url: str, password: str, schema: str, seconds: float) -> dict[str, float]:
    import asyncpg

    connection = await asyncpg.connect(
        url, password=password, server_settings={"synchronous_commit": "on"}
    )
    try:
        statement = await connection.prepare(UPSERT.format(schema=schema))
        names = Counter(f"apg-{uuid.uuid4().hex[:8]}")

        async def single() -> int:
            await statement.fetch(names.take(), 1, ENVELOPE)  # autocommit: one COMMIT
            return 1

        async def group() -> int:
            async with connection.transaction():
                for _ in range(GROUP):
                    await statement.fetch(names.take(), 1, ENVELOPE)
            return GROUP

        async def batched() -> int:
            async with connection.transaction():
                await statement.executemany([(names.take(), 1, ENVELOPE) for _ in range(GROUP)])
            return GROUP

        return {
            "single": await timed(seconds, single),
            "group64": await timed(seconds, group),
            "batch64": await timed(seconds, batched),
        }
    finally:
        await connection.close()


async def psycopg_rates(url: str, password: str, schema: str, seconds: float) -> dict[str, float]:
    import psycopg

    connection = await psycopg.AsyncConnection.connect(
        url, password=password, autocommit=True, options="-c synchronous_commit=on"
    )
    try:
        query: Any = UPSERT.format(schema=schema).replace("$1", "%s").replace("$2", "%s")
        query = query.replace("$3", "%s")
        names = Counter(f"pg3-{uuid.uuid4().hex[:8]}")
        cursor = connection.cursor()

        async def single() -> int:
            await cursor.execute(query, (names.take(), 1, ENVELOPE), prepare=True)
            return 1

        async def group() -> int:
            async with connection.transaction():
                for _ in range(GROUP):
                    await cursor.execute(query, (names.take(), 1, ENVELOPE), prepare=True)
            return GROUP

        async def batched() -> int:
            async with connection.transaction(), connection.pipeline():
                for _ in range(GROUP):
                    await cursor.execute(query, (names.take(), 1, ENVELOPE), prepare=True)
            return GROUP

        return {
            "single": await timed(seconds, single),
            "group64": await timed(seconds, group),
            "batch64": await timed(seconds, batched),
        }
    finally:
        await connection.close()


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("OCTO_TEST_POSTGRES_URL", DEFAULT_URL))
    parser.add_argument("--seconds", type=float, default=1.5, help="per workload per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    try:
        import asyncpg
        import psycopg
    except ImportError as exc:
        print(f"needs both drivers: {exc}", file=sys.stderr)
        return 2
    password = os.environ.get("OCTO_TEST_POSTGRES_PASSWORD", DEFAULT_PASSWORD)
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    await setup(args.url, password, schema)
    runs: dict[str, list[dict[str, float]]] = {"asyncpg": [], "psycopg": []}
    try:
        for _ in range(args.rounds):
            runs["asyncpg"].append(await asyncpg_rates(args.url, password, schema, args.seconds))
            runs["psycopg"].append(await psycopg_rates(args.url, password, schema, args.seconds))
    finally:
        await teardown(args.url, password, schema)
    print(f"asyncpg {asyncpg.__version__}, psycopg {psycopg.__version__}; {args.rounds} rounds")
    print(f"{'driver':<10}{'workload':<10}{'median w/s':>12}{'best w/s':>12}")
    for driver, rounds in runs.items():
        for workload in WORKLOADS:
            figures = [r[workload] for r in rounds]
            print(
                f"{driver:<10}{workload:<10}{statistics.median(figures):>12.0f}"
                f"{max(figures):>12.0f}"
            )
    for workload in WORKLOADS:
        pairs = zip(runs["asyncpg"], runs["psycopg"], strict=True)
        ratios = [a[workload] / p[workload] for a, p in pairs]
        print(f"asyncpg/psycopg {workload}: median ratio {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
