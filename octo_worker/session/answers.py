"""What a worker session answers to each frame it authenticated (W§10.5–10.9, D5, D6, D9).

:class:`SessionAnswers` is the part of ``WorkerSession`` that decides, under
the session lock, what one frame gets: the status rules of
:mod:`octo_worker.session.rules` pick the answer; ``invoke`` has its own
handler; every keyed request goes through one of two paths driven by its
row of :mod:`octo_worker.session.request_kinds` (an effect, or a status lookup); a
duplicate is answered from the journal. Each handler ends in a step for
the driver (a reply, an ack, a dead-letter, a requeue, or an adapter call
followed by more decisions), after the commits W§10.6 prescribes:

* refuse(error) (D6): seal a ``request_rejected`` naming the request, commit
  it with the session state, reply;
* respond(message, changes): seal, commit the journal changes, the state and
  the outbox row, reply;
* a failed commit: the session is already poisoned in memory; once no
  commit of it is in flight, the refusal with the failure's code (W§10.9
  step 2) is committed like any refusal, with the session state recording
  both its sequence and the status ``poisoned``, and only then published; a
  poisoned session's later refusals (``session_poisoned``) are committed
  the same way. When that commit fails too, the refusal is published
  best-effort without committing (W§10.9 step 2): the reload that follows
  persists the session's outbound counter past its sequence before
  anything else is sealed (W§10.11 rule 2, ``persist_poisoned``). Only a
  session superseded by another worker's fence publishes nothing.

It must never run an adapter itself (the driver does, outside the lock),
never publish anything not committed first (a poisoned session's refusal
whose own commit failed aside), and never put keys, payloads,
failure messages or adapter text in a refusal or a log line.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

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
from octo_worker.adapters.contract import (
    AdapterContext,
    DurableOperationContract,
    InvocationSafety,
    WorkerAdapterRegistry,
    lookup_miss_fences_key,
    refusal_status,
)
from octo_worker.journal import Existing, JournalChangeset, WorkerOperationJournal
from octo_worker.session.commits import CommitFailed, SessionCommits
from octo_worker.session.handling import (
    Ack,
    AdapterStep,
    DeadLetter,
    FinalStep,
    Handling,
    Reply,
    Requeue,
    Step,
)
from octo_worker.session.request_kinds import KEYED_MESSAGES, KeyedKind
from octo_worker.session.rules import CLOSED, CLOSED_REASON, Answer, answer
from octo_worker.session.state import SessionState
from octo_worker.storage.interface import OutboxEntry

__all__ = ["SessionAnswers", "WorkerSessionLimits", "reply_unresolved"]

STATUS_TYPES: Final = (Running, Succeeded, Failed, Cancelled)
# Refusals that say the journal holds the key pending (D5, W§10.6).
_PENDING_CODES: Final = frozenset({PendingOperation.code, PendingCompensation.code})


@dataclass(frozen=True)
class WorkerSessionLimits:
    """Reconciliation budgets of one session (W§10.1), shared by every lookup kind."""

    per_tool: int = 16
    per_session: int = 64

    def __post_init__(self) -> None:
        # The per-tool limit is checked first (W§10.1).
        if _not_positive(self.per_tool):
            raise ZeroPerToolReconciliationLimit()
        if _not_positive(self.per_session):
            raise ZeroSessionReconciliationLimit()


def _not_positive(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


class SessionAnswers:
    """The decisions of one session under its lock (see the module docstring).

    Owned by ``WorkerSession``, built with the session's state (which it
    changes), its commit pipeline, the adapters and the limits. Every method
    here is called with the session lock held and returns with it held (a
    commit releases it while in flight).
    """

    def __init__(
        self,
        state: SessionState,
        *,
        commits: SessionCommits,
        adapters: WorkerAdapterRegistry,
        limits: WorkerSessionLimits,
    ) -> None:
        self._state = state
        self._commits = commits
        self._adapters = adapters
        self._limits = limits

    # -- routing (W§10.5) -------------------------------------------------------------

    async def answer_locked(self, frame: bytes, run: Handling) -> Step:
        if self._state.status == CLOSED:
            return DeadLetter(CLOSED_REASON)
        duplicate = False
        try:
            # ``frame`` is out of its envelope already (WorkerSession.handle).
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
                return await self._invoke_locked(message, run)
            request = self._name_keyed(keyed, message, run)
            if keyed.effect:
                return await self._effect_locked(keyed, request, run)
            return await self._lookup_locked(keyed, request, run)
        if action is Answer.FROM_JOURNAL:
            return await self._from_journal_locked(message, run)
        if action is Answer.CLOSE:
            return await self._close_locked(run)
        if action is Answer.REFUSE_POISONED:
            self._name_any_request(message, run)
            return await self.refuse_poisoned_locked(run, SessionPoisoned())
        if action is Answer.REFUSE_UNSUPPORTED:
            assert isinstance(message, Cancel)
            run.name_request("cancel", message.request.cancellation_id)
            return await self._refuse_locked(run, UnsupportedMessage("cancel"))
        if action is Answer.REPLAY:
            return await self._session_only_then_dead_letter(
                run, SessionReplay(self._state.session_id)
            )
        if action is Answer.UNEXPECTED:
            return await self._session_only_then_dead_letter(run, UnexpectedMessage(kind))
        run.log.info("frame_dropped")
        return Ack()

    @staticmethod
    def _name_keyed(keyed: KeyedKind, message: WorkerMessage, run: Handling) -> Any:
        request = keyed.request_of(message)
        request_id, operation_key, compensation_key = keyed.names(request)
        run.name_request(keyed.message_type, request_id, operation_key, compensation_key)
        run.keyed = keyed
        return request

    def _name_any_request(self, message: WorkerMessage, run: Handling) -> None:
        keyed = KEYED_MESSAGES.get(type(message))
        if keyed is not None:
            self._name_keyed(keyed, message, run)
        elif isinstance(message, Invoke):
            run.name_request("invoke", message.invocation.request_id)
        elif isinstance(message, Cancel):
            run.name_request("cancel", message.request.cancellation_id)

    async def _from_journal_locked(self, message: WorkerMessage, run: Handling) -> Step:
        """D5: a duplicate keyed request gets the stored state; nothing is spent or run."""
        keyed = KEYED_MESSAGES[type(message)]
        request = self._name_keyed(keyed, message, run)
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            existing = keyed.lookup(journal, request, self._state.manifest.grant(request.tool))
            if isinstance(existing.state, Pending):
                raise keyed.pending(request)
            reply = keyed.answer(keyed.result(self._state.session_id, request, existing.state))
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        return await self._respond_locked(run, reply)

    # -- invoke (W§10.6) ----------------------------------------------------------------

    async def _invoke_locked(self, message: Invoke, run: Handling) -> Step:
        invocation = message.invocation
        run.name_request("invoke", invocation.request_id)
        try:
            auth = self._state.authorizer.authorize(invocation)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.authorizer = self._state.authorizer
        tool = invocation.tool
        adapter = self._adapters.get(tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(tool))
        if _declaration(adapter.invocation_safety, InvocationSafety) is None:
            return await self._refuse_locked(run, InvocationSafetyNotDeclared(tool))
        try:
            await self._commits.commit_locked(run.store)
        except CommitFailed as failed:
            return await self._poisoned_answer_locked(run, failed.error)
        grant = auth.grant

        async def after(result: Any, error: BaseException | None) -> FinalStep:
            return await self._after_invoke_locked(run, auth, result, error)

        return AdapterStep(
            call=lambda deadline: adapter.invoke(
                invocation,
                grant,
                AdapterContext.for_invoke(
                    self._state.scope, self._state.session_id, invocation.request_id, deadline
                ),
            ),
            after=after,
            tool=tool,
            method="invoke",
            ack_first=True,
            deadline=self._adapters.deadline_for(tool),
            returns=ToolPayload,
            admission=False,
        )

    async def _after_invoke_locked(
        self, run: Handling, auth: AuthorizedInvocation, payload: Any, error: BaseException | None
    ) -> FinalStep:
        tool = auth.request.tool
        if error is not None:
            return await self._refuse_locked(run, AdapterError(tool, _adapter_code(error)))
        if not isinstance(payload, ToolPayload):
            return await self._refuse_locked(run, AdapterError(tool, AdapterFailed.code))
        try:
            result = ToolResult(self._state.session_id, auth.request.request_id, payload)
            self._issuer(run).validate_result(auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        return await self._respond_locked(run, Result(result))

    # -- effect kinds: dispatch_operation, compensate_operation (W§10.6) ---------------

    async def _effect_locked(self, kind: KeyedKind, request: Any, run: Handling) -> Step:
        if kind.grant_fingerprint is not None:
            run.log = run.log.bind(grant_fingerprint=kind.grant_fingerprint(request))
        try:
            auth = kind.authorize(self._state.authorizer, request)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.authorizer = self._state.authorizer
        if kind.input_fingerprint is not None:
            run.log = run.log.bind(input_fingerprint=kind.input_fingerprint(request, auth))
        tool = request.tool
        adapter = self._adapters.get(tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(tool))
        if _declaration(adapter.durable_operation_contract, DurableOperationContract) is None:
            return await self._refuse_locked(run, DurableOperationContractNotDeclared(tool))
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            admission = kind.admit(journal, auth)
            if isinstance(admission, Existing):
                if isinstance(admission.state, Pending):
                    raise kind.pending(request)
                result = kind.result(self._state.session_id, request, admission.state)
                kind.validate_result(self._state.authorizer, auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        if isinstance(admission, Existing):
            run.log.info(kind.existing_event, state=str(admission.state.kind))
            return await self._respond_locked(run, kind.answer(result))
        try:
            revision = await self._commits.commit_locked(run.store, journal=journal.changeset())
        except CommitFailed as failed:
            return await self._poisoned_answer_locked(run, failed.error)
        journal.rebase(revision)
        run.log.debug(kind.admitted_event, revision=revision)  # its observation logs at info

        async def after(status: Any, error: BaseException | None) -> FinalStep:
            if _unfenced_miss(adapter, status):
                status, error = None, AdapterIndeterminate("unfenced lookup miss")
            return await self._after_effect_locked(kind, run, request, auth, journal, status, error)

        return self._adapter_step(kind, adapter, request, auth.grant, after)

    async def _after_effect_locked(
        self,
        kind: KeyedKind,
        run: Handling,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        status: Any,
        error: BaseException | None,
    ) -> FinalStep:
        assert kind.indeterminate is not None and run.operation_key is not None
        keys = (run.operation_key, run.compensation_key)
        if error is not None:
            # Refused before any effect (its input or options): the adapter did
            # not act, so the key ends failed, definite, with the refusal's code.
            refused = refusal_status(error)
            if refused is None:
                if isinstance(error, AdapterIndeterminate):
                    return await self._refuse_locked(run, kind.indeterminate(*keys, "adapter"))
                return await self._refuse_locked(
                    run, AdapterError(request.tool, _adapter_code(error))
                )
            status = refused
        # Built only when refused: this is the hot path of every dispatch.
        if not isinstance(status, STATUS_TYPES):
            return await self._refuse_locked(run, kind.indeterminate(*keys, "protocol"))
        try:
            kind.observe(journal, auth, status)
        except OctoError:
            return await self._refuse_locked(run, kind.indeterminate(*keys, "protocol"))
        try:
            result = kind.result(self._state.session_id, request, status)
            kind.validate_result(self._issuer(run), auth, result)
            frame = self._state.authenticator.seal(kind.answer(result))
        except OctoError:
            # The observation is dropped: the refusal commits no journal change.
            return await self._refuse_locked(run, kind.indeterminate(*keys, "protocol"))
        run.log.info(kind.observed_event, state=str(status.kind))
        return await self._commit_reply_locked(
            run, frame, journal.changeset(), unresolved=status.kind not in TERMINAL_KINDS
        )

    # -- lookup kinds: reconcile_operation (W§10.6), reconcile_compensation (D11) ------

    async def _lookup_locked(self, kind: KeyedKind, request: Any, run: Handling) -> Step:
        tool = request.tool
        if kind.grant_fingerprint is not None:
            run.log = run.log.bind(grant_fingerprint=kind.grant_fingerprint(request))
        try:
            auth = kind.authorize(self._state.authorizer, request)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.authorizer = self._state.authorizer
        journal = self._journal_or_none(run)
        if journal is None:
            return await self._refuse_load_error(run)
        try:
            kind.admit(journal, auth)
            settled = kind.lookup(journal, request, auth.grant).state
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        resolution = getattr(request, "resolution", None)
        if resolution is not None:
            return await self._resolve_locked(kind, run, request, auth, journal, settled)
        if settled_without_adapter(settled):
            # The adapter never acted under this key (or an operator settled it):
            # it has nothing to look up, and the row is terminal. Answered from
            # the journal; no budget is spent and no adapter is asked.
            return await self._settled_answer_locked(kind, run, request, auth, settled)
        # Session total first, then per tool (W§10.6 reconcile step 3). Both
        # lookup kinds spend these same counters (D11).
        if self._state.reconciliations_total >= self._limits.per_session:
            return await self._refuse_locked(
                run, ReconciliationSessionBudgetExhausted(self._limits.per_session)
            )
        if self._state.reconciliations_by_tool.get(tool, 0) >= self._limits.per_tool:
            return await self._refuse_locked(
                run, ReconciliationBudgetExhausted(tool, self._limits.per_tool)
            )
        self._state.reconciliations_total += 1
        self._state.reconciliations_by_tool[tool] = (
            self._state.reconciliations_by_tool.get(tool, 0) + 1
        )
        adapter = self._adapters.get(tool)
        if adapter is None:
            return await self._refuse_locked(run, MissingAdapter(tool))

        async def after(status: Any, error: BaseException | None) -> FinalStep:
            if _unfenced_miss(adapter, status):
                # "Proven not happened" from an adapter that does not fence the
                # key proves nothing: refused, the row stays as it is.
                status, error = None, AdapterFailed("unfenced lookup miss")
            return await self._after_lookup_locked(kind, run, request, auth, journal, status, error)

        # A status lookup has no effect: it may run before anything is committed
        # (S1), and the delivery is acked only after the answer is published.
        return self._adapter_step(kind, adapter, request, auth.grant, after)

    async def _after_lookup_locked(
        self,
        kind: KeyedKind,
        run: Handling,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        status: Any,
        error: BaseException | None,
    ) -> FinalStep:
        if error is not None:
            return await self._refuse_locked(run, AdapterError(request.tool, _adapter_code(error)))
        if not isinstance(status, STATUS_TYPES):
            return await self._refuse_locked(run, AdapterError(request.tool, AdapterFailed.code))
        try:
            kind.observe(journal, auth, status)
            result = kind.result(self._state.session_id, request, status)
            kind.validate_result(self._issuer(run), auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log.info(kind.observed_event, state=str(status.kind))
        return await self._respond_locked(run, kind.answer(result), journal.changeset())

    async def _resolve_locked(
        self,
        kind: KeyedKind,
        run: Handling,
        request: Any,
        auth: Any,
        journal: WorkerOperationJournal,
        current: Any,
    ) -> FinalStep:
        """An operator's decision: recorded for a ``pending`` or ``running`` key,
        without the adapter; a terminal key is answered as it is (never overwritten)."""
        if current.kind in TERMINAL_KINDS:
            return await self._settled_answer_locked(kind, run, request, auth, current)
        resolution = request.resolution
        status = resolution.status(auth.grant.format)
        try:
            kind.observe(journal, auth, status)
            result = kind.result(self._state.session_id, request, status)
            kind.validate_result(self._issuer(run), auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log.info(
            "resolved_by_operator",
            operator=resolution.operator,
            run_name=resolution.run,
            state_from=str(current.kind),
            state=str(status.kind),
        )
        return await self._respond_locked(run, kind.answer(result), journal.changeset())

    async def _settled_answer_locked(
        self, kind: KeyedKind, run: Handling, request: Any, auth: Any, state: Any
    ) -> FinalStep:
        try:
            result = kind.result(self._state.session_id, request, state)
            kind.validate_result(self._issuer(run), auth, result)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        run.log.info(kind.observed_event, state=str(state.kind), settled=True)
        return await self._respond_locked(run, kind.answer(result))

    def _adapter_step(
        self,
        kind: KeyedKind,
        adapter: Any,
        request: Any,
        grant: Any,
        after: Callable[[Any, BaseException | None], Any],
    ) -> AdapterStep:
        scope, session_id, tool = self._state.scope, self._state.session_id, request.tool
        return AdapterStep(
            call=lambda deadline: kind.call(
                adapter, request, grant, kind.context(scope, session_id, request, deadline)
            ),
            after=after,
            tool=tool,
            method=kind.adapter_method,
            ack_first=kind.effect,
            deadline=self._adapters.deadline_for(tool),
            returns=STATUS_TYPES,
            admission=kind.effect,
            effect=kind.effect,
        )

    # -- session-only answers ------------------------------------------------------

    async def _close_locked(self, run: Handling) -> Step:
        previous = self._state.status
        self._state.status = CLOSED
        try:
            await self._commits.commit_locked(run.store)
        except CommitFailed as failed:
            return await self._poisoned_answer_locked(run, failed.error)
        run.log.info("session_closed", previous=previous)
        return Ack()

    async def _session_only_then_dead_letter(self, run: Handling, error: OctoError) -> Step:
        # S1: the window bit is durable before the frame is dead-lettered.
        try:
            await self._commits.commit_locked(run.store)
        except CommitFailed as failed:
            return await self._poisoned_answer_locked(run, failed.error)
        run.log.info("frame_dead_lettered", code=error.code)
        return DeadLetter(error.code)

    # -- refuse / respond (W§10.5, W§10.8) ----------------------------------------

    async def _refuse_locked(self, run: Handling, error: OctoError) -> FinalStep:
        """refuse(error): seal a ``request_rejected``, commit it with the state, publish."""
        run.log.info("request_refused", code=error.code)
        try:
            frame = self._state.authenticator.seal(self._rejection(run, error))
        except OctoError as exc:
            # Nothing can be sent; the frame is still made durable before the ack (S1).
            run.log.warning("refusal_seal_failed", code=exc.code)
            try:
                await self._commits.commit_locked(run.store)
            except CommitFailed as failed:
                return await self._poisoned_answer_locked(run, failed.error)
            return Ack()
        return await self._commit_reply_locked(
            run, frame, None, refused=True, unresolved=_refusal_unresolved(error.code)
        )

    async def _refuse_load_error(self, run: Handling) -> FinalStep:
        # W§10.11 rule 7: a load error is refused with its code; nothing poisons.
        assert run.load_error is not None
        return await self._refuse_locked(run, run.load_error)

    async def _respond_locked(
        self, run: Handling, message: WorkerMessage, changes: JournalChangeset | None = None
    ) -> FinalStep:
        """respond(message, changes): seal, commit changes + state + outbox, publish."""
        try:
            frame = self._state.authenticator.seal(message)
        except OctoError as exc:
            return await self._refuse_locked(run, exc)
        return await self._commit_reply_locked(
            run, frame, changes, unresolved=reply_unresolved(message)
        )

    async def _commit_reply_locked(
        self,
        run: Handling,
        frame: bytes,
        changes: JournalChangeset | None,
        *,
        refused: bool = False,
        unresolved: bool | None = None,
    ) -> FinalStep:
        entry = OutboxEntry(
            message_id=message_id(frame),
            session_id=self._state.session_id,
            reply_to=self._state.reply_to,
            correlation_id=run.request_id,
            frame=frame,
            revision=0,
        )
        try:
            await self._commits.commit_locked(run.store, journal=changes, outbox=entry)
        except CommitFailed as failed:
            if refused and run.refused_poisoned and not self._commits.superseded:
                # The poisoned session's refusal could not be committed either
                # (a write conflict, a revision that did not advance, the
                # journal lost): published best-effort, without committing. Its
                # sequence is reserved by the first commit under the reload's
                # fresh fence (``WorkerSession.persist_poisoned``).
                run.log.warning("refusal_published_uncommitted", error=failed.error.code)
                return Reply(frame, run.request_id, None, refused, unresolved)
            return await self._poisoned_answer_locked(run, failed.error)
        return Reply(frame, run.request_id, entry.message_id, refused, unresolved)

    def _rejection(self, run: Handling, error: OctoError) -> RequestRejected:
        assert run.request_id is not None
        return RequestRejected(
            self._state.session_id,
            run.request_id,
            error.code,
            run.operation_key,
            run.compensation_key,
        )

    # -- poisoned sessions (W§10.9, W§10.11 rules 2-4) --------------------------------

    async def _poisoned_answer_locked(self, run: Handling, failure: OctoError) -> FinalStep:
        """W§10.9 step 2: refuse with the failure's code, once that refusal is durable.

        Nothing is published if the refusal's own commit failed (the refusal
        being committed here is this handling's), nor once superseded (a fence
        rejection, W§11.3: fail closed; :meth:`_refuse_poisoned_locked` checks
        it, for this path and the adapter's): the new owner restores the
        session from the store and seals from the stored outbound sequence. The
        delivery goes back to the broker unacked (it is answered after the
        reload, or by the new owner), or, acked already, gets no answer: the
        host times out and reconciles.
        """
        if run.request_id is None or run.refused_poisoned:
            return Requeue()
        return await self.refuse_poisoned_locked(run, _poison_refusal(run, failure))

    async def refuse_poisoned_locked(self, run: Handling, error: OctoError) -> FinalStep:
        """refuse(error) in a poisoned session: committed like any refusal, then published.

        Issue 15 over W§10.11 rule 3 ("without committing"): the commit is what
        makes the refusal's sequence durable before it is published (rule 2),
        so a session restored after a crash at any point never seals that
        number again. While commits built on a failed one are still in flight
        (they fail with it) it waits, holding the lock so that nothing more is
        built on the failure; then it commits the state as it stands, status
        ``poisoned``, with the refusal in the outbox.
        """
        if self._commits.superseded:
            # Another worker's fence: fail closed, publish nothing (see
            # _poisoned_answer_locked); every poisoned answer passes here.
            return Requeue()
        run.refused_poisoned = True
        if self._commits.broken and await self._commits.drain_locked():
            raise asyncio.CancelledError()
        return await self._refuse_locked(run, error)

    def _issuer(self, run: Handling) -> SessionAuthorizer:
        """The authorizer that issued the handling's token, which alone validates its result.

        It is the session's own, unless a failed commit rebuilt the session's
        at the last durable point while the adapter ran (W§10.9 step 1) and a
        ``close_session`` landed since: a closed session's running handlers
        finish and send their replies (W§10.6), so the result the adapter
        returned is still checked, recorded and answered, never refused for
        its token's provenance. (A session still poisoned never gets here.)
        """
        return run.authorizer if run.authorizer is not None else self._state.authorizer

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


def _poison_refusal(run: Handling, failure: OctoError) -> OctoError:
    """W§10.11 rule 4: indeterminate only once an effect kind's adapter ran."""
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


def _declaration(method: Callable[[], object], kind: type[enum.Enum]) -> object | None:
    """The adapter's declaration, or None: one that cannot be read, or that is not
    a member of ``kind`` (``False``, ``""``, another enum), is no declaration."""
    try:
        value = method()
    except Exception:
        return None
    return value if isinstance(value, kind) else None


def _unfenced_miss(adapter: object, status: object) -> bool:
    """A ``not_happened`` failure from an adapter that does not declare that its
    lookup miss fences the key (see ``BaseWorkerAdapter.lookup_miss_fences_key``)."""
    return is_proven_not_happened(status) and not lookup_miss_fences_key(adapter)


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
