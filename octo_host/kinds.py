"""The kinds of request the host sends to a worker and awaits a reply for.

One name per kind, shared as the key of every per-kind table: the engine's
(how a reply is opened and applied, :mod:`octo_host.engine`), the reactions'
(what a refusal leads to, :mod:`octo_host.reactions`) and the client's (how
a request is prepared and published, :mod:`octo_host.client`). A new kind
is one member here and one row in each of those tables.

This module is pure and must never hold behaviour: the tables that use it do.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["RequestKind"]


class RequestKind(StrEnum):
    """A request the host awaits a reply for; the value names it in logs."""

    DISPATCH = "dispatch"
    """``dispatch_operation``, answered by ``operation_result``."""
    RECONCILE = "reconcile"
    """``reconcile_operation``, answered by ``reconciled_operation``."""
    COMPENSATE = "compensate"
    """``compensate_operation``, answered by ``compensation_result``."""
    RECONCILE_COMPENSATION = "reconcile_compensation"
    """``reconcile_compensation``, answered by ``reconciled_compensation``."""
