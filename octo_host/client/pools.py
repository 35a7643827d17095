"""Sessions the client manages: one pool per tenant scope.

A verb that names a run and a key, not a session, borrows a session from
the pool of the key's scope for the time of the verb (:meth:`SessionPools.lease`).
The pool opens a session on demand with the scope's configured manifest and
counts what each of its sessions was given: requests, dispatches and
compensations per tool, lookups per tool and in all. A session is rotated
out (no longer handed out, then closed once its last verb returns) before
any of these reaches the bound the worker enforces: the request ids a
session retains (``MAX_SESSION_REQUEST_IDS``; rotated at
``ClientSettings.session_rotate_after``, well below), a grant's
``max_calls`` and ``max_compensations``, and the worker's default
reconciliation budgets. A session the verbs replaced is followed to
its successor, whose counts start again.

The counts are conservative: a verb's first request is counted when the
session is lent, every request is counted when it is registered
(``HostSession.requests``), and both are added, so a session rotates early
rather than late. A refusal the counts did not foresee (a worker configured
with smaller reconciliation budgets) is still answered by the verbs: a new
session, as the reactions table (``octo_host.reactions``) says.

It must never hand out a closed session, close a session a verb still
holds, persist a session, or cost more per lease than the scope's active
sessions (at most ``session_pool_size``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Final

from structlog.typing import FilteringBoundLogger

from octo_common.errors import InvalidConfiguration, OctoError
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.limits import (
    DEFAULT_MAX_RECONCILIATIONS_PER_SESSION,
    DEFAULT_MAX_RECONCILIATIONS_PER_TOOL,
    MAX_SESSION_REQUEST_IDS,
)
from octo_host.client.sessions import HostSession, SessionRegistry
from octo_host.client.settings import ClientSettings
from octo_host.kinds import RequestKind

__all__ = ["PoolStats", "SessionPools"]

_LOOKUPS: Final = frozenset({RequestKind.RECONCILE, RequestKind.RECONCILE_COMPENSATION})


@dataclass(slots=True)
class _Pooled:
    """One session of a pool and what it was given (reset when the verbs replace it)."""

    session: HostSession
    leases: int = 0
    lent: int = 0
    """Verbs lent this session (each counts one request before it is registered)."""
    calls: Counter[str] = field(default_factory=Counter)
    compensations: Counter[str] = field(default_factory=Counter)
    lookups: Counter[str] = field(default_factory=Counter)
    retired: bool = False

    def follow(self) -> None:
        """Move to the session that replaced this one: its counts start at zero."""
        newest = self.session.current()
        if newest is not self.session:
            self.session = newest
            self.lent = 0
            self.calls.clear()
            self.compensations.clear()
            self.lookups.clear()

    def requests(self) -> int:
        """Request ids this session may already hold: an upper bound."""
        return self.session.requests + self.lent


@dataclass(frozen=True, slots=True)
class PoolStats:
    """What the pools did so far (observability; the tests read it)."""

    opened: int
    rotated: int
    closed: int
    active: int


class _Pool:
    """The sessions of one scope."""

    def __init__(self, scope: str, manifest: CapabilityManifest) -> None:
        self.scope = scope
        self.manifest = manifest
        self.active: list[_Pooled] = []
        self.opening = asyncio.Lock()
        self.budgets = {grant.tool: grant for grant in manifest.grants}


class SessionPools:
    """The client's session pools, one per scope with a manifest (see the module docstring)."""

    def __init__(
        self,
        manifests: Mapping[str, CapabilityManifest],
        sessions: SessionRegistry,
        settings: ClientSettings,
        log: FilteringBoundLogger,
    ) -> None:
        self._manifests = dict(manifests)
        self._sessions = sessions
        self._settings = settings
        self._log = log
        self._pools: dict[str, _Pool] = {}
        self._opened = 0
        self._rotated = 0
        self._closed = 0

    @property
    def stats(self) -> PoolStats:
        active = sum(len(pool.active) for pool in self._pools.values())
        return PoolStats(self._opened, self._rotated, self._closed, active)

    def scopes(self) -> list[str]:
        """The scopes with a manifest, in the order given."""
        return list(self._manifests)

    def has_manifest(self, scope: str) -> bool:
        return scope in self._manifests

    def manifest_grant(self, scope: str, tool: str) -> CapabilityGrant | None:
        """The grant of ``tool`` in ``scope``'s manifest, or None."""
        manifest = self._manifests.get(scope)
        return None if manifest is None else manifest.grant(tool)

    @contextlib.asynccontextmanager
    async def lease(self, scope: str, kind: RequestKind, tool: str) -> AsyncIterator[HostSession]:
        """A session of ``scope``'s pool with room for one request of ``kind`` on ``tool``,
        held for the block; a session rotated out meanwhile is closed after its last lease.

        A scope without a manifest raises ``InvalidConfiguration``; one without
        a key, ``InvalidScopeKey`` (when its first session is opened).
        """
        pool = self._pool(scope)
        spent: list[_Pooled] = []
        entry = self._pick(pool, kind, tool, spent)
        if entry is None:
            async with pool.opening:
                # Another verb may have opened one while this one waited.
                entry = self._pick(pool, kind, tool, spent)
                if entry is None:
                    entry = await self._open(pool)
        self._count(entry, kind, tool)
        entry.leases += 1
        for rotated in spent:
            await self._close(rotated)
        try:
            yield entry.session
        finally:
            entry.leases -= 1
            if entry.retired and entry.leases == 0:
                await self._close(entry)

    def _pool(self, scope: str) -> _Pool:
        pool = self._pools.get(scope)
        if pool is None:
            manifest = self._manifests.get(scope)
            if manifest is None:
                raise InvalidConfiguration(
                    f"scopes: no manifest for scope {scope!r} (no [[grants]] for it)"
                )
            pool = self._pools[scope] = _Pool(scope, manifest)
        return pool

    def _pick(
        self, pool: _Pool, kind: RequestKind, tool: str, spent: list[_Pooled]
    ) -> _Pooled | None:
        """The least busy active session with room. The others that have none are
        rotated out; those no verb holds are added to ``spent``, to be closed."""
        best: _Pooled | None = None
        for entry in list(pool.active):
            entry.follow()
            if entry.session.closed or not self._has_room(pool, entry, kind, tool):
                self._rotate(pool, entry)
                if entry.leases == 0:
                    spent.append(entry)
                continue
            if best is None or entry.leases < best.leases:
                best = entry
        if best is None:
            return None
        busy = best.leases >= self._settings.session_max_in_flight
        if busy and len(pool.active) < self._settings.session_pool_size:
            return None  # every session is busy: open one more
        return best

    def _has_room(self, pool: _Pool, entry: _Pooled, kind: RequestKind, tool: str) -> bool:
        limit = min(self._settings.session_rotate_after, MAX_SESSION_REQUEST_IDS)
        if entry.requests() >= limit:
            return False
        grant = pool.budgets.get(tool)
        if kind is RequestKind.DISPATCH:
            return grant is None or entry.calls[tool] < grant.max_calls
        if kind is RequestKind.COMPENSATE:
            return grant is None or entry.compensations[tool] < grant.max_compensations
        return (
            entry.lookups[tool] < DEFAULT_MAX_RECONCILIATIONS_PER_TOOL
            and entry.lookups.total() < DEFAULT_MAX_RECONCILIATIONS_PER_SESSION
        )

    @staticmethod
    def _count(entry: _Pooled, kind: RequestKind, tool: str) -> None:
        entry.lent += 1
        if kind is RequestKind.DISPATCH:
            entry.calls[tool] += 1
        elif kind is RequestKind.COMPENSATE:
            entry.compensations[tool] += 1
        elif kind in _LOOKUPS:
            entry.lookups[tool] += 1

    async def _open(self, pool: _Pool) -> _Pooled:
        session = await self._sessions.open(pool.scope, pool.manifest)
        entry = _Pooled(session)
        pool.active.append(entry)
        self._opened += 1
        return entry

    def _rotate(self, pool: _Pool, entry: _Pooled) -> None:
        """No longer hand ``entry`` out; it is closed once no verb holds it."""
        pool.active.remove(entry)
        entry.retired = True
        self._rotated += 1
        self._log.info(
            "session_rotated",
            scope=pool.scope,
            session_id=entry.session.session_id,
            requests=entry.requests(),
        )

    async def _close(self, entry: _Pooled) -> None:
        session = entry.session.current()
        if session.closed:
            return
        self._closed += 1
        with contextlib.suppress(OctoError):
            await self._sessions.close_exact(session)
