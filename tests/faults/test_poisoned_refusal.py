"""SIGKILL after a poisoned session's refusal, before the reload that follows it.

Real processes, the real broker on 127.0.0.1:5672, real SQLite files: the
worker is ``tests/faults/_poisoning_worker_main.py`` in its own process (a
daemon whose ``test.hold`` adapter can keep an effect running, and whose
commits of ``op-fail-`` keys fail as a store error would); the host is made
by hand in this process (frames sealed and opened with its own
authenticator, so a reused sequence number shows as ``DuplicateFrame``).

The window: a commit fails and poisons the session; the daemon answers the
request with a refusal, then reloads the scope, and the reload waits for
every handler of the scope, so for as long as the slowest adapter still
runs. A SIGKILL inside that window must not let the session restored at the
next start seal a frame with the refusal's sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Final

import pytest

from octo_common.errors import DuplicateFrame
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    RequestRejected,
    WorkerMessage,
)
from octo_common.payload import ToolPayload
from octo_common.states import Pending
from octo_common.transport import reply_queue, worker_queue
from octo_host.amqp import connect, open_confirm_channel
from octo_worker.config import load_config
from octo_worker.store import SqliteJournalStore
from tests.integration.conftest import RawHost, RawSession
from tests.timing import scaled

from .conftest import URL, CrashEnv, broker_reachable

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

RUNNER: Final = Path(__file__).resolve().parent / "_poisoning_worker_main.py"
TOOL: Final = "test.hold"
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=8)
WAIT: Final = scaled(20.0)


class Worker:
    """The runner process we started; killed with SIGKILL or stopped with SIGTERM."""

    def __init__(self, env: CrashEnv, log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.process = subprocess.Popen(  # fixed argv, no shell
            [sys.executable, str(RUNNER), str(env.config_path)],
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

    async def ready(self) -> None:
        assert self.process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.process.stdout.readline), WAIT)
        assert line == b"ready\n", line

    def sigkill(self) -> None:
        self.process.kill()
        self.process.wait(10.0)
        assert self.process.returncode == -9

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5.0)
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()


def dispatch(session: RawSession, request_id: str, key: str, *, hold: bool) -> bytes:
    payload = ToolPayload.json({"hold": hold})
    request = OperationDispatchRequest(session.session_id, request_id, TOOL, key, payload)
    return session.auth.seal(DispatchOperation(request))


async def admitted(env: CrashEnv, key: str) -> None:
    """Until the worker's journal holds ``key`` pending (its adapter is called right after)."""
    config = load_config(env.config_path)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while loop.time() < deadline:
        store = SqliteJournalStore(config.journal_path, config.storage_keyring(), read_only=True)
        try:
            row = (await store.load_records(env.scope, [key]))[key]
        finally:
            await store.close()
        if row is not None and isinstance(row[0].state, Pending):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the held operation was never admitted")


async def reply_to(host: RawHost, request_id: str) -> Any:
    return await host.replies.wait_for(lambda m: m.correlation_id == request_id, timeout=WAIT)


async def test_a_sigkill_while_the_reload_waits_never_lets_a_refusal_sequence_be_reused(
    tmp_path: Path,
) -> None:
    if not broker_reachable():
        pytest.skip("RabbitMQ is not reachable on 127.0.0.1:5672")
    env = CrashEnv.create(tmp_path)
    host_id = f"t-poison-host-{uuid.uuid4().hex[:12]}"
    connection = await connect(URL, timeout=5.0, name="octo-test-poisoned-refusal")
    workers: list[Worker] = []
    try:
        first = Worker(env, tmp_path / "worker.err")
        workers.append(first)
        await first.ready()
        host = RawHost(await open_confirm_channel(connection), env.scope, host_id, env.scope_key)
        await host.start(connection)
        session = host.session()
        opening = session.auth.seal(
            OpenSession(CapabilityManifest(session.session_id, [GRANT]), reply_to=host.reply_queue)
        )
        await host.publish(opening, headers=host.headers(session, "open"))

        # An effect that keeps running: the reload after the poisoning waits for it.
        held = f"op-held-{secrets.token_hex(8)}"
        await host.publish(
            dispatch(session, "d-held", held, hold=True),
            headers=host.headers(session, "d-held"),
            correlation_id="d-held",
        )
        await admitted(env, held)  # durable: its adapter runs whatever happens next

        # A commit fails: the session is poisoned and the request refused.
        await host.publish(
            dispatch(session, "d-fail", f"op-fail-{secrets.token_hex(8)}", hold=False),
            headers=host.headers(session, "d-fail"),
            correlation_id="d-fail",
        )
        refusal = session.auth.open((await reply_to(host, "d-fail")).body)
        assert isinstance(refusal, RequestRejected)
        assert refusal.code == "journal_persistence_failed"

        # SIGKILL while the reload still waits for the held effect.
        first.sigkill()
        second = Worker(env, tmp_path / "worker.err")
        workers.append(second)
        await second.ready()

        await host.publish(
            dispatch(session, "d-next", f"op-next-{secrets.token_hex(8)}", hold=False),
            headers=host.headers(session, "d-next"),
            correlation_id="d-next",
        )
        reply = await reply_to(host, "d-next")
        try:
            answer: WorkerMessage = session.auth.open(reply.body)
        except DuplicateFrame:
            pytest.fail("the restored session sealed a frame with the refusal's sequence number")
        assert isinstance(answer, RequestRejected), answer
        assert (answer.request_id, answer.code) == ("d-next", "session_poisoned")
    finally:
        for worker in workers:
            worker.stop()
        channel = await connection.channel()
        for name in (worker_queue(env.scope), reply_queue(host_id)):
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
        await connection.close()
