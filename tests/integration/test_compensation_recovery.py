"""``recover`` resolves a compensation left unfinished, end to end.

Real RabbitMQ, the in-process worker daemon and real SQLite files for the
host ledger and the worker journal. The adapter is ``files.publish`` (its
effect log counts real removals) with a compensation lookup of its own: it
remembers each removal under the compensation's idempotency key, as a
provider keeps its records, and its lookup reports from that record without
removing anything. A crash between the removal and its record is the
adapter raising ``AdapterIndeterminate`` after the removal: the worker's
journal keeps the compensation ``pending``.
"""

from __future__ import annotations

from typing import Any

import pytest

from octo_common.errors import AdapterIndeterminate, AdapterUnsupported
from octo_common.payload import canonical_operation_input_bytes
from octo_common.states import Failed, StateKind, Succeeded
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationDispatch
from octo_host.engine import WorkflowEngine
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log

from .conftest import (
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
    publish_payload,
    recorded,
    registry,
    stored_ledger,
    undo_payload,
)

pytestmark = pytest.mark.rabbitmq


class LookupUndo(FilesPublishAdapter):
    """``files.publish`` whose removals are recorded by idempotency key and looked up
    (the lookup reports exactly what the inverse returned, as the journal expects)."""

    def __init__(self, env: WorkerEnv, *, lookup: bool, cut: bool) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=10.0)
        self.lookup, self.cut = lookup, cut
        self.removed: dict[str, Any] = {}
        self.compensations = 0
        self.lookups = 0

    async def compensate_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.compensations += 1
        status = await super().compensate_operation(request, grant, context)
        self.removed[context.idempotency_key] = status  # what the inverse returned
        if self.cut:
            raise AdapterIndeterminate("cut after the removal")
        return status

    async def reconcile_compensation(self, request: Any, grant: Any, context: Any) -> Any:
        self.lookups += 1
        if not self.lookup:
            raise AdapterUnsupported("reconcile_compensation")
        status = self.removed.get(context.idempotency_key)
        if status is None:
            return Failed("no removal under this key")
        return status


def removals(worker_env: WorkerEnv) -> int:
    return sum(1 for entry in read_effect_log(worker_env.effect_log) if entry["effect"] == "remove")


async def compensation_cut(
    hosts: HostFactory, worker_env: WorkerEnv
) -> tuple[HostClient, str, str]:
    """A succeeded operation whose compensation ran at the worker but stayed ``pending``
    in both the journal and the ledger; the host then crashes."""
    client = await hosts.start(max_attempts=2, backoff_initial=0.01)
    _, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    assert isinstance(await client.dispatch(session, run, key, publish_payload()), Succeeded)
    inverse = undo_payload()
    target = compensation_target(worker_env.scope, key, canonical_operation_input_bytes(inverse))
    compensation_key = await client.record_compensation(run, target, inverse, b"undo:1")
    state = await client.compensate(
        session, run, target, WorkflowCompensationDispatch("c-cut", inverse)
    )
    assert state.kind == StateKind.PENDING
    assert not (worker_env.shelf / "notes.txt").exists()  # the removal happened
    await hosts.crash(client)
    return client, key, compensation_key


async def test_recover_resolves_a_cut_compensation_without_its_inverse(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = LookupUndo(worker_env, lookup=True, cut=True)
    await workers.start(adapters=registry(adapter))
    _, key, compensation_key = await compensation_cut(hosts, worker_env)
    ledger = await stored_ledger(host_env)
    assert ledger.operation(key).compensation.state == StateKind.PENDING  # type: ignore[union-attr]

    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [compensation_key]
    assert summary.unresolved == [] and summary.errors == {}
    assert after.published["reconcile_compensation"] == 1
    assert after.published["compensate_operation"] == 0  # nothing sent again
    assert adapter.compensations == 1 and removals(worker_env) == 1  # one inverse
    assert adapter.lookups == 1
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.SUCCEEDED
    assert stored.state == StateKind.SUCCEEDED
    # Terminal now: a second recover has nothing left to do.
    again = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())
    assert again.unresolved == [] and after.published["reconcile_compensation"] == 1


async def test_a_lost_compensation_result_is_looked_up_after_a_host_crash(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    # The inverse finished at the worker; the host died before its answer came.
    adapter = LookupUndo(worker_env, lookup=True, cut=False)
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
        WorkflowCompensationDispatch("c-lost", inverse),
        approval,
        session.authenticator,
    )
    await before.publish(session, outbound.frame, "c-lost", kind="compensate_operation")
    await hosts.crash(before)

    after = await hosts.start(engine=WorkflowEngine())
    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.compensations == {key: StateKind.SUCCEEDED}
    assert summary.reconciled == [compensation_key]
    assert after.published["compensate_operation"] == 0
    assert adapter.compensations == 1 and removals(worker_env) == 1
    assert not (worker_env.shelf / "notes.txt").exists()


async def test_an_adapter_without_the_lookup_leaves_a_cut_compensation_for_an_operator(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = LookupUndo(worker_env, lookup=False, cut=True)
    await workers.start(adapters=registry(adapter))
    _, key, compensation_key = await compensation_cut(hosts, worker_env)

    after = await hosts.start(engine=WorkflowEngine(), max_attempts=2, backoff_initial=0.01)
    summary = await after.recover(RUN, after.engine.plan(STEPS), worker_env.scope, manifest())

    assert summary.unresolved == [compensation_key]
    assert summary.errors == {compensation_key: "adapter_error"}
    assert summary.compensations == {key: StateKind.PENDING}
    assert after.published["compensate_operation"] == 0
    assert adapter.compensations == 1 and removals(worker_env) == 1
    assert adapter.lookups == 2  # asked, never removed anything
    stored = (await stored_ledger(host_env)).operation(key)
    assert stored is not None and stored.compensation is not None
    assert stored.compensation.state == StateKind.PENDING
