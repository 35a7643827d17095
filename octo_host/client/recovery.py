"""The host client's recovery after a restart: reconcile every unfinished key.

This module owns :class:`RecoverySummary` and :class:`Recovery`: load and
validate a run's ledger, open a fresh session, and settle each operation
and compensation that is not terminal, key by key, reporting what it could
not settle and why: an operation is reconciled (and dispatched again under
its key only when the worker proves it never admitted it); a compensation
is looked up first (``reconcile_compensation``, no input needed), then, with
its inverse input, sent again under its key and a fresh approval when the
worker proves it never admitted it or the lookup left it unfinished.

A step with a retry policy is followed as ``execute`` follows it: after an
attempt ends in an outcome the policy retries, the attempt that replaces it
(one recorded before a crash, or one recorded now under its derived key) is
sent, and so on (``summary.retried``); the input given for any attempt of
the logical operation serves them all.

It must never create a new key other than a policy's retry of a ``failed``
attempt, dispatch or compensate a key the worker may have admitted unless
the worker answers from its journal, stop at one key's failure, or hand
over a session when recovery itself fails (the session is closed first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from octo_common.errors import (
    OctoError,
    UnknownCompensation,
    UnknownOperation,
    WorkerRequestRejected,
)
from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import TERMINAL_KINDS, StateKind, WorkerOperationState
from octo_host.client.retrying import Retries
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.verbs import HostVerbs, new_request_id
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowCompensation
from octo_host.plan import WorkflowPlan
from octo_host.reactions import Reaction, rejection_reaction
from octo_host.retries import retry_refusal

__all__ = ["Recovery", "RecoverySummary"]


def _input_of(
    run: HostRun, inputs: Mapping[str, ToolPayload], operation_key: str
) -> ToolPayload | None:
    """The input of ``operation_key``: given under its key, or under its first
    attempt's (every attempt of a logical operation has the same input)."""
    payload = inputs.get(operation_key)
    if payload is None:
        attempts = run.ledger.attempts(operation_key)
        if attempts:
            payload = inputs.get(attempts[0].operation_key)
    return payload


@dataclass
class RecoverySummary:
    """What :meth:`HostClient.recover` found and did, key by key.

    ``errors`` holds, for each key whose recovery failed (it is also in
    ``unresolved``), the error's code; for a worker refusal, the worker's
    rejection code (``unknown_operation``, ...).
    """

    run: HostRun
    session: HostSession
    operations: dict[str, StateKind] = field(default_factory=dict)
    compensations: dict[str, StateKind] = field(default_factory=dict)
    reconciled: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    """Attempts a step's retry policy had recovery send (recorded now or before a crash)."""
    unresolved: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


class Recovery:
    """Recovers the runs of one host client (``HostClient.recover``)."""

    def __init__(
        self,
        verbs: HostVerbs,
        runs: RunCache,
        sessions: SessionRegistry,
        retries: Retries,
        log: FilteringBoundLogger,
    ) -> None:
        self._verbs = verbs
        self._runs = runs
        self._sessions = sessions
        self._retries = retries
        self._log = log

    async def recover(
        self,
        run_name: str,
        plan: WorkflowPlan,
        scope: str,
        manifest: CapabilityManifest,
        *,
        inputs: Mapping[str, ToolPayload] | None = None,
        compensations: Mapping[str, tuple[WorkflowCompensationTarget, ToolPayload]] | None = None,
        minimum_revision: int = 0,
    ) -> RecoverySummary:
        """``HostClient.recover`` (its docstring is the contract)."""
        inputs = inputs or {}
        compensations = compensations or {}
        run = await self._runs.load(run_name, plan, minimum_revision=minimum_revision)
        session = await self._sessions.open(scope, manifest)
        summary = RecoverySummary(run, session)
        try:
            for operation in run.ledger.operations:
                key = operation.operation_key
                if operation.state not in TERMINAL_KINDS:
                    # A lookup needs no input: the key is reconciled from what the
                    # ledger holds; the input only lets a key the worker never
                    # admitted be sent again.
                    payload = _input_of(run, inputs, key)
                    data = None if payload is None else canonical_operation_input_bytes(payload)
                    try:
                        await self._verbs.settle(session, run, key, data, payload, None)
                    except OctoError as exc:
                        session = session.current()
                        never_admitted = (
                            isinstance(exc, WorkerRequestRejected)
                            and exc.rejection_code == UnknownOperation.code
                        )
                        if payload is None and never_admitted:
                            summary.unresolved.append(key)  # only its input can send it
                            continue
                        self._recovery_failed(summary, key, exc)
                        failed = run.operation(key)
                        if failed is not None:
                            summary.operations[key] = failed.state
                        continue
                    summary.reconciled.append(key)
                    session = session.current()
                current = run.operation(key)
                if current is None:
                    continue
                summary.operations[key] = current.state
                if current.state not in TERMINAL_KINDS:
                    summary.unresolved.append(key)
                else:
                    session = await self._follow_retries(
                        summary, session, run, key, _input_of(run, inputs, key)
                    )
                compensation = current.compensation
                if compensation is None:
                    continue
                if compensation.state not in TERMINAL_KINDS:
                    session = await self._settle_compensation(
                        summary, session, run, key, compensations.get(key)
                    )
                final = run.operation(key)
                if final is not None and final.compensation is not None:
                    summary.compensations[key] = final.compensation.state
                    compensation_key = final.compensation.compensation_key
                    if (
                        final.compensation.state not in TERMINAL_KINDS
                        and compensation_key not in summary.unresolved
                    ):
                        summary.unresolved.append(compensation_key)
        except BaseException:
            # Not a key's failure (a defect, a cancellation): no summary to hand over.
            with contextlib.suppress(OctoError):
                await self._sessions.close(session)
            raise
        summary.session = session
        self._log.info(
            "run_recovered",
            run=run_name,
            revision=run.revision,
            reconciled=len(summary.reconciled),
            unresolved=len(summary.unresolved),
        )
        return summary

    async def _settle_compensation(
        self,
        summary: RecoverySummary,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        entry: tuple[WorkflowCompensationTarget, ToolPayload] | None,
    ) -> HostSession:
        """Settle the unfinished compensation of ``operation_key``; returns the session now current.

        The compensation lookup first: it needs no input and performs nothing. Then, only
        with ``entry`` (target and inverse payload): the same ``cmp-`` key
        under a fresh approval, when the worker never admitted it (and the
        ledger still says ``pending``) or when the lookup left it unfinished.
        What leaves it unfinished is noted in ``summary.errors``.
        """
        compensation = self._compensation(run, operation_key)
        compensation_key = compensation.compensation_key
        cause: str | None
        try:
            state, cause = await self._verbs.look_up_compensation(session, run, operation_key)
        except WorkerRequestRejected as refused:
            session = session.current()
            cause = refused.rejection_code
            reaction = rejection_reaction(RequestKind.RECONCILE_COMPENSATION, cause)
            # Admission precedes the inverse: the worker never saw the key. The
            # ledger still saying pending is what makes sending it safe.
            unknown = (
                reaction is Reaction.COMPENSATE_SAME_KEY
                and self._compensation(run, operation_key).state == StateKind.PENDING
            )
            if entry is None or not unknown:
                self._recovery_failed(summary, compensation_key, refused)
                return session
        except OctoError as error:
            self._recovery_failed(summary, compensation_key, error)
            return session.current()
        else:
            session = session.current()
            if state.kind in TERMINAL_KINDS:
                summary.reconciled.append(compensation_key)
                return session
            if entry is None:
                if cause is not None:
                    summary.errors[compensation_key] = cause
                return session
        target, inverse = entry
        try:
            state = await self._verbs.compensate(
                session,
                run,
                target,
                WorkflowCompensationDispatch(new_request_id(RequestKind.COMPENSATE), inverse),
            )
        except OctoError as error:
            self._recovery_failed(summary, compensation_key, error)
            return session.current()
        summary.reconciled.append(compensation_key)
        if state.kind not in TERMINAL_KINDS and cause is not None:
            summary.errors[compensation_key] = cause
        return session.current()

    async def _follow_retries(
        self,
        summary: RecoverySummary,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        payload: ToolPayload | None,
    ) -> HostSession:
        """The step's retry policy after a terminal ``operation_key``: the attempt that
        replaces it (recorded before a crash, or now) sent in ``session``, and so
        on; returns the session now current. Without the input, an attempt the
        policy calls for is reported unresolved (nothing is recorded)."""
        replacement = run.ledger.replacement(operation_key)
        due = replacement is not None or retry_refusal(run.plan, run.ledger, operation_key) is None
        if not due:
            return session
        if payload is None:
            pending = operation_key if replacement is None else replacement.operation_key
            if pending not in summary.unresolved:
                summary.unresolved.append(pending)
            return session
        sending = payload
        current = session

        async def dispatch(attempt_key: str) -> WorkerOperationState | None:
            nonlocal current
            if run.state(attempt_key) in TERMINAL_KINDS:
                return None  # settled by an earlier run: nothing to send or ask
            current = current.current()
            summary.retried.append(attempt_key)
            return await self._verbs.dispatch(current, run, attempt_key, sending)

        try:
            last_key, _ = await self._retries.follow(run, operation_key, None, dispatch)
        except OctoError as exc:
            attempts = run.ledger.attempts(operation_key)
            self._recovery_failed(summary, attempts[-1].operation_key, exc)
            return current.current()
        for attempt in run.ledger.attempts(operation_key):
            summary.operations[attempt.operation_key] = attempt.state
        last = run.operation(last_key)
        if last is not None and last.state not in TERMINAL_KINDS:
            summary.unresolved.append(last_key)
        return current.current()

    @staticmethod
    def _compensation(run: HostRun, operation_key: str) -> WorkflowCompensation:
        operation = run.operation(operation_key)
        if operation is None or operation.compensation is None:
            raise UnknownCompensation(operation_key)  # the run's ledger only grows
        return operation.compensation

    def _recovery_failed(self, summary: RecoverySummary, key: str, error: OctoError) -> None:
        code = error.rejection_code if isinstance(error, WorkerRequestRejected) else error.code
        if key not in summary.unresolved:
            summary.unresolved.append(key)
        summary.errors[key] = code
        self._log.warning("recovery_key_failed", run=summary.run.name, key=key, error=code)
