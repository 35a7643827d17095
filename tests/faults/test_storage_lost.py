"""The journal lost while the workers run: each exits 4, saying why.

Two ``octo-worker run`` processes (an owner and its standby) share one
journal through a TCP relay in this process; the relay is cut (PostgreSQL
unreachable, as when its server stops). The owner's next commit fails, its
session is poisoned and the reload under a fresh fence cannot reach the
journal; the standby, handed the queue, cannot load the scope. Each exits
with the storage status 4 and one ``octo-worker:`` line naming the storage
error, so systemd's ``Restart=on-failure`` restarts it (before, each
stopped with status 0 after an info line, and the scope stayed unserved).
A SQLite journal that can no longer be written (every write of the process
past 4 KiB refused by the kernel, ``EFBIG``, as on a full or failing disk)
stops its worker the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.postgres import PostgresSchema, connect

from .failover import FailoverEnv, manifest, payload, record_run

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

REPO = Path(__file__).resolve().parents[2]
PYTHON = str(REPO / ".venv" / "bin" / "python")


class Relay:
    """A TCP relay to PostgreSQL that can be cut: listener and every connection closed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                client.close()
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.cut.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept under way
        self.listener.close()
        for end in self.sockets:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    async def cut_now(self) -> None:
        """Close the relay, and end the server's side of every session it carried
        (so no statement already on its way still lands)."""
        ports = []
        for end in self.sockets[1::2]:  # the upstream ends
            with contextlib.suppress(OSError):
                ports.append(end.getsockname()[1])
        self.close()
        connection = await connect()
        try:
            await connection.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE client_port = ANY($1::int[])",
                ports,
            )
        finally:
            await connection.close()


def through(config: Path, port: int) -> None:
    """``config``'s journal reached through the relay, and its log at info."""
    text = config.read_text(encoding="utf-8")
    text = text.replace("@127.0.0.1:5432/", f"@127.0.0.1:{port}/")
    text = text.replace('log_level = "warning"', 'log_level = "info"')
    config.write_text(text, encoding="utf-8")


class Worker:
    def __init__(self, config: Path) -> None:
        self.err = config.parent / "stderr.log"
        self.process = subprocess.Popen(
            [PYTHON, "-m", "octo_worker", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=self.err.open("wb"),
            cwd=REPO,
        )

    def stderr(self) -> str:
        return self.err.read_text(encoding="utf-8", errors="replace")

    async def wait_for(self, word: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while word not in self.stderr():
            assert self.process.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"no {word!r}: {self.stderr()}"
            await asyncio.sleep(0.1)

    async def exit_status(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (status := self.process.poll()) is None:
            assert time.monotonic() < deadline, self.stderr()
            await asyncio.sleep(0.1)
        return status

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def one_storage_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("octo-worker: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert "journal storage" in lines[0], lines[0]
    return lines[0]


async def test_the_journal_lost_stops_the_owner_and_the_standby_with_status_4(
    tmp_path: Path, postgres_schema: PostgresSchema
) -> None:
    relay = Relay(("127.0.0.1", 5432))
    env = FailoverEnv.create(tmp_path, postgres_schema)
    for config in env.configs:
        through(config, relay.port)
    owner = Worker(env.configs[0])
    standby: Worker | None = None
    client = env.client(reply_timeout=3.0)
    try:
        await owner.wait_for("worker_started")
        standby = Worker(env.configs[1])
        await standby.wait_for("worker_started")
        await client.start()
        tag = uuid.uuid4().hex[:8]
        _, run, keys = await record_run(client, 3, tag)

        session = await client.open_session(env.scope, manifest())
        await client.dispatch(session, run, keys[0], payload(0, tag))
        await owner.wait_for("scope_activated")

        await relay.cut_now()
        with contextlib.suppress(Exception):
            await client.dispatch(session, run, keys[1], payload(1, tag))
        assert await owner.exit_status() == 4
        one_storage_line(owner.stderr())

        # The queue goes to the standby: a delivery activates it, and the load fails.
        with contextlib.suppress(Exception):
            again = await client.open_session(env.scope, manifest())
            await client.dispatch(again, run, keys[2], payload(2, tag))
        assert await standby.exit_status() == 4
        one_storage_line(standby.stderr())
    finally:
        relay.close()
        owner.kill()
        if standby is not None:
            standby.kill()
        with contextlib.suppress(Exception):
            await client.close()
        await env.delete_queues()


class PipedWorker(Worker):
    """``octo-worker run`` whose stderr is a pipe (a file it writes would meet the
    file-size limit too), with SIGXFSZ ignored, so a write past the limit is an
    ``EFBIG`` error in the journal's writes, as on a full disk."""

    def __init__(self, config: Path) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [PYTHON, "-m", "octo_worker", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=REPO,
            preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN),
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line.decode("utf-8", "replace"))

    def stderr(self) -> str:
        return "".join(self.lines)


async def test_a_sqlite_journal_that_cannot_be_written_stops_the_worker_with_status_4(
    tmp_path: Path, postgres_schema: PostgresSchema
) -> None:
    env = FailoverEnv.create(tmp_path, postgres_schema, workers=1)
    (config,) = env.configs
    text = config.read_text(encoding="utf-8")
    text = text.replace(f'url = "{postgres_schema.url}"\n', 'journal = "journal.sqlite3"\n')
    text = text.replace(f'password_file = "{postgres_schema.password_file}"\n', "")
    text = text.replace(f'schema = "{postgres_schema.schema}"\n', "")
    text = text.replace('log_level = "warning"', 'log_level = "info"')
    config.write_text(text, encoding="utf-8")
    worker = PipedWorker(config)
    client = env.client(reply_timeout=3.0)
    try:
        await worker.wait_for("worker_started")
        await client.start()
        tag = uuid.uuid4().hex[:8]
        _, run, keys = await record_run(client, 2, tag)
        session = await client.open_session(env.scope, manifest())
        await client.dispatch(session, run, keys[0], payload(0, tag))

        # From now on no write of the process may reach past 4 KiB of any file:
        # the journal's next write fails (EFBIG), as a full or failing disk does.
        resource.prlimit(worker.process.pid, resource.RLIMIT_FSIZE, (4096, 4096))
        with contextlib.suppress(Exception):
            await client.dispatch(session, run, keys[1], payload(1, tag))
        assert await worker.exit_status() == 4
        line = one_storage_line(worker.stderr())
        assert "storage_backend_error" in line, line
    finally:
        worker.kill()
        with contextlib.suppress(Exception):
            await client.close()
        await env.delete_queues()
