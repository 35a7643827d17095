"""The adapter plug-in contract: declarations, defaults, the
adapter context, registry, typed JSON adapters, the call wrapper and entry-point
loading."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import msgspec
import pytest

from octo_common.errors import (
    AdapterFailed,
    AdapterIndeterminate,
    AdapterInvalidJsonInput,
    AdapterInvalidJsonOutput,
    AdapterUnsupported,
    DuplicateTool,
    InvalidCompensationKey,
    InvalidToken,
    InvalidTool,
    MissingAdapter,
    OutputTooLarge,
    WorkerAdapterError,
)
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    CompensationReconcileRequest,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
    ToolInvocation,
)
from octo_common.payload import ToolPayload
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
)
from octo_worker.adapters.files import FilesPublishAdapter

SESSION = "session-1"
TOOL = "math.add"
GRANT = CapabilityGrant.json(TOOL).with_compensation_limit(1)


class AddInput(msgspec.Struct, forbid_unknown_fields=True):
    left: int
    right: int


class Total(msgspec.Struct):
    total: int


SCOPE = "tenant-a"
# Event-loop time these direct calls may run until; none of them waits for it.
FAR_DEADLINE = 1e12
INVOKE_CONTEXT = AdapterContext.for_invoke(SCOPE, SESSION, "invoke-1", FAR_DEADLINE)


def invocation(payload: ToolPayload) -> ToolInvocation:
    return ToolInvocation(SESSION, "invoke-1", TOOL, payload)


# Declarations and defaults ----------------------------------------------------


def test_declaration_values() -> None:
    assert {s.name for s in InvocationSafety} == {"READ_ONLY", "INDEPENDENTLY_IDEMPOTENT"}
    assert {c.name for c in DurableOperationContract} == {
        "RECONCILIATION",
        "PROVIDER_IDEMPOTENCY_AND_RECONCILIATION",
    }


async def test_the_base_adapter_declares_nothing_and_supports_nothing() -> None:
    adapter = BaseWorkerAdapter()
    fingerprint = GRANT.compensation_fingerprint()
    binding = OperationCompensationBinding(TOOL, "op-1", "cmp-1", "tenant-a", fingerprint)
    operation = AdapterContext.for_operation(SCOPE, SESSION, "op-1", FAR_DEADLINE)
    compensation = AdapterContext.for_compensation(SCOPE, SESSION, "cmp-1", FAR_DEADLINE)
    calls = {
        "invoke": adapter.invoke(invocation(ToolPayload.json({})), GRANT, INVOKE_CONTEXT),
        "dispatch_operation": adapter.dispatch_operation(
            OperationDispatchRequest(SESSION, "d-1", TOOL, "op-1", ToolPayload.json({})),
            GRANT,
            operation,
        ),
        "compensate_operation": adapter.compensate_operation(
            OperationCompensationRequest(SESSION, "c-1", binding, ToolPayload.json({})),
            GRANT,
            compensation,
        ),
        "reconcile_operation": adapter.reconcile_operation(
            OperationReconcileRequest(SESSION, "r-1", TOOL, "op-1"), GRANT, operation
        ),
        "reconcile_compensation": adapter.reconcile_compensation(
            CompensationReconcileRequest(
                SESSION, "rc-1", TOOL, "op-1", "cmp-1", "tenant-a", fingerprint
            ),
            GRANT,
            compensation,
        ),
    }

    assert adapter.invocation_safety() is None
    assert adapter.durable_operation_contract() is None
    assert isinstance(adapter, WorkerAdapter)
    for method, call in calls.items():
        with pytest.raises(AdapterUnsupported) as info:
            await call
        assert info.value.method == method
        assert info.value.code == "adapter_unsupported"


def test_hook_docstrings_say_when_each_hook_runs() -> None:
    for name in (
        "invocation_safety",
        "durable_operation_contract",
        "invoke",
        "dispatch_operation",
        "compensate_operation",
        "reconcile_operation",
        "reconcile_compensation",
    ):
        doc = getattr(BaseWorkerAdapter, name).__doc__ or ""
        assert "Called" in doc, name
    assert "MUST NOT" in (BaseWorkerAdapter.reconcile_operation.__doc__ or "")
    assert "MUST NOT" in (BaseWorkerAdapter.reconcile_compensation.__doc__ or "")


# AdapterContext -------------------------------------------------------------


def _derived(scope: str, kind: str, key: str) -> str:
    """The adapter idempotency key written out with the blake3 package, not with octo code."""
    material = b"".join(
        len(part).to_bytes(8, "big") + part for part in (s.encode() for s in (scope, kind, key))
    )
    context = "octo 2026-12 adapter idempotency key v1"
    return str(blake3.blake3(material, derive_key_context=context).hexdigest())


def test_the_context_is_a_frozen_value_with_four_fields_in_order() -> None:
    key = "ab" * 32
    positional = AdapterContext("tenant-a", "session-1", key, 12.5)
    by_keyword = AdapterContext(
        scope="tenant-a", session_id="session-1", idempotency_key=key, deadline=12.5
    )
    assert positional == by_keyword and hash(positional) == hash(by_keyword)
    assert [f.name for f in dataclasses.fields(AdapterContext)] == [
        "scope",
        "session_id",
        "idempotency_key",
        "deadline",
    ]
    assert (positional.scope, positional.session_id) == ("tenant-a", "session-1")
    assert (positional.idempotency_key, positional.deadline) == (key, 12.5)
    assert positional != AdapterContext("tenant-b", "session-1", key, 12.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        positional.scope = "tenant-b"  # type: ignore[misc]
    # An integer deadline is the same event-loop time as a float.
    assert AdapterContext("tenant-a", "session-1", key, 12) == AdapterContext(
        "tenant-a", "session-1", key, 12.0
    )


def test_the_context_repr_shows_identifiers_only_and_may_be_logged() -> None:
    context = AdapterContext.for_operation("tenant-a", "session-1", "op-1", 99.0)
    text = repr(context)
    assert text.startswith("AdapterContext(scope='tenant-a', session_id='session-1'")
    assert context.idempotency_key in text and "99.0" in text


def test_each_constructor_derives_the_key_of_its_kind() -> None:
    operation = AdapterContext.for_operation("tenant-a", "session-1", "op-release-42", 5.0)
    compensation = AdapterContext.for_compensation("tenant-a", "session-1", "cmp-undo-42", 5.0)
    invoke = AdapterContext.for_invoke("tenant-a", "session-1", "invoke-7", 5.0)

    assert operation.idempotency_key == _derived("tenant-a", "operation", "op-release-42")
    assert compensation.idempotency_key == _derived("tenant-a", "compensation", "cmp-undo-42")
    assert invoke.idempotency_key == _derived("tenant-a", "invoke", "invoke-7")
    # The pinned known answer of test_digest, reached through the context.
    assert (
        operation.idempotency_key
        == "93e36e31716dcb9a326bc6f852a3ab8dfd24b75d6f76b66ca87f6c533b7fde69"
    )
    for context in (operation, compensation, invoke):
        assert (context.scope, context.session_id, context.deadline) == (
            "tenant-a",
            "session-1",
            5.0,
        )


def test_two_tenants_with_the_same_key_get_different_contexts() -> None:
    first = AdapterContext.for_operation("tenant-a", "session-1", "op-release-42", 5.0)
    second = AdapterContext.for_operation("tenant-b", "session-1", "op-release-42", 5.0)
    assert first.idempotency_key != second.idempotency_key
    # The session is not part of the key: a later session reaches the same effect.
    later = AdapterContext.for_operation("tenant-a", "session-2", "op-release-42", 9.0)
    assert later.idempotency_key == first.idempotency_key


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (("Tenant", "session-1", "ab" * 32, 1.0), InvalidToken),
        (("tenant-a", "session 1", "ab" * 32, 1.0), InvalidToken),
        (("tenant-a", "session-1", "AB" * 32, 1.0), ValueError),
        (("tenant-a", "session-1", "ab" * 31, 1.0), ValueError),
        (("tenant-a", "session-1", "../" + "a" * 61, 1.0), ValueError),
        (("tenant-a", "session-1", "ab" * 32, float("nan")), ValueError),
        (("tenant-a", "session-1", "ab" * 32, float("inf")), ValueError),
        (("tenant-a", "session-1", "ab" * 32, True), TypeError),
        (("tenant-a", "session-1", "ab" * 32, "soon"), TypeError),
    ],
)
def test_a_malformed_context_is_refused(fields: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        AdapterContext(*fields)


def test_the_constructors_refuse_keys_no_request_can_carry() -> None:
    with pytest.raises(InvalidCompensationKey):
        AdapterContext.for_compensation("tenant-a", "session-1", "undo-1", 1.0)
    with pytest.raises(InvalidToken):
        AdapterContext.for_operation("tenant-a", "session-1", "op/1", 1.0)
    with pytest.raises(InvalidToken):
        AdapterContext.for_invoke("tenant a", "session-1", "r-1", 1.0)


async def test_call_adapter_with_deadline_hands_the_call_its_cut_off_time() -> None:
    loop = asyncio.get_running_loop()
    seen: list[float] = []

    async def records(deadline: float) -> str:
        seen.append(deadline)
        return "done"

    before = loop.time()
    assert await call_adapter_with_deadline(records, deadline_seconds=7.0) == "done"
    after = loop.time()
    (deadline,) = seen
    assert before + 7.0 <= deadline <= after + 7.0

    async def waits_past(deadline: float) -> str:
        await asyncio.sleep(5)
        return "late"

    started = loop.time()
    with pytest.raises(AdapterIndeterminate):
        await call_adapter_with_deadline(waits_past, deadline_seconds=0.05)
    assert loop.time() < started + 2.0


async def test_an_adapter_of_the_old_two_argument_contract_fails_closed() -> None:
    class OldStyle(BaseWorkerAdapter):
        def durable_operation_contract(self) -> DurableOperationContract:
            return DurableOperationContract.RECONCILIATION

        async def dispatch_operation(self, request: Any, grant: Any) -> Any:  # type: ignore[override]
            raise AssertionError("never reached with a context")

    request = OperationDispatchRequest(SESSION, "d-1", TOOL, "op-1", ToolPayload.json({}))
    context = AdapterContext.for_operation(SCOPE, SESSION, "op-1", FAR_DEADLINE)
    with pytest.raises(AdapterFailed) as info:
        await call_adapter(
            lambda: OldStyle().dispatch_operation(request, GRANT, context),  # type: ignore[call-arg]
            deadline_seconds=1.0,
        )
    assert info.value.code == "adapter_failed"


def test_an_adapter_without_reconcile_compensation_is_not_a_worker_adapter() -> None:
    class FourMethods:
        def invocation_safety(self) -> None:
            return None

        def durable_operation_contract(self) -> None:
            return None

        async def invoke(self, request: Any, grant: Any, context: Any) -> Any: ...

        async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any: ...

        async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any: ...

        async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any: ...

    assert not isinstance(FourMethods(), WorkerAdapter)
    assert isinstance(BaseWorkerAdapter(), WorkerAdapter)


# Registry ------------------------------------------------------------------------


def test_the_registry_holds_one_adapter_per_token_tool() -> None:
    registry = WorkerAdapterRegistry()
    adder, other = BaseWorkerAdapter(), BaseWorkerAdapter()

    registry.register("math.add", adder)
    registry.register("files.publish", other)

    assert registry.contains("math.add") and "files.publish" in registry
    assert not registry.contains("math.sub")
    assert registry.get("math.add") is adder
    assert registry.get("math.sub") is None
    assert registry.tools() == ["files.publish", "math.add"]
    assert len(registry) == 2
    with pytest.raises(DuplicateTool) as duplicate:
        registry.register("math.add", other)
    assert duplicate.value.tool == "math.add"
    assert registry.get("math.add") is adder


@pytest.mark.parametrize("tool", ["", "Math.Add", "math add", "math/add", "a:b", "x" * 129])
def test_the_registry_refuses_tools_that_are_not_tokens(tool: str) -> None:
    registry = WorkerAdapterRegistry()

    with pytest.raises(InvalidTool) as info:
        registry.register(tool, BaseWorkerAdapter())
    assert info.value.tool == tool
    assert registry.tools() == []


# TypedJsonWorkerAdapter -----------------------------------------------------------


async def test_typed_json_adapter_converts_input_and_wraps_output() -> None:
    def add(value: AddInput) -> Total:
        return Total(value.left + value.right)

    adapter = TypedJsonWorkerAdapter(InvocationSafety.READ_ONLY, add, AddInput)

    result = await adapter.invoke(
        invocation(ToolPayload.json({"left": 20, "right": 22})), GRANT, INVOKE_CONTEXT
    )

    assert result == ToolPayload.json({"total": 42})
    assert adapter.invocation_safety() is InvocationSafety.READ_ONLY
    assert adapter.durable_operation_contract() is None
    with pytest.raises(AdapterUnsupported):
        await adapter.dispatch_operation(
            OperationDispatchRequest(SESSION, "d-1", TOOL, "op-1", ToolPayload.json({})),
            GRANT,
            AdapterContext.for_operation(SCOPE, SESSION, "op-1", FAR_DEADLINE),
        )


async def test_typed_json_adapter_accepts_async_handlers_and_plain_containers() -> None:
    async def echo(value: dict[str, Any]) -> list[Any]:
        return [value, 1]

    adapter = TypedJsonWorkerAdapter(InvocationSafety.INDEPENDENTLY_IDEMPOTENT, echo, dict)

    result = await adapter.invoke(invocation(ToolPayload.json({"a": [1.5]})), GRANT, INVOKE_CONTEXT)

    assert result == ToolPayload.json([{"a": [1.5]}, 1])


async def test_a_blocking_plain_handler_neither_stalls_the_loop_nor_escapes_the_deadline() -> None:
    release = threading.Event()

    def blocking(value: dict[str, Any]) -> dict[str, Any]:
        release.wait(5)  # a synchronous client call that hangs
        return value

    adapter = TypedJsonWorkerAdapter(InvocationSafety.READ_ONLY, blocking, dict)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    counting = asyncio.ensure_future(ticker())
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with pytest.raises(AdapterIndeterminate):
            await call_adapter_with_deadline(
                lambda deadline: adapter.invoke(
                    invocation(ToolPayload.json({"a": 1})),
                    GRANT,
                    AdapterContext.for_invoke(SCOPE, SESSION, "invoke-1", deadline),
                ),
                deadline_seconds=0.2,
            )
        assert loop.time() - started < 2.0
        assert ticks >= 5  # the loop kept running meanwhile
    finally:
        release.set()
        counting.cancel()


@pytest.mark.parametrize(
    "payload",
    [
        ToolPayload.text('{"left":1,"right":2}'),
        ToolPayload.json({"left": "20", "right": 22}),
        ToolPayload.json({"left": 20}),
        ToolPayload.json({"left": 20, "right": 22, "extra": 1}),
        ToolPayload.json({"left": True, "right": 22}),
        ToolPayload.json([20, 22]),
    ],
)
async def test_typed_json_adapter_refuses_input_that_does_not_convert(
    payload: ToolPayload,
) -> None:
    called: list[AddInput] = []
    adapter = TypedJsonWorkerAdapter(InvocationSafety.READ_ONLY, called.append, AddInput)

    with pytest.raises(AdapterInvalidJsonInput):
        await adapter.invoke(invocation(payload), GRANT, INVOKE_CONTEXT)
    assert called == []


@pytest.mark.parametrize(
    "output", [42, "text", None, True, {"x": float("nan")}, {1: "a"}, object()]
)
async def test_typed_json_adapter_refuses_output_that_is_not_a_json_container(
    output: object,
) -> None:
    adapter = TypedJsonWorkerAdapter(InvocationSafety.READ_ONLY, lambda _: output, dict)

    with pytest.raises(AdapterInvalidJsonOutput):
        await adapter.invoke(invocation(ToolPayload.json({})), GRANT, INVOKE_CONTEXT)


async def test_typed_json_adapter_lets_handler_errors_through() -> None:
    def broken(_: dict[str, Any]) -> dict[str, Any]:
        raise ZeroDivisionError("secret detail")

    adapter = TypedJsonWorkerAdapter(InvocationSafety.READ_ONLY, broken, dict)

    with pytest.raises(ZeroDivisionError):
        await adapter.invoke(invocation(ToolPayload.json({})), GRANT, INVOKE_CONTEXT)


def test_typed_json_adapter_needs_a_safety_declaration() -> None:
    with pytest.raises(TypeError):
        TypedJsonWorkerAdapter("read_only", dict, dict)  # type: ignore[arg-type]


# call_adapter ------------------------------------------------------------------------


async def test_call_adapter_returns_the_result() -> None:
    async def ok() -> str:
        return "done"

    assert await call_adapter(ok, deadline_seconds=1.0) == "done"
    assert await call_adapter(ok, deadline_seconds=1, returns=str) == "done"


async def test_an_expired_deadline_is_indeterminate() -> None:
    started = asyncio.Event()

    async def slow() -> str:
        started.set()
        await asyncio.sleep(10)
        return "late"

    with pytest.raises(AdapterIndeterminate) as info:
        await call_adapter(slow, deadline_seconds=0.05)
    assert started.is_set()
    assert info.value.code == "adapter_indeterminate"


async def test_the_adapters_own_timeout_is_a_failure_not_the_deadline() -> None:
    async def times_out() -> str:
        raise TimeoutError("upstream took too long")

    with pytest.raises(AdapterFailed) as info:
        await call_adapter(times_out, deadline_seconds=5.0)
    assert info.value.detail == "TimeoutError"


async def test_foreign_exceptions_become_adapter_failed_without_their_text() -> None:
    async def broken() -> str:
        raise RuntimeError("secret-token-abc payload text")

    with pytest.raises(AdapterFailed) as info:
        await call_adapter(broken, deadline_seconds=1.0)

    error = info.value
    assert error.detail == "RuntimeError"
    assert "secret" not in str(error) and "secret" not in repr(error)
    assert error.__cause__ is None and error.__suppress_context__


async def test_adapter_errors_pass_through_unchanged() -> None:
    raised = AdapterInvalidJsonInput("bad input detail")

    async def refuses() -> str:
        raise raised

    with pytest.raises(WorkerAdapterError) as info:
        await call_adapter(refuses, deadline_seconds=1.0)
    assert info.value is raised
    assert "detail" not in str(info.value)


async def test_other_octo_errors_from_an_adapter_are_failures() -> None:
    async def wrong() -> str:
        raise OutputTooLarge(10, 5)

    with pytest.raises(AdapterFailed) as info:
        await call_adapter(wrong, deadline_seconds=1.0)
    assert info.value.detail == "OutputTooLarge"


async def test_an_unexpected_result_type_is_a_failure() -> None:
    async def wrong() -> object:
        return object()

    with pytest.raises(AdapterFailed):
        await call_adapter(wrong, deadline_seconds=1.0, returns=str)


async def test_cancellation_propagates_through_call_adapter() -> None:
    started = asyncio.Event()

    async def slow() -> str:
        started.set()
        await asyncio.sleep(10)
        return "late"

    task = asyncio.create_task(call_adapter(slow, deadline_seconds=30.0))
    await started.wait()
    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_cancellation_the_adapter_raises_itself_is_indeterminate() -> None:
    shared: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    shared.cancel()  # e.g. a token refresh another call's deadline cancelled

    async def waits_on_it() -> str:
        return await shared

    with pytest.raises(AdapterIndeterminate) as info:
        await call_adapter(waits_on_it, deadline_seconds=5.0)
    assert info.value.code == "adapter_indeterminate"
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0


@pytest.mark.parametrize("deadline", [0, -1.0, float("inf"), float("nan")])
async def test_call_adapter_needs_a_positive_finite_deadline(deadline: float) -> None:
    async def ok() -> str:
        return "done"

    with pytest.raises(ValueError):
        await call_adapter(ok, deadline_seconds=deadline)


def test_adapter_deadline_reads_the_adapters_declaration() -> None:
    adapter = BaseWorkerAdapter()
    assert adapter_deadline(adapter) == DEFAULT_ADAPTER_DEADLINE_SECONDS
    adapter.deadline_seconds = 2.5
    assert adapter_deadline(adapter) == 2.5
    adapter.deadline_seconds = -1
    assert adapter_deadline(adapter) == DEFAULT_ADAPTER_DEADLINE_SECONDS
    assert adapter_deadline(object()) == DEFAULT_ADAPTER_DEADLINE_SECONDS


# Entry-point loading ----------------------------------------------------------------

PLUGIN_MODULE = "octo_test_plugins_for_loading"

PLUGIN_SOURCE = """
from octo_worker.adapters.contract import BaseWorkerAdapter, InvocationSafety


class EchoAdapter(BaseWorkerAdapter):
    tool = "echo.tool"

    def __init__(self, prefix="none"):
        self.prefix = prefix

    def invocation_safety(self):
        return InvocationSafety.READ_ONLY


def make_echo(prefix="none"):
    return EchoAdapter(prefix)


class WrongTool(BaseWorkerAdapter):
    tool = "other.tool"


class NotAnAdapter:
    ...


class NeedsAToken(BaseWorkerAdapter):
    tool = "token.tool"

    def __init__(self):
        raise KeyError("BILLING_TOKEN")  # an environment variable it expected


class TwoArguments(BaseWorkerAdapter):
    # Written for a two-argument contract: no context argument.

    async def reconcile_operation(self, request, grant):
        return None


class KeywordContext(BaseWorkerAdapter):
    # Takes the context by keyword only: the worker passes it by position.

    async def dispatch_operation(self, request, grant, *, context):
        return None


class FlexibleContext(BaseWorkerAdapter):
    # Accepts the three arguments however it likes: loads.

    async def dispatch_operation(self, request, *rest, **extra):
        return None

    async def reconcile_operation(self, request, grant, context=None):
        return None
"""

DEPENDENT_MODULE = "octo_test_plugin_with_a_missing_dependency"
DEPENDENT_SOURCE = "import octo_dependency_that_is_not_installed\n"
RAISING_MODULE = "octo_test_plugin_that_raises_on_import"
RAISING_SOURCE = "raise RuntimeError('no config')\n"

ENTRY_POINTS = f"""[{ADAPTER_ENTRY_POINT_GROUP}]
echo.tool = {PLUGIN_MODULE}:make_echo
broken.tool = octo_module_that_does_not_exist:Adapter
wrong.tool = {PLUGIN_MODULE}:WrongTool
not.adapter = {PLUGIN_MODULE}:NotAnAdapter
missing.attr = {PLUGIN_MODULE}:NoSuchClass
token.tool = {PLUGIN_MODULE}:NeedsAToken
old.contract = {PLUGIN_MODULE}:TwoArguments
keyword.context = {PLUGIN_MODULE}:KeywordContext
flexible.context = {PLUGIN_MODULE}:FlexibleContext
dependent.tool = {DEPENDENT_MODULE}:Adapter
raising.tool = {RAISING_MODULE}:Adapter
"""


@pytest.fixture
def plugin_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real installed distribution (dist-info on sys.path) declaring test adapters."""
    root = tmp_path / "site"
    dist = root / "octo_test_plugins-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: octo-test-plugins\nVersion: 0.0.0\n"
    )
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    (root / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    (root / f"{DEPENDENT_MODULE}.py").write_text(DEPENDENT_SOURCE)
    (root / f"{RAISING_MODULE}.py").write_text(RAISING_SOURCE)
    monkeypatch.syspath_prepend(str(root))
    for module in (PLUGIN_MODULE, DEPENDENT_MODULE, RAISING_MODULE):
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield root
    for module in (PLUGIN_MODULE, DEPENDENT_MODULE, RAISING_MODULE):
        sys.modules.pop(module, None)


def test_load_adapters_loads_the_real_files_publish_entry_point(tmp_path: Path) -> None:
    options = {
        "files.publish": {"target_dir": str(tmp_path / "out"), "effect_log": str(tmp_path / "log")}
    }

    registry = load_adapters(["files.publish"], options=options)

    adapter = registry.get("files.publish")
    assert isinstance(adapter, FilesPublishAdapter)
    assert adapter.target_dir == tmp_path / "out"
    assert registry.tools() == ["files.publish"]
    assert not (tmp_path / "out").exists()  # loading does no I/O


def test_a_missing_or_unknown_option_is_named_at_load(tmp_path: Path) -> None:
    with pytest.raises(AdapterLoadFailed) as missing:
        load_adapters(["files.publish"], options={"files.publish": {"target_dir": "out"}})
    assert missing.value.reason == (
        "its options were refused: missing a required argument: 'effect_log'"
    )
    options = {"target_dir": "out", "effect_log": "log", "colour": "secret-value"}
    with pytest.raises(AdapterLoadFailed) as unknown:
        load_adapters(["files.publish"], options={"files.publish": options})
    assert "unexpected keyword argument 'colour'" in unknown.value.reason
    assert "secret-value" not in str(unknown.value)  # a name, never a value


def test_load_adapters_with_no_names_loads_nothing() -> None:
    assert load_adapters([]).tools() == []


def test_an_unknown_adapter_name_is_missing() -> None:
    with pytest.raises(MissingAdapter) as info:
        load_adapters(["no.such-adapter"])
    assert info.value.tool == "no.such-adapter"
    assert info.value.code == "missing_adapter"


def test_only_the_named_entry_points_are_imported(
    plugin_distribution: Path, tmp_path: Path
) -> None:
    options = {
        "files.publish": {"target_dir": str(tmp_path / "o"), "effect_log": str(tmp_path / "l")}
    }

    registry = load_adapters(["files.publish"], options=options)

    assert registry.tools() == ["files.publish"]
    assert PLUGIN_MODULE not in sys.modules  # its entry points were never loaded


def test_a_factory_entry_point_gets_its_options_as_keywords(plugin_distribution: Path) -> None:
    registry = load_adapters(["echo.tool"], options={"echo.tool": {"prefix": "p-"}})

    adapter: Any = registry.get("echo.tool")
    assert adapter.prefix == "p-"
    assert adapter.invocation_safety() is InvocationSafety.READ_ONLY


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("broken.tool", MissingAdapter),
        ("missing.attr", MissingAdapter),
        ("wrong.tool", InvalidTool),
        ("not.adapter", InvalidTool),
        ("Not A Token", InvalidTool),
    ],
)
def test_entry_points_that_do_not_yield_the_named_adapter(
    plugin_distribution: Path, name: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        load_adapters([name])


@pytest.mark.parametrize(
    ("name", "options", "reason"),
    [
        ("token.tool", {}, "its factory raised KeyError"),
        (
            "echo.tool",
            {"colour": "red"},
            "its options were refused: got an unexpected keyword argument 'colour'",
        ),
        ("dependent.tool", {}, "'octo_dependency_that_is_not_installed', which is missing"),
        ("raising.tool", {}, "its module raised RuntimeError"),
    ],
)
def test_an_installed_adapter_that_fails_to_load_is_named_with_the_failure(
    plugin_distribution: Path, name: str, options: dict[str, Any], reason: str
) -> None:
    with pytest.raises(AdapterLoadFailed) as info:
        load_adapters([name], options={name: options})
    assert info.value.code == "adapter_load_failed"
    assert info.value.adapter == name
    assert reason in info.value.reason
    assert "BILLING_TOKEN" not in str(info.value) and "red" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "method"),
    [("old.contract", "reconcile_operation"), ("keyword.context", "dispatch_operation")],
)
def test_a_plugin_of_the_two_argument_contract_is_refused_at_load(
    plugin_distribution: Path, name: str, method: str
) -> None:
    # Every method takes (request, grant, context); refused here, naming
    # the adapter and the method, instead of failing every call later.
    with pytest.raises(AdapterLoadFailed) as info:
        load_adapters([name])
    assert info.value.code == "adapter_load_failed"
    assert info.value.adapter == name
    assert f"its method {method} does not take (request, grant, context)" in info.value.reason


def test_a_plugin_that_accepts_the_context_however_it_likes_loads(
    plugin_distribution: Path,
) -> None:
    assert load_adapters(["flexible.context"]).tools() == ["flexible.context"]


def test_every_method_the_worker_calls_with_a_context_is_checked() -> None:
    # The five async methods of the contract, and only those.
    async_methods = {
        name
        for name, value in vars(BaseWorkerAdapter).items()
        if inspect.iscoroutinefunction(value)
    }
    assert set(CONTEXT_METHODS) == async_methods


def test_a_name_listed_twice_is_a_duplicate(plugin_distribution: Path) -> None:
    with pytest.raises(DuplicateTool):
        load_adapters(["echo.tool", "echo.tool"])


class _Deadline:
    def __init__(self, seconds: object) -> None:
        self.deadline_seconds = seconds


def test_effective_deadline_prefers_the_adapters_own_then_the_configured_one(
    tmp_path: Path,
) -> None:
    # `octo-worker adapters list` and the daemon apply this one rule.
    assert effective_adapter_deadline(_Deadline(10.0), 45.0) == 10.0
    # An adapter that sets the base class's default value still means it.
    assert effective_adapter_deadline(_Deadline(DEFAULT_ADAPTER_DEADLINE_SECONDS), 45.0) == (
        DEFAULT_ADAPTER_DEADLINE_SECONDS
    )
    assert effective_adapter_deadline(object(), 45.0) == 45.0
    assert effective_adapter_deadline(_Deadline(-1), 45.0) == 45.0  # invalid: the configured one
    assert effective_adapter_deadline(_Deadline(True), 45.0) == 45.0

    class Inherits(BaseWorkerAdapter):
        """Sets no deadline of its own."""

    class OwnClassDefault(BaseWorkerAdapter):
        deadline_seconds = DEFAULT_ADAPTER_DEADLINE_SECONDS

    class FromItsParent(OwnClassDefault):
        """Inherits its parent's own choice."""

    # BaseWorkerAdapter's class default is no choice of the adapter's own.
    assert effective_adapter_deadline(Inherits(), 45.0) == 45.0
    assert effective_adapter_deadline(OwnClassDefault(), 45.0) == DEFAULT_ADAPTER_DEADLINE_SECONDS
    assert effective_adapter_deadline(FromItsParent(), 45.0) == DEFAULT_ADAPTER_DEADLINE_SECONDS
    files = FilesPublishAdapter(tmp_path / "out", tmp_path / "log")
    assert effective_adapter_deadline(files, 45.0) == 10.0
