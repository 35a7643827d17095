"""When the host client may send a dispatch again, and recovery key by key.

Real RabbitMQ, the in-process worker daemon with the real ``files.publish``
adapter (its effect log counts real effects) and real SQLite files for the
host ledger and the worker journal.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from octo_common.errors import CompensationActionDenied, WorkerRequestRejected
from octo_common.messages import OperationReconcileResult
from octo_common.payload import canonical_operation_input_bytes
from octo_common.states import Running, StateKind, Succeeded
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationPolicy, WorkflowCompensationTarget
from octo_host.engine import WorkflowEngine
from octo_host.plan import WorkflowStep
from octo_host.store import ledger_record_key
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import (
    GRANT,
    TOOL,
    AllowGrant,
    AllowUndo,
    HostEnv,
    HostFactory,
    WorkerEnv,
    WorkerRunner,
    compensation_target,
    manifest,
)
from .test_client import (
    RUN,
    STEPS,
    SlowPublish,
    publish_payload,
    recorded,
    registry,
    stored_ledger,
    undo_payload,
)

pytestmark = pytest.mark.rabbitmq

TWO_STEPS = [
    WorkflowStep("publish", "publish the release notes"),
    WorkflowStep("announce", "announce the release"),
]


async def recorded_two(client: HostClient) -> tuple[str, str]:
    """Two operations of one run, recorded and persisted, never sent."""
    run = await client.load_run(RUN, client.engine.plan(TWO_STEPS))
    first = await client.record_operation(
        run, "publish", TOOL, publish_payload("one.txt", "1"), b"n:1"
    )
    second = await client.record_operation(
        run, "announce", TOOL, publish_payload("two.txt", "2"), b"n:2"
    )
    return first, second


def effect_keys(worker_env: WorkerEnv) -> list[str]:
    return [e["operation_key"] for e in read_effect_log(worker_env.effect_log)]


def record_kinds(client: HostClient) -> list[str]:
    """The kinds of frame ``client`` publishes from now on, in order (a spy, not a stub)."""
    kinds: list[str] = []
    publish = client._broker.publish

    async def spy(*args: Any, kind: str = "frame", **kwargs: Any) -> None:
        kinds.append(kind)
        await publish(*args, kind=kind, **kwargs)

    client._broker.publish = spy  # type: ignore[method-assign]
    return kinds


# Re-dispatch only on unknown_operation for a key the ledger still holds pending ----------


async def test_a_succeeded_key_the_worker_forgot_is_never_dispatched_again(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)
    await asyncio.sleep(0.05)
    assert (await daemon.store.prune(worker_env.scope, 0)).removed == 1  # journal pruned

    # The operator runs the dispatch again: the worker answers operation_pruned.
    with pytest.raises(WorkerRequestRejected) as refused:
        await client.dispatch(session, run, key, publish_payload())

    assert refused.value.rejection_code == "operation_pruned"
    assert key in str(refused.value)
    assert client.published["dispatch_operation"] == 1
    assert effect_keys(worker_env) == [key]  # the effect ran once
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]


async def test_recover_never_dispatches_a_running_key_the_worker_does_not_know(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start()
    plan, run, key = await recorded(before)
    # The ledger says the worker reported the key running (its journal was lost since).
    ledger = run.ledger
    data = canonical_operation_input_bytes(publish_payload())
    request = before.engine.operation_reconcile_request(plan, ledger, key, data, "s-1", "r-1")
    before.engine.apply_verified_operation_reconciliation(
        plan, ledger, request, OperationReconcileResult("s-1", "r-1", TOOL, key, Running())
    )
    await before.store.replace(
        ledger_record_key(RUN), run._stored_revision, ledger.to_json().encode()
    )
    await hosts.close(before)

    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(
        RUN, after.engine.plan(STEPS), worker_env.scope, manifest(), inputs={key: publish_payload()}
    )

    assert summary.unresolved == [key]
    assert summary.errors == {key: "unknown_operation"}
    assert summary.operations == {key: StateKind.RUNNING}
    assert after.published["reconcile_operation"] == 1
    assert after.published["dispatch_operation"] == 0
    assert effect_keys(worker_env) == []
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.RUNNING  # type: ignore[union-attr]


# A key read from the ledger is reconciled before anything else ---------------------------


async def test_dispatch_after_a_host_restart_reconciles_a_pending_key_first(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = SlowPublish(worker_env, delay=0.5)
    await workers.start(adapters=registry(adapter))
    before = await hosts.start()
    plan, run, key = await recorded(before)
    session = await before.open_session(worker_env.scope, manifest())
    outbound = before.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-1", session.authenticator
    )
    await before.publish(session, outbound.frame, "d-1", kind="dispatch_operation")
    await hosts.crash(before)  # with the operation pending (maybe sent)

    after = await hosts.start(engine=WorkflowEngine())
    again = await after.load_run(RUN, after.engine.plan(STEPS))
    assert again.state(key) == StateKind.PENDING
    fresh = await after.open_session(worker_env.scope, manifest())
    state = await after.dispatch(fresh, again, key, publish_payload())

    assert isinstance(state, Succeeded)
    assert after.published["dispatch_operation"] == 0
    assert after.published["reconcile_operation"] >= 1
    assert adapter.dispatches == 1
    assert effect_keys(worker_env) == [key]
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]


async def test_two_concurrent_dispatches_of_one_key_send_one_dispatch_first(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    run = await client.load_run(RUN, client.engine.plan(TWO_STEPS))
    key = await client.record_operation(run, "publish", TOOL, publish_payload(), b"n:1")
    session = await client.open_session(worker_env.scope, manifest())
    kinds = record_kinds(client)

    # The first task holds the run lock (a ledger write) while both dispatches start.
    _, first, second = await asyncio.gather(
        client.record_operation(run, "announce", TOOL, publish_payload("two.txt"), b"n:2"),
        client.dispatch(session, run, key, publish_payload()),
        client.dispatch(session, run, key, publish_payload()),
    )

    assert isinstance(first, Succeeded) and first == second
    assert kinds[:2] == ["dispatch_operation", "reconcile_operation"]
    assert effect_keys(worker_env) == [key]


# Recovery goes on past a key that fails -------------------------------------------------


async def test_recover_reports_a_failing_key_and_goes_on_with_the_next(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start()
    first, second = await recorded_two(before)
    await hosts.close(before)

    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(
        RUN,
        after.engine.plan(TWO_STEPS),
        worker_env.scope,
        manifest(),
        inputs={
            first: publish_payload("one.txt", "not what was recorded"),
            second: publish_payload("two.txt", "2"),
        },
    )

    assert summary.unresolved == [first]
    assert summary.errors == {first: "input_fingerprint_mismatch"}
    assert summary.reconciled == [second]
    assert summary.operations == {first: StateKind.PENDING, second: StateKind.SUCCEEDED}
    assert effect_keys(worker_env) == [second]
    assert not summary.session.closed  # handed to the caller
    ledger = await stored_ledger(host_env)
    assert [op.state for op in ledger.operations] == [StateKind.PENDING, StateKind.SUCCEEDED]


class RefuseUndo:
    """An action verifier whose current policy refuses every compensation."""

    def __init__(self, scope: str) -> None:
        self.scope, self.calls = scope, 0

    def verify_compensation_action(self, action: Any) -> None:
        self.calls += 1
        raise CompensationActionDenied(action.operation_key, action.tool, self.scope)


async def test_recover_reports_a_refused_compensation_and_goes_on(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start()
    first, second = await recorded_two(before)
    run = await before.load_run(RUN, before.engine.plan(TWO_STEPS))
    session = await before.open_session(worker_env.scope, manifest())
    one = publish_payload("one.txt", "1")
    assert isinstance(await before.dispatch(session, run, first, one), Succeeded)
    inverse = undo_payload("one.txt")
    target = compensation_target(worker_env.scope, first, canonical_operation_input_bytes(inverse))
    compensation_key = await before.record_compensation(run, target, inverse, b"undo:1")
    await hosts.close(before)

    after = await hosts.start(engine=WorkflowEngine())
    refuse = RefuseUndo(worker_env.scope)
    refused = WorkflowCompensationTarget(
        first,
        WorkflowCompensationPolicy(worker_env.scope, GRANT),
        GRANT,
        AllowGrant(worker_env.scope, GRANT),
        refuse,
    )
    summary = await after.recover(
        RUN,
        after.engine.plan(TWO_STEPS),
        worker_env.scope,
        manifest(),
        inputs={second: publish_payload("two.txt", "2")},
        compensations={first: (refused, inverse)},
    )

    assert refuse.calls >= 1
    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "compensation_action_denied"}
    assert summary.compensations == {first: StateKind.PENDING}
    assert summary.operations == {first: StateKind.SUCCEEDED, second: StateKind.SUCCEEDED}
    assert summary.reconciled == [second]
    assert after.published["compensate_operation"] == 0
    assert effect_keys(worker_env) == [first, second]
    assert (worker_env.shelf / "one.txt").exists()


async def test_recover_closes_its_session_when_it_fails(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    before = await hosts.start()
    _, run, key = await recorded(before)
    session = await before.open_session(worker_env.scope, manifest())
    assert isinstance(await before.dispatch(session, run, key, publish_payload()), Succeeded)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))
    await before.record_compensation(run, target, inverse, b"undo:1")
    await hosts.close(before)

    after = await hosts.start(engine=WorkflowEngine())
    # A verifier defect (not an Octo error) is not a per-key refusal: it propagates.
    broken = compensation_target(worker_env.scope, key, b"something else", AllowUndo(b"other"))
    with pytest.raises(AssertionError):
        await after.recover(
            RUN,
            after.engine.plan(STEPS),
            worker_env.scope,
            manifest(),
            compensations={key: (broken, inverse)},
        )

    assert after.published["open_session"] == 1
    assert after.published["close_session"] == 1
    assert all(s.closed for s in after._sessions.by_id.values())
