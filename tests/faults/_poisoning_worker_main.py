"""A worker daemon process whose journal commits can be made to fail, for the SIGKILL
tests of a poisoned session (``tests/faults/test_poisoned_refusal.py``).

    python tests/faults/_poisoning_worker_main.py CONFIG

Runs :class:`WorkerDaemon` on ``worker.toml`` as ``_worker_main.py`` does
and prints ``ready`` once every scope is consuming. Its one adapter,
``test.hold``, is a real plug-in: a dispatch whose JSON payload says
``{"hold": true}`` waits (its effect never ends, so a reload of the scope
waits for it, as for the slowest adapter of a real scope); any other
succeeds at once. The one fault: a commit whose journal rows include an
operation key starting with ``op-fail-`` fails as a store error would,
before it reaches the database. The test kills this process with SIGKILL.

This runner adds no protocol behaviour of its own; logs go to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, Final

import structlog

from octo_common.errors import StorageBackendError
from octo_common.payload import ToolPayload
from octo_common.states import OperationStatus, Running, Succeeded
from octo_worker.adapters.contract import (
    BaseWorkerAdapter,
    DurableOperationContract,
    WorkerAdapterRegistry,
)
from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon

TOOL: Final = "test.hold"
FAILING_PREFIX: Final = "op-fail-"


class HoldAdapter(BaseWorkerAdapter):
    """``test.hold``: ``{"hold": true}`` never returns; anything else succeeds."""

    tool = TOOL
    deadline_seconds = 600.0

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> OperationStatus:
        if isinstance(request.payload.value, dict) and request.payload.value.get("hold"):
            await asyncio.Event().wait()
        return Succeeded(ToolPayload.json({"done": True}))

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> OperationStatus:
        return Running()


def fail_marked_commits(daemon: WorkerDaemon) -> None:
    store = daemon.store
    real_commit = store.commit

    async def commit(scope: str, lease: Any, changes: Any) -> int:
        rows = changes.journal.rows if changes.journal is not None else {}
        if any(key.startswith(FAILING_PREFIX) for key in rows):
            raise StorageBackendError("injected")
        return await real_commit(scope, lease, changes)

    store.commit = commit  # type: ignore[method-assign]


async def _serve(config_path: str) -> None:
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, HoldAdapter())
    daemon = WorkerDaemon(load_config(config_path), adapters=adapters)
    running = asyncio.ensure_future(daemon.run(install_signal_handlers=True))
    ready = asyncio.ensure_future(daemon.wait_ready())
    done, _ = await asyncio.wait({running, ready}, return_when=asyncio.FIRST_COMPLETED)
    if ready in done:
        fail_marked_commits(daemon)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    else:
        ready.cancel()
    await running


def main() -> int:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    asyncio.run(_serve(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
