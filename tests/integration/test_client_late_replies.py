"""Late and stale authentic replies reaching the host client.

The worker side is the scripted peer of ``scripted_worker.py`` on the real
broker: it seals the replies it is told to send, in the order a worker
answering duplicate deliveries concurrently may send them. The host ledger
is a real SQLite file.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from octo_common.errors import InvalidStateTransition
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.payload import canonical_operation_input_bytes
from octo_common.runtime.broker import publish_envelope
from octo_common.states import (
    Failed,
    Pending,
    Running,
    StateKind,
    Succeeded,
)
from octo_common.transport import (
    HEADER_SESSION,
    build_worker_reply,
)
from octo_host.compensation import WorkflowCompensationDispatch
from octo_host.plan import WorkflowStep

from .conftest import (
    WAIT,
    HostEnv,
    HostFactory,
    Inbox,
    WorkerEnv,
    compensation_target,
    header,
    manifest,
    reason_of,
)
from .scripted_worker import (
    ScriptedWorker,
    compensation_state,
    outcome,
    refusal,
    succeeded,
    until,
)
from .test_client import STEPS, TOOL, publish_payload, recorded, stored_ledger, undo_payload

pytestmark = pytest.mark.rabbitmq

STEPS_TWO = [*STEPS, WorkflowStep("announce", "announce it")]


# A pending_* refusal, then the outcome for the same request id -----------------------------


async def test_an_outcome_after_a_pending_refusal_of_the_same_request_is_applied(
    scripted: ScriptedWorker,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    dead_letters: Inbox,
) -> None:
    client = await hosts.start(max_attempts=1, backoff_initial=0.01)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    dispatching = asyncio.create_task(client.dispatch(session, run, key, publish_payload()))

    # A copy of the dispatch answered while the first copy is still being
    # handled: pending_operation, under the dispatch's request id.
    dispatch = await scripted.next("dispatch_operation")
    await scripted.reply(dispatch, refusal(dispatch, "pending_operation"))
    # The reconciliation that follows finds the key still pending too.
    reconcile = await scripted.next("reconcile_operation")
    await scripted.reply(reconcile, refusal(reconcile, "pending_operation"))
    assert isinstance(await asyncio.wait_for(dispatching, WAIT), Pending)
    assert run.state(key) == StateKind.PENDING

    # The first copy's outcome arrives late, for the same request id.
    await scripted.reply(dispatch, succeeded(dispatch))

    await until(lambda: run.state(key) == StateKind.SUCCEEDED, "the late outcome is applied")
    stored = await stored_ledger(host_env)
    assert stored.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert stored.revision == 2

    # One more copy of that outcome is dropped: not applied twice, not dead-lettered.
    await scripted.reply(dispatch, succeeded(dispatch))
    await asyncio.sleep(0.5)
    assert run.revision == 2
    assert (await stored_ledger(host_env)).revision == 2
    request_id = dispatch.request.request_id
    assert dead_letters.matching(lambda m: m.correlation_id == request_id) == []
    assert client.published["dispatch_operation"] == 1


# A stale running after the ledger's terminal state ------------------------------------------


async def test_a_stale_running_reply_after_succeeded_is_dropped_not_dead_lettered(
    scripted: ScriptedWorker,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    dead_letters: Inbox,
) -> None:
    client = await hosts.start(backoff_initial=0.01)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    # Two callers reconcile the key at once; the worker answers the second first.
    first = asyncio.create_task(client.reconcile(session, run, key, publish_payload()))
    second = asyncio.create_task(client.reconcile(session, run, key, publish_payload()))
    older = await scripted.next("reconcile_operation")
    newer = await scripted.next("reconcile_operation")
    await scripted.reply(newer, succeeded(newer))
    await until(lambda: run.state(key) == StateKind.SUCCEEDED, "succeeded is applied")

    # The answer to the other request, sealed earlier while the effect ran.
    scripted.answer_all(succeeded)  # whatever the host asks next
    await scripted.reply(older, outcome(older, Running()))

    states = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), WAIT)
    await asyncio.sleep(0.5)
    request_id = older.request.request_id
    assert dead_letters.matching(lambda m: m.correlation_id == request_id) == []
    # The caller told `running` asks again and gets the outcome; none sees an error.
    assert all(isinstance(state, Succeeded) for state in states), states
    stored = await stored_ledger(host_env)
    assert stored.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert stored.revision == 2 == run.revision


async def test_a_contradicting_terminal_reply_is_still_dead_lettered(
    scripted: ScriptedWorker,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    dead_letters: Inbox,
) -> None:
    # The guard beside the stale case: `failed` after `succeeded` is no older
    # answer but a contradiction, and the host still fails closed.
    client = await hosts.start(backoff_initial=0.01)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    first = asyncio.create_task(client.reconcile(session, run, key, publish_payload()))
    second = asyncio.create_task(client.reconcile(session, run, key, publish_payload()))
    older = await scripted.next("reconcile_operation")
    newer = await scripted.next("reconcile_operation")
    await scripted.reply(newer, succeeded(newer))
    await until(lambda: run.state(key) == StateKind.SUCCEEDED, "succeeded is applied")

    await scripted.reply(older, outcome(older, Failed("it did not happen")))

    request_id = older.request.request_id
    dead = await dead_letters.wait_for(lambda m: m.correlation_id == request_id)
    assert reason_of(dead) == "invalid_state_transition"
    outcomes = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), WAIT)
    assert sum(isinstance(o, InvalidStateTransition) for o in outcomes) == 1
    assert sum(isinstance(o, Succeeded) for o in outcomes) == 1
    stored = await stored_ledger(host_env)
    assert stored.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert stored.revision == 2


async def test_a_stale_running_compensation_reply_is_dropped_not_dead_lettered(
    scripted: ScriptedWorker,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    dead_letters: Inbox,
) -> None:
    client = await hosts.start(backoff_initial=0.01)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    scripted.answer_all(succeeded)
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)
    scripted.answer_all(None)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))
    await client.record_compensation(run, target, inverse, b"undo:1")
    revision = run.revision

    first = asyncio.create_task(
        client.compensate(session, run, target, WorkflowCompensationDispatch("c-one", inverse))
    )
    second = asyncio.create_task(
        client.compensate(session, run, target, WorkflowCompensationDispatch("c-two", inverse))
    )
    older = await scripted.next("compensate_operation")
    newer = await scripted.next("compensate_operation")
    await scripted.reply(newer, succeeded(newer))
    await until(lambda: compensation_state(run, key) == StateKind.SUCCEEDED, "succeeded")

    scripted.answer_all(succeeded)  # whatever the host asks next
    await scripted.reply(older, outcome(older, Running()))

    states = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), WAIT)
    await asyncio.sleep(0.5)
    request_id = older.request.request_id
    assert dead_letters.matching(lambda m: m.correlation_id == request_id) == []
    # The caller told `running` asks again and gets the outcome; none sees an error.
    assert all(isinstance(state, Succeeded) for state in states), states
    assert run.revision == revision + 1
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.SUCCEEDED


# A closed session let go of ---------------------------------------------------------------


async def test_a_closed_session_is_let_go_of_and_its_late_replies_are_still_recognised(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    # Grace before a closed session is let go of: one attempt of 0.3 s, no backoff.
    client = await hosts.start(reply_timeout=0.3, max_attempts=1, backoff_max=0.0)
    _, run, key = await recorded(client)
    first = await client.open_session(worker_env.scope, manifest())
    dispatching = asyncio.create_task(client.dispatch(first, run, key, publish_payload()))
    dispatch = await scripted.next("dispatch_operation")
    await scripted.reply(dispatch, succeeded(dispatch))
    assert isinstance(await asyncio.wait_for(dispatching, WAIT), Succeeded)
    await client.close_session(first)

    await asyncio.sleep(0.4)
    second = await client.open_session(worker_env.scope, manifest())
    # The closed session (its waiters, its sent ids) is dropped; the open one stays.
    assert first.session_id not in client._sessions.by_id
    assert second.session_id in client._sessions.by_id

    # A late authentic copy of its reply is dropped quietly, not dead-lettered...
    await scripted.reply(dispatch, succeeded(dispatch))
    # ... and a forged one under its session id still is.
    forged_key = SessionKey.derive(
        ScopeKey(bytes(32)), worker_env.scope, first.session_id, first.key_nonce
    )
    forged = SessionAuthenticator(first.session_id, forged_key, SessionRole.WORKER)
    forged.use_payload_codec()  # enveloped like the session's frames, under the wrong key
    envelope = build_worker_reply(
        worker_env.scope,
        first.session_id,
        first.key_nonce,
        forged.seal(succeeded(dispatch)),
        reply_to=client.reply_queue,
        correlation_id="forged",
    )
    await publish_envelope(scripted.channel, envelope, timeout=WAIT)
    dead = await dead_letters.wait_for(lambda m: m.correlation_id == "forged")
    assert reason_of(dead) == "frame_decryption_failed"  # the session's frames are enveloped
    await asyncio.sleep(0.3)
    late = [m for m in dead_letters.items if header(m, HEADER_SESSION) == first.session_id]
    assert late == [dead]
    assert run.state(key) == StateKind.SUCCEEDED and run.revision == 2


# Sessions replaced, verbs cancelled, runs evicted while a request is out ---------------------


async def test_a_dispatch_after_unknown_operation_follows_a_session_replaced_meanwhile(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(max_attempts=3, backoff_initial=0.01)
    plan = client.engine.plan(STEPS_TWO)
    run = await client.load_run("two-keys", plan)
    first, second = publish_payload("a.txt"), publish_payload("b.txt")
    k1 = await client.record_operation(run, "publish", TOOL, first, b"n1")
    k2 = await client.record_operation(run, "announce", TOOL, second, b"n2")
    run._unsent.discard(k1)  # as a run read from the store: k1 is reconciled first
    session = await client.open_session(worker_env.scope, manifest())
    a = asyncio.create_task(client.dispatch(session, run, k1, first))
    reconcile_a = await scripted.next("reconcile_operation")
    b = asyncio.create_task(client.dispatch(session, run, k2, second))
    dispatch_b = await scripted.next("dispatch_operation")
    # B's refusal makes the client replace the session (and close the old one).
    await scripted.reply(dispatch_b, refusal(dispatch_b, "session_poisoned"))
    reconcile_b = await scripted.next("reconcile_operation")
    assert reconcile_b.session_id != session.session_id and session.closed
    await scripted.reply(reconcile_b, succeeded(reconcile_b))
    assert isinstance(await asyncio.wait_for(b, WAIT), Succeeded)

    # A's key was never admitted: it is dispatched, on the session now current.
    await scripted.reply(reconcile_a, refusal(reconcile_a, "unknown_operation"))
    dispatch_a = await scripted.next("dispatch_operation")
    assert dispatch_a.session_id == reconcile_b.session_id
    await scripted.reply(dispatch_a, succeeded(dispatch_a))
    assert isinstance(await asyncio.wait_for(a, WAIT), Succeeded)
    assert client.published["dispatch_operation"] == 2


async def test_a_verb_cancelled_while_awaiting_its_reply_gives_its_waiter_up(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(max_cached_runs=1)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    dispatching = asyncio.create_task(client.dispatch(session, run, key, publish_payload()))
    dispatch = await scripted.next("dispatch_operation")
    dispatching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dispatching
    (waiter,) = session._waiters.values()
    assert waiter.abandoned  # a late reply is still applied, see below
    # It no longer pins its run in the cache ...
    plan = client.engine.plan(STEPS)
    await client.load_run("other-1", plan)
    await client.load_run("other-2", plan)
    assert run._detached
    # ... and the late reply still reaches the ledger, through the run loaded again.
    again = await client.load_run(run.name, plan)
    await scripted.reply(dispatch, succeeded(dispatch))
    await until(lambda: again.state(key) == StateKind.SUCCEEDED, "the late reply is applied")
    # ... and close() closes the session at the worker.
    await hosts.close(client)
    assert client.published["close_session"] == 1


async def test_a_verb_cancelled_before_its_publish_is_confirmed_keeps_its_waiter(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    """The frame may have reached the worker before its confirm: its reply is still applied."""
    client = await hosts.start()
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    broker = client._broker
    confirmed = asyncio.Event()  # never set: the caller is cancelled first
    real_publish = broker.publish

    async def publish_then_wait_for_the_confirm(*args: Any, **kwargs: Any) -> None:
        await real_publish(*args, **kwargs)
        if kwargs.get("kind") == "dispatch_operation":
            await confirmed.wait()

    broker.publish = publish_then_wait_for_the_confirm  # type: ignore[method-assign]
    dispatching = asyncio.create_task(client.dispatch(session, run, key, publish_payload()))
    dispatch = await scripted.next("dispatch_operation")
    dispatching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await dispatching
    broker.publish = real_publish  # type: ignore[method-assign]
    (waiter,) = session._waiters.values()
    assert waiter.abandoned
    await scripted.reply(dispatch, succeeded(dispatch))
    await until(lambda: run.state(key) == StateKind.SUCCEEDED, "the late reply is applied")


async def test_a_late_reply_for_an_evicted_run_goes_to_the_run_loaded_again(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(reply_timeout=0.3, max_attempts=1, max_cached_runs=1)
    plan = client.engine.plan(STEPS_TWO)
    run = await client.load_run("two-keys", plan)
    first = publish_payload("a.txt")
    k1 = await client.record_operation(run, "publish", TOOL, first, b"n1")
    session = await client.open_session(worker_env.scope, manifest())
    state = await client.dispatch(session, run, k1, first)  # nothing answers: timed out
    assert state.kind == StateKind.PENDING
    dispatch = await scripted.next("dispatch_operation")
    await scripted.next("reconcile_operation")
    await client.load_run("other", plan)  # evicts the run: its waiters were given up on
    assert run._detached
    again = await client.load_run("two-keys", plan)

    await scripted.reply(dispatch, succeeded(dispatch))
    await until(lambda: again.state(k1) == StateKind.SUCCEEDED, "the late reply is applied")
    # The object in use is the one that moved: its next write is no WriteConflict.
    k2 = await client.record_operation(again, "announce", TOOL, publish_payload("b.txt"), b"n2")
    stored = await stored_ledger(host_env, "two-keys")
    assert stored.operation(k1).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert stored.operation(k2) is not None


async def test_an_authentic_late_reply_of_a_retired_session_is_applied_to_the_ledger(
    scripted: ScriptedWorker,
    hosts: HostFactory,
    host_env: HostEnv,
    worker_env: WorkerEnv,
    dead_letters: Inbox,
) -> None:
    # Grace before a closed session is let go of: one attempt of 0.3 s, no backoff.
    client = await hosts.start(reply_timeout=0.3, max_attempts=1, backoff_max=0.0)
    _, run, key = await recorded(client)
    first = await client.open_session(worker_env.scope, manifest())
    # Nothing answers: the dispatch and the reconciliation after it time out.
    state = await client.dispatch(first, run, key, publish_payload())
    assert state.kind == StateKind.PENDING
    dispatch = await scripted.next("dispatch_operation")
    await scripted.next("reconcile_operation")
    await client.close_session(first)
    await asyncio.sleep(0.4)
    await client.open_session(worker_env.scope, manifest())  # lets the closed one go
    assert first.session_id not in client._sessions.by_id
    assert first.session_id in client._sessions.retired

    # The worker's outcome of the dispatch arrives now: applied, persisted, acked.
    await scripted.reply(dispatch, succeeded(dispatch))
    await until(lambda: run.state(key) == StateKind.SUCCEEDED, "the late outcome is applied")
    stored = await stored_ledger(host_env)
    assert stored.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert stored.revision == 2

    # A repeated copy of that answer is dropped: one transition, nothing dead-lettered.
    await scripted.reply(dispatch, succeeded(dispatch))
    await asyncio.sleep(0.3)
    assert (await stored_ledger(host_env)).revision == 2 == run.revision
    # A forged reply to that request under the retired session is still dead-lettered.
    forged_key = SessionKey.derive(
        ScopeKey(bytes(32)), worker_env.scope, first.session_id, first.key_nonce
    )
    forged = SessionAuthenticator(first.session_id, forged_key, SessionRole.WORKER)
    forged.use_payload_codec()  # enveloped like the session's frames, under the wrong key
    envelope = build_worker_reply(
        worker_env.scope,
        first.session_id,
        first.key_nonce,
        forged.seal(outcome(dispatch, Failed("forged"))),
        reply_to=client.reply_queue,
        correlation_id=dispatch.request.request_id,
    )
    await publish_envelope(scripted.channel, envelope, timeout=WAIT)
    dead = await dead_letters.wait_for(lambda m: header(m, HEADER_SESSION) == first.session_id)
    assert reason_of(dead) == "frame_decryption_failed"  # the session's frames are enveloped
    await asyncio.sleep(0.2)
    assert len(dead_letters.matching(lambda m: header(m, HEADER_SESSION) == first.session_id)) == 1
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
