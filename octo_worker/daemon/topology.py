"""RabbitMQ topology and the worker's connection helpers.

Owns: declaring the topology idempotently (:func:`declare_topology`),
the broker policy that gives worker queues their delivery limit and
dead-letter exchange (:func:`apply_policy`), the policy that bounds the
dead-letter queue (:func:`apply_dead_letter_policy`), the read-only view behind
``topology show`` (:func:`describe_topology`), and the worker's
:func:`connect` (a plain, non-robust aio-pika connection) and
:func:`open_confirm_channel`. The confirmed publish itself is
:func:`octo_common.runtime.broker.publish_confirmed`, shared with the host.

It must never: use ``connect_robust`` (its silent restore and hanging
publishes hide exactly the failures the protocol must see: the caller owns
reconnection), decide anything about frames (that is
:mod:`octo_common.transport` and the session), or log or echo credentials
and frame bodies.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Final

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from pamqp.common import FieldTable

from octo_common.errors import OctoError
from octo_common.runtime import amqp
from octo_common.runtime.tls import tls_refusal
from octo_common.transport import (
    DEAD_EXCHANGE,
    DEAD_LOG_ARGUMENTS,
    DEAD_LOG_STREAM,
    DEAD_OVERFLOW,
    DEAD_POLICY_NAME,
    DEAD_QUEUE,
    DEFAULT_DEAD_MAX_BYTES,
    DEFAULT_DEAD_MAX_LENGTH,
    DEFAULT_DELIVERY_LIMIT,
    EXCHANGE,
    WORKER_POLICY_NAME,
    WORKER_POLICY_PATTERN,
    reply_queue,
    worker_queue,
)

__all__ = [
    "POLICY_PRIORITY",
    "QueueStatus",
    "TopologyError",
    "TopologyReport",
    "apply_dead_letter_policy",
    "apply_policy",
    "connect",
    "connect_link",
    "declare_queues",
    "declare_topology",
    "describe_queues",
    "dead_letter_policy_definition",
    "describe_topology",
    "open_confirm_channel",
    "policy_definition",
]

# Only one policy applies to a queue (the highest priority wins); ours sits
# above the priority-0 catch-all policies operators commonly keep.
POLICY_PRIORITY: Final = 10

_QUORUM: Final[FieldTable] = {"x-queue-type": "quorum"}
# Single-active-consumer is a queue argument only: no policy can set it.
_WORKER_QUEUE_ARGUMENTS: Final[FieldTable] = {
    "x-queue-type": "quorum",
    "x-single-active-consumer": True,
}


class TopologyError(OctoError):
    """The broker topology or its policy could not be declared or applied.

    ``reason`` names what failed; it never contains credentials.
    """

    _fields: ClassVar[tuple[str, ...]] = ("reason",)
    _text = "broker topology error"
    reason: str


@dataclass(frozen=True, slots=True)
class TopologyReport:
    """What :func:`declare_topology` declared, and how the two policies were applied."""

    queues: tuple[str, ...]
    policy_applied_via: str | None
    dead_letter_policy_applied_via: str | None = None


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """One queue as a passive declare sees it (``topology show``)."""

    name: str
    exists: bool
    messages: int | None
    consumers: int | None


# Connections and channels -----------------------------------------------------------


async def connect(
    url: str,
    *,
    timeout: float = 10.0,
    name: str | None = None,
    heartbeat: int | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> AbstractConnection:
    """Open a plain (non-robust) aio-pika connection.

    A lost connection is final: ``connection.closed()`` resolves and every
    channel on it fails, so in-flight deliveries are never acked on a stale
    channel. The caller's own loop reconnects, re-declares, re-consumes and
    lets the broker redeliver whatever was not acked. ``heartbeat``
    (seconds) is what the client proposes: a peer silent that long is gone,
    so a paused worker loses its queue to a standby after about that long.
    """
    properties: FieldTable | None = {"connection_name": name} if name else None
    try:
        if heartbeat is None:
            return await aio_pika.connect(
                url, timeout=timeout, client_properties=properties, ssl_context=ssl_context
            )
        return await aio_pika.connect(
            url,
            timeout=timeout,
            client_properties=properties,
            heartbeat=heartbeat,
            ssl_context=ssl_context,
        )
    except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as error:
        raise _cannot_connect(error, await tls_refusal(url, ssl_context, timeout, error)) from None


def _cannot_connect(error: BaseException, tls: str | None) -> TopologyError:
    """The failure's class, or its TLS cause (``tls_refusal``); never the URL (it
    may hold a password)."""
    if tls is not None:
        return TopologyError(f"cannot connect to the broker: {tls}")
    return TopologyError(f"cannot connect to the broker ({type(error).__name__})")


async def open_confirm_channel(
    connection: AbstractConnection, *, prefetch_count: int | None = None
) -> AbstractChannel:
    """A channel in confirm mode whose mandatory publishes raise when returned."""
    channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
    if prefetch_count is not None:
        await channel.set_qos(prefetch_count=prefetch_count)
    return channel


async def connect_link(
    url: str,
    *,
    timeout: float = 10.0,
    name: str | None = None,
    heartbeat: int | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> amqp.Connection:
    """The daemon's connection on the lean client (the hot path): plain, its loss
    final, as :func:`connect`. A URL the lean client does not take (query
    parameters) or a failure raises ``TopologyError`` naming the failure's
    class only."""
    try:
        return await amqp.connect(
            url, timeout=timeout, name=name, heartbeat=heartbeat, ssl_context=ssl_context
        )
    except (ValueError, TimeoutError, OSError, amqp.AmqpError) as error:
        raise _cannot_connect(error, await tls_refusal(url, ssl_context, timeout, error)) from None


# Declaration ------------------------------------------------------------------------


async def declare_topology(
    channel: AbstractChannel,
    scopes: Iterable[str],
    *,
    host_ids: Iterable[str] = (),
    delivery_limit: int | None = DEFAULT_DELIVERY_LIMIT,
    dead_letter_max_length: int = DEFAULT_DEAD_MAX_LENGTH,
    dead_letter_max_bytes: int = DEFAULT_DEAD_MAX_BYTES,
    vhost: str = "/",
    management_url: str | None = None,
) -> TopologyReport:
    """Declare the topology (docs/protocol.md, "Frames on RabbitMQ"); safe to run again.

    * exchange ``octo.v5`` (durable, direct);
    * per scope, quorum queue ``octo.v5.worker.<scope>`` with
      single-active-consumer, bound to ``octo.v5`` with its own name;
    * per host id, quorum queue ``octo.v5.reply.<id>`` bound the same way;
    * exchange ``octo.v5.dead`` (durable, fanout) bound to quorum queue
      ``octo.v5.dead``.

    Worker queues get no delivery-limit or dead-letter arguments: unless
    ``delivery_limit`` is None, the broker policy of :func:`apply_policy`
    sets both, and the policy of :func:`apply_dead_letter_policy` bounds
    ``octo.v5.dead`` (both are applied first, so no queue exists without
    its policy). A queue that already exists with other arguments raises
    ``TopologyError``. A daemon whose deploy tooling already set the
    policies (or that cannot run ``rabbitmqctl``) passes
    ``delivery_limit=None``, which applies neither.
    """
    names_scopes = [worker_queue(scope) for scope in scopes]
    names_hosts = [reply_queue(host_id) for host_id in host_ids]
    applied_via: str | None = None
    dead_applied_via: str | None = None
    if delivery_limit is not None:
        dead_definition = dead_letter_policy_definition(
            dead_letter_max_length, dead_letter_max_bytes
        )
        applied_via = await asyncio.to_thread(
            apply_policy, delivery_limit, vhost=vhost, management_url=management_url
        )
        dead_applied_via = await asyncio.to_thread(
            _apply_named_policy,
            DEAD_POLICY_NAME,
            _exact_name_pattern(DEAD_QUEUE),
            dead_definition,
            vhost=vhost,
            management_url=management_url,
        )
    try:
        exchange = await channel.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        dead_exchange = await channel.declare_exchange(
            DEAD_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
        )
        dead_queue = await channel.declare_queue(DEAD_QUEUE, durable=True, arguments=_QUORUM)
        await dead_queue.bind(dead_exchange, routing_key="")
        dead_log = await channel.declare_queue(
            DEAD_LOG_STREAM, durable=True, arguments=dict(DEAD_LOG_ARGUMENTS)
        )
        await dead_log.bind(dead_exchange, routing_key="")
        for name in names_scopes:
            queue = await channel.declare_queue(
                name, durable=True, arguments=dict(_WORKER_QUEUE_ARGUMENTS)
            )
            await queue.bind(exchange, routing_key=name)
        for name in names_hosts:
            queue = await channel.declare_queue(name, durable=True, arguments=dict(_QUORUM))
            await queue.bind(exchange, routing_key=name)
    except aiormq.exceptions.ChannelPreconditionFailed as error:
        raise TopologyError(
            f"an existing queue or exchange differs: {_reply_text(error)}"
        ) from None
    except aiormq.exceptions.AMQPError as error:
        raise TopologyError(f"declaration failed ({type(error).__name__})") from None
    return TopologyReport(
        queues=(DEAD_QUEUE, DEAD_LOG_STREAM, *names_scopes, *names_hosts),
        policy_applied_via=applied_via,
        dead_letter_policy_applied_via=dead_applied_via,
    )


async def declare_queues(channel: amqp.Channel, scopes: Iterable[str]) -> tuple[str, ...]:
    """:func:`declare_topology` with ``delivery_limit=None`` on the lean client
    (the daemon's own set-up): the exchanges, ``octo.v5.dead``, the
    dead-letter log stream and each scope's worker queue, bound; no policy.
    Returns the queue names."""
    names = [worker_queue(scope) for scope in scopes]
    try:
        await channel.declare_exchange(EXCHANGE, "direct", durable=True)
        await channel.declare_exchange(DEAD_EXCHANGE, "fanout", durable=True)
        await channel.declare_queue(DEAD_QUEUE, durable=True, arguments=_QUORUM)
        await channel.bind_queue(DEAD_QUEUE, DEAD_EXCHANGE, "")
        await channel.declare_queue(DEAD_LOG_STREAM, durable=True, arguments=DEAD_LOG_ARGUMENTS)
        await channel.bind_queue(DEAD_LOG_STREAM, DEAD_EXCHANGE, "")
        for name in names:
            await channel.declare_queue(name, durable=True, arguments=_WORKER_QUEUE_ARGUMENTS)
            await channel.bind_queue(name, EXCHANGE, name)
    except amqp.ChannelClosed as error:
        if error.reply_code == 406:  # PRECONDITION_FAILED
            raise TopologyError(
                f"an existing queue or exchange differs: {error.reply_text[:300]}"
            ) from None
        raise TopologyError(f"declaration failed ({type(error).__name__})") from None
    except amqp.AmqpError as error:
        raise TopologyError(f"declaration failed ({type(error).__name__})") from None
    return (DEAD_QUEUE, DEAD_LOG_STREAM, *names)


async def describe_queues(connection: amqp.Connection, scopes: Iterable[str]) -> list[QueueStatus]:
    """:func:`describe_topology` of the scopes' worker queues and ``octo.v5.dead``
    on the lean client: passive declares on channels of their own (the broker
    closes the channel of a missing queue), closed after."""
    statuses: list[QueueStatus] = []
    channel: amqp.Channel | None = None
    try:
        for name in [*(worker_queue(s) for s in scopes), DEAD_QUEUE]:
            if channel is None or channel.is_closed:
                channel = await connection.channel()
            try:
                result = await channel.declare_queue(name, passive=True)
            except amqp.ChannelClosed as error:
                if error.reply_code != 404:  # NOT_FOUND
                    raise
                statuses.append(QueueStatus(name, exists=False, messages=None, consumers=None))
                continue
            statuses.append(
                QueueStatus(
                    name,
                    exists=True,
                    messages=int(result.message_count or 0),
                    consumers=int(result.consumer_count or 0),
                )
            )
    finally:
        if channel is not None and not channel.is_closed:
            await channel.close()
    return statuses


def _reply_text(error: BaseException) -> str:
    # The broker's own text names the entity and argument; it carries no secret.
    text = str(error.args[0]) if error.args else type(error).__name__
    return text[:300]


async def describe_topology(
    channel: AbstractChannel, scopes: Iterable[str], *, host_ids: Iterable[str] = ()
) -> list[QueueStatus]:
    """Message and consumer counts of the scopes' worker queues, the host
    reply queues and ``octo.v5.dead``, by passive declare (changes nothing).

    A missing queue is reported with ``exists=False``; the broker closes the
    channel for it, and this reopens it so the next queue can be asked.
    """
    names = [worker_queue(s) for s in scopes] + [reply_queue(h) for h in host_ids]
    statuses: list[QueueStatus] = []
    for name in [*names, DEAD_QUEUE]:
        try:
            queue = await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            await channel.reopen()
            statuses.append(QueueStatus(name, exists=False, messages=None, consumers=None))
            continue
        result = queue.declaration_result
        statuses.append(
            QueueStatus(
                name,
                exists=True,
                messages=int(result.message_count or 0),
                consumers=int(result.consumer_count or 0),
            )
        )
    return statuses


# Policy -----------------------------------------------------------------------------


def policy_definition(delivery_limit: int = DEFAULT_DELIVERY_LIMIT) -> dict[str, object]:
    """The worker-queue policy: delivery limit and dead-letter exchange."""
    if isinstance(delivery_limit, bool) or not isinstance(delivery_limit, int):
        raise TopologyError("delivery limit must be an integer")
    if not 1 <= delivery_limit <= 2**31 - 1:
        raise TopologyError("delivery limit must be between 1 and 2^31-1")
    return {"delivery-limit": delivery_limit, "dead-letter-exchange": DEAD_EXCHANGE}


def dead_letter_policy_definition(
    max_length: int = DEFAULT_DEAD_MAX_LENGTH, max_bytes: int = DEFAULT_DEAD_MAX_BYTES
) -> dict[str, object]:
    """The dead-letter queue policy: at most ``max_length`` letters and
    ``max_bytes`` body bytes; past either bound the oldest letters are dropped."""
    for name, value in (("max length", max_length), ("max bytes", max_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TopologyError(f"dead-letter {name} must be an integer")
        if not 1 <= value <= 2**63 - 1:
            raise TopologyError(f"dead-letter {name} must be between 1 and 2^63-1")
    return {"max-length": max_length, "max-length-bytes": max_bytes, "overflow": DEAD_OVERFLOW}


def _exact_name_pattern(queue: str) -> str:
    """A policy pattern matching exactly one queue name."""
    return "^" + re.escape(queue) + "$"


def apply_policy(
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT,
    *,
    vhost: str = "/",
    management_url: str | None = None,
    rabbitmqctl: str = "rabbitmqctl",
    timeout: float = 30.0,
) -> str:
    """Set the broker policy ``octo-v5-worker`` on ``^octo\\.v5\\.worker\\.``.

    Tries the management HTTP API first when ``management_url`` is given
    (``http://user:pass@host:15672``), then ``rabbitmqctl set_policy`` (the
    daemon host runs the broker locally in our deployments). Returns
    ``"management_api"`` or ``"rabbitmqctl"``; raises ``TopologyError`` when
    neither works. Blocking: async callers run it in a thread.
    """
    return _apply_named_policy(
        WORKER_POLICY_NAME,
        WORKER_POLICY_PATTERN,
        policy_definition(delivery_limit),
        vhost=vhost,
        management_url=management_url,
        rabbitmqctl=rabbitmqctl,
        timeout=timeout,
    )


def apply_dead_letter_policy(
    max_length: int = DEFAULT_DEAD_MAX_LENGTH,
    max_bytes: int = DEFAULT_DEAD_MAX_BYTES,
    *,
    queue: str = DEAD_QUEUE,
    policy_name: str = DEAD_POLICY_NAME,
    vhost: str = "/",
    management_url: str | None = None,
    rabbitmqctl: str = "rabbitmqctl",
    timeout: float = 30.0,
) -> str:
    """Bound the dead-letter queue by policy (``octo-v5-dead`` on ``^octo\\.v5\\.dead$``).

    ``queue`` and ``policy_name`` name another queue and policy only for
    tests. Same mechanisms, return value and errors as :func:`apply_policy`.
    """
    return _apply_named_policy(
        policy_name,
        _exact_name_pattern(queue),
        dead_letter_policy_definition(max_length, max_bytes),
        vhost=vhost,
        management_url=management_url,
        rabbitmqctl=rabbitmqctl,
        timeout=timeout,
    )


def _apply_named_policy(
    name: str,
    pattern: str,
    definition: dict[str, object],
    *,
    vhost: str = "/",
    management_url: str | None = None,
    rabbitmqctl: str = "rabbitmqctl",
    timeout: float = 30.0,
) -> str:
    failures: list[str] = []
    if management_url is not None:
        try:
            _apply_policy_http(management_url, vhost, name, pattern, definition, timeout)
        except TopologyError as error:
            failures.append(f"management api: {error.reason}")
        else:
            return "management_api"
    try:
        _apply_policy_rabbitmqctl(rabbitmqctl, vhost, name, pattern, definition, timeout)
    except TopologyError as error:
        failures.append(f"rabbitmqctl: {error.reason}")
    else:
        return "rabbitmqctl"
    raise TopologyError(f"cannot set the policy {name}; " + "; ".join(failures))


def _apply_policy_rabbitmqctl(
    executable: str,
    vhost: str,
    name: str,
    pattern: str,
    definition: dict[str, object],
    timeout: float,
) -> None:
    path = shutil.which(executable)
    if path is None:
        raise TopologyError(f"{executable!r} not found")
    argv = [
        path,
        "set_policy",
        "-p",
        vhost,
        "--apply-to",
        "queues",
        "--priority",
        str(POLICY_PRIORITY),
        name,
        pattern,
        json.dumps(definition, separators=(",", ":")),
    ]
    try:
        # argv list, no shell; the executable comes from the operator's config.
        done = subprocess.run(  # noqa: S603
            argv, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TopologyError(f"rabbitmqctl did not run ({type(error).__name__})") from None
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [""]
        raise TopologyError(f"exit status {done.returncode}: {last[0][:200]}")


def _apply_policy_http(
    management_url: str,
    vhost: str,
    name: str,
    pattern: str,
    definition: dict[str, object],
    timeout: float,
) -> None:
    parts = urllib.parse.urlsplit(management_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TopologyError("management url must be http(s)://[user:pass@]host[:port]")
    netloc = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    url = (
        f"{base}/api/policies/{urllib.parse.quote(vhost, safe='')}/"
        f"{urllib.parse.quote(name, safe='')}"
    )
    body = json.dumps(
        {
            "pattern": pattern,
            "definition": definition,
            "apply-to": "queues",
            "priority": POLICY_PRIORITY,
        }
    ).encode()
    request = urllib.request.Request(url, data=body, method="PUT")  # noqa: S310 - scheme checked
    request.add_header("content-type", "application/json")
    user = urllib.parse.unquote(parts.username or "guest")
    password = urllib.parse.unquote(parts.password or "guest")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request.add_header("authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            status = response.status
    except urllib.error.HTTPError as error:
        raise TopologyError(f"HTTP {error.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as error:
        raise TopologyError(f"unreachable ({type(error).__name__})") from None
    if status not in (200, 201, 204):
        raise TopologyError(f"HTTP {status}")
