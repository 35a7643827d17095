"""Waits that scale with the machine: a deadline a busy machine does not miss.

A test waits for a condition and stops waiting as soon as it holds; its
bound only decides how long a broken run takes to fail. A bound measured on
a quiet machine is missed on a loaded one (the suite runs beside other
suites and the broker on two cores), so every such bound goes through
:func:`scaled`: the base seconds times :func:`machine_factor`, how much
slower this machine is now than a quiet one, from the larger of

* the load average per CPU (how many runnable tasks share each core), and
* a short CPU probe's best time against its time on a quiet machine.

``OCTO_TEST_TIME_SCALE`` overrides the factor. The factor is at least 1 and
at most :data:`MAX_FACTOR`, measured once per process.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Final

__all__ = ["MAX_FACTOR", "machine_factor", "scaled"]

MAX_FACTOR: Final = 20.0
# The probe's best time on a quiet 2-core machine of the project's kind.
_PROBE_REFERENCE_SECONDS: Final = 0.008
_PROBE_ROUNDS: Final = 3


def _probe() -> float:
    started = time.perf_counter()
    total = 0
    for number in range(100_000):
        total += number * number
    return time.perf_counter() - started


@functools.cache
def machine_factor() -> float:
    """How much slower than a quiet machine this one is now (1 to MAX_FACTOR)."""
    forced = os.environ.get("OCTO_TEST_TIME_SCALE")
    if forced:
        return min(MAX_FACTOR, max(1.0, float(forced)))
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        load = 1.0
    speed = min(_probe() for _ in range(_PROBE_ROUNDS)) / _PROBE_REFERENCE_SECONDS
    return min(MAX_FACTOR, max(1.0, load, speed))


def scaled(seconds: float) -> float:
    """``seconds`` (a bound measured on a quiet machine) for this machine now."""
    return seconds * machine_factor()
