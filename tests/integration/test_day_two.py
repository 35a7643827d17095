"""Day two, as an operator lives it: real worker processes, the real host command.

The worker is ``python -m octo_worker run`` (a subprocess, killed with
SIGKILL at a kill point where a test needs a crash) serving a function
adapter installed as a plug-in; the host is ``python -m octo_host``. What
is checked is what an operator sees: exit statuses, the lines printed, the
host ledger, ``octo-worker journal show`` (with and without ``--reveal``),
the worker's metrics endpoint and the adapter's own effect file.

* A bad input ends ``failed`` with the code ``input_refused`` in the ledger
  and the journal at once; the validation text is shown only by ``journal
  show --reveal`` where the journal's data key is configured, and each
  reveal is audited.
* A key a crash left pending (the adapter's lookup cannot tell) is counted
  by ``octo_oldest_unresolved_pending_seconds`` after a restart before any
  request names it; the runbook's ``octo-host resolve`` records the
  decision in the ledger and the journal, and the gauge falls to zero.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import TOOL, Names, WorkerEnv, write_private, write_worker_env
from .test_host_cli import RUN, HostCli, Result

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]
GREET = "test.greet"
REASON = "checked the greeting service: nothing was sent (ticket 77)"

# A function adapter as a third-party plug-in: its effect is a line in a file
# named by the idempotency key; its lookup finds the line or proves nothing.
PLUGIN = """
import msgspec
from octo_worker.adapter_functions import AdapterCall, FunctionAdapter
from octo_worker.adapters import DurableOperationContract


class Greeting(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class Settings(msgspec.Struct, forbid_unknown_fields=True):
    effects: str


greet = FunctionAdapter(
    "test.greet",
    contract=DurableOperationContract.RECONCILIATION,
    input=Greeting,
    options=Settings,
)


def _sent(call):
    try:
        with open(call.options.effects, encoding="utf-8") as lines:
            return dict(line.split() for line in lines)
    except FileNotFoundError:
        return {}


@greet.dispatch
def send(value: Greeting, call: AdapterCall[Settings]):
    with open(call.options.effects, "a", encoding="utf-8") as lines:
        lines.write(f"{call.idempotency_key} {value.name}\\n")
    return {"greeted": value.name}


@greet.lookup
def look(call: AdapterCall[Settings]):
    name = _sent(call).get(call.idempotency_key)
    return None if name is None else {"greeted": name}
"""


def install_plugin(site: Path) -> dict[str, str]:
    site.mkdir(parents=True, exist_ok=True)
    (site / "octo_test_greet.py").write_text(PLUGIN)
    info = site / "octo_test_greet-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: octo-test-greet\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[octo.adapters]\ntest.greet = octo_test_greet:greet\n")
    environment = {k: v for k, v in os.environ.items() if k != "OCTO_FAULT"}
    environment["PYTHONPATH"] = str(site)
    return environment


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Worker:
    """The worker's files, a data key, a metrics port, and its processes."""

    def __init__(self, root: Path, names: Names) -> None:
        self.port = free_port()
        self.effects = root / "greetings.txt"
        extra = f"""
[adapters.options."{GREET}"]
effects = "{self.effects}"

[metrics]
listen = "127.0.0.1:{self.port}"
"""
        self.env: WorkerEnv = write_worker_env(root, names.scope, tools=(TOOL, GREET), extra=extra)
        keys = self.env.root / "worker" / "keys"
        write_private(keys / "data.key", secrets.token_bytes(32).hex().encode() + b"\n")
        text = self.env.config_path.read_text()
        text = text.replace(
            'key = { id = "worker-k1", key_file = "keys/storage.key" }',
            'key = { id = "worker-k1", key_file = "keys/storage.key" }\n'
            'data_key = { id = "data-1", key_file = "keys/data.key" }',
        )
        self.env.config_path.write_text(text)
        self.site_env = install_plugin(root / "site")
        self.process: subprocess.Popen[str] | None = None
        self.log = root / "worker.log"

    def start(self, fault: str | None = None) -> None:
        environment = dict(self.site_env)
        if fault is not None:
            environment["OCTO_FAULT"] = fault
        with self.log.open("a") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [PYTHON, "-m", "octo_worker", "run", "--config", str(self.env.config_path)],
                cwd=REPO,
                env=environment,
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
            )

    async def ready(self) -> None:
        for _ in range(600):
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"the worker exited: {self.log.read_text()[-2000:]}")
            text = await asyncio.to_thread(self.metrics_text)
            if text is not None and "octo_consumers_active 1.0" in text:
                return
            await asyncio.sleep(0.1)
        raise AssertionError("the worker never consumed its scope")

    def metrics_text(self) -> str | None:
        try:
            url = f"http://127.0.0.1:{self.port}/metrics"
            with urllib.request.urlopen(url, timeout=2) as response:
                return str(response.read().decode())
        except OSError:
            return None

    def unresolved_age(self) -> float:
        text = self.metrics_text()
        assert text is not None
        for line in text.splitlines():
            if line.startswith("octo_oldest_unresolved_pending_seconds{") and (
                f'scope="{self.env.scope}"' in line
            ):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    async def stop(self) -> None:
        process = self.process
        assert process is not None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 30)
        self.process = None

    async def killed(self) -> int:
        """Wait for a worker a kill point ended (SIGKILL)."""
        process = self.process
        assert process is not None
        code = await asyncio.to_thread(process.wait, 60)
        self.process = None
        return code

    def journal(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "octo_worker", "journal", *args, "--config", str(self.env.config_path)],
            cwd=REPO,
            env=self.site_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@pytest.fixture
async def worker(tmp_path: Path, names: Names) -> Any:
    started = Worker(tmp_path, names)
    yield started
    if started.process is not None and started.process.poll() is None:
        started.process.kill()
        started.process.wait(10)


@pytest.fixture
async def host(tmp_path: Path, names: Names, worker: Worker) -> HostCli:
    cli = HostCli(tmp_path / "host", names, worker.env)
    await cli.provision()
    text = cli.config.read_text()
    text = text.replace("reply_timeout_seconds = 5.0", "reply_timeout_seconds = 2.0")
    text = text.replace("max_attempts = 4", "max_attempts = 2")
    cli.config.write_text(
        text
        + f"""
[[grants]]
scope = "{names.scope}"
tool = "{GREET}"
format = "json"
max_calls = 8

[[plans]]
name = "greet"
steps = [{{ id = "hello", source = "greet someone" }}]
"""
    )
    return cli


async def greet(host: HostCli, payload: str) -> Result:
    return await host.run(
        "dispatch", RUN, "--plan", "greet", "--step", "hello", "--tool", GREET,
        "--payload", payload,
    )  # fmt: skip


def key_of(host_result: Result) -> str:
    for line in host_result.stdout.splitlines():
        if line.startswith("operation key:"):
            return line.split()[-1]
    raise AssertionError(host_result.stdout + host_result.stderr)


async def test_a_bad_input_ends_failed_on_both_sides_with_its_code_and_a_guarded_text(
    worker: Worker, host: HostCli
) -> None:
    worker.start()
    await worker.ready()
    dispatched = await greet(host, '{"name": 42}')
    # Definite at once: no lookups, no "still running".
    assert dispatched.status == 1, dispatched.stderr
    assert "observed:       failed [input_refused] (failure text withheld:" in dispatched.stdout
    assert "ledger state:   failed [input_refused]" in dispatched.stdout
    assert "ended failed" in dispatched.stderr and "recover" not in dispatched.stderr
    key = key_of(dispatched)

    ledger = (await host.run("ledger", "show", RUN, "--json")).json()
    [operation] = ledger["operations"]
    assert operation["state"] == "failed" and operation["failure"] == "input_refused"
    shown = await host.run("ledger", "show", RUN)
    assert "failed [input_refused]" in shown.stdout

    # The journal holds the same outcome; its text only for --reveal.
    plain = worker.journal("show", key)
    assert plain.returncode == 0, plain.stderr
    assert "failed [input_refused] (failure message:" in plain.stdout
    assert "Expected" not in plain.stdout
    audit = worker.env.state_dir / "failure-text-reveals.jsonl"
    assert not audit.exists()
    revealed = worker.journal("show", key, "--reveal")
    assert revealed.returncode == 0, revealed.stderr
    assert "failure text:       Expected `str`, got `int` - at `$.name`" in revealed.stdout
    [entry] = [json.loads(line) for line in audit.read_text().splitlines()]
    assert entry["key"] == key and entry["via"] == "journal show"

    # Without the journal's data key, the text is not shown at all.
    no_data_key = worker.env.config_path.with_name("no-data-key.toml")
    no_data_key.write_text(
        "\n".join(
            line
            for line in worker.env.config_path.read_text().splitlines()
            if not line.startswith("data_key")
        )
    )
    refused = subprocess.run(
        [PYTHON, "-m", "octo_worker", "journal", "show", key, "--reveal",
         "--config", str(no_data_key)],
        cwd=REPO, env=worker.site_env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode == 2
    assert "data key" in refused.stderr and "Expected" not in refused.stdout + refused.stderr
    assert len(audit.read_text().splitlines()) == 1

    # A lookup of the key says so too, from the journal, without its input.
    looked = await host.run("reconcile", RUN, key)
    assert looked.status == 1, looked.stderr
    assert "observed:       failed [input_refused]" in looked.stdout
    assert not worker.effects.exists()  # the function never ran
    await worker.stop()


async def test_the_stuck_key_runbook_settles_both_sides_and_clears_the_gauge(
    worker: Worker, host: HostCli
) -> None:
    # The worker dies after acking the admission, before its adapter runs.
    worker.start(fault="worker.after_ack")
    await worker.ready()
    dispatch = asyncio.create_task(greet(host, '{"name": "ada"}'))
    assert await worker.killed() == -signal.SIGKILL
    worker.start()
    dispatched = await dispatch
    assert dispatched.status == 1, dispatched.stderr
    key = key_of(dispatched)
    assert "still" in dispatched.stderr  # the lookup proves nothing: running
    await worker.stop()

    # A restart: the key is counted before any request names it again.
    worker.start()
    await worker.ready()
    assert worker.unresolved_age() > 0
    assert "running" in worker.journal("show", key).stdout

    recovered = await host.run("recover", RUN)
    assert recovered.status == 1
    # Looked up without its input: still running there, not "no input given".
    assert f"unresolved: {key}: not finished at the worker yet" in recovered.stdout

    # From the key alone: its run, and complete commands.
    found = await host.run("find", key)
    assert found.status == 0, found.stderr
    assert f"run:            {RUN}" in found.stdout
    scope = worker.env.scope
    assert f"next:           octo-host reconcile {RUN} {key} --scope {scope}" in found.stdout
    looked = await host.run("reconcile", key)  # no run, no input
    assert looked.status == 1, looked.stderr
    assert "observed:       running" in looked.stdout

    resolved = await host.run(
        "resolve", key, "--state", "failed", "--reason", REASON, "--operator", "alice"
    )
    assert resolved.status == 0, resolved.stderr
    assert f"{key}: running -> failed" in resolved.stdout
    assert "worker journal: recorded failed" in resolved.stdout
    assert REASON not in resolved.stdout + resolved.stderr

    # Terminal on both sides, with the operator's code; nothing ran.
    ledger = (await host.run("ledger", "show", RUN, "--json")).json()
    [operation] = ledger["operations"]
    assert operation["state"] == "failed" and operation["failure"] == "resolved_by_operator"
    journal = worker.journal("show", key)
    assert "failed [resolved_by_operator]" in journal.stdout
    revealed = worker.journal("show", key, "--reveal")
    assert f"resolved by operator alice (run {RUN}): {REASON}" in revealed.stdout
    [entry] = (await host.run("audit", "show", RUN, "--json")).json()["entries"]
    assert entry["ledger_agrees"] is True and entry["operator"] == "alice"
    assert worker.unresolved_age() == 0.0
    assert (await host.run("recover", RUN)).status == 0
    assert not worker.effects.exists()

    # Settled: a second decision is refused before anything is sent.
    again = await host.run(
        "resolve", RUN, key, "--state", "succeeded", "--reason", "no", "--operator", "bob"
    )
    assert again.status == 1 and "terminal" in again.stderr
    await worker.stop()
    # And after a restart too, nothing is left to count.
    worker.start()
    await worker.ready()
    assert worker.unresolved_age() == 0.0
    await worker.stop()
