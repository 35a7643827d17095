"""Adapters: the plug-in contract and registry, and the built-in adapters.

The package's public names are the contract's (``octo_worker.adapters``):
``contract`` holds the plug-in contract, the registry and entry-point loading;
``functions`` adapters written as plain functions; ``files`` and
``files_disk`` the reference adapter ``files.publish``; ``noop`` ``octo.noop``.
"""

from octo_worker.adapters.contract import (
    ADAPTER_ENTRY_POINT_GROUP,
    CONTEXT_METHODS,
    DEFAULT_ADAPTER_DEADLINE_SECONDS,
    AdapterContext,
    AdapterLoadFailed,
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
    TypedJsonWorkerAdapter,
    WorkerAdapter,
    WorkerAdapterRegistry,
    adapter_deadline,
    call_adapter,
    call_adapter_with_deadline,
    effective_adapter_deadline,
    load_adapters,
    refusal_status,
    run_handler,
    validation_text,
)

__all__ = [
    "ADAPTER_ENTRY_POINT_GROUP",
    "AdapterContext",
    "AdapterLoadFailed",
    "BaseWorkerAdapter",
    "CONTEXT_METHODS",
    "DEFAULT_ADAPTER_DEADLINE_SECONDS",
    "DurableOperationContract",
    "InvocationSafety",
    "TypedJsonWorkerAdapter",
    "WorkerAdapter",
    "WorkerAdapterRegistry",
    "adapter_deadline",
    "call_adapter",
    "call_adapter_with_deadline",
    "effective_adapter_deadline",
    "load_adapters",
    "refusal_status",
    "run_handler",
    "validation_text",
]
