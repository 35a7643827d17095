"""The README, run as printed, from empty directories, against the real broker.

* "Quick start": its three commands, the first checked against the Makefile
  (``make -n``: the repository's own environment is the one under test), the
  other two run from an empty directory with the one-command worker
  (``octo-worker dev``) and the host snippet saved as ``publish.py``: the
  file is published once, run again it is answered without a second effect,
  the host library prints nothing but the result, and Ctrl-C stops the
  worker cleanly.
* "Writing an adapter": ``greet.py`` and ``test_greet.py`` saved in an empty
  directory and run with pytest as the README says; ``greet.py`` is also
  served by a real worker daemon and driven by a real host.
* ``docs/host-library.md``: the long form runs against the real broker and
  worker, and publishes once.
* The README stays short and names nothing a clone does not have.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

import pytest

from octo_common.payload import ToolPayload
from octo_common.states import StateKind
from octo_host.client import HostClient
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon
from tests.timing import scaled

from .conftest import URL, Names, WorkerEnv, WorkerRunner, write_host_toml, write_private

pytestmark = pytest.mark.rabbitmq

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOST_LIBRARY = REPO / "docs" / "host-library.md"
VENV_BIN = REPO / ".venv" / "bin"
# Bounds on waits that end as soon as their condition holds, scaled with the
# machine's load (a busy machine is slow, never wrong): only a broken worker
# reaches them.
START_BOUND = scaled(30.0)
COMMAND_BOUND = scaled(60.0)


def section(path: Path, title: str) -> str:
    text = path.read_text(encoding="utf-8")
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def python_blocks(path: Path, title: str) -> list[str]:
    """The ``python`` blocks of the section titled ``title``, in order."""
    return re.findall(r"```python\n(.*?)```", section(path, title), flags=re.DOTALL)


def shell_block(path: Path, title: str) -> list[str]:
    """The commands of the section's first plain (shell) block."""
    block = re.findall(r"```\n(.*?)```", section(path, title), flags=re.DOTALL)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def run_block(block: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    scope = {"__name__": "readme_example", **(namespace or {})}
    exec(compile(block, str(README), "exec"), scope)
    return scope


def as_run_here(command: str) -> list[str]:
    """A README command, its ``.venv/bin/`` being the repository's environment."""
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(VENV_BIN / argv[0].removeprefix(".venv/bin/"))
    return argv


class Lines:
    """The lines a process writes to one of its pipes, read on a thread."""

    def __init__(self, pipe: IO[str]) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        for line in pipe:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for(self, pattern: str, bound: float) -> str:
        deadline = time.monotonic() + bound
        with self._changed:
            while True:
                for line in self.lines:
                    if re.search(pattern, line):
                        return line
                left = deadline - time.monotonic()
                assert left > 0, f"no line matching {pattern!r} in:\n" + "\n".join(self.lines)
                self._changed.wait(left)

    def text(self) -> str:
        with self._changed:
            return "\n".join(self.lines)


def test_the_readme_is_short_and_self_contained() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 300
    for path in re.findall(r"`((?:docs|deploy|examples|bench|demo|tests)/[^`\s]*)`", text):
        assert (REPO / path.rstrip("/")).exists(), path
    assert (REPO / "LICENSE").is_file() and (REPO / "CHANGELOG.md").is_file()


def test_the_quick_start_runs_from_an_empty_directory(tmp_path: Path) -> None:
    commands = shell_block(README, "Quick start: a first worker and a host")
    assert len(commands) <= 3, commands
    setup, worker, host = commands
    assert setup.startswith("make ")
    targets = shlex.split(setup)[1:]
    dry = subprocess.run(
        ["make", "-n", "-C", str(REPO), *targets], capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    (snippet,) = python_blocks(README, "Quick start: a first worker and a host")

    here = tmp_path / "empty"
    here.mkdir()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OCTO_FAULT", None)
    daemon = subprocess.Popen(
        as_run_here(worker),
        cwd=here,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = Lines(daemon.stdout), Lines(daemon.stderr)  # type: ignore[arg-type]
    try:
        # What the user is told to do next, then the worker consuming.
        told = out.wait_for(r"publish\.py", START_BOUND)
        assert "octo-dev/host.toml" in told, out.text()
        assert "README" in out.text()
        err.wait_for(r"worker_consuming", START_BOUND)
        assert not err.text().lstrip().startswith("{"), "logs meant for a person, not JSON"
        keys = here / "octo-dev" / "keys"
        assert (here / "octo-dev").stat().st_mode & 0o777 == 0o700
        for key in keys.iterdir():
            assert key.stat().st_mode & 0o777 == 0o600, key

        (here / "publish.py").write_text(snippet, encoding="utf-8")
        for _ in range(2):  # the same job twice: one effect
            done = subprocess.run(
                as_run_here(host),
                cwd=here,
                env=env,
                capture_output=True,
                text=True,
                timeout=COMMAND_BOUND,
            )
            assert (done.returncode, done.stdout, done.stderr) == (0, "succeeded\n", "")
        published = list((here / "octo-dev" / "worker" / "published").glob("*/notes-1.2.3.txt"))
        assert [path.read_text() for path in published] == ["1.2.3"]
        effects = read_effect_log(here / "octo-dev" / "worker" / "effects.log")
        assert [entry["effect"] for entry in effects] == ["publish"]
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGINT)  # Ctrl-C
        status = daemon.wait(timeout=COMMAND_BOUND)
    assert status == 0, err.text()

    # Run again, it reuses the directory: same scope, keys untouched.
    scope_key = (here / "octo-dev" / "keys" / "scope.key").read_bytes()
    again = subprocess.run(
        [*as_run_here(worker), "--no-run"],
        cwd=here,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_BOUND,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("reusing octo-dev/")
    assert (here / "octo-dev" / "keys" / "scope.key").read_bytes() == scope_key


def test_the_adapter_and_its_test_run_from_an_empty_directory(tmp_path: Path) -> None:
    section_text = section(README, "Writing an adapter")
    adapter, kit_test = python_blocks(README, "Writing an adapter")
    assert "Save as `greet.py`" in section_text and "Save as `test_greet.py`" in section_text
    command = re.search(r"run `(\.venv/bin/python -m pytest test_greet\.py)`", section_text)
    assert command is not None
    (tmp_path / "greet.py").write_text(adapter, encoding="utf-8")
    (tmp_path / "test_greet.py").write_text(kit_test, encoding="utf-8")
    done = subprocess.run(
        [*as_run_here(command.group(1)), "-p", "no:cacheprovider", "-q"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=COMMAND_BOUND,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


async def test_the_readme_adapter_is_served_by_a_real_worker(
    worker_env: WorkerEnv, workers: WorkerRunner, names: Names, tmp_path: Path
) -> None:
    adapter = run_block(python_blocks(README, "Writing an adapter")[0])
    registry = WorkerAdapterRegistry()
    registry.register("demo.greet", adapter["greetings"]())  # as load_adapters calls it
    await workers.start(adapters=registry)
    config = write_host_toml(
        tmp_path / "host",
        names.host(),
        worker_env,
        f"""
[[grants]]
scope = "{worker_env.scope}"
tool = "demo.greet"
format = "json"

[[plans]]
name = "hello"
steps = [{{ id = "greet", source = "greet Ada" }}]
""",
    )
    payload = ToolPayload.json({"name": "Ada"})
    for _ in range(2):  # the same job twice: one effect
        async with HostClient.from_config(config) as client:
            run = await client.load_run("hello-ada", "hello")
            state = await client.execute(run, "greet", "demo.greet", payload, b"1")
            assert state.kind == StateKind.SUCCEEDED
    assert list(adapter["SENT"].values()) == ["hello Ada"]


async def test_the_host_library_long_form_publishes_once(
    daemon: WorkerDaemon, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    (long_form,) = python_blocks(HOST_LIBRARY, "The long form")
    publish_notes = run_block(long_form)["publish_notes"]
    scope_key = worker_env.root / "worker" / "keys" / "scope.key"
    ledger_key = write_private(tmp_path / "host" / "ledger.key", secrets.token_bytes(32))
    ledger = tmp_path / "host" / "ledger.sqlite3"

    first = await publish_notes(URL, worker_env.scope, scope_key, ledger, ledger_key)
    assert first == StateKind.SUCCEEDED
    assert (worker_env.shelf / "notes-1.2.3.txt").read_text() == "1.2.3"
    # Run again (a retried job): the same key, answered without a second effect.
    again = await publish_notes(URL, worker_env.scope, scope_key, ledger, ledger_key)
    assert again == StateKind.SUCCEEDED
    assert len(read_effect_log(worker_env.effect_log)) == 1
