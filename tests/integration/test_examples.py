"""``examples/``: the host service script drives the example plug-in through a real
worker daemon (the plug-in loaded by its ``octo.adapters`` entry point, as
``[adapters] enabled`` names it) on the real broker.

The example package's own tests (``examples/octo-example-tickets/tests``,
written with the adapter kit) run with the suite: ``testpaths`` lists them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from octo_example_tickets import HelpDesk

from .conftest import Names, WorkerRunner, write_host_toml, write_worker_env

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "host_service.py"


async def service(config: Path, *args: str) -> tuple[int, list[dict[str, str]]]:
    environment = {k: v for k, v in os.environ.items() if k != "OCTO_FAULT"}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        "--config",
        str(config),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=environment,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60.0)
    assert process.returncode is not None
    printed = [json.loads(line) for line in stdout.decode().splitlines() if line.startswith("{")]
    assert process.returncode == 0, stderr.decode()[-2000:]
    return process.returncode, printed


async def test_the_host_service_opens_each_ticket_once_and_closes_one(
    tmp_path: Path, names: Names
) -> None:
    desk = HelpDesk(tmp_path / "desk")
    worker = write_worker_env(
        tmp_path,
        names.scope,
        tools=("tickets.open",),
        extra=f'[adapters.options."tickets.open"]\ndesk_dir = "{desk.directory}"\n',
    )
    runner = WorkerRunner(worker)
    await runner.start()
    config = write_host_toml(
        tmp_path / "host",
        names.host(),
        worker,
        f"""
[[grants]]
scope = "{worker.scope}"
tool = "tickets.open"
format = "json"
max_calls = 64
max_compensations = 1

[[actions]]
tool = "tickets.open"
inverse = {{ close = "ticket" }}

[[plans]]
name = "ticket"
steps = [{{ id = "open", source = "open the help-desk ticket" }}]
""",
    )
    try:
        _, opened = await service(config, "open", "printer on fire", "disk full")
        assert [line["state"] for line in opened] == ["succeeded", "succeeded"]
        assert len(desk.tickets()) == 2
        # The same command again: the same jobs, reconciled, no second ticket.
        _, again = await service(config, "open", "printer on fire", "disk full")
        assert [line["state"] for line in again] == ["succeeded", "succeeded"]
        assert len(desk.tickets()) == 2
        _, closed = await service(config, "close", "disk full")
        assert [line["closed"] for line in closed] == ["succeeded"]
        assert sorted(bool(desk.closed_by(key)) for key in desk.tickets()) == [False, True]
    finally:
        await runner.stop_all()
