"""The host client's recovery after a restart (H§16.5, D11): reconcile every unfinished key.

This module owns :class:`RecoverySummary` and :class:`Recovery`: load and
validate a run's ledger, open a fresh session, and settle each operation
and compensation that is not terminal, key by key, reporting what it could
not settle and why: an operation is reconciled (and dispatched again under
its key only when the worker proves it never admitted it); a compensation
is looked up first (``reconcile_compensation``, no input needed), then, with
its inverse input, sent again under its key and a fresh approval when the
worker proves it never admitted it or the lookup left it unfinished.

It must never create a new key, dispatch or compensate a key the worker may
have admitted unless the worker answers from its journal, stop at one key's
failure, or hand over a session when recovery itself fails (the session is
closed first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from octo_common.errors import OctoError, UnknownCompensation, WorkerRequestRejected
from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.verbs import HostVerbs, new_request_id
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowCompensation
from octo_host.plan import WorkflowPlan
from octo_host.reactions import Reaction, rejection_reaction

__all__ = ["Recovery", "RecoverySummary"]


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
    unresolved: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)


class Recovery:
    """Recovers the runs of one host client (``HostClient.recover``)."""

    def __init__(
        self,
        verbs: HostVerbs,
        runs: RunCache,
        sessions: SessionRegistry,
        log: FilteringBoundLogger,
    ) -> None:
        self._verbs = verbs
        self._runs = runs
        self._sessions = sessions
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
                    payload = inputs.get(key)
                    if payload is None:
                        summary.unresolved.append(key)
                        continue
                    try:
                        await self._verbs.settle(
                            session,
                            run,
                            key,
                            canonical_operation_input_bytes(payload),
                            payload,
                            None,
                        )
                    except OctoError as exc:
                        session = session.current()
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

        D11 first: the lookup needs no input and performs nothing. Then, only
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
