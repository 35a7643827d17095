"""An operator's resolution at the worker: a lookup request carrying a decision.

A real ``WorkerSession`` with frames sealed by a real host-role
authenticator, the real ``SqliteJournalStore`` on a tmp_path file and the
in-test scripted plug-in (see ``test_session.py``). A resolution records
the decision for a ``pending`` or ``running`` key without calling the
adapter, answers a terminal key as it is, is answered from the journal when
its frame comes again, and spends no lookup budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.messages import (
    CompensationReconcileRequest,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
    ReconcileOperation,
    Resolution,
)
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, Pending, Succeeded

from .test_session import SCRIPTED, rejection_code
from .test_session_compensation_lookup import (
    closed,
    compensation_of,
    left_pending,
    lookup,
    lookup_world,
)


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = await lookup_world(tmp_path)
    yield w
    await closed(w)


DECISION = Resolution("failed", "alice", "nothing was sent (ticket 77)", "release-7")


def resolve(w: Any, key: str, decision: Resolution = DECISION) -> ReconcileOperation:
    request = w.reconcile(key, tool=SCRIPTED).request
    return ReconcileOperation(msgspec.structs.replace(request, resolution=decision))


async def test_a_resolution_records_the_decision_without_the_adapter(world: Any) -> None:
    w = world
    w.scripted.dispatch_outcome = AdapterIndeterminate("lost")
    refused = await w.send(w.dispatch("op-x", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    assert rejection_code(w.answer(refused)) == "indeterminate_operation"
    assert isinstance((await w.record("op-x")).state, Pending)
    calls = list(w.scripted.calls)

    sealed = w.host.seal(resolve(w, "op-x"))
    answered = w.answer(await w.deliver(sealed))
    assert isinstance(answered, ReconciledOperation)
    decided = answered.result.status
    assert decided == Failed(
        "resolved by operator alice (run release-7): nothing was sent (ticket 77)",
        "resolved_by_operator",
    )
    assert (await w.record("op-x")).state == decided
    assert w.scripted.calls == calls  # neither the effect nor its lookup ran
    assert w.session.reconciliations() == (0, {})  # no lookup budget spent

    # The same frame again (a redelivery) is answered from the journal.
    again = w.answer(await w.deliver(sealed))
    assert isinstance(again, ReconciledOperation) and again.result.status == decided
    # A later lookup is answered from the journal too: the adapter is not asked.
    looked = w.answer(await w.send(w.reconcile("op-x", tool=SCRIPTED)))
    assert isinstance(looked, ReconciledOperation) and looked.result.status == decided
    assert w.scripted.calls == calls


async def test_a_resolution_never_overwrites_an_outcome(world: Any) -> None:
    w = world
    done = w.answer(await w.send(w.dispatch("op-y", ToolPayload.json({"a": 1}), tool=SCRIPTED)))
    status = done.result.status
    assert isinstance(status, Succeeded)
    answered = w.answer(await w.send(resolve(w, "op-y")))
    assert isinstance(answered, ReconciledOperation) and answered.result.status == status
    assert (await w.record("op-y")).state == status
    unknown = w.answer(await w.send(resolve(w, "op-never")))
    assert rejection_code(unknown) == "unknown_operation"


async def test_a_compensation_is_resolved_by_its_own_decision(world: Any) -> None:
    w = world
    await left_pending(w)
    calls = list(w.scripted.calls)
    request = lookup(w, "op-x", "cmp-x").request
    decision = Resolution("cancelled", "bob", "the refund was voided by hand", "release-7")
    frame = ReconcileCompensation(msgspec.structs.replace(request, resolution=decision))
    assert isinstance(frame.request, CompensationReconcileRequest)
    answered = w.answer(await w.send(frame))
    assert isinstance(answered, ReconciledCompensation)
    assert answered.result.status == Cancelled()
    assert await compensation_of(w, "op-x") == Cancelled()
    assert w.scripted.calls == calls
