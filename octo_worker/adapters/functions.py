"""Adapters written as plain functions with typed inputs.

:class:`FunctionAdapter` is a :class:`~octo_worker.adapters.BaseWorkerAdapter`
whose four durable methods are functions registered with decorators::

    refunds = FunctionAdapter(
        "billing.refund",
        contract=DurableOperationContract.PROVIDER_IDEMPOTENCY_AND_RECONCILIATION,
        input=Refund,          # msgspec Struct: the dispatch payload, converted strictly
        inverse=UndoRefund,    # msgspec Struct: the one inverse payload it accepts
        options=Settings,      # msgspec Struct: [adapters.options."billing.refund"]
    )

    @refunds.dispatch
    async def refund(value: Refund, call: AdapterCall[Settings]) -> dict[str, str]: ...

    @refunds.compensate        # (inverse, call)
    @refunds.lookup            # (call): the dispatch's status by call.idempotency_key
    @refunds.lookup_compensation  # (call): the inverse's status by its key

The durable contract is declared explicitly (a :class:`DurableOperationContract`
member, no default), the input and inverse contracts are types, and every
function receives an :class:`AdapterCall`: the call's
:class:`~octo_worker.adapters.AdapterContext` (scope, session, the
adapter idempotency key, deadline), the operation key, for a compensation the
original operation's idempotency key, and the adapter's typed options.

The object is also the entry point's factory: ``load_adapters`` calls it
with the tool's options (``[adapters.options.<tool>]``), which are
converted to ``options`` strictly, and gets a configured copy; a copy
without a dispatch function, or without the dispatch lookup, is refused
(``FunctionAdapterIncomplete``): a durable operation whose outcome cannot
be looked up after a crash is not one. Plain (non-async) functions run in a
worker thread, so a blocking client neither stalls the daemon nor escapes
its deadline.

A dispatch or compensation input that does not convert, or an adapter
registered without its options, is refused before any function runs
(``AdapterInvalidJsonInput`` with msgspec's message, "Expected `str`, got
`int` - at `$.name"``; ``AdapterInvalidOptions``): the worker ends the key
``failed`` with the code ``input_refused`` / ``options_refused``, definite,
since nothing ran. Options refused at load name the field
(``AdapterInvalidOptions``, shown by ``load_adapters``).

What a function returns becomes the status: an ``OperationStatus``
(``Succeeded``, ``Failed``, ``Running``, ``Cancelled``) as it is; any other
value the JSON output of ``Succeeded`` (an object or an array); None from
``dispatch`` or ``compensate`` ``Succeeded({})``; None from a lookup
``Running``, since a key not seen yet proves nothing (it stays pending for
an operator, never ``Failed``).

It must never retry a function, call a lookup function to perform an
effect, or let an input that does not convert reach a function.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from octo_common.errors import AdapterInvalidJsonInput, AdapterInvalidOptions, OctoError
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, Running, Succeeded
from octo_worker.adapters.contract import (
    AdapterContext,
    BaseWorkerAdapter,
    DurableOperationContract,
    json_output_payload,
    run_handler,
    validation_text,
)

if TYPE_CHECKING:
    from octo_common.grants import CapabilityGrant
    from octo_common.messages import (
        CompensationReconcileRequest,
        OperationCompensationRequest,
        OperationDispatchRequest,
        OperationReconcileRequest,
    )
    from octo_common.states import OperationStatus

__all__ = ["AdapterCall", "FunctionAdapter", "FunctionAdapterIncomplete"]

OptionsT = TypeVar("OptionsT")
F = TypeVar("F", bound=Callable[..., Any])

_STATUSES = (Succeeded, Failed, Running, Cancelled)
_EMPTY = ToolPayload.json({})


class FunctionAdapterIncomplete(OctoError):
    """A function adapter was loaded without one of the functions its contract needs."""

    _fields = ("tool", "missing")
    tool: str
    missing: str


@dataclass(frozen=True, slots=True)
class AdapterCall(Generic[OptionsT]):
    """What a function of a :class:`FunctionAdapter` is told besides its input.

    ``idempotency_key`` names this call's effect (the operation's for
    dispatch and its lookup, the compensation's for compensate and its
    lookup); ``original_idempotency_key`` is always the operation's (so a
    compensation can name what it undoes at the provider). Never name an
    effect by ``operation_key``: keys are unique only within a scope.
    """

    context: AdapterContext
    operation_key: str
    original_idempotency_key: str
    options: OptionsT

    @property
    def idempotency_key(self) -> str:
        return self.context.idempotency_key

    @property
    def scope(self) -> str:
        return self.context.scope

    @property
    def deadline(self) -> float:
        """Event-loop time at which the worker stops waiting (the call is indeterminate)."""
        return self.context.deadline


class FunctionAdapter(BaseWorkerAdapter, Generic[OptionsT]):
    """An adapter made of plain functions (see the module docstring)."""

    def __init__(
        self,
        tool: str,
        *,
        contract: DurableOperationContract,
        input: type[Any],
        inverse: type[Any] | None = None,
        options: type[OptionsT] | None = None,
        deadline_seconds: float | None = None,
    ) -> None:
        if not isinstance(contract, DurableOperationContract):
            raise TypeError("contract must be a DurableOperationContract member")
        self.tool = tool
        self._contract = contract
        self._input = input
        self._inverse = inverse
        self._options_type = options
        self._options: Any = None
        self._configured = options is None
        if deadline_seconds is not None:
            self.deadline_seconds = deadline_seconds
        self._dispatch: Callable[..., Any] | None = None
        self._compensate: Callable[..., Any] | None = None
        self._lookup: Callable[..., Any] | None = None
        self._lookup_compensation: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        return f"FunctionAdapter(tool={self.tool!r}, contract={self._contract.value})"

    # -- registration ------------------------------------------------------------------

    def dispatch(self, function: F) -> F:
        """Register ``function(value, call)``: performs the effect at most once."""
        self._dispatch = _checked(function, 2, "dispatch")
        return function

    def compensate(self, function: F) -> F:
        """Register ``function(inverse, call)``: performs the inverse at most once.
        Needs ``inverse=`` (the inverse contract) at construction."""
        if self._inverse is None:
            raise TypeError("compensate needs inverse= (the inverse payload's type)")
        self._compensate = _checked(function, 2, "compensate")
        return function

    def lookup(self, function: F) -> F:
        """Register ``function(call)``: the dispatch's status by ``call.idempotency_key``;
        it must never perform the effect."""
        self._lookup = _checked(function, 1, "lookup")
        return function

    def lookup_compensation(self, function: F) -> F:
        """Register ``function(call)``: the inverse's status by ``call.idempotency_key``;
        it must never perform the inverse."""
        self._lookup_compensation = _checked(function, 1, "lookup_compensation")
        return function

    def __call__(self, **options: Any) -> FunctionAdapter[OptionsT]:
        """The entry point's factory: a copy configured with ``options`` (converted to
        the ``options`` type strictly; ``TypeError`` / ``ValueError`` refuse them)."""
        if self._dispatch is None:
            raise FunctionAdapterIncomplete(self.tool, "dispatch")
        if self._lookup is None:
            raise FunctionAdapterIncomplete(self.tool, "lookup")
        configured = copy.copy(self)
        if self._options_type is None:
            if options:
                raise AdapterInvalidOptions(
                    f"{self.tool} takes no options (given: {', '.join(sorted(options))})"
                )
        else:
            try:
                configured._options = msgspec.convert(options, self._options_type, strict=True)
            except msgspec.ValidationError as exc:
                # msgspec names the field and the expected type, never a value.
                raise AdapterInvalidOptions(validation_text(exc)) from None
            configured._configured = True
        return configured

    # -- the contract ------------------------------------------------------------------

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return self._contract

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        function = self._dispatch
        if function is None:
            return await super().dispatch_operation(request, grant, context)
        value = _converted(request.payload, self._input)
        call = self._call(context, request.operation_key, context.idempotency_key)
        return _status(await run_handler(function, value, call), _EMPTY)

    async def compensate_operation(
        self,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        function, inverse = self._compensate, self._inverse
        if function is None or inverse is None:
            return await super().compensate_operation(request, grant, context)
        value = _converted(request.payload, inverse)  # the inverse contract, first
        call = self._call(context, request.operation_key, _original_key(context, request))
        return _status(await run_handler(function, value, call), _EMPTY)

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        function = self._lookup
        if function is None:
            return await super().reconcile_operation(request, grant, context)
        call = self._call(context, request.operation_key, context.idempotency_key)
        return _status(await run_handler(function, call), None)

    async def reconcile_compensation(
        self,
        request: CompensationReconcileRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        function = self._lookup_compensation
        if function is None:
            return await super().reconcile_compensation(request, grant, context)
        call = self._call(context, request.operation_key, _original_key(context, request))
        return _status(await run_handler(function, call), None)

    def _call(
        self, context: AdapterContext, operation_key: str, original: str
    ) -> AdapterCall[OptionsT]:
        if not self._configured:
            # Registered as declared, never called with its options: a function
            # would get None for a typed value. Refused before it runs.
            raise AdapterInvalidOptions(f"{self.tool} was registered without its options")
        return AdapterCall(context, operation_key, original, self._options)


def _checked(function: F, arity: int, name: str) -> F:
    """``function`` if it can be called with ``arity`` positional arguments."""
    try:
        inspect.signature(function).bind(*([None] * arity))
    except (TypeError, ValueError):
        raise TypeError(f"{name} functions take {arity} positional argument(s)") from None
    return function


def _converted(payload: ToolPayload, kind: type[Any]) -> Any:
    if payload.format != "json":
        raise AdapterInvalidJsonInput("payload is not JSON")
    try:
        return msgspec.convert(payload.value, kind, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec's message names the field and the expected type ("Expected
        # `str`, got `int` - at `$.name`"), never the value: the failure text.
        raise AdapterInvalidJsonInput(validation_text(exc)) from None
    except (TypeError, ValueError) as exc:
        raise AdapterInvalidJsonInput(
            f"the input does not convert ({type(exc).__name__})"
        ) from None


def _original_key(
    context: AdapterContext, request: OperationCompensationRequest | CompensationReconcileRequest
) -> str:
    original = AdapterContext.for_operation(
        context.scope, context.session_id, request.operation_key, context.deadline
    )
    return original.idempotency_key


def _status(result: object, none: ToolPayload | None) -> OperationStatus:
    if isinstance(result, _STATUSES):
        return result
    if result is None:
        return Running() if none is None else Succeeded(none)
    return Succeeded(json_output_payload(result))
