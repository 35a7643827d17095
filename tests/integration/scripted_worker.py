"""A scripted worker for the host client's tests: the worker end of a scope's queue.

The test consumes the scope's worker queue itself on the real broker, opens
each session with a WORKER-role ``SessionAuthenticator`` derived from the
scope key, and seals exactly the replies it is told to send, in the order a
real worker may send them (late, repeated, refused). The ``scripted``
fixture of ``conftest.py`` starts one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.messages import (
    CloseSession,
    CompensateOperation,
    CompensationReconcileResult,
    CompensationResult,
    DispatchOperation,
    OpenSession,
    OperationCompensationResult,
    OperationReconcileResult,
    OperationResult,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    WorkerMessage,
    message_type,
)
from octo_common.payload import ToolPayload
from octo_common.runtime.broker import publish_envelope
from octo_common.states import OperationStatus, StateKind, Succeeded
from octo_common.transport import (
    EXCHANGE,
    HEADER_KEY_NONCE,
    HEADER_SESSION,
    build_worker_reply,
    worker_queue,
)
from octo_host.client import HostRun

from .conftest import WAIT, header

OUTPUT = ToolPayload.json({"name": "notes.txt"})


@dataclass
class Received:
    """One request the scripted worker opened, with what it needs to answer it."""

    session_id: str
    nonce: bytes
    reply_to: str
    auth: SessionAuthenticator
    message: WorkerMessage

    @property
    def type(self) -> str:
        return message_type(self.message)

    @property
    def request(self) -> Any:
        return self.message.request  # type: ignore[union-attr]


class ScriptedWorker:
    """The worker end of the scope's queue, answering only what the test says.

    Every delivery is acked on arrival; ``open_session`` creates the worker
    authenticator of its session, every other request is queued for
    :meth:`next`, unless :meth:`answer_all` set an automatic answer.
    """

    def __init__(self, channel: AbstractChannel, scope: str, scope_key: ScopeKey) -> None:
        self.channel, self.scope, self.scope_key = channel, scope, scope_key
        self._auth: dict[str, SessionAuthenticator] = {}
        self._requests: asyncio.Queue[Received] = asyncio.Queue()
        self._auto: Callable[[Received], WorkerMessage] | None = None

    async def start(self, broker: AbstractConnection) -> None:
        consume = await broker.channel()
        exchange = await consume.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        name = worker_queue(self.scope)
        queue = await consume.declare_queue(
            name,
            durable=True,
            arguments={"x-queue-type": "quorum", "x-single-active-consumer": True},
        )
        await queue.bind(exchange, routing_key=name)
        await queue.consume(self._on_message)

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        await message.ack()
        session_id = header(message, HEADER_SESSION)
        nonce_hex = header(message, HEADER_KEY_NONCE)
        assert session_id is not None and nonce_hex is not None and message.reply_to
        nonce = bytes.fromhex(nonce_hex)
        auth = self._auth.get(session_id)
        if auth is None:
            key = SessionKey.derive(self.scope_key, self.scope, session_id, nonce)
            auth = self._auth[session_id] = SessionAuthenticator(
                session_id, key, SessionRole.WORKER
            )
        opened = auth.open(message.body)
        if isinstance(opened, OpenSession) and opened.payload_codec is not None:
            auth.use_payload_codec()  # every later frame, both ways, is an envelope
        if isinstance(opened, OpenSession | CloseSession):
            return
        received = Received(session_id, nonce, message.reply_to, auth, opened)
        if self._auto is not None:
            await self.reply(received, self._auto(received))
        else:
            self._requests.put_nowait(received)

    async def next(self, kind: str) -> Received:
        received = await asyncio.wait_for(self._requests.get(), WAIT)
        assert received.type == kind
        return received

    def answer_all(self, answer: Callable[[Received], WorkerMessage] | None) -> None:
        """From now on answer every request at once with ``answer`` (None: queue them)."""
        self._auto = answer

    async def reply(
        self, received: Received, answer: WorkerMessage, correlation_id: str | None = None
    ) -> None:
        """Seal and publish ``answer``; under ``correlation_id`` when given (a forgery)."""
        body = received.auth.seal(answer)
        envelope = build_worker_reply(
            self.scope,
            received.session_id,
            received.nonce,
            body,
            reply_to=received.reply_to,
            correlation_id=correlation_id or received.request.request_id,
        )
        await publish_envelope(self.channel, envelope, timeout=WAIT)


def outcome(received: Received, status: OperationStatus) -> WorkerMessage:
    """The worker's answer to ``received`` with ``status``, in the request's message type."""
    request = received.request
    if isinstance(received.message, ReconcileCompensation):
        return ReconciledCompensation(
            CompensationReconcileResult(
                request.session_id,
                request.request_id,
                request.tool,
                request.operation_key,
                request.compensation_key,
                request.tenant_scope,
                request.grant_fingerprint,
                status,
            )
        )
    if isinstance(received.message, CompensateOperation):
        return CompensationResult(
            OperationCompensationResult(
                request.session_id, request.request_id, request.binding, status
            )
        )
    result = OperationReconcileResult(
        request.session_id, request.request_id, request.tool, request.operation_key, status
    )
    if isinstance(received.message, ReconcileOperation):
        return ReconciledOperation(result)
    assert isinstance(received.message, DispatchOperation)
    return OperationResult(result)


def refusal(received: Received, code: str) -> RequestRejected:
    request = received.request
    return RequestRejected(
        request.session_id,
        request.request_id,
        code,
        request.operation_key,
        getattr(request, "compensation_key", None),
    )


def succeeded(received: Received) -> WorkerMessage:
    return outcome(received, Succeeded(OUTPUT))


async def until(condition: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.02)


def compensation_state(run: HostRun, key: str) -> StateKind | None:
    operation = run.operation(key)
    assert operation is not None
    return None if operation.compensation is None else operation.compensation.state
