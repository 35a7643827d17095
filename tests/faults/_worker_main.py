"""Run one worker daemon as its own process (crash matrix, soak, e2e benchmark).

    python tests/faults/_worker_main.py CONFIG [--profile OUT.prof]
    python tests/faults/_worker_main.py --stdin [--profile OUT.prof]

Imports the daemon, then (``--stdin``: after reading the config path as one
line on stdin, so a caller can start the interpreter ahead of time) loads
``worker.toml``, runs :class:`WorkerDaemon` with SIGTERM/SIGINT handlers and
prints ``ready`` on stdout once every scope is consuming. ``OCTO_FAULT`` in
the environment arms the daemon's fault injector as in production.
``--profile`` writes a cProfile dump at a clean stop (SIGTERM).

This runner adds no protocol behaviour of its own; logs go to stderr at
warning level (the daemon logs no keys or payloads).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import structlog

from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon


async def _serve(config_path: str) -> None:
    daemon = WorkerDaemon(load_config(config_path))
    running = asyncio.ensure_future(daemon.run(install_signal_handlers=True))
    ready = asyncio.ensure_future(daemon.wait_ready())
    done, _ = await asyncio.wait({running, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    else:
        ready.cancel()
    await running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    parser.add_argument("--stdin", action="store_true", help="read the config path from stdin")
    parser.add_argument("--profile", help="write a cProfile dump here at a clean stop")
    args = parser.parse_args(argv)
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    if args.stdin:
        sys.stdout.write("loaded\n")
        sys.stdout.flush()
        config_path = sys.stdin.readline().strip()
    else:
        config_path = args.config
    if not config_path:
        parser.error("a config path is required")
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            asyncio.run(_serve(config_path))
        finally:
            profiler.disable()
            profiler.dump_stats(args.profile)
        return 0
    asyncio.run(_serve(config_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
