"""The adapter plug-in contract: what an adapter is, when it is
called, what it is told, and how adapters are found and called.

This module owns:

* the declarations ``InvocationSafety`` and ``DurableOperationContract``
  (defined, with ``refusal_status`` and ``lookup_miss_fences_key``, in the
  pure :mod:`octo_worker.adapters.declarations`, and named here too);
* ``AdapterContext``, the third argument of every adapter method: the
  tenant scope, the session, the scope-qualified idempotency key and the
  deadline of the call;
* ``WorkerAdapter`` (the ``typing.Protocol`` every adapter satisfies) and
  ``BaseWorkerAdapter`` (safe defaults: declare nothing, support nothing);
* ``WorkerAdapterRegistry`` (one adapter per tool) and
  ``TypedJsonWorkerAdapter`` (a read-only ``invoke`` handler over typed JSON);
* ``call_adapter`` / ``call_adapter_with_deadline``, the only way the worker
  calls an adapter method: one deadline, and every failure mapped to an
  adapter error without its text;
* ``load_adapters``, which loads *only* the configured names of the
  entry-point group ``octo.adapters``.

It must never touch the journal, the store or a session, never log payloads,
adapter error text or secrets, and never retry an adapter call.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import msgspec

from octo_common.codec import compact_json
from octo_common.errors import (
    AdapterFailed,
    AdapterIndeterminate,
    AdapterInvalidJsonInput,
    AdapterInvalidJsonOutput,
    AdapterInvalidOptions,
    AdapterUnsupported,
    DuplicateTool,
    InvalidTool,
    MissingAdapter,
    OctoError,
    WorkerAdapterError,
)
from octo_common.ids import is_token
from octo_common.payload import ToolPayload
from octo_worker.adapters.context import AdapterContext
from octo_worker.adapters.declarations import (
    DurableOperationContract,
    InvocationSafety,
    lookup_miss_fences_key,
    refusal_status,
)

if TYPE_CHECKING:
    from octo_common.grants import CapabilityGrant
    from octo_common.messages import (
        CompensationReconcileRequest,
        OperationCompensationRequest,
        OperationDispatchRequest,
        OperationReconcileRequest,
        ToolInvocation,
    )
    from octo_common.states import OperationStatus

__all__ = [
    "ADAPTER_ENTRY_POINT_GROUP",
    "CONTEXT_METHODS",
    "AdapterContext",
    "AdapterLoadFailed",
    "DEFAULT_ADAPTER_DEADLINE_SECONDS",
    "BaseWorkerAdapter",
    "DurableOperationContract",
    "InvocationSafety",
    "TypedJsonWorkerAdapter",
    "WorkerAdapter",
    "WorkerAdapterRegistry",
    "adapter_deadline",
    "effective_adapter_deadline",
    "call_adapter",
    "call_adapter_with_deadline",
    "load_adapters",
    "lookup_miss_fences_key",
    "refusal_status",
    "validation_text",
    "run_handler",
]

ADAPTER_ENTRY_POINT_GROUP = "octo.adapters"
DEFAULT_ADAPTER_DEADLINE_SECONDS = 30.0

T = TypeVar("T")
InputT = TypeVar("InputT")


class AdapterLoadFailed(OctoError):
    """An enabled adapter is installed but could not be loaded: its module (or a
    module it imports) raised, or its factory refused its options or raised.

    ``reason`` names the exception class (and a missing module's name); for
    options it shows what names the field and never a value: the options that
    do not bind to the factory's parameters (a missing or unknown option's
    name), or the detail of an ``AdapterInvalidOptions`` the factory raised
    (a ``FunctionAdapter``'s validation message, "Object missing required
    field `bucket`"). Any other exception's text is never shown: it could
    carry an option's value.
    """

    _fields = ("adapter", "reason")
    adapter: str
    reason: str


@runtime_checkable
class WorkerAdapter(Protocol):
    """An adapter serves one tool. See ``BaseWorkerAdapter`` for each hook.

    An adapter MUST NOT retry an effect on its own after an ambiguous
    outcome, MUST NOT call the journal and MUST NOT log payloads or secrets.
    """

    def invocation_safety(self) -> InvocationSafety | None: ...

    def durable_operation_contract(self) -> DurableOperationContract | None: ...

    async def invoke(
        self, request: ToolInvocation, grant: CapabilityGrant, context: AdapterContext
    ) -> ToolPayload: ...

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus: ...

    async def compensate_operation(
        self,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus: ...

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus: ...

    async def reconcile_compensation(
        self,
        request: CompensationReconcileRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus: ...


class BaseWorkerAdapter:
    """Defaults for every hook: declare nothing, support nothing.

    Subclass it and override what the tool supports. ``tool`` (optional)
    names the tool the adapter serves; ``load_adapters`` refuses an entry
    point whose adapter names another tool. ``deadline_seconds`` is the
    per-tool deadline the worker applies to each call (``call_adapter``).

    Every async hook may raise the adapter errors
    (``AdapterUnsupported``, ``AdapterInvalidJsonInput``,
    ``AdapterInvalidJsonOutput``, ``AdapterFailed``,
    ``AdapterIndeterminate``). Any other exception is treated as
    ``AdapterFailed`` and its text is never logged or sent. Hooks run on the
    worker's event loop: blocking work belongs in a thread.
    """

    tool: str | None = None
    deadline_seconds: float = DEFAULT_ADAPTER_DEADLINE_SECONDS

    def invocation_safety(self) -> InvocationSafety | None:
        """Called at every ``invoke``, before the call budget matters.

        Return ``READ_ONLY`` or ``INDEPENDENTLY_IDEMPOTENT`` to allow ordinary
        invocations. None (the default) refuses them with
        ``InvocationSafetyNotDeclared``. Must be cheap and side-effect free.
        """
        return None

    def durable_operation_contract(self) -> DurableOperationContract | None:
        """Called at every ``dispatch_operation`` and ``compensate_operation``, before
        the journal is consulted.

        Return how outcomes are recovered. None (the default) refuses durable
        operations and compensations with ``DurableOperationContractNotDeclared``,
        leaving the journal untouched. Must be cheap and side-effect free.
        """
        return None

    async def invoke(
        self, request: ToolInvocation, grant: CapabilityGrant, context: AdapterContext
    ) -> ToolPayload:
        """Called for an ``invoke`` after authorization and a durable session commit.

        May run the tool (read-only or independently idempotent, as declared)
        and return its payload in ``grant.format``; the worker checks size and
        format against the grant afterwards. Has no journal row: it must never
        perform an effect that needs deduplication.
        """
        raise AdapterUnsupported("invoke")

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Called exactly once per admitted operation key, after the admission is
        durable and the delivery acked.

        Performs the effect at most once and returns its status (``Running``,
        ``Succeeded``, ``Failed``, ``Cancelled``). Names the effect (and
        deduplicates it at a provider) by ``context.idempotency_key``, never
        by the bare operation key, which another tenant may share.

        What it raises tells "did not act" from "may have acted":

        * ``AdapterInvalidJsonInput`` (the input does not meet the adapter's
          contract) or ``AdapterInvalidOptions`` (its configuration refuses
          the call), raised before anything is touched: the worker records
          the key ``failed`` with the code ``input_refused`` /
          ``options_refused`` and the error's detail as the failure text
          (a validation message: never a value of the input or a secret).
          The key is definite; the adapter is never called for it again.
          Raise them only when nothing was done.
        * ``AdapterIndeterminate`` when the outcome is unknown, any other
          error, or the deadline: the row stays ``pending`` and only
          ``reconcile_operation`` (or an operator) can resolve it.

        Must never retry the effect by itself or keep it running
        unaccounted for after returning.
        """
        raise AdapterUnsupported("dispatch_operation")

    async def compensate_operation(
        self,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        """Called exactly once per admitted compensation, after the admission is
        durable and only for a ``succeeded`` original of the same tool and scope.

        MUST validate the inverse payload against the adapter's own explicit
        inverse contract (refuse with ``AdapterInvalidJsonInput``) before
        touching anything, then perform the inverse effect at most once,
        named by ``context.idempotency_key`` (derived from the compensation
        key and the scope).
        """
        raise AdapterUnsupported("compensate_operation")

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Called on ``reconcile_operation`` for a key the journal holds.

        A bounded status lookup by ``context.idempotency_key`` (the
        operation's, as at dispatch). It MUST NOT perform the effect, start
        it, or finish it; it reports what happened.
        """
        raise AdapterUnsupported("reconcile_operation")

    async def reconcile_compensation(
        self,
        request: CompensationReconcileRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        """Called on ``reconcile_compensation`` for a compensation the journal
        holds under exactly this identity.

        A bounded status lookup by ``context.idempotency_key`` (the
        compensation's, as at ``compensate_operation``). It MUST NOT perform
        the inverse effect, start it, or finish it; it reports what happened.
        Without it (the default) a compensation left ``pending`` after a
        crash stays for an operator.
        """
        raise AdapterUnsupported("reconcile_compensation")


# Registry -------------------------------------------------------------------


class WorkerAdapterRegistry:
    """One adapter per tool name (tool names are tokens), with its deadline.

    ``default_deadline_seconds`` is the deadline of an adapter that declares
    none (the daemon passes ``[adapters] deadline_seconds``); each adapter's
    deadline is read once, when it is registered (:meth:`deadline_for`).
    """

    __slots__ = ("_adapters", "_deadlines", "_default_deadline")

    def __init__(
        self, *, default_deadline_seconds: float = DEFAULT_ADAPTER_DEADLINE_SECONDS
    ) -> None:
        self._adapters: dict[str, WorkerAdapter] = {}
        self._deadlines: dict[str, float] = {}
        self._default_deadline = default_deadline_seconds

    def register(self, tool: str, adapter: WorkerAdapter) -> None:
        """Add ``adapter`` for ``tool``: ``InvalidTool`` / ``DuplicateTool`` otherwise."""
        if not is_token(tool):
            raise InvalidTool(tool)
        if tool in self._adapters:
            raise DuplicateTool(tool)
        self._adapters[tool] = adapter
        self._deadlines[tool] = effective_adapter_deadline(adapter, self._default_deadline)

    def deadline_for(self, tool: str) -> float:
        """Seconds the worker waits for a call of ``tool``'s adapter before it counts
        as indeterminate (see :func:`effective_adapter_deadline`)."""
        return self._deadlines[tool]

    def with_default_deadline(self, seconds: float) -> WorkerAdapterRegistry:
        """The same adapters, registered again with ``seconds`` as the default deadline."""
        registry = WorkerAdapterRegistry(default_deadline_seconds=seconds)
        for tool, adapter in self._adapters.items():
            registry.register(tool, adapter)
        return registry

    def contains(self, tool: str) -> bool:
        return tool in self._adapters

    def get(self, tool: str) -> WorkerAdapter | None:
        """The adapter for ``tool``, or None (the session refuses with ``MissingAdapter``)."""
        return self._adapters.get(tool)

    def tools(self) -> list[str]:
        """Registered tool names, sorted."""
        return sorted(self._adapters)

    def __contains__(self, tool: object) -> bool:
        return tool in self._adapters

    def __iter__(self) -> Iterator[str]:
        return iter(self.tools())

    def __len__(self) -> int:
        return len(self._adapters)

    def __repr__(self) -> str:
        return f"WorkerAdapterRegistry(tools={self.tools()!r})"


# Typed JSON invoke adapter ---------------------------------------------------


class TypedJsonWorkerAdapter(BaseWorkerAdapter, Generic[InputT]):
    """An ``invoke``-only adapter: JSON input converted to ``input_type``, handler output
    returned as a JSON payload.

    ``handler`` receives the converted input and may be a plain or an async
    function; a plain one runs in a worker thread (``asyncio.to_thread``), so
    a blocking call neither stalls the daemon nor escapes the deadline. Its
    errors pass through unchanged (``call_adapter`` maps them).
    """

    def __init__(
        self,
        safety: InvocationSafety,
        handler: Callable[[InputT], Any],
        input_type: type[InputT],
    ) -> None:
        if not isinstance(safety, InvocationSafety):
            raise TypeError("safety must be an InvocationSafety")
        self._safety = safety
        self._handler = handler
        self._input_type = input_type

    def __repr__(self) -> str:
        name = getattr(self._input_type, "__name__", "?")
        return f"TypedJsonWorkerAdapter(safety={self._safety.value}, input_type={name})"

    def invocation_safety(self) -> InvocationSafety | None:
        return self._safety

    async def invoke(
        self, request: ToolInvocation, grant: CapabilityGrant, context: AdapterContext
    ) -> ToolPayload:
        payload = request.payload
        if payload.format != "json":
            raise AdapterInvalidJsonInput("payload is not JSON")
        try:
            value = msgspec.convert(payload.value, self._input_type, strict=True)
        except (msgspec.ValidationError, TypeError, ValueError) as exc:
            raise AdapterInvalidJsonInput(type(exc).__name__) from None
        return json_output_payload(await run_handler(self._handler, value))


async def run_handler(handler: Callable[..., Any], *args: Any) -> Any:
    """``handler(*args)``: awaited when it is a coroutine function, else run in a worker
    thread (its result awaited if it is awaitable).

    A plain function may block: off the event loop, so the daemon keeps
    serving and the deadline still answers. The thread runs on after the
    deadline; the call is then indeterminate, which a durable operation's
    lookup settles and which a READ_ONLY or idempotent invoke tolerates.
    """
    if inspect.iscoroutinefunction(handler):
        return await handler(*args)
    output = await asyncio.to_thread(handler, *args)
    if inspect.isawaitable(output):
        output = await output
    return output


def json_output_payload(output: object) -> ToolPayload:
    """An adapter's output as a JSON payload: it must encode and be an object or array."""
    try:
        natural = msgspec.to_builtins(output)
    except (TypeError, ValueError, OverflowError) as exc:
        raise AdapterInvalidJsonOutput(type(exc).__name__) from None
    if not isinstance(natural, dict | list):
        raise AdapterInvalidJsonOutput("output is not an object or an array")
    try:
        compact_json(natural)
        payload = ToolPayload.json(natural)
        payload.validate_for("json")
    except OctoError as exc:
        raise AdapterInvalidJsonOutput(exc.code) from None
    return payload


# Calling an adapter ---------------------------------------------------------


def adapter_deadline(adapter: object) -> float:
    """The per-tool deadline of ``adapter`` (its ``deadline_seconds``, else the default)."""
    value = getattr(adapter, "deadline_seconds", DEFAULT_ADAPTER_DEADLINE_SECONDS)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return DEFAULT_ADAPTER_DEADLINE_SECONDS
    if not math.isfinite(value) or value <= 0:
        return DEFAULT_ADAPTER_DEADLINE_SECONDS
    return float(value)


def effective_adapter_deadline(adapter: object, configured: float) -> float:
    """The deadline the daemon applies to ``adapter``.

    The adapter's own ``deadline_seconds`` when it sets one (on the instance,
    or on its class or a base class other than :class:`BaseWorkerAdapter`,
    whose class default does not count), valid (a positive finite number);
    otherwise ``configured`` (``[adapters] deadline_seconds``).
    """
    if not _declares_deadline(adapter):
        return configured
    value = getattr(adapter, "deadline_seconds", None)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return configured
    if not math.isfinite(value) or value <= 0:
        return configured
    return float(value)


def _declares_deadline(adapter: object) -> bool:
    if "deadline_seconds" in getattr(adapter, "__dict__", {}):
        return True
    for cls in type(adapter).__mro__:
        if cls is BaseWorkerAdapter:
            return False
        if "deadline_seconds" in vars(cls):
            return True
    return False


async def call_adapter(
    call: Callable[[], Awaitable[T]],
    *,
    deadline_seconds: float,
    returns: type[Any] | tuple[type[Any], ...] | None = None,
) -> T:
    """``call_adapter_with_deadline`` for a call that does not need its deadline."""
    return await call_adapter_with_deadline(
        lambda _deadline: call(), deadline_seconds=deadline_seconds, returns=returns
    )


async def call_adapter_with_deadline(
    call: Callable[[float], Awaitable[T]],
    *,
    deadline_seconds: float,
    returns: type[Any] | tuple[type[Any], ...] | None = None,
) -> T:
    """Run one adapter call under a deadline and map its failures.

    ``call`` receives the event-loop time at which the deadline expires,
    exactly the one the call is cut at: the ``deadline`` of the call's
    ``AdapterContext``.

    * the deadline expiring → ``AdapterIndeterminate("deadline")``: the call
      may or may not have had its effect;
    * a ``WorkerAdapterError`` → raised unchanged;
    * ``asyncio.CancelledError`` when this task is being cancelled (the
      worker is stopping) → propagates; one the adapter raised by itself (an
      awaited future of its own was cancelled) → ``AdapterIndeterminate``;
    * any other exception, Octo errors included → ``AdapterFailed`` carrying
      only the exception's class name, never its text;
    * with ``returns``, a result of another type → ``AdapterFailed``.
    """
    if isinstance(deadline_seconds, bool) or not isinstance(deadline_seconds, int | float):
        raise TypeError("deadline_seconds must be a number")
    if not math.isfinite(deadline_seconds) or deadline_seconds <= 0:
        raise ValueError("deadline_seconds must be positive and finite")
    deadline = asyncio.get_running_loop().time() + deadline_seconds
    timeout = asyncio.timeout_at(deadline)
    try:
        async with timeout:
            result = await call(deadline)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        # Nobody cancelled this task: the adapter let a cancellation of its own
        # escape. The call may or may not have had its effect.
        raise AdapterIndeterminate("cancelled") from None
    except WorkerAdapterError:
        raise
    except TimeoutError:
        if timeout.expired():
            raise AdapterIndeterminate("deadline") from None
        raise AdapterFailed("TimeoutError") from None
    except Exception as exc:
        raise AdapterFailed(type(exc).__name__) from None
    if returns is not None and not isinstance(result, returns):
        raise AdapterFailed("unexpected result type")
    return result


# msgspec's only message that quotes the value it refused (an enum or a literal).
_ENUM_VALUE = re.compile(r"^Invalid enum value .*?(?= - at `|$)", re.DOTALL)


def validation_text(error: msgspec.ValidationError) -> str:
    """msgspec's message for a value that does not convert, without any value:
    the expected type and the field ("Expected `str`, got `int` - at `$.name`",
    "Object missing required field `bucket`"); an enum or literal mismatch,
    which msgspec quotes, becomes "Invalid enum value - at `$.undo`"."""
    return _ENUM_VALUE.sub("Invalid enum value", str(error))


# Entry-point discovery ------------------------------------------------------


def load_adapters(
    names: Sequence[str],
    *,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> WorkerAdapterRegistry:
    """Load exactly the adapters named in ``names`` from the ``octo.adapters`` group.

    No other entry point of the group is imported. Each entry point is a
    class or factory called with its options as keyword arguments
    (``options[name]``, none when absent). Errors:

    * a name that no installed entry point declares, or whose own module is
      not there → ``MissingAdapter(name)``;
    * an entry point whose module raises on import (a dependency missing, a
      syntax error, anything else), or whose factory raises →
      ``AdapterLoadFailed(name, reason)``;
    * a name that is not a tool token, a factory result that is not a
      ``WorkerAdapter``, or an adapter whose ``tool`` names another tool →
      ``InvalidTool(name)``;
    * an adapter one of whose five async methods cannot be called as
      ``(request, grant, context)`` (an older two-argument contract)
      → ``AdapterLoadFailed(name, reason)`` naming the method;
    * a name listed twice → ``DuplicateTool(name)``.
    """
    options = options or {}
    available: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=ADAPTER_ENTRY_POINT_GROUP):
        # The first distribution on the path wins, like a normal import.
        available.setdefault(entry.name, entry)
    registry = WorkerAdapterRegistry()
    for name in names:
        if not is_token(name):
            raise InvalidTool(name)
        if registry.contains(name):
            raise DuplicateTool(name)
        found = available.get(name)
        if found is None:
            raise MissingAdapter(name)
        try:
            factory = found.load()
        except ModuleNotFoundError as exc:
            module = found.module
            if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
                raise MissingAdapter(name) from None  # the plug-in itself is not there
            raise AdapterLoadFailed(name, f"it imports {exc.name!r}, which is missing") from None
        except AttributeError:
            raise MissingAdapter(name) from None  # the module lacks the named object
        except Exception as exc:  # SyntaxError included: a module that raises on import
            raise AdapterLoadFailed(name, f"its module raised {type(exc).__name__}") from None
        given = dict(options.get(name, {}))
        unbound = _unbound_options(factory, given)
        if unbound is not None:
            raise AdapterLoadFailed(name, f"its options were refused: {unbound}") from None
        try:
            adapter = factory(**given)
        except AdapterInvalidOptions as exc:
            raise AdapterLoadFailed(
                name, f"its options were refused: {exc.detail or exc}"
            ) from None
        except (TypeError, ValueError) as exc:
            raise AdapterLoadFailed(
                name, f"it refused its options ({type(exc).__name__}): see adapters.options"
            ) from None
        except Exception as exc:
            raise AdapterLoadFailed(name, f"its factory raised {type(exc).__name__}") from None
        if not isinstance(adapter, WorkerAdapter):
            raise InvalidTool(name)
        declared = getattr(adapter, "tool", None)
        if declared is not None and declared != name:
            raise InvalidTool(name)
        _check_context_argument(name, adapter)
        registry.register(name, adapter)
    return registry


def _unbound_options(factory: Callable[..., Any], options: Mapping[str, Any]) -> str | None:
    """Why ``options`` cannot be passed to ``factory`` as keywords, naming only the
    parameters (a missing one, an unknown one), or None when they bind or the
    factory's signature cannot be read."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(**options)
    except TypeError as exc:
        # inspect's own text: parameter names only ("missing a required
        # argument: 'effect_log'", "got an unexpected keyword argument 'x'").
        return str(exc)
    return None


# The five methods the worker calls as ``method(request, grant, context)``.
CONTEXT_METHODS = (
    "invoke",
    "dispatch_operation",
    "compensate_operation",
    "reconcile_operation",
    "reconcile_compensation",
)


def _check_context_argument(name: str, adapter: object) -> None:
    """Refuse an adapter one of whose methods cannot take ``(request, grant, context)``.

    A plug-in written for an older two-argument contract would
    otherwise fail every call as ``adapter_failed``; it is refused at load
    instead, naming the adapter and the first such method.
    """
    for method in CONTEXT_METHODS:
        try:
            inspect.signature(getattr(adapter, method)).bind(None, None, None)
        except (TypeError, ValueError):
            raise AdapterLoadFailed(
                name, f"its method {method} does not take (request, grant, context)"
            ) from None
