"""Broker queue gauges for the metrics endpoint, refreshed on an interval.

Owns: the loop that, every ``[metrics] queue_refresh_seconds`` while the
daemon is connected, asks the broker for the ready-message and consumer
counts of each configured scope's worker queue and of ``octo.v5.dead``
(passive declares, :func:`octo_worker.daemon.topology.describe_topology`) and sets
``octo_queue_messages{queue}``, ``octo_queue_consumers{queue}`` and
``octo_queue_refresh_timestamp_seconds``. The consumer count is the broker's,
so it covers every worker of a scope, not only this one: it is what tells an
operator that no worker consumes a scope queue, and the message count of
``octo.v5.dead`` is the dead-letter queue's depth.

It must never: declare, bind or change anything on the broker; run on a
delivery's path or use the channels the daemon consumes and publishes on (a
passive declare of a missing queue closes its channel, so each refresh
opens and closes a channel of its own); let a broker error or a slow broker
end the loop or hold the daemon (each refresh is bounded by a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import aiormq
import structlog
from aio_pika.abc import AbstractConnection

from octo_common.errors import OctoError
from octo_common.runtime import amqp
from octo_worker.daemon.metrics import WorkerMetrics
from octo_worker.daemon.topology import describe_queues, describe_topology

__all__ = ["refresh_queue_gauges", "watch_queues"]

_log = structlog.get_logger("octo.worker")


async def refresh_queue_gauges(
    connection: AbstractConnection | amqp.Connection,
    scopes: Sequence[str],
    metrics: WorkerMetrics,
) -> None:
    """One refresh: passive declares on a fresh channel, then the gauges."""
    if isinstance(connection, amqp.Connection):
        statuses = await describe_queues(connection, scopes)
    else:
        channel = await connection.channel(publisher_confirms=False)
        try:
            statuses = await describe_topology(channel, scopes)
        finally:
            with contextlib.suppress(Exception):
                await channel.close()
    for status in statuses:
        metrics.note_queue(status.name, status.messages, status.consumers)
    metrics.note_queues_refreshed()


async def watch_queues(
    metrics: WorkerMetrics,
    scopes: Sequence[str],
    *,
    interval: float,
    timeout: float,
    connection: Callable[[], amqp.Connection | None],
    stopping: asyncio.Event,
) -> None:
    """Refresh every ``interval`` seconds until ``stopping`` is set.

    ``connection()`` returns the daemon's live connection, or None while it
    reconnects (the gauges then keep their last values and the refresh
    timestamp stops moving, which is what the staleness alert watches).
    """
    failing = False
    while not stopping.is_set():
        current = connection()
        if current is not None and not current.is_closed:
            try:
                async with asyncio.timeout(timeout):
                    await refresh_queue_gauges(current, scopes, metrics)
            except (
                TimeoutError,
                OctoError,
                amqp.AmqpError,
                aiormq.exceptions.AMQPError,
                OSError,
            ) as exc:
                if not failing:
                    _log.warning("queue_gauges_refresh_failed", error=type(exc).__name__)
                failing = True
            else:
                failing = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), timeout=interval)
