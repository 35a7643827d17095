"""The verbs that take a run and a key, not a session, and the one-call verbs
``execute`` and ``undo``.

Each verb here borrows a session from the pool of the key's scope
(:mod:`~octo_host.client.pools`) and hands the work to the same
:class:`~octo_host.client.verbs.HostVerbs` method the explicit-session
verbs use, so it persists exactly what they persist, in the same order.
``execute`` is ``record_operation(..., scope=...)`` (or the intent an
earlier attempt recorded, found by its derived key) then ``dispatch``;
``undo`` is ``record_compensation`` (both verifiers; or the intent an
earlier attempt recorded, with the same inverse) then ``compensate`` under
a fresh approval.

It must never send a request on a session it did not lease, pick a scope
other than the one the key is bound to, record a second intent or a second
compensation, or turn an ambiguous outcome into a new attempt: what the
verbs could not settle comes back ``pending`` or ``running``. Only a step's
retry policy makes a new attempt, through
:class:`~octo_host.client.retrying.Retries`, for an outcome the policy names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from structlog.typing import FilteringBoundLogger

from octo_common.errors import (
    CompensationAlreadyRecorded,
    DuplicateOperationKey,
    InvalidConfiguration,
    OctoError,
    UnknownOperation,
)
from octo_common.grants import CapabilityGrant
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import TERMINAL_KINDS, WorkerOperationState
from octo_host.client.pools import SessionPools
from octo_host.client.retrying import Retries
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.verbs import HostVerbs, new_request_id
from octo_host.compensation import (
    CompensationActionVerifier,
    CompensationGrantVerifier,
    WorkflowCompensationDispatch,
    WorkflowCompensationTarget,
)
from octo_host.kinds import RequestKind
from octo_host.ledger import WorkflowOperation
from octo_host.policy import WorkflowCompensationPolicy

__all__ = ["CompensationVerifiers", "OperationScopeUnbound", "PooledVerbs"]

CompensationVerifiers: TypeAlias = Callable[
    [ToolPayload | None], tuple[CompensationGrantVerifier, CompensationActionVerifier]
]
"""Given the original operation's input (or None), the grant and action verifiers a
compensation is approved through (``HostClient.from_config`` builds them from
``[[grants]]`` and ``[[actions]]``)."""


class OperationScopeUnbound(OctoError):
    """A verb without a session named a key bound to no scope: nothing is sent.

    Record it with ``record_operation(..., scope=...)`` (or ``execute``), or
    dispatch it once on an explicit session, so its scope is durable first.
    """

    _fields = ("operation_key",)
    _text = "operation key is bound to no scope"
    operation_key: str


class PooledVerbs:
    """The run-and-key verbs of one host client (see the module docstring)."""

    def __init__(
        self,
        verbs: HostVerbs,
        runs: RunCache,
        pools: SessionPools,
        retries: Retries,
        log: FilteringBoundLogger,
    ) -> None:
        self._verbs = verbs
        self._runs = runs
        self._pools = pools
        self._retries = retries
        self._log = log
        self.verifiers: CompensationVerifiers | None = None

    async def _scope(self, run: HostRun, operation_key: str) -> str:
        scope = await self._runs.bound_scope(run, operation_key)
        if scope is None:
            raise OperationScopeUnbound(operation_key)
        return scope

    @staticmethod
    def _operation(run: HostRun, operation_key: str) -> WorkflowOperation:
        operation = run.operation(operation_key)
        if operation is None:
            raise UnknownOperation(operation_key)
        return operation

    async def dispatch(
        self, run: HostRun, operation_key: str, payload: ToolPayload, scope: str | None = None
    ) -> WorkerOperationState:
        """``HostClient.dispatch(run, key, payload)`` (its docstring is the contract)."""
        tool = self._operation(run, operation_key).tool
        if scope is None:
            scope = await self._scope(run, operation_key)
        async with self._pools.lease(scope, RequestKind.DISPATCH, tool) as session:
            return await self._verbs.dispatch(session, run, operation_key, payload)

    async def reconcile(
        self, run: HostRun, operation_key: str, input: ToolPayload | bytes | None
    ) -> WorkerOperationState:
        tool = self._operation(run, operation_key).tool
        scope = await self._scope(run, operation_key)
        async with self._pools.lease(scope, RequestKind.RECONCILE, tool) as session:
            return await self._verbs.reconcile(session, run, operation_key, input)

    async def compensate(
        self,
        run: HostRun,
        target: WorkflowCompensationTarget,
        dispatch: WorkflowCompensationDispatch,
    ) -> WorkerOperationState:
        key = target.operation_key
        tool = self._operation(run, key).tool
        scope = await self._scope(run, key)
        async with self._pools.lease(scope, RequestKind.COMPENSATE, tool) as session:
            return await self._verbs.compensate(session, run, target, dispatch)

    async def reconcile_compensation(
        self, run: HostRun, operation_key: str
    ) -> WorkerOperationState:
        tool = self._operation(run, operation_key).tool
        scope = await self._scope(run, operation_key)
        kind = RequestKind.RECONCILE_COMPENSATION
        async with self._pools.lease(scope, kind, tool) as session:
            return await self._verbs.reconcile_compensation(session, run, operation_key)

    # -- one call ------------------------------------------------------------------------

    async def execute(
        self,
        run: HostRun,
        step_id: str,
        tool: str,
        payload: ToolPayload,
        nonce: bytes,
        scope: str,
    ) -> WorkerOperationState:
        """``HostClient.execute`` (its docstring is the contract)."""
        if not self._pools.has_manifest(scope):
            raise InvalidConfiguration(f"scopes: no manifest for scope {scope!r}")
        try:
            key = await self._verbs.record_operation(
                run, step_id, tool, payload, nonce, scope=scope
            )
        except DuplicateOperationKey as exc:
            # An earlier attempt of this job recorded it: dispatch reconciles it
            # first (it may have been sent), and binds it to ``scope`` if it is not
            # bound yet (another scope: DispatchScopeMismatch, nothing sent).
            key = exc.key
        state = await self.dispatch(run, key, payload, scope)

        async def dispatch(attempt_key: str) -> WorkerOperationState:
            return await self.dispatch(run, attempt_key, payload, scope)

        # The step's retry policy, if any: an attempt proven not to have happened
        # is replaced by the next one (recorded first), never sent again itself.
        _, last = await self._retries.follow(run, key, state, dispatch)
        return state if last is None else last

    async def undo(
        self,
        run: HostRun,
        operation_key: str,
        inverse: ToolPayload,
        nonce: bytes,
        policy: WorkflowCompensationPolicy | None = None,
        original: ToolPayload | None = None,
    ) -> WorkerOperationState:
        """``HostClient.undo`` (its docstring is the contract)."""
        operation = self._operation(run, operation_key)
        scope = await self._scope(run, operation_key)
        grant = self._grant(scope, operation.tool)
        if policy is None:
            policy = WorkflowCompensationPolicy(scope, grant)
        verifiers = self.verifiers
        if verifiers is None:
            raise InvalidConfiguration(
                "compensation: this client has no verifiers (HostClient.from_config, "
                "or compensation_verifiers=)"
            )
        grant_verifier, action_verifier = verifiers(original)
        target = WorkflowCompensationTarget(
            operation_key, policy, grant, grant_verifier, action_verifier
        )
        existing = operation.compensation
        if existing is None:
            try:
                await self._verbs.record_compensation(run, target, inverse, nonce)
            except CompensationAlreadyRecorded:
                existing = self._operation(run, operation_key).compensation
                if existing is None:
                    raise
        if existing is not None and (
            existing.state in TERMINAL_KINDS
            or not existing.matches_input(canonical_operation_input_bytes(inverse))
        ):
            # The one compensation is finished, or is another inverse: never a second.
            raise CompensationAlreadyRecorded(operation_key)
        # New, or recorded by an earlier attempt with this inverse and not finished:
        # the same cmp- key and input, under a fresh approval.
        dispatch = WorkflowCompensationDispatch(new_request_id(RequestKind.COMPENSATE), inverse)
        return await self.compensate(run, target, dispatch)

    def _grant(self, scope: str, tool: str) -> CapabilityGrant:
        grant = self._pools.manifest_grant(scope, tool)
        if grant is None:
            raise InvalidConfiguration(f"grants: scope {scope!r} has no grant of tool {tool!r}")
        return grant
