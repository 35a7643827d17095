"""The host client's runs: each run's durable ledger and its routes.

This module owns :class:`HostRun` (one workflow run's ledger in the store,
record key ``("workflow-ledger", run)``, with the keys it recorded and never
sent) and :class:`RunCache`: load or create a run's ledger for a plan and
validate it against the rollback watermark (the highest revision this client
saw for the run), keep a bounded number of runs loaded (least recently used
out, runs in use set aside), write a ledger with compare-and-swap before
anything acts on it, adopt the stored ledger after a conflict, and bind
each operation key to the scope of its first dispatch
(``("workflow-routes", run)``). Hosts that share one ledger decide by
compare-and-swap: a write that lost adopts the stored ledger and the caller
decides again from it (``MAX_WRITE_ATTEMPTS``).

It must never adopt a ledger that does not validate for its plan and
watermark, let a run's stored revision fall behind the database (a write
runs to the end even when its caller is cancelled), change a key's bound
scope, drop a run that holds keys it recorded and never sent, or cost more
per load than the runs it drops (no copy of the cache, no scan of every
run or waiter).
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
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
    "MAX_WRITE_ATTEMPTS",
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
    there could run the effect twice. Fail closed.
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


MAX_WRITE_ATTEMPTS: Final = 4
"""Writes of one decision to a run: the first, and those after a ``WriteConflict``.

Hosts sharing one ledger decide by compare-and-swap: a write that
lost adopts the stored ledger (``RunCache.persist_locked``) and the decision
is taken again from it; past this bound the conflict is raised (fail closed).
"""

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


async def stored_routes(store: AuthenticatedStore, run: str) -> dict[str, str]:
    """A run's routes as stored (operation key → scope), for an operator's view."""
    record = await store.load(routes_record_key(run))
    if record is None:
        return {}
    doc = decode_struct(record.payload, _RoutesDoc, error=InvalidLedgerEncoding)
    if doc.format_version != _ROUTES_FORMAT_VERSION or doc.run != run:
        raise InvalidLedgerEncoding("routes record of another run or version")
    return dict(doc.routes)


class _RunLock(asyncio.Lock):
    """A run's lock; ``on_release`` (set by the run cache while it has set the run
    aside as in use) is called after every release."""

    def __init__(self) -> None:
        super().__init__()
        self.on_release: Callable[[], None] | None = None

    def release(self) -> None:
        super().release()
        if self.on_release is not None:
            self.on_release()


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
        self._lock = _RunLock()
        # Waiters a caller awaits for a request of this run (kept by the
        # sessions' waiter tables): while any is, the run stays cached.
        self._awaited = 0
        # Keys this object recorded and sent no dispatch for (changed under the
        # lock): the only keys a dispatch_operation may go to directly. A key
        # read from the store, whatever its state, may have been sent before
        # (another process, a crash): it is reconciled first.
        self._unsent: set[str] = set()
        # Set when the client no longer holds this object as the run's (dropped
        # from its cache, or another object loaded for the run): from then on
        # it dispatches no key without reconciling first, ``_unsent`` or not.
        self._detached = False
        # ("workflow-routes", name): loaded on the first dispatch (None until then).
        self._routes: dict[str, str] | None = None
        self._routes_revision: int | None = None

    def _in_use(self) -> bool:
        """Its lock held, a reply awaited by a caller, or keys recorded and never sent."""
        return self._awaited > 0 or bool(self._unsent) or self._lock.locked()

    def _release_pin(self) -> None:
        """A waiter a caller awaited no longer is (answered, given up on, removed)."""
        self._awaited -= 1
        if self._awaited == 0 and self._lock.on_release is not None:
            self._lock.on_release()

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
    """The runs one client has loaded and their writes.

    Bounded by ``max_cached_runs`` (see :meth:`_evict`): the runs that may be
    dropped are kept in least-recently-used order, and a run found in use
    when its turn comes is set aside until its last pin goes, so a miss over
    the bound costs O(1) amortised.

    **Watermarks.** The watermark of a run is the highest ledger revision
    this client saw for it (loaded, written or adopted); a load never
    accepts a ledger below it, so a store rolled back under a running client
    is refused rather than believed. It is kept for every run in
    the cache and, once a run is dropped, for the ``max_cached_runs`` runs
    dropped last; beyond that it is forgotten, so the client holds at most
    ``2 * max_cached_runs`` of them (plus the runs in use) however many runs
    it ever loaded. A run whose watermark is forgotten is still covered by
    the store's own rollback protection: the SQLite ledger's sealed store
    head is checked by every load (a database restored whole is refused
    while this process runs, anchor or not), and with its anchor file the
    last ``RECENT_RECORDS`` records the backend loaded or wrote are checked
    one by one and every record at the next open (a record put back alone
    is found there). The PostgreSQL backend has no anchor: a run
    dropped longer ago than the watermarks reach is protected only by the
    store's floor rule and the record's authentication.
    """

    def __init__(
        self,
        store: AuthenticatedStore,
        engine: WorkflowEngine,
        settings: ClientSettings,
        log: FilteringBoundLogger,
    ) -> None:
        self.store = store
        self._engine = engine
        self._settings = settings
        self._log = log
        self.loaded: dict[str, HostRun] = {}
        """Every run held, least recently loaded first (bounded, see ``_evict``)."""
        self._lru: OrderedDict[str, HostRun] = OrderedDict()
        """The runs of ``loaded`` not set aside as in use, least recently used first."""
        self._watermarks: dict[str, int] = {}
        """Run name -> watermark, for every run of ``loaded``."""
        self._dropped_watermarks: OrderedDict[str, int] = OrderedDict()
        """Run name -> watermark of runs dropped, the last ``max_cached_runs`` of them."""
        self.examined = 0
        """Runs looked at by ``_evict`` (a count the tests read: O(1) per miss)."""

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
            if name in self._lru:
                self._lru.move_to_end(name)
            return cached
        key = ledger_record_key(name)
        record = await self.store.load(key)
        if record is None:
            ledger = self._engine.operation_ledger(plan)
            try:
                record = await self.store.create(key, ledger.to_json().encode("utf-8"))
            except WriteConflict:
                # Another host created the run first (a shared ledger): load theirs.
                record = await self.store.load(key)
                if record is None:
                    raise
                ledger = WorkflowOperationLedger.from_json(record.payload)
        else:
            ledger = WorkflowOperationLedger.from_json(record.payload)
        watermark = max(self.watermark(name), minimum_revision)
        self._engine.validate_operation_ledger_at_or_after(plan, ledger, watermark)
        run = HostRun(name, plan, ledger, record.revision)
        replaced = self.loaded.pop(name, None)
        if replaced is not None:
            # Two objects for one run: neither may dispatch a key without reconciling.
            self._lru.pop(name, None)
            replaced._lock.on_release = None
            replaced._unsent.clear()
            replaced._detached = True
        self._dropped_watermarks.pop(name, None)
        self._watermarks[name] = max(self._watermarks.get(name, 0), ledger.revision)
        self.loaded[name] = run
        self._lru[name] = run
        self._evict(run)
        self._log.info("run_loaded", run=name, revision=ledger.revision, plan=plan.fingerprint)
        return run

    def watermark(self, name: str) -> int:
        """The highest ledger revision this client saw for run ``name`` (0 if forgotten)."""
        found = self._watermarks.get(name)
        if found is None:
            found = self._dropped_watermarks.get(name, 0)
        return found

    def _raise_watermark(self, name: str, revision: int) -> None:
        if name in self.loaded:
            if revision > self._watermarks.get(name, 0):
                self._watermarks[name] = revision
            return
        # A detached object written after its run was dropped (or replaced and dropped).
        dropped = self._dropped_watermarks
        if revision > dropped.get(name, 0):
            dropped[name] = revision
            dropped.move_to_end(name)
            self._trim_dropped_watermarks()

    def _trim_dropped_watermarks(self) -> None:
        dropped = self._dropped_watermarks
        while len(dropped) > self._settings.max_cached_runs:
            dropped.popitem(last=False)

    def _evict(self, newest: HostRun) -> None:
        """Keep at most ``max_cached_runs`` runs loaded, dropping the least recently used.

        A long-lived client otherwise keeps the ledger of every run it ever
        loaded. Kept whatever the bound: the run just loaded (``newest``), a
        run in use (its lock held, or a reply to a request of it awaited by a
        caller), and a run holding keys it recorded and never sent (a second
        object for the run could not tell them from sent ones). A dropped
        object is detached: if a caller still holds it, it reconciles every key
        before dispatching any, like the object loaded for the run next. Its
        watermark moves to the dropped runs' (see the class docstring).

        A run found in use is taken out of the order and set aside (its lock
        calls :meth:`_set_back` when a pin goes), so each run is looked at
        once per time it is set aside or dropped: O(1) amortised per miss.
        """
        excess = len(self.loaded) - self._settings.max_cached_runs
        lru = self._lru
        while excess > 0 and lru:
            name, run = lru.popitem(last=False)
            self.examined += 1
            if run is newest:  # every other run is set aside: keep it, stop
                lru[name] = run
                return
            if run._in_use():
                run._lock.on_release = functools.partial(self._set_back, name)
                continue
            del self.loaded[name]
            run._detached = True
            self._dropped_watermarks[name] = self._watermarks.pop(name, 0)
            self._dropped_watermarks.move_to_end(name)
            excess -= 1
        self._trim_dropped_watermarks()

    def _set_back(self, name: str) -> None:
        """A pin of a run set aside went: once it is not in use, it may be dropped again."""
        run = self.loaded.get(name)
        if run is None or run._lock.on_release is None or run._in_use():
            return
        run._lock.on_release = None
        self._lru[name] = run  # most recently used: it just was

    @staticmethod
    def require_durable(run: HostRun) -> None:
        """Raise unless the ledger ``run`` holds is the one last written or read.

        Every change is persisted on a copy before the run adopts it, so this
        never fires; a request must never be sealed from a ledger that is not
        durable, and this says so where it is sealed.
        """
        if run._ledger.revision != run._durable_ledger_revision:
            raise RuntimeError(
                f"run {run.name!r} holds ledger revision {run._ledger.revision}, "
                f"durable {run._durable_ledger_revision}: nothing is sealed from it"
            )

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
        self._raise_watermark(run.name, candidate.revision)
        self._log.debug("ledger_persisted", run=run.name, revision=candidate.revision)

    async def _resync(self, run: HostRun) -> None:
        """Adopt the stored ledger of ``run`` if it validates; else keep the run as is."""
        try:
            record = await self.store.load(run.record_key)
            if record is None or record.revision == run._stored_revision:
                return
            ledger = WorkflowOperationLedger.from_json(record.payload)
            watermark = self.watermark(run.name)
            self._engine.validate_operation_ledger_at_or_after(run.plan, ledger, watermark)
        except OctoError as exc:
            self._log.error("ledger_resync_failed", run=run.name, error=exc.code)
            return
        run._stored_revision = record.revision
        run._ledger = ledger
        run._durable_ledger_revision = ledger.revision
        run._unsent.clear()  # the other writer may have sent any key
        self._raise_watermark(run.name, ledger.revision)
        self._log.warning("ledger_resynced", run=run.name, revision=ledger.revision)

    def current(self, run: HostRun) -> HostRun:
        """The object loaded for ``run``'s name now (``run`` itself unless it was detached)."""
        return self.loaded.get(run.name, run)

    async def bind_route(self, run: HostRun, operation_key: str, scope: str) -> None:
        """Bind ``operation_key`` to ``scope`` before its first ``dispatch_operation``.

        Raises :class:`DispatchScopeMismatch` when an earlier dispatch bound it
        to another scope. Called under the run lock.
        """
        for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
            routes = await self.routes_with(run, operation_key, scope)
            if routes is None:
                return
            try:
                record = await self.store.compare_and_swap(
                    routes_record_key(run.name), run._routes_revision, _routes_doc(run, routes)
                )
            except WriteConflict:
                run._routes = None  # another host bound a key: reloaded and decided again
                if attempt >= MAX_WRITE_ATTEMPTS:
                    raise
                continue
            except BaseException:
                run._routes = None  # reloaded from the store on the next dispatch
                raise
            run._routes, run._routes_revision = routes, record.revision
            return

    async def routes_with(
        self, run: HostRun, operation_key: str, scope: str
    ) -> dict[str, str] | None:
        """The run's routes with ``operation_key`` bound to ``scope``; None if it is already.

        Raises :class:`DispatchScopeMismatch` when the key is bound to
        another scope. Called under the run lock; writes nothing.
        """
        routes = await self._routes(run)
        bound = routes.get(operation_key)
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
        return {**routes, operation_key: scope}

    async def bound_scope(self, run: HostRun, operation_key: str) -> str | None:
        """The scope ``operation_key`` is bound to (by ``record_operation(scope=...)`` or
        its first dispatch), or None. Takes the run lock."""
        async with run._lock:
            return (await self._routes(run)).get(operation_key)

    async def _routes(self, run: HostRun) -> dict[str, str]:
        """The run's routes, loaded from the store the first time. Under the run lock."""
        if run._routes is None:
            record = await self.store.load(routes_record_key(run.name))
            if record is None:
                run._routes, run._routes_revision = {}, None
            else:
                doc = decode_struct(record.payload, _RoutesDoc, error=InvalidLedgerEncoding)
                if doc.format_version != _ROUTES_FORMAT_VERSION or doc.run != run.name:
                    raise InvalidLedgerEncoding("routes record of another run or version")
                run._routes, run._routes_revision = dict(doc.routes), record.revision
        return run._routes
