"""The adapter test kit (``octo_worker.testing``) and function adapters
(``octo_worker.adapters.functions``), on a real WorkerSession and SQLite journal.

The plug-in here is a ``FunctionAdapter`` over an in-memory provider that
records each effect by the idempotency key it is given (a real part: the
plug-in is the thing under test). Every scenario checks the provider's own
record of effects besides what the worker answered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import pytest

from octo_common.errors import AdapterInvalidJsonInput, AdapterInvalidOptions, WorkerRequestRejected
from octo_common.payload import ToolPayload
from octo_common.states import Failed, StateKind, Succeeded
from octo_worker.adapters.contract import AdapterContext, DurableOperationContract, WorkerAdapter
from octo_worker.adapters.functions import AdapterCall, FunctionAdapter, FunctionAdapterIncomplete
from octo_worker.testing import KILL_POINTS, AdapterKit, counts

TOOL = "test.transfer"


class Transfer(msgspec.Struct, forbid_unknown_fields=True):
    account: str
    cents: int


class UndoTransfer(msgspec.Struct, forbid_unknown_fields=True):
    undo: Literal["transfer"]


class Settings(msgspec.Struct):
    currency: str


@dataclass
class Provider:
    """An external system that deduplicates by the idempotency key it is handed."""

    sent: dict[str, Transfer] = field(default_factory=dict)
    refunded: dict[str, str] = field(default_factory=dict)  # original key -> refund key
    effects: int = 0


def receipt(call: AdapterCall[Settings]) -> dict[str, str]:
    return {"id": call.idempotency_key[:12], "currency": call.options.currency}


def transfer_adapter(provider: Provider) -> FunctionAdapter[Settings]:
    adapter: FunctionAdapter[Settings] = FunctionAdapter(
        TOOL,
        contract=DurableOperationContract.PROVIDER_IDEMPOTENCY_AND_RECONCILIATION,
        input=Transfer,
        inverse=UndoTransfer,
        options=Settings,
    )

    @adapter.dispatch
    async def send(value: Transfer, call: AdapterCall[Settings]) -> dict[str, str]:
        if call.idempotency_key not in provider.sent:
            provider.effects += 1
            provider.sent[call.idempotency_key] = value
        return receipt(call)

    @adapter.compensate
    async def refund(inverse: UndoTransfer, call: AdapterCall[Settings]) -> None:
        if call.original_idempotency_key not in provider.refunded:
            provider.effects += 1
            provider.refunded[call.original_idempotency_key] = call.idempotency_key

    @adapter.lookup
    def sent(call: AdapterCall[Settings]) -> dict[str, str] | None:  # a plain function: a thread
        # The same output as the dispatch's: the worker compares it with its journal.
        found = provider.sent.get(call.idempotency_key)
        return None if found is None else receipt(call)

    @adapter.lookup_compensation
    async def refunded(call: AdapterCall[Settings]) -> dict[str, str] | None:
        done = provider.refunded.get(call.original_idempotency_key) == call.idempotency_key
        return {} if done else None

    return adapter


PAYLOAD = ToolPayload.json({"account": "acc-1", "cents": 250})
INVERSE = ToolPayload.json({"undo": "transfer"})


@pytest.fixture
def provider() -> Provider:
    return Provider()


@pytest.fixture
def configured(provider: Provider) -> WorkerAdapter:
    return transfer_adapter(provider)(currency="EUR")


async def test_dispatch_runs_once_and_a_duplicate_is_answered_from_the_journal(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        key = kit.new_key()
        first = await kit.dispatch(PAYLOAD, key)
        assert first.kind == StateKind.SUCCEEDED
        assert isinstance(first, Succeeded) and first.payload.value["currency"] == "EUR"
        again = await kit.dispatch(PAYLOAD, key)
        assert again == first
        assert counts(kit.calls) == {"dispatch_operation": 1}
        assert provider.effects == 1
        # The same key with another input is refused by the journal, nothing runs.
        with pytest.raises(WorkerRequestRejected) as refused:
            await kit.dispatch(ToolPayload.json({"account": "acc-2", "cents": 1}), key)
        assert refused.value.rejection_code == "operation_identity_mismatch"
        assert counts(kit.calls) == {"dispatch_operation": 1}


async def test_an_input_that_does_not_convert_never_reaches_the_function(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        key = kit.new_key()
        bad = ToolPayload.json({"account": "acc-1", "cents": "250"})
        state = await kit.dispatch(bad, key)
        # Did not act: failed, definite, with msgspec's own message and the field.
        assert isinstance(state, Failed)
        assert state.code == "input_refused"
        assert state.message == "Expected `int`, got `str` - at `$.cents`"
        assert isinstance(kit.last_error, AdapterInvalidJsonInput)
        assert counts(kit.calls) == {"dispatch_operation": 1}
        # A duplicate and a lookup are answered from the journal: nothing is asked.
        assert await kit.dispatch(bad, key) == state
        assert await kit.reconcile(key) == state
        assert counts(kit.calls) == {"dispatch_operation": 1}
        assert provider.effects == 0


async def test_a_function_adapter_registered_without_its_options_refuses_before_running(
    provider: Provider, tmp_path: Path
) -> None:
    declared = transfer_adapter(provider)  # never called with its options
    async with AdapterKit(declared, tmp_path) as kit:
        state = await kit.dispatch(PAYLOAD)
        assert isinstance(state, Failed) and state.code == "options_refused"
        assert "without its options" in state.message
        assert provider.effects == 0


async def test_an_adapter_failure_is_the_cause_of_the_kits_refusal(
    provider: Provider, tmp_path: Path
) -> None:
    adapter = FunctionAdapter(
        TOOL, contract=DurableOperationContract.RECONCILIATION, input=Transfer
    )

    @adapter.dispatch
    async def send(value: Transfer, call: AdapterCall[None]) -> None:
        raise ConnectionError("provider unreachable at 10.0.0.7")

    @adapter.lookup
    async def look(call: AdapterCall[None]) -> None:
        return None

    async with AdapterKit(adapter(), tmp_path) as kit:
        with pytest.raises(WorkerRequestRejected) as refused:
            await kit.dispatch(PAYLOAD)
        # May have acted: the key stays pending, the code goes to the host, and
        # the test sees the plug-in's own exception.
        assert refused.value.rejection_code == "adapter_error"
        assert isinstance(refused.value.__cause__, ConnectionError)
        assert str(kit.last_error) == "provider unreachable at 10.0.0.7"


async def test_compensation_checks_the_inverse_contract_then_runs_once(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        key = kit.new_key()
        assert (await kit.dispatch(PAYLOAD, key)).kind == StateKind.SUCCEEDED
        undone = await kit.compensate(key, INVERSE)
        assert undone.kind == StateKind.SUCCEEDED
        assert (await kit.compensate(key, INVERSE)) == undone  # from the journal
        # A lookup always asks the plug-in, and must agree with the journal.
        assert (await kit.reconcile_compensation(key)).kind == StateKind.SUCCEEDED
        assert counts(kit.calls) == {
            "dispatch_operation": 1,
            "compensate_operation": 1,
            "reconcile_compensation": 1,
        }
        assert provider.effects == 2


async def test_a_wrong_inverse_is_refused_before_any_effect(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        key = kit.new_key()
        await kit.dispatch(PAYLOAD, key)
        undone = await kit.compensate(key, ToolPayload.json({"undo": "everything"}))
        assert isinstance(undone, Failed) and undone.code == "input_refused"
        # msgspec quotes a refused enum value: the failure text never does.
        assert undone.message == "Invalid enum value - at `$.undo`"
        assert provider.refunded == {}


@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_crash_at_each_kill_point_is_reconciled_without_a_second_effect(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path, point: str
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        report = await kit.dispatch_crashing(PAYLOAD, at=point)
        assert report.reached
        assert kit.restarts == 1
        effect_ran = point not in ("worker.after_admission_commit", "worker.after_ack")
        assert kit.calls["dispatch_operation"] == int(effect_ran)
        if report.redelivered is not None:
            # The broker delivers an unacked frame again: nothing runs twice.
            assert report.redelivered.settled
        state = await kit.reconcile(report.key)
        # The effect ran: the journal or the lookup says so. It did not: the
        # lookup finds nothing, which proves nothing: still unresolved.
        expected = StateKind.SUCCEEDED if effect_ran else StateKind.RUNNING
        assert state.kind == expected
        assert kit.calls["dispatch_operation"] == int(effect_ran)
        assert provider.effects == int(effect_ran)


@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_compensation_cut_at_each_kill_point_is_looked_up_not_run_again(
    configured: WorkerAdapter, provider: Provider, tmp_path: Path, point: str
) -> None:
    async with AdapterKit(configured, tmp_path) as kit:
        key = kit.new_key()
        await kit.dispatch(PAYLOAD, key)
        report = await kit.compensate_crashing(key, INVERSE, at=point)
        assert report.reached
        ran = point not in ("worker.after_admission_commit", "worker.after_ack")
        assert kit.calls["compensate_operation"] == int(ran)
        state = await kit.reconcile_compensation(key)
        assert state.kind == (StateKind.SUCCEEDED if ran else StateKind.RUNNING)
        assert kit.calls["compensate_operation"] == int(ran)
        assert len(provider.refunded) == int(ran)


async def test_a_function_adapter_needs_dispatch_and_its_lookup_and_typed_options(
    provider: Provider,
) -> None:
    bare = FunctionAdapter(TOOL, contract=DurableOperationContract.RECONCILIATION, input=Transfer)
    with pytest.raises(FunctionAdapterIncomplete):
        bare()

    @bare.dispatch
    async def send(value: Transfer, call: AdapterCall[None]) -> None:
        return None

    with pytest.raises(FunctionAdapterIncomplete) as missing:
        bare()
    assert missing.value.missing == "lookup"
    with pytest.raises(TypeError):
        FunctionAdapter(TOOL, contract="reconciliation", input=Transfer)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        bare.compensate(send)  # no inverse= contract
    with pytest.raises(TypeError):

        @bare.lookup
        async def wrong(value: Transfer, call: AdapterCall[None]) -> None:  # two arguments
            return None

    @bare.lookup
    async def look(call: AdapterCall[None]) -> None:
        return None

    assert bare() is not bare  # a configured copy
    with pytest.raises(AdapterInvalidOptions) as none_taken:
        bare(currency="EUR")  # no options type: none accepted
    assert none_taken.value.detail == f"{TOOL} takes no options (given: currency)"
    with pytest.raises(AdapterInvalidOptions) as strict:
        transfer_adapter(provider)(currency=978)  # options are converted strictly
    assert strict.value.detail == "Expected `str`, got `int` - at `$.currency`"
    with pytest.raises(AdapterInvalidOptions) as missing_option:
        transfer_adapter(provider)()
    assert missing_option.value.detail == "Object missing required field `currency`"


async def test_the_fixture_loads_a_plugin_by_its_entry_point(adapter_kit: object) -> None:
    make = adapter_kit
    assert callable(make)
    async with make("octo.noop") as kit:
        assert isinstance(kit, AdapterKit)
        state = await kit.dispatch(ToolPayload.json({}))
        assert state.kind == StateKind.SUCCEEDED
        assert counts(kit.calls) == {"dispatch_operation": 1}


def test_adapter_call_names_the_call() -> None:
    context = AdapterContext.for_operation("s", "sess", "op-1", 10.0)
    call = AdapterCall(context, "op-1", context.idempotency_key, None)
    assert call.scope == "s" and call.deadline == 10.0
    assert call.idempotency_key == context.idempotency_key
