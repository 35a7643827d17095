"""Octo's two processes as the benchmarks run them: the worker daemon and the host client.

Shared by ``bench/e2e.py`` and ``bench/endurance.py``:

* :class:`WorkerFiles` writes a ``worker.toml``, its keys and state
  directory (optionally with the rollback anchor ``storage.anchor``, the
  metrics endpoint on, or the journal in PostgreSQL);
* :class:`WorkerProcess` starts ``bench/_e2e_peer.py`` (the daemon exactly
  as ``octo-worker run`` runs it) in its own process and reads its CPU time
  and RSS from ``/proc`` (all threads of the process);
* :func:`ledger_store` opens the host's ``SqliteLedgerStore``, optionally
  with its rollback anchor;
* process figures of this (the host) process, :func:`wait_idle` for the
  worker, the worker's delivery counters from its metrics endpoint, and
  queue clean-up.

It must never reach into the daemon or client internals: the worker is
driven only through the broker and observed only through ``/proc`` and its
metrics endpoint, the host only through ``HostClient``'s public verbs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import structlog

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant
from octo_common.records import StorageKeyring
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore

HERE = Path(__file__).resolve().parent
URL = os.environ.get("OCTO_BENCH_BROKER", "amqp://127.0.0.1:5672/")
PEER = HERE / "_e2e_peer.py"
TOOL = "octo.noop"
GRANT = CapabilityGrant(TOOL, "json", max_calls=1024)
STEP = WorkflowStep("noop", "benchmark no-op")
# The explicit initialisation of an anchor for a database without records
# (``octo-host ledger init-anchor`` writes the same); both stores accept it on their first open.
EMPTY_ANCHOR = b'{"format_version":1,"records":[]}'
CLOCK_TICK = os.sysconf("SC_CLK_TCK")
MB = 1024 * 1024


def write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# /proc figures (Linux) -----------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` now."""
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int) -> int:
    """The highest RSS of process ``pid`` since it started or since :func:`reset_peak_rss`."""
    return _status_kib(pid, "VmHWM") * 1024


def reset_peak_rss(pid: int) -> bool:
    """Make the peak RSS start again from the current RSS (``clear_refs`` 5)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def broker_pid(port: int = 5672) -> int | None:
    """The process listening on ``port`` on this machine (the broker), or None
    when it cannot be found (another user's process, no /proc)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


def host_cpu_seconds() -> float:
    """CPU time of this process, all threads (the ledger's SQLite thread included)."""
    return time.process_time()


# The worker ----------------------------------------------------------------------------------


class WorkerFiles:
    """worker.toml, keys and state directory of a benchmark's worker.

    ``anchor=True`` configures ``[storage] anchor`` and writes the explicit
    empty anchor before the first start; ``metrics_port`` turns the metrics
    endpoint on at ``127.0.0.1:<port>``.
    """

    def __init__(
        self,
        root: Path,
        in_flight: int,
        *,
        anchor: bool = False,
        metrics_port: int | None = None,
        storage: str | None = None,
    ) -> None:
        """``storage``: the ``[storage]`` lines that place the journal elsewhere than
        the default SQLite file (a PostgreSQL schema, ``bench/_pg.py``)."""
        self.root = root
        self.scope = f"bench-{uuid.uuid4().hex[:10]}"
        self.scope_key_bytes = secrets.token_bytes(32)
        self.metrics_port = metrics_port
        write_private(root / "keys" / "scope.key", self.scope_key_bytes)
        write_private(root / "keys" / "storage.key", secrets.token_bytes(32).hex().encode())
        journal = 'journal = "journal.sqlite3"\n' if storage is None else storage
        if anchor:
            write_private(root / "state" / "journal.anchor", EMPTY_ANCHOR)
            journal += 'anchor = "journal.anchor"\n'
        metrics = ""
        if metrics_port is not None:
            metrics = f'\n[metrics]\nlisten = "127.0.0.1:{metrics_port}"\n'
        self.config = root / "worker.toml"
        # max_concurrency: the daemon's default (32) would cap 64 in flight.
        self.config.write_text(
            f"""
[worker]
state_dir = "state"
shutdown_grace_seconds = 5.0
log_level = "warning"

[broker]
url = "{URL}"
prefetch = {max(in_flight, 64)}

[storage]
{journal}key = {{ id = "bench-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{self.scope}"
key_file = "keys/scope.key"
max_concurrency = {max(in_flight, 64)}

[adapters]
enabled = ["{TOOL}"]
{metrics}""",
            encoding="utf-8",
        )

    @property
    def scope_key(self) -> ScopeKey:
        return ScopeKey.from_bytes(self.scope_key_bytes)


class WorkerProcess:
    """The worker daemon in its own process (``bench/_e2e_peer.py``)."""

    def __init__(
        self, files: WorkerFiles, stages: Path | None = None, profile: Path | None = None
    ) -> None:
        self.counters = files.root / f"counters-{uuid.uuid4().hex[:8]}.jsonl"
        argv = [sys.executable, str(PEER), str(files.config), "--counters", str(self.counters)]
        if stages is not None:
            argv += ["--stages", str(stages)]
        if profile is not None:
            argv += ["--profile", str(profile)]
        self.files = files
        self.stages = stages
        self.profile = profile
        self.dumps = 0
        with open(files.root / "worker.err", "ab") as err:
            self.process = subprocess.Popen(  # fixed argv, no shell
                argv, stdout=subprocess.PIPE, stderr=err
            )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if line.strip() != b"ready":
            self.process.kill()
            self.process.wait(5)
            raise RuntimeError(f"the worker did not start:\n{self.error_tail()}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def error_tail(self, size: int = 2000) -> str:
        path = self.files.root / "worker.err"
        return path.read_text("utf-8", "replace")[-size:] if path.exists() else ""

    def checkpoint(self) -> None:
        """Dump the worker's stage timers / profile so far and reset them (SIGUSR1)."""
        self.process.send_signal(signal.SIGUSR1)
        self.dumps += 1
        time.sleep(0.2)

    def socket_writes(self) -> int:
        """The worker's socket writes to the broker as of the last :meth:`checkpoint`."""
        lines = self.counters.read_text("utf-8").splitlines() if self.counters.exists() else []
        return int(json.loads(lines[-1])["socket_writes"]) if lines else 0

    def last_stages(self) -> dict[str, list[float]]:
        if self.stages is None:
            return {}
        lines = self.stages.read_text("utf-8").splitlines()
        return dict(json.loads(lines[-1])) if lines else {}

    def last_profile(self) -> Path | None:
        return None if self.profile is None else Path(f"{self.profile}-{self.dumps}.prof")

    def cpu_seconds(self) -> float:
        """User + system CPU time of the worker process so far, all threads."""
        return cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def deliveries(self) -> dict[str, float]:
        """The worker's ``octo_deliveries_total`` of its scope, by outcome (metrics endpoint)."""
        if self.files.metrics_port is None:
            raise RuntimeError("the worker was started without a metrics endpoint")
        url = f"http://127.0.0.1:{self.files.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode("utf-8")
        found: dict[str, float] = {}
        scope = f'scope="{self.files.scope}"'
        for line in text.splitlines():
            if line.startswith("octo_deliveries_total{") and scope in line:
                labels, value = line.rsplit(" ", 1)
                outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
                found[outcome] = found.get(outcome, 0.0) + float(value)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.process.stdout is not None:
            self.process.stdout.close()


async def wait_idle(
    worker: WorkerProcess,
    *,
    window: float = 0.25,
    busy_share: float = 0.05,
    calm_windows: int = 2,
    timeout: float = 600.0,
) -> float:
    """Wait until the worker uses under ``busy_share`` of a core for ``calm_windows`` windows.

    Returns the seconds waited. A host's ``close()`` closes its sessions at
    the worker after the measurement; without this wait the worker would
    still be closing them while the next measurement runs.
    """
    started = time.perf_counter()
    calm = 0
    before = worker.cpu_seconds()
    while time.perf_counter() - started < timeout:
        await asyncio.sleep(window)
        now = worker.cpu_seconds()
        calm = calm + 1 if now - before < busy_share * window else 0
        before = now
        if calm >= calm_windows:
            break
    return time.perf_counter() - started


# The host ------------------------------------------------------------------------------------


def ledger_store(path: Path, *, anchor: bool) -> SqliteLedgerStore:
    """A fresh host ledger store at ``path``; ``anchor``: its rollback anchor ``<path>.anchor``."""
    anchor_path = None
    if anchor:
        anchor_path = path.with_name(path.name + ".anchor")
        write_private(anchor_path, EMPTY_ANCHOR)
    keyring = StorageKeyring("host-k1", secrets.token_bytes(32))
    return SqliteLedgerStore(path, keyring, anchor_path=anchor_path)


def host_rss_bytes() -> int:
    return rss_bytes(os.getpid())


async def delete_queue(name: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(URL, timeout=5.0)
    try:
        channel = await connection.channel()
        await channel.queue_delete(name)
    finally:
        await connection.close()


def quiet_logs() -> None:
    """Host logs at warning: production would ship the info lines, a benchmark measures Octo."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
