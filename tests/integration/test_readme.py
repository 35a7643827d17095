"""The README's code, run as printed against the real broker and worker.

* "Embedding the host library": the quick start (at most 15 lines) publishes
  a file through ``HostClient.from_config`` and ``execute``; the long form
  (a store, a client and a session by hand) does the same. Each, run again,
  answers from the ledger and the journal without a second effect.
* "Writing an adapter plug-in": the quick start (at most 20 lines) is
  served by a real worker daemon and driven by a real host; its kit test
  runs as printed.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from octo_common.payload import ToolPayload
from octo_common.states import StateKind
from octo_host.client import HostClient
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import read_effect_log
from octo_worker.daemon.daemon import WorkerDaemon

from .conftest import URL, Names, WorkerEnv, WorkerRunner, write_host_toml, write_private

pytestmark = pytest.mark.rabbitmq

README = Path(__file__).resolve().parents[2] / "README.md"
HOST_QUICK_START_LINES = 15
ADAPTER_QUICK_START_LINES = 20


def python_blocks(section: str) -> list[str]:
    """The ``python`` blocks of the README section titled ``section``, in order."""
    text = README.read_text(encoding="utf-8")
    part = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", part, flags=re.DOTALL)


def run_block(block: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    scope = {"__name__": "readme_example", **(namespace or {})}
    exec(compile(block, str(README), "exec"), scope)
    return scope


def lines(block: str) -> int:
    return len(block.rstrip("\n").split("\n"))


def test_the_quick_starts_fit_their_bounds() -> None:
    host = python_blocks("Embedding the host library")
    adapter = python_blocks("Writing an adapter plug-in")
    assert len(host) == 2, "the host section shows the quick start and the long form"
    assert lines(host[0]) <= HOST_QUICK_START_LINES, lines(host[0])
    assert "from_config" in host[0] and "execute" in host[0]
    assert lines(adapter[0]) <= ADAPTER_QUICK_START_LINES, lines(adapter[0])
    assert "FunctionAdapter" in adapter[0]


def publish_config(root: Path, names: Names, worker: WorkerEnv) -> Path:
    return write_host_toml(
        root,
        names.host(),
        worker,
        f"""
[[grants]]
scope = "{worker.scope}"
tool = "files.publish"
format = "json"
max_calls = 4
max_compensations = 1

[[plans]]
name = "release"
steps = [{{ id = "publish", source = "publish the release notes" }}]
""",
    )


async def test_the_readme_host_quick_start_publishes_once(
    daemon: WorkerDaemon, worker_env: WorkerEnv, names: Names, tmp_path: Path
) -> None:
    publish_notes = run_block(python_blocks("Embedding the host library")[0])["publish_notes"]
    config = publish_config(tmp_path / "host", names, worker_env)
    assert await publish_notes(str(config)) == "succeeded"
    assert (worker_env.shelf / "notes-1.2.3.txt").read_text() == "1.2.3"
    # Run again (a retried job): the same key, answered without a second effect.
    assert await publish_notes(str(config)) == "succeeded"
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def test_the_readme_host_long_form_publishes_once(
    daemon: WorkerDaemon, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    publish_notes = run_block(python_blocks("Embedding the host library")[1])["publish_notes"]
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


async def test_the_readme_adapter_quick_start_is_served_by_a_real_worker(
    worker_env: WorkerEnv, workers: WorkerRunner, names: Names, tmp_path: Path
) -> None:
    adapter = run_block(python_blocks("Writing an adapter plug-in")[0])
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


async def test_the_readme_adapter_kit_test_passes_as_printed(tmp_path: Path) -> None:
    blocks = python_blocks("Writing an adapter plug-in")
    adapter = run_block(blocks[0])
    test_greet = run_block(blocks[1], adapter)["test_greet"]
    await test_greet(tmp_path)
    # One effect for the twice-delivered key, one for each kill point past the ack.
    assert len(adapter["SENT"]) == 1 + 3
