"""Operation and compensation states and their one transition table.

Everything that decides whether a state may follow another lives here, in
one table, shared by the worker journal and the host ledger (h11's
``_state.py`` shape). States are frozen values tagged by ``"state"`` on the
wire; their reprs never show a payload or a failure message.
"""

from __future__ import annotations

import enum
import re
from typing import Any, ClassVar, Protocol

import msgspec

from octo_common.errors import (
    InvalidOperationFailure,
    OperationFailureTooLarge,
    OutputTooLarge,
)
from octo_common.limits import MAX_OPERATION_ERROR_BYTES
from octo_common.payload import ToolPayload

__all__ = [
    "DID_NOT_ACT_CODES",
    "Cancelled",
    "Failed",
    "FailureCode",
    "OperationStatus",
    "Pending",
    "Running",
    "StateKind",
    "Succeeded",
    "TERMINAL_KINDS",
    "WorkerOperationState",
    "accepts",
    "did_not_act",
    "is_failure_code",
    "is_proven_not_happened",
    "kind_of",
    "state_for_kind",
    "validate_operation_status_for_grant",
    "validate_state_for_grant",
]


class StateKind(enum.StrEnum):
    """The five state kinds; values are the wire spellings."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __repr__(self) -> str:
        return f"StateKind.{self.name}"


TERMINAL_KINDS = frozenset({StateKind.SUCCEEDED, StateKind.FAILED, StateKind.CANCELLED})


class _State(msgspec.Struct, frozen=True, tag_field="state"):
    kind: ClassVar[StateKind]

    def validate(self) -> None:
        """Running, cancelled and pending are always valid."""


class Pending(_State, frozen=True, tag="pending"):
    """Admitted, outcome not yet observed (journal and ledger only; never a status)."""

    kind: ClassVar[StateKind] = StateKind.PENDING

    def __repr__(self) -> str:
        return "Pending()"


class Running(_State, frozen=True, tag="running"):
    kind: ClassVar[StateKind] = StateKind.RUNNING

    def __repr__(self) -> str:
        return "Running()"


class Succeeded(_State, frozen=True, tag="succeeded"):
    payload: ToolPayload
    kind: ClassVar[StateKind] = StateKind.SUCCEEDED

    def validate(self) -> None:
        self.payload.validate_for(self.payload.format)

    def __repr__(self) -> str:
        return f"Succeeded(payload=[redacted {self.payload.format}])"


class FailureCode(enum.StrEnum):
    """Why a ``failed`` state is definite, when Octo knows it (``Failed.code``).

    A ``Failed`` without a code is the adapter's own report that its effect
    failed: whether something was done before it failed is the adapter's
    business, so nothing may be retried on its strength. With a code:

    * ``INPUT_REFUSED``: the adapter refused the request's input (its JSON
      contract, a name, a bound) before any effect. It did not act, and it
      is never called again under this key: the journal answers the key
      from the row.
    * ``OPTIONS_REFUSED``: the adapter's own configuration refused the call
      before any effect. Did not act, as above.
    * ``NOT_HAPPENED``: a status lookup proved that the effect did not
      happen and fenced the key at the adapter, so that a late call under
      the key does nothing. Did not act, and never will under this key.
    * ``RESOLVED_BY_OPERATOR``: an operator decided the key ``failed`` after
      checking the target system. Octo does not know whether an effect ran:
      it is not a "did not act" outcome.
    """

    INPUT_REFUSED = "input_refused"
    OPTIONS_REFUSED = "options_refused"
    NOT_HAPPENED = "not_happened"
    RESOLVED_BY_OPERATOR = "resolved_by_operator"

    def __repr__(self) -> str:
        return f"FailureCode.{self.name}"


DID_NOT_ACT_CODES = frozenset(
    {FailureCode.INPUT_REFUSED, FailureCode.OPTIONS_REFUSED, FailureCode.NOT_HAPPENED}
)
"""The codes of a ``failed`` state that prove no effect ran under its key."""

# A failure code's syntax: snake_case, as error codes are (unknown codes decode).
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")


class Failed(_State, frozen=True, tag="failed", omit_defaults=True):
    """A definite failure: ``message`` is adapter text (1..4096 bytes, never shown
    by default); ``code``, when set, says why it is definite (:class:`FailureCode`).

    ``code`` is omitted from the encoding when None, so a failure without one
    is ``{"state":"failed","message":...}`` exactly.
    """

    message: str
    code: str | None = None
    kind: ClassVar[StateKind] = StateKind.FAILED

    def validate(self) -> None:
        size = len(self.message.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise InvalidOperationFailure()
        if size > MAX_OPERATION_ERROR_BYTES:
            raise OperationFailureTooLarge(size, MAX_OPERATION_ERROR_BYTES)
        if self.code is not None and not is_failure_code(self.code):
            raise InvalidOperationFailure()

    def __repr__(self) -> str:
        if self.code is None:
            return "Failed(message=[redacted])"
        return f"Failed(message=[redacted], code={self.code!r})"


class Cancelled(_State, frozen=True, tag="cancelled"):
    kind: ClassVar[StateKind] = StateKind.CANCELLED

    def __repr__(self) -> str:
        return "Cancelled()"


OperationStatus = Running | Succeeded | Failed | Cancelled
WorkerOperationState = Pending | Running | Succeeded | Failed | Cancelled

_BARE: dict[StateKind, _State] = {
    StateKind.PENDING: Pending(),
    StateKind.RUNNING: Running(),
    StateKind.CANCELLED: Cancelled(),
}


def state_for_kind(kind: StateKind | str) -> Pending | Running | Cancelled:
    """The payload-less state of a kind (``succeeded``/``failed`` need content)."""
    state = _BARE.get(StateKind(kind))
    if state is None:
        raise ValueError(f"{kind} needs a payload or message")
    return state  # type: ignore[return-value]


def is_failure_code(value: object) -> bool:
    """``value`` has the syntax of a failure code (snake_case, at most 64 characters)."""
    return isinstance(value, str) and _CODE.fullmatch(value) is not None


def did_not_act(state: Any) -> bool:
    """A ``failed`` state whose code proves that no effect ran (``DID_NOT_ACT_CODES``)."""
    return isinstance(state, Failed) and state.code in DID_NOT_ACT_CODES


def is_proven_not_happened(state: Any) -> bool:
    """A ``failed`` state coded ``not_happened``: proven not to have happened, and the
    key fenced at the adapter (the one outcome a retry policy answers by default)."""
    return isinstance(state, Failed) and state.code == FailureCode.NOT_HAPPENED


def kind_of(state: Any) -> StateKind:
    """The kind of a state object or of a bare kind."""
    if isinstance(state, StateKind):
        return state
    if isinstance(state, _State):
        return state.kind
    return StateKind(state)


# current kind -> observed kinds accepted (observed pending is never accepted)
_TRANSITIONS: dict[StateKind, frozenset[StateKind]] = {
    StateKind.PENDING: frozenset(
        {StateKind.RUNNING, StateKind.SUCCEEDED, StateKind.FAILED, StateKind.CANCELLED}
    ),
    StateKind.RUNNING: frozenset(
        {StateKind.RUNNING, StateKind.SUCCEEDED, StateKind.FAILED, StateKind.CANCELLED}
    ),
    StateKind.SUCCEEDED: frozenset({StateKind.SUCCEEDED}),
    StateKind.FAILED: frozenset({StateKind.FAILED}),
    StateKind.CANCELLED: frozenset({StateKind.CANCELLED}),
}


def accepts(current: Any, observed: Any) -> bool:
    """May ``observed`` follow ``current``?

    With two state objects, a terminal ``succeeded``/``failed`` accepts only
    an exactly equal observation (payload / message compared exactly). With a
    bare ``StateKind`` on either side (the host ledger keeps no payloads),
    kinds alone decide.
    """
    current_kind = kind_of(current)
    observed_kind = kind_of(observed)
    if observed_kind not in _TRANSITIONS[current_kind]:
        return False
    exact = current_kind in (StateKind.SUCCEEDED, StateKind.FAILED)
    if exact and isinstance(current, _State) and isinstance(observed, _State):
        return bool(current == observed)
    return True


class _GrantLimits(Protocol):
    @property
    def format(self) -> str: ...

    @property
    def max_output_bytes(self) -> int: ...


def validate_operation_status_for_grant(status: Any, grant: _GrantLimits) -> None:
    """``status.validate()``, then a success's format and size vs the grant."""
    status.validate()
    if isinstance(status, Succeeded):
        size = status.payload.validate_for(grant.format)
        if size > grant.max_output_bytes:
            raise OutputTooLarge(size, grant.max_output_bytes)


def validate_state_for_grant(state: Any, grant: _GrantLimits) -> None:
    """A stored state against the current grant: pending passes after validation."""
    state.validate()
    if not isinstance(state, Pending):
        validate_operation_status_for_grant(state, grant)
