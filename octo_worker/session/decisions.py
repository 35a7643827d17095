"""What a worker session answers to each frame it authenticated: pure decisions as steps.

:class:`SessionDecisions` decides, under the session lock, what one frame
gets, and returns it as a step for the session's one driver
(``WorkerSession.handle``): a :class:`~octo_worker.session.steps.Commit` whose
outcome it decides on next, an adapter call followed by more decisions, or an
end (a reply, an ack, a dead-letter, a requeue). It never awaits: the driver
runs every commit, adapter call, publish and ack.

The status rules of :mod:`octo_worker.session.rules` pick the answer;
``invoke`` has its own decisions; every keyed request goes through one path
driven by its row of :mod:`octo_worker.session.request_kinds` (an effect
kind admits and acks before its adapter, a lookup kind spends the
reconciliation budgets); a duplicate is answered from the journal. The
answers are:

* refuse(error): seal a ``request_rejected`` naming the request, commit it
  with the session state, reply;
* respond(message, changes): seal, commit the journal changes, the state and
  the outbox row, reply;
* a failed commit: the session is already poisoned in memory; once no
  commit of it is in flight, the refusal with the failure's code is
  committed like any refusal, with the session state recording both its
  sequence and the status ``poisoned``, and only then published; a poisoned
  session's later refusals (``session_poisoned``) are committed the same
  way. When that commit fails too, the refusal is published best-effort
  without committing: the reload that follows persists the session's
  outbound counter past its sequence before anything else is sealed
  (``WorkerSession.persist_poisoned``). Only a session superseded by another
  worker's fence publishes nothing.

Pure: no I/O; it changes the session's state and the handling's record.
It must never run an adapter or a commit itself, never publish anything not
committed first (a poisoned session's refusal whose own commit failed
aside), and never put keys, payloads, failure messages or adapter text in a
refusal or a log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Protocol

from octo_common.authorizer import AuthorizedInvocation, SessionAuthorizer
from octo_common.digest import message_id
from octo_common.errors import (
    AdapterError,
    AdapterFailed,
    AdapterIndeterminate,
    DuplicateFrame,
    DurableOperationContractNotDeclared,
    InvalidJournalRevision,
    InvocationSafetyNotDeclared,
    JournalPersistenceFailed,
    MissingAdapter,
    OctoError,
    PendingCompensation,
    PendingOperation,
    ReconciliationBudgetExhausted,
    ReconciliationSessionBudgetExhausted,
    SessionPoisoned,
    SessionReplay,
    StorageBackendError,
    UnexpectedMessage,
    UnsupportedMessage,
    ZeroPerToolReconciliationLimit,
    ZeroSessionReconciliationLimit,
)
from octo_common.messages import (
    Cancel,
    CompensationResult,
    Invoke,
    OperationResult,
    ReconciledCompensation,
    ReconciledOperation,
    RequestRejected,
    Result,
    ToolResult,
    WorkerMessage,
    message_type,
)
from octo_common.payload import ToolPayload
from octo_common.states import (
    TERMINAL_KINDS,
    Cancelled,
    Failed,
    FailureCode,
    Pending,
    Running,
    Succeeded,
    did_not_act,
    is_proven_not_happened,
)
from octo_worker.adapters.context import AdapterContext
from octo_worker.adapters.declarations import (
    DurableOperationContract,
    InvocationSafety,
    declaration,
    lookup_miss_fences_key,
    refusal_status,
)
from octo_worker.journal import Existing, JournalChangeset, WorkerOperationJournal
from octo_worker.session.request_kinds import KEYED_MESSAGES, KeyedKind
from octo_worker.session.rules import CLOSED, CLOSED_REASON, Answer, answer
from octo_worker.session.state import SessionState
from octo_worker.session.steps import (
    Ack,
    AdapterStep,
    Commit,
    DeadLetter,
    Drain,
    Handling,
    Reply,
    Requeue,
    Step,
)
from octo_worker.storage.interface import OutboxEntry

__all__ = [
    "STATUS_TYPES",
    "SessionDecisions",
    "WorkerSessionLimits",
    "reply_unresolved",
    "settled_without_adapter",
]

STATUS_TYPES: Final = (Running, Succeeded, Failed, Cancelled)
# Refusals that say the journal holds the key pending.
_PENDING_CODES: Final = frozenset({PendingOperation.code, PendingCompensation.code})


@dataclass(frozen=True)
class WorkerSessionLimits:
    """Reconciliation budgets of one session, shared by every lookup kind."""

    per_tool: int = 16
    per_session: int = 64

    def __post_init__(self) -> None:
        # The per-tool limit is checked first.
        if _not_positive(self.per_tool):
            raise ZeroPerToolReconciliationLimit()
        if _not_positive(self.per_session):
            raise ZeroSessionReconciliationLimit()


def _not_positive(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


class Adapters(Protocol):
    """What the decisions read of the adapter registry."""

    def get(self, tool: str) -> Any: ...

    def deadline_for(self, tool: str) -> float: ...


class CommitFacts(Protocol):
    """What the decisions read of the session's commit pipeline."""

    @property
    def superseded(self) -> bool: ...

    @property
    def broken(self) -> bool: ...


class SessionDecisions:
    """The decisions of one session under its lock (see the module docstring).

    Owned by ``WorkerSession``, built with the session's state (which it
    changes), what it reads of its commit pipeline, the adapters and the
    limits. Every method is called with the session lock held and returns a
    step at once.
    """

    def __init__(
        self,
        state: SessionState,
        *,
        commits: CommitFacts,
        adapters: Adapters,
        limits: WorkerSessionLimits,
    ) -> None:
        self._state = state
        self._commits = commits
        self._adapters = adapters
        self._limits = limits

    # -- routing ---------------------------------------------------------------------

    def answer(self, frame: bytes, run: Handling) -> Step:
        """What ``frame`` (out of its envelope already) gets."""
        if self._state.status == CLOSED:
            return DeadLetter(CLOSED_REASON)
        duplicate = False
        try:
            message: WorkerMessage = self._state.authenticator.open_frame(frame)
        except DuplicateFrame as dup:
            message = dup.message
            duplicate = True
        except OctoError as exc:
            run.log.info("frame_refused", code=exc.code)
            return DeadLetter(exc.code)
        kind = message_type(message)
        run.log = run.log.bind(type=kind, duplicate=duplicate)
        action = answer(self._state.status, kind, duplicate)
        if action is Answer.REQUEST:
            keyed = KEYED_MESSAGES.get(type(message))
            if keyed is None:
                assert isinstance(message, Invoke)
                return self._invoke(message, run)
            return self._keyed(keyed, _name_keyed(keyed, message, run), run)
        if action is Answer.FROM_JOURNAL:
            return self._from_journal(message, run)
        if action is Answer.CLOSE:
            return self._close(run)
        if action is Answer.REFUSE_POISONED:
            _name_any_request(message, run)
            return self.refuse_poisoned(run, SessionPoisoned())
        if action is Answer.REFUSE_UNSUPPORTED:
            assert isinstance(message, Cancel)
            run.name_request("cancel", message.request.cancellation_id)
            return self._refuse(run, UnsupportedMessage("cancel"))
        if action is Answer.REPLAY:
            return self._session_only_then_dead_letter(run, SessionReplay(self._state.session_id))
        if action is Answer.UNEXPECTED:
            return self._session_only_then_dead_letter(run, UnexpectedMessage(kind))
        run.log.info("frame_dropped")
        return Ack()

    def _from_journal(self, message: WorkerMessage, run: Handling) -> Step:
        """A duplicate keyed request gets the stored state; nothing is spent or run."""
        keyed = KEYED_MESSAGES[type(message)]
        request = _name_keyed(keyed, message, run)
        journal = self._journal_or_none(run)
        if journal is None:
            return self._refuse_load_error(run)
        try:
            existing = keyed.lookup(journal, request, self._state.manifest.grant(request.tool))
            if isinstance(existing.state, Pending):
                raise keyed.pending(request)
            reply = keyed.answer(keyed.result(self._state.session_id, request, existing.state))
        except OctoError as exc:
            return self._refuse(run, exc)
        return self._respond(run, reply)

    # -- invoke ----------------------------------------------------------------------

    def _invoke(self, message: Invoke, run: Handling) -> Step:
        invocation = message.invocation
        run.name_request("invoke", invocation.request_id)
        try:
            auth = self._state.authorizer.authorize(invocation)
        except OctoError as exc:
            return self._refuse(run, exc)
        run.authorizer = self._state.authorizer
        tool = invocation.tool
        adapter, missing = self._declared_adapter(tool, effect=False)
        if missing is not None:
            return self._refuse(run, missing)
        scope, session_id = self._state.scope, self._state.session_id
        grant = auth.grant
        call = AdapterStep(
            call=lambda deadline: adapter.invoke(
                invocation,
                grant,
                AdapterContext.for_invoke(scope, session_id, invocation.request_id, deadline),
            ),
            after=lambda payload, error: self._invoked(run, auth, payload, error),
            tool=tool,
            method="invoke",
            ack_first=True,
            deadline=self._adapters.deadline_for(tool),
            returns=ToolPayload,
            admission=False,
        )
        return Commit(then=lambda _revision: call, failed=lambda e: self._poisoned(run, e))

    def _invoked(
        self, run: Handling, auth: AuthorizedInvocation, payload: Any, error: BaseException | None
    ) -> Step:
        tool = auth.request.tool
        if error is not None:
            return self._refuse(run, AdapterError(tool, _adapter_code(error)))
        if not isinstance(payload, ToolPayload):
            return self._refuse(run, AdapterError(tool, AdapterFailed.code))
        try:
            result = ToolResult(self._state.session_id, auth.request.request_id, payload)
            self._issuer(run).validate_result(auth, result)
        except OctoError as exc:
            return self._refuse(run, exc)
        return self._respond(run, Result(result))

    # -- keyed kinds: one path, its differences read from the kind's row -------------

    def _keyed(self, kind: KeyedKind, request: Any, run: Handling) -> Step:
        if kind.grant_fingerprint is not None:
            run.log = run.log.bind(grant_fingerprint=kind.grant_fingerprint(request))
        try:
            auth = kind.authorize(self._state.authorizer, request)
        except OctoError as exc:
            return self._refuse(run, exc)
        run.authorizer = self._state.authorizer
        if kind.effect:
            return self._admit(kind, request, auth, run)
        return self._look_up(kind, request, auth, run)

    def _admit(self, kind: KeyedKind, request: Any, auth: Any, run: Handling) -> Step:
        """An effect kind: the adapter's contract, the admission, its commit, then the adapter
        (the driver acks the delivery before the call)."""
        if kind.input_fingerprint is not None:
            run.log = run.log.bind(input_fingerprint=kind.input_fingerprint(request, auth))
        adapter, missing = self._declared_adapter(request.tool, effect=True)
        if missing is not None:
            return self._refuse(run, missing)
        journal = self._journal_or_none(run)
        if journal is None:
            return self._refuse_load_error(run)
        try:
            admission = kind.admit(journal, auth)
            if isinstance(admission, Existing):
                if isinstance(admission.state, Pending):
                    raise kind.pending(request)
                result = kind.result(self._state.session_id, request, admission.state)
                kind.validate_result(self._state.authorizer, auth, result)
        except OctoError as exc:
            return self._refuse(run, exc)
        if isinstance(admission, Existing):
            # Answered from the journal: the reply is committed with the state
            # (no journal change) and published; no adapter, no admission.
            run.log.info(kind.existing_event, state=str(admission.state.kind))
            return self._respond(run, kind.answer(result))

        def admitted(revision: int) -> Step:
            journal.rebase(revision)
            run.log.debug(kind.admitted_event, revision=revision)  # its observation logs at info
            return self._adapter_step(kind, adapter, request, auth, journal, run)

        return Commit(
            then=admitted,
            failed=lambda e: self._poisoned(run, e),
            journal=journal.changeset(),
        )

    def _look_up(self, kind: KeyedKind, request: Any, auth: Any, run: Handling) -> Step:
        """A lookup kind: the journal's check of the key, the budgets, then the adapter
        (it has no effect: nothing is committed before it, and the delivery is acked
        only after the answer is published)."""
        tool = request.tool
        journal = self._journal_or_none(run)
        if journal is None:
            return self._refuse_load_error(run)
        try:
            kind.admit(journal, auth)
            settled = kind.lookup(journal, request, auth.grant).state
        except OctoError as exc:
            return self._refuse(run, exc)
        resolution = getattr(request, "resolution", None)
        if resolution is not None:
            return self._resolve(kind, run, request, auth, journal, settled)
        if settled_without_adapter(settled):
            # The adapter never acted under this key (or an operator settled it):
            # it has nothing to look up, and the row is terminal. Answered from
            # the journal; no budget is spent and no adapter is asked.
            return self._settled_answer(kind, run, request, auth, settled)
        # Session total first, then per tool. Both lookup kinds spend these
        # same counters.
        if self._state.reconciliations_total >= self._limits.per_session:
            return self._refuse(run, ReconciliationSessionBudgetExhausted(self._limits.per_session))
        if self._state.reconciliations_by_tool.get(tool, 0) >= self._limits.per_tool:
            return self._refuse(run, ReconciliationBudgetExhausted(tool, self._limits.per_tool))
        self._state.reconciliations_total += 1
        self._state.reconciliations_by_tool[tool] = (
            self._state.reconciliations_by_tool.get(tool, 0) + 1
        )
        adapter = self._adapters.get(tool)
        if adapter is None:
            return self._refuse(run, MissingAdapter(tool))
        return self._adapter_step(kind, adapter, request, auth, journal, run)

    def _adapter_step(
        self,
        kind: KeyedKind,
        adapter: Any,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        run: Handling,
    ) -> AdapterStep:
        scope, session_id, tool, grant = (
            self._state.scope,
            self._state.session_id,
            request.tool,
            auth.grant,
        )
        return AdapterStep(
            call=lambda deadline: kind.call(
                adapter, request, grant, kind.context(scope, session_id, request, deadline)
            ),
            after=lambda status, error: self._observed(
                kind, run, request, auth, journal, adapter, status, error
            ),
            tool=tool,
            method=kind.adapter_method,
            ack_first=kind.effect,
            deadline=self._adapters.deadline_for(tool),
            returns=STATUS_TYPES,
            admission=kind.effect,
            effect=kind.effect,
        )

    def _observed(
        self,
        kind: KeyedKind,
        run: Handling,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        adapter: Any,
        status: Any,
        error: BaseException | None,
    ) -> Step:
        """What the adapter's answer gets: observed, committed with the reply, published.

        Once an effect kind's adapter ran, any failure to record its answer
        is the kind's indeterminate refusal (the key stays pending for a
        status lookup); a lookup kind's failure is refused as it is.
        """
        if is_proven_not_happened(status) and not lookup_miss_fences_key(adapter):
            # "Proven not happened" from an adapter that does not fence the key
            # proves nothing (an effect kind: indeterminate; a lookup: refused,
            # the row stays as it is).
            status, error = None, kind.unfenced_miss("unfenced lookup miss")
        if error is not None:
            # Refused before any effect (its input or options): the adapter did
            # not act, so the key ends failed, definite, with the refusal's code.
            refused = refusal_status(error) if kind.effect else None
            if refused is None:
                if kind.indeterminate is not None and isinstance(error, AdapterIndeterminate):
                    return self._refuse(run, _indeterminate(kind, run, "adapter"))
                return self._refuse(run, AdapterError(request.tool, _adapter_code(error)))
            status = refused
        if not isinstance(status, STATUS_TYPES):
            failure: OctoError = AdapterError(request.tool, AdapterFailed.code)
            return self._refuse(run, _after_adapter_failure(kind, run, failure))
        try:
            kind.observe(journal, auth, status)
            result = kind.result(self._state.session_id, request, status)
            kind.validate_result(self._issuer(run), auth, result)
            frame = self._state.authenticator.seal(kind.answer(result))
        except OctoError as exc:
            # The observation is dropped: the refusal commits no journal change.
            return self._refuse(run, _after_adapter_failure(kind, run, exc))
        run.log.info(kind.observed_event, state=str(status.kind))
        return self._commit_reply(
            run, frame, journal.changeset(), unresolved=status.kind not in TERMINAL_KINDS
        )

    def _resolve(
        self,
        kind: KeyedKind,
        run: Handling,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        current: Any,
    ) -> Step:
        """An operator's decision: recorded for a ``pending`` or ``running`` key,
        without the adapter; a terminal key is answered as it is (never overwritten)."""
        if current.kind in TERMINAL_KINDS:
            return self._settled_answer(kind, run, request, auth, current)
        resolution = request.resolution
        status = resolution.status(auth.grant.format)
        try:
            kind.observe(journal, auth, status)
            result = kind.result(self._state.session_id, request, status)
            kind.validate_result(self._issuer(run), auth, result)
        except OctoError as exc:
            return self._refuse(run, exc)
        run.log.info(
            "resolved_by_operator",
            operator=resolution.operator,
            run_name=resolution.run,
            state_from=str(current.kind),
            state=str(status.kind),
        )
        return self._respond(run, kind.answer(result), journal.changeset())

    def _settled_answer(
        self, kind: KeyedKind, run: Handling, request: Any, auth: Any, state: Any
    ) -> Step:
        try:
            result = kind.result(self._state.session_id, request, state)
            kind.validate_result(self._issuer(run), auth, result)
        except OctoError as exc:
            return self._refuse(run, exc)
        run.log.info(kind.observed_event, state=str(state.kind), settled=True)
        return self._respond(run, kind.answer(result))

    # -- session-only answers --------------------------------------------------------

    def _close(self, run: Handling) -> Step:
        previous = self._state.status
        self._state.status = CLOSED

        def closed(_revision: int) -> Step:
            run.log.info("session_closed", previous=previous)
            return Ack()

        return Commit(then=closed, failed=lambda e: self._poisoned(run, e))

    def _session_only_then_dead_letter(self, run: Handling, error: OctoError) -> Step:
        # The window bit is durable before the frame is dead-lettered.
        def committed(_revision: int) -> Step:
            run.log.info("frame_dead_lettered", code=error.code)
            return DeadLetter(error.code)

        return Commit(then=committed, failed=lambda e: self._poisoned(run, e))

    # -- refuse / respond ------------------------------------------------------------

    def _refuse(self, run: Handling, error: OctoError) -> Step:
        """refuse(error): seal a ``request_rejected``, commit it with the state, publish."""
        run.log.info("request_refused", code=error.code)
        try:
            frame = self._state.authenticator.seal(self._rejection(run, error))
        except OctoError as exc:
            # Nothing can be sent; the frame is still made durable before the ack.
            run.log.warning("refusal_seal_failed", code=exc.code)
            return Commit(then=lambda _revision: Ack(), failed=lambda e: self._poisoned(run, e))
        return self._commit_reply(
            run, frame, None, refused=True, unresolved=_refusal_unresolved(error.code)
        )

    def _refuse_load_error(self, run: Handling) -> Step:
        # A load error is refused with its code; nothing poisons.
        assert run.load_error is not None
        return self._refuse(run, run.load_error)

    def _respond(
        self, run: Handling, message: WorkerMessage, changes: JournalChangeset | None = None
    ) -> Step:
        """respond(message, changes): seal, commit changes + state + outbox, publish."""
        try:
            frame = self._state.authenticator.seal(message)
        except OctoError as exc:
            return self._refuse(run, exc)
        return self._commit_reply(run, frame, changes, unresolved=reply_unresolved(message))

    def _commit_reply(
        self,
        run: Handling,
        frame: bytes,
        changes: JournalChangeset | None,
        *,
        refused: bool = False,
        unresolved: bool | None = None,
    ) -> Step:
        entry = OutboxEntry(
            message_id=message_id(frame),
            session_id=self._state.session_id,
            reply_to=self._state.reply_to,
            correlation_id=run.request_id,
            frame=frame,
            revision=0,
        )

        def failed(failure: OctoError) -> Step:
            if refused and run.refused_poisoned and not self._commits.superseded:
                # The poisoned session's refusal could not be committed either
                # (a write conflict, a revision that did not advance, the
                # journal lost): published best-effort, without committing. Its
                # sequence is reserved by the first commit under the reload's
                # fresh fence (``WorkerSession.persist_poisoned``).
                run.log.warning("refusal_published_uncommitted", error=failure.code)
                return Reply(frame, run.request_id, None, refused, unresolved)
            return self._poisoned(run, failure)

        return Commit(
            then=lambda _revision: Reply(
                frame, run.request_id, entry.message_id, refused, unresolved
            ),
            failed=failed,
            journal=changes if changes else None,
            outbox=entry,
        )

    def _rejection(self, run: Handling, error: OctoError) -> RequestRejected:
        assert run.request_id is not None
        return RequestRejected(
            self._state.session_id,
            run.request_id,
            error.code,
            run.operation_key,
            run.compensation_key,
        )

    # -- poisoned sessions -----------------------------------------------------------

    def _poisoned(self, run: Handling, failure: OctoError) -> Step:
        """After a failed commit: refuse with the failure's code, once that refusal is durable.

        Nothing is published if the refusal's own commit failed (the refusal
        being committed here is this handling's), nor once superseded (a fence
        rejection: fail closed; :meth:`refuse_poisoned` checks it, for this
        path and the adapter's): the new owner restores the session from the
        store and seals from the stored outbound sequence. The delivery goes
        back to the broker unacked (it is answered after the reload, or by the
        new owner), or, acked already, gets no answer: the host times out and
        reconciles.
        """
        if run.request_id is None or run.refused_poisoned:
            return Requeue()
        return self.refuse_poisoned(run, _poison_refusal(run, failure))

    def refuse_poisoned(self, run: Handling, error: OctoError) -> Step:
        """refuse(error) in a poisoned session: committed like any refusal, then published.

        The commit is what makes the refusal's sequence durable before it is
        published, so a session restored after a crash at any point never
        seals that number again. While commits built on a failed one are still
        in flight (they fail with it) the driver drains them, holding the lock
        so that nothing more is built on the failure; then the state is
        committed as it stands, status ``poisoned``, with the refusal in the
        outbox.
        """
        if self._commits.superseded:
            # Another worker's fence: fail closed, publish nothing (see
            # _poisoned); every poisoned answer passes here.
            return Requeue()
        run.refused_poisoned = True
        if self._commits.broken:
            return Drain(then=lambda: self._refuse(run, error))
        return self._refuse(run, error)

    def _issuer(self, run: Handling) -> SessionAuthorizer:
        """The authorizer that issued the handling's token, which alone validates its result.

        It is the session's own, unless a failed commit rebuilt the session's
        at the last durable point while the adapter ran and a
        ``close_session`` landed since: a closed session's running handlers
        finish and send their replies, so the result the adapter returned is
        still checked, recorded and answered, never refused for its token's
        provenance. (A session still poisoned never gets here.)
        """
        return run.authorizer if run.authorizer is not None else self._state.authorizer

    def _declared_adapter(self, tool: str, *, effect: bool) -> tuple[Any, OctoError | None]:
        """The tool's adapter, or the refusal: none registered, or one that does not
        declare its durable contract (an effect) or its invocation safety (invoke)."""
        adapter = self._adapters.get(tool)
        if adapter is None:
            return None, MissingAdapter(tool)
        if effect:
            if declaration(adapter.durable_operation_contract, DurableOperationContract) is None:
                return None, DurableOperationContractNotDeclared(tool)
        elif declaration(adapter.invocation_safety, InvocationSafety) is None:
            return None, InvocationSafetyNotDeclared(tool)
        return adapter, None

    def _journal_or_none(self, run: Handling) -> WorkerOperationJournal | None:
        if run.load_error is not None or run.records is None:
            if run.load_error is None:
                run.load_error = StorageBackendError("records were not loaded")
            return None
        try:
            return WorkerOperationJournal(self._state.scope, run.records)
        except OctoError as exc:
            run.load_error = exc
            return None


# Helpers --------------------------------------------------------------------


def _name_keyed(keyed: KeyedKind, message: WorkerMessage, run: Handling) -> Any:
    request = keyed.request_of(message)
    request_id, operation_key, compensation_key = keyed.names(request)
    run.name_request(keyed.message_type, request_id, operation_key, compensation_key)
    run.keyed = keyed
    return request


def _name_any_request(message: WorkerMessage, run: Handling) -> None:
    keyed = KEYED_MESSAGES.get(type(message))
    if keyed is not None:
        _name_keyed(keyed, message, run)
    elif isinstance(message, Invoke):
        run.name_request("invoke", message.invocation.request_id)
    elif isinstance(message, Cancel):
        run.name_request("cancel", message.request.cancellation_id)


def _indeterminate(kind: KeyedKind, run: Handling, cause: str) -> OctoError:
    assert kind.indeterminate is not None and run.operation_key is not None
    return kind.indeterminate(run.operation_key, run.compensation_key, cause)


def _after_adapter_failure(kind: KeyedKind, run: Handling, failure: OctoError) -> OctoError:
    """An answer the adapter gave that cannot be recorded: an effect kind's is
    indeterminate (the adapter may have acted), a lookup kind's is ``failure``."""
    if kind.indeterminate is None:
        return failure
    return _indeterminate(kind, run, "protocol")


def _poison_refusal(run: Handling, failure: OctoError) -> OctoError:
    """Indeterminate only once an effect kind's adapter ran."""
    revision = isinstance(failure, InvalidJournalRevision)
    keyed = run.keyed
    if (
        run.adapter_ran
        and keyed is not None
        and keyed.indeterminate is not None
        and run.operation_key is not None
    ):
        cause = "invalid_journal_revision" if revision else "journal"
        return keyed.indeterminate(run.operation_key, run.compensation_key, cause)
    if revision:
        return failure
    return JournalPersistenceFailed(failure.code)


def settled_without_adapter(state: Any) -> bool:
    """A row a status lookup answers from the journal: ``failed`` because the
    adapter did not act (``DID_NOT_ACT_CODES``) or because an operator decided."""
    return did_not_act(state) or (
        isinstance(state, Failed) and state.code == FailureCode.RESOLVED_BY_OPERATOR
    )


def _adapter_code(error: BaseException) -> str:
    if isinstance(error, OctoError):
        return error.code
    return AdapterFailed.code


def reply_unresolved(message: WorkerMessage) -> bool | None:
    """What a reply says of its request's operation key, for the hooks.

    True: still unresolved (a status ``running``, or a refusal saying the
    journal holds the key pending, which is how a key a crash left pending
    shows up after a restart); False: resolved (a terminal status); None:
    nothing (any other refusal, any other message).
    """
    if isinstance(message, RequestRejected):
        return _refusal_unresolved(message.code)
    if isinstance(
        message,
        OperationResult | ReconciledOperation | CompensationResult | ReconciledCompensation,
    ):
        return message.result.status.kind not in TERMINAL_KINDS
    return None


def _refusal_unresolved(code: str) -> bool | None:
    return True if code in _PENDING_CODES else None
