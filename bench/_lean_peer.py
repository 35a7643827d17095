"""The far end of the lean durable ceiling (run by bench/e2e.py): Octo's lean AMQP client.

    OCTO_BENCH_BROKER=amqp://... python bench/_lean_peer.py REQUEST_QUEUE PREFETCH

(the broker URL travels in the environment, never on the command line).

Consumes REQUEST_QUEUE (a quorum queue) with manual acks; for each request
publishes the body back to its ``reply_to`` through the default exchange,
persistent, mandatory and publisher-confirmed, waits for the confirm, then
acks the request: the Octo worker's order on the same client the
worker uses, without journal, session or frame work. Prints ``ready`` once
consuming and stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import _loop

from octo_common.runtime import amqp


async def serve(url: str, request_queue: str, prefetch: int) -> None:
    connection = await amqp.connect(url, name="octo-bench-lean-peer")
    publish = await connection.channel(publisher_confirms=True)
    consume = await connection.channel()
    await consume.set_qos(prefetch_count=prefetch)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def answer(delivery: amqp.AmqpDelivery) -> None:
        if delivery.reply_to:
            outcome = await publish.publish(
                "",
                delivery.reply_to,
                delivery.body,
                amqp.Properties(correlation_id=delivery.correlation_id, delivery_mode=2),
            )
            if outcome != amqp.ACKED:
                await delivery.reject(requeue=True)
                return
        await delivery.ack()

    def on_request(delivery: amqp.AmqpDelivery) -> None:
        task = loop.create_task(answer(delivery))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    await consume.consume(request_queue, on_request)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await connection.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    url = os.environ.get("OCTO_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/")
    _loop.run(serve(url, argv[1], int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
