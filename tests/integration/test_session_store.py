"""WorkerSession across crashes, restarts and store faults, on both journal backends.

Every ``world`` here is opened on ``journal_db`` (a SQLite file, then a
PostgreSQL schema). A "restart" closes the store object and opens a new one
on the same database,
reserves a fresh fence and rebuilds the session with ``WorkerSession.restore``
from what ``load_sessions`` returns, as the daemon does. A "crash"
cancels a handling mid-flight. Faults are injected at the store boundary
(``FaultyStore`` wraps the real store).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import (
    FencingTokenRejected,
    InvalidJournalLease,
    RecordLocationMismatch,
    SerializationError,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.messages import (
    CloseSession,
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    OperationResult,
    ReconciledOperation,
    Result,
)
from octo_common.payload import ToolPayload
from octo_common.states import Pending, Succeeded
from octo_worker.session.session import WorkerSession, WorkerSessionLimits
from octo_worker.storage.base import JournalStoreBase
from octo_worker.store import SessionDocuments, WorkerCommit

from .journal_backends import JournalDatabase
from .test_session import (
    NONCE,
    PUBLISH,
    REPLY_TO,
    SCOPE,
    SCOPE_KEY,
    SCRIPTED,
    SESSION,
    FaultyStore,
    RecordingDelivery,
    World,
    open_world,
    publish_grant,
    publish_payload,
    rejection_code,
    scripted_grant,
    session_key,
    wait_until,
)


async def restart(world: World) -> tuple[JournalStoreBase, Any]:
    """Close the store, reopen the database under a fresh fence, restore the session."""
    await world.real_store.close()
    store = world.new_store()
    lease = await store.reserve_fence(SCOPE)
    persisted = (await store.load_sessions(SCOPE))[SESSION]
    session = await WorkerSession.restore(
        persisted,
        scope_key=ScopeKey.from_bytes(SCOPE_KEY),
        scope=SCOPE,
        store=store,
        lease=lease,
        adapters=world.adapters,
        limits=WorkerSessionLimits(),
    )
    world.real_store = store
    world.store = FaultyStore(store)
    world.lease = lease
    world.session = session
    return store, lease


@pytest.fixture
async def world(tmp_path: Path, journal_db: JournalDatabase) -> Any:
    w = await open_world(tmp_path, database=journal_db)
    yield w
    w.files.close()
    await w.real_store.close()


async def test_example_22_redelivery_after_restart_is_answered_from_the_journal(
    world: World,
) -> None:
    frame = world.host.seal(world.dispatch("op-restart", publish_payload("r.txt")))
    first = await world.deliver(frame)
    assert isinstance(world.answer(first), OperationResult)
    calls = world.session.calls_for(PUBLISH)

    await restart(world)
    assert world.session.status == "open"
    assert world.session.calls_for(PUBLISH) == calls
    assert world.session.highest_revision == await world.real_store.head_revision(SCOPE)

    redelivered = await world.deliver(frame)
    answer = world.answer(redelivered)
    assert isinstance(answer, OperationResult)
    assert isinstance(answer.result.status, Succeeded)
    assert answer.result.request_id == "dispatch-1"
    assert world.session.calls_for(PUBLISH) == calls  # no budget charged
    assert len(world.effects()) == 1  # adapter not re-run
    (commit,) = world.store.commits
    assert commit.journal is None


async def test_crash_after_admission_leaves_pending_and_reconciliation_resolves(
    world: World,
) -> None:
    gate = asyncio.Event()
    world.scripted.gate = gate
    frame = world.host.seal(world.dispatch("op-crash", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    delivery = RecordingDelivery()
    task = asyncio.create_task(world.session.handle(frame, world.store, delivery))
    await wait_until(lambda: world.scripted.calls == ["dispatch"])
    assert delivery.kinds == ["ack"]  # acked after the admission commit, before the adapter
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await restart(world)
    world.scripted.gate = None
    record = await world.record("op-crash")
    assert record is not None and isinstance(record.state, Pending)

    redelivered = await world.deliver(frame)
    assert rejection_code(world.answer(redelivered)) == "pending_operation"
    world.scripted.reconcile_outcome = Succeeded(ToolPayload.json({"ok": 1}))
    reconciled = await world.send(world.reconcile("op-crash", tool=SCRIPTED))
    answer = world.answer(reconciled)
    assert isinstance(answer, ReconciledOperation)
    assert isinstance(answer.result.status, Succeeded)
    record = await world.record("op-crash")
    assert record is not None and isinstance(record.state, Succeeded)
    # Only the first frame ever ran the effect; the lookup never re-dispatches.
    assert world.scripted.calls == ["dispatch", "reconcile"]


async def test_frame_not_durable_before_a_crash_is_handled_as_new(world: World) -> None:
    done = Succeeded(ToolPayload.json({"ok": 1}))
    world.scripted.dispatch_outcome = world.scripted.reconcile_outcome = done
    await world.send(world.dispatch("op-none", ToolPayload.json({"a": 1}), tool=SCRIPTED))
    # A reconciliation commits only after its lookup: crash during the lookup.
    gate = asyncio.Event()
    world.scripted.gate = gate
    frame = world.host.seal(world.reconcile("op-none", tool=SCRIPTED))
    task = asyncio.create_task(world.session.handle(frame, world.store, RecordingDelivery()))
    await wait_until(lambda: world.scripted.calls == ["dispatch", "reconcile"])
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    await restart(world)
    world.scripted.gate = None
    assert world.session.reconciliations() == (0, {})  # nothing of it was durable
    again = await world.deliver(frame)
    assert isinstance(world.answer(again), ReconciledOperation)
    assert world.session.reconciliations() == (1, {SCRIPTED: 1})


async def test_poisoning_reload_persists_poisoned_and_never_reuses_a_sequence(
    world: World,
) -> None:
    # The refusal's own commit fails too: the refusal is published best-effort
    # without a commit, and the reload records the session poisoned with its
    # outbound counter past that refusal's sequence, so no sequence is reused.
    first = len(world.store.commits) + 1
    world.store.fail_commits = {first, first + 1}
    refused = await world.send(world.dispatch("op-p", publish_payload("p.txt")))
    assert refused.kinds == ["reply", "ack"]
    assert rejection_code(world.answer(refused)) == "journal_persistence_failed"
    old = world.session
    assert old.status == "poisoned" and old.commit_failed
    reserve = old.next_outgoing
    old_store, old_lease = world.real_store, world.lease

    # The daemon's reload: fresh fence, restore, persist poisoned.
    reloaded = world.new_store()
    lease = await reloaded.reserve_fence(SCOPE)
    persisted = (await reloaded.load_sessions(SCOPE))[SESSION]
    assert persisted.status == "open"  # the failed commits left nothing
    session = await WorkerSession.restore(
        persisted,
        scope_key=ScopeKey.from_bytes(SCOPE_KEY),
        scope=SCOPE,
        store=reloaded,
        lease=lease,
        adapters=world.adapters,
        limits=WorkerSessionLimits(),
    )
    await session.persist_poisoned(reloaded, reserve=reserve)
    assert (await reloaded.load_sessions(SCOPE))[SESSION].status == "poisoned"
    assert session.next_outgoing == reserve
    assert not session.commit_failed

    # The superseded store instance can no longer write.
    with pytest.raises(FencingTokenRejected):
        await old_store.commit(SCOPE, old_lease, world.store.commits[0])
    await old_store.close()

    world.real_store, world.lease, world.session = reloaded, lease, session
    world.store = FaultyStore(reloaded)
    later = await world.send(world.dispatch("op-q", publish_payload("q.txt")))
    # The host opens it: a reused sequence would raise DuplicateFrame here.
    assert rejection_code(world.answer(later)) == "session_poisoned"
    (refusal,) = world.store.commits  # committed before its publish, nothing else
    assert refusal.journal is None and len(refusal.outbox_insert) == 1
    assert world.effects() == []
    # The redelivered frame of the first refusal is answered now.
    again = await world.send(world.dispatch("op-p", publish_payload("p.txt")))
    assert rejection_code(world.answer(again)) == "session_poisoned"

    # After another restart the session is still poisoned.
    await restart(world)
    assert world.session.status == "poisoned"


class SlowCommitStore(FaultyStore):
    """Commits really, but reports the outcome only when the test lets it."""

    def __init__(self, inner: JournalStoreBase) -> None:
        super().__init__(inner)
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def commit(self, scope: str, lease: Any, changes: WorkerCommit) -> int:
        revision = await super().commit(scope, lease, changes)
        self.entered.set()
        await self.release.wait()
        return revision


async def test_cancelled_handler_still_learns_its_commit_outcome(world: World) -> None:
    slow = SlowCommitStore(world.real_store)
    frame = world.host.seal(world.invoke(ToolPayload.json({"a": 1})))
    task = asyncio.create_task(world.session.handle(frame, slow, RecordingDelivery()))
    await slow.entered.wait()
    task.cancel()
    await asyncio.sleep(0.01)
    assert not task.done()  # waits for the shielded commit's outcome
    slow.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert world.session.status == "open"
    assert world.session.highest_revision == await world.real_store.head_revision(SCOPE)
    # The next commit builds on the committed state row: no conflict, no poisoning.
    later = await world.send(world.invoke(ToolPayload.json({"a": 2})))
    assert isinstance(world.answer(later), Result)
    assert world.session.calls_for(SCRIPTED) == 2


async def test_restore_checks_lease_and_location(world: World) -> None:
    persisted = (await world.real_store.load_sessions(SCOPE))[SESSION]
    common: dict[str, Any] = {
        "scope_key": ScopeKey.from_bytes(SCOPE_KEY),
        "store": world.real_store,
        "adapters": world.adapters,
        "limits": WorkerSessionLimits(),
    }
    with pytest.raises(InvalidJournalLease):
        await WorkerSession.restore(persisted, scope=SCOPE, lease=object(), **common)  # type: ignore[arg-type]
    with pytest.raises(RecordLocationMismatch):
        await WorkerSession.restore(persisted, scope="tenant-other", lease=world.lease, **common)


async def test_restore_rebuilds_the_same_state_and_refuses_foreign_documents(
    world: World,
) -> None:
    await world.send(world.dispatch("op-doc", publish_payload("doc.txt")))
    persisted = (await world.real_store.load_sessions(SCOPE))[SESSION]
    restored = await WorkerSession.restore(
        persisted,
        scope_key=ScopeKey.from_bytes(SCOPE_KEY),
        scope=SCOPE,
        store=world.real_store,
        lease=world.lease,
        adapters=world.adapters,
        limits=WorkerSessionLimits(),
    )
    assert restored._commits.state_document() == persisted.state
    assert restored.key_nonce == NONCE and restored.reply_to == REPLY_TO

    # A document this module did not write (an extra key inside the manifest).
    opening = persisted.opening.replace(b'"grants":', b'"note":1,"grants":', 1)
    forged = SessionDocuments(
        state=persisted.state.replace(SESSION.encode(), b"session-9"),
        opening=opening.replace(SESSION.encode(), b"session-9"),
    )
    await world.real_store.commit(SCOPE, world.lease, WorkerCommit(sessions={"session-9": forged}))
    foreign = (await world.real_store.load_sessions(SCOPE))["session-9"]
    with pytest.raises(SerializationError):
        await WorkerSession.restore(
            foreign,
            scope_key=ScopeKey.from_bytes(SCOPE_KEY),
            scope=SCOPE,
            store=world.real_store,
            lease=world.lease,
            adapters=world.adapters,
            limits=WorkerSessionLimits(),
        )


async def test_reply_whose_publish_failed_stays_in_the_outbox_across_restart(
    world: World,
) -> None:
    delivery = RecordingDelivery(fail_reply=True)
    await world.deliver(world.host.seal(world.dispatch("op-o", publish_payload("o.txt"))), delivery)
    assert delivery.kinds == ["ack", "reply_failed"]  # acked at admission; reply kept
    await restart(world)
    (entry,) = await world.real_store.load_outbox(SCOPE)
    assert (entry.reply_to, entry.correlation_id) == (REPLY_TO, "dispatch-1")
    answer = world.host.open(entry.frame)
    assert isinstance(answer, OperationResult) and isinstance(answer.result.status, Succeeded)
    # Once the daemon's republish is confirmed, the next commit deletes the row.
    world.session.confirm_published(entry.message_id)
    await world.send(world.reconcile("op-o"))
    assert entry.message_id in world.store.commits[0].outbox_delete
    remaining = await world.real_store.load_outbox(SCOPE)
    assert entry.message_id not in [e.message_id for e in remaining]


async def test_closed_session_stays_closed_after_restart(world: World) -> None:
    await world.send(CloseSession(SESSION))
    await restart(world)
    assert world.session.status == "closed"
    delivery = await world.send(world.dispatch("op-c", publish_payload("c.txt")))
    assert delivery.events == [("dead_letter", "session_closed")]


async def test_two_sessions_of_a_scope_share_the_key_lock(
    tmp_path: Path, journal_db: JournalDatabase
) -> None:
    w = await open_world(tmp_path, database=journal_db)
    try:
        # A second session on the same store and scope.
        other_id = "session-2"
        key = session_key(other_id)
        host2 = SessionAuthenticator(other_id, key, SessionRole.HOST)
        manifest = CapabilityManifest(other_id, [publish_grant(), scripted_grant()])
        session2 = await WorkerSession.open(
            SessionAuthenticator(other_id, key, SessionRole.WORKER),
            host2.seal(OpenSession(manifest, reply_to=REPLY_TO)),
            scope=SCOPE,
            key_nonce=NONCE,
            reply_to=REPLY_TO,
            store=w.store,
            lease=w.lease,
            adapters=w.adapters,
            limits=WorkerSessionLimits(),
        )
        gate = asyncio.Event()
        w.scripted.gate = gate
        payload = ToolPayload.json({"a": 1})
        frame1 = w.host.seal(w.dispatch("op-shared", payload, tool=SCRIPTED))
        frame2 = host2.seal(
            DispatchOperation(
                OperationDispatchRequest(other_id, "dispatch-x", SCRIPTED, "op-shared", payload)
            )
        )
        d1, d2 = RecordingDelivery(), RecordingDelivery()
        t1 = asyncio.create_task(w.session.handle(frame1, w.store, d1))
        await wait_until(lambda: w.scripted.calls == ["dispatch"])
        t2 = asyncio.create_task(session2.handle(frame2, w.store, d2))
        await asyncio.sleep(0.05)
        assert d2.events == []  # parked on the scope's key lock
        gate.set()
        await asyncio.gather(t1, t2)
        assert w.scripted.calls == ["dispatch"]
        answer2 = host2.open(d2.frames[0])
        assert isinstance(answer2, OperationResult)
        assert isinstance(answer2.result.status, Succeeded)
    finally:
        w.files.close()
        await w.real_store.close()
