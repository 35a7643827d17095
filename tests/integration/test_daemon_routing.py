"""The daemon's delivery routing (session lookup and open) with a real SQLite
journal and the real ``files.publish`` adapter, without a broker.

Deliveries are fed straight to the daemon's per-message handler with stand-in
messages; dead letters and replies are recorded instead of published. This
makes the interleavings at the handler's await points deterministic: a store
gate holds one session's open in its commit while others arrive.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import DispatchOperation, OpenSession, OperationDispatchRequest
from octo_common.payload import ToolPayload
from octo_common.transport import (
    HEADER_KEY_NONCE,
    HEADER_SCOPE,
    HEADER_SESSION,
    frame_message_id,
    reply_queue,
    worker_queue,
)
from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon

TOOL = "files.publish"
GRANT = CapabilityGrant(TOOL, "json", max_calls=8, max_compensations=1)
SCOPE = "t-routing"
HOST_ID = "t-routing-host"
WAIT = 5.0


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)
    path.chmod(0o600)


@dataclass
class FakeChannel:
    is_closed: bool = False


@dataclass
class FakeMessage:
    """What the daemon reads of an ``AbstractIncomingMessage``."""

    body: bytes
    headers: dict[str, Any]
    reply_to: str | None
    correlation_id: str | None = None
    routing_key: str = worker_queue(SCOPE)
    settled: list[str] = field(default_factory=list)

    @property
    def message_id(self) -> str:
        return frame_message_id(self.body)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append("requeue" if requeue else "reject")

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        assert not multiple and requeue
        self.settled.append("handed_back")


@dataclass
class Session:
    session_id: str
    nonce: bytes
    auth: SessionAuthenticator


class Routing:
    """A started daemon (store and scope loaded, no broker) and what it sent."""

    def __init__(self, daemon: WorkerDaemon, scope_key: ScopeKey) -> None:
        self.daemon = daemon
        self.scope_key = scope_key
        self.dead: list[tuple[str, str]] = []  # (session id, reason)
        self.replies: list[tuple[str, str | None]] = []  # (session id, correlation id)
        self.channel = FakeChannel()
        daemon._broker.publisher.dead_letter = self._dead_letter  # type: ignore[method-assign]
        daemon._broker.publisher.publish = self._publish  # type: ignore[method-assign]

    async def _dead_letter(self, scope: Any, message: Any, channel: Any, reason: str) -> None:
        self.dead.append((message.headers[HEADER_SESSION], reason))
        await message.ack()

    async def _publish(self, envelope: Any) -> None:
        self.replies.append((envelope.routing_key, envelope.correlation_id))

    def session(self, index: int) -> Session:
        session_id = f"s-{index}-{secrets.token_hex(4)}"
        nonce = secrets.token_bytes(32)
        key = SessionKey.derive(self.scope_key, SCOPE, session_id, nonce)
        return Session(session_id, nonce, SessionAuthenticator(session_id, key, SessionRole.HOST))

    def message(self, session: Session, body: bytes, correlation_id: str | None) -> FakeMessage:
        headers = {
            HEADER_SCOPE: SCOPE,
            HEADER_SESSION: session.session_id,
            HEADER_KEY_NONCE: session.nonce.hex(),
        }
        return FakeMessage(body, headers, reply_queue(HOST_ID), correlation_id)

    def open_message(self, session: Session) -> FakeMessage:
        manifest = CapabilityManifest(session.session_id, [GRANT])
        return self.message(
            session, session.auth.seal(OpenSession(manifest, reply_to=reply_queue(HOST_ID))), None
        )

    def dispatch_message(self, session: Session, request_id: str) -> FakeMessage:
        payload = ToolPayload.json({"name": f"{session.session_id}.txt", "content": "hello"})
        request = OperationDispatchRequest(
            session.session_id, request_id, TOOL, "op-" + secrets.token_hex(8), payload
        )
        return self.message(session, session.auth.seal(DispatchOperation(request)), request_id)

    def deliver(self, message: FakeMessage) -> asyncio.Task[None]:
        """What the consumer callback does: one handler task per delivery, in order."""
        scope = self.daemon._scopes[SCOPE]
        return asyncio.ensure_future(self.daemon._path().on_message(scope, message, self.channel))  # type: ignore[arg-type]

    def gate_commits(self, held: Callable[[Any], bool]) -> asyncio.Event:
        """Hold every journal commit ``held(changes)`` selects until the event is set."""
        store = self.daemon.store
        real_commit: Callable[..., Awaitable[int]] = store.commit
        gate = asyncio.Event()

        async def commit(scope: str, lease: Any, changes: Any) -> int:
            if held(changes):
                await gate.wait()
            return await real_commit(scope, lease, changes)

        store.commit = commit  # type: ignore[method-assign]
        # A held commit must not be overtaken by one chained on it.
        store.chains_session_commits = False
        return gate


@pytest.fixture
async def routing(tmp_path: Path) -> AsyncIterator[Routing]:
    scope_key = secrets.token_bytes(32)
    base = tmp_path / "worker"
    _write_private(base / "keys" / "scope.key", scope_key)
    _write_private(base / "keys" / "storage.key", secrets.token_bytes(32).hex().encode())
    config_path = base / "worker.toml"
    config_path.write_text(
        f"""
[worker]
state_dir = "state"
log_level = "warning"

[broker]
url = "amqp://127.0.0.1:5672/"

[storage]
journal = "journal.sqlite3"
key = {{ id = "worker-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{SCOPE}"
key_file = "keys/scope.key"
max_concurrency = 16

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
""",
        encoding="utf-8",
    )
    daemon = WorkerDaemon(load_config(config_path))
    await daemon._start()
    try:
        yield Routing(daemon, ScopeKey.from_bytes(scope_key))
    finally:
        await daemon.store.close()


def _opens(changes: Any) -> set[str]:
    return {sid for sid, docs in changes.sessions.items() if docs.opening is not None}


async def _settle(tasks: list[asyncio.Task[None]]) -> None:
    done, pending = await asyncio.wait(tasks, timeout=WAIT)
    assert not pending, "a delivery never settled"
    for task in done:
        task.result()


async def test_a_frame_right_behind_its_open_waits_for_it_while_another_open_holds_the_scope(
    routing: Routing,
) -> None:
    # Session rotation: another session's open is in its commit when a new
    # session's open_session and its first frame arrive back to back.
    other, fresh = routing.session(1), routing.session(2)
    gate = routing.gate_commits(lambda changes: other.session_id in _opens(changes))
    tasks = [routing.deliver(routing.open_message(other))]
    for _ in range(5):
        await asyncio.sleep(0)
    open_fresh = routing.open_message(fresh)
    first_frame = routing.dispatch_message(fresh, "req-1")
    tasks += [routing.deliver(open_fresh), routing.deliver(first_frame)]
    for _ in range(20):
        await asyncio.sleep(0)
    gate.set()
    await _settle(tasks)

    assert routing.dead == []
    assert open_fresh.settled == ["ack"]
    assert first_frame.settled == ["ack"]
    assert routing.replies == [(reply_queue(HOST_ID), "req-1")]
    sessions = await routing.daemon.store.load_sessions(SCOPE)
    assert {other.session_id, fresh.session_id} <= set(sessions)


async def test_a_frame_behind_a_slow_open_of_its_own_session_waits_for_it(
    routing: Routing,
) -> None:
    fresh = routing.session(1)
    gate = routing.gate_commits(lambda changes: fresh.session_id in _opens(changes))
    open_fresh = routing.open_message(fresh)
    frames = [routing.dispatch_message(fresh, f"req-{i}") for i in range(3)]
    tasks = [routing.deliver(open_fresh), *(routing.deliver(m) for m in frames)]
    for _ in range(20):
        await asyncio.sleep(0)
    gate.set()
    await _settle(tasks)

    assert routing.dead == []
    assert sorted(r[1] or "" for r in routing.replies) == ["req-0", "req-1", "req-2"]


async def test_many_sessions_rotating_at_once_lose_no_first_frame(routing: Routing) -> None:
    sessions = [routing.session(i) for i in range(12)]
    gate = routing.gate_commits(lambda changes: bool(_opens(changes)))
    tasks: list[asyncio.Task[None]] = []
    for session in sessions:
        tasks.append(routing.deliver(routing.open_message(session)))
        tasks.append(routing.deliver(routing.dispatch_message(session, session.session_id)))
    for _ in range(20):
        await asyncio.sleep(0)
    gate.set()
    await _settle(tasks)

    assert routing.dead == []
    assert sorted(r[1] or "" for r in routing.replies) == sorted(s.session_id for s in sessions)
    stored = await routing.daemon.store.load_sessions(SCOPE)
    assert {s.session_id for s in sessions} <= set(stored)
    # The daemon's bound metric children feed the same families and labels.
    sample = routing.daemon.metrics.registry.get_sample_value
    assert sample("octo_deliveries_total", {"scope": SCOPE, "outcome": "acked"}) == 24
    assert sample("octo_replies_total", {"scope": SCOPE, "outcome": "confirmed"}) == 12
    admitted = {"scope": SCOPE, "kind": "operation", "result": "dispatch"}
    assert sample("octo_admissions_total", admitted) == 12
    calls = {"tool": TOOL, "method": "dispatch_operation", "outcome": "ok"}
    assert sample("octo_adapter_outcomes_total", calls) == 12
    durations = {"tool": TOOL, "method": "dispatch_operation"}
    assert sample("octo_adapter_duration_seconds_count", durations) == 12


async def test_dead_letters_count_by_reason(routing: Routing) -> None:
    stray = routing.session(1)
    for index in range(3):
        await _settle([routing.deliver(routing.dispatch_message(stray, f"req-{index}"))])
    # The routing stand-in replaces the broker copy, so count through the real method.
    publisher = routing.daemon._broker.publisher
    await publisher.__class__.dead_letter(
        publisher,
        SCOPE,
        routing.dispatch_message(stray, "req-x"),  # type: ignore[arg-type]
        routing.channel,  # type: ignore[arg-type]
        "unknown_session",
    )
    sample = routing.daemon.metrics.registry.get_sample_value
    labels = {"scope": SCOPE, "reason": "unknown_session"}
    assert sample("octo_frames_rejected_total", labels) == 1
    assert sample("octo_deliveries_total", {"scope": SCOPE, "outcome": "dead_lettered"}) == 3


async def test_a_duplicate_open_behind_the_first_is_handled_once_not_opened_twice(
    routing: Routing,
) -> None:
    fresh = routing.session(1)
    gate = routing.gate_commits(lambda changes: fresh.session_id in _opens(changes))
    first = routing.open_message(fresh)
    copy = routing.open_message(fresh)
    copy.body = first.body  # a redelivered copy of the same open_session
    tasks = [routing.deliver(first), routing.deliver(copy)]
    for _ in range(20):
        await asyncio.sleep(0)
    gate.set()
    await _settle(tasks)

    assert first.settled == ["ack"]
    # The copy meets the open session and is handled as a repeated open
    # (dropped), never a second open.
    assert copy.settled == ["ack"]
    assert routing.dead == [], routing.dead
    assert len(await routing.daemon.store.load_sessions(SCOPE)) == 1


async def test_a_frame_of_a_session_nobody_opens_is_still_unknown(routing: Routing) -> None:
    stray = routing.session(1)
    message = routing.dispatch_message(stray, "req-1")
    await _settle([routing.deliver(message)])

    assert routing.dead == [(stray.session_id, "unknown_session")]
    assert routing.replies == []


async def test_a_delivery_of_a_scope_another_worker_took_is_handed_back_with_a_nack(
    routing: Routing,
) -> None:
    # A nack, not a reject: handing a frame back unhandled is no failure of
    # it, so (RabbitMQ >= 4.3) it does not use up the frame's delivery limit.
    routing.daemon._scopes[SCOPE].superseded = True
    message = routing.open_message(routing.session(1))
    await _settle([routing.deliver(message)])
    assert message.settled == ["handed_back"]
    assert routing.dead == [] and routing.replies == []


async def test_a_delivery_whose_handling_failed_is_rejected_back_into_the_queue(
    routing: Routing,
) -> None:
    # A real failure is a reject: the broker counts it toward the delivery
    # limit, so a frame that keeps failing ends in the dead-letter queue.
    async def failing(scope: Any, message: Any, channel: Any, reason: str) -> None:
        raise RuntimeError("the dead-letter copy failed")

    routing.daemon._broker.publisher.dead_letter = failing  # type: ignore[method-assign]
    message = routing.dispatch_message(routing.session(1), "req-1")  # unknown session
    await _settle([routing.deliver(message)])
    assert message.settled == ["requeue"]


async def test_a_frame_received_after_its_open_never_overtakes_it_at_an_activation(
    routing: Routing,
) -> None:
    """A shared journal's scope in standby: the open_session that activates it waits
    for the activation, and a frame of that session received once the activation has
    left standby (while it republishes the outbox) waited for the gate only, so it
    was routed first and dead-lettered ``unknown_session``. It waits for its open."""
    daemon = routing.daemon
    scope = daemon._scopes[SCOPE]
    scope.standby = True
    scope.running.clear()
    daemon._broker._consume_channel = routing.channel  # type: ignore[assignment]
    lifecycle = daemon._scopes_lifecycle()
    republish = lifecycle.republish_outbox
    held = asyncio.Event()

    async def slow_republish(served: Any) -> Any:
        await held.wait()
        return await republish(served)

    lifecycle.republish_outbox = slow_republish  # type: ignore[method-assign]
    fresh = routing.session(1)
    tasks = [routing.deliver(routing.open_message(fresh))]
    await asyncio.wait_for(_until(lambda: not scope.standby), WAIT)
    frame = routing.dispatch_message(fresh, "req-1")
    tasks.append(routing.deliver(frame))
    for _ in range(20):
        await asyncio.sleep(0)
    held.set()
    await _settle(tasks)

    assert routing.dead == []
    assert frame.settled == ["ack"]
    assert routing.replies == [(reply_queue(HOST_ID), "req-1")]


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)
