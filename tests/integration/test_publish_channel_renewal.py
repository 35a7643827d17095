"""A nacked or unconfirmed publish goes again on a new confirm channel, worker and host alike.

RabbitMQ can leave a channel nacking, or never confirming, every publish to
a quorum queue whose leader's node died or was cut off while the channel was
opened, while a channel opened later publishes at once (seen on a
three-node cluster: ``make test-cluster``, where the worker's replies failed
for minutes and the broker dead-lettered the requests they answered). A
single node cannot make a channel stuck that way, so here the stuck channel
is a real channel of a real connection to the shared broker whose publishes
a stand-in for ``publish_envelope`` fails; the channel put in its place is
opened on the same connection by the code under test, and nothing else is
faked.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from octo_common.runtime import amqp
from octo_common.transport import PublishNacked, PublishTimedOut, build_host_publish
from octo_host.client import broker as host_broker
from octo_host.client.broker import HostBroker
from octo_host.client.settings import ClientSettings
from octo_worker.hooks import NO_HOOKS
from octo_worker.transport import ConfirmedPublisher
from octo_worker.transport import delivery as worker_delivery

pytestmark = pytest.mark.rabbitmq

URL = "amqp://127.0.0.1:5672/"
PUBLISH_TIMEOUT = 0.5


@pytest.fixture
async def connection() -> AsyncIterator[amqp.Connection]:
    opened = await amqp.connect(URL, timeout=5.0, name="octo-test-renewal")
    try:
        yield opened
    finally:
        await opened.close()


class StuckChannel:
    """``publish_envelope`` in which one channel fails every publish (``failure``: a
    nack, or no confirm in time); the others confirm."""

    def __init__(self, stuck: amqp.Channel, failure: str) -> None:
        self.stuck = stuck
        self.failure = failure
        self.channels: list[amqp.Channel] = []

    async def __call__(self, channel: amqp.Channel, envelope: Any, *, timeout: float) -> None:
        self.channels.append(channel)
        if channel is self.stuck:
            if self.failure == "nack":
                raise PublishNacked(envelope.routing_key)
            raise PublishTimedOut(envelope.routing_key, timeout)


@pytest.fixture(params=["nack", "timeout"])
async def fake(connection: amqp.Connection, request: pytest.FixtureRequest) -> StuckChannel:
    """A stand-in whose stuck channel is a real confirm channel of ``connection``."""
    return StuckChannel(await connection.channel(publisher_confirms=True), request.param)


def _envelope() -> Any:
    return build_host_publish(
        "t-renewal",
        "s-" + secrets.token_hex(12),
        secrets.token_bytes(32),
        b"{}",
        reply_to="octo.v5.reply.t-renewal-host",
        correlation_id="d-1",
    )


async def _check_renewed(fake: StuckChannel, current: amqp.Channel | None) -> None:
    """The stuck channel was tried first, the last publish went on a new open confirm
    channel that is now the current one, and the stuck one is closed soon after."""
    assert fake.channels[0] is fake.stuck
    fresh = fake.channels[-1]
    assert fresh is not fake.stuck and not fresh.is_closed and fresh.publisher_confirms
    assert current is fresh
    for _ in range(100):
        if fake.stuck.is_closed:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the stuck channel is still open after its confirms ended")


async def test_worker_publish_renews_a_failing_channel(
    connection: amqp.Connection, fake: StuckChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(worker_delivery, "publish_envelope", fake)
    connected = asyncio.Event()
    connected.set()
    publisher = ConfirmedPublisher(
        timeout=PUBLISH_TIMEOUT,
        connected=connected,
        stopping=asyncio.Event(),
        hooks=NO_HOOKS,
        log=structlog.get_logger("test"),
    )
    publisher.use(connection, fake.stuck)

    await publisher.publish(_envelope())

    await _check_renewed(fake, publisher._channel)
    assert not connection.is_closed


async def test_host_publish_renews_a_failing_channel(
    connection: amqp.Connection, fake: StuckChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_broker, "publish_envelope", fake)
    settings = ClientSettings(
        reply_timeout=1.0,
        publish_timeout=PUBLISH_TIMEOUT,
        max_attempts=3,
        backoff_initial=0.05,
        backoff_max=0.1,
        max_cached_runs=4,
    )
    broker = HostBroker(URL, "t-renewal-host", settings, structlog.get_logger("test"))
    broker._connection = connection
    broker._publish_channel = fake.stuck
    broker._connected.set()
    session = SimpleNamespace(
        scope="t-renewal", session_id="s-" + secrets.token_hex(12), key_nonce=bytes(32)
    )

    await broker.publish(session, b"{}", "d-1", kind="dispatch_operation")

    await _check_renewed(fake, broker._publish_channel)
    assert broker.published["dispatch_operation"] == 1
