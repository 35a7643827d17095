"""The RabbitMQ mapping as pure values: names, envelopes, header checks."""

from __future__ import annotations

import blake3
import pytest
from pamqp import decode as pamqp_decode
from pamqp import encode as pamqp_encode

from octo_common.errors import (
    InvalidFrameHeaders,
    InvalidKeyNonce,
    InvalidToken,
    ScopeMismatch,
    WireFrameTooLarge,
)
from octo_common.transport import (
    CONTENT_TYPE,
    DEAD_EXCHANGE,
    DEAD_QUEUE,
    DEFAULT_DELIVERY_LIMIT,
    EXCHANGE,
    HEADER_KEY_NONCE,
    HEADER_REASON,
    HEADER_SCOPE,
    HEADER_SESSION,
    WORKER_POLICY_PATTERN,
    DeliveryHeaders,
    PublishFailed,
    PublishNacked,
    PublishReturned,
    PublishTimedOut,
    build_dead_letter_headers,
    build_host_publish,
    build_worker_reply,
    check_delivery,
    frame_message_id,
    host_id_of_reply_queue,
    reply_queue,
    scope_of_worker_queue,
    worker_queue,
)

MIB = 1_048_576
NONCE = bytes(range(32))
NONCE_HEX = NONCE.hex()
SCOPE = "tenant-a"


def good_headers(**overrides: object) -> dict[str, object]:
    headers: dict[str, object] = {
        HEADER_SCOPE: SCOPE,
        HEADER_SESSION: "sess-1",
        HEADER_KEY_NONCE: NONCE_HEX,
    }
    headers.update(overrides)
    return headers


# Names ------------------------------------------------------------------------


def test_topology_constants_are_the_spec_names() -> None:
    assert EXCHANGE == "octo.v5"
    assert DEAD_EXCHANGE == "octo.v5.dead"
    assert DEAD_QUEUE == "octo.v5.dead"
    assert CONTENT_TYPE == "application/vnd.octo.frame+json"
    assert (HEADER_SCOPE, HEADER_SESSION, HEADER_KEY_NONCE, HEADER_REASON) == (
        "octo-scope",
        "octo-session",
        "octo-key-nonce",
        "octo-reason",
    )
    assert WORKER_POLICY_PATTERN == r"^octo\.v5\.worker\."
    assert DEFAULT_DELIVERY_LIMIT == 5


def test_queue_names_are_built_from_tokens() -> None:
    assert worker_queue("tenant-a") == "octo.v5.worker.tenant-a"
    assert reply_queue("host.1") == "octo.v5.reply.host.1"


def test_policy_pattern_matches_worker_queues_only() -> None:
    import re

    pattern = re.compile(WORKER_POLICY_PATTERN)
    assert pattern.search(worker_queue("s"))
    assert not pattern.search(reply_queue("h"))
    assert not pattern.search(DEAD_QUEUE)
    assert not pattern.search("octo.v5Xworker.s")


@pytest.mark.parametrize("bad", ["", "Tenant", "a b", "a/b", "a:b", "x" * 129, "é"])
def test_worker_queue_refuses_a_scope_that_is_not_a_token(bad: str) -> None:
    with pytest.raises(InvalidToken) as raised:
        worker_queue(bad)
    assert raised.value.field == "tenant scope"


@pytest.mark.parametrize("bad", ["", "Host", "h/1", "h 1"])
def test_reply_queue_refuses_a_host_id_that_is_not_a_token(bad: str) -> None:
    with pytest.raises(InvalidToken):
        reply_queue(bad)


def test_queue_names_parse_back_to_their_tokens() -> None:
    assert scope_of_worker_queue("octo.v5.worker.tenant-a") == "tenant-a"
    assert scope_of_worker_queue("octo.v5.worker.") is None
    assert scope_of_worker_queue("octo.v5.reply.h") is None
    assert host_id_of_reply_queue("octo.v5.reply.h-1") == "h-1"
    assert host_id_of_reply_queue("octo.v5.reply.H") is None
    assert host_id_of_reply_queue("octo.v5.worker.s") is None
    assert host_id_of_reply_queue(None) is None


# Envelopes --------------------------------------------------------------------


def test_host_publish_carries_every_property_of_w12_1() -> None:
    body = b'{"frame":1}'
    env = build_host_publish(
        SCOPE, "sess-1", NONCE, body, reply_to=reply_queue("h1"), correlation_id="req-1"
    )
    assert env.body == body
    assert env.message_id == blake3.blake3(body).hexdigest()
    assert env.correlation_id == "req-1"
    assert env.reply_to == "octo.v5.reply.h1"
    assert env.exchange == "octo.v5"
    assert env.routing_key == "octo.v5.worker.tenant-a"
    assert env.content_type == CONTENT_TYPE
    assert env.delivery_mode == 2
    assert dict(env.headers) == {
        "octo-scope": SCOPE,
        "octo-session": "sess-1",
        "octo-key-nonce": NONCE_HEX,
    }


def test_open_session_publish_has_no_correlation_id() -> None:
    env = build_host_publish(
        SCOPE, "sess-1", NONCE, b"{}", reply_to=reply_queue("h1"), correlation_id=None
    )
    assert env.correlation_id is None


def test_worker_reply_is_routed_to_the_recorded_reply_queue() -> None:
    env = build_worker_reply(
        SCOPE, "sess-1", NONCE, b"{}", reply_to="octo.v5.reply.h1", correlation_id="req-9"
    )
    assert env.routing_key == "octo.v5.reply.h1"
    assert env.reply_to is None
    assert env.exchange == EXCHANGE
    assert env.correlation_id == "req-9"
    assert env.message_id == frame_message_id(b"{}")


def test_a_reply_is_never_routed_into_a_worker_queue() -> None:
    # reply_to is unauthenticated: it must not steer a reply into a scope queue.
    with pytest.raises(ValueError):
        build_worker_reply(
            SCOPE, "s", NONCE, b"{}", reply_to="octo.v5.worker.other", correlation_id=None
        )
    with pytest.raises(ValueError):
        build_host_publish(
            SCOPE, "s", NONCE, b"{}", reply_to="amq.rabbitmq.reply-to", correlation_id=None
        )


def test_builders_refuse_bad_inputs_with_protocol_errors() -> None:
    reply = reply_queue("h1")
    with pytest.raises(InvalidToken):
        build_host_publish("Bad", "s", NONCE, b"{}", reply_to=reply, correlation_id=None)
    with pytest.raises(InvalidToken):
        build_host_publish(SCOPE, "S!", NONCE, b"{}", reply_to=reply, correlation_id=None)
    with pytest.raises(InvalidToken):
        build_host_publish(SCOPE, "s", NONCE, b"{}", reply_to=reply, correlation_id="R 1")
    with pytest.raises(InvalidKeyNonce):
        build_host_publish(SCOPE, "s", NONCE[:31], b"{}", reply_to=reply, correlation_id=None)


def test_builders_accept_exactly_one_mebibyte_and_refuse_more() -> None:
    reply = reply_queue("h1")
    env = build_host_publish(SCOPE, "s", NONCE, b"x" * MIB, reply_to=reply, correlation_id=None)
    assert len(env.body) == MIB
    with pytest.raises(WireFrameTooLarge) as raised:
        build_worker_reply(SCOPE, "s", NONCE, b"x" * (MIB + 1), reply_to=reply, correlation_id=None)
    assert raised.value.actual == MIB + 1


def test_envelope_repr_never_shows_the_frame() -> None:
    env = build_host_publish(
        SCOPE, "s", NONCE, b"SECRET-PAYLOAD", reply_to=reply_queue("h"), correlation_id=None
    )
    assert "SECRET-PAYLOAD" not in repr(env)


def test_dead_letter_headers_add_the_reason_and_keep_the_rest() -> None:
    original = good_headers(**{"x-other": 7})
    copied = build_dead_letter_headers(original, "scope_mismatch")
    assert copied == {**original, "octo-reason": "scope_mismatch"}
    assert HEADER_REASON not in original
    again = build_dead_letter_headers(copied, "unknown_session")
    assert again[HEADER_REASON] == "unknown_session"
    assert build_dead_letter_headers(None, "invalid_frame_headers") == {
        "octo-reason": "invalid_frame_headers"
    }


def test_dead_letter_headers_can_always_be_encoded_again() -> None:
    # pamqp decodes a non-UTF-8 long string as bytes, and cannot encode bytes.
    received = {"x-raw": b"\xff\xfe", "x-table": {"a": b"\xff", "b": [b"\x00", 1]}, "n": 1}
    with pytest.raises(TypeError):
        pamqp_encode.field_table(received)
    copied = build_dead_letter_headers(received, "invalid_frame_headers")
    encoded = pamqp_encode.field_table(copied)
    _, decoded = pamqp_decode.field_table(encoded)
    assert bytes(decoded["x-raw"]) == b"\xff\xfe"
    assert decoded["x-table"]["b"][1] == 1 and decoded["n"] == 1
    assert decoded["octo-reason"] == "invalid_frame_headers"


@pytest.mark.parametrize("bad", ["", "Scope", "1abc", "a-b", "x" * 65])
def test_dead_letter_reason_must_be_an_error_code(bad: str) -> None:
    with pytest.raises(ValueError):
        build_dead_letter_headers({}, bad)


def test_publish_failures_share_a_base_and_have_stable_codes() -> None:
    returned = PublishReturned("octo.v5.worker.x", 312)
    assert isinstance(returned, PublishFailed)
    assert returned.code == "publish_returned"
    assert PublishNacked("k").code == "publish_nacked"
    timed_out = PublishTimedOut("k", 2.5)
    assert timed_out.timeout == 2.5
    assert isinstance(timed_out, PublishFailed)


# check_delivery (its first two checks) -----------------------------------------------


def test_good_headers_give_the_session_and_the_raw_nonce() -> None:
    assert check_delivery(SCOPE, 10, good_headers()) == DeliveryHeaders("sess-1", NONCE)


def test_header_values_may_arrive_as_bytes() -> None:
    headers = good_headers(
        **{
            HEADER_SCOPE: SCOPE.encode(),
            HEADER_SESSION: b"sess-1",
            HEADER_KEY_NONCE: NONCE_HEX.encode(),
        }
    )
    assert check_delivery(SCOPE, 10, headers) == DeliveryHeaders("sess-1", NONCE)


def test_body_of_exactly_one_mebibyte_passes_and_one_more_byte_does_not() -> None:
    assert check_delivery(SCOPE, MIB, good_headers()).session_id == "sess-1"
    with pytest.raises(WireFrameTooLarge) as raised:
        check_delivery(SCOPE, MIB + 1, good_headers())
    assert raised.value.code == "wire_frame_too_large"


def test_size_is_checked_before_any_header() -> None:
    with pytest.raises(WireFrameTooLarge):
        check_delivery(SCOPE, MIB + 1, None)


@pytest.mark.parametrize(
    "scope_value",
    [None, "tenant-b", "TENANT-A", b"tenant-b", 7, ["tenant-a"], bytearray(b"tenant-a"), b"\xff"],
)
def test_missing_or_other_scope_is_a_scope_mismatch(scope_value: object) -> None:
    headers = good_headers()
    if scope_value is None:
        del headers[HEADER_SCOPE]
    else:
        headers[HEADER_SCOPE] = scope_value
    with pytest.raises(ScopeMismatch) as raised:
        check_delivery(SCOPE, 10, headers)
    assert raised.value.code == "scope_mismatch"


def test_no_headers_at_all_is_a_scope_mismatch() -> None:
    with pytest.raises(ScopeMismatch):
        check_delivery(SCOPE, 10, None)
    with pytest.raises(ScopeMismatch):
        check_delivery(SCOPE, 10, {})


def test_scope_is_checked_before_session_and_nonce() -> None:
    headers = {HEADER_SCOPE: "other", HEADER_SESSION: "NOT A TOKEN", HEADER_KEY_NONCE: "zz"}
    with pytest.raises(ScopeMismatch):
        check_delivery(SCOPE, 10, headers)


@pytest.mark.parametrize(
    "session_value",
    ["", "Sess", "s s", "x" * 129, b"\xff\xfe", 12, None, bytearray(b"sess-1")],
)
def test_session_header_must_be_a_token(session_value: object) -> None:
    headers = good_headers()
    if session_value is None:
        del headers[HEADER_SESSION]
    else:
        headers[HEADER_SESSION] = session_value
    with pytest.raises(InvalidFrameHeaders) as raised:
        check_delivery(SCOPE, 10, headers)
    assert raised.value.code == "invalid_frame_headers"


@pytest.mark.parametrize(
    "nonce_value",
    [
        NONCE_HEX.upper(),
        NONCE_HEX[:-2],
        NONCE_HEX + "00",
        "g" * 64,
        " " + NONCE_HEX[1:],
        NONCE,
        b"\xff" * 64,
        64,
        None,
    ],
)
def test_nonce_header_must_be_64_lowercase_hex(nonce_value: object) -> None:
    headers = good_headers()
    if nonce_value is None:
        del headers[HEADER_KEY_NONCE]
    else:
        headers[HEADER_KEY_NONCE] = nonce_value
    with pytest.raises(InvalidFrameHeaders):
        check_delivery(SCOPE, 10, headers)


def test_other_headers_are_ignored() -> None:
    headers = good_headers(**{"x-delivery-count": 3, HEADER_REASON: "whatever"})
    assert check_delivery(SCOPE, 10, headers).key_nonce == NONCE


@pytest.mark.parametrize("bad", [["tenant-a"], {"tenant": "a"}, 5, b"tenant-a"])
def test_a_route_argument_of_another_type_fails_with_its_check_not_a_cache_error(
    bad: object,
) -> None:
    for field in ("scope", "session_id"):
        arguments: dict[str, object] = {"scope": SCOPE, "session_id": "s-1"}
        arguments[field] = bad
        with pytest.raises(InvalidToken):
            build_host_publish(
                arguments["scope"],  # type: ignore[arg-type]
                arguments["session_id"],  # type: ignore[arg-type]
                NONCE,
                b"{}",
                reply_to="octo.v5.reply.h1",
                correlation_id=None,
            )
