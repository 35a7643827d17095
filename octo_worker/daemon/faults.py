"""The worker's kill points for the crash tests, as hooks (``OCTO_FAULT``).

:class:`FaultHooks` reaches the ``worker.*`` points of
:mod:`octo_common.runtime.faults` from the hooks that run at those moments:

* ``worker.after_admission_commit``: ``after_admission_commit``;
* ``worker.after_ack``: ``after_ack`` (after letting the ack reach the broker);
* ``worker.after_effect``: ``after_effect``;
* ``worker.before_reply``: ``before_reply``;
* ``worker.after_reply``: ``after_reply``;
* ``worker.after_compensation_admission_commit``: ``after_admission_commit``
  of a ``compensate_operation`` (after the generic point);
* ``worker.after_compensation_effect``: ``after_effect`` of the adapter's
  ``compensate_operation`` (after the generic point).

The daemon installs it only when ``OCTO_FAULT`` chose a point. It must never
do anything but kill the process at the chosen point.
"""

from __future__ import annotations

from typing import Final

from octo_common.runtime.faults import FaultInjector
from octo_worker.hooks import WorkerHooks

__all__ = ["FaultHooks"]

_COMPENSATE: Final = "compensate_operation"  # the message type and the adapter method


class FaultHooks(WorkerHooks):
    """Kills the process at the configured ``worker.*`` point (see the module docstring)."""

    def __init__(self, injector: FaultInjector) -> None:
        self._reach = injector.reach

    def after_admission_commit(self, scope: str, kind: str, operation_key: str) -> None:
        self._reach("worker.after_admission_commit")
        if kind == _COMPENSATE:
            self._reach("worker.after_compensation_admission_commit")

    def after_ack(self, scope: str, kind: str, operation_key: str) -> None:
        # Let the kernel flush the ack to the broker socket before dying.
        self._reach("worker.after_ack", settle=0.2)

    def after_effect(self, scope: str, tool: str, method: str) -> None:
        self._reach("worker.after_effect")
        if method == _COMPENSATE:
            self._reach("worker.after_compensation_effect")

    def before_reply(
        self, scope: str, kind: str, operation_key: str | None, unresolved: bool | None
    ) -> None:
        self._reach("worker.before_reply")

    def after_reply(
        self,
        scope: str,
        kind: str,
        operation_key: str | None,
        refused: bool,
        acked: bool,
    ) -> None:
        self._reach("worker.after_reply")
