"""AMQP clients on Octo's hot path, same run: aiormq (as Octo called it), pika's
asyncio connection, and Octo's own lean client (``octo_common.runtime.amqp``).

    .venv/bin/python bench/amqp_clients.py [--total 5000] [--runs 3] [--window 64]

Each round measures every client in turn (interleaved), on a fresh quorum
queue of the shared broker:

* publish: ``--total`` persistent, mandatory, publisher-confirmed publishes
  of a 512-byte body with Octo's headers, ``--window`` in flight;
* consume + ack: the same messages consumed with prefetch ``--window``,
  each acked from its delivery callback.

Printed per client and phase: the client process's CPU per message (user +
system, microseconds), messages per second, and socket writes per message
where the client counts them (the lean client does). Medians over
``--runs`` with min-max. The broker's CPU is not included (``bench/e2e.py``
reports it for whole round trips). pika is the ``bench`` extra; without
it its rows are skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _loop  # noqa: E402
import aio_pika  # noqa: E402
from aiormq.abc import DeliveredMessage  # noqa: E402

from octo_common.runtime import amqp  # noqa: E402
from octo_common.runtime.broker import frame_properties  # noqa: E402

URL = "amqp://guest:guest@127.0.0.1:5672/"
BODY = b"x" * 512
HEADERS = {
    "octo-protocol": "octo.v5",
    "octo-scope": "bench",
    "octo-session": "s" * 43,
    "octo-key-nonce": "n" * 22,
}
QUORUM = {"x-queue-type": "quorum"}

Phase = dict[str, float]


def _measure_start() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _measure_end(start: tuple[float, float], total: int, writes: int | None) -> Phase:
    cpu = time.process_time() - start[0]
    wall = time.perf_counter() - start[1]
    result = {"cpu_us": cpu / total * 1e6, "per_s": total / wall}
    if writes is not None:
        result["writes"] = writes / total
    return result


async def _windowed(total: int, window: int, one: Callable[[int], Awaitable[None]]) -> None:
    counter = iter(range(total))

    async def lane() -> None:
        for i in counter:
            await one(i)

    await asyncio.gather(*(lane() for _ in range(window)))


async def bench_aiormq(queue: str, total: int, window: int) -> dict[str, Phase]:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        await channel.declare_queue(queue, durable=True, arguments=QUORUM)
        underlay = await channel.get_underlay_channel()

        async def publish(i: int) -> None:
            properties = frame_properties(f"m{i}", None, None, HEADERS)
            await underlay.basic_publish(
                BODY, exchange="", routing_key=queue, properties=properties, mandatory=True
            )

        start = _measure_start()
        await _windowed(total, window, publish)
        published = _measure_end(start, total, None)

        consume = await connection.channel(publisher_confirms=False)
        await consume.set_qos(prefetch_count=window)
        low = await consume.get_underlay_channel()
        done = asyncio.get_running_loop().create_future()
        count = 0

        async def deliver(message: DeliveredMessage) -> None:
            nonlocal count
            await low.basic_ack(message.delivery_tag or 0, wait=False)
            count += 1
            if count == total and not done.done():
                done.set_result(None)

        start = _measure_start()
        await low.basic_consume(queue, deliver, no_ack=False)
        await done
        consumed = _measure_end(start, total, None)
        await channel.queue_delete(queue)
    finally:
        await connection.close()
    return {"publish": published, "consume_ack": consumed}


async def bench_lean(queue: str, total: int, window: int) -> dict[str, Phase]:
    connection = await amqp.connect(URL, name="bench-lean")
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments=QUORUM)

        async def publish(i: int) -> None:
            properties = amqp.Properties(
                content_type="application/octo+json",
                delivery_mode=2,
                headers=dict(HEADERS),
                message_id=f"m{i}",
            )
            outcome = await channel.publish("", queue, BODY, properties, mandatory=True)
            if outcome != amqp.ACKED:
                raise RuntimeError(f"publish outcome {outcome}")

        writes = connection.writes
        start = _measure_start()
        await _windowed(total, window, publish)
        published = _measure_end(start, total, connection.writes - writes)

        consume = await connection.channel()
        await consume.set_qos(window)
        done = asyncio.get_running_loop().create_future()
        count = 0

        def deliver(message: amqp.AmqpDelivery) -> None:
            nonlocal count
            consume.ack(message.delivery_tag)
            count += 1
            if count == total and not done.done():
                done.set_result(None)

        writes = connection.writes
        start = _measure_start()
        await consume.consume(queue, deliver)
        await done
        consumed = _measure_end(start, total, connection.writes - writes)
        cleanup = await connection.channel()
        from pamqp import commands

        await cleanup.rpc(commands.Queue.Delete(queue=queue), (commands.Queue.DeleteOk,))
    finally:
        await connection.close()
    return {"publish": published, "consume_ack": consumed}


async def bench_pika(queue: str, total: int, window: int) -> dict[str, Phase]:
    import pika
    from pika.adapters.asyncio_connection import AsyncioConnection

    loop = asyncio.get_running_loop()

    def waiter() -> tuple[asyncio.Future[Any], Callable[..., None]]:
        future: asyncio.Future[Any] = loop.create_future()

        def resolve(*args: Any) -> None:
            if not future.done():
                future.set_result(args[0] if args else None)

        return future, resolve

    opened, on_open = waiter()

    def on_error(_: Any, error: Any) -> None:
        if not opened.done():
            opened.set_exception(RuntimeError(f"pika could not connect: {error}"))

    connection = AsyncioConnection(
        pika.URLParameters(URL),
        on_open_callback=on_open,
        on_open_error_callback=on_error,
        custom_ioloop=loop,
    )
    await opened
    try:
        got, resolve = waiter()
        connection.channel(on_open_callback=resolve)
        channel = await got
        got, resolve = waiter()
        channel.queue_declare(queue, durable=True, arguments=QUORUM, callback=resolve)
        await got

        pending: dict[int, asyncio.Future[None]] = {}

        def on_confirm(frame: Any) -> None:
            method = frame.method
            tags = (
                [t for t in pending if t <= method.delivery_tag]
                if method.multiple
                else [method.delivery_tag]
            )
            for tag in tags:
                future = pending.pop(tag, None)
                if future is not None:
                    future.set_result(None)

        got, resolve = waiter()
        channel.confirm_delivery(ack_nack_callback=on_confirm, callback=resolve)
        await got
        next_tag = 0

        async def publish(i: int) -> None:
            nonlocal next_tag
            properties = pika.BasicProperties(
                content_type="application/octo+json",
                delivery_mode=2,
                headers=dict(HEADERS),
                message_id=f"m{i}",
            )
            next_tag += 1
            future = loop.create_future()
            pending[next_tag] = future
            channel.basic_publish("", queue, BODY, properties=properties, mandatory=True)
            await future

        start = _measure_start()
        await _windowed(total, window, publish)
        published = _measure_end(start, total, None)

        got, resolve = waiter()
        connection.channel(on_open_callback=resolve)
        consume = await got
        got, resolve = waiter()
        consume.basic_qos(prefetch_count=window, callback=resolve)
        await got
        done = loop.create_future()
        count = 0

        def deliver(ch: Any, method: Any, properties: Any, body: bytes) -> None:
            nonlocal count
            ch.basic_ack(method.delivery_tag)
            count += 1
            if count == total and not done.done():
                done.set_result(None)

        start = _measure_start()
        consume.basic_consume(queue, deliver)
        await done
        consumed = _measure_end(start, total, None)
        got, resolve = waiter()
        channel.queue_delete(queue, callback=resolve)
        await got
    finally:
        closed, on_closed = waiter()
        connection.add_on_close_callback(on_closed)
        connection.close()
        await closed
    return {"publish": published, "consume_ack": consumed}


CLIENTS: dict[str, Callable[[str, int, int], Awaitable[dict[str, Phase]]]] = {
    "aiormq (as Octo called it)": bench_aiormq,
    "pika AsyncioConnection": bench_pika,
    "Octo lean (asyncio.Protocol + struct/pamqp)": bench_lean,
}


def _fmt(values: list[float], digits: int = 1) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f})"


async def main(total: int, runs: int, window: int) -> None:
    try:
        import pika  # noqa: F401
    except ImportError:
        CLIENTS.pop("pika AsyncioConnection")
        print("pika is not installed (the bench extra): its rows are skipped")
    results: dict[str, list[dict[str, Phase]]] = {name: [] for name in CLIENTS}
    for _ in range(runs):
        for name, bench in CLIENTS.items():
            queue = f"octo.bench.clients.{uuid.uuid4().hex[:10]}"
            results[name].append(await bench(queue, total, window))
    print(
        f"\n{total} messages, {window} in flight, {runs} run(s), loop {_loop.name()}; "
        "medians (min-max); client CPU per message"
    )
    print(
        f"{'client':46} | {'publish us':>22} | {'publish msg/s':>22} | "
        f"{'consume+ack us':>22} | {'consume msg/s':>22} | writes/msg"
    )
    for name, rows in results.items():
        pub = [r["publish"] for r in rows]
        con = [r["consume_ack"] for r in rows]
        writes = ""
        if "writes" in pub[0]:
            writes = (
                f"{statistics.median(p['writes'] for p in pub):.3f} / "
                f"{statistics.median(c['writes'] for c in con):.3f}"
            )
        print(
            f"{name:46} | {_fmt([p['cpu_us'] for p in pub]):>22} | "
            f"{_fmt([p['per_s'] for p in pub], 0):>22} | "
            f"{_fmt([c['cpu_us'] for c in con]):>22} | "
            f"{_fmt([c['per_s'] for c in con], 0):>22} | {writes}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=int, default=64)
    args = parser.parse_args()
    _loop.run(main(args.total, args.runs, args.window))
