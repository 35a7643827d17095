"""The RabbitMQ mapping of frames, as pure values.

This module owns every name of the broker topology (exchanges, queues,
policy pattern), the AMQP header names, the properties of one publish
(:class:`FrameEnvelope`) and the first two steps of the worker's delivery
pipeline (:func:`check_delivery`). It also defines the
errors a confirmed publish can end with, so that the worker daemon and the
host client name the same failures.

It must never do I/O: no asyncio, no sockets, no aio-pika import. The
daemon and the client turn a :class:`FrameEnvelope` into an AMQP publish
and feed :func:`check_delivery` with what the broker delivered.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Final

import blake3

from octo_common.errors import (
    InvalidFrameHeaders,
    InvalidKeyNonce,
    OctoError,
    ScopeMismatch,
    WireFrameTooLarge,
)
from octo_common.ids import is_token, parse_key_nonce_hex, validate_key_nonce, validate_token
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.peek import header_text

__all__ = [
    "CONTENT_TYPE",
    "DEAD_EXCHANGE",
    "DEAD_LOG_ARGUMENTS",
    "DEAD_LOG_MAX_AGE",
    "DEAD_LOG_MAX_BYTES",
    "DEAD_LOG_SEGMENT_BYTES",
    "DEAD_LOG_STREAM",
    "DEAD_OVERFLOW",
    "DEAD_POLICY_NAME",
    "DEAD_POLICY_PATTERN",
    "DEAD_QUEUE",
    "DEFAULT_DEAD_MAX_BYTES",
    "DEFAULT_DEAD_MAX_LENGTH",
    "DEFAULT_DELIVERY_LIMIT",
    "DELIVERY_MODE_PERSISTENT",
    "EXCHANGE",
    "HEADER_KEY_NONCE",
    "HEADER_REASON",
    "HEADER_SCOPE",
    "HEADER_SESSION",
    "REPLY_QUEUE_PREFIX",
    "WORKER_POLICY_NAME",
    "WORKER_POLICY_PATTERN",
    "WORKER_QUEUE_PREFIX",
    "DeliveryHeaders",
    "FrameEnvelope",
    "FrameRoute",
    "PublishChannelClosed",
    "PublishFailed",
    "PublishNacked",
    "PublishReturned",
    "PublishTimedOut",
    "build_dead_letter_headers",
    "build_host_publish",
    "build_worker_reply",
    "check_delivery",
    "delivery_key_nonce",
    "delivery_session_id",
    "frame_message_id",
    "host_id_of_reply_queue",
    "reply_queue",
    "scope_of_worker_queue",
    "worker_queue",
]

# Topology names.
EXCHANGE: Final = "octo.v5"
DEAD_EXCHANGE: Final = "octo.v5.dead"
DEAD_QUEUE: Final = "octo.v5.dead"
WORKER_QUEUE_PREFIX: Final = "octo.v5.worker."
REPLY_QUEUE_PREFIX: Final = "octo.v5.reply."

# The broker policy that gives every worker queue its delivery limit and
# dead-letter exchange (policies can change later; queue arguments cannot).
WORKER_POLICY_NAME: Final = "octo-v5-worker"
WORKER_POLICY_PATTERN: Final = r"^octo\.v5\.worker\."
DEFAULT_DELIVERY_LIMIT: Final = 5

# The broker policy that bounds the dead-letter queue, so that a flood of
# refused frames cannot fill the broker's disk. The defaults equal what one
# `octo-worker dlq list` can hold, so an inspection always sees the whole
# queue. Overflow drops the oldest letters (drop-head): the worker's
# dead-letter publish is still confirmed (its path never changes with the
# queue's fill), the queue keeps the newest refusals (the ones that describe
# what is failing now), and octo_frames_rejected_total still counts every
# refusal, dropped or not. reject-publish would instead keep the start of a
# flood and nack every later copy, so the worker would fall back to
# rejecting the original, which the broker then drops as well.
DEAD_POLICY_NAME: Final = "octo-v5-dead"
DEAD_POLICY_PATTERN: Final = r"^octo\.v5\.dead$"
DEFAULT_DEAD_MAX_LENGTH: Final = 10_000
DEFAULT_DEAD_MAX_BYTES: Final = 256 * 1024 * 1024
DEAD_OVERFLOW: Final = "drop-head"

# The dead-letter log: a RabbitMQ stream bound to the dead-letter exchange
# beside the queue, so every dead letter is also appended to it. The
# operator views (``dlq list``, the console) read it by offset: a read
# settles nothing and raises no delivery count, each letter keeps its offset
# as a stable id, and a page holds only its own letters. Retention bounds
# it (its size, then its age, segment by segment); queue arguments cannot
# change once declared, so these are constants.
DEAD_LOG_STREAM: Final = "octo.v5.dead.log"
DEAD_LOG_MAX_BYTES: Final = 256 * 1024 * 1024
DEAD_LOG_MAX_AGE: Final = "14D"
DEAD_LOG_SEGMENT_BYTES: Final = 16 * 1024 * 1024
DEAD_LOG_ARGUMENTS: Final[Mapping[str, int | str]] = {
    "x-queue-type": "stream",
    "x-max-length-bytes": DEAD_LOG_MAX_BYTES,
    "x-max-age": DEAD_LOG_MAX_AGE,
    "x-stream-max-segment-size-bytes": DEAD_LOG_SEGMENT_BYTES,
}

# Properties and headers of every publish.
CONTENT_TYPE: Final = "application/vnd.octo.frame+json"
DELIVERY_MODE_PERSISTENT: Final = 2
HEADER_SCOPE: Final = "octo-scope"
HEADER_SESSION: Final = "octo-session"
HEADER_KEY_NONCE: Final = "octo-key-nonce"
HEADER_REASON: Final = "octo-reason"

# A dead-letter reason is an error code: the rejection-code syntax.
_REASON = re.compile(r"[a-z][a-z0-9_]{0,63}")


# Publish failures -------------------------------------------------------------


class PublishFailed(OctoError):
    """A publish the broker did not confirm: it is a failed publish.

    A failed publish says nothing about whether a consumer will see the
    frame; the caller may retry with the same frame bytes or, on
    the worker, reject the delivery it was answering.
    """

    _fields: ClassVar[tuple[str, ...]] = ("routing_key",)
    _text = "publish was not confirmed"
    routing_key: str


class PublishReturned(PublishFailed):
    """The broker returned the mandatory publish: no queue is bound to it."""

    _fields = ("routing_key", "reply_code")
    _defaults = {"reply_code": 312}
    _text = "publish was returned as unroutable"
    routing_key: str
    reply_code: int


class PublishNacked(PublishFailed):
    """The broker answered the publish with ``basic.nack``."""

    _text = "publish was negatively confirmed"


class PublishTimedOut(PublishFailed):
    """No confirm arrived in time; the frame may or may not be enqueued."""

    _fields = ("routing_key", "timeout")
    _text = "publish confirm timed out"
    routing_key: str
    timeout: float


class PublishChannelClosed(PublishFailed):
    """The channel or connection was closed before the confirm arrived."""

    _text = "channel closed before the publish was confirmed"


# Names ------------------------------------------------------------------------


def worker_queue(scope: str) -> str:
    """The queue of tenant scope ``scope``: ``octo.v5.worker.<scope>``.

    Raises ``InvalidToken("tenant scope", scope)`` unless ``scope`` is a token.
    """
    validate_token("tenant scope", scope)
    return WORKER_QUEUE_PREFIX + scope


def reply_queue(host_id: str) -> str:
    """The reply queue of host ``host_id``: ``octo.v5.reply.<host_id>``.

    A host id has token syntax; a bad one raises ``InvalidToken("host id", …)``.
    """
    validate_token("host id", host_id)
    return REPLY_QUEUE_PREFIX + host_id


def scope_of_worker_queue(name: str) -> str | None:
    """The scope a worker queue name belongs to, or None if it is not one."""
    if not name.startswith(WORKER_QUEUE_PREFIX):
        return None
    scope = name[len(WORKER_QUEUE_PREFIX) :]
    return scope if is_token(scope) else None


def host_id_of_reply_queue(name: object) -> str | None:
    """The host id of a reply queue name, or None if ``name`` is not one.

    ``reply_to`` is unauthenticated; a worker can use this to refuse
    replies to anything but a host reply queue.
    """
    if not isinstance(name, str) or not name.startswith(REPLY_QUEUE_PREFIX):
        return None
    host_id = name[len(REPLY_QUEUE_PREFIX) :]
    return host_id if is_token(host_id) else None


def frame_message_id(body: bytes) -> str:
    """``message_id`` of a publish: hex BLAKE3 (unkeyed) of the frame bytes."""
    return str(blake3.blake3(body).hexdigest())


# Publishing -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrameEnvelope:
    """Everything one publish of a frame needs.

    ``exchange`` and ``routing_key`` say where it goes; ``headers`` are the
    three ``octo-*`` headers. Every publish is persistent
    (:data:`DELIVERY_MODE_PERSISTENT`), mandatory and publisher-confirmed,
    with :data:`CONTENT_TYPE`. The body never appears in ``repr``.
    """

    body: bytes = field(repr=False)
    message_id: str
    correlation_id: str | None
    reply_to: str | None
    headers: Mapping[str, str]
    routing_key: str
    exchange: str = EXCHANGE
    content_type: str = CONTENT_TYPE
    delivery_mode: int = DELIVERY_MODE_PERSISTENT


@dataclass(frozen=True, slots=True)
class FrameRoute:
    """Where one session's frames go in one direction, its names checked once.

    ``headers`` are the three ``octo-*`` headers every frame of the session
    carries; ``reply_to`` is the host reply queue a host publish names (None
    on a reply). Built by :func:`build_host_publish` and
    :func:`build_worker_reply` (remembered for the most recent routes, so a
    session's names are validated once, not per frame); :meth:`envelope`
    checks only what changes per frame.
    """

    routing_key: str
    reply_to: str | None
    headers: Mapping[str, str]

    def envelope(self, body: bytes, correlation_id: str | None) -> FrameEnvelope:
        """The publish of ``body``: its size and the correlation id checked, its message id."""
        body = _check_body(body)
        return FrameEnvelope(
            body=body,
            message_id=frame_message_id(body),
            correlation_id=_check_correlation_id(correlation_id),
            reply_to=self.reply_to,
            headers=self.headers,
            routing_key=self.routing_key,
        )


# Routes are a few hundred bytes; this many covers every live session of a busy
# process, and one that falls out is only validated again.
_ROUTES_KEPT: Final = 4096


def _frame_headers(scope: str, session_id: str, key_nonce: bytes) -> Mapping[str, str]:
    validate_token("tenant scope", scope)
    validate_token("session id", session_id)
    validate_key_nonce(key_nonce)
    return MappingProxyType(
        {
            HEADER_SCOPE: scope,
            HEADER_SESSION: session_id,
            HEADER_KEY_NONCE: bytes(key_nonce).hex(),
        }
    )


def _check_body(body: bytes) -> bytes:
    if not isinstance(body, bytes):
        raise TypeError("a frame body is bytes")
    if len(body) > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(len(body), MAX_WIRE_FRAME_BYTES)
    return body


def _check_correlation_id(correlation_id: str | None) -> str | None:
    # The request id (or cancellation id) of the message: token syntax.
    if correlation_id is not None:
        validate_token("request id", correlation_id)
    return correlation_id


def _hashable_nonce(key_nonce: bytes) -> bytes:
    """The nonce as ``bytes`` (a route is remembered by it); anything else but a
    32-byte ``bytearray`` raises ``InvalidKeyNonce``."""
    if type(key_nonce) is not bytes:
        validate_key_nonce(key_nonce)
        return bytes(key_nonce)
    return key_nonce


def _remembered(
    route: Callable[[str, str, bytes, str], FrameRoute],
    scope: str,
    session_id: str,
    key_nonce: bytes,
    reply_to: str,
) -> FrameRoute:
    """The remembered route of exact strings; any other argument is checked uncached,
    so it fails with the error its check names (never an unhashable-type error)."""
    if type(scope) is str and type(session_id) is str and type(reply_to) is str:
        return route(scope, session_id, key_nonce, reply_to)
    unwrapped: Callable[[str, str, bytes, str], FrameRoute] = route.__wrapped__  # type: ignore[attr-defined]
    return unwrapped(scope, session_id, key_nonce, reply_to)


@functools.lru_cache(maxsize=_ROUTES_KEPT)
def _host_route(scope: str, session_id: str, key_nonce: bytes, reply_to: str) -> FrameRoute:
    headers = _frame_headers(scope, session_id, key_nonce)
    if host_id_of_reply_queue(reply_to) is None:
        raise ValueError("reply_to must be a host reply queue (octo.v5.reply.<host-id>)")
    return FrameRoute(routing_key=worker_queue(scope), reply_to=reply_to, headers=headers)


@functools.lru_cache(maxsize=_ROUTES_KEPT)
def _reply_route(scope: str, session_id: str, key_nonce: bytes, reply_to: str) -> FrameRoute:
    headers = _frame_headers(scope, session_id, key_nonce)
    if host_id_of_reply_queue(reply_to) is None:
        raise ValueError("a reply is routed to a host reply queue (octo.v5.reply.<host-id>)")
    return FrameRoute(routing_key=reply_to, reply_to=None, headers=headers)


def build_host_publish(
    scope: str,
    session_id: str,
    key_nonce: bytes,
    body: bytes,
    *,
    reply_to: str,
    correlation_id: str | None,
) -> FrameEnvelope:
    """The publish of a host→worker frame.

    Routed to ``octo.v5.worker.<scope>`` through ``octo.v5``; ``reply_to``
    must be a host reply queue (:func:`reply_queue`); ``correlation_id`` is
    the request id, None for ``open_session`` and ``close_session``.
    """
    route = _remembered(_host_route, scope, session_id, _hashable_nonce(key_nonce), reply_to)
    return route.envelope(body, correlation_id)


def build_worker_reply(
    scope: str,
    session_id: str,
    key_nonce: bytes,
    body: bytes,
    *,
    reply_to: str,
    correlation_id: str | None,
) -> FrameEnvelope:
    """The publish of a worker→host reply.

    ``reply_to`` is the reply queue recorded from the session's accepted
    ``open_session`` delivery; it becomes the routing key. A reply carries no
    ``reply_to`` of its own.
    """
    route = _remembered(_reply_route, scope, session_id, _hashable_nonce(key_nonce), reply_to)
    return route.envelope(body, correlation_id)


def build_dead_letter_headers(
    headers: Mapping[str, object] | None, reason: str
) -> dict[str, object]:
    """The headers of a dead-letter copy: the delivery's own plus ``octo-reason``.

    ``reason`` is the error code that dead-lettered the frame; it
    replaces any ``octo-reason`` the delivery already carried.
    """
    if not (isinstance(reason, str) and _REASON.fullmatch(reason)):
        raise ValueError("a dead-letter reason is an error code ([a-z][a-z0-9_]{0,63})")
    copied: dict[str, object] = {
        str(name): _encodable(value) for name, value in (headers or {}).items()
    }
    copied[HEADER_REASON] = reason
    return copied


def _encodable(value: object) -> object:
    """A received header value in a form the AMQP encoder accepts again.

    pamqp decodes a long string that is not UTF-8 as ``bytes`` but cannot
    encode ``bytes``; a copy of such a delivery would otherwise fail to
    publish at all. Those become byte arrays, in nested tables and arrays too.
    """
    if isinstance(value, bytes | memoryview):
        return bytearray(value)
    if isinstance(value, dict):
        return {str(name): _encodable(item) for name, item in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(item) for item in value]
    return value


# Receiving --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeliveryHeaders:
    """The validated ``octo-session`` and ``octo-key-nonce`` of a delivery."""

    session_id: str
    key_nonce: bytes


def check_delivery(
    scope: str, body_len: int, headers: Mapping[str, object] | None
) -> DeliveryHeaders:
    """The first two checks of a delivery on the queue of scope ``scope``, in order.

    1. ``body_len`` over 1 MiB raises ``WireFrameTooLarge``;
    2. ``octo-scope`` absent or different from ``scope`` raises
       ``ScopeMismatch``; ``octo-session`` not a token or ``octo-key-nonce``
       not 64 lowercase hex raises ``InvalidFrameHeaders``.

    Each error's ``code`` is the dead-letter reason. Header values may be
    ``str`` or ``bytes``; any other type is malformed.
    """
    if body_len > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(body_len, MAX_WIRE_FRAME_BYTES)
    found = headers or {}
    if header_text(found.get(HEADER_SCOPE)) != scope:
        raise ScopeMismatch()
    session_id = delivery_session_id(found)
    if session_id is None:
        raise InvalidFrameHeaders()
    key_nonce = delivery_key_nonce(found)
    if key_nonce is None:
        raise InvalidFrameHeaders()
    return DeliveryHeaders(session_id=session_id, key_nonce=key_nonce)


def delivery_session_id(headers: Mapping[str, object]) -> str | None:
    """The ``octo-session`` header when it is a token, else None (invalid headers)."""
    session_id = header_text(headers.get(HEADER_SESSION))
    return session_id if session_id is not None and is_token(session_id) else None


def delivery_key_nonce(headers: Mapping[str, object]) -> bytes | None:
    """The raw ``octo-key-nonce`` when the header is 64 lowercase hex, else None."""
    nonce_text = header_text(headers.get(HEADER_KEY_NONCE))
    if nonce_text is None:
        return None
    try:
        return parse_key_nonce_hex(nonce_text)
    except InvalidKeyNonce:
        return None
