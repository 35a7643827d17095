"""The host client's runs: each run's durable ledger and its routes (H§16.5, H§17).

This module owns :class:`HostRun` (one workflow run's ledger in the store,
record key ``("workflow-ledger", run)``, with the keys it recorded and never
sent) and :class:`RunCache`: load or create a run's ledger for a plan and
validate it against the rollback watermark (the highest revision this client
stored for the run), keep a bounded number of runs loaded, write a ledger
with compare-and-swap before anything acts on it, adopt the stored ledger
after a conflict, and bind each operation key to the scope of its first
dispatch (``("workflow-routes", run)``).

It must never adopt a ledger that does not validate for its plan and
watermark, let a run's stored revision fall behind the database (a write
runs to the end even when its caller is cancelled), change a key's bound
scope, or drop a run that holds keys it recorded and never sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final

import msgspec
from structlog.typing import FilteringBoundLogger

from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    InvalidLedgerEncoding,
    OctoError,
    StorageBackendError,
    UnknownOperation,
    WriteConflict,
)
from octo_common.records import StorageRecordKey
from octo_common.states import StateKind
from octo_host.client.settings import ClientSettings
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowPlan
from octo_host.store import AuthenticatedStore, ledger_record_key

__all__ = [
    "ROUTES_NAMESPACE",
    "DispatchScopeMismatch",
    "HostRun",
    "RunCache",
    "routes_record_key",
]


class DispatchScopeMismatch(OctoError):
    """The key was bound to another tenant scope by its first dispatch; nothing is sent.

    The ledger does not name a scope and worker journals are per scope, so
    an ``unknown_operation`` from a second scope is no evidence: dispatching
    there could run the effect twice (PROTOCOL.md §1, H§16.4). Fail closed.
    """

    _fields = ("operation_key", "bound_scope", "scope")
    _text = "operation key bound to another scope"
    operation_key: str
    bound_scope: str
    scope: str

    def __str__(self) -> str:
        return (
            f"{self.operation_key} was dispatched to scope {self.bound_scope}, "
            f"refused for scope {self.scope}"
        )


ROUTES_NAMESPACE: Final = "workflow-routes"
_ROUTES_FORMAT_VERSION: Final = 1


class _RoutesDoc(msgspec.Struct, forbid_unknown_fields=True):
    """``("workflow-routes", RUN)``: the scope each operation key is bound to.

    A key is bound before its first dispatch, or when it is recorded with a scope.
    """

    format_version: int
    run: str
    routes: dict[str, str]


def _routes_doc(run: HostRun, routes: dict[str, str]) -> bytes:
    return encode_struct(_RoutesDoc(_ROUTES_FORMAT_VERSION, run.name, routes))


def routes_record_key(run: str) -> StorageRecordKey:
    """The record key of a run's dispatch routes: ``("workflow-routes", run)``."""
    return StorageRecordKey(ROUTES_NAMESPACE, run)


class HostRun:
    """One workflow run's durable ledger (``("workflow-ledger", name)``).

    Built by :meth:`HostClient.load_run`. Every change goes through the client,
    which persists it with compare-and-swap before anything acts on it; its
    underscored attributes belong to the client.
    """

    def __init__(
        self,
        name: str,
        plan: WorkflowPlan,
        ledger: WorkflowOperationLedger,
        stored_revision: int,
    ) -> None:
        self.name = name
        self.plan = plan
        self.record_key = ledger_record_key(name)
        self._ledger = ledger
        self._stored_revision = stored_revision
        self._durable_ledger_revision = ledger.revision
        self._lock = asyncio.Lock()
        # Keys this object recorded and sent no dispatch for (changed under the
        # lock): the only keys a dispatch_operation may go to directly. A key
        # read from the store, whatever its state, may have been sent before
        # (another process, a crash): it is reconciled first (H§16.5).
        self._unsent: set[str] = set()
        # Set when the client no longer holds this object as the run's (dropped
        # from its cache, or another object loaded for the run): from then on
        # it dispatches no key without reconciling first, ``_unsent`` or not.
        self._detached = False
        # ("workflow-routes", name): loaded on the first dispatch (None until then).
        self._routes: dict[str, str] | None = None
        self._routes_revision: int | None = None

    @property
    def ledger(self) -> WorkflowOperationLedger:
        """A copy of the current (durable) ledger."""
        return self._ledger.copy()

    @property
    def revision(self) -> int:
        return self._ledger.revision

    def operation(self, operation_key: str) -> WorkflowOperation | None:
        return self._ledger.operation(operation_key)

    def state(self, operation_key: str) -> StateKind:
        operation = self._ledger.operation(operation_key)
        if operation is None:
            raise UnknownOperation(operation_key)
        return operation.state

    def __repr__(self) -> str:
        return f"HostRun(name={self.name!r}, revision={self._ledger.revision})"


class RunCache:
    """The runs one client has loaded, least recently loaded first, and their writes."""

    def __init__(
        self,
        store: AuthenticatedStore,
        engine: WorkflowEngine,
        settings: ClientSettings,
        awaited_runs: Callable[[], set[int]],
        log: FilteringBoundLogger,
    ) -> None:
        self.store = store
        self._engine = engine
        self._settings = settings
        self._awaited_runs = awaited_runs
        self._log = log
        self.loaded: dict[str, HostRun] = {}
        """Runs loaded, least recently loaded first; bounded (see ``_evict``)."""
        self._watermarks: dict[str, int] = {}

    async def load(self, name: str, plan: WorkflowPlan, *, minimum_revision: int = 0) -> HostRun:
        """Load (or create at revision 0) the ledger of run ``name`` for ``plan``.

        The ledger is validated for the plan and against the rollback watermark:
        the highest revision this client stored for the run, or ``minimum_revision``.
        """
        cached = self.loaded.get(name)
        if (
            cached is not None
            and (cached.plan is plan or cached.plan.fingerprint == plan.fingerprint)
            and cached.revision >= minimum_revision
        ):
            del self.loaded[name]
            self.loaded[name] = cached  # most recently used
            return cached
        key = ledger_record_key(name)
        record = await self.store.load(key)
        if record is None:
            ledger = self._engine.operation_ledger(plan)
            record = await self.store.create(key, ledger.to_json().encode("utf-8"))
        else:
            ledger = WorkflowOperationLedger.from_json(record.payload)
        watermark = max(self._watermarks.get(name, 0), minimum_revision)
        self._engine.validate_operation_ledger_at_or_after(plan, ledger, watermark)
        self._watermarks[name] = ledger.revision
        run = HostRun(name, plan, ledger, record.revision)
        replaced = self.loaded.pop(name, None)
        if replaced is not None:
            # Two objects for one run: neither may dispatch a key without reconciling.
            replaced._unsent.clear()
            replaced._detached = True
        self.loaded[name] = run
        self._evict()
        self._log.info("run_loaded", run=name, revision=ledger.revision, plan=plan.fingerprint)
        return run

    def _evict(self) -> None:
        """Keep at most ``max_cached_runs`` runs loaded, dropping the least recently used.

        A long-lived client otherwise keeps the ledger of every run it ever
        loaded. Kept whatever the bound: the run just loaded, a run in use (its
        lock held, or a reply to a request of it awaited by a caller), and a
        run holding keys it recorded and never sent (a second
        object for the run could not tell them from sent ones). A dropped
        object is detached: if a caller still holds it, it reconciles every key
        before dispatching any, like the object loaded for the run next.
        """
        excess = len(self.loaded) - self._settings.max_cached_runs
        if excess <= 0:
            return
        waited = self._awaited_runs()
        newest = next(reversed(self.loaded))
        for name, run in list(self.loaded.items()):
            if name == newest or run._lock.locked() or run._unsent or id(run) in waited:
                continue
            del self.loaded[name]
            run._detached = True
            excess -= 1
            if excess <= 0:
                return

    async def persist_locked(
        self,
        run: HostRun,
        candidate: WorkflowOperationLedger,
        routes: dict[str, str] | None = None,
    ) -> None:
        """Compare-and-swap ``candidate`` over the stored ledger; then adopt it.

        With ``routes`` (the run's routes with one binding added), the routes
        record is written in the same transaction: both or neither.
        """
        if (
            routes is None
            and candidate.revision == run._durable_ledger_revision
            and candidate == run._ledger
        ):
            return
        payload = candidate.to_json().encode("utf-8")
        # The write and the adoption of its outcome run to the end even if the
        # caller is cancelled, and the caller (who holds the run lock) waits
        # for them: otherwise the run's stored revision would fall behind the
        # database and every later write of the run would be a WriteConflict.
        task = asyncio.ensure_future(self._swap_and_adopt(run, candidate, payload, routes))
        cancelled = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                cancelled = True
            except BaseException:
                break  # the task is done: its outcome is raised below
        if cancelled:
            if not task.cancelled():
                task.exception()  # retrieved: the caller sees its cancellation
            raise asyncio.CancelledError()
        task.result()

    async def _swap_and_adopt(
        self,
        run: HostRun,
        candidate: WorkflowOperationLedger,
        payload: bytes,
        routes: dict[str, str] | None,
    ) -> None:
        try:
            if routes is None:
                record = await self.store.compare_and_swap(
                    run.record_key, run._stored_revision, payload
                )
            else:
                record, routes_record = await self.store.compare_and_swap_many(
                    [
                        (run.record_key, run._stored_revision, payload),
                        (
                            routes_record_key(run.name),
                            run._routes_revision,
                            _routes_doc(run, routes),
                        ),
                    ]
                )
                run._routes, run._routes_revision = routes, routes_record.revision
        except BaseException as exc:
            if routes is not None:
                run._routes = None  # reloaded from the store when next needed
            if isinstance(exc, WriteConflict | StorageBackendError):
                # The stored ledger is not what this run holds (another writer,
                # or a write reported failed after its commit): adopt what the
                # store holds, so the next verb starts from it instead of
                # failing forever.
                await self._resync(run)
            raise
        run._stored_revision = record.revision
        run._ledger = candidate
        run._durable_ledger_revision = candidate.revision
        self._watermarks[run.name] = candidate.revision
        self._log.debug("ledger_persisted", run=run.name, revision=candidate.revision)

    async def _resync(self, run: HostRun) -> None:
        """Adopt the stored ledger of ``run`` if it validates; else keep the run as is."""
        try:
            record = await self.store.load(run.record_key)
            if record is None or record.revision == run._stored_revision:
                return
            ledger = WorkflowOperationLedger.from_json(record.payload)
            watermark = self._watermarks.get(run.name, 0)
            self._engine.validate_operation_ledger_at_or_after(run.plan, ledger, watermark)
        except OctoError as exc:
            self._log.error("ledger_resync_failed", run=run.name, error=exc.code)
            return
        run._stored_revision = record.revision
        run._ledger = ledger
        run._durable_ledger_revision = ledger.revision
        run._unsent.clear()  # the other writer may have sent any key
        self._watermarks[run.name] = ledger.revision
        self._log.warning("ledger_resynced", run=run.name, revision=ledger.revision)

    def current(self, run: HostRun) -> HostRun:
        """The object loaded for ``run``'s name now (``run`` itself unless it was detached)."""
        return self.loaded.get(run.name, run)

    async def bind_route(self, run: HostRun, operation_key: str, scope: str) -> None:
        """Bind ``operation_key`` to ``scope`` before its first ``dispatch_operation``.

        Raises :class:`DispatchScopeMismatch` when an earlier dispatch bound it
        to another scope. Called under the run lock.
        """
        routes = await self.routes_with(run, operation_key, scope)
        if routes is None:
            return
        try:
            record = await self.store.compare_and_swap(
                routes_record_key(run.name), run._routes_revision, _routes_doc(run, routes)
            )
        except BaseException:
            run._routes = None  # reloaded from the store on the next dispatch
            raise
        run._routes, run._routes_revision = routes, record.revision

    async def routes_with(
        self, run: HostRun, operation_key: str, scope: str
    ) -> dict[str, str] | None:
        """The run's routes with ``operation_key`` bound to ``scope``; None if it is already.

        Raises :class:`DispatchScopeMismatch` when the key is bound to
        another scope. Called under the run lock; writes nothing.
        """
        if run._routes is None:
            record = await self.store.load(routes_record_key(run.name))
            if record is None:
                run._routes, run._routes_revision = {}, None
            else:
                doc = decode_struct(record.payload, _RoutesDoc, error=InvalidLedgerEncoding)
                if doc.format_version != _ROUTES_FORMAT_VERSION or doc.run != run.name:
                    raise InvalidLedgerEncoding("routes record of another run or version")
                run._routes, run._routes_revision = dict(doc.routes), record.revision
        bound = run._routes.get(operation_key)
        if bound == scope:
            return None
        if bound is not None:
            self._log.error(
                "dispatch_refused",
                run=run.name,
                operation_key=operation_key,
                code=DispatchScopeMismatch.code,
                bound_scope=bound,
                scope=scope,
            )
            raise DispatchScopeMismatch(operation_key, bound, scope)
        return {**run._routes, operation_key: scope}
