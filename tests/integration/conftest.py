"""Fixtures for the RabbitMQ integration tests of the worker daemon and the host client.

Every test gets its own tenant scope and host ids (uuid suffix), its own key
files (0600) and ``worker.toml`` in ``tmp_path``, an in-process
``WorkerDaemon`` on the real broker with the real ``files.publish`` adapter,
and real SQLite files for the worker journal and the host ledger. Teardown
stops the daemons and clients it started and deletes the worker and reply
queues it declared. Dead letters are observed through a private, exclusive
queue bound to the ``octo.v5.dead`` fanout exchange, so the shared
``octo.v5.dead`` queue is never consumed from here; a test sees only the dead
letters routed to its own queues, never those of tests running beside it
(other pytest-xdist workers, other checkouts on the same broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import struct
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage
from pamqp import encode as pamqp_encode

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import OpenSession
from octo_common.records import StorageKeyring
from octo_common.runtime.broker import publish_confirmed
from octo_common.transport import (
    DEAD_EXCHANGE,
    EXCHANGE,
    HEADER_KEY_NONCE,
    HEADER_REASON,
    HEADER_SCOPE,
    HEADER_SESSION,
    frame_message_id,
    reply_queue,
    worker_queue,
)
from octo_host.amqp import BrokerUnavailable, connect, open_confirm_channel
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationPolicy, WorkflowCompensationTarget
from octo_host.engine import WorkflowEngine
from octo_host.store import SqliteLedgerStore
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.config import WorkerConfig, load_config
from octo_worker.daemon.daemon import WorkerDaemon
from tests.postgres import PostgresSchema

from .journal_backends import BACKENDS, JournalDatabase

URL = "amqp://127.0.0.1:5672/"
TOOL = "files.publish"
# Enough calls for a dispatch, its re-dispatches and a few test frames per session.
GRANT = CapabilityGrant(TOOL, "json", max_calls=8, max_compensations=1)
WAIT = 5.0  # the bound of every wait in these tests


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def write_private(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
    return path


def manifest() -> CapabilityManifest:
    """The manifest a host opens sessions with (its session id is replaced per open)."""
    return CapabilityManifest("manifest", [GRANT])


class AllowGrant:
    """A grant verifier that accepts exactly the configured tenant and grant."""

    def __init__(self, tenant: str, grant: CapabilityGrant) -> None:
        self.tenant, self.grant, self.calls = tenant, grant, 0

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.calls += 1
        assert tenant_scope == self.tenant and grant == self.grant


class AllowUndo:
    """An action verifier that accepts only the inverse of this test's publish."""

    def __init__(self, allowed_input: bytes) -> None:
        self.allowed_input, self.calls = allowed_input, 0

    def verify_compensation_action(self, action: Any) -> None:
        self.calls += 1
        assert action.compensation_input == self.allowed_input


def compensation_target(
    scope: str, operation_key: str, inverse: bytes, action: AllowUndo | None = None
) -> WorkflowCompensationTarget:
    """The target of this test's compensation: tenant = the worker scope, grant = GRANT."""
    policy = WorkflowCompensationPolicy(scope, GRANT)
    return WorkflowCompensationTarget(
        operation_key, policy, GRANT, AllowGrant(scope, GRANT), action or AllowUndo(inverse)
    )


# Broker ---------------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def journal_db(request: pytest.FixtureRequest, tmp_path: Path) -> JournalDatabase:
    """A worker journal database of each backend in turn (``journal_backends``)."""
    if request.param == "sqlite":
        return JournalDatabase("sqlite", tmp_path / "journal" / "worker.db", None)
    place: PostgresSchema = request.getfixturevalue("postgres_schema")
    return JournalDatabase("postgres", tmp_path / "unused", place)


@pytest.fixture
async def broker() -> AsyncIterator[AbstractConnection]:
    try:
        connection = await connect(URL, timeout=3.0, name="octo-test-integration")
    except BrokerUnavailable as error:
        pytest.skip(f"RabbitMQ is not reachable on 127.0.0.1:5672 ({error.reason})")
    yield connection
    await connection.close()


@pytest.fixture
async def channel(broker: AbstractConnection) -> AbstractChannel:
    """A confirm channel for raw publishes."""
    return await open_confirm_channel(broker)


@dataclass
class Names:
    scope: str
    host_id: str
    queues: list[str] = field(default_factory=list)

    def host(self, suffix: str = "") -> str:
        """A host id of this test (registered for queue cleanup)."""
        host_id = self.host_id + suffix
        self.queues.append(reply_queue(host_id))
        return host_id

    def queue(self, prefix: str) -> str:
        """A queue name (routing key) of this test, registered for cleanup."""
        name = unique(prefix)
        self.queues.append(name)
        return name


@pytest.fixture
async def names(broker: AbstractConnection) -> AsyncIterator[Names]:
    scope = unique("t-scope")
    found = Names(scope=scope, host_id=unique("t-host"), queues=[worker_queue(scope)])
    yield found
    channel = await broker.channel()
    for name in found.queues:
        with contextlib.suppress(Exception):
            await channel.queue_delete(name)
    with contextlib.suppress(Exception):
        await channel.close()


class Inbox:
    """Deliveries of one queue, collected by a consumer (acked on arrival).

    With ``keep``, only the deliveries it accepts are collected (all are acked).
    """

    def __init__(self, keep: Callable[[AbstractIncomingMessage], bool] | None = None) -> None:
        self.items: list[AbstractIncomingMessage] = []
        self._keep = keep
        self._arrived = asyncio.Event()

    async def put(self, message: AbstractIncomingMessage) -> None:
        await message.ack()
        if self._keep is not None and not self._keep(message):
            return
        self.items.append(message)
        self._arrived.set()

    async def wait_for(
        self, match: Callable[[AbstractIncomingMessage], bool], timeout: float = WAIT
    ) -> AbstractIncomingMessage:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for item in self.items:
                if match(item):
                    return item
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError("no matching delivery arrived in time")
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def matching(self, match: Callable[[AbstractIncomingMessage], bool]) -> list[Any]:
        return [item for item in self.items if match(item)]


def header(message: AbstractIncomingMessage, name: str) -> str | None:
    value = (message.headers or {}).get(name)
    if isinstance(value, bytes):
        return value.decode()
    return None if value is None else str(value)


@pytest.fixture
async def dead_letters(broker: AbstractConnection, names: Names) -> AsyncIterator[Inbox]:
    """Copies of what is dead-lettered to ``octo.v5.dead`` during the test from
    this test's queues (a dead letter keeps its delivery's routing key, which
    is the queue name: ``names.queues``)."""
    channel = await broker.channel()
    exchange = await channel.declare_exchange(
        DEAD_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    queue = await channel.declare_queue(exclusive=True, auto_delete=True)
    await queue.bind(exchange, routing_key="")
    inbox = Inbox(lambda message: message.routing_key in names.queues)
    tag = await queue.consume(inbox.put)
    yield inbox
    with contextlib.suppress(Exception):
        await queue.cancel(tag)
        await channel.close()


# Worker -----------------------------------------------------------------------------------


@dataclass
class WorkerEnv:
    """Files of one worker: config, keys, journal, published directory, effect log."""

    root: Path
    scope: str
    scope_key: ScopeKey
    config_path: Path
    config: WorkerConfig

    @property
    def state_dir(self) -> Path:
        return self.root / "worker" / "state"

    @property
    def published(self) -> Path:
        """``files.publish``'s ``target_dir``."""
        return self.state_dir / "published"

    @property
    def shelf(self) -> Path:
        """Where ``files.publish`` puts this scope's files (a directory per scope)."""
        return self.published / self.scope

    @property
    def effect_log(self) -> Path:
        return self.state_dir / "effects.log"


def write_worker_env(
    root: Path, scope: str, *, tools: tuple[str, ...] = (TOOL,), extra: str = ""
) -> WorkerEnv:
    """Keys and ``worker.toml`` of a worker serving ``scope`` with ``tools`` (one of
    them may be ``files.publish``, publishing under ``state/published``); ``extra``
    is appended to the file (other adapters' options)."""
    scope_key = secrets.token_bytes(32)
    base = root / "worker"
    write_private(base / "keys" / "scope.key", scope_key)
    write_private(base / "keys" / "storage.key", secrets.token_bytes(32).hex().encode() + b"\n")
    config_path = base / "worker.toml"
    enabled = ", ".join(f'"{tool}"' for tool in tools)
    publish = f"""
[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
"""
    config_path.write_text(
        f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 3.0
log_level = "warning"

[broker]
url = "{URL}"
connect_timeout_seconds = 3.0
publish_timeout_seconds = 5.0

[storage]
journal = "journal.sqlite3"
key = {{ id = "worker-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{scope}"
key_file = "keys/scope.key"

[adapters]
enabled = [{enabled}]
{publish if TOOL in tools else ""}
{extra}
""",
        encoding="utf-8",
    )
    return WorkerEnv(
        root=root,
        scope=scope,
        scope_key=ScopeKey.from_bytes(scope_key),
        config_path=config_path,
        config=load_config(config_path),
    )


@pytest.fixture
def worker_env(tmp_path: Path, names: Names) -> WorkerEnv:
    return write_worker_env(tmp_path, names.scope)


def write_host_toml(
    root: Path, host_id: str, worker: WorkerEnv, body: str, *, broker: str = ""
) -> Path:
    """``root/host.toml`` for a host of ``worker``'s scope (its key copied, a fresh ledger
    key, the ledger in ``root``), followed by ``body`` (grants, actions, plans);
    ``broker`` adds keys to ``[broker]``."""
    keys = root / "keys"
    write_private(keys / "scope.key", (worker.root / "worker" / "keys" / "scope.key").read_bytes())
    write_private(keys / "ledger.key", secrets.token_bytes(32))
    path = root / "host.toml"
    path.write_text(
        f"""
[host]
host_id = "{host_id}"

[broker]
url = "{URL}"
publish_timeout_seconds = 5.0
reply_timeout_seconds = 5.0
{broker}

[ledger]
database = "ledger.sqlite3"
key = {{ id = "h1", key_file = "keys/ledger.key" }}

[[scopes]]
name = "{worker.scope}"
key_file = "keys/scope.key"
{body}
""",
        encoding="utf-8",
    )
    return path


class WorkerRunner:
    """Starts in-process daemons on ``env`` and stops whatever is still running."""

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self._running: dict[WorkerDaemon, asyncio.Task[None]] = {}

    async def start(self, adapters: WorkerAdapterRegistry | None = None) -> WorkerDaemon:
        daemon = WorkerDaemon(self.env.config, adapters=adapters)
        task = asyncio.create_task(daemon.run())
        ready = asyncio.create_task(daemon.wait_ready())
        done, _ = await asyncio.wait({task, ready}, timeout=15.0, return_when="FIRST_COMPLETED")
        if ready not in done:
            ready.cancel()
            if task in done:
                task.result()  # the start-up error
            task.cancel()
            raise AssertionError("the worker daemon did not become ready")
        self._running[daemon] = task
        return daemon

    async def stop(self, daemon: WorkerDaemon) -> None:
        task = self._running.pop(daemon)
        daemon.request_stop()
        await asyncio.wait_for(task, timeout=15.0)

    async def stop_all(self) -> None:
        for daemon in list(self._running):
            with contextlib.suppress(Exception):
                await self.stop(daemon)


@pytest.fixture
async def workers(worker_env: WorkerEnv) -> AsyncIterator[WorkerRunner]:
    runner = WorkerRunner(worker_env)
    yield runner
    await runner.stop_all()


@pytest.fixture
async def daemon(workers: WorkerRunner) -> WorkerDaemon:
    """One running daemon serving this test's scope with ``files.publish``."""
    return await workers.start()


async def wait_session(
    daemon: WorkerDaemon, scope: str, session_id: str, status: str = "open"
) -> None:
    """Until the worker's store holds the session with ``status`` (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while loop.time() < deadline:
        sessions = await daemon.store.load_sessions(scope)
        found = sessions.get(session_id)
        if found is not None and found.status == status:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"session never reached status {status!r} at the worker")


# Host --------------------------------------------------------------------------------------


@dataclass
class HostEnv:
    ledger_path: Path
    keyring_bytes: bytes

    def store(self) -> SqliteLedgerStore:
        return SqliteLedgerStore(self.ledger_path, StorageKeyring("host-k1", self.keyring_bytes))


@pytest.fixture
def host_env(tmp_path: Path) -> HostEnv:
    return HostEnv(tmp_path / "host" / "ledger.sqlite3", secrets.token_bytes(32))


class HostFactory:
    """Started ``HostClient``s on this test's scope; closed (and stores closed) at teardown."""

    def __init__(self, env: HostEnv, worker: WorkerEnv, names: Names) -> None:
        self.env, self.worker, self.names = env, worker, names
        self._clients: list[HostClient] = []

    async def start(
        self,
        *,
        host_id: str | None = None,
        engine: WorkflowEngine | None = None,
        reply_timeout: float = WAIT,
        extra_scope_keys: dict[str, ScopeKey] | None = None,
        **kwargs: Any,
    ) -> HostClient:
        client = HostClient(
            URL,
            host_id=host_id or self.names.host(),
            scope_keys={self.worker.scope: self.worker.scope_key, **(extra_scope_keys or {})},
            store=self.env.store(),
            engine=engine,
            reply_timeout=reply_timeout,
            publish_timeout=WAIT,
            **kwargs,
        )
        await client.start()
        self._clients.append(client)
        return client

    async def close(self, client: HostClient) -> None:
        await client.close()
        await client.store.close()

    async def crash(self, client: HostClient) -> None:
        """The host process dies: it sends nothing more, not even the
        ``close_session`` frames a clean ``close()`` publishes."""
        for session in client._sessions.by_id.values():
            session.closed = True
        await self.close(client)

    async def close_all(self) -> None:
        for client in self._clients:
            with contextlib.suppress(Exception):
                await self.close(client)


@pytest.fixture
async def hosts(
    host_env: HostEnv, worker_env: WorkerEnv, names: Names
) -> AsyncIterator[HostFactory]:
    factory = HostFactory(host_env, worker_env, names)
    yield factory
    await factory.close_all()


@pytest.fixture
async def scripted(
    broker: AbstractConnection, channel: AbstractChannel, worker_env: WorkerEnv
) -> AsyncIterator[Any]:
    """A scripted worker on this test's scope (see ``scripted_worker.py``), no daemon."""
    from .scripted_worker import ScriptedWorker  # it imports this module's helpers

    worker = ScriptedWorker(channel, worker_env.scope, worker_env.scope_key)
    await worker.start(broker)
    yield worker
    worker.answer_all(None)


# Hand-crafted frames --------------------------------------------------------------------


@dataclass
class RawSession:
    session_id: str
    nonce: bytes
    auth: SessionAuthenticator


class RawHost:
    """A host made by hand: its own reply queue, frames sealed and published raw."""

    def __init__(self, channel: AbstractChannel, scope: str, host_id: str, key: ScopeKey) -> None:
        self.channel, self.scope, self.host_id, self.key = channel, scope, host_id, key
        self.reply_queue = reply_queue(host_id)
        self.replies = Inbox()

    async def start(self, broker: AbstractConnection) -> None:
        consume = await broker.channel()
        exchange = await consume.declare_exchange(
            EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
        )
        queue = await consume.declare_queue(
            self.reply_queue, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await queue.bind(exchange, routing_key=self.reply_queue)
        await queue.consume(self.replies.put)

    def session(self, key: ScopeKey | None = None) -> RawSession:
        session_id = unique("s")
        nonce = secrets.token_bytes(32)
        derived = SessionKey.derive(key or self.key, self.scope, session_id, nonce)
        return RawSession(
            session_id, nonce, SessionAuthenticator(session_id, derived, SessionRole.HOST)
        )

    def headers(self, session: RawSession, marker: str) -> dict[str, str]:
        return {
            HEADER_SCOPE: self.scope,
            HEADER_SESSION: session.session_id,
            HEADER_KEY_NONCE: session.nonce.hex(),
            "x-test-marker": marker,
        }

    async def publish(
        self,
        body: bytes,
        *,
        headers: Mapping[str, str],
        correlation_id: str | None = None,
        reply_to: str | None = None,
    ) -> None:
        await publish_confirmed(
            self.channel,
            EXCHANGE,
            worker_queue(self.scope),
            body,
            message_id=frame_message_id(body),
            correlation_id=correlation_id,
            reply_to=self.reply_queue if reply_to is None else reply_to,
            headers=headers,
            timeout=WAIT,
        )

    async def open(self, session: RawSession, marker: str = "open") -> None:
        frame = session.auth.seal(
            OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=self.reply_queue)
        )
        await self.publish(frame, headers=self.headers(session, marker))


@pytest.fixture
async def raw_host(
    broker: AbstractConnection, channel: AbstractChannel, names: Names, worker_env: WorkerEnv
) -> RawHost:
    host = RawHost(channel, names.scope, names.host("-raw"), worker_env.scope_key)
    await host.start(broker)
    return host


def marker_of(marker: str) -> Callable[[AbstractIncomingMessage], bool]:
    return lambda message: header(message, "x-test-marker") == marker


def reason_of(message: AbstractIncomingMessage) -> str | None:
    return header(message, HEADER_REASON)


class RawLongString(bytes):
    """A header value sent as an AMQP long string of exactly these bytes.

    pamqp sends only ``str`` as a long string (UTF-8); a peer may send any
    bytes, and pamqp decodes a long string that is not UTF-8 as ``bytes``.
    """


@pytest.fixture
def raw_long_strings(monkeypatch: pytest.MonkeyPatch) -> type[RawLongString]:
    """Lets this process publish :class:`RawLongString` header values."""
    original = pamqp_encode.encode_table_value

    def encode(value: Any) -> bytes:
        if isinstance(value, RawLongString):
            return b"S" + struct.pack(">I", len(value)) + bytes(value)
        return original(value)

    monkeypatch.setattr(pamqp_encode, "encode_table_value", encode)
    return RawLongString
