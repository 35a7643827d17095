"""The RabbitMQ topology and the confirmed publish, against the real broker.

Every test uses its own scope and host names (uuid suffix) and deletes the
worker and reply queues it created. The shared exchanges and ``octo.v5.dead``
stay: other tests and the daemon use them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from octo_common.runtime.broker import publish_confirmed, publish_envelope
from octo_common.transport import (
    CONTENT_TYPE,
    DEAD_EXCHANGE,
    DEAD_LOG_STREAM,
    DEAD_POLICY_NAME,
    DEAD_QUEUE,
    DEFAULT_DEAD_MAX_BYTES,
    DEFAULT_DEAD_MAX_LENGTH,
    EXCHANGE,
    HEADER_SCOPE,
    WORKER_POLICY_NAME,
    PublishChannelClosed,
    PublishReturned,
    PublishTimedOut,
    build_host_publish,
    reply_queue,
    worker_queue,
)
from octo_worker.daemon.topology import (
    TopologyError,
    apply_dead_letter_policy,
    apply_policy,
    connect,
    declare_topology,
    describe_topology,
    open_confirm_channel,
)

pytestmark = pytest.mark.rabbitmq

URL = "amqp://127.0.0.1:5672/"
NONCE = bytes(range(32))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def connection() -> AsyncIterator[AbstractConnection]:
    try:
        conn = await connect(URL, timeout=3.0, name="octo-test-topology")
    except TopologyError as error:
        pytest.skip(f"RabbitMQ is not reachable on 127.0.0.1:5672 ({error.reason})")
    yield conn
    await conn.close()


@pytest.fixture
async def channel(connection: AbstractConnection) -> AbstractChannel:
    return await open_confirm_channel(connection)


@pytest.fixture
async def cleanup(connection: AbstractConnection) -> AsyncIterator[list[str]]:
    """Queue names to delete after the test, on a channel of their own."""
    names: list[str] = []
    yield names
    channel = await connection.channel()
    for name in names:
        await channel.queue_delete(name)
    await channel.close()


def rabbitmqctl_json(*args: str) -> list[dict[str, object]]:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    out = subprocess.run(
        ["rabbitmqctl", *args, "--formatter", "json", "-q"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    result: list[dict[str, object]] = json.loads(out)
    return result


def queue_arguments(row: dict[str, object]) -> dict[str, object]:
    """rabbitmqctl's JSON lists queue arguments as [name, type, value] triples."""
    raw = row["arguments"]
    assert isinstance(raw, list)
    return {str(item[0]): item[-1] for item in raw}


async def next_delivery(
    queue: aio_pika.abc.AbstractQueue, timeout: float = 2.0
) -> AbstractIncomingMessage:
    """The next delivery on ``queue`` through a consumer (SAC quorum queues refuse basic.get)."""
    got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    tag = await queue.consume(got.put)
    try:
        return await asyncio.wait_for(got.get(), timeout)
    finally:
        await queue.cancel(tag)


async def dead_letter_from(
    watch: aio_pika.abc.AbstractQueue, routing_key: str, timeout: float
) -> AbstractIncomingMessage:
    """The first dead letter on ``watch`` routed from ``routing_key``.

    ``watch`` sees every dead letter on the broker, also those of tests running
    beside this one: those are acked and passed over.
    """
    got: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
    tag = await watch.consume(got.put)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            message = await asyncio.wait_for(got.get(), max(0.0, deadline - loop.time()))
            await message.ack()
            if message.routing_key == routing_key:
                return message
    finally:
        await watch.cancel(tag)


async def test_declare_is_idempotent_and_worker_queue_is_quorum_with_sac(
    channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope, host = unique("t-scope"), unique("t-host")
    cleanup += [worker_queue(scope), reply_queue(host)]

    first = await declare_topology(channel, [scope], host_ids=[host])
    second = await declare_topology(channel, [scope], host_ids=[host])

    assert (
        first.queues
        == second.queues
        == (
            DEAD_QUEUE,
            DEAD_LOG_STREAM,
            worker_queue(scope),
            reply_queue(host),
        )
    )
    assert first.policy_applied_via == "rabbitmqctl"
    rows = {
        row["name"]: row
        for row in rabbitmqctl_json("list_queues", "name", "type", "arguments", "policy")
        if row["name"] in (worker_queue(scope), reply_queue(host), DEAD_QUEUE)
    }
    worker = rows[worker_queue(scope)]
    assert worker["type"] == "quorum"
    # Only the two arguments: delivery limit and DLX come from the policy.
    assert queue_arguments(worker) == {
        "x-queue-type": "quorum",
        "x-single-active-consumer": True,
    }
    assert worker["policy"] == WORKER_POLICY_NAME
    assert rows[reply_queue(host)]["type"] == "quorum"
    assert rows[reply_queue(host)]["policy"] != WORKER_POLICY_NAME
    assert rows[DEAD_QUEUE]["type"] == "quorum"


async def test_policy_sets_delivery_limit_and_dead_letter_exchange() -> None:
    assert apply_policy(5) == "rabbitmqctl"
    policies = {row["name"]: row for row in rabbitmqctl_json("list_policies")}
    policy = policies[WORKER_POLICY_NAME]
    assert policy["pattern"] == r"^octo\.v5\.worker\."
    assert policy["apply-to"] == "queues"
    definition = policy["definition"]
    if isinstance(definition, str):
        definition = json.loads(definition)
    assert definition == {"delivery-limit": 5, "dead-letter-exchange": "octo.v5.dead"}


async def test_a_frame_rejected_past_the_delivery_limit_lands_in_octo_v5_dead(
    connection: AbstractConnection, channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope = unique("t-dl")
    cleanup.append(worker_queue(scope))
    await declare_topology(channel, [scope], delivery_limit=5)
    # A private queue on the fanout sees every dead letter without taking
    # anyone else's out of octo.v5.dead.
    watch = await channel.declare_queue(exclusive=True)
    await watch.bind(DEAD_EXCHANGE)
    envelope = build_host_publish(
        scope, "sess-dl", NONCE, b'{"poison":true}', reply_to=reply_queue("h"), correlation_id=None
    )
    await publish_envelope(channel, envelope, timeout=5.0)

    consumer = await connection.channel()
    await consumer.set_qos(prefetch_count=1)
    queue = await consumer.get_queue(worker_queue(scope), ensure=False)
    deliveries = 0
    for _ in range(6):  # delivery limit 5: the sixth reject dead-letters it
        message = await next_delivery(queue)
        deliveries += 1
        await message.reject(requeue=True)

    dead = await dead_letter_from(watch, worker_queue(scope), timeout=5.0)
    assert deliveries == 6
    assert dead.body == envelope.body
    assert dead.message_id == envelope.message_id
    assert dead.headers[HEADER_SCOPE] == scope
    assert dead.headers["x-first-death-reason"] == "delivery_limit"
    with pytest.raises(asyncio.TimeoutError):
        await next_delivery(queue, timeout=0.3)
    await consumer.close()
    await remove_from_dead_queue(connection, envelope.message_id)


async def remove_from_dead_queue(connection: AbstractConnection, message_id: str) -> None:
    """Take our own copy out of the shared dead queue; requeue everyone else's."""
    channel = await connection.channel()
    queue = await channel.get_queue(DEAD_QUEUE, ensure=False)
    held: list[AbstractIncomingMessage] = []
    try:
        for _ in range(1000):
            message = await queue.get(fail=False, no_ack=False)
            if message is None:
                break
            if message.message_id == message_id:
                await message.ack()
                break
            held.append(message)
    finally:
        for message in held:
            await message.reject(requeue=True)
        await channel.close()


async def test_confirmed_publish_delivers_every_w12_1_property(
    channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope, host = unique("t-pub"), unique("t-host")
    cleanup += [worker_queue(scope), reply_queue(host)]
    await declare_topology(channel, [scope], host_ids=[host], delivery_limit=None)
    envelope = build_host_publish(
        scope, "sess-1", NONCE, b'{"hello":1}', reply_to=reply_queue(host), correlation_id="req-1"
    )

    await publish_envelope(channel, envelope, timeout=5.0)

    queue = await channel.get_queue(worker_queue(scope), ensure=False)
    message = await next_delivery(queue)
    await message.ack()
    assert message.body == envelope.body
    assert message.content_type == CONTENT_TYPE
    assert message.message_id == envelope.message_id
    assert message.correlation_id == "req-1"
    assert message.reply_to == reply_queue(host)
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.exchange == EXCHANGE
    assert message.routing_key == worker_queue(scope)
    assert dict(message.headers) == dict(envelope.headers)


async def test_unroutable_mandatory_publish_raises_returned(channel: AbstractChannel) -> None:
    nowhere = worker_queue(unique("t-absent"))
    await declare_topology(channel, [], delivery_limit=None)

    with pytest.raises(PublishReturned) as raised:
        await publish_confirmed(
            channel,
            EXCHANGE,
            nowhere,
            b"{}",
            message_id="m-unroutable",
            correlation_id=None,
            reply_to=None,
            headers={},
            timeout=5.0,
        )
    assert raised.value.routing_key == nowhere
    assert raised.value.reply_code == 312
    # The channel survives a return and confirms the next publish.
    assert not channel.is_closed


async def test_publish_to_a_missing_exchange_is_a_closed_channel(
    connection: AbstractConnection,
) -> None:
    channel = await open_confirm_channel(connection)
    with pytest.raises(PublishChannelClosed):
        await publish_confirmed(
            channel,
            unique("octo.t.no-such-exchange"),
            "k",
            b"{}",
            message_id="m1",
            correlation_id=None,
            reply_to=None,
            headers={},
            timeout=5.0,
        )
    assert channel.is_closed
    # Publishing again on the dead channel fails at once, it never hangs.
    with pytest.raises(PublishChannelClosed):
        await publish_confirmed(
            channel,
            EXCHANGE,
            "k",
            b"{}",
            message_id="m2",
            correlation_id=None,
            reply_to=None,
            headers={},
            timeout=5.0,
        )


async def test_publish_without_time_left_times_out(channel: AbstractChannel) -> None:
    with pytest.raises(PublishTimedOut) as raised:
        await publish_confirmed(
            channel,
            EXCHANGE,
            "k",
            b"{}",
            message_id="m-timeout",
            correlation_id=None,
            reply_to=None,
            headers={},
            timeout=0.0,
        )
    assert raised.value.timeout == 0.0


async def test_same_frame_published_concurrently_is_confirmed_twice(
    channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope = unique("t-dup")
    cleanup.append(worker_queue(scope))
    await declare_topology(channel, [scope], delivery_limit=None)
    envelope = build_host_publish(
        scope, "s", NONCE, b'{"same":1}', reply_to=reply_queue("h"), correlation_id="r"
    )

    await asyncio.gather(*(publish_envelope(channel, envelope, timeout=5.0) for _ in range(3)))

    [status] = [s for s in await describe_topology(channel, [scope]) if s.name != DEAD_QUEUE]
    assert status.messages == 3


async def test_describe_counts_messages_and_reports_missing_queues(
    channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope, missing, host = unique("t-desc"), unique("t-missing"), unique("t-host")
    cleanup += [worker_queue(scope), reply_queue(host)]
    await declare_topology(channel, [scope], host_ids=[host], delivery_limit=None)
    for n in range(2):
        envelope = build_host_publish(
            scope,
            "s",
            NONCE,
            f'{{"n":{n}}}'.encode(),
            reply_to=reply_queue(host),
            correlation_id=None,
        )
        await publish_envelope(channel, envelope, timeout=5.0)

    statuses = {
        s.name: s for s in await describe_topology(channel, [missing, scope], host_ids=[host])
    }

    assert statuses[worker_queue(scope)].exists
    assert statuses[worker_queue(scope)].messages == 2
    assert statuses[worker_queue(scope)].consumers == 0
    assert not statuses[worker_queue(missing)].exists
    assert statuses[worker_queue(missing)].messages is None
    assert statuses[reply_queue(host)].messages == 0
    assert statuses[DEAD_QUEUE].exists
    assert not channel.is_closed


async def test_declare_refuses_an_existing_queue_with_other_arguments(
    connection: AbstractConnection, cleanup: list[str]
) -> None:
    scope = unique("t-drift")
    cleanup.append(worker_queue(scope))
    plain = await connection.channel()
    await plain.declare_queue(
        worker_queue(scope), durable=True, arguments={"x-queue-type": "quorum"}
    )
    channel = await open_confirm_channel(connection)

    with pytest.raises(TopologyError) as raised:
        await declare_topology(channel, [scope], delivery_limit=None)
    assert "x-single-active-consumer" in raised.value.reason


def test_policy_error_when_neither_rabbitmqctl_nor_the_api_works() -> None:
    with pytest.raises(TopologyError) as raised:
        apply_policy(
            5,
            management_url="http://admin:s3cret-pw@127.0.0.1:1",
            rabbitmqctl="/nonexistent/rabbitmqctl",
            timeout=2.0,
        )
    text = str(raised.value)
    assert "management api" in text
    assert "rabbitmqctl" in text
    assert "s3cret-pw" not in text


@pytest.mark.parametrize("bad", [0, -1, True, 2**31])
def test_policy_refuses_a_meaningless_delivery_limit(bad: int) -> None:
    with pytest.raises(TopologyError):
        apply_policy(bad)


async def test_connect_failure_names_the_cause_but_never_the_password() -> None:
    with pytest.raises(TopologyError) as raised:
        await connect("amqp://guest:hunter2-secret@127.0.0.1:1/", timeout=2.0)
    assert "hunter2-secret" not in str(raised.value)
    assert "hunter2-secret" not in repr(raised.value)
    assert raised.value.__cause__ is None


# The dead-letter queue's bound (policy octo-v5-dead) ---------------------------------


async def test_declare_bounds_the_dead_letter_queue_by_policy(
    channel: AbstractChannel, cleanup: list[str]
) -> None:
    scope = unique("t-dead")
    cleanup.append(worker_queue(scope))
    report = await declare_topology(channel, [scope], delivery_limit=5)
    assert report.dead_letter_policy_applied_via == "rabbitmqctl"
    policies = {row["name"]: row for row in rabbitmqctl_json("list_policies")}
    policy = policies[DEAD_POLICY_NAME]
    assert policy["pattern"] == r"^octo\.v5\.dead$"
    assert policy["apply-to"] == "queues"
    definition = policy["definition"]
    if isinstance(definition, str):
        definition = json.loads(definition)
    assert definition == {
        "max-length": DEFAULT_DEAD_MAX_LENGTH,
        "max-length-bytes": DEFAULT_DEAD_MAX_BYTES,
        "overflow": "drop-head",
    }
    effective = {
        row["name"]: row["policy"] for row in rabbitmqctl_json("list_queues", "name", "policy")
    }
    assert effective[DEAD_QUEUE] == DEAD_POLICY_NAME
    # The worker queues keep their own policy: one policy applies per queue.
    assert effective[worker_queue(scope)] == WORKER_POLICY_NAME


@pytest.fixture
async def bounded_dead_queue(
    connection: AbstractConnection,
) -> AsyncIterator[Callable[[int, int], Awaitable[str]]]:
    """A test-only queue declared like octo.v5.dead, under a policy of the given bound."""
    made: list[tuple[str, str]] = []

    async def make(max_length: int, max_bytes: int) -> str:
        name = unique("octo-test.dead")
        policy = "octo-test-dead-" + name.rsplit("-", 1)[-1]
        made.append((name, policy))
        via = await asyncio.to_thread(
            apply_dead_letter_policy, max_length, max_bytes, queue=name, policy_name=policy
        )
        assert via == "rabbitmqctl"
        declaring = await connection.channel()
        await declaring.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
        await declaring.close()

        def policy_in_force() -> bool:
            rows = rabbitmqctl_json("list_queues", "name", "policy")
            return any(row["name"] == name and row["policy"] == policy for row in rows)

        for _ in range(100):
            if await asyncio.to_thread(policy_in_force):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"policy {policy} never applied to {name}")
        return name

    yield make
    channel = await connection.channel()
    for name, policy in made:
        await channel.queue_delete(name)
        await asyncio.to_thread(
            subprocess.run,
            ["rabbitmqctl", "clear_policy", policy],
            capture_output=True,
            timeout=30,
            check=False,
        )
    await channel.close()


async def _publish_letters(channel: AbstractChannel, queue: str, bodies: list[bytes]) -> None:
    for index, body in enumerate(bodies):
        await publish_confirmed(
            channel,
            "",
            queue,
            body,
            message_id=f"letter-{index}",
            correlation_id=None,
            reply_to=None,
            headers={"octo-reason": "serialization"},
            timeout=5.0,
        )


async def _drain(connection: AbstractConnection, queue: str) -> list[AbstractIncomingMessage]:
    channel = await connection.channel()
    held = await channel.get_queue(queue, ensure=False)
    messages: list[AbstractIncomingMessage] = []
    while (message := await held.get(fail=False, no_ack=True)) is not None:
        messages.append(message)
    await channel.close()
    return messages


async def test_the_dead_letter_bound_keeps_the_newest_letters_up_to_the_length(
    connection: AbstractConnection,
    channel: AbstractChannel,
    bounded_dead_queue: Callable[[int, int], Awaitable[str]],
) -> None:
    queue = await bounded_dead_queue(5, DEFAULT_DEAD_MAX_BYTES)
    bodies = [f'{{"poison":{n}}}'.encode() for n in range(40)]
    # Every copy is confirmed: a full queue never refuses the worker's dead letter.
    await _publish_letters(channel, queue, bodies)

    assert await ready_count(channel, queue) == 5
    kept = await _drain(connection, queue)
    assert [m.body for m in kept] == bodies[-5:]
    assert [m.message_id for m in kept] == [f"letter-{n}" for n in range(35, 40)]


async def test_the_dead_letter_bound_holds_the_bytes(
    connection: AbstractConnection,
    channel: AbstractChannel,
    bounded_dead_queue: Callable[[int, int], Awaitable[str]],
) -> None:
    queue = await bounded_dead_queue(1000, 2000)
    bodies = [bytes([65 + n % 26]) * 300 for n in range(30)]
    await _publish_letters(channel, queue, bodies)

    kept = await _drain(connection, queue)
    assert 0 < len(kept) <= 2000 // 300
    assert sum(len(m.body) for m in kept) <= 2000
    assert [m.body for m in kept] == bodies[-len(kept) :]


async def ready_count(channel: AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)


def test_the_dead_letter_policy_refuses_a_meaningless_bound() -> None:
    for bad in (0, -1, True, 2**63):
        with pytest.raises(TopologyError):
            apply_dead_letter_policy(bad, 1024)
        with pytest.raises(TopologyError):
            apply_dead_letter_policy(10, bad)
