"""What an adapter declares, and what its refusal means: pure rules the session reads.

Owns the declarations ``InvocationSafety`` and ``DurableOperationContract``,
:func:`declaration` (an adapter's declaration read safely),
:func:`lookup_miss_fences_key` (whether a status lookup's miss proves the key
unused) and :func:`refusal_status`, the one rule telling "did not act" from
"may have acted": an effect method that refuses its input or its options
before any effect (``AdapterInvalidJsonInput``, ``AdapterInvalidOptions``)
ends the key ``failed`` with a :class:`~octo_common.states.FailureCode`;
every other error leaves it ``pending`` for a status lookup.

No I/O, no state: it must never call an adapter's effect or lookup method.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from octo_common.errors import AdapterInvalidJsonInput, AdapterInvalidOptions
from octo_common.limits import MAX_OPERATION_ERROR_BYTES
from octo_common.states import Failed, FailureCode

__all__ = [
    "DurableOperationContract",
    "InvocationSafety",
    "bounded_text",
    "declaration",
    "lookup_miss_fences_key",
    "refusal_status",
]


class InvocationSafety(enum.StrEnum):
    """Why an ordinary ``invoke`` may run without a journal row.

    ``READ_ONLY``: the call has no effect. ``INDEPENDENTLY_IDEMPOTENT``: its
    effect is idempotent by itself, so a repeated call changes nothing.
    """

    READ_ONLY = "read_only"
    INDEPENDENTLY_IDEMPOTENT = "independently_idempotent"


class DurableOperationContract(enum.StrEnum):
    """How a durable operation's outcome can be recovered after a crash.

    ``RECONCILIATION``: ``reconcile_operation`` can look the outcome up by
    operation key. ``PROVIDER_IDEMPOTENCY_AND_RECONCILIATION``: in addition,
    the provider deduplicates by the operation key itself.
    """

    RECONCILIATION = "reconciliation"
    PROVIDER_IDEMPOTENCY_AND_RECONCILIATION = "provider_idempotency_and_reconciliation"


def declaration(method: Callable[[], object], kind: type[enum.Enum]) -> object | None:
    """The adapter's declaration, or None: one that cannot be read, or that is not
    a member of ``kind`` (``False``, ``""``, another enum), is no declaration."""
    try:
        value = method()
    except Exception:
        return None
    return value if isinstance(value, kind) else None


def lookup_miss_fences_key(adapter: object) -> bool:
    """The adapter's declaration (``BaseWorkerAdapter.lookup_miss_fences_key``):
    exactly True, else False (absent, raising, or any other value declares nothing)."""
    method = getattr(adapter, "lookup_miss_fences_key", None)
    if method is None:
        return False
    try:
        return method() is True
    except Exception:
        return False


def refusal_status(error: BaseException) -> Failed | None:
    """The definite status of an effect method's refusal before any effect, or None.

    ``AdapterInvalidJsonInput`` → ``Failed(detail, code="input_refused")``;
    ``AdapterInvalidOptions`` → ``Failed(detail, code="options_refused")``;
    the failure text is the error's detail (cut to the 4096-byte bound at a
    character boundary), or its generic text when it has none. Any other
    error (indeterminate, failed, a deadline) is None: the adapter may have
    acted, and the key stays ``pending``.
    """
    if isinstance(error, AdapterInvalidJsonInput):
        code = FailureCode.INPUT_REFUSED
    elif isinstance(error, AdapterInvalidOptions):
        code = FailureCode.OPTIONS_REFUSED
    else:
        return None
    detail = error.detail if isinstance(error.detail, str) and error.detail else str(error)
    return Failed(bounded_text(detail), code.value)


def bounded_text(text: str) -> str:
    """``text`` cut to the operation-error bound at a character boundary."""
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_OPERATION_ERROR_BYTES:
        return data.decode("utf-8")
    return data[:MAX_OPERATION_ERROR_BYTES].decode("utf-8", "ignore")
