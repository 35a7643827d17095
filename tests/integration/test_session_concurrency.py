"""Concurrent admissions through real sessions on one real SQLite journal.

Issue 3's acceptance: 1,000 concurrent admissions of 100 keys from two
sessions give exactly 100 Dispatch. Every delivery goes through
``WorkerSession.handle`` (open, authorize, key lock, journal, group commit,
adapter, observation); the adapter counts its calls, so a second effect for
any key would show.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    OperationResult,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Succeeded
from octo_worker.adapters import (
    BaseWorkerAdapter,
    DurableOperationContract,
    WorkerAdapterRegistry,
)
from octo_worker.session import WorkerSession, WorkerSessionLimits
from octo_worker.store import SqliteJournalStore

SCOPE = "tenant-concurrency"
TOOL = "count.effect"
KEYS = 100
DELIVERIES = 1000


class CountingAdapter(BaseWorkerAdapter):
    """A plug-in whose effect is one count per call, with a yield to invite races."""

    tool = TOOL

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    async def dispatch_operation(self, request: Any, grant: Any) -> Any:
        self.calls[request.operation_key] += 1
        await asyncio.sleep(0)
        return Succeeded(ToolPayload.json({"key": request.operation_key}))


class Delivery:
    def __init__(self, host: SessionAuthenticator, answers: list[Any]) -> None:
        self.host, self.answers = host, answers

    async def ack(self) -> None:
        return None

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        self.answers.append(self.host.open(frame))

    async def dead_letter(self, reason: str) -> None:
        raise AssertionError(f"dead-lettered: {reason}")


async def test_1000_concurrent_admissions_of_100_keys_from_two_sessions(tmp_path: Path) -> None:
    store = SqliteJournalStore(tmp_path / "journal.db", StorageKeyring("k1", bytes(32)))
    lease = await store.reserve_fence(SCOPE)
    adapter = CountingAdapter()
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    scope_key = ScopeKey.from_bytes(bytes(range(1, 33)))
    grant = CapabilityGrant(TOOL, "json", max_calls=DELIVERIES)

    sessions: list[tuple[WorkerSession, SessionAuthenticator]] = []
    for index in range(2):
        session_id, nonce = f"session-{index}", bytes([index + 1]) * 32
        key = SessionKey.derive(scope_key, SCOPE, session_id, nonce)
        host = SessionAuthenticator(session_id, key, SessionRole.HOST)
        worker = SessionAuthenticator(session_id, key, SessionRole.WORKER)
        opening = host.seal(OpenSession(CapabilityManifest(session_id, [grant])))
        session = await WorkerSession.open(
            worker,
            opening,
            scope=SCOPE,
            key_nonce=nonce,
            reply_to="octo.v5.reply.host-1",
            store=store,
            lease=lease,
            adapters=adapters,
            limits=WorkerSessionLimits(),
        )
        sessions.append((session, host))

    answers: list[Any] = []
    handlings = []
    for n in range(DELIVERIES):
        session, host = sessions[n % 2]
        key = f"op-{n % KEYS:03d}"
        request = OperationDispatchRequest(
            host.session_id, f"d-{n}", TOOL, key, ToolPayload.json({"n": n % KEYS})
        )
        frame = host.seal(DispatchOperation(request))
        handlings.append(session.handle(frame, store, Delivery(host, answers)))
    await asyncio.gather(*handlings)

    try:
        assert sum(adapter.calls.values()) == KEYS  # exactly 100 Dispatch
        assert set(adapter.calls.values()) == {1}
        assert len(answers) == DELIVERIES  # every delivery was answered
        results = [a for a in answers if isinstance(a, OperationResult)]
        pending = [a for a in answers if isinstance(a, RequestRejected)]
        assert all(isinstance(a.result.status, Succeeded) for a in results)
        # A duplicate admitted while the first was still running is told to wait.
        assert {a.code for a in pending} <= {"pending_operation"}
        records = await store.list_records(SCOPE)
        assert len(records) == KEYS
        assert all(isinstance(record.state, Succeeded) for record, _ in records)
        assert all(session.status == "open" for session, _ in sessions)
    finally:
        await store.close()
