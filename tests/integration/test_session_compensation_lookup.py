"""The worker side of a compensation lookup: ``reconcile_compensation``, the mirror of
``reconcile_operation``.

Each scenario is the compensation counterpart of a reconciliation scenario
of ``test_session.py`` / ``test_session_store.py``, on the same parts: a
real ``WorkerSession`` with frames sealed by a real host-role
authenticator, the real ``SqliteJournalStore`` on a tmp_path file, the real
``files.publish`` adapter and the in-test ``ScriptedAdapter`` (a plug-in,
so a real part). Faults are injected at the store boundary.

What a lookup asks of the worker: authorize as a reconciliation (the request id
only); the journal checks the compensation's identity (its refusals spend
no budget); the reconciliation budgets are spent, the same counters as
``reconcile_operation``; no adapter is ``missing_adapter``; the adapter's
lookup runs before anything is committed and any error of it is
``adapter_error`` with the budget spent; the observation may settle a
``pending``/``running`` compensation, never change a terminal one; the
answer is committed with the row, the session state and the outbox, then
published, then the delivery is acked; a duplicate is answered from the
journal.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.grants import CapabilityGrant
from octo_common.messages import ReconciledCompensation, RequestRejected
from octo_common.payload import ToolPayload
from octo_common.states import Failed, Pending, Running, Succeeded
from octo_worker.adapters.contract import BaseWorkerAdapter, DurableOperationContract
from octo_worker.journal import WorkerOperationRecord
from octo_worker.session.session import WorkerSessionLimits

from .test_session import (
    SCOPE,
    SCRIPTED,
    RecordingDelivery,
    World,
    commits_since,
    open_world,
    publish_grant,
    rejection_code,
    scripted_grant,
    wait_until,
)
from .test_session_store import restart

GRANT = scripted_grant(max_compensations=1)
UNDO = ToolPayload.json({"undo": 1})
DONE = Succeeded(ToolPayload.json({"undone": 1}))


async def lookup_world(tmp_path: Path, *, limits: WorkerSessionLimits | None = None) -> World:
    return await open_world(tmp_path, [publish_grant(), GRANT], limits=limits)


@pytest.fixture
async def world(tmp_path: Path) -> Any:
    w = await lookup_world(tmp_path)
    yield w
    w.files.close()
    await w.real_store.close()


async def closed(w: World) -> None:
    w.files.close()
    await w.real_store.close()


def lookup(w: World, key: str, compensation_key: str, **kw: Any) -> Any:
    return w.reconcile_compensation(key, compensation_key, GRANT, tool=SCRIPTED, **kw)


async def compensation_of(w: World, key: str) -> Any:
    record = await w.record(key)
    assert record is not None and record.compensation is not None
    return record.compensation.state


async def left_pending(w: World, key: str = "op-x", compensation_key: str = "cmp-x") -> None:
    """A succeeded original whose compensation ran with an unknown outcome: pending."""
    await w.send(w.dispatch(key, ToolPayload.json({"a": 1}), tool=SCRIPTED))
    w.scripted.compensate_outcome = AdapterIndeterminate("lost")
    refused = await w.send(w.compensate(key, compensation_key, UNDO, GRANT, tool=SCRIPTED))
    assert rejection_code(w.answer(refused)) == "indeterminate_compensation"
    assert isinstance(await compensation_of(w, key), Pending)


# The lookup and its budgets ------------------------------


async def test_a_lookup_settles_a_pending_compensation_and_spends_the_shared_budget(
    tmp_path: Path,
) -> None:
    w = await lookup_world(tmp_path, limits=WorkerSessionLimits(per_tool=1, per_session=64))
    try:
        await left_pending(w)
        # The journal's identity checks refuse without spending the budget.
        unknown = await w.send(lookup(w, "op-unknown", "cmp-x"))
        assert rejection_code(w.answer(unknown)) == "unknown_operation"
        await w.send(w.dispatch("op-bare", ToolPayload.json({"a": 1}), tool=SCRIPTED))
        uncompensated = await w.send(lookup(w, "op-bare", "cmp-x"))
        assert rejection_code(w.answer(uncompensated)) == "unknown_compensation"
        other_key = await w.send(lookup(w, "op-x", "cmp-other"))
        assert rejection_code(w.answer(other_key)) == "compensation_identity_mismatch"
        stale = GRANT.with_compensation_limit(2)  # another grant fingerprint
        stale_lookup = w.reconcile_compensation("op-x", "cmp-x", stale, tool=SCRIPTED)
        assert rejection_code(w.answer(await w.send(stale_lookup))) == (
            "compensation_identity_mismatch"
        )
        other_scope = await w.send(lookup(w, "op-x", "cmp-x", tenant="tenant-other"))
        assert rejection_code(w.answer(other_scope)) == "operation_journal_scope_mismatch"
        assert w.session.reconciliations() == (0, {})
        assert w.scripted.calls == ["dispatch", "compensate", "dispatch"]

        head = await w.real_store.head_revision(SCOPE)
        start = len(w.store.commits)
        w.scripted.lookup_outcome = DONE
        first = await w.send(lookup(w, "op-x", "cmp-x"))
        answer = w.answer(first)
        assert isinstance(answer, ReconciledCompensation)
        assert answer.result.status == DONE
        assert (answer.result.operation_key, answer.result.compensation_key) == ("op-x", "cmp-x")
        assert answer.result.grant_fingerprint == GRANT.compensation_fingerprint()
        assert first.kinds == ["reply", "ack"]  # acked only after the publish
        (respond,) = commits_since(w, start)  # one commit: row, session state, outbox
        assert respond.journal is not None and "op-x" in respond.journal.rows
        assert len(respond.outbox_insert) == 1
        assert await w.real_store.head_revision(SCOPE) > head
        assert await compensation_of(w, "op-x") == DONE
        record = await w.record("op-x")
        assert record is not None and isinstance(record.state, Succeeded)  # never changes
        assert w.session.reconciliations() == (1, {SCRIPTED: 1})

        # The per-tool budget is the one reconcile_operation spends too.
        spent = await w.send(w.reconcile("op-x", tool=SCRIPTED))
        assert rejection_code(w.answer(spent)) == "reconciliation_budget_exhausted"
        again = await w.send(lookup(w, "op-x", "cmp-x"))
        assert rejection_code(w.answer(again)) == "reconciliation_budget_exhausted"
        assert w.scripted.calls == ["dispatch", "compensate", "dispatch", "lookup"]
    finally:
        await closed(w)


async def test_a_reconcile_operation_spends_the_session_budget_a_lookup_then_lacks(
    tmp_path: Path,
) -> None:
    w = await lookup_world(tmp_path, limits=WorkerSessionLimits(per_tool=2, per_session=1))
    try:
        await left_pending(w)
        w.scripted.reconcile_outcome = Succeeded(ToolPayload.json({"ok": 1}))
        reconciled = await w.send(w.reconcile("op-x", tool=SCRIPTED))
        assert not isinstance(w.answer(reconciled), RequestRejected)
        refused = await w.send(lookup(w, "op-x", "cmp-x"))
        assert rejection_code(w.answer(refused)) == "reconciliation_session_budget_exhausted"
        assert w.session.reconciliations() == (1, {SCRIPTED: 1})
        assert "lookup" not in w.scripted.calls
    finally:
        await closed(w)


async def test_looking_up_a_running_compensation_twice_advances_the_revision_each_time(
    world: World,
) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = Running()
    revisions = []
    for _ in range(2):
        start = len(world.store.commits)
        delivery = await world.send(lookup(world, "op-x", "cmp-x"))
        assert isinstance(world.answer(delivery), ReconciledCompensation)
        (commit,) = commits_since(world, start)
        assert commit.journal is not None and "op-x" in commit.journal.rows  # always included
        revisions.append(await world.real_store.head_revision(SCOPE))
    assert revisions[1] > revisions[0]
    assert isinstance(await compensation_of(world, "op-x"), Running)
    assert world.session.reconciliations() == (2, {SCRIPTED: 2})


async def test_a_terminal_compensation_accepts_itself_and_refuses_a_contradiction(
    world: World,
) -> None:
    await world.send(world.dispatch("op-t", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    world.scripted.compensate_outcome = DONE
    await world.send(world.compensate("op-t", "cmp-t", UNDO, GRANT, tool=SCRIPTED))
    assert await compensation_of(world, "op-t") == DONE

    world.scripted.lookup_outcome = DONE
    same = await world.send(lookup(world, "op-t", "cmp-t"))
    answer = world.answer(same)
    assert isinstance(answer, ReconciledCompensation) and answer.result.status == DONE

    world.scripted.lookup_outcome = Failed("gone")
    contradictory = await world.send(lookup(world, "op-t", "cmp-t"))
    assert rejection_code(world.answer(contradictory)) == "invalid_worker_compensation_transition"
    assert await compensation_of(world, "op-t") == DONE
    assert world.session.status == "open"
    assert world.session.reconciliations() == (2, {SCRIPTED: 2})


async def test_a_lookup_adapter_error_keeps_the_budget_spent(world: World) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = AdapterIndeterminate("slow")
    refused = await world.send(lookup(world, "op-x", "cmp-x"))
    rejected = world.answer(refused)
    assert rejection_code(rejected) == "adapter_error"
    assert isinstance(rejected, RequestRejected)
    assert (rejected.operation_key, rejected.compensation_key) == ("op-x", "cmp-x")
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})
    assert isinstance(await compensation_of(world, "op-x"), Pending)


async def test_a_lookup_status_outside_the_grant_is_refused_and_changes_nothing(
    world: World,
) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = Succeeded(ToolPayload.json({"big": "z" * 300}))
    refused = await world.send(lookup(world, "op-x", "cmp-x"))
    assert rejection_code(world.answer(refused)) == "output_too_large"
    assert isinstance(await compensation_of(world, "op-x"), Pending)
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})


class WithoutLookup(BaseWorkerAdapter):
    """Declares a contract and compensates, but has no ``reconcile_compensation``."""

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        return Succeeded(ToolPayload.json({"ok": 1}))

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AdapterIndeterminate("lost")


async def test_an_adapter_without_the_lookup_leaves_the_compensation_pending(
    tmp_path: Path,
) -> None:
    tool = "test.nolookup"
    grant = CapabilityGrant(tool, "json", max_calls=8, max_compensations=1)
    w = await open_world(tmp_path, [publish_grant(), grant], extra={tool: WithoutLookup()})
    try:
        await w.send(w.dispatch("op-n", ToolPayload.json({"a": 1}), tool=tool))
        await w.send(w.compensate("op-n", "cmp-n", UNDO, grant, tool=tool))
        refused = await w.send(w.reconcile_compensation("op-n", "cmp-n", grant, tool=tool))
        assert rejection_code(w.answer(refused)) == "adapter_error"
        record = await w.record("op-n")
        assert record is not None and record.compensation is not None
        assert isinstance(record.compensation.state, Pending)  # left for an operator
        assert w.session.reconciliations() == (1, {tool: 1})
    finally:
        await closed(w)


async def test_a_lookup_without_an_adapter_is_refused_after_spending(world: World) -> None:
    await left_pending(world)
    world.adapters.hidden.add(SCRIPTED)
    refused = await world.send(lookup(world, "op-x", "cmp-x"))
    assert rejection_code(world.answer(refused)) == "missing_adapter"
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})
    assert world.scripted.calls == ["dispatch", "compensate"]


async def test_a_lookup_commit_failure_is_not_indeterminate(world: World) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = DONE
    world.store.fail_commits = {len(world.store.commits) + 1}
    delivery = await world.send(lookup(world, "op-x", "cmp-x"))
    assert rejection_code(world.answer(delivery)) == "journal_persistence_failed"
    assert world.session.reconciliations() == (0, {})  # restored
    assert isinstance(await compensation_of(world, "op-x"), Pending)


async def test_a_poisoned_session_refuses_a_lookup(world: World) -> None:
    await left_pending(world)
    world.store.fail_commits = {len(world.store.commits) + 1}
    await world.send(world.invoke(ToolPayload.json({"a": 1})))
    assert world.session.status == "poisoned"
    refused = await world.send(lookup(world, "op-x", "cmp-x"))
    assert rejection_code(world.answer(refused)) == "session_poisoned"
    assert "lookup" not in world.scripted.calls


# Duplicates ------------------------------------------------------------------------


async def test_a_duplicate_lookup_is_answered_from_the_journal(world: World) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = Running()
    frame = world.host.seal(lookup(world, "op-x", "cmp-x"))
    await world.deliver(frame)
    start = len(world.store.commits)
    again = await world.deliver(frame)
    answer = world.answer(again)
    assert isinstance(answer, ReconciledCompensation)
    assert answer.result.request_id == "lookup-3"  # the frame's own request id
    assert isinstance(answer.result.status, Running)
    (commit,) = commits_since(world, start)  # session state and outbox only
    assert commit.journal is None and len(commit.outbox_insert) == 1
    assert again.kinds == ["reply", "ack"]
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})  # no budget
    assert world.scripted.calls.count("lookup") == 1  # no adapter


async def test_a_duplicate_lookup_of_a_pending_compensation_is_pending_compensation(
    world: World,
) -> None:
    await left_pending(world)
    world.scripted.lookup_outcome = AdapterIndeterminate("slow")
    frame = world.host.seal(lookup(world, "op-x", "cmp-x"))
    first = await world.deliver(frame)
    assert rejection_code(world.answer(first)) == "adapter_error"
    duplicate = await world.deliver(frame)
    rejected = world.answer(duplicate)
    assert rejection_code(rejected) == "pending_compensation"
    assert isinstance(rejected, RequestRejected)
    assert (rejected.operation_key, rejected.compensation_key) == ("op-x", "cmp-x")
    assert world.scripted.calls.count("lookup") == 1


async def test_a_duplicate_lookup_of_an_unknown_compensation_is_refused(world: World) -> None:
    await world.send(world.dispatch("op-u", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    frame = world.host.seal(lookup(world, "op-u", "cmp-u"))
    first = await world.deliver(frame)
    assert rejection_code(world.answer(first)) == "unknown_compensation"
    duplicate = await world.deliver(frame)
    assert rejection_code(world.answer(duplicate)) == "unknown_compensation"
    assert world.session.reconciliations() == (0, {})


# Across a restart (counterpart of the crash-after-admission scenario) ------------------


async def test_a_crash_after_the_compensation_admission_is_settled_by_the_lookup(
    world: World,
) -> None:
    await world.send(world.dispatch("op-c", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    gate = asyncio.Event()
    world.scripted.gate = gate
    frame = world.host.seal(world.compensate("op-c", "cmp-c", UNDO, GRANT, tool=SCRIPTED))
    delivery = RecordingDelivery()
    task = asyncio.create_task(world.session.handle(frame, world.store, delivery))
    await wait_until(lambda: world.scripted.calls == ["dispatch", "compensate"])
    assert delivery.kinds == ["ack"]  # acked after the admission commit, before the adapter
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await restart(world)
    world.scripted.gate = None
    assert isinstance(await compensation_of(world, "op-c"), Pending)
    redelivered = await world.deliver(frame)
    assert rejection_code(world.answer(redelivered)) == "pending_compensation"

    world.scripted.lookup_outcome = DONE
    settled = await world.send(lookup(world, "op-c", "cmp-c"))
    answer = world.answer(settled)
    assert isinstance(answer, ReconciledCompensation) and answer.result.status == DONE
    assert await compensation_of(world, "op-c") == DONE
    # The inverse ran once, before the crash; the lookup never compensates.
    assert world.scripted.calls == ["dispatch", "compensate", "lookup"]
    replay = await world.deliver(frame)
    assert world.answer(replay).result.status == DONE  # type: ignore[attr-defined]


async def test_a_lookup_cut_before_its_commit_is_handled_as_new_after_a_restart(
    world: World,
) -> None:
    await left_pending(world)
    gate = asyncio.Event()
    world.scripted.gate = gate
    frame = world.host.seal(lookup(world, "op-x", "cmp-x"))
    task = asyncio.create_task(world.session.handle(frame, world.store, RecordingDelivery()))
    await wait_until(lambda: world.scripted.calls[-1:] == ["lookup"])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await restart(world)
    world.scripted.gate = None
    assert world.session.reconciliations() == (0, {})  # nothing of it was durable
    world.scripted.lookup_outcome = DONE
    again = await world.deliver(frame)
    assert isinstance(world.answer(again), ReconciledCompensation)
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})
    record: WorkerOperationRecord | None = await world.record("op-x")
    assert record is not None and record.compensation is not None
    assert record.compensation.state == DONE
