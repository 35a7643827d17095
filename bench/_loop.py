"""The event loop every benchmark process runs on, chosen once for the whole run.

``OCTO_BENCH_LOOP`` (``uvloop`` or ``asyncio``; default ``uvloop``, as the
worker daemon's ``event_loop = "auto"``) is read
by every benchmark process, and child processes inherit it, so Octo and the
baselines it is compared with always run on the same kind of loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHOICES = ("asyncio", "uvloop")


def name() -> str:
    chosen = os.environ.get("OCTO_BENCH_LOOP", "uvloop")
    if chosen not in CHOICES:
        raise SystemExit(f"OCTO_BENCH_LOOP must be one of {', '.join(CHOICES)}, not {chosen!r}")
    return chosen


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    if name() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
