"""The host client's retries of a step's operation under new keys (``WorkflowStep.retry``).

This module owns :class:`Retries`: after an attempt ended, find the attempt
that replaces it (recorded by an earlier call, another host sharing the
ledger, or a process that died before sending it) or record one as the
step's retry policy allows (``octo_host.retries``), durably, then send it
through the caller's dispatch, and go on until an attempt ends in an outcome
the policy does not retry or the attempts run out. ``execute`` and
``recover`` follow a step's policy through it.

Why this never runs an effect twice: only a ``failed`` attempt whose outcome
the step names is replaced (by default only ``not_happened``: the adapter
proved the effect did not happen and fenced the key, so the old key can never
act later); a ``pending`` or ``running`` attempt is never replaced; an
attempt is replaced at most once (the ledger refuses a second replacement,
and the new key is derived from the first key and the attempt number, so two
hosts record the same one); and a new attempt is durable in the ledger
before its first publish, so a crash between the two leaves it recorded
``pending`` and the next ``recover`` sends that same key (after the worker
proves it never admitted it).

It must never replace an attempt the policy does not name, send an attempt
that is not durable, record a second replacement of one attempt, or
dispatch a key again by itself (the dispatch path decides that).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Final

from structlog.typing import FilteringBoundLogger

from octo_common.payload import ToolPayload
from octo_common.runtime.faults import FaultInjector
from octo_common.states import WorkerOperationState
from octo_host.client.runs import MAX_WRITE_ATTEMPTS, HostRun, RunCache
from octo_host.client.sessions import HostSession
from octo_host.client.verbs import HostVerbs
from octo_host.retries import record_retry, retry_refusal

__all__ = ["Dispatch", "Retries"]

# The ledger write that records a retry is durable; nothing of it is sealed or sent.
_RETRY_FAULT_POINT: Final = "host.after_retry_intent"

Dispatch = Callable[[str], Awaitable[WorkerOperationState | None]]
"""Sends one attempt by its key and returns its state (the caller's dispatch verb);
None when the caller did not send it (the ledger already holds it terminal)."""


class Retries:
    """The retries of one host client (see the module docstring)."""

    def __init__(self, verbs: HostVerbs, runs: RunCache, log: FilteringBoundLogger) -> None:
        self._verbs = verbs
        self._runs = runs
        self._log = log
        self._faults = FaultInjector()

    async def follow(
        self,
        run: HostRun,
        operation_key: str,
        state: WorkerOperationState | None,
        dispatch: Dispatch,
    ) -> tuple[str, WorkerOperationState | None]:
        """From ``operation_key``, which ended in ``state``: send the attempt that
        replaces it (recorded now if the policy allows and none is), and so on.

        Returns the key of the last attempt and the state it ended in
        (``operation_key`` and ``state`` when nothing replaces it). What the
        dispatch raises is raised: the attempt it was sending stays recorded.
        """
        current, last = operation_key, state
        while True:
            replacement = run.ledger.replacement(current)
            if replacement is None:
                if retry_refusal(run.plan, run.ledger, current) is not None:
                    return current, last
                await asyncio.sleep(self._backoff(run, current))
                recorded = await self.record(run, current)
                if recorded is None:
                    return current, last
                key = recorded
            else:
                key = replacement.operation_key
            last = await dispatch(key)
            current = key

    async def follow_in(
        self,
        session: HostSession,
        run: HostRun,
        operation_key: str,
        payload: ToolPayload,
        state: WorkerOperationState,
    ) -> tuple[str, WorkerOperationState]:
        """:meth:`follow`, each attempt dispatched on ``session`` (or the session that
        replaced it) with ``payload``; the state is the last attempt's."""

        async def dispatch(key: str) -> WorkerOperationState:
            return await self._verbs.dispatch(session.current(), run, key, payload)

        last_key, last = await self.follow(run, operation_key, state, dispatch)
        return last_key, state if last is None else last

    async def record(self, run: HostRun, operation_key: str) -> str | None:
        """The key of the attempt that replaces ``operation_key``: one already in the
        ledger, or one recorded and persisted now as the step's policy allows (bound
        to the scope of the attempt it replaces). None when the policy refuses."""
        async with run._lock:
            for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
                # Decided on the ledger as stored: after a lost compare-and-swap,
                # another host's retry of this attempt is found here (same key).
                existing = run._ledger.replacement(operation_key)
                if existing is not None:
                    return existing.operation_key
                candidate = run._ledger.copy()
                if retry_refusal(run.plan, candidate, operation_key) is not None:
                    return None
                key = record_retry(run.plan, candidate, operation_key)
                scope = (await self._runs._routes(run)).get(operation_key)
                routes = None if scope is None else await self._runs.routes_with(run, key, scope)
                if await self._verbs._persisted(run, candidate, routes, attempt):
                    break
            run._unsent.add(key)
        self._faults.reach(_RETRY_FAULT_POINT)
        recorded = run.operation(key)
        self._log.info(
            "retry_recorded",
            run=run.name,
            operation_key=key,
            retry_of=operation_key,
            attempt=None if recorded is None else recorded.attempt,
        )
        return key

    @staticmethod
    def _backoff(run: HostRun, operation_key: str) -> float:
        operation = run.operation(operation_key)
        if operation is None:
            return 0.0
        policy = run.plan.retry_policy(operation.step_id)
        return 0.0 if policy is None else policy.backoff_before(operation.attempt + 1)
