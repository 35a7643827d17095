"""The far end of the plain aio-pika request/reply baseline (run by bench/baselines.py).

    OCTO_BENCH_BROKER=amqp://... python bench/_rpc_peer.py REQUEST_QUEUE PREFETCH

(the broker URL travels in the environment, never on the command line).

Consumes REQUEST_QUEUE with manual acks; for each request publishes the body
back to its ``reply_to`` through the default exchange (publisher-confirmed,
mandatory, not persistent), waits for the confirm, then acks the request —
the same ordering the Octo worker uses for answers, without any
journal, session or frame work. Prints ``ready`` once consuming and stops on
SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import _loop
import aio_pika
from aio_pika.abc import AbstractIncomingMessage


async def serve(url: str, request_queue: str, prefetch: int) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    await channel.set_qos(prefetch_count=prefetch)
    queue = await channel.get_queue(request_queue, ensure=True)
    exchange = channel.default_exchange

    async def on_request(message: AbstractIncomingMessage) -> None:
        if message.reply_to:
            await exchange.publish(
                aio_pika.Message(
                    message.body,
                    correlation_id=message.correlation_id,
                    delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                ),
                routing_key=message.reply_to,
                mandatory=True,
            )
        await message.ack()

    await queue.consume(on_request, no_ack=False)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await connection.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    url = os.environ.get("OCTO_BENCH_BROKER", "amqp://127.0.0.1:5672/")
    _loop.run(serve(url, argv[1], int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
