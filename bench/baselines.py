"""Baselines for the end-to-end benchmark, measured on the same broker and machine.

Two reference points for an Octo round trip (host publish -> worker ->
reply), each a request/reply between two processes over RabbitMQ on
127.0.0.1, with a fixed number of requests in flight:

* :func:`run_aiopika_ceiling`: plain aio-pika, the fastest an asyncio
  request/reply can go here. The peer (``bench/_rpc_peer.py``, a separate
  process) consumes a request queue with manual acks and answers each request
  with a publisher-confirmed publish to ``reply_to`` before acking it. The
  client publishes each request confirmed and mandatory and acks each reply.
  No persistence (transient messages on classic queues), no frames,
  no journal: whatever Octo costs above this is Octo's own work.
* :func:`run_celery`: Celery on the same broker (``bench/celery_app.py``) with
  ``task_acks_late=True`` and the ``rpc://`` result backend; a no-op task
  awaited with the same number in flight. The worker is a separate
  ``celery worker`` process; the default pool is ``threads`` with 4 threads
  (on 2 cores it beat prefork with 2 processes for a no-op task: no
  parent/child pipe hop per task; ``pool="prefork"`` is there to compare).
  Its prefetch is raised so the worker can hold every in-flight task.

Each returns ``{"ops_per_s", "p50_ms", "p99_ms"}``: completed round trips per
second of wall time, and the median and 99th percentile round-trip latency
(publish to reply in hand). A short warm-up precedes every measurement.

    python bench/baselines.py [--total 3000] [--runs 3]

prints both baselines at 1 and 64 in flight (medians over ``--runs``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import _loop
import aio_pika
from aio_pika.abc import AbstractIncomingMessage

BROKER_URL = os.environ.get("OCTO_BENCH_BROKER", "amqp://127.0.0.1:5672/")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEER = HERE / "_rpc_peer.py"
BODY_BYTES = 512  # about the size of a sealed Octo dispatch frame
CELERY_POOL = "threads"
CELERY_CONCURRENCY = 4


def summarize(latencies: list[float], elapsed: float) -> dict[str, float]:
    """ops/s over the measured wall time; p50/p99 by nearest rank, in ms."""
    ordered = sorted(latencies)

    def rank(q: float) -> float:
        return ordered[max(math.ceil(q * len(ordered)) - 1, 0)] * 1000.0

    return {
        "ops_per_s": round(len(ordered) / elapsed, 1),
        "p50_ms": round(rank(0.50), 3),
        "p99_ms": round(rank(0.99), 3),
    }


def _warmup_count(total: int, in_flight: int) -> int:
    return max(min(total // 10, 500), in_flight)


# Plain aio-pika ------------------------------------------------------------------------


async def _start_peer(
    url: str, request_queue: str, prefetch: int, peer: Path = PEER
) -> asyncio.subprocess.Process:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(peer),
        request_queue,
        str(prefetch),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "OCTO_BENCH_BROKER": url},
    )
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    if line.strip() != b"ready":
        process.kill()
        await process.wait()
        raise RuntimeError(f"the peer {peer.name} did not start")
    return process


async def _stop_peer(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            process.kill()
            await process.wait()


async def aiopika_ceiling(
    in_flight: int, total: int, *, url: str = BROKER_URL, body_bytes: int = BODY_BYTES
) -> dict[str, float]:
    """The async form of :func:`run_aiopika_ceiling`."""
    if in_flight < 1 or total < in_flight:
        raise ValueError("need in_flight >= 1 and total >= in_flight")
    request_queue = f"octo.bench.rpc.{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(url, timeout=10)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.set_qos(prefetch_count=max(in_flight * 2, 16))
        # Durable queue, transient messages: RabbitMQ 4.3 refuses transient
        # non-exclusive queues; x-expires cleans up after a crashed run.
        await channel.declare_queue(request_queue, durable=True, arguments={"x-expires": 600_000})
        replies = await channel.declare_queue(exclusive=True)
        peer = await _start_peer(url, request_queue, prefetch=in_flight)
        try:
            return await _drive_aiopika(
                channel, request_queue, replies, in_flight, total, body_bytes
            )
        finally:
            await _stop_peer(peer)
            await channel.queue_delete(request_queue)
    finally:
        await connection.close()


async def _drive_aiopika(
    channel: aio_pika.abc.AbstractChannel,
    request_queue: str,
    replies: aio_pika.abc.AbstractQueue,
    in_flight: int,
    total: int,
    body_bytes: int,
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_reply(message: AbstractIncomingMessage) -> None:
        await message.ack()
        future = waiting.pop(message.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_result(None)

    await replies.consume(on_reply, no_ack=False)
    exchange = channel.default_exchange
    body = b"x" * body_bytes
    ids = itertools.count()
    latencies: list[float] = []

    async def round_trip(record: bool) -> None:
        correlation_id = str(next(ids))
        answered: asyncio.Future[None] = loop.create_future()
        waiting[correlation_id] = answered
        started = time.perf_counter()
        await exchange.publish(
            aio_pika.Message(
                body,
                correlation_id=correlation_id,
                reply_to=replies.name,
                delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            ),
            routing_key=request_queue,
            mandatory=True,
        )
        await asyncio.wait_for(answered, 30)
        if record:
            latencies.append(time.perf_counter() - started)

    async def run(count: int, record: bool) -> float:
        shares = [
            count // in_flight + (1 if i < count % in_flight else 0) for i in range(in_flight)
        ]

        async def lane(n: int) -> None:
            for _ in range(n):
                await round_trip(record)

        started = time.perf_counter()
        await asyncio.gather(*(lane(n) for n in shares))
        return time.perf_counter() - started

    await run(_warmup_count(total, in_flight), record=False)
    elapsed = await run(total, record=True)
    return summarize(latencies, elapsed)


def run_aiopika_ceiling(in_flight: int, total: int, *, url: str = BROKER_URL) -> dict[str, float]:
    """Plain aio-pika request/reply between two processes (see the module doc).

    Blocking: runs its own event loop, so call it outside a running loop
    (``await aiopika_ceiling(...)`` from async code).
    """
    return _loop.run(aiopika_ceiling(in_flight, total, url=url))


# Celery ------------------------------------------------------------------------------


def _celery_client(url: str) -> Any:
    from celery import Celery

    client = Celery("octo_bench_client", broker=url, backend="rpc://")
    client.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_persistent=False,
        broker_connection_retry_on_startup=True,
    )
    return client


def _start_celery_worker(
    url: str, queue: str, pool: str, concurrency: int, prefetch_multiplier: int
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.celery_app",
        "worker",
        f"--pool={pool}",
        f"--concurrency={concurrency}",
        f"--prefetch-multiplier={prefetch_multiplier}",
        "-Q",
        queue,
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel=WARNING",
    ]
    env = {**os.environ, "OCTO_BENCH_BROKER": url, "OCTO_BENCH_CELERY_QUEUE": queue}
    return subprocess.Popen(  # fixed argv, no shell
        argv,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: prefork children stop with it
    )


def _stop_celery_worker(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


def run_celery(
    in_flight: int,
    total: int,
    *,
    url: str = BROKER_URL,
    pool: str = CELERY_POOL,
    concurrency: int = CELERY_CONCURRENCY,
) -> dict[str, float]:
    """Celery no-op tasks with ``in_flight`` outstanding (see the module doc).

    The client keeps a window of ``in_flight`` sent tasks and waits for the
    oldest one's result before sending the next, so latencies of later tasks
    include no wait on earlier ones beyond Celery's own ordering.
    """
    if in_flight < 1 or total < in_flight:
        raise ValueError("need in_flight >= 1 and total >= in_flight")
    queue = f"octo.bench.celery.{uuid.uuid4().hex[:12]}"
    prefetch_multiplier = max(1, math.ceil(in_flight / concurrency))
    worker = _start_celery_worker(url, queue, pool, concurrency, prefetch_multiplier)
    client = _celery_client(url)
    try:
        # The first result also waits for the worker to come up.
        client.send_task("octo_bench.noop", args=(0,), queue=queue).get(timeout=60)
        _celery_window(client, queue, in_flight, _warmup_count(total, in_flight), record=None)
        latencies: list[float] = []
        started = time.perf_counter()
        _celery_window(client, queue, in_flight, total, record=latencies)
        elapsed = time.perf_counter() - started
        return summarize(latencies, elapsed)
    finally:
        _stop_celery_worker(worker)
        with client.connection_for_write() as connection:
            connection.default_channel.queue_delete(queue)
        client.close()


def _celery_window(
    client: Any, queue: str, in_flight: int, count: int, record: list[float] | None
) -> None:
    window: collections.deque[tuple[Any, float]] = collections.deque()
    sent = 0
    while sent < count or window:
        while sent < count and len(window) < in_flight:
            started = time.perf_counter()
            result = client.send_task("octo_bench.noop", args=(sent,), queue=queue)
            window.append((result, started))
            sent += 1
        result, started = window.popleft()
        result.get(timeout=60)
        if record is not None:
            record.append(time.perf_counter() - started)


# Command line ------------------------------------------------------------------------


def _median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total", type=int, default=3000, help="round trips per measurement")
    parser.add_argument("--runs", type=int, default=1, help="report the median of this many")
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--celery-pool", default=CELERY_POOL)
    parser.add_argument("--celery-concurrency", type=int, default=CELERY_CONCURRENCY)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)

    results: dict[str, dict[str, float]] = {}
    for in_flight in args.in_flight:
        pika_runs = [run_aiopika_ceiling(in_flight, args.total) for _ in range(args.runs)]
        results[f"aiopika_ceiling@{in_flight}"] = _median_of(pika_runs)
        celery_runs = [
            run_celery(
                in_flight,
                args.total,
                pool=args.celery_pool,
                concurrency=args.celery_concurrency,
            )
            for _ in range(args.runs)
        ]
        results[f"celery_{args.celery_pool}{args.celery_concurrency}@{in_flight}"] = _median_of(
            celery_runs
        )
    if args.json:
        print(json.dumps(results, sort_keys=True))
        return 0
    print(f"{'baseline':<28}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for name, figures in results.items():
        print(
            f"{name:<28}{figures['ops_per_s']:>10.1f}"
            f"{figures['p50_ms']:>10.3f}{figures['p99_ms']:>10.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
