"""A host process for the crash matrix: records, persists, dispatches, and (armed
with ``OCTO_FAULT=host.<point>@n``) dies by its own SIGKILL at the n-th time it
reaches that point (the ledger write before a publish, a reply applied but not
persisted, a compensation intent).

    python tests/faults/_host_main.py --stdin

Prints ``loaded`` once imported, reads one JSON line of arguments from stdin
(broker URL, host id, scope and scope key file, ledger path and storage key,
plan steps and their retry attempts, run name, tool, tag, concurrent),
records one publish operation per step, prints ``RECORDED <key> ...``, opens
a session, dispatches every key (one after another, or all at once), then
records and sends the compensation of the first key. With ``execute`` set it
instead runs ``HostClient.execute`` for each step in turn (the steps' retry
policy followed; armed with ``OCTO_FAULT=host.after_retry_intent`` it dies
right after the ledger write that records a retry). Printing ``survived`` means the fault never
fired. Secrets travel on stdin, never on the command line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

import structlog

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import Succeeded
from octo_host.client import HostClient
from octo_host.compensation import (
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.plan import RetryPolicy, WorkflowStep
from octo_host.store import SqliteLedgerStore


class _Allow:
    """Verifiers of this one compensation (tenant = the scope, inverse = the undo)."""

    def __init__(self, scope: str, grant: CapabilityGrant, inverse: bytes) -> None:
        self.scope, self.grant, self.inverse = scope, grant, inverse

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        if tenant_scope != self.scope or grant != self.grant:
            raise PermissionError("grant")

    def verify_compensation_action(self, action: Any) -> None:
        if action.compensation_input != self.inverse:
            raise PermissionError("action")


async def main(a: dict[str, Any]) -> None:
    keyring = StorageKeyring("host-k1", bytes.fromhex(a["storage_key"]))
    grant = CapabilityGrant(a["tool"], "json", max_calls=16, max_compensations=1)
    client = HostClient(
        a["url"],
        host_id=a["host_id"],
        store=SqliteLedgerStore(a["ledger"], keyring),
        scope_keys={a["scope"]: ScopeKey.from_file(a["scope_key_file"])},
        reply_timeout=a.get("reply_timeout", 5.0),
        max_attempts=a.get("max_attempts", 6),
        manifests={a["scope"]: CapabilityManifest("manifest", [grant])},
    )
    await client.start()
    tag = a["tag"]
    retry = RetryPolicy(attempts=a["retry_attempts"], backoff_seconds=0.05)
    plan = client.engine.plan([WorkflowStep(s, src, retry) for s, src in a["steps"]])
    run = await client.load_run(a["run"], plan)
    payloads = [
        ToolPayload.json({"name": f"file-{i}.txt", "content": f"{tag}:{i}"})
        for i in range(len(a["steps"]))
    ]
    if a.get("execute"):
        # One call per step: record, dispatch, and the step's retry policy.
        for i, (step, _) in enumerate(a["steps"]):
            await client.execute(run, step, a["tool"], payloads[i], f"{tag}:{i}".encode())
        print("survived", flush=True)
        await client.close()
        return
    keys = [
        await client.record_operation(run, step, a["tool"], payloads[i], f"{tag}:{i}".encode())
        for i, (step, _) in enumerate(a["steps"])
    ]
    print("RECORDED", *keys, flush=True)
    session = await client.open_session(a["scope"], CapabilityManifest("manifest", [grant]))
    if a["concurrent"]:
        states = await asyncio.gather(
            *(client.dispatch(session, run, k, p) for k, p in zip(keys, payloads, strict=True))
        )
    else:
        states = [
            await client.dispatch(session, run, k, p) for k, p in zip(keys, payloads, strict=True)
        ]
    if isinstance(states[0], Succeeded):
        inverse = ToolPayload.json({"undo": "publish", "name": "file-0.txt"})
        allow = _Allow(a["scope"], grant, canonical_operation_input_bytes(inverse))
        target = WorkflowCompensationTarget(
            keys[0], WorkflowCompensationPolicy(a["scope"], grant), grant, allow, allow
        )
        await client.record_compensation(run, target, inverse, f"{tag}:undo".encode())
        await client.compensate(
            session, run, target, WorkflowCompensationDispatch(f"c-{tag}", inverse)
        )
    print("survived", flush=True)
    await client.close()


if __name__ == "__main__":
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    if "--stdin" in sys.argv:
        print("loaded", flush=True)
    asyncio.run(main(json.loads(sys.stdin.readline())))
