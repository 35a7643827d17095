"""Environment-selected kill points for the crash tests of worker and host (inactive unless set).

``OCTO_FAULT=<point>[@<n>]`` makes the process kill itself with SIGKILL the
n-th time (default: first) it reaches ``<point>``. The worker daemon and the
host client each hold one :class:`FaultInjector` and call
:meth:`FaultInjector.reach` at these points:

* ``worker.after_admission_commit``: a dispatch/compensation admission is
  durable, the delivery is not yet acked;
* ``worker.after_ack``: the delivery is acked, the adapter has not run;
* ``worker.after_effect``: the adapter performed its effect, nothing observed;
* ``worker.before_reply``: the observation is durable (reply in the outbox),
  not yet published;
* ``worker.after_reply``: the reply is confirmed by the broker, not yet
  marked published;
* ``worker.after_compensation_admission_commit``: as
  ``worker.after_admission_commit``, counting ``compensate_operation``
  admissions only;
* ``worker.after_compensation_effect``: as ``worker.after_effect``, counting
  the adapter's ``compensate_operation`` (the inverse effect) only;
* ``host.after_ledger_commit``: the host's ledger write is durable, the
  frame is not yet published;
* ``host.after_compensation_intent``: the ledger write that records a
  compensation intent is durable; nothing of it is sealed or sent;
* ``host.after_reply_applied``: a reply is opened and applied to a copy of
  the ledger; the change is not durable and the reply is not acked;
* ``host.after_retry_intent``: the ledger write that records a retry (the
  next attempt of a step, under its new key) is durable; nothing of it is
  sealed or sent.

Besides, outside the protocol (so not in the model's kill-point table):
:data:`STORAGE_FAULT_POINTS`, points inside one storage transaction, where
a kill must leave the store as it was before the transaction:

* ``worker.during_journal_rekey``: a journal row's item rewritten under the
  active key's hash, the transaction not committed.

Nothing happens when the variable is absent; a malformed value is ignored
with a warning on stderr (never fatal: production never sets it). It must
never do anything but kill this process at the chosen point.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

__all__ = ["FAULT_POINTS", "STORAGE_FAULT_POINTS", "FaultInjector"]

FAULT_POINTS = frozenset(
    {
        "worker.after_admission_commit",
        "worker.after_ack",
        "worker.after_effect",
        "worker.before_reply",
        "worker.after_reply",
        "worker.after_compensation_admission_commit",
        "worker.after_compensation_effect",
        "host.after_ledger_commit",
        "host.after_compensation_intent",
        "host.after_reply_applied",
        "host.after_retry_intent",
    }
)


STORAGE_FAULT_POINTS = frozenset({"worker.during_journal_rekey"})


class FaultInjector:
    """Kills the process at the configured point; a no-op otherwise."""

    def __init__(self, spec: str | None = None) -> None:
        spec = os.environ.get("OCTO_FAULT") if spec is None else spec
        self._point: str | None = None
        self._remaining = 0
        if not spec:
            return
        point, _, count = spec.partition("@")
        known = point in FAULT_POINTS or point in STORAGE_FAULT_POINTS
        if not known or (count and not count.isdigit()):
            sys.stderr.write(f"octo: ignoring unknown OCTO_FAULT value {spec!r}\n")
            return
        self._point = point
        self._remaining = int(count) if count else 1

    @property
    def active(self) -> bool:
        return self._point is not None

    def reach(self, point: str, *, settle: float = 0.0) -> None:
        """Mark that ``point`` was reached; die there when it is the chosen one."""
        if not self._due(point):
            return
        if settle:
            # Let the kernel flush what was just written to the broker socket.
            time.sleep(settle)
        self._die(point)

    async def reach_flushed(self, point: str, *, settle: float = 0.2) -> None:
        """As :meth:`reach`, but first let the event loop run for ``settle`` seconds,
        so frames this process queued (an ack) are written before it dies."""
        if not self._due(point):
            return
        await asyncio.sleep(settle)
        self._die(point)

    def _due(self, point: str) -> bool:
        if point != self._point:
            return False
        self._remaining -= 1
        return self._remaining <= 0

    @staticmethod
    def _die(point: str) -> None:
        sys.stderr.write(f"octo: fault injection: SIGKILL at {point}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
