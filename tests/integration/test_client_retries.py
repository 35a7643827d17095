"""A step's retry policy through a real worker daemon, broker and ledger: only an
outcome proven not to have happened by an adapter that fences the key is retried.

The adapter under test stands in for the tool (``files.publish``'s grant) and
counts its calls per key: its first dispatch fails indeterminately (the
worker cannot tell whether the effect ran), and its lookup answers as each
test needs. ``HostClient.execute`` runs the step with its policy on.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, Running, StateKind, Succeeded
from octo_host.plan import RetryPolicy, WorkflowStep
from octo_worker.adapters.contract import (
    BaseWorkerAdapter,
    DurableOperationContract,
    WorkerAdapterRegistry,
)

from .conftest import TOOL, HostFactory, Names, WorkerEnv, WorkerRunner, manifest
from .test_client import RUN, publish_payload
from .test_host_cli import PUBLISH, HostCli
from .test_host_cli import RUN as CLI_RUN

POLICY = RetryPolicy(attempts=3, backoff_seconds=0.0)
STEPS = [WorkflowStep("publish", "publish the release notes", POLICY)]


class CutOnce(BaseWorkerAdapter):
    """The first dispatch is cut (indeterminate); later ones succeed. The lookup of a
    key whose dispatch was cut answers ``lookup``; any other, the dispatch's success."""

    tool = TOOL

    def __init__(self, lookup: Any, fences: bool) -> None:
        self.lookup = lookup
        self.fences = fences
        self.dispatches: Counter[str] = Counter()
        self.cut: set[str] = set()

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> bool:
        return self.fences

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.dispatches[request.operation_key] += 1
        if not self.cut:
            self.cut.add(request.operation_key)
            raise AdapterIndeterminate("connection lost before the answer")
        return Succeeded(ToolPayload.json({"done": True}))

    async def reconcile_operation(self, request: Any, grant: Any, context: Any) -> Any:
        if request.operation_key in self.cut:
            return self.lookup
        return Succeeded(ToolPayload.json({"done": True}))


async def _execute(
    workers: WorkerRunner, hosts: HostFactory, adapter: CutOnce
) -> tuple[Any, list[Any]]:
    registry = WorkerAdapterRegistry()
    registry.register(TOOL, adapter)
    await workers.start(adapters=registry)
    client = await hosts.start(
        manifests={workers.env.scope: manifest()}, max_attempts=3, backoff_initial=0.01
    )
    run = await client.load_run(RUN, client.engine.plan(STEPS))
    state = await client.execute(run, "publish", TOOL, publish_payload(), b"job-1")
    return state, list(run.ledger.operations)


async def test_a_proven_not_happened_attempt_is_replaced_and_the_step_succeeds(
    workers: WorkerRunner, hosts: HostFactory
) -> None:
    adapter = CutOnce(Failed("no trace of it", FailureCode.NOT_HAPPENED), fences=True)
    state, operations = await _execute(workers, hosts, adapter)

    assert isinstance(state, Succeeded)
    first, retry = operations
    assert (first.state, first.failure) == (StateKind.FAILED, FailureCode.NOT_HAPPENED)
    assert (retry.state, retry.retry_of, retry.attempt) == (
        StateKind.SUCCEEDED,
        first.operation_key,
        2,
    )
    # Each key reached the adapter's effect once; the effect happened under the second.
    assert adapter.dispatches == Counter({first.operation_key: 1, retry.operation_key: 1})


async def test_an_indeterminate_outcome_is_never_retried(
    workers: WorkerRunner, hosts: HostFactory
) -> None:
    # The lookup cannot tell either: the key stays running, and nothing replaces it.
    adapter = CutOnce(Running(), fences=True)
    state, operations = await _execute(workers, hosts, adapter)

    assert state.kind == StateKind.RUNNING
    [only] = operations
    assert only.state == StateKind.RUNNING and only.retry_of is None
    assert adapter.dispatches == Counter({only.operation_key: 1})


async def test_an_adapter_that_cannot_fence_a_lookup_miss_is_never_retried(
    workers: WorkerRunner, hosts: HostFactory
) -> None:
    # Its lookup claims "not happened", but a late call could still act under the
    # key: the worker refuses the claim, the key stays unsettled, no retry is made.
    adapter = CutOnce(Failed("no trace of it", FailureCode.NOT_HAPPENED), fences=False)
    state, operations = await _execute(workers, hosts, adapter)

    assert state.kind not in (StateKind.SUCCEEDED, StateKind.FAILED)
    [only] = operations
    assert only.state in (StateKind.PENDING, StateKind.RUNNING) and only.retry_of is None
    assert adapter.dispatches == Counter({only.operation_key: 1})


RETRIED_PLAN = """
[[plans]]
name = "retried"

[[plans.steps]]
id = "publish"
source = "publish the release notes"
retry = { attempts = 3, backoff_seconds = 0.0 }
"""


@pytest.fixture
async def cli(tmp_path: Path, names: Names, worker_env: WorkerEnv) -> HostCli:
    host = HostCli(tmp_path / "host", names, worker_env)
    await host.provision()
    return host


async def test_the_cli_follows_a_configured_policy_and_shows_every_attempt(
    workers: WorkerRunner, cli: HostCli
) -> None:
    adapter = CutOnce(Failed("no trace of it", FailureCode.NOT_HAPPENED), fences=True)
    registry = WorkerAdapterRegistry()
    registry.register(TOOL, adapter)
    await workers.start(adapters=registry)
    cli.write_config(extra=RETRIED_PLAN)

    dispatched = await cli.run(
        "dispatch", CLI_RUN, "--plan", "retried", "--step", "publish", "--tool", TOOL,
        "--scope", cli.names.scope, "--payload", PUBLISH, "--json",
    )  # fmt: skip

    assert dispatched.status == 0, dispatched.stderr
    document = dispatched.json()
    assert document["ledger_state"] == "succeeded"
    first, second = document["attempts"]
    assert (first["state"], first["failure"]) == ("failed", "not_happened")
    assert second == {"operation_key": document["operation_key"], "state": "succeeded"}
    shown = (await cli.run("ledger", "show", CLI_RUN, "--json")).json()["operations"]
    assert [(op["attempt"], op["retry_of"], op["failure"]) for op in shown] == [
        (1, None, "not_happened"),
        (2, first["operation_key"], None),
    ]
    human = (await cli.run("ledger", "show", CLI_RUN)).stdout
    assert "failed [not_happened]" in human
    assert f"2 (after {first['operation_key']})" in human
    # find, from either key (the console's key page names it), shows the chain.
    found = await cli.run("find", first["operation_key"])
    assert found.status == 0, found.stderr
    assert "attempt:        1 of 2" in found.stdout
    assert f"replaced by:    {document['operation_key']}" in found.stdout
    [run] = (await cli.run("find", document["operation_key"], "--json")).json()["runs"]
    assert run["attempts"] == [first["operation_key"], document["operation_key"]]
