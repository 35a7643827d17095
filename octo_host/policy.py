"""The compensation policy: the tenant scope and grant fingerprint a compensation is bound to.

This module owns :class:`WorkflowCompensationPolicy`, the one value the
ledger records with a compensation intent and every hardened engine call
checks against the current grant. It is importable as
``octo_host.compensation.WorkflowCompensationPolicy``.

It must never do I/O, keep the grant itself, or import the ledger or the
engine (both build on it).
"""

from __future__ import annotations

from typing import NoReturn

from octo_common.errors import (
    CompensationNotGranted,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationTenantScope,
    InvalidTool,
)
from octo_common.grants import CapabilityGrant
from octo_common.ids import is_fingerprint, is_token

__all__ = ["WorkflowCompensationPolicy"]


def _token(value: object) -> bool:
    return isinstance(value, str) and is_token(value)


def _fingerprint(value: object) -> bool:
    return isinstance(value, str) and is_fingerprint(value)


class WorkflowCompensationPolicy:
    """The tenant scope and grant fingerprint a compensation is bound to.

    Read-only: ``tool``, ``tenant_scope``, ``grant_fingerprint``. The grant
    itself is not kept; the host passes the current grant with every target.
    """

    __slots__ = ("_grant_fingerprint", "_tenant_scope", "_tool")

    _tool: str
    _tenant_scope: str
    _grant_fingerprint: str

    def __init__(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        if not _token(tenant_scope):
            raise InvalidCompensationTenantScope(tenant_scope)
        grant.validate()
        if grant.max_compensations == 0:
            raise CompensationNotGranted(grant.tool)
        object.__setattr__(self, "_tool", grant.tool)
        object.__setattr__(self, "_tenant_scope", tenant_scope)
        object.__setattr__(self, "_grant_fingerprint", grant.compensation_fingerprint())

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is read-only")

    @property
    def tool(self) -> str:
        return self._tool

    @property
    def tenant_scope(self) -> str:
        return self._tenant_scope

    @property
    def grant_fingerprint(self) -> str:
        return self._grant_fingerprint

    def validate_syntax(self) -> None:
        """Tool token, tenant token, grant fingerprint hex, in that order."""
        if not _token(self._tool):
            raise InvalidTool(self._tool)
        if not _token(self._tenant_scope):
            raise InvalidCompensationTenantScope(self._tenant_scope)
        if not _fingerprint(self._grant_fingerprint):
            raise InvalidCompensationGrantFingerprint()

    def matches_grant(self, grant: CapabilityGrant) -> bool:
        """Same tool, a nonzero compensation budget and the same fingerprint
        (short-circuit; the fingerprint may raise the grant's errors)."""
        return (
            grant.tool == self._tool
            and grant.max_compensations > 0
            and grant.compensation_fingerprint() == self._grant_fingerprint
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WorkflowCompensationPolicy):
            return NotImplemented
        return (self._tool, self._tenant_scope, self._grant_fingerprint) == (
            other._tool,
            other._tenant_scope,
            other._grant_fingerprint,
        )

    def __hash__(self) -> int:
        return hash((self._tool, self._tenant_scope, self._grant_fingerprint))

    def __repr__(self) -> str:
        return (
            f"WorkflowCompensationPolicy(tool={self._tool!r}, "
            f"tenant_scope={self._tenant_scope!r}, grant_fingerprint={self._grant_fingerprint!r})"
        )
