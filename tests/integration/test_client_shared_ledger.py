"""Two host clients sharing one ledger in PostgreSQL decide by compare-and-swap.

Each client is its own host id (two machines) with its own PostgreSQL
connection to one schema; the ledger key is shared. A write that loses the
compare-and-swap adopts the stored ledger and the decision is taken again
from it, so no run ever records two intents for one step. The worker is the
in-process daemon (real ``files.publish``) or the scripted peer, on the real
broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from octo_common.errors import CompensationAlreadyRecorded, DuplicateOperationKey
from octo_common.payload import canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import StateKind, Succeeded
from octo_host.client import HostClient
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowStep
from octo_host.storage.postgres import PostgresLedgerStore
from octo_host.store import ledger_record_key
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon
from tests.postgres import PostgresSchema

from .conftest import TOOL, URL, WAIT, Names, WorkerEnv, compensation_target, manifest
from .scripted_worker import ScriptedWorker, succeeded
from .test_client import publish_payload, undo_payload

pytestmark = pytest.mark.rabbitmq

RUN = "shared-7"
STEPS = [
    WorkflowStep("publish", "publish the release notes"),
    WorkflowStep("announce", "announce the release"),
]

Start = Callable[[], Awaitable[HostClient]]


@pytest.fixture
async def shared(
    postgres_schema: PostgresSchema, names: Names, worker_env: WorkerEnv
) -> AsyncIterator[Start]:
    """Starts host clients on one PostgreSQL ledger schema (one ledger key, own host ids)."""
    ledger_key = secrets.token_bytes(32)
    clients: list[HostClient] = []

    async def start() -> HostClient:
        store = PostgresLedgerStore(
            postgres_schema.url,
            StorageKeyring("host-k1", ledger_key),
            password_file=postgres_schema.password_file,
            schema=postgres_schema.schema,
        )
        client = HostClient(
            URL,
            host_id=names.host(f"-{len(clients)}"),
            scope_keys={worker_env.scope: worker_env.scope_key},
            store=store,
            reply_timeout=WAIT,
            publish_timeout=WAIT,
            backoff_initial=0.01,
        )
        clients.append(client)
        await client.start()
        return client

    yield start
    for client in clients:
        with contextlib.suppress(Exception):
            await client.close()
        with contextlib.suppress(Exception):
            await client.store.close()


async def stored(client: HostClient) -> WorkflowOperationLedger:
    record = await client.store.load(ledger_record_key(RUN))
    assert record is not None
    return WorkflowOperationLedger.from_json(record.payload)


@pytest.mark.parametrize("scope", [False, True], ids=["ledger", "ledger-and-routes"])
async def test_two_hosts_recording_one_step_at_once_record_one_intent(
    shared: Start, worker_env: WorkerEnv, scope: bool
) -> None:
    first, second = await shared(), await shared()
    # Both hosts hold the run at the same revision before either writes.
    runs = [await client.load_run(RUN, client.engine.plan(STEPS)) for client in (first, second)]
    assert runs[0].revision == runs[1].revision == 0
    bound = {"scope": worker_env.scope} if scope else {}

    outcomes: list[Any] = await asyncio.gather(
        *(
            client.record_operation(
                run, "publish", TOOL, publish_payload(), b"shared-7/publish", **bound
            )
            for client, run in zip((first, second), runs, strict=True)
        ),
        return_exceptions=True,
    )

    # One records the intent; the other, having lost the compare-and-swap, decides
    # again on the stored ledger and finds the same derived key (as recording it
    # twice in one process does), instead of failing with write_conflict.
    [key] = [outcome for outcome in outcomes if isinstance(outcome, str)]
    [duplicate] = [o for o in outcomes if isinstance(o, DuplicateOperationKey)]
    assert duplicate.key == key
    ledger = await stored(first)
    assert [operation.operation_key for operation in ledger.operations] == [key]
    assert ledger.revision == 1
    # Both hosts now hold the one intent, ready to settle it.
    assert all(run.operation(key) is not None and run.revision == 1 for run in runs)


async def test_a_host_that_lost_a_write_records_its_own_step_after_the_other(
    shared: Start,
) -> None:
    first, second = await shared(), await shared()
    runs = [await client.load_run(RUN, client.engine.plan(STEPS)) for client in (first, second)]

    keys: list[str] = await asyncio.gather(
        first.record_operation(runs[0], "publish", TOOL, publish_payload("a.txt"), b"a"),
        second.record_operation(runs[1], "announce", TOOL, publish_payload("b.txt"), b"b"),
    )

    # Different steps: both intents are recorded, one after the other.
    ledger = await stored(first)
    assert sorted(operation.operation_key for operation in ledger.operations) == sorted(keys)
    assert ledger.revision == 2


async def test_a_reply_applied_after_another_hosts_write_goes_to_the_stored_ledger(
    shared: Start, scripted: ScriptedWorker, worker_env: WorkerEnv
) -> None:
    first, second = await shared(), await shared()
    run = await first.load_run(RUN, first.engine.plan(STEPS))
    key = await first.record_operation(run, "publish", TOOL, publish_payload(), b"one")
    session = await first.open_session(worker_env.scope, manifest())
    dispatching = asyncio.create_task(first.dispatch(session, run, key, publish_payload()))
    dispatch = await scripted.next("dispatch_operation")

    # While the dispatch is out, the other host records the next step.
    other = await second.load_run(RUN, second.engine.plan(STEPS))
    theirs = await second.record_operation(
        other, "announce", TOOL, publish_payload("b.txt"), b"two"
    )
    assert run.revision == 1 and other.revision == 2

    # The worker's answer: the first write of it loses to the other host's write,
    # so it is applied again to the stored ledger, not dead-lettered.
    await scripted.reply(dispatch, succeeded(dispatch))
    state = await asyncio.wait_for(dispatching, WAIT)

    assert isinstance(state, Succeeded)
    ledger = await stored(first)
    assert [o.operation_key for o in ledger.operations] == [key, theirs]
    assert ledger.operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert ledger.operation(theirs).state == StateKind.PENDING  # type: ignore[union-attr]
    assert ledger.revision == 3 == run.revision


async def test_two_hosts_compensating_one_operation_at_once_record_one_intent(
    shared: Start, daemon: WorkerDaemon, worker_env: WorkerEnv
) -> None:
    first, second = await shared(), await shared()
    run = await first.load_run(RUN, first.engine.plan(STEPS))
    key = await first.record_operation(run, "publish", TOOL, publish_payload(), b"one")
    session = await first.open_session(worker_env.scope, manifest())
    assert isinstance(await first.dispatch(session, run, key, publish_payload()), Succeeded)
    other = await second.load_run(RUN, second.engine.plan(STEPS))
    assert other.state(key) == StateKind.SUCCEEDED
    inverse = undo_payload()
    data = canonical_operation_input_bytes(inverse)

    outcomes: list[Any] = await asyncio.gather(
        first.record_compensation(
            run, compensation_target(worker_env.scope, key, data), inverse, b"u1"
        ),
        second.record_compensation(
            other, compensation_target(worker_env.scope, key, data), inverse, b"u2"
        ),
        return_exceptions=True,
    )

    [compensation_key] = [o for o in outcomes if isinstance(o, str)]
    assert [type(o) for o in outcomes if not isinstance(o, str)] == [CompensationAlreadyRecorded]
    recorded = (await stored(first)).operation(key)
    assert recorded is not None and recorded.compensation is not None
    assert recorded.compensation.compensation_key == compensation_key
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]
