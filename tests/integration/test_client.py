"""The host client against the in-process worker daemon on the real broker.

Real RabbitMQ, real SQLite files for the host ledger and the worker journal,
and the real ``files.publish`` adapter, whose effect log counts real effects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection

from octo_common.errors import (
    AdapterUnsupported,
    CompensationRequiresSucceededOperation,
    DuplicateOperationKey,
    InvalidScopeKey,
    OctoError,
    SessionClosed,
    StaleRevision,
    WriteConflict,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import OperationReconcileResult, OperationResult
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.runtime import amqp
from octo_common.runtime.broker import publish_confirmed
from octo_common.states import StateKind, Succeeded
from octo_common.transport import (
    EXCHANGE,
    HEADER_KEY_NONCE,
    HEADER_SCOPE,
    HEADER_SESSION,
    PublishReturned,
    PublishTimedOut,
    reply_queue,
    worker_queue,
)
from octo_host.amqp import (
    BrokerUnavailable,
    connect,
    declare_replies,
    open_confirm_channel,
)
from octo_host.client import (
    DispatchScopeMismatch,
    HostClient,
    HostRun,
    HostSession,
    routes_record_key,
)
from octo_host.client import broker as broker_module
from octo_host.compensation import WorkflowCompensationDispatch
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan, WorkflowStep
from octo_host.store import ledger_record_key
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import (
    TOOL,
    URL,
    WAIT,
    AllowUndo,
    HostEnv,
    HostFactory,
    Inbox,
    Names,
    RawLongString,
    WorkerEnv,
    WorkerRunner,
    compensation_target,
    header,
    manifest,
    marker_of,
    reason_of,
    unique,
    wait_session,
)

pytestmark = pytest.mark.rabbitmq

STEPS = [WorkflowStep("publish", "publish the release notes")]
RUN = "release-42"


def publish_payload(name: str = "notes.txt", content: str = "hello") -> ToolPayload:
    return ToolPayload.json({"name": name, "content": content})


def undo_payload(name: str = "notes.txt") -> ToolPayload:
    return ToolPayload.json({"undo": "publish", "name": name})


class SlowPublish(FilesPublishAdapter):
    """``files.publish`` whose dispatch takes ``delay`` seconds before publishing."""

    def __init__(self, env: WorkerEnv, delay: float) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.delay = delay
        self.dispatches = 0
        self.reconciliations = 0

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.dispatches += 1
        await asyncio.sleep(self.delay)
        return await super().dispatch_operation(request, grant, context)

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.reconciliations += 1
        return await super().reconcile_operation(request, grant, context)


class SlowUndo(FilesPublishAdapter):
    """``files.publish`` whose compensation takes ``delay`` seconds before removing."""

    def __init__(self, env: WorkerEnv, delay: float) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.delay = delay
        self.compensations = 0

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.compensations += 1
        await asyncio.sleep(self.delay)
        return await super().compensate_operation(request, grant, context)


class SlowUndoWithoutLookup(SlowUndo):
    """``SlowUndo`` with no compensation lookup: the host can only send it again."""

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AdapterUnsupported("reconcile_compensation")


def registry(adapter: FilesPublishAdapter) -> WorkerAdapterRegistry:
    found = WorkerAdapterRegistry()
    found.register(TOOL, adapter)
    return found


async def recorded(client: HostClient) -> tuple[WorkflowPlan, HostRun, str]:
    plan = client.engine.plan(STEPS)
    run = await client.load_run(RUN, plan)
    key = await client.record_operation(run, "publish", TOOL, publish_payload(), b"release-42:1")
    return plan, run, key


async def dispatch_in_flight(
    client: HostClient, worker_env: WorkerEnv
) -> tuple[HostRun, str, HostSession, asyncio.Task[Any]]:
    """A recorded key dispatched in the background, returned once its request is out."""
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    dispatching = asyncio.create_task(client.dispatch(session, run, key, publish_payload()))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not session._waiters and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return run, key, session, dispatching


async def stored_ledger(host_env: HostEnv, run: str = RUN) -> WorkflowOperationLedger:
    """The ledger as a second store object reads it from the file."""
    store = host_env.store()
    try:
        record = await store.load(ledger_record_key(run))
    finally:
        await store.close()
    assert record is not None
    return WorkflowOperationLedger.from_json(record.payload)


async def test_dispatch_succeeds_and_the_ledger_is_persisted(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    _, run, key = await recorded(client)
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.PENDING  # type: ignore[union-attr]

    session = await client.open_session(worker_env.scope, manifest())
    state = await client.dispatch(session, run, key, publish_payload())

    assert isinstance(state, Succeeded)
    assert state.payload.value["name"] == "notes.txt"
    ledger = await stored_ledger(host_env)
    assert ledger.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert ledger.revision == 2 == run.revision
    assert "hello" not in ledger.to_json()  # fingerprints only
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]
    assert (worker_env.shelf / "notes.txt").read_text() == "hello"
    assert client.published["dispatch_operation"] == 1
    assert client.published["reconcile_operation"] == 0


async def test_load_run_checks_the_minimum_revision_even_for_a_cached_run(
    hosts: HostFactory,
) -> None:
    client = await hosts.start()
    plan, run, _ = await recorded(client)
    assert await client.load_run(RUN, plan, minimum_revision=run.revision) is run
    # A caller that knows of a later revision (another host wrote it, or the
    # store was rolled back under this one) is refused, not handed the cache.
    with pytest.raises(StaleRevision):
        await client.load_run(RUN, plan, minimum_revision=run.revision + 1)


async def test_compensation_after_success_removes_the_file(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)

    inverse = undo_payload()
    action = AllowUndo(canonical_operation_input_bytes(inverse))
    target = compensation_target(worker_env.scope, key, action.allowed_input, action)
    compensation_key = await client.record_compensation(run, target, inverse, b"undo:1")
    assert compensation_key.startswith("cmp-")
    state = await client.compensate(
        session, run, target, WorkflowCompensationDispatch("c-1", inverse)
    )

    assert isinstance(state, Succeeded)
    assert not (worker_env.shelf / "notes.txt").exists()
    assert len(read_effect_log(worker_env.effect_log)) == 2
    ledger = await stored_ledger(host_env)
    operation = ledger.operation(key)
    assert operation is not None and operation.state == StateKind.SUCCEEDED
    assert operation.compensation is not None
    assert operation.compensation.compensation_key == compensation_key
    assert operation.compensation.state == StateKind.SUCCEEDED
    # Action verifier: at recording, at approval, right before sealing.
    assert action.calls == 3


async def test_compensation_of_a_pending_original_is_refused_before_sealing(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    await wait_session(daemon, worker_env.scope, session.session_id)
    sealed_before = session.authenticator.export_state().next_outgoing
    head_before = await daemon.store.head_revision(worker_env.scope)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))

    with pytest.raises(CompensationRequiresSucceededOperation):
        await client.compensate(session, run, target, WorkflowCompensationDispatch("c-1", inverse))

    assert session.authenticator.export_state().next_outgoing == sealed_before
    assert client.published["compensate_operation"] == 0
    assert run.state(key) == StateKind.PENDING and run.revision == 1
    await asyncio.sleep(0.2)
    assert await daemon.store.head_revision(worker_env.scope) == head_before
    assert read_effect_log(worker_env.effect_log) == []


async def test_the_same_frame_twice_has_one_effect_and_two_answers(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    plan, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    outbound = client.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-twice", session.authenticator
    )

    first = await client.send(session, outbound)
    second = await client.send(session, outbound)

    for answer in (first, second):
        assert isinstance(answer, OperationResult)
        assert answer.result.request_id == "d-twice"
        assert isinstance(answer.result.status, Succeeded)
    assert first.result.status == second.result.status  # type: ignore[union-attr]
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert client.published["dispatch_operation"] == 2


async def test_a_repeated_answer_to_an_answered_request_is_dropped_not_dead_lettered(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    client = await hosts.start()
    plan, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    outbound = client.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-again", session.authenticator
    )
    answer = await client.send(session, outbound)
    assert isinstance(answer, OperationResult)

    # A second copy of the frame (a publish retried after a lost confirm): the
    # worker answers it again with the same request id, and nobody waits for it.
    await client.publish(session, outbound.frame, "d-again")
    await asyncio.sleep(1.0)
    assert dead_letters.matching(lambda m: m.correlation_id == "d-again") == []
    assert len(read_effect_log(worker_env.effect_log)) == 1

    # A reply to a request id this session never sent is still refused.
    stranger = client.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-never", session.authenticator
    )
    await client.publish(session, stranger.frame, "d-never")
    dead = await dead_letters.wait_for(lambda m: m.correlation_id == "d-never")
    assert reason_of(dead) == "unexpected_message"


async def test_reply_timeout_reconciles_the_same_key_and_never_redispatches(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = SlowPublish(worker_env, delay=1.2)
    await workers.start(adapters=registry(adapter))
    client = await hosts.start(reply_timeout=0.5, backoff_initial=0.05)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())

    state = await client.dispatch(session, run, key, publish_payload())

    assert isinstance(state, Succeeded)
    assert client.published["dispatch_operation"] == 1
    assert client.published["reconcile_operation"] >= 1
    assert adapter.dispatches == 1
    assert adapter.reconciliations >= 1
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]

    # Asked again, the client reconciles a key it already dispatched.
    again = await client.dispatch(session, run, key, publish_payload())
    assert again == state
    assert client.published["dispatch_operation"] == 1
    assert adapter.dispatches == 1


async def test_recover_after_a_host_restart_resolves_a_pending_operation(
    workers: WorkerRunner,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    names: Names,
    dead_letters: Inbox,
) -> None:
    await workers.start(adapters=registry(SlowPublish(worker_env, delay=0.5)))
    host_id = names.host("-restart")
    before = await hosts.start(host_id=host_id)
    plan, run, key = await recorded(before)
    session = await before.open_session(worker_env.scope, manifest())
    outbound = before.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-1", session.authenticator
    )
    # The host goes away while it awaits the answer, with the operation pending
    # (a session with a request awaited is left open by close()).
    awaiting = asyncio.ensure_future(before.send(session, outbound))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while before.published["dispatch_operation"] == 0 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    await hosts.close(before)
    awaiting.cancel()
    with contextlib.suppress(asyncio.CancelledError, OctoError):
        await awaiting
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.PENDING  # type: ignore[union-attr]
    deadline = loop.time() + WAIT
    while not read_effect_log(worker_env.effect_log) and loop.time() < deadline:
        await asyncio.sleep(0.05)

    after = await hosts.start(host_id=host_id, engine=WorkflowEngine())
    rebuilt = after.engine.plan(STEPS)
    summary = await after.recover(
        RUN, rebuilt, worker_env.scope, manifest(), inputs={key: publish_payload()}
    )

    assert summary.operations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [key]
    assert summary.unresolved == []
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert after.published["dispatch_operation"] == 0
    assert len(read_effect_log(worker_env.effect_log)) == 1
    # The old session's reply reached the new process, which does not know it.
    stale = await dead_letters.wait_for(lambda m: header(m, HEADER_SESSION) == session.session_id)
    assert reason_of(stale) == "unknown_session"


async def test_recover_dispatches_a_key_the_worker_never_admitted(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start()
    _, _, key = await recorded(before)  # recorded and persisted, never published
    await hosts.close(before)

    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(
        RUN,
        after.engine.plan(STEPS),
        worker_env.scope,
        manifest(),
        inputs={key: publish_payload()},
    )

    assert summary.operations == {key: StateKind.SUCCEEDED}
    assert after.published["reconcile_operation"] == 1  # answered unknown_operation
    assert after.published["dispatch_operation"] == 1
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_a_key_dispatched_to_one_scope_is_never_dispatched_to_another(
    daemon: WorkerDaemon,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    names: Names,
    channel: AbstractChannel,
) -> None:
    # A second tenant scope whose worker is down: its dispatch stays queued.
    other = unique("t-other")
    names.queues.append(worker_queue(other))
    queue = await channel.declare_queue(
        worker_queue(other), durable=True, arguments={"x-queue-type": "quorum"}
    )
    await queue.bind(EXCHANGE, routing_key=worker_queue(other))
    client = await hosts.start(extra_scope_keys={other: ScopeKey(secrets.token_bytes(32))})
    _, run, key = await recorded(client)
    away = await client.open_session(other, manifest())
    dispatching = asyncio.create_task(client.dispatch(away, run, key, publish_payload()))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    # The waiter is registered before the publish is confirmed: wait for the count.
    while client.published["dispatch_operation"] < 1 and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert client.published["dispatch_operation"] == 1  # out, to the other scope
    dispatching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dispatching

    # The same key on this scope: its worker never admitted it (unknown_operation),
    # yet the key was sent elsewhere, so a dispatch here could run it twice.
    session = await client.open_session(worker_env.scope, manifest())
    with pytest.raises(DispatchScopeMismatch) as refused:
        await client.dispatch(session, run, key, publish_payload())
    assert refused.value.code == "dispatch_scope_mismatch"
    assert refused.value.bound_scope == other and refused.value.scope == worker_env.scope
    assert client.published["reconcile_operation"] == 1
    assert client.published["dispatch_operation"] == 1  # nothing more was sent
    assert read_effect_log(worker_env.effect_log) == []
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.PENDING  # type: ignore[union-attr]

    # The binding is durable: a restarted host refuses the same way.
    await hosts.close(client)
    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(
        RUN, after.engine.plan(STEPS), worker_env.scope, manifest(), inputs={key: publish_payload()}
    )
    assert summary.unresolved == [key] and summary.errors == {key: "dispatch_scope_mismatch"}
    assert after.published["dispatch_operation"] == 0
    assert read_effect_log(worker_env.effect_log) == []


async def stored_routes(host_env: HostEnv) -> tuple[int, dict[str, str]] | None:
    """The run's routes record (revision, routes) as a second store object reads it."""
    store = host_env.store()
    try:
        record = await store.load(routes_record_key(RUN))
    finally:
        await store.close()
    if record is None:
        return None
    return record.revision, json.loads(record.payload)["routes"]


async def test_a_key_recorded_with_its_scope_is_bound_in_the_same_commit(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    plan = client.engine.plan(STEPS)
    run = await client.load_run(RUN, plan)
    backend = client.store._sqlite
    transactions, _ = backend.group_commit_stats
    key = await client.record_operation(
        run, "publish", TOOL, publish_payload(), b"release-42:1", scope=worker_env.scope
    )
    # One transaction holds both the intent and the binding.
    assert backend.group_commit_stats[0] == transactions + 1
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.PENDING  # type: ignore[union-attr]
    assert await stored_routes(host_env) == (1, {key: worker_env.scope})

    session = await client.open_session(worker_env.scope, manifest())
    transactions, _ = backend.group_commit_stats
    state = await client.dispatch(session, run, key, publish_payload())
    assert isinstance(state, Succeeded)
    # The dispatch wrote only the outcome: the binding was already there.
    assert backend.group_commit_stats[0] == transactions + 1
    assert await stored_routes(host_env) == (1, {key: worker_env.scope})
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_recording_with_a_scope_refuses_a_key_bound_elsewhere_and_writes_nothing(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    other = unique("t-other")
    client = await hosts.start(extra_scope_keys={other: ScopeKey(secrets.token_bytes(32))})
    plan = client.engine.plan(STEPS)
    run = await client.load_run(RUN, plan)
    with pytest.raises(InvalidScopeKey):  # no key for it: nothing could ever be sent there
        await client.record_operation(
            run, "publish", TOOL, publish_payload(), b"release-42:1", scope="t-nokey"
        )
    assert await stored_routes(host_env) is None
    key = await client.record_operation(
        run, "publish", TOOL, publish_payload(), b"release-42:1", scope=other
    )
    assert await stored_routes(host_env) == (1, {key: other})

    # Bound at record time: a dispatch to another scope is refused, unsent.
    session = await client.open_session(worker_env.scope, manifest())
    with pytest.raises(DispatchScopeMismatch) as refused:
        await client.dispatch(session, run, key, publish_payload())
    assert refused.value.bound_scope == other and refused.value.scope == worker_env.scope
    assert client.published["dispatch_operation"] == 0

    # A key the routes already bind elsewhere: refused before anything is written.
    bound = "op-bound-elsewhere"
    store = host_env.store()
    try:
        await store.compare_and_swap(
            routes_record_key(RUN),
            1,
            json.dumps(
                {"format_version": 1, "run": RUN, "routes": {key: other, bound: other}}
            ).encode(),
        )
    finally:
        await store.close()
    fresh = await hosts.start(
        engine=WorkflowEngine(), extra_scope_keys={other: ScopeKey(secrets.token_bytes(32))}
    )
    run = await fresh.load_run(RUN, fresh.engine.plan(STEPS))
    ledger = await stored_ledger(host_env)
    with pytest.raises(DispatchScopeMismatch):
        await fresh.record_operation(
            run,
            "publish",
            TOOL,
            publish_payload("b.txt"),
            b"-",
            operation_key=bound,
            scope=worker_env.scope,
        )
    assert await stored_ledger(host_env) == ledger
    assert run.operation(bound) is None
    assert await stored_routes(host_env) == (2, {key: other, bound: other})
    # The same key recorded with the scope it is bound to is accepted, no new binding.
    await fresh.record_operation(
        run, "publish", TOOL, publish_payload("b.txt"), b"-", operation_key=bound, scope=other
    )
    assert (await stored_ledger(host_env)).operation(bound) is not None
    assert await stored_routes(host_env) == (2, {key: other, bound: other})


async def test_the_run_cache_is_bounded_and_keeps_runs_with_unsent_keys(
    hosts: HostFactory,
) -> None:
    client = await hosts.start(max_cached_runs=2)
    plan = client.engine.plan(STEPS)
    busy = await client.load_run("run-busy", plan)
    key = await client.record_operation(busy, "publish", TOOL, publish_payload(), b"busy:1")
    idle = await client.load_run("run-idle", plan)
    await client.load_run("run-third", plan)
    # Over the bound: the least recently used run is dropped, except one whose
    # recorded key was never sent (a second object could not know it unsent).
    assert await client.load_run("run-busy", plan) is busy
    assert key in busy._unsent
    again = await client.load_run("run-idle", plan)
    assert again is not idle and again.revision == idle.revision
    assert len(client._runs.loaded) == 2
    for name in ("run-a", "run-b", "run-c", "run-d"):
        await client.load_run(name, plan)
    assert list(client._runs.loaded) == ["run-busy", "run-d"]


async def test_loading_a_run_again_with_an_equal_plan_keeps_the_same_object(
    hosts: HostFactory,
) -> None:
    client = await hosts.start()
    run = await client.load_run(RUN, client.engine.plan(STEPS))
    # recover() and the CLI build the plan again: an equal plan (same
    # fingerprint) must not replace the object a running verb still uses.
    rebuilt = client.engine.plan(STEPS)
    assert rebuilt is not run.plan and rebuilt.fingerprint == run.plan.fingerprint
    assert await client.load_run(RUN, rebuilt) is run
    assert not run._detached


async def test_a_run_dropped_from_the_cache_reconciles_before_it_dispatches(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(max_cached_runs=1)
    plan = client.engine.plan(STEPS)
    busy = await client.load_run("run-busy", plan)
    await client.record_operation(busy, "publish", TOOL, publish_payload(), b"busy:1")
    # The run just loaded is kept even over the bound.
    held = await client.load_run("run-held", plan)
    assert await client.load_run("run-held", plan) is held
    await client.load_run("run-next", plan)
    assert "run-held" not in client._runs.loaded
    # A caller still holding the dropped object records and dispatches on it:
    # another object may be loaded for the run at any time, so the key is
    # reconciled first and sent only on the worker's unknown_operation.
    key = await client.record_operation(held, "publish", TOOL, publish_payload(), b"held:1")
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, held, key, publish_payload()), Succeeded)
    assert client.published["reconcile_operation"] == 1
    assert client.published["dispatch_operation"] == 1
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_closing_the_client_closes_its_idle_sessions_at_the_worker(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)

    # Sessions are process-local: left open, the worker would keep this one
    # (and restore it at every start) for ever.
    await hosts.close(client)
    await wait_session(daemon, worker_env.scope, session.session_id, "closed")
    assert session.closed


async def test_a_frame_of_a_closed_session_is_dead_lettered(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    client = await hosts.start()
    plan, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)

    await client.close_session(session)
    await wait_session(daemon, worker_env.scope, session.session_id, "closed")
    head = await daemon.store.head_revision(worker_env.scope)
    outbound = client.engine.prepare_authenticated_operation_reconciliation(
        plan,
        run.ledger,
        key,
        canonical_operation_input_bytes(publish_payload()),
        "r-after-close",
        session.authenticator,
    )
    with pytest.raises(SessionClosed):
        await client.send(session, outbound)
    await client.publish(session, outbound.frame, "r-after-close", kind="reconcile_operation")

    dead = await dead_letters.wait_for(lambda m: m.correlation_id == "r-after-close")
    assert reason_of(dead) == "session_closed"
    assert header(dead, HEADER_SESSION) == session.session_id
    assert await daemon.store.head_revision(worker_env.scope) == head
    assert run.state(key) == StateKind.SUCCEEDED


async def test_compensation_timeout_repeats_the_same_key_under_a_fresh_approval(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = SlowUndo(worker_env, delay=1.0)
    await workers.start(adapters=registry(adapter))
    client = await hosts.start(reply_timeout=0.4, backoff_initial=0.05)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)
    inverse = undo_payload()
    action = AllowUndo(canonical_operation_input_bytes(inverse))
    target = compensation_target(worker_env.scope, key, action.allowed_input, action)
    compensation_key = await client.record_compensation(run, target, inverse, b"undo:1")

    state = await client.compensate(
        session, run, target, WorkflowCompensationDispatch("c-1", inverse)
    )

    assert isinstance(state, Succeeded)
    sent = client.published["compensate_operation"]
    assert sent >= 2  # repeated after the timeout ...
    assert action.calls == 1 + 2 * sent  # ... each time under a fresh approval
    assert adapter.compensations == 1  # ... and the inverse ran once
    assert len(read_effect_log(worker_env.effect_log)) == 2
    operation = (await stored_ledger(host_env)).operation(key)
    assert operation is not None and operation.compensation is not None
    assert operation.compensation.compensation_key == compensation_key
    assert operation.compensation.state == StateKind.SUCCEEDED


async def test_spent_call_budget_opens_a_new_session_and_reconciles_first(
    daemon: WorkerDaemon, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    plan = client.engine.plan(
        [WorkflowStep("publish", "publish the notes"), WorkflowStep("announce", "and again")]
    )
    run = await client.load_run(RUN, plan)
    one_call = CapabilityManifest("manifest", [CapabilityGrant(TOOL, "json", max_calls=1)])
    first_payload = publish_payload("one.txt", "1")
    second_payload = publish_payload("two.txt", "2")
    first = await client.record_operation(run, "publish", TOOL, first_payload, b"n:1")
    second = await client.record_operation(run, "announce", TOOL, second_payload, b"n:2")
    session = await client.open_session(worker_env.scope, one_call)
    assert isinstance(await client.dispatch(session, run, first, first_payload), Succeeded)

    # The session's one call is spent: the worker refuses before admitting.
    state = await client.dispatch(session, run, second, second_payload)

    assert isinstance(state, Succeeded)
    fresh = session.current()
    assert fresh is not session and session.closed
    assert fresh.manifest.grants == one_call.grants
    assert client.published["open_session"] == 2
    assert client.published["reconcile_operation"] == 1  # answered unknown_operation
    assert client.published["dispatch_operation"] == 3
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [first, second]
    ledger = await stored_ledger(host_env)
    assert [op.state for op in ledger.operations] == [StateKind.SUCCEEDED] * 2


_CRASHING_HOST = """
import asyncio, json, sys
from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_host.client import HostClient
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore

async def main(a):
    keyring = StorageKeyring("host-k1", bytes.fromhex(a["storage_key"]))
    store = SqliteLedgerStore(a["ledger"], keyring)
    client = HostClient(a["url"], host_id=a["host_id"], store=store,
                        scope_keys={a["scope"]: ScopeKey.from_file(a["scope_key_file"])})
    await client.start()
    plan = client.engine.plan([WorkflowStep(s, src) for s, src in a["steps"]])
    run = await client.load_run(a["run"], plan)
    payload = ToolPayload.json(a["payload"])
    key = await client.record_operation(run, "publish", a["tool"], payload, b"release-42:1")
    print("RECORDED", key, flush=True)
    grant = CapabilityGrant(a["tool"], "json", max_calls=8, max_compensations=1)
    session = await client.open_session(a["scope"], CapabilityManifest("manifest", [grant]))
    await client.dispatch(session, run, key, payload)  # OCTO_FAULT kills us before the publish
    print("survived", flush=True)

asyncio.run(main(json.loads(sys.argv[1])))
"""


async def test_host_killed_after_its_ledger_commit_recovers_by_dispatching_the_same_key(
    daemon: WorkerDaemon,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    names: Names,
) -> None:
    arguments = {
        "url": URL,
        "host_id": names.host("-crash"),
        "scope": worker_env.scope,
        "scope_key_file": str(worker_env.root / "worker" / "keys" / "scope.key"),
        "ledger": str(host_env.ledger_path),
        "storage_key": host_env.keyring_bytes.hex(),
        "steps": [[step.id, step.source] for step in STEPS],
        "run": RUN,
        "tool": TOOL,
        "payload": publish_payload().value,
    }
    env = dict(os.environ, OCTO_FAULT="host.after_ledger_commit")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CRASHING_HOST,
        json.dumps(arguments),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=20.0)
    assert process.returncode == -signal.SIGKILL, err.decode()[-2000:]
    assert b"SIGKILL at host.after_ledger_commit" in err
    key = out.decode().split("RECORDED ", 1)[1].split()[0]
    assert b"survived" not in out
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.PENDING  # type: ignore[union-attr]
    assert read_effect_log(worker_env.effect_log) == []

    client = await hosts.start(engine=WorkflowEngine())
    summary = await client.recover(
        RUN,
        client.engine.plan(STEPS),
        worker_env.scope,
        manifest(),
        inputs={key: publish_payload()},
    )

    assert summary.operations == {key: StateKind.SUCCEEDED}
    assert client.published["reconcile_operation"] == 1  # unknown_operation: never admitted
    assert client.published["dispatch_operation"] == 1
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]


async def test_recover_resends_a_pending_compensation_under_a_fresh_approval(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    # Without the lookup the adapter cannot settle it: recover sends it again.
    adapter = SlowUndoWithoutLookup(worker_env, delay=0.5)
    await workers.start(adapters=registry(adapter))
    before = await hosts.start()
    plan, run, key = await recorded(before)
    session = await before.open_session(worker_env.scope, manifest())
    assert isinstance(await before.dispatch(session, run, key, publish_payload()), Succeeded)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))
    compensation_key = await before.record_compensation(run, target, inverse, b"undo:1")
    ledger = run.ledger
    approval = before.engine.approve_compensation(
        plan, ledger, target, canonical_operation_input_bytes(inverse), session.authenticator
    )
    outbound = before.engine.prepare_authenticated_operation_compensation(
        plan,
        ledger,
        target,
        WorkflowCompensationDispatch("c-1", inverse),
        approval,
        session.authenticator,
    )
    await before.publish(session, outbound.frame, "c-1", kind="compensate_operation")
    await hosts.crash(before)  # while the inverse runs

    after = await hosts.start(engine=WorkflowEngine())
    rebuilt = after.engine.plan(STEPS)
    action = AllowUndo(canonical_operation_input_bytes(inverse))
    fresh_target = compensation_target(worker_env.scope, key, action.allowed_input, action)
    summary = await after.recover(
        RUN, rebuilt, worker_env.scope, manifest(), compensations={key: (fresh_target, inverse)}
    )

    assert summary.operations == {key: StateKind.SUCCEEDED}
    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [compensation_key]
    assert summary.unresolved == []
    assert action.calls >= 2  # a fresh approval and the check before sealing
    assert adapter.compensations == 1
    assert len(read_effect_log(worker_env.effect_log)) == 2
    assert not (worker_env.shelf / "notes.txt").exists()
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.SUCCEEDED


async def test_a_session_whose_open_was_never_confirmed_is_not_closed_at_the_worker(
    hosts: HostFactory, host_env: HostEnv
) -> None:
    nowhere = unique("t-nowhere")  # a key, but no worker queue: the open is returned
    client = await hosts.start(extra_scope_keys={nowhere: ScopeKey(secrets.token_bytes(32))})
    with pytest.raises(PublishReturned):
        await client.open_session(nowhere, manifest())
    # Closed at once and, with nothing sent on it, let go of at once.
    assert client._sessions.by_id == {}
    assert len(client._sessions.retired) == 1
    await hosts.close(client)
    assert client.published["close_session"] == 0


async def test_a_session_whose_open_may_have_reached_the_worker_stays_to_be_closed(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await hosts.start()
    publish = client._broker.publish

    async def confirm_lost(session: HostSession, frame: bytes, *args: Any, **kwargs: Any) -> None:
        await publish(session, frame, *args, **kwargs)  # the broker has the open ...
        raise PublishTimedOut(worker_queue(worker_env.scope), 0.0)  # ... its confirm is lost

    monkeypatch.setattr(client._broker, "publish", confirm_lost)
    with pytest.raises(PublishTimedOut):
        await client.open_session(worker_env.scope, manifest())
    monkeypatch.undo()
    (session,) = client._sessions.by_id.values()
    assert not session.closed  # close() closes it at the worker
    await hosts.close(client)
    assert client.published["close_session"] == 1


async def test_a_reply_with_a_header_pamqp_cannot_encode_again_is_still_dead_lettered(
    hosts: HostFactory,
    channel: AbstractChannel,
    dead_letters: Inbox,
    raw_long_strings: type[RawLongString],
) -> None:
    """A non-UTF-8 long string decodes as bytes, which pamqp cannot encode: the
    copy to octo.v5.dead must not raise (the delivery would stay unacked, and
    enough of them would fill the prefetch and stop every reply)."""
    client = await hosts.start()
    exchange = await channel.get_exchange(EXCHANGE, ensure=False)
    for marker in ("raw-1", "raw-2"):
        await exchange.publish(
            aio_pika.Message(
                b"junk",
                message_id=marker,
                headers={"x-test-marker": marker, "x-raw": raw_long_strings(b"\xff\xfe")},
            ),
            routing_key=client.reply_queue,
        )
    for marker in ("raw-1", "raw-2"):
        dead = await dead_letters.wait_for(marker_of(marker))
        assert reason_of(dead) == "invalid_frame_headers"
        assert bytes(dead.headers["x-raw"]) == b"\xff\xfe"  # type: ignore[arg-type]


async def test_forged_and_malformed_replies_are_dead_lettered_by_the_host(
    workers: WorkerRunner,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    channel: AbstractChannel,
    dead_letters: Inbox,
) -> None:
    await workers.start(adapters=registry(SlowPublish(worker_env, delay=0.5)))
    client = await hosts.start()
    run, key, session, dispatching = await dispatch_in_flight(client, worker_env)
    (request_id,) = session._waiters

    # A "worker" that does not hold the scope key claims success.
    forger = SessionAuthenticator(
        session.session_id,
        SessionKey.derive(
            ScopeKey.from_bytes(os.urandom(32)),
            worker_env.scope,
            session.session_id,
            session.key_nonce,
        ),
        SessionRole.WORKER,
    )
    forger.use_payload_codec()  # enveloped as the session's frames are, under the wrong key
    forged = forger.seal(
        OperationResult(
            OperationReconcileResult(
                session.session_id, request_id, TOOL, key, Succeeded(ToolPayload.json({}))
            )
        )
    )
    good_headers = {
        HEADER_SCOPE: worker_env.scope,
        HEADER_SESSION: session.session_id,
        HEADER_KEY_NONCE: session.key_nonce.hex(),
    }
    cases = {
        "forged": (good_headers, "frame_decryption_failed"),
        "no-session": (
            {k: v for k, v in good_headers.items() if k != HEADER_SESSION},
            "invalid_frame_headers",
        ),
        "other-scope": ({**good_headers, HEADER_SCOPE: "t-elsewhere"}, "scope_mismatch"),
        "other-nonce": (
            {**good_headers, HEADER_KEY_NONCE: "00" * 32},
            "invalid_authentication_tag",
        ),
    }
    for marker, (headers, _) in cases.items():
        await publish_confirmed(
            channel,
            EXCHANGE,
            client.reply_queue,
            forged,
            message_id=marker,
            correlation_id=request_id,
            reply_to=None,
            headers={**headers, "x-test-marker": marker},
            timeout=WAIT,
        )
    for marker, (_, reason) in cases.items():
        dead = await dead_letters.wait_for(marker_of(marker))
        assert reason_of(dead) == reason, marker
    assert not dispatching.done()
    assert run.state(key) == StateKind.PENDING

    state = await asyncio.wait_for(dispatching, WAIT)
    assert isinstance(state, Succeeded)
    assert state.payload.value["name"] == "notes.txt"  # the genuine answer, not the forged {}
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]


async def test_a_full_session_first_lets_go_of_a_waiter_nobody_awaits(host_env: HostEnv) -> None:
    store = host_env.store()
    client = HostClient(URL, host_id="full-host", scope_keys={}, store=store)
    try:
        session_id, nonce = "s-" + "ab" * 12, secrets.token_bytes(32)
        key = SessionKey.derive(ScopeKey(secrets.token_bytes(32)), "t-x", session_id, nonce)
        auth = SessionAuthenticator(session_id, key, SessionRole.HOST)
        session = HostSession("t-x", manifest(), nonce, auth)
        waiters = [
            client._sessions.register(session, f"r-{i}", "dispatch", None, None)
            for i in range(1024)
        ]
        waiters[5].abandoned = True  # its verb timed out
        client._sessions.register(session, "r-new", "dispatch", None, None)
        assert "r-5" not in session._waiters and "r-0" in session._waiters
        assert not waiters[0].abandoned
        # Every one awaited: the oldest goes (its caller will time out).
        client._sessions.register(session, "r-newer", "dispatch", None, None)
        assert "r-0" not in session._waiters and waiters[0].abandoned
        assert len(session._waiters) == 1024
    finally:
        await store.close()


async def test_a_verb_cancelled_during_its_ledger_write_leaves_the_run_consistent(
    host_env: HostEnv,
) -> None:
    """The ledger CAS and its adoption finish even when the verb is cancelled."""
    store = host_env.store()
    client = HostClient(URL, host_id="cancel-host", scope_keys={}, store=store)
    try:
        plan = client.engine.plan([*STEPS, WorkflowStep("announce", "announce it")])
        run = await client.load_run(RUN, plan)
        stored_before = run._stored_revision
        verb = asyncio.ensure_future(
            client.record_operation(run, "publish", TOOL, publish_payload(), b"n:1")
        )
        await asyncio.sleep(0)  # the write is submitted to the database thread
        verb.cancel()
        with pytest.raises(asyncio.CancelledError):
            await verb
        # The cancelled write landed and the run adopted it: the next write of
        # the same run is not a WriteConflict.
        assert run._stored_revision == stored_before + 1
        await client.record_operation(run, "announce", TOOL, publish_payload("b.txt"), b"n:2")
        ledger = await stored_ledger(host_env)
        assert ledger == run.ledger
        assert len(ledger.operations) == 2
    finally:
        await store.close()


# Errors reaching callers are Octo errors (#8) ------------------------------------------------


async def test_a_session_for_a_scope_without_a_key_is_refused_with_an_octo_error(
    hosts: HostFactory,
) -> None:
    client = await hosts.start()

    with pytest.raises(InvalidScopeKey) as refused:
        await client.open_session("t-not-configured", manifest())

    assert refused.value.code == "invalid_scope_key"
    assert client.published["open_session"] == 0


async def test_a_malformed_broker_url_is_broker_unavailable_and_not_shown(
    host_env: HostEnv,
) -> None:
    url = "amqp://guest:s3cret-pw@127.0.0.1:not-a-port/"
    with pytest.raises(BrokerUnavailable) as refused:
        await connect(url, timeout=2.0)
    assert "s3cret" not in str(refused.value) and "s3cret" not in repr(refused.value)

    store = host_env.store()
    client = HostClient(url, host_id="malformed-url-host", scope_keys={}, store=store)
    try:
        with pytest.raises(BrokerUnavailable) as refused:
            await client.start()
        assert "s3cret" not in str(refused.value)
    finally:
        await store.close()


async def test_a_channel_on_a_closed_connection_is_broker_unavailable(
    broker: AbstractConnection,
) -> None:
    connection = await connect(URL, timeout=WAIT, name="octo-test-closed")
    await connection.close()

    with pytest.raises(BrokerUnavailable):
        await open_confirm_channel(connection)


async def test_a_reply_consumer_that_cannot_start_is_broker_unavailable(
    hosts: HostFactory,
    broker: AbstractConnection,
    names: Names,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reply queue vanishes between its declaration and the consume (real broker)."""

    async def declare_then_lose(connection: amqp.Connection, host_id: str) -> amqp.Channel:
        channel = await declare_replies(connection, host_id)
        other = await broker.channel()
        await other.queue_delete(reply_queue(host_id))
        await other.close()
        return channel

    monkeypatch.setattr(broker_module, "declare_replies", declare_then_lose)
    host_id = names.host("-lost")

    with pytest.raises(BrokerUnavailable) as refused:
        await hosts.start(host_id=host_id)

    # The broker closed the consume channel: 404, no such queue.
    assert "ChannelClosed" in refused.value.reason


async def test_a_lost_reply_consumer_releases_waiting_calls_at_once_and_is_restored(
    workers: WorkerRunner, hosts: HostFactory, worker_env: WorkerEnv, channel: AbstractChannel
) -> None:
    await workers.start(adapters=registry(SlowPublish(worker_env, delay=1.5)))
    # A reply timeout far beyond the wait below: an outcome within it is not a timeout.
    client = await hosts.start(reply_timeout=20 * WAIT, backoff_initial=0.05)
    run, key, session, dispatching = await dispatch_in_flight(client, worker_env)
    assert session._waiters

    # The reply queue is deleted: the broker cancels the client's consumer. The
    # waiting dispatch is released at once; the client connects again (declaring
    # and consuming its reply queue anew) and reconciles the same key there.
    await channel.queue_delete(client.reply_queue)
    state = await asyncio.wait_for(dispatching, 3 * WAIT)

    assert isinstance(state, Succeeded)
    assert client.reconnects == 1
    assert client.published["dispatch_operation"] == 1
    assert client.published["reconcile_operation"] >= 1
    assert run.state(key) == StateKind.SUCCEEDED
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]
    # Later verbs work on the restored consumer.
    assert isinstance(await client.reconcile(session, run, key, publish_payload()), Succeeded)


async def test_a_failed_session_is_replaced_once_and_never_replaces_its_successor(
    daemon: WorkerDaemon, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start()
    first = await client.open_session(worker_env.scope, manifest())
    # Two verbs saw the same session fail at once: one fresh session for both.
    a, b = await asyncio.gather(
        client._sessions.replace(first, "rejection"), client._sessions.replace(first, "timeouts")
    )
    assert a is b and first.replaced_by is a and first.closed
    # A late failure reported on the old session does not replace (close) the new one.
    again = await client._sessions.replace(first, "rejection")
    assert again is a and not a.closed and a.replaced_by is None
    assert client.published["open_session"] == 2


async def test_a_write_conflict_resyncs_the_run_and_the_decision_is_taken_again(
    hosts: HostFactory, host_env: HostEnv
) -> None:
    first = await hosts.start()
    _, run, key = await recorded(first)
    # Another writer (a second client on the same ledger file) moves the run on.
    second = await hosts.start()
    other_run = await second.load_run(RUN, second.engine.plan(STEPS))
    theirs = await second.record_operation(
        other_run, "publish", TOOL, publish_payload("b.txt"), b"release-42:2"
    )
    # The first write meets the other's revision: the run adopts the stored
    # ledger and the intent is recorded on top of it, in the same call.
    mine = await first.record_operation(
        run, "publish", TOOL, publish_payload("c.txt"), b"release-42:3"
    )
    stored = await stored_ledger(host_env)
    assert [o.operation_key for o in stored.operations] == [key, theirs, mine]
    assert run.ledger == stored
    # The other writer's own intent, decided again on the stored ledger, is
    # found there: refused as a duplicate, never recorded twice.
    with pytest.raises(DuplicateOperationKey):
        await first.record_operation(
            run, "publish", TOOL, publish_payload("b.txt"), b"release-42:2"
        )
    assert (await stored_ledger(host_env)).revision == stored.revision


async def test_a_write_that_keeps_conflicting_fails_closed(
    hosts: HostFactory, host_env: HostEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await hosts.start()
    _, run, key = await recorded(first)
    second = await hosts.start()
    other_run = await second.load_run(RUN, second.engine.plan(STEPS))
    resync = first._runs._resync
    moved: list[str] = []

    async def another_writer_first(target: HostRun) -> None:
        # Before each retry the other host writes again: every attempt loses.
        await resync(target)
        moved.append(
            await second.record_operation(
                other_run,
                "publish",
                TOOL,
                publish_payload(f"o{len(moved)}.txt"),
                f"other:{len(moved)}".encode(),
            )
        )

    await second.record_operation(other_run, "publish", TOOL, publish_payload("x.txt"), b"x")
    monkeypatch.setattr(first._runs, "_resync", another_writer_first)
    with pytest.raises(WriteConflict):
        await first.record_operation(run, "publish", TOOL, publish_payload("c.txt"), b"c")

    stored = await stored_ledger(host_env)
    assert len(moved) == 4  # one resync per attempt (MAX_WRITE_ATTEMPTS), then fail closed
    mine = first.engine.derive_operation_key(
        run.plan, "publish", TOOL, canonical_operation_input_bytes(publish_payload("c.txt")), b"c"
    )
    keys = [o.operation_key for o in stored.operations]
    assert mine not in keys and keys[0] == key and keys[2:] == moved
