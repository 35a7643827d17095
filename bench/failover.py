"""Worker failover time on a shared PostgreSQL journal: kill to first answer.

    .venv/bin/python bench/failover.py [--kills 5] [--warm 4]

Real processes, the real broker and the PostgreSQL test database of
``deploy/ensure-postgres.sh`` (a schema of its own, dropped at the end). One
scope is served by a chain of worker daemons (``tests/faults/_worker_main.py``,
the daemon as ``octo-worker run`` runs it) sharing the journal and the
``files.publish`` directory: the owner and one standby run at any time. For
each of ``--kills`` rounds the host (a ``HostClient`` in this process, one
session for the whole run) has ``--warm`` operations answered by the owner,
then the owner is SIGKILLed and one operation is dispatched at once; the
failover time is from the kill to that operation's ``succeeded``: the broker
sees the dead connection, makes the standby the active consumer, which
reserves the next fence, restores the session from PostgreSQL, republishes
the outbox and serves. A fresh standby is started after every round. Printed:
each round, the median (goal <= 5 s) and, as the same-run baseline, the
median round trip of the warm operations (one operation with no failover).

Prints figures, asserts nothing but the answers being ``succeeded``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import structlog

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octo_common.states import Succeeded
from tests.faults.conftest import Launcher
from tests.faults.failover import FailoverEnv, manifest, payload, record_run
from tests.postgres import URL as PG_URL
from tests.postgres import PostgresSchema, unique_schema, write_password_file


async def measure(root: Path, kills: int, warm: int) -> tuple[list[float], list[float]]:
    place = PostgresSchema(PG_URL, write_password_file(root / "pg"), unique_schema())
    env = FailoverEnv.create(root, place, workers=kills + 2)
    launcher = Launcher(root / "runners")
    client = env.client(reply_timeout=30.0)
    tag = uuid.uuid4().hex[:8]
    failovers: list[float] = []
    round_trips: list[float] = []
    runners = []
    try:
        for index in (0, 1):
            runner = await launcher.take("worker", None)
            runner.send(str(env.configs[index]))
            await runner.expect("ready")
            runners.append(runner)
        await client.start()
        _, run, keys = await record_run(client, kills * (warm + 1), tag)
        session = await client.open_session(env.scope, manifest())
        ops = iter(enumerate(keys))

        async def one() -> float:
            index, key = next(ops)
            started = time.perf_counter()
            state = await client.dispatch(session, run, key, payload(index, tag))
            assert isinstance(state, Succeeded), state
            return time.perf_counter() - started

        for round_number in range(kills):
            for _ in range(warm):
                round_trips.append(await one())
            owner = runners[round_number]
            killed = time.perf_counter()
            owner.kill_now()
            await one()
            failovers.append(time.perf_counter() - killed)
            print(
                f"round {round_number + 1}: kill -> first answer by the standby "
                f"{failovers[-1]:.3f} s (fence {await env.fence()})",
                flush=True,
            )
            standby = await launcher.take("worker", None)
            standby.send(str(env.configs[round_number + 2]))
            await standby.expect("ready")
            runners.append(standby)
    finally:
        await client.close()
        await client.store.close()
        for runner in runners:
            await runner.stop()
        launcher.close()
        await env.delete_queues()
        await place.drop()
    return failovers, round_trips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=5, help="failovers measured (median)")
    parser.add_argument("--warm", type=int, default=4, help="operations before each kill")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory(prefix="octo-failover-") as tmp:
        failovers, round_trips = asyncio.run(measure(Path(tmp), args.kills, max(1, args.warm)))
    median = statistics.median(failovers)
    baseline = statistics.median(round_trips)
    print(
        f"failover, kill -> first operation completed by the standby: median {median:.3f} s "
        f"of {len(failovers)} (min {min(failovers):.3f}, max {max(failovers):.3f}); "
        f"goal <= 5 s: {'met' if median <= 5.0 else 'NOT met'}"
    )
    print(f"baseline: one operation without failover, median round trip {baseline * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
