"""The simulated external system behind the ``sim.effect`` plug-in, and the plug-in.

:class:`External` is what lives outside every worker process and survives
its deaths: its record per key (``done``, ``failed``, ``refused`` by a
lookup, as ``files.publish`` keeps one), and the history checker's counts of
every call and every effect. Each worker process gets its own
:class:`SimAdapter` over the one external system; each call is two I/O
boundaries of that process (before the call reaches the system, after it
returns), so a process may die with an effect done and its outcome unknown.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, StateKind, Succeeded
from octo_worker.adapters.contract import (
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
)

from .world import Boundaries, Process

TOOL: Final = "sim.effect"
NOT_HAPPENED: Final = Failed("not performed", FailureCode.NOT_HAPPENED)
REFUSED: Final = Failed("the effect failed")


class External:
    """The external system's records and the checker's counts (see the module docstring)."""

    def __init__(self, rng: random.Random, durable: Callable[[str], Awaitable[Any]]) -> None:
        self.rng = rng
        self.durable = durable  # operation key -> the journal's record (None: none)
        self.records: dict[str, Any] = {}
        self.crecords: dict[str, Any] = {}
        self.effects: Counter[str] = Counter()
        self.ceffects: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.ccalls: Counter[str] = Counter()
        self.violations: list[str] = []

    async def dispatch(self, key: str) -> Any:
        self.calls[key] += 1
        record = await self.durable(key)
        if record is None or record.state.kind is not StateKind.PENDING:
            self.violations.append(f"dispatch of {key} without a durable pending admission")
        if key not in self.records:
            if self.rng.random() < 0.8:
                self.effects[key] += 1
                self.records[key] = Succeeded(ToolPayload.json({"done": key[:12]}))
            else:
                self.records[key] = REFUSED
        return self.records[key]

    async def compensate(self, key: str) -> Any:
        self.ccalls[key] += 1
        record = await self.durable(key)
        if (
            record is None
            or record.state.kind is not StateKind.SUCCEEDED
            or record.compensation is None
            or self.effects[key] != 1
        ):
            self.violations.append(f"compensation of {key} without a succeeded original")
        if key not in self.crecords:
            self.ceffects[key] += 1
            self.crecords[key] = Succeeded(ToolPayload.json({"undone": key[:12]}))
        return self.crecords[key]


class SimAdapter(BaseWorkerAdapter):
    """``sim.effect`` as one worker process calls it."""

    tool = TOOL

    def __init__(self, external: External, boundaries: Boundaries, process: Process) -> None:
        self.external = external
        self.boundaries = boundaries
        self.process = process

    def invocation_safety(self) -> InvocationSafety | None:
        return InvocationSafety.READ_ONLY

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> bool:
        return True

    async def _call(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        await self.boundaries.gate(self.process, f"before {what}")
        outcome = await call()
        await self.boundaries.gate(self.process, f"after {what}")
        return outcome

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        key = request.operation_key
        return await self._call("the effect", lambda: self.external.dispatch(key))

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return await self._lookup("a lookup", self.external.records, request.operation_key)

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        key = request.binding.operation_key
        return await self._call("the inverse", lambda: self.external.compensate(key))

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        key = request.operation_key
        return await self._lookup("an inverse lookup", self.external.crecords, key)

    async def _lookup(self, what: str, records: dict[str, Any], key: str) -> Any:
        """What the system's record says; a miss records "not performed" (it fences the key)."""

        async def lookup() -> Any:
            return records.setdefault(key, NOT_HAPPENED)

        return await self._call(what, lookup)
