"""Concurrent admissions through real sessions on one real journal, on both backends.

The bar: 1,000 concurrent admissions of 100 keys from two
sessions give exactly 100 Dispatch; and one session's concurrent handlings
share transactions (pipelined commits) without weakening any of that. Every delivery goes through
``WorkerSession.handle`` (open, authorize, key lock, journal, group commit,
adapter, observation); the adapter counts its calls, so a second effect for
any key would show.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from octo_common.errors import StorageBackendError
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CloseSession,
    DispatchOperation,
    Invoke,
    OpenSession,
    OperationDispatchRequest,
    OperationResult,
    RequestRejected,
    ToolInvocation,
)
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Pending, Succeeded
from octo_worker.adapters.contract import (
    BaseWorkerAdapter,
    DurableOperationContract,
    InvocationSafety,
    WorkerAdapterRegistry,
)
from octo_worker.session.session import WorkerSession, WorkerSessionLimits
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import WorkerCommit, WorkerJournalLease

from .journal_backends import JournalDatabase

SCOPE = "tenant-concurrency"
TOOL = "count.effect"
KEYS = 100
DELIVERIES = 1000
SCOPE_KEY = ScopeKey.from_bytes(bytes(range(1, 33)))


class CountingAdapter(BaseWorkerAdapter):
    """A plug-in whose effect is one count per call, with a yield to invite races."""

    tool = TOOL

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        self.calls[request.operation_key] += 1
        await asyncio.sleep(0)
        return Succeeded(ToolPayload.json({"key": request.operation_key}))


class Delivery:
    def __init__(self, host: SessionAuthenticator, answers: list[Any]) -> None:
        self.host, self.answers = host, answers
        self.acked = False

    async def ack(self) -> None:
        self.acked = True

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        self.answers.append(self.host.open(frame))

    async def dead_letter(self, reason: str) -> None:
        raise AssertionError(f"dead-lettered: {reason}")

    async def requeue(self) -> None:
        return None


async def test_1000_concurrent_admissions_of_100_keys_from_two_sessions(
    journal_db: JournalDatabase,
) -> None:
    store = journal_db.store(StorageKeyring("k1", bytes(32)))
    lease = await store.reserve_fence(SCOPE)
    adapter = CountingAdapter()
    adapters = registry(adapter)
    sessions = [await open_session(store, lease, adapters, DELIVERIES, index) for index in (0, 1)]

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


# One session, many concurrent handlings ----------------------------------------------------
#
# A session's commits are one compare-and-swap chain on its state row. With a
# store that chains them (both journal backends), a handling submits its
# commit while the previous one is still in flight, so concurrent handlings
# of one session share transactions. These keep every promise of the
# one-at-a-time version: each admission durable before its effect, the
# durable state equal to the durable journal, and one failed commit failing
# every commit built on it (the session poisons) instead of letting a later
# one land on older state.


class FailingCommitStore:
    """The real store, with one commit failing before it reaches the database.

    The fault the daemon's own boundary can raise at any commit (a store
    closing under it, a change set refused before I/O); the commits the
    session built on top of it are already submitted when it fails.
    """

    chains_session_commits = True

    def __init__(self, store: JournalStoreBase, fail_at: int) -> None:
        self.store, self.fail_at, self.calls = store, fail_at, 0
        self.outcomes: dict[int, str] = {}
        # Commit number -> an event it waits for before it goes on (or fails).
        self.gates: dict[int, asyncio.Event] = {}
        self.statuses: dict[int, tuple[str, bool]] = {}

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int:
        self.calls += 1
        call = self.calls
        for documents in changes.sessions.values():
            status = json.loads(documents.state)["status"]
            self.statuses[call] = (
                status,
                changes.journal is not None or bool(changes.outbox_insert),
            )
        if call in self.gates:
            await self.gates[call].wait()
        if call == self.fail_at:
            await asyncio.sleep(0)
            self.outcomes[call] = "injected"
            raise StorageBackendError("injected")
        try:
            revision = await self.store.commit(scope, lease, changes)
        except Exception as exc:
            self.outcomes[call] = type(exc).__name__
            raise
        self.outcomes[call] = "ok"
        return revision

    async def load_records(self, scope: str, keys: list[str]) -> Any:
        return await self.store.load_records(scope, keys)

    async def head_revision(self, scope: str) -> int:
        return await self.store.head_revision(scope)


async def open_session(
    store: Any, lease: WorkerJournalLease, adapters: WorkerAdapterRegistry, calls: int, index: int
) -> tuple[WorkerSession, SessionAuthenticator]:
    session_id, nonce = f"session-{index}", bytes([index + 1]) * 32
    key = SessionKey.derive(SCOPE_KEY, SCOPE, session_id, nonce)
    host = SessionAuthenticator(session_id, key, SessionRole.HOST)
    worker = SessionAuthenticator(session_id, key, SessionRole.WORKER)
    grant = CapabilityGrant(TOOL, "json", max_calls=calls)
    opening = host.seal(
        OpenSession(CapabilityManifest(session_id, [grant]), reply_to="octo.v5.reply.host-1")
    )
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
    return session, host


def dispatch(host: SessionAuthenticator, n: int) -> bytes:
    request = OperationDispatchRequest(
        host.session_id, f"d-{n}", TOOL, f"op-{n:03d}", ToolPayload.json({"n": n})
    )
    return host.seal(DispatchOperation(request))


async def restored_session(store: JournalStoreBase, lease: WorkerJournalLease) -> WorkerSession:
    """session-1 as its durable state rebuilds it."""
    persisted = (await store.load_sessions(SCOPE))["session-1"]
    return await WorkerSession.restore(
        persisted,
        scope_key=SCOPE_KEY,
        scope=SCOPE,
        store=store,
        lease=lease,
        adapters=registry(CountingAdapter()),
        limits=WorkerSessionLimits(),
    )


async def restored_calls(store: JournalStoreBase, lease: WorkerJournalLease) -> int:
    """What the durable session state says this session spent."""
    return (await restored_session(store, lease)).calls_for(TOOL)


def registry(adapter: CountingAdapter) -> WorkerAdapterRegistry:
    adapters = WorkerAdapterRegistry()
    adapters.register(TOOL, adapter)
    return adapters


async def test_concurrent_handlings_of_one_session_share_transactions(
    journal_db: JournalDatabase,
) -> None:
    count = 200
    store = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await store.reserve_fence(SCOPE)
        adapter = CountingAdapter()
        session, host = await open_session(store, lease, registry(adapter), count, 1)
        before = store.stats
        answers: list[Any] = []
        deliveries = [Delivery(host, answers) for _ in range(count)]

        await asyncio.gather(
            *(session.handle(dispatch(host, n), store, deliveries[n]) for n in range(count))
        )

        stats = store.stats
        # Two commits per dispatch (admission, observation with the reply).
        assert stats.change_sets - before.change_sets == 2 * count
        assert stats.failed_change_sets == before.failed_change_sets
        # Held one at a time, one session's commits never share a transaction.
        assert stats.transactions - before.transactions < count
        assert stats.largest_batch > 1
        assert len(answers) == count and all(d.acked for d in deliveries)
        assert all(isinstance(a, OperationResult) for a in answers)
        assert all(isinstance(a.result.status, Succeeded) for a in answers)
        assert sum(adapter.calls.values()) == count and set(adapter.calls.values()) == {1}
        assert session.status == "open"
        assert session.highest_revision == await store.head_revision(SCOPE)
        # The last state row written holds every handling's change.
        assert await restored_calls(store, lease) == count
        records = await store.list_records(SCOPE)
        assert len(records) == count
        assert all(isinstance(record.state, Succeeded) for record, _ in records)
    finally:
        await store.close()


async def test_a_failed_commit_fails_every_commit_built_on_it(journal_db: JournalDatabase) -> None:
    count = 40
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        adapter = CountingAdapter()
        # Commit 1 opens the session; commit 4 is an admission with others behind it.
        store = FailingCommitStore(real, fail_at=4)
        session, host = await open_session(store, lease, registry(adapter), count, 1)
        answers: list[Any] = []

        await asyncio.gather(
            *(
                session.handle(dispatch(host, n), store, Delivery(host, answers))
                for n in range(count)
            )
        )

        assert session.status == "poisoned"
        # The commits submitted after the failed one were built on it (they
        # were in flight when it failed): each failed, none landed on the
        # state before it. Those before it committed.
        later = [
            store.outcomes[call]
            for call in sorted(store.outcomes)
            if call > 4 and store.statuses[call][0] == "open"
        ]
        assert later and set(later) == {"WriteConflict"}
        assert [store.outcomes[call] for call in (1, 2, 3, 4)] == ["ok", "ok", "ok", "injected"]
        # Built once the failure settled: the refusals, each committed with the
        # session poisoned before it was published.
        refusals = [call for call in store.outcomes if store.statuses[call][0] == "poisoned"]
        assert refusals and {store.outcomes[call] for call in refusals} == {"ok"}
        built_on_it = [call for call in store.outcomes if call > 4 and call not in refusals]
        assert min(refusals) > max(built_on_it)
        admitted = {record.operation_key for record, _ in await real.list_records(SCOPE)}
        # The effect ran only for durable admissions, once each.
        assert set(adapter.calls) <= admitted
        assert set(adapter.calls.values()) <= {1}
        # The durable session state and the durable journal agree: every
        # durable admission is counted, and nothing else is.
        assert await restored_calls(real, lease) == len(admitted)
        # Every delivery got an answer: a result, or a refusal.
        assert len(answers) == count
        refused = [a for a in answers if isinstance(a, RequestRejected)]
        assert refused
        assert {a.code for a in refused} <= {
            "journal_persistence_failed",
            "session_poisoned",
            "indeterminate_operation",
        }
        records = dict((r.operation_key, r) for r, _ in await real.list_records(SCOPE))
        for answer in answers:
            if isinstance(answer, OperationResult):
                key = answer.result.operation_key
                assert not isinstance(records[key].state, Pending)
    finally:
        await real.close()


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.002)


async def started(
    session: WorkerSession, store: Any, frame: bytes, host: SessionAuthenticator, answers: list[Any]
) -> asyncio.Future[None]:
    """Start one handling and let it run until it waits (at a commit gate, say)."""
    task = asyncio.ensure_future(session.handle(frame, store, Delivery(host, answers)))
    await settle()
    return task


async def test_a_close_behind_a_failed_commit_commits_nothing_and_stays_poisoned(
    journal_db: JournalDatabase,
) -> None:
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = FailingCommitStore(real, fail_at=2)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        store.gates = {2: asyncio.Event(), 3: asyncio.Event()}
        answers: list[Any] = []
        first = await started(session, store, dispatch(host, 1), host, answers)
        second = await started(session, store, dispatch(host, 2), host, answers)
        close = host.seal(CloseSession(host.session_id))
        # Built while the two admissions are in flight, on top of them.
        closing = await started(session, store, close, host, answers)
        assert store.calls == 4 and store.statuses[4][0] == "closed"
        store.gates[2].set()  # the first admission fails; the others were built on it
        store.gates[3].set()
        await asyncio.wait_for(asyncio.gather(first, second, closing), 10)

        # The close was built on the failure: it failed with it, and the
        # session is still poisoned, as the daemon's reload expects.
        assert session.status == "poisoned"
        assert [store.outcomes[call] for call in (1, 2, 3, 4)] == [
            "ok",
            "injected",
            "WriteConflict",
            "WriteConflict",
        ]
        # After it, only the two refusals, each committed before its publish
        # with the session poisoned.
        assert store.calls == 6
        assert [store.statuses[call] for call in (5, 6)] == [("poisoned", True)] * 2
        assert [a.code for a in answers] == ["journal_persistence_failed"] * 2
        durable = (await real.load_sessions(SCOPE))["session-1"]
        assert durable.status == "poisoned"
        later: list[Any] = []
        await session.handle(dispatch(host, 3), store, Delivery(host, later))
        assert [a.code for a in later] == ["session_poisoned"]
        assert store.calls == 7 and store.statuses[7] == ("poisoned", True)
    finally:
        await real.close()


async def test_outbox_release_behind_a_failed_commit_commits_nothing(
    journal_db: JournalDatabase,
) -> None:
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = FailingCommitStore(real, fail_at=2)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        store.gates = {2: asyncio.Event()}
        answers: list[Any] = []
        first = await started(session, store, dispatch(host, 1), host, answers)
        session.confirm_published("ab" * 32)
        release = asyncio.ensure_future(session.release_confirmed(store))
        await settle()
        store.gates[2].set()
        await first
        assert await release == 0
        assert session.status == "poisoned"
        # No outbox-only commit after the failure: the one commit after it is
        # the refusal of the failed admission (state and outbox row).
        assert store.calls == 3 and store.statuses[3] == ("poisoned", True)
    finally:
        await real.close()


class UnchainedStore(FailingCommitStore):
    chains_session_commits = False


async def test_a_handling_cancelled_while_waiting_its_turn_changes_nothing(
    journal_db: JournalDatabase,
) -> None:
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = UnchainedStore(real, fail_at=0)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        store.gates = {2: asyncio.Event()}
        answers: list[Any] = []
        first = await started(session, store, dispatch(host, 1), host, answers)
        # The close waits for the admission in flight before it reads or
        # changes anything (a store that cannot chain).
        close = await started(
            session, store, host.seal(CloseSession(host.session_id)), host, answers
        )
        close.cancel()
        await settle()
        assert close.cancelled()  # at once: it had changed nothing
        store.gates[2].set()
        await first

        assert session.status == "open"
        assert [store.statuses[call] for call in (2, 3)] == [("open", True), ("open", True)]
        assert store.calls == 3
        assert (await real.load_sessions(SCOPE))["session-1"].status == "open"
    finally:
        await real.close()


async def test_a_closed_session_is_never_persisted_poisoned_again(
    journal_db: JournalDatabase,
) -> None:
    # The daemon's reload records a poisoned session poisoned; a close_session
    # committed first keeps the session closed.
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = FailingCommitStore(real, fail_at=0)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        await session.handle(host.seal(CloseSession(host.session_id)), store, Delivery(host, []))
        assert session.status == "closed" and store.calls == 2

        revision = await session.persist_poisoned(store)

        assert store.calls == 2 and revision == session.highest_revision
        assert session.status == "closed"
        assert (await real.load_sessions(SCOPE))["session-1"].status == "closed"
    finally:
        await real.close()


async def test_with_a_store_that_cannot_chain_a_handling_starts_after_the_commit_before_it(
    journal_db: JournalDatabase,
) -> None:
    # As when the session held its lock through each commit: the second
    # request reads the session as the failed commit left it, poisoned.
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = UnchainedStore(real, fail_at=2)
        session, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        store.gates = {2: asyncio.Event()}
        first: list[Any] = []
        second: list[Any] = []
        one = await started(session, store, dispatch(host, 1), host, first)
        two = await started(session, store, dispatch(host, 2), host, second)
        assert store.calls == 2  # the second waits for the first's commit, unbuilt
        store.gates[2].set()
        await asyncio.wait_for(asyncio.gather(one, two), 10)

        assert [a.code for a in first] == ["journal_persistence_failed"]
        assert [a.code for a in second] == ["session_poisoned"]
        # Two refusals, each committed before its publish.
        assert store.calls == 4
        assert [store.statuses[call] for call in (3, 4)] == [("poisoned", True)] * 2
    finally:
        await real.close()


# An ack or a dead-letter that commits nothing waits for the commit before it (S1) ---


class ReadOnlyAdapter(CountingAdapter):
    def invocation_safety(self) -> InvocationSafety:
        return InvocationSafety.READ_ONLY

    async def invoke(self, request: Any, grant: Any, context: Any) -> ToolPayload:
        return ToolPayload.json({"ok": 1})


class Settling(Delivery):
    """Records how it was settled; nothing else."""

    def __init__(self, host: SessionAuthenticator) -> None:
        super().__init__(host, [])
        self.events: list[str] = []

    async def ack(self) -> None:
        self.events.append("ack")

    async def reply(self, frame: bytes, correlation_id: str | None) -> None:
        self.events.append("reply")

    async def dead_letter(self, reason: str) -> None:
        self.events.append(f"dead_letter:{reason}")

    async def requeue(self) -> None:
        self.events.append("requeue")


def invoke(host: SessionAuthenticator) -> bytes:
    return host.seal(
        Invoke(ToolInvocation(host.session_id, "i-1", TOOL, ToolPayload.json({"n": 1})))
    )


@dataclass
class GatedSession:
    """A session whose first commit after the open waits at a gate, then lands or fails."""

    real: JournalStoreBase
    store: FailingCommitStore
    session: WorkerSession
    host: SessionAuthenticator


@pytest.fixture(params=[True, False], ids=["lands", "fails"])
async def gated(
    request: pytest.FixtureRequest, journal_db: JournalDatabase
) -> AsyncIterator[GatedSession]:
    real = journal_db.store(StorageKeyring("k1", bytes(32)))
    try:
        lease = await real.reserve_fence(SCOPE)
        store = FailingCommitStore(real, fail_at=0 if request.param else 2)
        session, host = await open_session(store, lease, registry(ReadOnlyAdapter()), 10, 1)
        store.gates = {2: asyncio.Event()}
        yield GatedSession(real, store, session, host)
    finally:
        await real.close()


async def test_a_duplicate_is_acked_only_once_the_commit_recording_the_original_lands(
    gated: GatedSession,
) -> None:
    session, store, host = gated.session, gated.store, gated.host
    frame = invoke(host)
    first, second = Settling(host), Settling(host)
    one = asyncio.ensure_future(session.handle(frame, store, first))
    await settle()
    two = asyncio.ensure_future(session.handle(frame, store, second))  # the same bytes
    await settle()
    # Only the first delivery's commit records the frame: the copy waits for it.
    assert first.events == [] and second.events == []
    store.gates[2].set()
    await asyncio.wait_for(asyncio.gather(one, two), 10)
    if store.fail_at == 0:
        assert second.events == ["ack"]
        assert first.events == ["ack", "reply"]
    else:
        # Nothing durable holds the frame: the copy goes back to the broker.
        assert second.events == ["requeue"]
        assert session.status == "poisoned"


async def test_a_frame_of_a_closing_session_is_dropped_only_once_the_close_lands(
    gated: GatedSession,
) -> None:
    session, store, host = gated.session, gated.store, gated.host
    closer, late = Settling(host), Settling(host)
    closing = asyncio.ensure_future(
        session.handle(host.seal(CloseSession(host.session_id)), store, closer)
    )
    await settle()
    assert session.status == "closed"  # in memory; the commit waits at its gate
    dropping = asyncio.ensure_future(session.handle(dispatch(host, 1), store, late))
    await settle()
    assert late.events == []
    store.gates[2].set()
    await asyncio.wait_for(asyncio.gather(closing, dropping), 10)
    if store.fail_at == 0:
        assert late.events == ["dead_letter:session_closed"]
    else:
        assert late.events == ["requeue"]
        assert session.status == "poisoned"


async def test_a_superseded_worker_seals_nothing_so_the_new_owner_reuses_no_sequence(
    journal_db: JournalDatabase,
) -> None:
    ring = StorageKeyring("k1", bytes(32))
    old = journal_db.store(ring)
    new = journal_db.store(ring)
    try:
        old_lease = await old.reserve_fence(SCOPE)
        first, host = await open_session(old, old_lease, registry(CountingAdapter()), 10, 1)
        served = Settling(host)
        await first.handle(dispatch(host, 1), old, served)
        assert served.events == ["ack", "reply"]
        # Another worker takes the scope over and restores the session.
        new_lease = await new.reserve_fence(SCOPE)
        second = await WorkerSession.restore(
            (await new.load_sessions(SCOPE))["session-1"],
            scope_key=SCOPE_KEY,
            scope=SCOPE,
            store=new,
            lease=new_lease,
            adapters=registry(CountingAdapter()),
            limits=WorkerSessionLimits(),
        )
        # The old worker still consumes: its commit meets the new fence. It
        # seals nothing and hands the frame back (the new owner answers it) ...
        answers: list[Any] = []
        refused = Settling(host)
        await first.handle(dispatch(host, 2), old, refused)
        assert refused.events == ["requeue"]
        assert first.status == "poisoned"
        later = Settling(host)
        await first.handle(dispatch(host, 3), old, later)
        assert later.events == ["requeue"]
        # ... so the new owner's replies carry sequences the host never saw.
        await second.handle(dispatch(host, 2), new, Delivery(host, answers))
        assert isinstance(answers[0], OperationResult)
    finally:
        await old.close()
        await new.close()
