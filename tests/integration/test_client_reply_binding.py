"""The host's raw ``send`` path takes a reply only for the request it answers.

The correlation id of a delivery is not authenticated; the request id inside
the sealed reply is. The worker side is the scripted peer of
``scripted_worker.py`` on the real broker, which publishes two genuine
replies with their correlation ids swapped.
"""

from __future__ import annotations

import asyncio

import pytest

from octo_host.client import ReplyTimedOut

from .conftest import HostFactory, Inbox, WorkerEnv, manifest, reason_of
from .scripted_worker import ScriptedWorker, succeeded
from .test_client import publish_payload, recorded

pytestmark = pytest.mark.rabbitmq


async def test_swapped_correlation_ids_are_refused_on_the_raw_send_path(
    scripted: ScriptedWorker, hosts: HostFactory, worker_env: WorkerEnv, dead_letters: Inbox
) -> None:
    client = await hosts.start(reply_timeout=2.0)
    plan, run, key = await recorded(client)
    session = await client.open_session(worker_env.scope, manifest())
    first = client.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-first", session.authenticator
    )
    second = client.engine.prepare_authenticated_operation_dispatch(
        plan, run.ledger, key, publish_payload(), "d-second", session.authenticator
    )
    sending = [
        asyncio.create_task(client.send(session, first)),
        asyncio.create_task(client.send(session, second)),
    ]
    received = {}
    for _ in range(2):
        request = await scripted.next("dispatch_operation")
        received[request.request.request_id] = request
    await scripted.reply(received["d-first"], succeeded(received["d-first"]), "d-second")
    await scripted.reply(received["d-second"], succeeded(received["d-second"]), "d-first")

    for correlation_id in ("d-first", "d-second"):
        dead = await dead_letters.wait_for(lambda m, c=correlation_id: m.correlation_id == c)
        assert reason_of(dead) == "reply_correlation_mismatch"
    # Neither waiter took the other's reply: both are still without an answer.
    for task in sending:
        with pytest.raises(ReplyTimedOut):
            await task
