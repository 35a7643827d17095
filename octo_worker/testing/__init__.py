"""Testing an adapter plug-in before deploying it.

``AdapterKit`` runs a plug-in through a real ``WorkerSession`` on a real
SQLite journal, without a broker: dispatch, duplicate, compensation, both
lookups, and a simulated crash at each of the worker's kill points followed
by a restart and reconciliation; ``kit.calls`` counts the plug-in's real
calls. With Octo installed, pytest loads :mod:`octo_worker.testing.pytest_plugin`
(entry point ``pytest11``), whose ``adapter_kit`` fixture makes kits in the
test's temporary directory.

Nothing here is used by the daemon.
"""

from octo_worker.testing.kit import (
    KILL_POINTS,
    AdapterKit,
    CountingAdapter,
    CrashReport,
    KitDelivery,
    SimulatedCrash,
    counts,
    status_of,
)

__all__ = [
    "KILL_POINTS",
    "AdapterKit",
    "CountingAdapter",
    "CrashReport",
    "KitDelivery",
    "SimulatedCrash",
    "counts",
    "status_of",
]
