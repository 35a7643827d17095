"""The daemon: the RabbitMQ consumer that serves the configured scopes.

The package's public name is ``WorkerDaemon`` (``octo_worker.daemon``):
``daemon`` owns the process; ``deliveries`` one delivery's path; ``scopes``
each served scope's lifecycle; ``broker_link`` and ``topology`` the broker;
``queue_watch``, ``metrics``, ``faults`` and ``sdnotify`` what watches it;
``startup`` what ``run`` refuses before the broker.
"""

from octo_worker.daemon.daemon import (
    WorkerDaemon,
)

__all__ = [
    "WorkerDaemon",
]
