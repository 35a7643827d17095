"""The worker side of ``bench/e2e.py`` and ``bench/endurance.py``: one ``WorkerDaemon``.

    python bench/_e2e_peer.py CONFIG [--stages PATH] [--profile PREFIX] [--log-level L]

Runs the daemon exactly as ``octo-worker run`` does (``WorkerDaemon(config,
metrics=...).run(install_signal_handlers=True)``, the metrics endpoint served
when ``[metrics] listen`` is set, logs at warning on stderr) and prints
``ready`` once consuming. Measurement aids, both off by default:

* ``--stages PATH``: wraps a few daemon, session, store and frame functions
  with wall-clock timers (this process only; nothing is edited on disk).
  Each SIGUSR1 appends the totals so far to PATH as one JSON line and
  resets them, so the benchmark brackets exactly its measured phase.
* ``--profile PREFIX``: runs cProfile; each SIGUSR1 also writes
  ``PREFIX-<n>.prof`` and restarts the profiler.
* ``--counters PATH``: each SIGUSR1 appends the daemon's socket writes to
  the broker so far (its current connection) to PATH as one JSON line.

SIGTERM stops the daemon cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import _loop
import structlog

from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon
from octo_worker.daemon.metrics import WorkerMetrics


class StageTimers:
    """Wall-clock time and call counts of wrapped functions, by label."""

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = {}

    def reset(self) -> None:
        self.totals = {}

    def add(self, label: str, seconds: float) -> None:
        entry = self.totals.setdefault(label, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    def wrap(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        add = self.add
        if asyncio.iscoroutinefunction(original):

            @functools.wraps(original)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    add(label, time.perf_counter() - started)

            setattr(owner, name, timed_async)
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                add(label, time.perf_counter() - started)

        setattr(owner, name, timed)


def instrument_worker(timers: StageTimers) -> None:
    """The worker pipeline's stages (see bench/e2e.py for how they nest)."""
    from octo_common import authorizer, frames
    from octo_worker import journal, store
    from octo_worker.daemon import deliveries
    from octo_worker.session import commits, session
    from octo_worker.transport import delivery

    timers.wrap(deliveries.DeliveryPath, "on_message", "delivery_total")
    timers.wrap(session.WorkerSession, "handle", "session_handle")
    timers.wrap(frames.SessionAuthenticator, "open", "frame_open")
    timers.wrap(frames.SessionAuthenticator, "seal", "frame_seal")
    timers.wrap(authorizer.SessionAuthorizer, "authorize_operation", "authorize")
    timers.wrap(authorizer, "worker_input_fingerprint", "input_fingerprint")
    timers.wrap(journal.WorkerOperationJournal, "admit", "journal_admit")
    timers.wrap(journal.WorkerOperationJournal, "observe", "journal_observe")
    timers.wrap(commits.SessionCommits, "state_document", "state_document_encode")
    timers.wrap(session.WorkerSession, "confirm_published", "outbox_mark")
    timers.wrap(store.SqliteJournalStore, "commit", "journal_commit")
    timers.wrap(store.SqliteJournalStore, "load_records", "journal_load")
    from octo_worker.storage.postgres import PostgresJournalStore

    timers.wrap(PostgresJournalStore, "commit", "journal_commit")
    timers.wrap(PostgresJournalStore, "load_records", "journal_load")
    timers.wrap(delivery.BrokerDelivery, "ack", "ack")
    timers.wrap(delivery.BrokerDelivery, "reply", "reply_publish_confirmed")
    timers.wrap(session, "call_adapter_reporting", "adapter")


def socket_writes(daemon: WorkerDaemon | None) -> int:
    """The socket writes of the daemon's current broker connection (0 without one)."""
    connection = None if daemon is None else daemon._broker.connection()
    return 0 if connection is None else connection.writes


async def _serve(config_path: str, on_usr1: Callable[[], None], held: list[WorkerDaemon]) -> None:
    config = load_config(config_path)
    metrics = WorkerMetrics()
    if config.metrics.listen is not None:  # as ``octo-worker run`` does
        metrics.serve(config.metrics.listen)
    daemon = WorkerDaemon(config, metrics=metrics)
    held.append(daemon)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_usr1)
    running = asyncio.ensure_future(daemon.run(install_signal_handlers=True))
    ready = asyncio.ensure_future(daemon.wait_ready())
    done, _ = await asyncio.wait({running, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        print("ready", flush=True)
    else:
        ready.cancel()
    await running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--stages")
    parser.add_argument("--profile")
    parser.add_argument("--counters")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[args.log_level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    timers = StageTimers()
    if args.stages:
        instrument_worker(timers)
    profiler = cProfile.Profile() if args.profile else None
    dumps = 0
    held: list[WorkerDaemon] = []

    def on_usr1() -> None:
        nonlocal dumps
        dumps += 1
        if args.counters:
            with open(args.counters, "a", encoding="utf-8") as out:
                daemon = held[0] if held else None
                out.write(json.dumps({"socket_writes": socket_writes(daemon)}) + "\n")
        if args.stages:
            with open(args.stages, "a", encoding="utf-8") as out:
                out.write(json.dumps(timers.totals) + "\n")
            timers.reset()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(f"{args.profile}-{dumps}.prof")
            profiler.clear()
            profiler.enable()

    if profiler is not None:
        profiler.enable()
    _loop.run(_serve(args.config, on_usr1, held))
    return 0


if __name__ == "__main__":
    sys.exit(main())
