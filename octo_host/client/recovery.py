"""The host client's recovery after a restart (H§16.5): reconcile every unfinished key.

This module owns :class:`RecoverySummary` and :class:`Recovery`: load and
validate a run's ledger, open a fresh session, and settle each operation
and compensation that is not terminal (reconcile, dispatch the same key
again only when the worker proves it never admitted it, resend the same
compensation under a fresh approval), key by key, reporting what it could
not settle and why.

It must never create a new key, dispatch a key the worker may have
admitted, stop at one key's failure, or hand over a session when recovery
itself fails (the session is closed first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from octo_common.errors import OctoError, WorkerRequestRejected
from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.verbs import HostVerbs, new_request_id
from octo_host.compensation import WorkflowCompensationDispatch, WorkflowCompensationTarget
from octo_host.kinds import RequestKind
from octo_host.plan import WorkflowPlan

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
                    entry = compensations.get(key)
                    if entry is None:
                        summary.unresolved.append(compensation.compensation_key)
                        summary.compensations[key] = compensation.state
                        continue
                    target, inverse = entry
                    try:
                        await self._verbs.compensate(
                            session,
                            run,
                            target,
                            WorkflowCompensationDispatch(
                                new_request_id(RequestKind.COMPENSATE), inverse
                            ),
                        )
                    except OctoError as exc:
                        session = session.current()
                        self._recovery_failed(summary, compensation.compensation_key, exc)
                        failed = run.operation(key)
                        if failed is not None and failed.compensation is not None:
                            summary.compensations[key] = failed.compensation.state
                        continue
                    session = session.current()
                    summary.reconciled.append(compensation.compensation_key)
                final = run.operation(key)
                if final is not None and final.compensation is not None:
                    summary.compensations[key] = final.compensation.state
                    if final.compensation.state not in TERMINAL_KINDS:
                        summary.unresolved.append(final.compensation.compensation_key)
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

    def _recovery_failed(self, summary: RecoverySummary, key: str, error: OctoError) -> None:
        code = error.rejection_code if isinstance(error, WorkerRequestRejected) else error.code
        summary.unresolved.append(key)
        summary.errors[key] = code
        self._log.warning("recovery_key_failed", run=summary.run.name, key=key, error=code)
