"""The payload codec on the real broker: what RabbitMQ holds is ciphertext.

A hand-made host opens a session that names the codec; the worker daemon is
stopped while the request waits in its queue, so the test reads the broker's
own copy back (basic.get) before the worker sees it. The reply is read from
the host's reply queue as the broker delivered it, and a refused frame from
the dead-letter queue. None holds the input, the output or the tool name in
the clear; each opens to the right message with the session's key.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets

import pytest
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from octo_common.framecipher import MAGIC
from octo_common.grants import CapabilityManifest
from octo_common.limits import PAYLOAD_CODEC
from octo_common.messages import DispatchOperation, OpenSession, OperationResult
from octo_common.requests import OperationDispatchRequest
from octo_common.states import Succeeded
from octo_common.transport import worker_queue

from .conftest import (
    GRANT,
    TOOL,
    WAIT,
    Inbox,
    RawHost,
    RawSession,
    WorkerRunner,
    marker_of,
    reason_of,
    unique,
    wait_session,
)
from .test_daemon_rabbitmq import QUIET, answer, operation_key, publish_payload

pytestmark = pytest.mark.rabbitmq


def _open_codec_session(raw_host: RawHost) -> tuple[RawSession, bytes]:
    session = raw_host.session()
    opening = session.auth.seal(
        OpenSession(
            CapabilityManifest(session.session_id, [GRANT]),
            reply_to=raw_host.reply_queue,
            payload_codec=PAYLOAD_CODEC,
        )
    )
    session.auth.use_payload_codec()
    return session, opening


async def test_the_brokers_copies_of_a_codec_sessions_frames_hold_no_plaintext(
    workers: WorkerRunner, raw_host: RawHost, channel: AbstractChannel, dead_letters: Inbox
) -> None:
    daemon = await workers.start()
    session, opening = _open_codec_session(raw_host)
    await raw_host.publish(opening, headers=raw_host.headers(session, "open"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    await workers.stop(daemon)

    secret_input = "input-" + secrets.token_hex(16)
    key = operation_key()
    request = OperationDispatchRequest(
        session.session_id, "d-1", TOOL, key, publish_payload(content=secret_input)
    )
    await raw_host.publish(
        session.auth.seal(DispatchOperation(request)),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    # The request as the broker holds it, read back from the worker's queue
    # (a consumer of the test's own: basic.get is refused on this queue).
    queue = await channel.get_queue(worker_queue(raw_host.scope), ensure=False)
    held: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def take(message: AbstractIncomingMessage) -> None:
        await message.nack(requeue=True)
        if not held.done():
            held.set_result(message.body)

    tag = await queue.consume(take)
    body = await asyncio.wait_for(held, WAIT)
    await queue.cancel(tag)
    assert body.startswith(MAGIC)
    for plain in (secret_input.encode(), key.encode(), TOOL.encode(), b"dispatch_operation"):
        assert plain not in body

    # A worker started again restores the session's codec from its journal
    # and answers; the reply is enveloped too.
    await workers.start()
    result = await answer(raw_host, session, "d-1")
    assert isinstance(result, OperationResult)
    assert isinstance(result.result.status, Succeeded)
    digest = hashlib.sha256(secret_input.encode()).hexdigest()
    assert result.result.status.payload.value["sha256"] == digest
    (reply,) = raw_host.replies.matching(lambda m: m.correlation_id == "d-1")
    assert reply.body.startswith(MAGIC)
    for plain in (digest.encode(), key.encode(), b"operation_result"):
        assert plain not in reply.body

    # A frame the worker refuses goes to the dead-letter queue as it came.
    refused_input = "refused-" + secrets.token_hex(16)
    tampered = bytearray(
        session.auth.seal(
            DispatchOperation(
                OperationDispatchRequest(
                    session.session_id,
                    "d-2",
                    TOOL,
                    operation_key(),
                    publish_payload(content=refused_input),
                )
            )
        )
    )
    tampered[-1] ^= 1
    await raw_host.publish(
        bytes(tampered), headers=raw_host.headers(session, "tampered"), correlation_id="d-2"
    )
    dead = await dead_letters.wait_for(marker_of("tampered"))
    assert reason_of(dead) == "frame_decryption_failed"
    assert dead.body.startswith(MAGIC) and refused_input.encode() not in dead.body


async def test_a_frame_in_the_clear_in_a_codec_session_is_refused(
    workers: WorkerRunner, raw_host: RawHost, dead_letters: Inbox
) -> None:
    """Once the open named the codec, a frame in the clear (a downgrade, even
    one sealed with the session's own key) is refused before it is opened."""
    daemon = await workers.start()
    session, opening = _open_codec_session(raw_host)
    await raw_host.publish(opening, headers=raw_host.headers(session, "open"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    clear_auth = type(session.auth)(
        session.session_id,
        session.auth._key,  # the session's own key, without the envelope
        session.auth.role,
    )
    clear = RawSession(session.session_id, session.nonce, clear_auth)
    marker = unique("clear")
    request = OperationDispatchRequest(
        session.session_id, "d-1", TOOL, operation_key(), publish_payload()
    )
    await raw_host.publish(
        clear.auth.seal(DispatchOperation(request)),
        headers=raw_host.headers(session, marker),
        correlation_id="d-1",
    )
    dead = await dead_letters.wait_for(marker_of(marker))
    assert reason_of(dead) == "frame_decryption_failed"
    # The open_session itself is never enveloped: a copy of it again (a
    # broker redelivery) is the duplicate it is, acked and dropped.
    again = unique("open-again")
    await raw_host.publish(opening, headers=raw_host.headers(session, again))
    await asyncio.sleep(QUIET)
    assert dead_letters.matching(marker_of(again)) == []
    assert raw_host.replies.items == []
