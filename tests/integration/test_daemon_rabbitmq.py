"""The worker daemon on the real broker, driven by frames crafted by hand.

A hand-made host seals frames with a HOST authenticator and publishes them
raw to ``octo.v5.worker.<scope>``. Every frame the daemon must refuse is
expected as a copy on ``octo.v5.dead`` with the right ``octo-reason``, with no
reply on the host's queue and no change to the worker journal's revision.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aio_pika
import msgspec
import pytest
from aio_pika.abc import AbstractConnection

from octo_common.errors import DuplicateFrame
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.messages import (
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationResult,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    WorkerMessage,
)
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_common.transport import (
    EXCHANGE,
    HEADER_KEY_NONCE,
    HEADER_SCOPE,
    HEADER_SESSION,
    worker_queue,
)
from octo_worker.adapters.contract import AdapterIndeterminate, WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import (
    GRANT,
    TOOL,
    WAIT,
    Inbox,
    Names,
    RawHost,
    RawLongString,
    RawSession,
    WorkerEnv,
    WorkerRunner,
    header,
    marker_of,
    reason_of,
    unique,
    wait_session,
)

pytestmark = pytest.mark.rabbitmq

QUIET = 0.3  # how long "no reply" is watched for after the dead letter arrived


def publish_payload(name: str = "notes.txt", content: str = "hello") -> ToolPayload:
    return ToolPayload.json({"name": name, "content": content})


def dispatch_frame(session: RawSession, request_id: str, key: str, content: str = "hello") -> bytes:
    request = OperationDispatchRequest(
        session.session_id, request_id, TOOL, key, publish_payload(content=content)
    )
    return session.auth.seal(DispatchOperation(request))


def operation_key() -> str:
    return "op-" + secrets.token_hex(16)


async def answer(raw_host: RawHost, session: RawSession, request_id: str) -> WorkerMessage:
    """The next authentic reply for ``request_id``; copies the host already
    accepted (a republished outbox frame) are dropped, as the host does."""
    seen: set[int] = set()
    while True:
        reply = await raw_host.replies.wait_for(
            lambda m: m.correlation_id == request_id and id(m) not in seen
        )
        seen.add(id(reply))
        try:
            return session.auth.open(reply.body)
        except DuplicateFrame:
            continue


async def opened(
    raw_host: RawHost, daemon: WorkerDaemon, key: ScopeKey | None = None
) -> RawSession:
    session = raw_host.session(key)
    await raw_host.open(session, marker=unique("open"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    return session


async def assert_refused(
    dead_letters: Inbox,
    raw_host: RawHost,
    daemon: WorkerDaemon,
    marker: str,
    reason: str,
    head_before: int,
) -> None:
    """Dead-lettered with ``reason``, never answered, journal revision unchanged."""
    dead = await dead_letters.wait_for(marker_of(marker))
    assert reason_of(dead) == reason
    await asyncio.sleep(QUIET)
    assert raw_host.replies.items == []
    assert await daemon.store.head_revision(raw_host.scope) == head_before


async def test_open_session_sealed_with_another_scope_key_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    head = await daemon.store.head_revision(raw_host.scope)
    wrong = raw_host.session(ScopeKey.from_bytes(secrets.token_bytes(32)))
    await raw_host.open(wrong, marker="open-wrong-key")

    await assert_refused(
        dead_letters, raw_host, daemon, "open-wrong-key", "invalid_authentication_tag", head
    )
    assert wrong.session_id not in await daemon.store.load_sessions(raw_host.scope)


async def test_frame_sealed_with_another_scope_key_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox, worker_env: WorkerEnv
) -> None:
    session = await opened(raw_host, daemon)
    # Same session id and nonce, key derived from a foreign scope key.
    foreign = ScopeKey.from_bytes(secrets.token_bytes(32))
    forged = RawSession(
        session.session_id,
        session.nonce,
        SessionAuthenticator(
            session.session_id,
            SessionKey.derive(foreign, raw_host.scope, session.session_id, session.nonce),
            SessionRole.HOST,
        ),
    )
    head = await daemon.store.head_revision(raw_host.scope)
    frame = dispatch_frame(forged, "d-forged", operation_key())
    await raw_host.publish(
        frame, headers=raw_host.headers(session, "forged"), correlation_id="d-forged"
    )

    await assert_refused(
        dead_letters, raw_host, daemon, "forged", "invalid_authentication_tag", head
    )
    assert read_effect_log(worker_env.effect_log) == []


async def test_tampered_frame_is_dead_lettered_and_the_original_still_works(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox, worker_env: WorkerEnv
) -> None:
    session = await opened(raw_host, daemon)
    key = operation_key()
    frame = dispatch_frame(session, "d-1", key, content="hello")
    tampered = frame.replace(b'"content":"hello"', b'"content":"jello"')
    assert tampered != frame
    head = await daemon.store.head_revision(raw_host.scope)

    await raw_host.publish(
        tampered, headers=raw_host.headers(session, "tampered"), correlation_id="d-1"
    )
    await assert_refused(
        dead_letters, raw_host, daemon, "tampered", "invalid_authentication_tag", head
    )
    assert read_effect_log(worker_env.effect_log) == []

    # Nothing of the tampered copy was kept: the authentic frame is new to the worker.
    await raw_host.publish(
        frame, headers=raw_host.headers(session, "genuine"), correlation_id="d-1"
    )
    message = await answer(raw_host, session, "d-1")
    assert isinstance(message, OperationResult)
    assert isinstance(message.result.status, Succeeded)
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert (worker_env.shelf / "notes.txt").read_text() == "hello"


async def test_reflected_worker_frame_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = await opened(raw_host, daemon)
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "dispatch"),
        correlation_id="d-1",
    )
    reply = await raw_host.replies.wait_for(lambda m: m.correlation_id == "d-1")
    raw_host.replies.items.clear()
    head = await daemon.store.head_revision(raw_host.scope)

    # The worker's own sealed answer, sent back to it with valid headers.
    await raw_host.publish(
        reply.body, headers=raw_host.headers(session, "reflected"), correlation_id="d-1"
    )
    await assert_refused(
        dead_letters, raw_host, daemon, "reflected", "invalid_authentication_tag", head
    )


async def test_scope_header_naming_another_scope_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = await opened(raw_host, daemon)
    head = await daemon.store.head_revision(raw_host.scope)
    headers = raw_host.headers(session, "other-scope")
    headers[HEADER_SCOPE] = unique("t-other")
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()), headers=headers, correlation_id="d-1"
    )
    await assert_refused(dead_letters, raw_host, daemon, "other-scope", "scope_mismatch", head)


async def test_oversize_body_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = await opened(raw_host, daemon)
    head = await daemon.store.head_revision(raw_host.scope)
    body = b"{" + b" " * MAX_WIRE_FRAME_BYTES + b"}"
    await raw_host.publish(body, headers=raw_host.headers(session, "oversize"))
    await assert_refused(dead_letters, raw_host, daemon, "oversize", "wire_frame_too_large", head)


async def test_missing_or_malformed_headers_are_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = await opened(raw_host, daemon)
    head = await daemon.store.head_revision(raw_host.scope)
    cases = [
        ("no-session", HEADER_SESSION, None, "invalid_frame_headers"),
        ("no-scope", HEADER_SCOPE, None, "invalid_frame_headers"),
        ("no-nonce", HEADER_KEY_NONCE, None, "invalid_frame_headers"),
        ("bad-nonce", HEADER_KEY_NONCE, "AB" * 32, "invalid_frame_headers"),
        ("bad-session", HEADER_SESSION, "Not A Token", "invalid_frame_headers"),
    ]
    for index, (marker, name, value, _) in enumerate(cases):
        headers = raw_host.headers(session, marker)
        if value is None:
            del headers[name]
        else:
            headers[name] = value
        request_id = f"d-{index}"
        await raw_host.publish(
            dispatch_frame(session, request_id, operation_key()),
            headers=headers,
            correlation_id=request_id,
        )
    for marker, _, _, reason in cases:
        dead = await dead_letters.wait_for(marker_of(marker))
        assert reason_of(dead) == reason, marker
    await asyncio.sleep(QUIET)
    assert raw_host.replies.items == []
    assert await daemon.store.head_revision(raw_host.scope) == head


async def test_a_frame_with_a_header_pamqp_cannot_encode_again_is_still_dead_lettered(
    daemon: WorkerDaemon,
    raw_host: RawHost,
    dead_letters: Inbox,
    raw_long_strings: type[RawLongString],
) -> None:
    session = await opened(raw_host, daemon)
    head = await daemon.store.head_revision(raw_host.scope)
    headers: dict[str, Any] = dict(raw_host.headers(session, "raw"))
    del headers[HEADER_KEY_NONCE]  # refused at the header check
    headers["x-raw"] = raw_long_strings(b"\xff\xfe")  # decoded as bytes, which pamqp cannot encode
    exchange = await raw_host.channel.get_exchange(EXCHANGE, ensure=False)
    await exchange.publish(
        aio_pika.Message(dispatch_frame(session, "d-raw", operation_key()), headers=headers),
        routing_key=worker_queue(raw_host.scope),
    )
    dead = await dead_letters.wait_for(marker_of("raw"))
    assert reason_of(dead) == "invalid_frame_headers"
    await asyncio.sleep(QUIET)
    assert raw_host.replies.items == []
    assert await daemon.store.head_revision(raw_host.scope) == head


async def test_frame_of_an_unknown_session_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    head = await daemon.store.head_revision(raw_host.scope)
    never_opened = raw_host.session()
    await raw_host.publish(
        dispatch_frame(never_opened, "d-1", operation_key()),
        headers=raw_host.headers(never_opened, "unknown"),
        correlation_id="d-1",
    )
    await assert_refused(dead_letters, raw_host, daemon, "unknown", "unknown_session", head)
    dead = dead_letters.matching(marker_of("unknown"))[0]
    assert header(dead, HEADER_SESSION) == never_opened.session_id


async def test_worker_restart_answers_an_accepted_frame_from_the_journal(
    workers: WorkerRunner, raw_host: RawHost, dead_letters: Inbox, worker_env: WorkerEnv
) -> None:
    first = await workers.start()
    session = await opened(raw_host, first)
    key = operation_key()
    frame = dispatch_frame(session, "d-1", key)
    await raw_host.publish(frame, headers=raw_host.headers(session, "d-1"), correlation_id="d-1")
    first_answer = await answer(raw_host, session, "d-1")
    assert isinstance(first_answer, OperationResult)
    assert isinstance(first_answer.result.status, Succeeded)
    assert len(read_effect_log(worker_env.effect_log)) == 1

    await workers.stop(first)
    raw_host.replies.items.clear()
    # The same accepted frame again, queued while no worker runs (a redelivery).
    await raw_host.publish(frame, headers=raw_host.headers(session, "again"), correlation_id="d-1")
    second = await workers.start()

    again = await answer(raw_host, session, "d-1")
    assert isinstance(again, OperationResult)
    assert again.result.status == first_answer.result.status
    assert len(read_effect_log(worker_env.effect_log)) == 1

    # The restored session keeps serving: a new request is handled as new.
    reconcile = session.auth.seal(
        ReconcileOperation(OperationReconcileRequest(session.session_id, "r-1", TOOL, key))
    )
    await raw_host.publish(
        reconcile, headers=raw_host.headers(session, "r-1"), correlation_id="r-1"
    )
    reconciled = await answer(raw_host, session, "r-1")
    assert isinstance(reconciled, ReconciledOperation)
    assert reconciled.result.status == first_answer.result.status
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert dead_letters.matching(lambda m: header(m, HEADER_SESSION) == session.session_id) == []
    await workers.stop(second)


async def test_open_session_without_reply_to_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    head = await daemon.store.head_revision(raw_host.scope)
    session = raw_host.session()
    frame = session.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )
    await raw_host.publish(frame, headers=raw_host.headers(session, "no-reply-to"), reply_to="")
    await assert_refused(
        dead_letters, raw_host, daemon, "no-reply-to", "invalid_frame_headers", head
    )
    assert session.session_id not in await daemon.store.load_sessions(raw_host.scope)


async def test_reopening_a_session_id_is_session_replay_and_a_redelivered_open_is_dropped(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = raw_host.session()
    opening = session.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )
    await raw_host.publish(opening, headers=raw_host.headers(session, "open"))
    await wait_session(daemon, raw_host.scope, session.session_id)

    # The same opening frame again (a redelivery): a duplicate, acked and dropped.
    await raw_host.publish(opening, headers=raw_host.headers(session, "open-again"))
    # A new authentic opening of the same id, same nonce: SessionReplay.
    reopen = session.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )
    await raw_host.publish(reopen, headers=raw_host.headers(session, "reopen"))
    # The same id under another nonce: SessionReplay before any authentication.
    other = raw_host.session()
    other = RawSession(
        session.session_id,
        other.nonce,
        SessionAuthenticator(
            session.session_id,
            SessionKey.derive(raw_host.key, raw_host.scope, session.session_id, other.nonce),
            SessionRole.HOST,
        ),
    )
    hijack = other.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )
    await raw_host.publish(hijack, headers=raw_host.headers(other, "other-nonce"))

    for marker in ("reopen", "other-nonce"):
        dead = await dead_letters.wait_for(marker_of(marker))
        assert reason_of(dead) == "session_replay", marker
    await asyncio.sleep(QUIET)
    assert dead_letters.matching(marker_of("open-again")) == []
    assert raw_host.replies.items == []
    sessions = await daemon.store.load_sessions(raw_host.scope)
    assert sessions[session.session_id].status == "open"

    # The session still works with its first nonce.
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)


async def test_undecodable_body_of_a_known_session_is_dead_lettered(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    session = await opened(raw_host, daemon)
    head = await daemon.store.head_revision(raw_host.scope)
    await raw_host.publish(
        b'{"not":"a frame"', headers=raw_host.headers(session, "garbage"), correlation_id="d-1"
    )
    await assert_refused(dead_letters, raw_host, daemon, "garbage", "serialization", head)


async def test_replies_go_to_the_queue_recorded_at_open(
    daemon: WorkerDaemon, raw_host: RawHost, names: Names, broker: AbstractConnection
) -> None:
    session = await opened(raw_host, daemon)
    elsewhere = RawHost(raw_host.channel, raw_host.scope, names.host("-elsewhere"), raw_host.key)
    await elsewhere.start(broker)

    # reply_to is unauthenticated: a later frame cannot redirect the answers.
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
        reply_to=elsewhere.reply_queue,
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)
    await asyncio.sleep(QUIET)
    assert elsewhere.replies.items == []


async def test_a_forged_open_with_a_foreign_reply_to_gets_nothing_and_the_genuine_open_works(
    daemon: WorkerDaemon,
    raw_host: RawHost,
    names: Names,
    broker: AbstractConnection,
    dead_letters: Inbox,
) -> None:
    """Someone who saw an open_session republishes it first with a reply queue
    of their own: the reply queue sealed into the frame is not theirs, so the
    copy is refused, nothing reaches their queue, and the genuine open (not a
    duplicate of anything accepted) opens the session."""
    thief = RawHost(raw_host.channel, raw_host.scope, names.host("-thief"), raw_host.key)
    await thief.start(broker)
    session = raw_host.session()
    opening = session.auth.seal(
        OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=raw_host.reply_queue)
    )
    await raw_host.publish(
        opening, headers=raw_host.headers(session, "forged"), reply_to=thief.reply_queue
    )
    dead = await dead_letters.wait_for(marker_of("forged"))
    assert reason_of(dead) == "reply_queue_not_allowed"
    assert session.session_id not in await daemon.store.load_sessions(raw_host.scope)

    await raw_host.publish(opening, headers=raw_host.headers(session, "genuine"))
    await wait_session(daemon, raw_host.scope, session.session_id)
    # The thief republishes a request of the session too: its answer goes
    # to the queue sealed at open, never to the delivery's reply_to.
    await raw_host.publish(
        dispatch_frame(session, "d-1", operation_key()),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
        reply_to=thief.reply_queue,
    )
    assert isinstance(await answer(raw_host, session, "d-1"), OperationResult)
    await asyncio.sleep(QUIET)
    assert thief.replies.items == []


async def test_an_open_that_seals_no_reply_queue_needs_one_the_configuration_allows(
    daemon: WorkerDaemon, raw_host: RawHost, dead_letters: Inbox
) -> None:
    """A frame of the protocol's base form (no reply queue sealed in) opens
    nothing unless the scope's configuration lists the delivery's queue."""
    session = raw_host.session()
    frame = session.auth.seal(OpenSession(CapabilityManifest(session.session_id, [GRANT])))
    head = await daemon.store.head_revision(raw_host.scope)
    await raw_host.publish(frame, headers=raw_host.headers(session, "unbound"))
    await assert_refused(dead_letters, raw_host, daemon, "unbound", "reply_queue_not_allowed", head)
    assert session.session_id not in await daemon.store.load_sessions(raw_host.scope)


class _SlowFiles(FilesPublishAdapter):
    def __init__(self, env: WorkerEnv, delay: float) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)
        self.delay = delay
        self.dispatches = 0

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.dispatches += 1
        await asyncio.sleep(self.delay)
        return await super().dispatch_operation(request, grant, context)


async def test_two_copies_in_flight_at_once_run_one_effect_and_both_are_answered(
    workers: WorkerRunner, raw_host: RawHost, dead_letters: Inbox, worker_env: WorkerEnv
) -> None:
    adapter = _SlowFiles(worker_env, delay=0.4)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    daemon = await workers.start(adapters=adapters)
    session = await opened(raw_host, daemon)
    frame = dispatch_frame(session, "d-1", operation_key())

    # The second copy arrives while the first one's adapter call is running.
    await raw_host.publish(frame, headers=raw_host.headers(session, "copy-1"), correlation_id="d-1")
    await raw_host.publish(frame, headers=raw_host.headers(session, "copy-2"), correlation_id="d-1")

    first = await answer(raw_host, session, "d-1")
    second = await answer(raw_host, session, "d-1")
    for message in (first, second):
        assert isinstance(message, OperationResult)
        assert isinstance(message.result.status, Succeeded)
    assert adapter.dispatches == 1
    assert len(read_effect_log(worker_env.effect_log)) == 1
    assert dead_letters.matching(lambda m: header(m, HEADER_SESSION) == session.session_id) == []


async def test_worker_stopped_during_an_effect_leaves_it_pending_for_reconciliation(
    raw_host: RawHost, dead_letters: Inbox, worker_env: WorkerEnv
) -> None:
    # A short grace: the stop cancels the handler while the adapter still sleeps.
    config = msgspec.structs.replace(
        worker_env.config,
        worker=msgspec.structs.replace(worker_env.config.worker, shutdown_grace_seconds=0.2),
    )
    adapter = _SlowFiles(worker_env, delay=3.0)
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    runner = WorkerRunner(worker_env)
    first = WorkerDaemon(config, adapters=adapters)
    task = asyncio.create_task(first.run())
    try:
        await asyncio.wait_for(first.wait_ready(), WAIT)
        session = await opened(raw_host, first)
        key = operation_key()
        frame = dispatch_frame(session, "d-1", key)
        await raw_host.publish(
            frame, headers=raw_host.headers(session, "d-1"), correlation_id="d-1"
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while adapter.dispatches == 0 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        assert adapter.dispatches == 1
    finally:
        first.request_stop()
        await asyncio.wait_for(task, 15.0)
    assert read_effect_log(worker_env.effect_log) == []

    second = await runner.start()
    try:
        records = {r.operation_key: r for r, _ in await second.store.list_records(raw_host.scope)}
        assert records[key].state.kind.value == "pending"
        # The same frame again: still pending at the worker, never run again.
        await raw_host.publish(
            frame, headers=raw_host.headers(session, "d-1-again"), correlation_id="d-1"
        )
        refused = await answer(raw_host, session, "d-1")
        assert isinstance(refused, RequestRejected), refused
        assert refused.code == "pending_operation"
        # Reconciliation resolves it from the adapter's own record.
        reconcile = session.auth.seal(
            ReconcileOperation(OperationReconcileRequest(session.session_id, "r-1", TOOL, key))
        )
        await raw_host.publish(
            reconcile, headers=raw_host.headers(session, "r-1"), correlation_id="r-1"
        )
        reconciled = await answer(raw_host, session, "r-1")
        assert isinstance(reconciled, ReconciledOperation)
        assert reconciled.result.status.kind.value == "failed"
        assert adapter.dispatches == 1
        assert read_effect_log(worker_env.effect_log) == []
    finally:
        await runner.stop_all()


class _LostAnswerFiles(FilesPublishAdapter):
    """Runs the effect, then cannot tell whether it happened (indeterminate)."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=30.0)

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        await super().dispatch_operation(request, grant, context)
        raise AdapterIndeterminate("lost the answer")


async def test_a_key_left_pending_counts_in_the_oldest_pending_gauge_until_reconciled(
    workers: WorkerRunner, raw_host: RawHost, worker_env: WorkerEnv
) -> None:
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, _LostAnswerFiles(worker_env))
    daemon = await workers.start(adapters=adapters)
    session = await opened(raw_host, daemon)
    key = operation_key()
    await raw_host.publish(
        dispatch_frame(session, "d-1", key),
        headers=raw_host.headers(session, "d-1"),
        correlation_id="d-1",
    )
    refused = await answer(raw_host, session, "d-1")
    assert isinstance(refused, RequestRejected) and refused.code == "indeterminate_operation"

    def age() -> float:
        sample = daemon.metrics.registry.get_sample_value(
            "octo_oldest_unresolved_pending_seconds", {"scope": raw_host.scope}
        )
        assert sample is not None
        return sample

    first = age()
    assert first > 0
    await asyncio.sleep(0.2)
    # Read when scraped: it grows while the key stays unresolved.
    assert age() >= first + 0.2
    reconcile = session.auth.seal(
        ReconcileOperation(OperationReconcileRequest(session.session_id, "r-1", TOOL, key))
    )
    await raw_host.publish(
        reconcile, headers=raw_host.headers(session, "r-1"), correlation_id="r-1"
    )
    reconciled = await answer(raw_host, session, "r-1")
    assert isinstance(reconciled, ReconciledOperation)
    assert isinstance(reconciled.result.status, Succeeded)
    assert age() == 0.0
    assert len(read_effect_log(worker_env.effect_log)) == 1
