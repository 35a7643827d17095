"""The ``octo-worker`` command, as an operator runs it: real processes, files and broker.

Every command runs as a subprocess (``python -m octo_worker``) against real
key files, a real SQLite journal and the real RabbitMQ on 127.0.0.1:5672.
Each module gets its own RabbitMQ virtual host (made and removed with
``rabbitmqctl``), so its dead-letter queue and policies are its own and
``dlq drop --all`` touches nothing else. The daemon runs as ``octo-worker run``
with a ``NOTIFY_SOCKET`` the test listens on; a host peer (a real HOST-role
``SessionAuthenticator`` and aio-pika) opens sessions and dispatches
``files.publish`` operations through the broker.

The helpers here (``Broker``, ``WorkerFiles``, ``RunningWorker``, ``HostPeer``)
are shared with ``test_metrics.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CompensateOperation,
    CompensationResult,
    DispatchOperation,
    OpenSession,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationResult,
    RequestRejected,
    WorkerMessage,
)
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Pending, Succeeded
from octo_common.transport import (
    DEAD_EXCHANGE,
    DEAD_POLICY_NAME,
    DEAD_QUEUE,
    DEFAULT_DEAD_MAX_BYTES,
    DEFAULT_DEAD_MAX_LENGTH,
    EXCHANGE,
    WORKER_POLICY_NAME,
    build_host_publish,
    reply_queue,
    worker_queue,
)
from octo_worker.config import WorkerConfig, load_config
from octo_worker.storage.configured import configured_store
from octo_worker.store import SqliteJournalStore

from .test_worker_store_prune import _record as prune_record
from .test_worker_store_prune import _write as write_rows

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")
RABBITMQCTL = shutil.which("rabbitmqctl")
PUBLISH = "files.publish"


def broker_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


def rabbitmqctl(*args: str) -> subprocess.CompletedProcess[str]:
    assert RABBITMQCTL is not None
    return subprocess.run(
        [RABBITMQCTL, *args], capture_output=True, text=True, timeout=60, check=True
    )


# The broker: one virtual host per module ---------------------------------------------


@dataclass
class Broker:
    vhost: str

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:5672/{self.vhost}"


@contextlib.contextmanager
def private_vhost(prefix: str) -> Iterator[Broker]:
    """A fresh virtual host the guest user may use; deleted afterwards."""
    if not broker_answers():
        pytest.skip("RabbitMQ does not answer on 127.0.0.1:5672 (deploy/ensure-rabbitmq.sh)")
    if RABBITMQCTL is None:
        pytest.skip("rabbitmqctl is not installed: cannot create a private virtual host")
    vhost = f"{prefix}-{uuid.uuid4().hex[:10]}"
    rabbitmqctl("add_vhost", vhost)
    try:
        rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield Broker(vhost)
    finally:
        subprocess.run(
            [RABBITMQCTL, "delete_vhost", vhost], capture_output=True, timeout=60, check=False
        )


@pytest.fixture(scope="module")
def vhost() -> Iterator[Broker]:
    """This module's own virtual host (the conftest ``broker`` is a shared connection)."""
    with private_vhost("octo-cli") as value:
        yield value


# Files: configuration, keys, state --------------------------------------------------


def write_key(path: Path, data: bytes | None = None, mode: int = 0o600) -> bytes:
    key = data if data is not None else os.urandom(32)
    path.write_bytes(key)
    path.chmod(mode)
    return key


@dataclass
class WorkerFiles:
    """One worker's directory: config, scope and storage keys, state directory."""

    root: Path
    broker_url: str
    scope: str
    scope_key: bytes = b""
    extra: str = ""
    adapters: tuple[str, ...] = (PUBLISH,)
    metrics_listen: str | None = None
    delivery_limit: int | None = None

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.scope_key:
            self.scope_key = write_key(self.root / "scope.key")
        if not (self.root / "storage.key").exists():
            write_key(self.root / "storage.key")
        self.write()

    @property
    def config(self) -> Path:
        return self.root / "worker.toml"

    @property
    def journal(self) -> Path:
        return self.root / "state" / "journal.sqlite3"

    @property
    def published(self) -> Path:
        """``files.publish``'s files of this scope (a directory per scope)."""
        return self.root / "state" / "published" / self.scope

    def write(self, text: str | None = None) -> Path:
        if text is None:
            enabled = ", ".join(f'"{name}"' for name in self.adapters)
            limit = "" if self.delivery_limit is None else f"delivery_limit = {self.delivery_limit}"
            metrics = (
                ""
                if self.metrics_listen is None
                else f'[metrics]\nlisten = "{self.metrics_listen}"'
            )
            options = (
                '[adapters.options."files.publish"]\n'
                'target_dir = "./published"\neffect_log = "./effects.log"\n'
                if PUBLISH in self.adapters
                else ""
            )
            text = f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 5
log_level = "info"

[broker]
url = "{self.broker_url}"
connect_timeout_seconds = 3
reconnect_initial_seconds = 0.2
reconnect_max_seconds = 1
{limit}

[storage]
journal = "journal.sqlite3"
key = {{ id = "k1", key_file = "storage.key" }}

[[scopes]]
name = "{self.scope}"
key_file = "scope.key"

[adapters]
enabled = [{enabled}]
{options}
{metrics}
{self.extra}
"""
        self.config.write_text(text)
        return self.config


def octo_worker(
    *args: str, config: Path | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    argv = [PYTHON, "-m", "octo_worker", *args]
    if config is not None:
        argv += ["--config", str(config)]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


def octo_worker_each(
    *argvs: list[str], config: Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Several independent commands at once (each is a process start: run them together)."""
    processes = []
    for args in argvs:
        argv = [PYTHON, "-m", "octo_worker", *args]
        if config is not None:
            argv += ["--config", str(config)]
        processes.append(
            subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
            )
        )
    results = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=60)
        results.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return results


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("octo-worker: "), stderr
    return lines[0]


def run_error(stderr: str) -> str:
    """``run``'s stderr is its log: JSON lines, then the one error line."""
    *logs, last = stderr.strip().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in logs), stderr
    assert "Traceback" not in stderr
    assert last.startswith("octo-worker: "), stderr
    return last


def json_out(result: subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout)


# The daemon, as systemd runs it --------------------------------------------------------


class NotifyListener:
    """An abstract AF_UNIX datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self) -> None:
        self.name = f"@octo-test-notify-{uuid.uuid4().hex}"
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind("\0" + self.name[1:])
        self.received: list[str] = []

    def wait_for(self, state: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(state in datagram.splitlines() for datagram in self.received):
                return True
            self.socket.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                data = self.socket.recv(4096)
            except TimeoutError:
                break
            self.received.append(data.decode())
        return any(state in datagram.splitlines() for datagram in self.received)

    def drain(self) -> None:
        """Collect what already arrived, without waiting."""
        self.socket.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self.received.append(self.socket.recv(4096).decode())

    def close(self) -> None:
        if self.socket.fileno() >= 0:
            self.drain()
        self.socket.close()


@dataclass
class RunningWorker:
    process: subprocess.Popen[str]
    notify: NotifyListener
    files: WorkerFiles
    stderr_path: Path
    stopped: bool = False

    @classmethod
    def start(
        cls,
        files: WorkerFiles,
        *,
        ready_timeout: float = 20.0,
        wrapper: list[str] | None = None,
        env: dict[str, str] | None = None,
        watchdog_usec: int | None = None,
    ) -> RunningWorker:
        notify = NotifyListener()
        env = dict(env or os.environ, NOTIFY_SOCKET=notify.name)
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        if watchdog_usec is not None:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        stderr_path = files.root / "run.stderr"
        with stderr_path.open("w") as stderr:
            process = subprocess.Popen(
                [
                    *(wrapper or []),
                    PYTHON,
                    "-m",
                    "octo_worker",
                    "run",
                    "--config",
                    str(files.config),
                ],
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
                env=env,
                cwd=REPO,
            )
        worker = cls(process, notify, files, stderr_path)
        if not notify.wait_for("READY=1", ready_timeout):
            worker.kill()
            pytest.fail(f"octo-worker run never sent READY=1: {worker.log()[-2000:]}")
        return worker

    def log(self) -> str:
        return self.stderr_path.read_text()

    def log_events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log().splitlines() if line.startswith("{")]

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then the exit status (what systemd's stop does)."""
        if not self.stopped:
            self.process.send_signal(signal.SIGTERM)
            self.stopped = True
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.notify.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.stopped = True
        self.notify.close()


# The host side ---------------------------------------------------------------------------


@dataclass
class HostPeer:
    """A host that opens one session and dispatches through the real broker."""

    url: str
    scope: str
    scope_key: bytes
    host_id: str = field(default_factory=lambda: f"host-{uuid.uuid4().hex[:8]}")
    session_id: str = field(default_factory=lambda: f"session-{uuid.uuid4().hex[:8]}")
    nonce: bytes = field(default_factory=lambda: os.urandom(32))

    def __post_init__(self) -> None:
        key = SessionKey.derive(
            ScopeKey.from_bytes(self.scope_key), self.scope, self.session_id, self.nonce
        )
        self.host = SessionAuthenticator(self.session_id, key, SessionRole.HOST)
        self.counter = 0

    async def publish(
        self, channel: aio_pika.abc.AbstractChannel, frame: bytes, correlation: str | None
    ) -> None:
        envelope = build_host_publish(
            self.scope,
            self.session_id,
            self.nonce,
            frame,
            reply_to=reply_queue(self.host_id),
            correlation_id=correlation,
        )
        exchange = await channel.get_exchange(EXCHANGE, ensure=False)
        await exchange.publish(
            aio_pika.Message(
                envelope.body,
                headers=dict(envelope.headers),
                message_id=envelope.message_id,
                correlation_id=envelope.correlation_id,
                reply_to=envelope.reply_to,
                content_type=envelope.content_type,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            envelope.routing_key,
            mandatory=True,
        )

    async def dispatch_files(
        self, names: list[str], timeout: float = 15.0
    ) -> list[tuple[str, Any]]:
        """Open the session, dispatch one publish per name; return (key, answer)."""
        payloads = [ToolPayload.json({"name": n, "content": f"content of {n}"}) for n in names]
        return await self.dispatch(PUBLISH, payloads, timeout=timeout)

    async def dispatch(
        self, tool: str, payloads: list[ToolPayload], timeout: float = 15.0
    ) -> list[tuple[str, Any]]:
        """Open the session, dispatch one operation per payload; return (key, answer)."""
        connection = await aio_pika.connect(self.url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            replies = await channel.declare_queue(
                reply_queue(self.host_id), durable=True, arguments={"x-queue-type": "quorum"}
            )
            exchange = await channel.get_exchange(EXCHANGE, ensure=False)
            await replies.bind(exchange, routing_key=reply_queue(self.host_id))
            grant = CapabilityGrant(
                tool, "json", max_calls=16, max_input_bytes=1024, max_output_bytes=1024
            )
            manifest = CapabilityManifest(self.session_id, [grant])
            await self.publish(
                channel,
                self.host.seal(OpenSession(manifest, reply_to=reply_queue(self.host_id))),
                None,
            )
            keys: dict[str, str] = {}
            for payload in payloads:
                self.counter += 1
                request_id = f"dispatch-{self.counter}"
                key = f"op-{uuid.uuid4().hex}"
                keys[request_id] = key
                request = OperationDispatchRequest(self.session_id, request_id, tool, key, payload)
                await self.publish(channel, self.host.seal(DispatchOperation(request)), request_id)
            answers: dict[str, WorkerMessage] = {}
            async with asyncio.timeout(timeout):
                async with replies.iterator() as messages:
                    async for message in messages:
                        await message.ack()
                        answer = self.host.open(message.body)
                        answers[str(message.correlation_id)] = answer
                        if len(answers) == len(keys):
                            break
            return [(keys[rid], answers[rid]) for rid in keys]
        finally:
            await connection.close()

    async def dispatch_then_compensate(
        self, name: str, timeout: float = 15.0
    ) -> tuple[str, str, list[Any]]:
        """Publish ``name``, then undo it: (operation key, compensation key, answers)."""
        grant = CapabilityGrant(
            PUBLISH,
            "json",
            max_calls=16,
            max_input_bytes=1024,
            max_output_bytes=1024,
            max_compensations=1,
        )
        key = f"op-{uuid.uuid4().hex}"
        undo_key = f"cmp-{uuid.uuid4().hex}"
        dispatch = DispatchOperation(
            OperationDispatchRequest(
                self.session_id,
                "dispatch-undo-1",
                PUBLISH,
                key,
                ToolPayload.json({"name": name, "content": f"content of {name}"}),
            )
        )
        binding = OperationCompensationBinding(
            PUBLISH, key, undo_key, self.scope, grant.compensation_fingerprint()
        )
        compensate = CompensateOperation(
            OperationCompensationRequest(
                self.session_id,
                "compensate-undo-1",
                binding,
                ToolPayload.json({"undo": "publish", "name": name}),
            )
        )
        connection = await aio_pika.connect(self.url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            replies = await channel.declare_queue(
                reply_queue(self.host_id), durable=True, arguments={"x-queue-type": "quorum"}
            )
            exchange = await channel.get_exchange(EXCHANGE, ensure=False)
            await replies.bind(exchange, routing_key=reply_queue(self.host_id))
            manifest = CapabilityManifest(self.session_id, [grant])
            await self.publish(
                channel,
                self.host.seal(OpenSession(manifest, reply_to=reply_queue(self.host_id))),
                None,
            )
            answers: list[Any] = []
            async with asyncio.timeout(timeout), replies.iterator() as messages:
                # One request at a time: the compensation needs the success first.
                for message, request_id in (
                    (dispatch, "dispatch-undo-1"),
                    (compensate, "compensate-undo-1"),
                ):
                    await self.publish(channel, self.host.seal(message), request_id)
                    async for reply in messages:
                        await reply.ack()
                        answers.append(self.host.open(reply.body))
                        break
            return key, undo_key, answers
        finally:
            await connection.close()

    async def dispatch_without_waiting(self, tool: str, payload: ToolPayload) -> str:
        """Open the session and publish one dispatch; returns its operation key."""
        connection = await aio_pika.connect(self.url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            replies = await channel.declare_queue(
                reply_queue(self.host_id), durable=True, arguments={"x-queue-type": "quorum"}
            )
            exchange = await channel.get_exchange(EXCHANGE, ensure=False)
            await replies.bind(exchange, routing_key=reply_queue(self.host_id))
            grant = CapabilityGrant(tool, "json", max_calls=4)
            manifest = CapabilityManifest(self.session_id, [grant])
            await self.publish(
                channel,
                self.host.seal(OpenSession(manifest, reply_to=reply_queue(self.host_id))),
                None,
            )
            key = f"op-{uuid.uuid4().hex}"
            request = OperationDispatchRequest(self.session_id, "dispatch-1", tool, key, payload)
            await self.publish(channel, self.host.seal(DispatchOperation(request)), "dispatch-1")
            return key
        finally:
            await connection.close()

    async def publish_garbage(self, headers: dict[str, Any], body: bytes) -> str:
        """A frame the daemon must dead-letter; returns its message id."""
        message_id = f"garbage-{uuid.uuid4().hex[:12]}"
        connection = await aio_pika.connect(self.url, timeout=5)
        try:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(EXCHANGE, ensure=False)
            await exchange.publish(
                aio_pika.Message(body, headers=headers, message_id=message_id),
                worker_queue(self.scope),
                mandatory=True,
            )
        finally:
            await connection.close()
        return message_id


def succeeded(answer: Any) -> bool:
    return isinstance(answer, OperationResult) and isinstance(answer.result.status, Succeeded)


def wait_until(condition: Any, timeout: float = 10.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


# Module fixtures: one running daemon and one real dispatch ------------------------------

SCOPE = "tenant-release"


@pytest.fixture(scope="module")
def worker(vhost: Broker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    files = WorkerFiles(tmp_path_factory.mktemp("worker"), vhost.url, SCOPE)
    running = RunningWorker.start(files)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()
        running.kill()


@pytest.fixture(scope="module")
def dispatched(worker: RunningWorker, vhost: Broker) -> list[str]:
    """Two files published through the broker; returns their operation keys."""
    peer = HostPeer(vhost.url, SCOPE, worker.files.scope_key)
    answers = asyncio.run(peer.dispatch_files(["release-1.txt", "release-2.txt"]))
    assert all(succeeded(answer) for _, answer in answers), answers
    assert sorted(p.name for p in worker.files.published.iterdir() if not p.name.startswith("."))
    return [key for key, _ in answers]


# check -----------------------------------------------------------------------------------


def test_check_passes_on_a_good_config_with_the_daemon_running(worker: RunningWorker) -> None:
    result = octo_worker("check", config=worker.files.config)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    names = [line.split(": ", 1)[0] for line in lines]
    assert names == [
        "config",
        f"scope key {SCOPE}",
        "storage keys",
        "key roles",
        "adapters",
        "journal",
        "broker",
    ]
    assert all(": ok: " in line for line in lines), lines
    assert "1/1 scope queue(s) declared" in lines[-1]
    assert "guest" not in result.stdout  # the broker URL is shown without credentials

    document = json_out(octo_worker("check", "--json", config=worker.files.config))
    assert document["ok"] is True
    assert {check["name"] for check in document["checks"]} >= {"journal", "broker", "adapters"}


def test_bad_config_key_is_exit_2_with_one_line_naming_it(tmp_path: Path, vhost: Broker) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-bad", extra="")
    files.write(files.config.read_text().replace("[worker]\n", '[worker]\ncolour = "blue"\n'))
    verbs = (["check"], ["run"], ["journal", "list"], ["dlq", "list"])
    for verb, result in zip(verbs, octo_worker_each(*verbs, config=files.config), strict=True):
        assert result.returncode == 2, (verb, result.stderr)
        line = one_line(result.stderr)
        assert "colour" in line and "worker" in line, line

    missing = octo_worker("check", config=tmp_path / "nowhere.toml")
    assert missing.returncode == 2
    assert "nowhere.toml does not exist" in one_line(missing.stderr)


def test_world_readable_key_file_is_refused_with_a_chmod_hint(
    tmp_path: Path, vhost: Broker
) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-perm")
    (tmp_path / "scope.key").chmod(0o644)
    result = octo_worker("check", config=files.config)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert str(tmp_path / "scope.key") in line and "chmod 600" in line, line
    assert "scope key tenant-perm: FAIL" in result.stdout

    run = octo_worker("run", config=files.config)  # refused before it connects
    assert run.returncode == 2
    line = run_error(run.stderr)
    assert str(tmp_path / "scope.key") in line and "chmod 600" in line, line

    (tmp_path / "scope.key").chmod(0o600)
    (tmp_path / "storage.key").write_bytes(b"short")
    short = octo_worker("check", config=files.config)
    assert short.returncode == 2
    assert "storage keys: FAIL" in short.stdout
    assert "32 raw bytes or 64 lowercase hex" in one_line(short.stderr)


def test_unknown_adapter_is_a_clear_configuration_error(tmp_path: Path, vhost: Broker) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-adapter", adapters=("nope.adapter",))
    result = octo_worker("check", config=files.config)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "nope.adapter" in line and "octo.adapters" in line, line

    listing = octo_worker("adapters", "list", "--json", config=files.config)
    assert listing.returncode == 1
    assert "nope.adapter" in one_line(listing.stderr)
    rows = {item["name"]: item for item in json.loads(listing.stdout)["adapters"]}
    assert rows["nope.adapter"]["enabled"] is True
    assert rows["nope.adapter"]["installed"] is False
    assert rows[PUBLISH]["enabled"] is False and rows[PUBLISH]["installed"] is True

    run = octo_worker("run", config=files.config)
    assert run.returncode == 2
    assert "nope.adapter" in run_error(run.stderr)


def test_unreachable_broker_is_exit_3_in_one_line(tmp_path: Path) -> None:
    files = WorkerFiles(tmp_path, "amqp://127.0.0.1:1/", "tenant-down")
    result = octo_worker("check", config=files.config)
    assert result.returncode == 3, result.stderr
    line = one_line(result.stderr)
    assert "broker" in line and "unreachable" in line and "127.0.0.1:1" in line
    assert "guest" not in result.stderr + result.stdout
    assert "broker: FAIL" in result.stdout
    assert "journal: ok" in result.stdout  # every other check still ran

    verbs = (["topology", "show"], ["topology", "declare"], ["dlq", "list"])
    for verb, failed in zip(verbs, octo_worker_each(*verbs, config=files.config), strict=True):
        assert failed.returncode == 3, (verb, failed.stderr)
        assert "unreachable" in one_line(failed.stderr)


def test_usage_errors_are_exit_2_in_one_line() -> None:
    argvs = (["frobnicate"], ["journal"], ["dlq", "show", "zero"], ["dlq", "drop"], ["--help"])
    *errors, helped = octo_worker_each(*argvs)
    for argv, result in zip(argvs, errors, strict=False):
        assert result.returncode == 2, argv
        assert one_line(result.stderr).count("octo-worker") == 1, result.stderr
    assert helped.returncode == 0


# topology --------------------------------------------------------------------------------


def test_topology_declare_applies_the_policy_and_show_counts(tmp_path: Path, vhost: Broker) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-topology")
    declared = octo_worker(
        "topology",
        "declare",
        "--delivery-limit",
        "7",
        "--host-id",
        "host-1",
        "--json",
        config=files.config,
    )
    assert declared.returncode == 0, declared.stderr
    report = json_out(declared)
    assert report["queues"] == [
        "octo.v5.dead",
        "octo.v5.dead.log",
        worker_queue("tenant-topology"),
        reply_queue("host-1"),
    ]
    assert report["policy"] == {
        "name": WORKER_POLICY_NAME,
        "delivery_limit": 7,
        "applied_via": "rabbitmqctl",
    }
    policies = json.loads(
        rabbitmqctl("list_policies", "-p", vhost.vhost, "--formatter", "json").stdout
    )
    (policy,) = [p for p in policies if p["name"] == WORKER_POLICY_NAME]
    definition = policy["definition"]
    if isinstance(definition, str):
        definition = json.loads(definition)
    assert definition == {"delivery-limit": 7, "dead-letter-exchange": "octo.v5.dead"}
    # The dead-letter queue's bound, from [broker] (defaults here).
    assert report["dead_letter_policy"] == {
        "name": DEAD_POLICY_NAME,
        "max_length": DEFAULT_DEAD_MAX_LENGTH,
        "max_length_bytes": DEFAULT_DEAD_MAX_BYTES,
        "overflow": "drop-head",
        "applied_via": "rabbitmqctl",
    }
    (dead_policy,) = [p for p in policies if p["name"] == DEAD_POLICY_NAME]
    dead_definition = dead_policy["definition"]
    if isinstance(dead_definition, str):
        dead_definition = json.loads(dead_definition)
    assert dead_policy["pattern"] == r"^octo\.v5\.dead$"
    assert dead_definition == {
        "max-length": DEFAULT_DEAD_MAX_LENGTH,
        "max-length-bytes": DEFAULT_DEAD_MAX_BYTES,
        "overflow": "drop-head",
    }
    queues = rabbitmqctl("list_queues", "-p", vhost.vhost, "name", "policy", "--formatter", "json")
    assert {row["name"]: row["policy"] for row in json.loads(queues.stdout)}[
        "octo.v5.dead"
    ] == DEAD_POLICY_NAME

    shown = json_out(
        octo_worker("topology", "show", "--host-id", "host-1", "--json", config=files.config)
    )
    by_name = {queue["name"]: queue for queue in shown["queues"]}
    assert by_name[worker_queue("tenant-topology")] == {
        "name": worker_queue("tenant-topology"),
        "exists": True,
        "messages": 0,
        "consumers": 0,
    }
    assert by_name[reply_queue("host-1")]["exists"] is True
    human = octo_worker("topology", "show", config=files.config)
    assert worker_queue("tenant-topology") in human.stdout

    gone = octo_worker("topology", "show", "--host-id", "host-never", "--json", config=files.config)
    assert {q["name"]: q["exists"] for q in json_out(gone)["queues"]}[
        reply_queue("host-never")
    ] is False


def test_topology_show_sees_the_running_daemon_consume(worker: RunningWorker) -> None:
    shown = json_out(octo_worker("topology", "show", "--json", config=worker.files.config))
    by_name = {queue["name"]: queue for queue in shown["queues"]}
    assert by_name[worker_queue(SCOPE)]["consumers"] == 1


# journal ---------------------------------------------------------------------------------


def test_journal_list_show_and_verify_after_a_real_dispatch(
    worker: RunningWorker, dispatched: list[str]
) -> None:
    config = worker.files.config
    listed = octo_worker("journal", "list", "--json", config=config)
    assert listed.returncode == 0, listed.stderr
    records = {r["operation_key"]: r for r in json_out(listed)["records"]}
    for key in dispatched:
        assert records[key]["tool"] == PUBLISH
        assert records[key]["state"] == "succeeded"
        assert records[key]["compensation_state"] is None
        assert records[key]["scope"] == SCOPE
        assert records[key]["revision"] >= 1
    human = octo_worker("journal", "list", "--scope", SCOPE, config=config)
    assert all(key in human.stdout for key in dispatched)
    assert "content of" not in listed.stdout + human.stdout  # never a payload

    shown = octo_worker("journal", "show", dispatched[0], "--json", config=config)
    assert shown.returncode == 0, shown.stderr
    (record,) = json_out(shown)["records"]
    assert record["operation_key"] == dispatched[0]
    assert len(record["input_fingerprint"]) == 64
    assert record["state"] == "succeeded"
    assert record["payload"]["format"] == "json" and record["payload"]["bytes"] > 0
    assert record["compensation"] is None
    human_show = octo_worker("journal", "show", dispatched[0], config=config)
    assert "payload: json" in human_show.stdout
    assert "content of" not in shown.stdout + human_show.stdout

    missing = octo_worker("journal", "show", "op-nothing-here", config=config)
    assert missing.returncode == 1
    assert "op-nothing-here" in one_line(missing.stderr)
    other_scope = octo_worker("journal", "list", "--scope", "tenant-none", config=config)
    assert other_scope.returncode == 1
    one_line(other_scope.stderr)

    verified = octo_worker("journal", "verify", "--json", config=config)
    assert verified.returncode == 0, verified.stderr
    report = json_out(verified)
    assert report["integrity_check"] == ["ok"]
    assert report["first_failure"] is None
    assert report["scopes"][SCOPE]["journal_rows"] >= len(dispatched)
    assert report["scopes"][SCOPE]["sessions"] >= 1


def test_journal_verify_with_a_wrong_storage_key_names_the_first_failure(
    worker: RunningWorker, dispatched: list[str], tmp_path: Path
) -> None:
    impostor = tmp_path / "impostor"
    impostor.mkdir()
    write_key(impostor / "storage.key")  # same key id, other bytes
    text = (
        worker.files.config.read_text()
        .replace('state_dir = "state"', f'state_dir = "{worker.files.root / "state"}"')
        .replace('key_file = "scope.key"', f'key_file = "{worker.files.root / "scope.key"}"')
    )
    (impostor / "worker.toml").write_text(text)
    result = octo_worker("journal", "verify", "--json", config=impostor / "worker.toml")
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert f"scope {SCOPE}" in line, line
    report = json_out(result)
    assert report["ok"] is False
    assert report["first_failure"].startswith(f"scope {SCOPE}: ")
    listing = octo_worker("journal", "list", config=impostor / "worker.toml")
    assert listing.returncode == 4
    assert f"scope {SCOPE}" in one_line(listing.stderr)


def test_journal_prune_rejects_a_bad_duration(worker: RunningWorker) -> None:
    bad = octo_worker("journal", "prune", "--older-than", "thirty", config=worker.files.config)
    assert bad.returncode == 2
    assert "not a duration" in one_line(bad.stderr)
    recent = octo_worker(
        "journal", "prune", "--older-than", "1h", "--json", config=worker.files.config
    )
    assert recent.returncode == 0, recent.stderr
    assert json_out(recent)["removed"] == 0  # every row here was written moments ago


def test_journal_verbs_never_create_a_database(tmp_path: Path, vhost: Broker) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-empty")
    result = octo_worker("journal", "list", config=files.config)
    assert result.returncode == 1
    assert "does not exist" in one_line(result.stderr)
    assert not files.journal.exists()


# adapters --------------------------------------------------------------------------------


def test_adapters_list_marks_enabled_and_reports_the_contract(worker: RunningWorker) -> None:
    result = octo_worker("adapters", "list", "--json", config=worker.files.config)
    assert result.returncode == 0, result.stderr
    rows = {item["name"]: item for item in json_out(result)["adapters"]}
    publish = rows[PUBLISH]
    assert publish["enabled"] is True and publish["installed"] is True
    assert publish["entry_point"] == "octo_worker.adapters.files:FilesPublishAdapter"
    assert publish["durable_operation_contract"] == "reconciliation"
    assert publish["invocation_safety"] is None
    assert publish["deadline_seconds"] > 0
    human = octo_worker("adapters", "list", config=worker.files.config)
    assert PUBLISH in human.stdout and "reconciliation" in human.stdout


# dlq ---------------------------------------------------------------------------------------


def dlq_entries(config: Path, *args: str) -> list[dict[str, Any]]:
    result = octo_worker("dlq", "list", "--json", *args, config=config)
    assert result.returncode == 0, result.stderr
    entries: list[dict[str, Any]] = json_out(result)["entries"]
    return entries


def dead_queue_length(config: Path) -> int:
    shown = octo_worker("topology", "show", "--json", config=config)
    assert shown.returncode == 0, shown.stderr
    (dead,) = [q for q in json_out(shown)["queues"] if q["name"] == DEAD_QUEUE]
    return int(dead["messages"])


async def _publish_dead_letter(url: str, headers: dict[str, Any]) -> str:
    """A letter published straight to the dead-letter exchange (no scope queue)."""
    message_id = f"foreign-{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel(publisher_confirms=True)
        dead = await channel.get_exchange(DEAD_EXCHANGE, ensure=False)
        await dead.publish(aio_pika.Message(b"x", headers=headers, message_id=message_id), "")
    finally:
        await connection.close()
    return message_id


def test_dlq_list_show_drop_after_the_daemon_dead_letters_garbage(
    worker: RunningWorker, vhost: Broker
) -> None:
    config = worker.files.config
    peer = HostPeer(vhost.url, SCOPE, worker.files.scope_key)
    wrong_scope = asyncio.run(
        peer.publish_garbage({"octo-scope": "tenant-other"}, b"not a frame \x00\xff")
    )
    junk_body = asyncio.run(
        peer.publish_garbage(
            {"octo-scope": SCOPE, "octo-session": "session-x", "octo-key-nonce": "ab" * 32},
            b'{"no":"frame"}',
        )
    )
    foreign = asyncio.run(
        _publish_dead_letter(vhost.url, {"octo-scope": "tenant-elsewhere", "octo-reason": "x"})
    )

    def both_listed() -> list[dict[str, Any]] | None:
        """Our two dead letters in one listing (one ``dlq list`` process a look)."""
        ours = [e for e in dlq_entries(config) if e["message_id"] in (wrong_scope, junk_body)]
        return ours if len(ours) == 2 else None

    entries = wait_until(both_listed)
    assert entries, worker.log()[-2000:]
    by_id = {entry["message_id"]: entry for entry in entries}
    # Dead-lettered from this worker's queue: its scope, whatever the header said.
    assert by_id[wrong_scope]["reason"] == "scope_mismatch"
    assert by_id[wrong_scope]["queue_scope"] == SCOPE
    assert by_id[wrong_scope]["scope"] == "tenant-other"
    assert by_id[wrong_scope]["size"] == len(b"not a frame \x00\xff")
    assert by_id[junk_body]["reason"] == "serialization"
    assert by_id[junk_body]["session"] == "session-x"
    assert "body_text" not in by_id[junk_body]  # never the body unless asked
    # This worker's scopes by default; another scope's letter with --all-scopes.
    assert foreign not in [e["message_id"] for e in dlq_entries(config)]
    everyone = wait_until(
        lambda: [e for e in dlq_entries(config, "--all-scopes") if e["message_id"] == foreign]
    )
    assert everyone and everyone[0]["queue_scope"] == "tenant-elsewhere"

    # Reading changes nothing: the same letters under the same ids, every time.
    again = dlq_entries(config)
    assert again == dlq_entries(config) == entries
    assert [e["id"] for e in again] == sorted(e["id"] for e in again)
    human = octo_worker("dlq", "list", config=config)
    assert "reason=scope_mismatch" in human.stdout and "not a frame" not in human.stdout
    # Pages: one letter, then the next after its id.
    (first,) = dlq_entries(config, "--limit", "1")
    paged = octo_worker("dlq", "list", "--json", "--limit", "1", config=config)
    assert json_out(paged)["next_after"] == first["id"]
    (second,) = dlq_entries(config, "--limit", "1", "--after", str(first["id"]))
    assert second["id"] > first["id"] and second == again[1]

    letter = by_id[junk_body]["id"]
    shown = octo_worker("dlq", "show", str(letter), "--json", config=config)
    assert json_out(shown)["entry"]["message_id"] == junk_body
    assert "body_text" not in json_out(shown)["entry"]
    with_body = octo_worker("dlq", "show", str(letter), "--body", "--json", config=config)
    assert json_out(with_body)["entry"]["body_text"] == '{"no":"frame"}'
    beyond = octo_worker("dlq", "show", str(again[-1]["id"] + 1000), config=config)
    assert beyond.returncode == 1 and "no letter with id" in one_line(beyond.stderr)
    other = octo_worker("dlq", "show", str(letter), "--message-id", wrong_scope, config=config)
    assert other.returncode == 1  # the guard: id and message id disagree

    alone = octo_worker("dlq", "drop", config=config)
    assert alone.returncode == 2 and "--message-id" in one_line(alone.stderr)
    assert dead_queue_length(config) == 3

    dropped = octo_worker("dlq", "drop", "--message-id", junk_body, "--json", config=config)
    assert dropped.returncode == 0, dropped.stderr
    assert json_out(dropped)["entry"]["message_id"] == junk_body
    # Every list and show above left the queue's letters undelivered: the drop
    # is the first delivery of this letter (no delivery count yet).
    assert json_out(dropped)["entry"]["delivery_count"] in (None, 0)
    assert dead_queue_length(config) == 2
    unknown = octo_worker("dlq", "drop", "--message-id", "no-such-id", config=config)
    assert unknown.returncode == 1 and "no message with message id" in one_line(unknown.stderr)
    assert dead_queue_length(config) == 2

    everything = octo_worker("dlq", "drop", "--all", "--json", config=config)
    assert json_out(everything)["dropped"] == 2
    assert dead_queue_length(config) == 0
    # The log keeps its copies until retention removes them.
    assert dlq_entries(config) == entries


# run ---------------------------------------------------------------------------------------


def test_run_reaches_ready_and_exits_0_on_sigterm_within_the_grace(
    tmp_path: Path, vhost: Broker
) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-sigterm")
    started = time.monotonic()
    running = RunningWorker.start(files)
    try:
        assert time.monotonic() - started < 20
        ready = next(d for d in running.notify.received if "READY=1" in d.splitlines())
        assert "STATUS=serving 1 scope(s)" in ready.splitlines()
        stopping_at = time.monotonic()
        status = running.stop(timeout=15)
        assert status == 0, running.log()[-2000:]
        assert time.monotonic() - stopping_at < 5 + 5  # shutdown_grace_seconds + slack
    finally:
        running.kill()
    assert any("STOPPING=1" in d.splitlines() for d in running.notify.received)
    events = running.log_events()
    assert {"worker_started", "worker_consuming", "worker_stopped"} <= {e["event"] for e in events}
    assert all("timestamp" in e and "level" in e for e in events)
    assert "Traceback" not in running.log()


def test_daemon_declares_queues_and_topology_declare_adds_the_policy(tmp_path: Path) -> None:
    """The daemon declares its queues only; the policy is an operator step."""
    with private_vhost("octo-policy") as own:
        files = WorkerFiles(tmp_path, own.url, "tenant-policy", delivery_limit=3)
        running = RunningWorker.start(files)
        try:

            def policies() -> list[dict[str, Any]]:
                listed = rabbitmqctl("list_policies", "-p", own.vhost, "--formatter", "json")
                return [p for p in json.loads(listed.stdout) if p["name"] == WORKER_POLICY_NAME]

            assert policies() == []
            declared = octo_worker("topology", "declare", "--json", config=files.config)
            assert declared.returncode == 0, declared.stderr
            assert json_out(declared)["policy"]["delivery_limit"] == 3  # [broker] delivery_limit
            (policy,) = policies()
            definition = policy["definition"]
            if isinstance(definition, str):
                definition = json.loads(definition)
            assert definition == {"delivery-limit": 3, "dead-letter-exchange": "octo.v5.dead"}
            assert running.process.poll() is None  # re-declaring beside it is harmless
        finally:
            assert running.stop() == 0


async def commit_beside_the_anchor(files: WorkerFiles) -> None:
    """One commit by a store that does not update the anchor file."""
    store = SqliteJournalStore(
        files.journal, StorageKeyring("k1", (files.root / "storage.key").read_bytes())
    )
    try:
        await write_rows(store, [prune_record("op-beside", Pending())])
    finally:
        await store.close()


def test_rollback_anchor_is_created_by_init_anchor_and_checked(
    tmp_path: Path, vhost: Broker
) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-anchor")
    files.write(
        files.config.read_text().replace(
            'journal = "journal.sqlite3"', 'journal = "journal.sqlite3"\nanchor = "journal.anchor"'
        )
    )
    anchor = tmp_path / "state" / "journal.anchor"
    before = octo_worker("check", config=files.config)
    assert before.returncode == 4
    assert "journal init-anchor" in one_line(before.stderr)
    assert "journal: FAIL" in before.stdout

    created = octo_worker("journal", "init-anchor", "--json", config=files.config)
    assert created.returncode == 0, created.stderr
    assert json_out(created)["anchor"] == str(anchor)
    assert anchor.stat().st_mode & 0o777 == 0o600
    assert octo_worker("check", config=files.config).returncode == 0

    again = octo_worker("journal", "init-anchor", config=files.config)
    assert again.returncode == 1
    assert "--force" in one_line(again.stderr)
    assert octo_worker("journal", "init-anchor", "--force", config=files.config).returncode == 0

    # Inspection writes nothing, even with the anchor behind the database
    # (a daemon between its commit and its anchor write): the daemon replaces
    # that file after each commit, and a second writer could break its commit.
    asyncio.run(commit_beside_the_anchor(files))
    behind = anchor.read_bytes()
    for argv in (
        ["journal", "list"],
        ["journal", "verify"],
        ["check"],
        ["journal", "reseal"],
        ["journal", "prune", "--older-than", "1h"],
    ):
        octo_worker(*argv, config=files.config)
    assert anchor.read_bytes() == behind

    anchor.unlink()
    missing = octo_worker("journal", "verify", config=files.config)
    assert missing.returncode == 4
    assert "rollback_anchor_missing" in one_line(missing.stderr)


MDWE_WRAPPER = """
import ctypes, os, sys
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0):
    sys.exit(97)
os.execv(sys.argv[1], sys.argv[1:])
"""


def test_run_serves_under_memory_deny_write_execute(tmp_path: Path, vhost: Broker) -> None:
    """The unit's MemoryDenyWriteExecute=yes, emulated with prctl(PR_SET_MDWE).

    The flag survives execve, so the whole daemon (CPython, aio-pika, SQLite,
    cryptography, BLAKE3, msgspec, the files.publish adapter) runs with
    writable+executable mappings refused, exactly as systemd would run it.
    """
    probe = subprocess.run(
        [PYTHON, "-c", MDWE_WRAPPER, PYTHON, "-c", "pass"], capture_output=True, check=False
    )
    if probe.returncode == 97:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux >= 6.3)")
    files = WorkerFiles(tmp_path, vhost.url, "tenant-mdwe")
    running = RunningWorker.start(files, wrapper=[PYTHON, "-c", MDWE_WRAPPER])
    try:
        peer = HostPeer(vhost.url, "tenant-mdwe", files.scope_key)
        answers = asyncio.run(peer.dispatch_files(["mdwe.txt"]))
        assert all(succeeded(answer) for _, answer in answers), running.log()[-2000:]
        assert (files.published / "mdwe.txt").read_text() == "content of mdwe.txt"
    finally:
        status = running.stop()
        running.kill()
    assert status == 0, running.log()[-2000:]


def test_rabbitmq_definitions_import_and_agree_with_topology_declare(tmp_path: Path) -> None:
    """deploy/rabbitmq-definitions.json, imported with rabbitmqctl into a private vhost."""
    from octo_common.transport import (
        DEAD_POLICY_PATTERN,
        DEFAULT_DELIVERY_LIMIT,
        WORKER_POLICY_PATTERN,
    )
    from octo_worker.daemon.topology import POLICY_PRIORITY, dead_letter_policy_definition

    definitions = json.loads((REPO / "deploy" / "rabbitmq-definitions.json").read_text())
    policy, dead_policy = definitions["policies"]
    assert policy["name"] == WORKER_POLICY_NAME
    assert policy["pattern"] == WORKER_POLICY_PATTERN
    assert policy["priority"] == POLICY_PRIORITY
    assert policy["definition"] == {
        "delivery-limit": DEFAULT_DELIVERY_LIMIT,
        "dead-letter-exchange": "octo.v5.dead",
    }
    # The dead-letter bound the file applies is the one `topology declare` applies.
    assert dead_policy["name"] == DEAD_POLICY_NAME
    assert dead_policy["pattern"] == DEAD_POLICY_PATTERN
    assert dead_policy["apply-to"] == "queues"
    assert dead_policy["priority"] == POLICY_PRIORITY
    assert dead_policy["definition"] == dead_letter_policy_definition()
    with private_vhost("octo-defs") as own:
        text = json.dumps(definitions).replace('"vhost": "/"', f'"vhost": "{own.vhost}"')
        document = json.loads(text)
        document["vhosts"] = [{"name": own.vhost}]
        # rabbitmqctl runs as the rabbitmq user, who cannot read tmp_path (and
        # 3.10 does not read "-" from stdin): a public file in /tmp, no secret in it.
        handle, name = tempfile.mkstemp(prefix="octo-defs-", suffix=".json", dir="/tmp")
        try:
            os.write(handle, json.dumps(document).encode())
            os.close(handle)
            os.chmod(name, 0o644)
            imported = subprocess.run(
                [str(RABBITMQCTL), "import_definitions", name],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        finally:
            os.unlink(name)
        assert imported.returncode == 0, imported.stdout + imported.stderr

        files = WorkerFiles(tmp_path / "worker", own.url, "tenant-release")

        def imported_queues() -> bool:
            shown = octo_worker(
                "topology", "show", "--host-id", "host-1", "--json", config=files.config
            )
            return all(queue["exists"] for queue in json_out(shown)["queues"])

        assert wait_until(imported_queues), "the import never created the queues"
        # The queues the file made are exactly what the worker declares: a
        # re-declaration with different arguments would fail (exit 3).
        declared = octo_worker(
            "topology", "declare", "--skip-policy", "--host-id", "host-1", config=files.config
        )
        assert declared.returncode == 0, declared.stderr
        listed = rabbitmqctl("list_policies", "-p", own.vhost, "--formatter", "json")
        assert sorted(p["name"] for p in json.loads(listed.stdout)) == sorted(
            [WORKER_POLICY_NAME, DEAD_POLICY_NAME]
        )
        queues = rabbitmqctl(
            "list_queues", "-p", own.vhost, "name", "policy", "--formatter", "json"
        )
        policy_of = {row["name"]: row["policy"] for row in json.loads(queues.stdout)}
        assert policy_of[DEAD_QUEUE] == DEAD_POLICY_NAME
        assert policy_of[worker_queue("tenant-release")] == WORKER_POLICY_NAME


def test_run_with_an_unusable_state_directory_is_a_storage_error(
    tmp_path: Path, vhost: Broker
) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-nostate")
    (tmp_path / "occupied").write_text("a file where the state directory should be")
    files.write(
        files.config.read_text().replace('state_dir = "state"', 'state_dir = "occupied/state"')
    )
    run = octo_worker("run", config=files.config)
    assert run.returncode == 4
    line = run_error(run.stderr)
    assert "start-up failed" in line and "occupied" in line, line
    check = octo_worker("check", config=files.config)
    assert check.returncode == 4  # check foresees it
    assert "occupied is not a directory" in one_line(check.stderr)
    assert "journal: FAIL" in check.stdout


# A third-party adapter, installed the way a plug-in package installs one: a
# module plus a dist-info directory declaring an ``octo.adapters`` entry point.
SLOW_ADAPTER = """
import asyncio

from octo_common.errors import AdapterUnsupported
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_worker.adapters.contract import DurableOperationContract


class SlowAdapter:
    \"\"\"Takes two seconds a dispatch (or the payload's \"seconds\"); no deadline of its own.\"\"\"

    tool = "test.slow"

    def invocation_safety(self):
        return None

    def durable_operation_contract(self):
        return DurableOperationContract.RECONCILIATION

    async def invoke(self, request, grant, context):
        raise AdapterUnsupported("invoke")

    async def dispatch_operation(self, request, grant, context):
        await asyncio.sleep(request.payload.value.get("seconds", 2.0))
        return Succeeded(ToolPayload.json({"slow": True}))

    async def compensate_operation(self, request, grant, context):
        raise AdapterUnsupported("compensate_operation")

    async def reconcile_operation(self, request, grant, context):
        return Succeeded(ToolPayload.json({"slow": True}))

    async def reconcile_compensation(self, request, grant, context):
        raise AdapterUnsupported("reconcile_compensation")
"""


def install_slow_adapter(site: Path) -> dict[str, str]:
    """Install the plug-in into ``site``; returns the environment that sees it."""
    site.mkdir(parents=True, exist_ok=True)
    (site / "octo_test_slow_adapter.py").write_text(SLOW_ADAPTER)
    info = site / "octo_test_slow_adapter-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: octo-test-slow-adapter\nVersion: 1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[octo.adapters]\ntest.slow = octo_test_slow_adapter:SlowAdapter\n"
    )
    return dict(os.environ, PYTHONPATH=str(site))


def octo_worker_seeing(
    env: dict[str, str], *args: str, config: Path
) -> subprocess.CompletedProcess[str]:
    """``octo_worker`` with ``env`` (a plug-in site on its path)."""
    return subprocess.run(
        [PYTHON, "-m", "octo_worker", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        env=env,
    )


def test_adapters_list_shows_a_third_party_plug_in(tmp_path: Path, vhost: Broker) -> None:
    env = install_slow_adapter(tmp_path / "site")
    files = WorkerFiles(tmp_path / "worker", vhost.url, "tenant-plugin", adapters=("test.slow",))
    listed = octo_worker_seeing(env, "adapters", "list", "--json", config=files.config)
    assert listed.returncode == 0, listed.stderr
    rows = {item["name"]: item for item in json_out(listed)["adapters"]}
    assert rows["test.slow"]["enabled"] is True
    assert rows["test.slow"]["distribution"] == "octo-test-slow-adapter"
    assert rows["test.slow"]["durable_operation_contract"] == "reconciliation"
    assert rows[PUBLISH]["enabled"] is False


def test_a_plug_in_that_fails_to_load_is_a_configuration_error_naming_it(
    tmp_path: Path, vhost: Broker
) -> None:
    env = install_slow_adapter(tmp_path / "site")
    files = WorkerFiles(
        tmp_path / "worker",
        vhost.url,
        "tenant-plugin",
        adapters=("test.slow",),
        extra='[adapters.options."test.slow"]\ncolour = "crimson-7f3a"\n',
    )
    checked = octo_worker_seeing(env, "check", config=files.config)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "adapters: FAIL" in checked.stdout and "adapter_load_failed" in checked.stdout
    assert "test.slow" in checked.stdout and "crimson-7f3a" not in checked.stdout
    assert "broker: ok" in checked.stdout  # the other checks still ran
    started = octo_worker_seeing(env, "run", config=files.config)
    assert started.returncode == 2  # a configuration error: systemd does not restart it
    assert "test.slow" in started.stderr.splitlines()[-1]


def test_configured_adapter_deadline_bounds_an_adapter_without_its_own(
    tmp_path: Path, vhost: Broker
) -> None:
    env = install_slow_adapter(tmp_path / "site")
    files = WorkerFiles(
        tmp_path / "worker",
        vhost.url,
        "tenant-deadline",
        adapters=("test.slow",),
        extra="",
    )
    files.write(
        files.config.read_text().replace(
            'enabled = ["test.slow"]', 'enabled = ["test.slow"]\ndeadline_seconds = 0.5'
        )
    )
    running = RunningWorker.start(files, env=env)
    try:
        peer = HostPeer(vhost.url, "tenant-deadline", files.scope_key)
        ((_, answer),) = asyncio.run(peer.dispatch("test.slow", [ToolPayload.json({"n": 1})]))
    finally:
        running.stop()
        running.kill()
    # Past the configured deadline the outcome is unknown: the row stays pending. The
    # adapter succeeds after two seconds, well inside the default deadline (30 s): only
    # the configured 0.5 s makes this answer indeterminate.
    assert isinstance(answer, RequestRejected), answer
    assert answer.code == "indeterminate_operation"


def test_topology_declare_refuses_a_configured_delivery_limit_below_one(
    tmp_path: Path, vhost: Broker
) -> None:
    files = WorkerFiles(tmp_path, vhost.url, "tenant-limit", delivery_limit=0)
    result = octo_worker("topology", "declare", config=files.config)
    assert result.returncode == 2
    assert "broker.delivery_limit" in one_line(result.stderr)
    flag = octo_worker("topology", "declare", "--delivery-limit", "0", config=files.config)
    assert flag.returncode == 2
    assert "--delivery-limit" in one_line(flag.stderr)


LOGGING_PROBE = """
import logging
import structlog
from octo_worker.cli import configure_logging

configure_logging("info", "json")
log = structlog.get_logger("octo.test")
log.debug("hidden_below_level")
try:
    raise ValueError("adapter said: the secret is 42")
except ValueError:
    log.exception("adapter_call_failed", code="adapter_failed")
    logging.getLogger("aiormq.connection").warning("library warning", exc_info=True)
log.info("plain_event", scope="tenant-x")
"""


def test_run_logging_is_json_without_exception_text() -> None:
    done = subprocess.run(
        [PYTHON, "-c", LOGGING_PROBE], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout == ""
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [line["event"] for line in lines] == [
        "adapter_call_failed",
        "library warning",
        "plain_event",
    ]
    failed, library, plain = lines
    assert failed["level"] == "error" and failed["code"] == "adapter_failed"
    assert failed["error_type"] == "ValueError"
    assert library["level"] == "warning" and library["error_type"] == "ValueError"
    assert plain["scope"] == "tenant-x" and plain["timestamp"].endswith("Z")
    assert "secret" not in done.stderr and "Traceback" not in done.stderr


def test_journal_show_finds_a_compensation_by_its_key(worker: RunningWorker, vhost: Broker) -> None:
    peer = HostPeer(vhost.url, SCOPE, worker.files.scope_key)
    key, undo_key, answers = asyncio.run(peer.dispatch_then_compensate("undone.txt"))
    assert succeeded(answers[0]), answers
    assert isinstance(answers[1], CompensationResult), answers
    assert isinstance(answers[1].result.status, Succeeded)
    assert not (worker.files.published / "undone.txt").exists()

    config = worker.files.config
    by_operation = json_out(octo_worker("journal", "show", key, "--json", config=config))
    by_compensation = json_out(octo_worker("journal", "show", undo_key, "--json", config=config))
    assert by_operation == by_compensation
    (record,) = by_compensation["records"]
    assert record["operation_key"] == key and record["state"] == "succeeded"
    compensation = record["compensation"]
    assert compensation["compensation_key"] == undo_key
    assert compensation["state"] == "succeeded"
    assert len(compensation["grant_fingerprint"]) == 64
    assert compensation["payload"]["format"] == "json"
    human = octo_worker("journal", "show", undo_key, config=config).stdout
    assert f"compensation key:   {undo_key}" in human
    listed = {
        r["operation_key"]: r
        for r in json_out(octo_worker("journal", "list", "--json", config=config))["records"]
    }
    assert listed[key]["compensation_state"] == "succeeded"
    assert "undone.txt" not in human  # the inverse payload is never shown


def test_watchdog_pings_while_healthy_and_stops_after_a_stall(tmp_path: Path) -> None:
    """WatchdogSec as systemd sets it; the broker vanishes (its vhost is deleted)."""
    with private_vhost("octo-watchdog") as own:
        files = WorkerFiles(tmp_path, own.url, "tenant-watchdog")
        files.write(
            files.config.read_text().replace(
                'log_level = "info"', 'log_level = "info"\nwatchdog_stall_seconds = 0.5'
            )
        )
        running = RunningWorker.start(files, watchdog_usec=400_000)  # a ping every 0.2 s
        try:
            notify = running.notify

            def pings() -> int:
                notify.wait_for("never", 0.05)  # collect what arrived
                return sum("WATCHDOG=1" in d.splitlines() for d in notify.received)

            assert wait_until(lambda: pings() >= 3, timeout=5), notify.received
            rabbitmqctl("delete_vhost", own.vhost)  # the connection is closed, for good

            def reconnecting() -> bool:
                return any(e["event"] == "broker_connect_failed" for e in running.log_events())

            assert wait_until(reconnecting, timeout=10), running.log()[-2000:]
            time.sleep(1.0)  # unhealthy for longer than watchdog_stall_seconds
            stalled = pings()
            time.sleep(0.8)  # four ping periods
            assert pings() == stalled, "the daemon kept pinging a stalled watchdog"
            assert running.process.poll() is None  # systemd, not the daemon, acts on it
        finally:
            status = running.stop()
            running.kill()
        assert status == 0, running.log()[-2000:]
        events = {event["event"] for event in running.log_events()}
        assert "broker_connect_failed" in events


def test_journal_prune_removes_old_terminal_rows_and_never_a_pending_one(
    tmp_path: Path, vhost: Broker
) -> None:
    env = install_slow_adapter(tmp_path / "site")
    files = WorkerFiles(
        tmp_path / "worker", vhost.url, "tenant-prune", adapters=(PUBLISH, "test.slow")
    )
    running = RunningWorker.start(files, env=env)
    try:
        peer = HostPeer(vhost.url, "tenant-prune", files.scope_key)
        ((done_key, answer),) = asyncio.run(peer.dispatch_files(["old.txt"]))
        assert succeeded(answer)
        slow = HostPeer(vhost.url, "tenant-prune", files.scope_key)
        # The dispatch outlasts the test: the row is pending when the worker is killed.
        pending_key = asyncio.run(
            slow.dispatch_without_waiting("test.slow", ToolPayload.json({"seconds": 3600}))
        )

        def admitted() -> bool:
            listed = octo_worker("journal", "list", "--json", config=files.config)
            states = {r["operation_key"]: r["state"] for r in json_out(listed)["records"]}
            return states.get(pending_key) == "pending"

        assert wait_until(admitted, timeout=10), running.log()[-2000:]
    finally:
        running.kill()  # SIGKILL while the slow adapter runs: the row stays pending
    time.sleep(1.2)

    pruned = octo_worker("journal", "prune", "--older-than", "1s", "--json", config=files.config)
    assert pruned.returncode == 0, pruned.stderr
    assert json_out(pruned)["scopes"] == {"tenant-prune": {"removed": 1, "kept": 1}}
    remaining = json_out(octo_worker("journal", "list", "--json", config=files.config))
    assert [(r["operation_key"], r["state"]) for r in remaining["records"]] == [
        (pending_key, "pending")
    ]
    missing = octo_worker("journal", "show", done_key, config=files.config)
    assert missing.returncode == 1  # pruned: its outcome is gone, the key is refused
    assert octo_worker("journal", "verify", config=files.config).returncode == 0


def into_a_closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to the pipe now fails with EPIPE
    try:
        return subprocess.run(
            [PYTHON, "-m", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            # Unbuffered, so the first line is written at once, as a long
            # listing's are; buffered, the failure would come at exit instead.
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            timeout=60,
            check=False,
            cwd=REPO,
        )
    finally:
        os.close(write_end)


def test_output_into_a_closed_pipe_stops_quietly(
    worker: RunningWorker, dispatched: list[str], tmp_path: Path
) -> None:
    """``octo-worker journal list | head``: the reader is gone; no traceback, no
    "internal error", exit 1."""
    config = str(worker.files.config)
    for argv in (
        ["octo_worker", "journal", "list", "--config", config],
        ["octo_worker", "journal", "list", "--json", "--config", config],
        ["octo_host", "keys", "generate", "--storage", "k9", "--out", str(tmp_path / "k")],
    ):
        done = into_a_closed_pipe(argv)
        assert (done.returncode, done.stderr) == (1, b""), argv
    # A failing command with --json: its one error line still reaches stderr.
    failed = into_a_closed_pipe(
        ["octo_worker", "journal", "list", "--json", "--config", "/no.toml"]
    )
    assert failed.returncode == 2
    assert failed.stderr.decode().count("\n") == 1 and b"Traceback" not in failed.stderr


async def _opened(config: WorkerConfig) -> None:
    """Open the journal as the daemon's start does (writable), then close it."""
    store = configured_store(config)
    try:
        await store.scopes()
    finally:
        await store.close()


def test_journal_reseal_lets_an_old_storage_key_be_retired(
    worker: RunningWorker, dispatched: list[str], tmp_path: Path
) -> None:
    """docs/operations.md, rotating the storage key: new key active, old as a read key,
    reseal, then verify without the old key (closed sessions included)."""
    state = tmp_path / "state"
    state.mkdir()
    with (
        contextlib.closing(sqlite3.connect(worker.files.journal)) as source,
        contextlib.closing(sqlite3.connect(state / "journal.sqlite3")) as copy,
    ):
        source.backup(copy)  # a copy: the running worker keeps its own key
    write_key(tmp_path / "storage-k2.key")
    base = (
        worker.files.config.read_text()
        .replace('state_dir = "state"', f'state_dir = "{state}"')
        .replace('key_file = "scope.key"', f'key_file = "{worker.files.root / "scope.key"}"')
    )
    old_key = f'key = {{ id = "k1", key_file = "{worker.files.root / "storage.key"}" }}'
    rotated, retired = tmp_path / "rotated.toml", tmp_path / "retired.toml"
    rotating = 'key = { id = "k2", key_file = "storage-k2.key" }\nread_keys = [' + old_key[6:] + "]"
    rotated.write_text(base.replace('key = { id = "k1", key_file = "storage.key" }', rotating))
    retired.write_text(
        base.replace(
            'key = { id = "k1", key_file = "storage.key" }',
            'key = { id = "k2", key_file = "storage-k2.key" }',
        )
    )
    before = octo_worker("journal", "verify", config=retired)
    assert before.returncode == 1, before.stdout  # rows still sealed with k1
    # The worker's start under the rotated keyring (what a rotation restarts it
    # for) names the journal rows' keys under k2 (their items are keyed hashes).
    asyncio.run(_opened(load_config(rotated)))
    resealed = octo_worker("journal", "reseal", "--json", config=rotated)
    assert resealed.returncode == 0, resealed.stderr
    report = json_out(resealed)
    assert report["resealed"] >= len(dispatched) + 2  # journal rows and a session's two
    after = octo_worker("journal", "verify", "--json", config=retired)
    assert after.returncode == 0, after.stdout + after.stderr
    assert json_out(after)["totals"]["journal_rows"] >= len(dispatched)
