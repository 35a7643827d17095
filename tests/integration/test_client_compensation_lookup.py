"""The host side of a compensation lookup: ``reconcile_compensation`` and ``recover``.

The worker is the scripted peer of ``scripted_worker.py`` on the real
broker (it answers exactly what each test says, as a worker whose adapter
implements the lookup, lacks it, or never admitted the key would); the host
ledger is a real SQLite file. What a real worker answers is checked end to
end in ``test_compensation_recovery.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from octo_common.errors import WorkerRequestRejected
from octo_common.messages import (
    ReconcileCompensation,
    WorkerMessage,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import OperationStatus, Running, StateKind, Succeeded
from octo_host.client import HostClient, HostRun
from octo_host.compensation import WorkflowCompensationTarget
from octo_host.engine import WorkflowEngine

from .conftest import HostEnv, HostFactory, Names, WorkerEnv, compensation_target, manifest
from .scripted_worker import (
    Received,
    ScriptedWorker,
    compensation_state,
    outcome,
    refusal,
    succeeded,
)
from .test_client import RUN, STEPS, publish_payload, recorded, stored_ledger, undo_payload
from .test_host_cli import PUBLISH, UNDO, HostCli, assert_one_line_error
from .test_host_cli import RUN as CLI_RUN

pytestmark = pytest.mark.rabbitmq

UNDONE = ToolPayload.json({"removed": "notes.txt"})


def looked_up(status: OperationStatus) -> Callable[[Received], WorkerMessage]:
    """The worker's answer to every ``reconcile_compensation``: ``status``."""

    def answer(received: Received) -> WorkerMessage:
        assert isinstance(received.message, ReconcileCompensation)
        return outcome(received, status)

    return answer


async def compensation_recorded(
    client: HostClient, scripted: ScriptedWorker, worker_env: WorkerEnv
) -> tuple[HostRun, str, str, WorkflowCompensationTarget]:
    """A succeeded operation and its compensation intent, recorded and never sent."""
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    scripted.answer_all(succeeded)
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)
    scripted.answer_all(None)
    await client.close_session(session)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))
    compensation_key = await client.record_compensation(run, target, inverse, b"undo:1")
    return run, key, compensation_key, target


async def restarted(hosts: HostFactory, before: HostClient, **kwargs: object) -> HostClient:
    """The host process stops and a new one starts on the same ledger."""
    await hosts.crash(before)
    return await hosts.start(engine=WorkflowEngine(), **kwargs)  # type: ignore[arg-type]


async def test_recover_looks_a_pending_compensation_up_without_its_inverse(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start(backoff_initial=0.01)
    _, key, compensation_key, _ = await compensation_recorded(before, scripted, worker_env)
    after = await restarted(hosts, before, backoff_initial=0.01)

    recovering = asyncio.create_task(
        after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())
    )
    lookup = await scripted.next("reconcile_compensation")
    # The lookup names the compensation exactly as recorded, and carries no input.
    request = lookup.request
    assert (request.operation_key, request.compensation_key) == (key, compensation_key)
    assert request.tenant_scope == worker_env.scope
    await scripted.reply(lookup, looked_up(Succeeded(UNDONE))(lookup))
    summary = await asyncio.wait_for(recovering, 10.0)

    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [compensation_key]
    assert summary.unresolved == [] and summary.errors == {}
    assert after.published["reconcile_compensation"] == 1
    assert after.published["compensate_operation"] == 0
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.SUCCEEDED
    assert stored.state == StateKind.SUCCEEDED  # the original is untouched


async def test_a_lookup_answer_is_persisted_before_the_next_lookup(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(backoff_initial=0.01, max_attempts=3)
    run, key, _, _ = await compensation_recorded(client, scripted, worker_env)
    session = await client.open_session(worker_env.scope, manifest())

    looking = asyncio.create_task(client.reconcile_compensation(session, run, key))
    first = await scripted.next("reconcile_compensation")
    await scripted.reply(first, looked_up(Running())(first))
    # The next lookup is sent only once `running` is durable.
    second = await scripted.next("reconcile_compensation")
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.RUNNING
    assert second.request.request_id != first.request.request_id
    await scripted.reply(second, looked_up(Succeeded(UNDONE))(second))

    state = await asyncio.wait_for(looking, 10.0)
    assert isinstance(state, Succeeded)
    assert compensation_state(run, key) == StateKind.SUCCEEDED
    assert client.published["reconcile_compensation"] == 2


async def test_an_adapter_without_the_lookup_leaves_the_compensation_for_an_operator(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start(backoff_initial=0.01)
    _, key, compensation_key, _ = await compensation_recorded(before, scripted, worker_env)
    revision = (await stored_ledger(host_env)).revision
    after = await restarted(hosts, before, backoff_initial=0.01, max_attempts=2)
    # The worker's adapter raises AdapterUnsupported: the worker refuses adapter_error.
    scripted.answer_all(lambda received: refusal(received, "adapter_error"))

    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "adapter_error"}
    assert summary.compensations == {key: StateKind.PENDING}
    assert after.published["reconcile_compensation"] == 2  # max_attempts, then reported
    assert after.published["compensate_operation"] == 0  # no inverse given: nothing runs
    assert (await stored_ledger(host_env)).revision == revision


async def test_a_missing_adapter_is_reported_at_once(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start(backoff_initial=0.01)
    _, key, compensation_key, _ = await compensation_recorded(before, scripted, worker_env)
    after = await restarted(hosts, before, backoff_initial=0.01)
    scripted.answer_all(lambda received: refusal(received, "missing_adapter"))

    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "missing_adapter"}
    assert summary.compensations == {key: StateKind.PENDING}
    assert after.published["reconcile_compensation"] == 1


async def test_a_compensation_the_worker_never_admitted_is_sent_under_its_key(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start(backoff_initial=0.01)
    _, key, compensation_key, target = await compensation_recorded(before, scripted, worker_env)
    after = await restarted(hosts, before, backoff_initial=0.01)
    inverse = undo_payload()

    recovering = asyncio.create_task(
        after.recover(
            RUN,
            after.engine.plan(STEPS),
            worker_env.scope,
            manifest(),
            compensations={key: (target, inverse)},
        )
    )
    lookup = await scripted.next("reconcile_compensation")
    await scripted.reply(lookup, refusal(lookup, "unknown_compensation"))
    sent = await scripted.next("compensate_operation")
    assert sent.request.compensation_key == compensation_key  # the same key, never a new one
    assert sent.request.payload == inverse
    await scripted.reply(sent, outcome(sent, Succeeded(UNDONE)))
    summary = await asyncio.wait_for(recovering, 10.0)

    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.unresolved == [] and summary.errors == {}
    assert target.action_verifier.calls >= 1  # type: ignore[attr-defined]  # a fresh approval
    assert after.published["compensate_operation"] == 1


async def test_unknown_compensation_without_the_inverse_sends_nothing(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    before = await hosts.start(backoff_initial=0.01)
    _, _, compensation_key, _ = await compensation_recorded(before, scripted, worker_env)
    after = await restarted(hosts, before, backoff_initial=0.01)
    scripted.answer_all(lambda received: refusal(received, "unknown_compensation"))

    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "unknown_compensation"}
    assert after.published["reconcile_compensation"] == 1
    assert after.published["compensate_operation"] == 0


async def test_unknown_compensation_for_a_running_one_is_never_sent_again(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    # The ledger says the worker reported the inverse running: its journal
    # forgetting the key is no proof that nothing ran. Fail closed.
    client = await hosts.start(backoff_initial=0.01, max_attempts=1)
    run, key, compensation_key, target = await compensation_recorded(client, scripted, worker_env)
    session = await client.open_session(worker_env.scope, manifest())
    scripted.answer_all(looked_up(Running()))
    assert isinstance(await client.reconcile_compensation(session, run, key), Running)
    await client.close_session(session)
    assert compensation_state(run, key) == StateKind.RUNNING
    scripted.answer_all(lambda received: refusal(received, "unknown_compensation"))

    summary = await client.recover(
        RUN,
        run.plan,
        worker_env.scope,
        manifest(),
        compensations={key: (target, undo_payload())},
    )

    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "unknown_compensation"}
    assert summary.compensations == {key: StateKind.RUNNING}
    assert client.published["compensate_operation"] == 0


async def test_the_lookup_verb_raises_unknown_compensation_to_its_caller(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv
) -> None:
    client = await hosts.start(backoff_initial=0.01)
    run, key, _, _ = await compensation_recorded(client, scripted, worker_env)
    session = await client.open_session(worker_env.scope, manifest())
    scripted.answer_all(lambda received: refusal(received, "unknown_compensation"))

    with pytest.raises(WorkerRequestRejected) as refused:
        await client.reconcile_compensation(session, run, key)

    assert refused.value.rejection_code == "unknown_compensation"
    assert compensation_state(run, key) == StateKind.PENDING
    assert client.published["compensate_operation"] == 0


async def test_a_lookup_that_was_not_answered_falls_back_to_the_recorded_inverse(
    scripted: ScriptedWorker, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    # An adapter without the lookup, and the inverse at hand: the same cmp- key
    # under a fresh approval, which the worker answers from its journal.
    before = await hosts.start(backoff_initial=0.01)
    _, key, compensation_key, target = await compensation_recorded(before, scripted, worker_env)
    after = await restarted(hosts, before, backoff_initial=0.01, max_attempts=2)

    def answer(received: Received) -> WorkerMessage:
        if isinstance(received.message, ReconcileCompensation):
            return refusal(received, "adapter_error")
        return outcome(received, Succeeded(UNDONE))

    scripted.answer_all(answer)
    summary = await after.recover(
        RUN,
        after.engine.plan(STEPS),
        worker_env.scope,
        manifest(),
        compensations={key: (target, undo_payload())},
    )

    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [compensation_key]
    assert summary.unresolved == [] and summary.errors == {}
    assert after.published["reconcile_compensation"] == 2
    assert after.published["compensate_operation"] == 1


# octo-host reconcile RUN cmp-... and recover without inputs ------------------------------


async def test_the_cli_looks_a_compensation_up_by_its_cmp_key(
    scripted: ScriptedWorker, tmp_path: Path, names: Names, worker_env: WorkerEnv
) -> None:
    cli = HostCli(tmp_path / "host", names, worker_env)
    await cli.provision()
    scripted.answer_all(succeeded)
    key = (await cli.dispatch()).json()["operation_key"]
    # The inverse was admitted and its outcome is unknown: the worker keeps
    # answering pending_compensation until its attempts run out.
    scripted.answer_all(lambda received: refusal(received, "pending_compensation"))
    pending = await cli.run(
        "compensate", CLI_RUN, key, "--scope", names.scope, "--payload", UNDO,
        "--nonce", "undo-1", "--original", PUBLISH, "--json",
    )  # fmt: skip
    assert pending.status == 1, pending.stderr
    compensation_key = pending.json()["compensation_key"]
    assert pending.json()["compensation_state"] == "pending"

    # recover without --inputs looks it up; an adapter without the lookup refuses.
    scripted.answer_all(lambda received: refusal(received, "adapter_error"))
    recovered = await cli.run("recover", CLI_RUN, "--scope", names.scope)
    assert recovered.status == 1
    assert f"unresolved: {compensation_key}: adapter_error" in recovered.stdout

    # A compensation is looked up without input; an input is refused.
    with_input = await cli.run(
        "reconcile", CLI_RUN, compensation_key, "--scope", names.scope, "--payload", UNDO
    )
    assert with_input.status == 2
    assert_one_line_error(with_input, "--payload", "without input")

    scripted.answer_all(lambda received: outcome(received, Succeeded(UNDONE)))
    looked = await cli.run("reconcile", CLI_RUN, compensation_key, "--scope", names.scope, "--json")
    assert looked.status == 0, looked.stderr
    document = looked.json()
    assert document["compensation_key"] == compensation_key
    assert document["compensation_state"] == "succeeded"
    assert document["observed"]["state"] == "succeeded"
    [operation] = (await cli.run("ledger", "show", CLI_RUN, "--json")).json()["operations"]
    assert operation["state"] == "succeeded"
    assert operation["compensation"]["state"] == "succeeded"

    # Nothing is left for recover.
    again = await cli.run("recover", CLI_RUN, "--scope", names.scope, "--json")
    assert again.status == 0, again.stderr
    assert again.json()["compensations"] == {key: "succeeded"}
