"""The host client reconnects by itself after its broker connection is lost.

Real RabbitMQ: the test closes exactly this client's connection with
``rabbitmqctl close_connection``, found by the ``connection_name`` client
property the client sets (never ``close_all_connections``: other tests share
the broker). The worker is the in-process daemon with the real
``files.publish`` adapter, whose effect log counts real effects; the host
ledger is a real SQLite file.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from typing import Any

import pytest

from octo_common.states import StateKind, Succeeded
from octo_host.client import HostClient
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log

from .conftest import TOOL, WAIT, HostEnv, HostFactory, WorkerEnv, WorkerRunner, manifest
from .test_client import (
    dispatch_in_flight,
    publish_payload,
    registry,
    stored_ledger,
)

pytestmark = pytest.mark.rabbitmq


def connection_pid(name: str) -> str:
    """The broker's pid of the one connection whose ``connection_name`` is ``name``."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here")
    listed = subprocess.run(
        ["rabbitmqctl", "list_connections", "pid", "client_properties", "-q"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    marker = f'{{"connection_name","{name}"}}'
    pids = [line.split("\t", 1)[0] for line in listed.splitlines() if marker in line]
    assert len(pids) == 1, f"connections named {name}: {pids}"
    return pids[0]


def close_connection(pid: str) -> None:
    subprocess.run(
        ["rabbitmqctl", "close_connection", pid, "closed by an octo test"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )


async def until(condition: Any, what: str, timeout: float = 3 * WAIT) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(0.02)


class GatedPublish(FilesPublishAdapter):
    """``files.publish`` whose dispatch waits for the test's go before publishing."""

    def __init__(self, env: WorkerEnv) -> None:
        super().__init__(env.published, env.effect_log, deadline_seconds=60.0)
        self.entered = asyncio.Event()
        self.go = asyncio.Event()
        self.dispatches = 0

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.dispatches += 1
        self.entered.set()
        await self.go.wait()
        return await super().dispatch_operation(request, grant, context)


def effect_keys(worker_env: WorkerEnv) -> list[str]:
    return [e["operation_key"] for e in read_effect_log(worker_env.effect_log)]


async def test_a_dispatch_cut_by_a_closed_connection_ends_through_reconciliation(
    workers: WorkerRunner, hosts: HostFactory, host_env: HostEnv, worker_env: WorkerEnv
) -> None:
    adapter = GatedPublish(worker_env)
    await workers.start(adapters=registry(adapter))
    # A reply timeout far beyond the test: the verb ends by the cut, not by a timeout.
    client: HostClient = await hosts.start(reply_timeout=20 * WAIT, backoff_initial=0.05)
    pid = await asyncio.to_thread(connection_pid, client.connection_name)
    run, key, session, dispatching = await dispatch_in_flight(client, worker_env)
    await asyncio.wait_for(adapter.entered.wait(), WAIT)  # admitted; the effect is waiting

    await asyncio.to_thread(close_connection, pid)
    await until(lambda: client.reconnects >= 1, "the client reconnects")
    adapter.go.set()
    state = await asyncio.wait_for(dispatching, 3 * WAIT)

    # Terminal through reconciliation of the same key: one dispatch, one effect.
    assert isinstance(state, Succeeded)
    assert run.state(key) == StateKind.SUCCEEDED
    assert client.published["dispatch_operation"] == 1
    assert client.published["reconcile_operation"] >= 1
    assert adapter.dispatches == 1
    assert effect_keys(worker_env) == [key]
    assert (await stored_ledger(host_env)).operation(key).state == StateKind.SUCCEEDED  # type: ignore[union-attr]
    assert session.current() is session  # the worker's session outlived the connection

    # A later verb of the same client, never restarted, goes through.
    second = await client.record_operation(
        run, "publish", TOOL, publish_payload("second.txt"), b"after-the-cut"
    )
    fresh = await client.open_session(worker_env.scope, manifest())
    assert isinstance(
        await client.dispatch(fresh, run, second, publish_payload("second.txt")), Succeeded
    )
    assert effect_keys(worker_env) == [key, second]
    assert client.reconnects == 1
