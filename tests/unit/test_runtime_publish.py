"""What one publish sends: the properties, and the route a session's frames share.

``frame_properties`` must equal, field by field and on the wire, what an
``aio_pika.Message`` with the same values sends (the publish bypasses
aio-pika's message objects); the route behind ``build_host_publish`` and
``build_worker_reply`` is validated once per session and still refuses bad
names on every call.
"""

from __future__ import annotations

import aio_pika
import pytest
from pamqp import frame as pamqp_frame
from pamqp.header import ContentHeader

from octo_common.errors import InvalidKeyNonce, InvalidToken
from octo_common.runtime.broker import frame_properties
from octo_common.transport import (
    CONTENT_TYPE,
    HEADER_KEY_NONCE,
    HEADER_SCOPE,
    HEADER_SESSION,
    build_host_publish,
    build_worker_reply,
    frame_message_id,
)

NONCE = bytes(range(32))
REPLY = "octo.v5.reply.h-1"
BODY = b'{"frame": 1}'


def _wire(properties: object) -> bytes:
    return pamqp_frame.marshal(ContentHeader(0, len(BODY), properties), 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("correlation_id", "reply_to"), [("req-1", REPLY), (None, REPLY), ("req-2", None)]
)
def test_frame_properties_equal_what_an_aio_pika_message_sends(
    correlation_id: str | None, reply_to: str | None
) -> None:
    envelope = build_host_publish(
        "tenant-a", "sess-1", NONCE, BODY, reply_to=REPLY, correlation_id=correlation_id
    )
    ours = frame_properties(envelope.message_id, correlation_id, reply_to, envelope.headers)
    theirs = aio_pika.Message(
        BODY,
        content_type=CONTENT_TYPE,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        headers=dict(envelope.headers),
        message_id=envelope.message_id,
        correlation_id=correlation_id,
        reply_to=reply_to,
    ).properties
    # aio-pika sends priority 0; the publish leaves it out, which the broker
    # reads as the same lowest priority. Every other property is the same.
    assert (ours.priority, theirs.priority) == (None, 0)
    theirs.priority = None
    for name in ours.__slots__:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.delivery_mode == 2 and ours.content_type == CONTENT_TYPE
    assert _wire(ours) == _wire(theirs)


def test_frame_properties_copy_the_headers() -> None:
    headers = {HEADER_SCOPE: "tenant-a"}
    properties = frame_properties("m", None, None, headers)
    assert properties.headers == headers and properties.headers is not headers


def test_frames_of_one_session_share_one_route_and_differ_per_frame() -> None:
    first = build_worker_reply(
        "tenant-a", "sess-9", NONCE, b"a", reply_to=REPLY, correlation_id="r-1"
    )
    second = build_worker_reply(
        "tenant-a", "sess-9", bytearray(NONCE), b"bb", reply_to=REPLY, correlation_id=None
    )
    assert first.headers is second.headers
    assert dict(first.headers) == {
        HEADER_SCOPE: "tenant-a",
        HEADER_SESSION: "sess-9",
        HEADER_KEY_NONCE: NONCE.hex(),
    }
    assert (first.routing_key, first.reply_to) == (REPLY, None)
    assert (first.message_id, second.message_id) == (
        frame_message_id(b"a"),
        frame_message_id(b"bb"),
    )
    assert (first.correlation_id, second.correlation_id) == ("r-1", None)
    host = build_host_publish(
        "tenant-a", "sess-9", NONCE, b"a", reply_to=REPLY, correlation_id=None
    )
    assert (host.routing_key, host.reply_to) == ("octo.v5.worker.tenant-a", REPLY)
    assert dict(host.headers) == dict(first.headers)


def test_a_remembered_route_still_checks_each_frame() -> None:
    build_host_publish("tenant-a", "sess-3", NONCE, b"x", reply_to=REPLY, correlation_id="r-1")
    with pytest.raises(InvalidToken):
        build_host_publish("tenant-a", "sess-3", NONCE, b"x", reply_to=REPLY, correlation_id="R!")
    with pytest.raises(TypeError):
        build_host_publish("tenant-a", "sess-3", NONCE, "x", reply_to=REPLY, correlation_id=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("nonce", [bytes(31), bytearray(33), "0" * 32, 7])
def test_a_bad_nonce_is_refused_every_time(nonce: object) -> None:
    for _ in range(2):
        with pytest.raises(InvalidKeyNonce):
            build_worker_reply(
                "tenant-a",
                "sess-4",
                nonce,
                b"x",
                reply_to=REPLY,
                correlation_id=None,  # type: ignore[arg-type]
            )
