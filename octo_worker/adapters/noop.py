"""``octo.noop``: an adapter whose effect is nothing at all.

Used by ``bench/e2e.py`` to measure the protocol's own cost (journal, frames,
broker) without any effect, and handy as a health probe. A dispatch
succeeds with ``{}``; a compensation of ``{"undo": "noop"}`` succeeds; a
reconciliation of an operation or of a compensation reports success for any
admitted key (there was never anything to do).
"""

from __future__ import annotations

from typing import Any

from octo_common.errors import AdapterInvalidJsonInput
from octo_common.messages import (
    CompensationReconcileRequest,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    ToolInvocation,
)
from octo_common.payload import ToolPayload
from octo_common.states import OperationStatus, Succeeded
from octo_worker.adapters.contract import (
    AdapterContext,
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
)

__all__ = ["NoopAdapter"]

_EMPTY = ToolPayload.json({})


class NoopAdapter(BaseWorkerAdapter):
    """Tool ``octo.noop`` (JSON): every call succeeds without doing anything."""

    tool = "octo.noop"

    def __init__(self, *, deadline_seconds: float = 5.0) -> None:
        self.deadline_seconds = deadline_seconds

    def invocation_safety(self) -> InvocationSafety | None:
        return InvocationSafety.READ_ONLY

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return DurableOperationContract.RECONCILIATION

    async def invoke(
        self, request: ToolInvocation, grant: Any, context: AdapterContext
    ) -> ToolPayload:
        return _EMPTY

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: Any, context: AdapterContext
    ) -> OperationStatus:
        return Succeeded(_EMPTY)

    async def compensate_operation(
        self, request: OperationCompensationRequest, grant: Any, context: AdapterContext
    ) -> OperationStatus:
        value = request.payload.value if request.payload.format == "json" else None
        if value != {"undo": "noop"}:
            raise AdapterInvalidJsonInput('inverse contract: {"undo": "noop"}')
        return Succeeded(_EMPTY)

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: Any, context: AdapterContext
    ) -> OperationStatus:
        return Succeeded(_EMPTY)

    async def reconcile_compensation(
        self, request: CompensationReconcileRequest, grant: Any, context: AdapterContext
    ) -> OperationStatus:
        return Succeeded(_EMPTY)
