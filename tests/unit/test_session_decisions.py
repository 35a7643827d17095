"""The session's decisions (octo_worker.session.decisions), driven without any I/O.

``SessionDecisions`` returns steps and never awaits: these tests play the
driver's part by hand (a commit's revision or failure, an adapter's answer)
and check what each decision asks for next, in order.
"""

from __future__ import annotations

import secrets
from typing import Any

import pytest
import structlog

from octo_common.authorizer import SessionAuthorizer
from octo_common.errors import (
    AdapterIndeterminate,
    AdapterInvalidJsonInput,
    StorageBackendError,
)
from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    DispatchOperation,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationResult,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, Pending, StateKind, Succeeded
from octo_worker.adapters.declarations import DurableOperationContract
from octo_worker.session.decisions import SessionDecisions, WorkerSessionLimits
from octo_worker.session.rules import OPEN, POISONED
from octo_worker.session.state import SessionState
from octo_worker.session.steps import (
    AdapterStep,
    Commit,
    DeadLetter,
    Drain,
    Handling,
    Reply,
    Requeue,
    Step,
)

SCOPE = "tenant-a"
SESSION = "s-decisions"
TOOL = "t.op"


class Adapter:
    """Declares its contract; ``fences`` says whether a lookup miss fences the key."""

    def __init__(self, fences: bool = False) -> None:
        self.fences = fences

    def durable_operation_contract(self) -> DurableOperationContract:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> bool:
        return self.fences

    async def dispatch_operation(self, request: Any, grant: Any, context: Any) -> Any:
        raise AssertionError("the decisions never call an adapter")


class Registry:
    def __init__(self, adapter: Adapter | None) -> None:
        self.adapter = adapter

    def get(self, tool: str) -> Any:
        return self.adapter if tool == TOOL else None

    def deadline_for(self, tool: str) -> float:
        return 5.0


class Commits:
    superseded = False
    broken = False


class World:
    def __init__(self, adapter: Adapter | None = None) -> None:
        nonce = secrets.token_bytes(32)
        key = SessionKey.derive(ScopeKey.from_bytes(secrets.token_bytes(32)), SCOPE, SESSION, nonce)
        self.host = SessionAuthenticator(SESSION, key, SessionRole.HOST)
        manifest = CapabilityManifest(SESSION, [CapabilityGrant(TOOL, "json", max_calls=8)])
        self.state = SessionState(
            scope=SCOPE,
            session_id=SESSION,
            key_nonce=nonce,
            reply_to="octo.v5.reply.h",
            manifest=manifest,
            authenticator=SessionAuthenticator(SESSION, key, SessionRole.WORKER),
            authorizer=SessionAuthorizer(manifest),
            status=OPEN,
            reconciliations_total=0,
            reconciliations_by_tool={},
        )
        self.commits = Commits()
        self.decisions = SessionDecisions(
            self.state,
            commits=self.commits,
            adapters=Registry(adapter if adapter is not None else Adapter()),
            limits=WorkerSessionLimits(),
        )

    def run(self, records: dict[str, Any] | None = None) -> Handling:
        return Handling(
            delivery=None,  # type: ignore[arg-type]  # the decisions never settle it
            store=None,  # type: ignore[arg-type]
            log=structlog.get_logger("test"),
            records=records,
        )

    def dispatch(self, key: str = "op-1", index: int = 1) -> bytes:
        request = OperationDispatchRequest(
            SESSION, f"req-{index}", TOOL, key, ToolPayload.json({"name": key})
        )
        return self.host.seal(DispatchOperation(request))

    def succeeded(self, key: str = "op-1") -> tuple[Any, int]:
        """Run one dispatch of ``key`` through its decisions: its journal row, succeeded."""
        admission = _commit(self.decisions.answer(self.dispatch(key, 100), self.run({key: None})))
        call = admission.then(2)
        assert isinstance(call, AdapterStep)
        observed = _commit(call.after(Succeeded(ToolPayload.json({})), None))
        assert observed.journal is not None
        observed.then(3)
        return observed.journal.rows[key].record, 3

    def opened(self, frame: bytes) -> Any:
        return self.host.open(frame)


def _commit(step: Step) -> Commit:
    assert isinstance(step, Commit), step
    return step


def test_a_new_dispatch_commits_its_admission_then_asks_for_the_adapter_acked_first() -> None:
    world = World()
    run = world.run({"op-1": None})
    admission = _commit(world.decisions.answer(world.dispatch(), run))
    assert admission.outbox is None and admission.journal is not None
    assert [row.record.state for row in admission.journal.rows.values()] == [Pending()]
    call = admission.then(2)
    assert isinstance(call, AdapterStep)
    assert (call.ack_first, call.admission, call.effect, call.method) == (
        True,
        True,
        True,
        "dispatch_operation",
    )
    # The adapter's answer: observed, committed with the reply, then published.
    observed = _commit(call.after(Succeeded(ToolPayload.json({"ok": True})), None))
    assert observed.journal is not None and observed.outbox is not None
    reply = observed.then(3)
    assert isinstance(reply, Reply) and reply.outbox_id == observed.outbox.message_id
    assert (reply.refused, reply.unresolved) == (False, False)
    message = world.opened(reply.frame)
    assert isinstance(message, OperationResult)
    assert message.result.status.kind == StateKind.SUCCEEDED


def test_a_known_key_is_answered_from_the_journal_without_an_admission_or_an_adapter() -> None:
    world = World()
    row = world.succeeded()
    # A new request id for the same key and input: the journal holds it, succeeded.
    step = _commit(world.decisions.answer(world.dispatch(index=2), world.run({"op-1": row})))
    assert step.journal is None and step.outbox is not None  # the reply, no journal change
    reply = step.then(4)
    assert isinstance(reply, Reply) and not reply.refused
    assert isinstance(world.opened(reply.frame), OperationResult)


def test_an_input_refusal_before_any_effect_ends_the_key_failed_with_its_code() -> None:
    world = World()
    call = _commit(world.decisions.answer(world.dispatch(), world.run({"op-1": None}))).then(2)
    assert isinstance(call, AdapterStep)
    observed = _commit(call.after(None, AdapterInvalidJsonInput("no")))
    assert observed.journal is not None
    (row,) = observed.journal.rows.values()
    assert isinstance(row.record.state, Failed)
    assert row.record.state.code == FailureCode.INPUT_REFUSED


@pytest.mark.parametrize(("fences", "refused"), [(False, True), (True, False)])
def test_an_unfenced_lookup_miss_from_an_effect_is_indeterminate(
    fences: bool, refused: bool
) -> None:
    world = World(Adapter(fences=fences))
    call = _commit(world.decisions.answer(world.dispatch(), world.run({"op-1": None}))).then(2)
    assert isinstance(call, AdapterStep)
    miss = Failed("not there", FailureCode.NOT_HAPPENED.value)
    step = _commit(call.after(miss, None))
    reply = step.then(3)
    assert isinstance(reply, Reply) and reply.refused is refused
    message = world.opened(reply.frame)
    if refused:
        assert isinstance(message, RequestRejected)
        assert message.code == "indeterminate_operation"
        assert step.journal is None  # the observation is dropped
    else:
        assert isinstance(message, OperationResult)


def test_an_adapter_that_may_have_acted_leaves_an_indeterminate_refusal() -> None:
    world = World()
    call = _commit(world.decisions.answer(world.dispatch(), world.run({"op-1": None}))).then(2)
    assert isinstance(call, AdapterStep)
    reply = _commit(call.after(None, AdapterIndeterminate("deadline"))).then(3)
    assert isinstance(reply, Reply)
    message = world.opened(reply.frame)
    assert isinstance(message, RequestRejected) and message.code == "indeterminate_operation"


def test_a_failed_admission_commit_is_refused_once_that_refusal_is_committed() -> None:
    world = World()
    admission = _commit(world.decisions.answer(world.dispatch(), world.run({"op-1": None})))
    world.state.status = POISONED  # what the commit pipeline does on a failure
    world.commits.broken = True  # and commits built on it are still in flight
    drain = admission.failed(StorageBackendError("disk"))
    assert isinstance(drain, Drain)  # nothing more is built on the failure first
    refusal = _commit(drain.then())
    assert refusal.journal is None and refusal.outbox is not None
    reply = refusal.then(2)
    assert isinstance(reply, Reply) and reply.refused
    message = world.opened(reply.frame)
    assert isinstance(message, RequestRejected) and message.code == "journal_persistence_failed"


def test_a_poisoned_refusal_whose_own_commit_fails_is_published_uncommitted() -> None:
    world = World()
    world.state.status = POISONED
    step = _commit(world.decisions.answer(world.dispatch(), world.run({"op-1": None})))
    assert step.journal is None and step.outbox is not None
    reply = step.failed(StorageBackendError("disk"))
    assert isinstance(reply, Reply) and reply.outbox_id is None and reply.refused
    message = world.opened(reply.frame)
    assert isinstance(message, RequestRejected) and message.code == "session_poisoned"


def test_a_superseded_session_publishes_nothing() -> None:
    world = World()
    world.state.status = POISONED
    world.commits.superseded = True
    assert isinstance(world.decisions.answer(world.dispatch(), world.run({"op-1": None})), Requeue)


def test_a_lookup_spends_its_budget_and_refuses_an_unfenced_miss() -> None:
    world = World()
    row = world.succeeded()

    def reconcile(request_id: str) -> bytes:
        request = OperationReconcileRequest(SESSION, request_id, TOOL, "op-1")
        return world.host.seal(ReconcileOperation(request))

    call = world.decisions.answer(reconcile("rec-1"), world.run({"op-1": row}))
    assert isinstance(call, AdapterStep)  # nothing committed before a lookup
    assert (call.ack_first, call.effect) == (False, False)
    assert world.state.reconciliations_total == 1
    miss = Failed("not there", FailureCode.NOT_HAPPENED.value)
    step = _commit(call.after(miss, None))
    assert step.journal is None
    reply = step.then(4)
    assert isinstance(reply, Reply)
    message = world.opened(reply.frame)
    assert isinstance(message, RequestRejected) and message.code == "adapter_error"
    # A status it can record is answered as a reconciliation, with the row.
    call = world.decisions.answer(reconcile("rec-2"), world.run({"op-1": row}))
    assert isinstance(call, AdapterStep)
    step = _commit(call.after(Succeeded(ToolPayload.json({})), None))
    assert step.journal is not None
    reply = step.then(5)
    assert isinstance(reply, Reply) and isinstance(world.opened(reply.frame), ReconciledOperation)
    assert world.state.reconciliations_total == 2


def test_a_frame_that_does_not_authenticate_is_dead_lettered() -> None:
    world = World()
    assert isinstance(world.decisions.answer(b"not a frame", world.run()), DeadLetter)


def test_a_redelivered_frame_is_answered_from_the_journal_never_admitted_again() -> None:
    world = World()
    frame = world.dispatch()
    admission = _commit(world.decisions.answer(frame, world.run({"op-1": None})))
    call = admission.then(2)
    assert isinstance(call, AdapterStep)
    observed = _commit(call.after(Succeeded(ToolPayload.json({})), None))
    assert observed.journal is not None
    row = (observed.journal.rows["op-1"].record, 3)
    observed.then(3)
    again = _commit(world.decisions.answer(frame, world.run({"op-1": row})))
    assert again.journal is None and again.outbox is not None
    reply = again.then(4)
    assert isinstance(reply, Reply) and not reply.refused
    message = world.opened(reply.frame)
    assert isinstance(message, OperationResult)
    assert message.result.request_id == "req-1"
    assert message.result.status.kind == StateKind.SUCCEEDED
