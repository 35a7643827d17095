"""The Celery baseline's app: one no-op task on the same RabbitMQ broker.

Started by bench/baselines.py as ``celery -A bench.celery_app worker ...``
from the repository root. Configuration comes from the environment so the
benchmark can give every run its own queue:

* ``OCTO_BENCH_BROKER``: AMQP URL (default ``amqp://127.0.0.1:5672//``);
* ``OCTO_BENCH_CELERY_QUEUE``: the task queue (default ``octo.bench.celery``).

Settings that matter for a fair comparison: ``task_acks_late=True`` (the
task message is acked after the task ran, like Octo acks after durable
admission) and the ``rpc://`` result backend (results travel back over
AMQP to a per-client reply queue, like Octo's reply queue). Everything else
is Celery's default: durable classic queue, persistent task messages, no
publisher confirms.
"""

from __future__ import annotations

import os

from celery import Celery

BROKER_URL = os.environ.get("OCTO_BENCH_BROKER", "amqp://127.0.0.1:5672//")
TASK_QUEUE = os.environ.get("OCTO_BENCH_CELERY_QUEUE", "octo.bench.celery")

app = Celery("octo_bench", broker=BROKER_URL, backend="rpc://")
app.conf.update(
    task_acks_late=True,
    task_default_queue=TASK_QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_persistent=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_send_sent_event=False,
)


@app.task(name="octo_bench.noop")  # type: ignore[untyped-decorator]
def noop(value: int) -> int:
    """Does nothing: the measurement is Celery's own round trip."""
    return value
