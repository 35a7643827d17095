"""What an adapter is told besides the request and the grant: :class:`AdapterContext`.

A frozen value, pure (no I/O), so that the session's request-kind table
builds it without importing the adapter contract's I/O. It must never hold
a secret: its repr may be logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from octo_common.digest import AdapterIdempotencyKind, adapter_idempotency_key
from octo_common.ids import is_fingerprint, validate_token

__all__ = ["AdapterContext"]


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """What an adapter knows besides the request and the grant.

    * ``scope``: the tenant scope whose journal admitted the request. One
      adapter instance serves every scope, and operation and compensation
      keys are unique only within a scope.
    * ``session_id``: the session the request arrived in.
    * ``idempotency_key``: 64 lowercase hex, unique across scopes
      (``octo_common.digest.adapter_idempotency_key``). It is the key an
      adapter hands to an external provider or names its own effect by;
      an adapter MUST NOT use the bare operation or compensation key for
      that. Since it is always 64 hex, it is safe in a file name.
    * ``deadline``: event-loop time (``asyncio.get_running_loop().time()``)
      at which the worker stops waiting and the call counts as
      indeterminate. An adapter may bound its own I/O by it.

    A frozen value compared field by field; none of its fields is secret,
    so its repr may be logged. The worker builds it with ``for_operation``,
    ``for_compensation`` or ``for_invoke``, which derive the key.
    """

    scope: str
    session_id: str
    idempotency_key: str
    deadline: float

    def __post_init__(self) -> None:
        validate_token("tenant scope", self.scope)
        validate_token("session id", self.session_id)
        if not is_fingerprint(self.idempotency_key):
            raise ValueError("an adapter idempotency key is 64 lowercase hex")
        deadline = self.deadline
        if isinstance(deadline, bool) or not isinstance(deadline, int | float):
            raise TypeError("an adapter deadline is event-loop time, a number")
        if not math.isfinite(deadline):
            raise ValueError("an adapter deadline is finite")
        object.__setattr__(self, "deadline", float(deadline))

    @classmethod
    def _derived(
        cls,
        scope: str,
        session_id: str,
        kind: AdapterIdempotencyKind,
        key: str,
        deadline: float,
    ) -> AdapterContext:
        return cls(scope, session_id, adapter_idempotency_key(scope, kind, key), deadline)

    @classmethod
    def for_operation(
        cls, scope: str, session_id: str, operation_key: str, deadline: float
    ) -> AdapterContext:
        """For ``dispatch_operation`` and ``reconcile_operation``: kind ``operation``."""
        return cls._derived(scope, session_id, "operation", operation_key, deadline)

    @classmethod
    def for_compensation(
        cls, scope: str, session_id: str, compensation_key: str, deadline: float
    ) -> AdapterContext:
        """For ``compensate_operation`` and ``reconcile_compensation``: kind ``compensation``."""
        return cls._derived(scope, session_id, "compensation", compensation_key, deadline)

    @classmethod
    def for_invoke(
        cls, scope: str, session_id: str, request_id: str, deadline: float
    ) -> AdapterContext:
        """For ``invoke``: kind ``invoke`` over the request id."""
        return cls._derived(scope, session_id, "invoke", request_id, deadline)
