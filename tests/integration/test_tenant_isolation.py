"""Two tenant scopes on one worker never share an effect, end to end.

Real RabbitMQ, the worker daemon in process serving two scopes with the
real ``files.publish`` adapter (one instance for both), and one
``HostClient`` per tenant, each with its own ledger file. Both tenants run
the same plan with the same nonce, so the host derives the same operation
key for both: only the scope tells the two operations apart, and the
adapter hears of it through ``AdapterContext``.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

import pytest

from octo_common.frames import ScopeKey
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import StateKind, Succeeded
from octo_common.transport import worker_queue
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationDispatch
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore
from octo_worker.adapters.contract import AdapterContext
from octo_worker.adapters.files import read_effect_log
from octo_worker.config import load_config

from .conftest import (
    TOOL,
    URL,
    WAIT,
    Names,
    WorkerEnv,
    WorkerRunner,
    compensation_target,
    manifest,
    unique,
    write_private,
)

pytestmark = pytest.mark.rabbitmq

NONCE = b"release-1.2.3"  # the same for both tenants
PAYLOAD = ToolPayload.json({"name": "notes.txt", "content": "1.2.3"})
INVERSE = ToolPayload.json({"undo": "publish", "name": "notes.txt"})


def with_second_scope(env: WorkerEnv, scope: str, key: bytes) -> WorkerEnv:
    """The same worker configuration serving ``scope`` too."""
    write_private(env.root / "worker" / "keys" / "other.key", key)
    text = env.config_path.read_text(encoding="utf-8")
    text += f'\n[[scopes]]\nname = "{scope}"\nkey_file = "keys/other.key"\n'
    env.config_path.write_text(text, encoding="utf-8")
    return dataclasses.replace(env, config=load_config(env.config_path))


async def tenant_host(tmp_path: Path, host_id: str, scope: str, key: ScopeKey) -> HostClient:
    store = SqliteLedgerStore(
        tmp_path / f"ledger-{scope}.sqlite3", StorageKeyring("host-k1", secrets.token_bytes(32))
    )
    client = HostClient(
        URL,
        host_id=host_id,
        scope_keys={scope: key},
        store=store,
        reply_timeout=WAIT,
        publish_timeout=WAIT,
    )
    await client.start()
    return client


async def test_two_scopes_with_the_same_plan_and_nonce_publish_and_remove_their_own_files(
    worker_env: WorkerEnv, names: Names, tmp_path: Path
) -> None:
    other = unique("t-scope")
    names.queues.append(worker_queue(other))
    other_key = secrets.token_bytes(32)
    env = with_second_scope(worker_env, other, other_key)
    runner = WorkerRunner(env)
    await runner.start()
    tenants = {
        worker_env.scope: worker_env.scope_key,
        other: ScopeKey.from_bytes(other_key),
    }
    clients: dict[str, HostClient] = {}
    try:
        keys: dict[str, str] = {}
        runs = {}
        sessions = {}
        for scope, scope_key in tenants.items():
            client = clients[scope] = await tenant_host(
                tmp_path, names.host(scope), scope, scope_key
            )
            plan = client.engine.plan([WorkflowStep("publish", "publish the release notes")])
            runs[scope] = await client.load_run("release-1.2.3", plan)
            keys[scope] = await client.record_operation(
                runs[scope], "publish", TOOL, PAYLOAD, NONCE, scope=scope
            )
            sessions[scope] = await client.open_session(scope, manifest())
            state = await client.dispatch(sessions[scope], runs[scope], keys[scope], PAYLOAD)
            assert isinstance(state, Succeeded)
        key = keys[worker_env.scope]
        assert keys[other] == key  # one operation key, two tenants

        # Two files, two logged effects, each named by its own scope's key.
        published = env.published
        for scope in tenants:
            assert (published / scope / "notes.txt").read_text() == "1.2.3"
        effects = read_effect_log(env.effect_log)
        assert [(e["effect"], e["scope"], e["operation_key"]) for e in effects] == [
            ("publish", worker_env.scope, key),
            ("publish", other, key),
        ]
        assert [e["idempotency_key"] for e in effects] == [
            AdapterContext.for_operation(scope, "s", key, 0.0).idempotency_key for scope in tenants
        ]

        # Each compensation removes only its own tenant's file.
        inverse = canonical_operation_input_bytes(INVERSE)
        for index, scope in enumerate(tenants):
            client = clients[scope]
            target = compensation_target(scope, key, inverse)
            await client.record_compensation(runs[scope], target, INVERSE, b"undo:" + NONCE)
            state = await client.compensate(
                sessions[scope], runs[scope], target, WorkflowCompensationDispatch("c-1", INVERSE)
            )
            assert isinstance(state, Succeeded)
            remaining = [s for s in tenants if (published / s / "notes.txt").exists()]
            assert remaining == list(tenants)[index + 1 :]
            operation = runs[scope].operation(key)
            assert operation is not None and operation.compensation is not None
            assert operation.compensation.state == StateKind.SUCCEEDED
        removals = [e for e in read_effect_log(env.effect_log) if e["effect"] == "remove"]
        assert [e["scope"] for e in removals] == list(tenants)
    finally:
        for client in clients.values():
            await client.close()
            await client.store.close()
        await runner.stop_all()
