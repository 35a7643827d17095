"""The README's host-library example, run as printed against the real broker and worker.

The ``python`` block under "Embedding the host library" is executed as a
module; its ``publish_notes`` must publish one file through the worker
daemon and return ``succeeded``, and run again it must answer from the
ledger and the journal without a second effect.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from typing import Any

import pytest

from octo_common.states import StateKind
from octo_worker.adapters_files import read_effect_log
from octo_worker.daemon import WorkerDaemon

from .conftest import URL, WorkerEnv, write_private

pytestmark = pytest.mark.rabbitmq

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> dict[str, Any]:
    text = README.read_text(encoding="utf-8")
    section = text.split("## Embedding the host library", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "the section shows one python block"
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    return namespace


async def test_the_readme_host_example_publishes_once(
    daemon: WorkerDaemon, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    publish_notes = readme_example()["publish_notes"]
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
