"""The keyed request kinds, one row each: what differs between them is data, not code.

A keyed request names an operation key; the session holds that key's lock,
loads its journal row and answers from the journal. Two paths serve every
kind (``octo_worker.session.decisions``):

* an **effect** kind (``dispatch_operation``, ``compensate_operation``):
  authorize, check the adapter's contract, admit into the journal, commit
  the admission, ack, call the adapter once, observe, commit the answer
  with the outbox row, publish;
* a **lookup** kind (``reconcile_operation``, and
  ``reconcile_compensation``): authorize (the request id only), let the
  journal check the key's identity, spend the session's reconciliation
  budgets (one set of counters shared by both lookup kinds), call the
  adapter's status lookup, observe, commit the answer, publish, ack.

A duplicate of any keyed kind is answered from the journal through
the row's ``lookup``, ``pending``, ``result`` and ``answer``.

Each row names the authorizer, journal and adapter methods, the result and
reply message types, the refusal for a key still pending and, for an effect
kind, the indeterminate refusal; what follows from the path (effect or
lookup) and from the key a kind names (an operation's or a compensation's)
is filled in once, by ``_row``. This module holds no state and does no
I/O; it must never hold a rule that is not a difference between kinds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from octo_common import messages
from octo_common.authorizer import SessionAuthorizer
from octo_common.errors import (
    AdapterFailed,
    AdapterIndeterminate,
    IndeterminateCompensation,
    IndeterminateOperation,
    OctoError,
    PendingCompensation,
    PendingOperation,
)
from octo_common.grants import CapabilityGrant
from octo_common.states import OperationStatus
from octo_worker.adapters.context import AdapterContext
from octo_worker.journal import Dispatch, Existing, WorkerOperationJournal

__all__ = [
    "COMPENSATE",
    "DISPATCH",
    "KEYED_KINDS",
    "RECONCILE_COMPENSATION",
    "RECONCILE_OPERATION",
    "KeyedKind",
]

# The request, authorization and result structs differ per kind; each row's
# callables take and return its own (``Any`` here, checked by the rows).
Request = Any
Authorized = Any
Result = Any


@dataclass(frozen=True, slots=True)
class KeyedKind:
    """One keyed request kind (see the module docstring for the two paths)."""

    message_type: str
    # True: dispatch-like (admission, ack, effect); False: a status lookup.
    effect: bool
    # The message (of this kind's class) -> its request.
    request_of: Callable[[Any], Request]
    # Request -> (request id, operation key, compensation key or None).
    names: Callable[[Request], tuple[str, str, str | None]]
    authorize: Callable[[SessionAuthorizer, Request], Authorized]
    # Effect kinds: the journal's admission (Dispatch or Existing). Lookup
    # kinds: the journal's check that it holds the key with this identity.
    admit: Callable[[WorkerOperationJournal, Authorized], Dispatch | Existing | None]
    observe: Callable[[WorkerOperationJournal, Authorized, OperationStatus], object]
    lookup: Callable[[WorkerOperationJournal, Request, CapabilityGrant | None], Existing]
    pending: Callable[[Request], OctoError]
    # (session id, request, status) -> the result struct.
    result: Callable[[str, Request, OperationStatus], Result]
    validate_result: Callable[[SessionAuthorizer, Authorized, Result], None]
    answer: Callable[[Result], messages.WorkerMessage]
    # (adapter, request, grant, context) -> the adapter's coroutine.
    call: Callable[[Any, Request, CapabilityGrant, AdapterContext], Awaitable[Any]]
    adapter_method: str
    # (scope, session id, request, deadline) -> the adapter's context.
    context: Callable[[str, str, Request, float], AdapterContext]
    # Effect kinds: (operation key, compensation key, cause) -> the refusal
    # of a request whose adapter ran and whose outcome is unknown.
    indeterminate: Callable[[str, str | None, str], OctoError] | None
    # What an adapter's unfenced "not happened" becomes (given its text): for
    # an effect kind an indeterminate outcome, for a lookup a failed lookup.
    unfenced_miss: Callable[[str], OctoError]
    # Log fields: the grant fingerprint a request names (bound before it is
    # authorized) and the input fingerprint (bound once it is); event names.
    grant_fingerprint: Callable[[Request], str] | None
    input_fingerprint: Callable[[Request, Authorized], str] | None
    existing_event: str
    admitted_event: str
    observed_event: str


def _operation_names(request: Request) -> tuple[str, str, str | None]:
    return request.request_id, request.operation_key, None


def _compensation_names(request: Request) -> tuple[str, str, str | None]:
    return request.request_id, request.operation_key, request.compensation_key


def _operation_context(
    scope: str, session: str, request: Request, deadline: float
) -> AdapterContext:
    return AdapterContext.for_operation(scope, session, request.operation_key, deadline)


def _compensation_context(
    scope: str, session: str, request: Request, deadline: float
) -> AdapterContext:
    return AdapterContext.for_compensation(scope, session, request.compensation_key, deadline)


def _operation_result(session_id: str, request: Request, status: OperationStatus) -> Result:
    return messages.OperationReconcileResult(
        session_id, request.request_id, request.tool, request.operation_key, status
    )


def _compensation_result(session_id: str, request: Request, status: OperationStatus) -> Result:
    return messages.OperationCompensationResult(
        session_id, request.request_id, request.binding, status
    )


def _compensation_lookup_result(
    session_id: str, request: Request, status: OperationStatus
) -> Result:
    return messages.CompensationReconcileResult(
        session_id,
        request.request_id,
        request.tool,
        request.operation_key,
        request.compensation_key,
        request.tenant_scope,
        request.grant_fingerprint,
        status,
    )


def _indeterminate_compensation(
    operation_key: str, compensation_key: str | None, cause: str
) -> OctoError:
    assert compensation_key is not None  # a compensate request always names one
    return IndeterminateCompensation(operation_key, compensation_key, cause)


def _validate_reconciliation(journal: WorkerOperationJournal, auth: Authorized) -> None:
    journal.validate_reconciliation(auth)


def _validate_compensation_reconciliation(
    journal: WorkerOperationJournal, auth: Authorized
) -> None:
    journal.validate_compensation_reconciliation(auth)


def _row(
    message_type: str,
    *,
    effect: bool,
    by_compensation: bool,
    authorize: Callable[[SessionAuthorizer, Request], Authorized],
    admit: Callable[[WorkerOperationJournal, Authorized], Dispatch | Existing | None],
    observe: Callable[[WorkerOperationJournal, Authorized, OperationStatus], object],
    lookup: Callable[[WorkerOperationJournal, Request, CapabilityGrant | None], Existing],
    result: Callable[[str, Request, OperationStatus], Result],
    validate_result: Callable[[SessionAuthorizer, Authorized, Result], None],
    answer: Callable[[Result], messages.WorkerMessage],
    indeterminate: Callable[[str, str | None, str], OctoError] | None = None,
    input_fingerprint: Callable[[Request, Authorized], str] | None = None,
    events: tuple[str, str, str],
) -> KeyedKind:
    """One row: what follows from the kind's path (effect or lookup) and its key
    (an operation's, or a compensation's) is filled in here, once."""
    return KeyedKind(
        message_type=message_type,
        effect=effect,
        request_of=_request_of,
        names=_compensation_names if by_compensation else _operation_names,
        authorize=authorize,
        admit=admit,
        observe=observe,
        lookup=lookup,
        pending=_compensation_pending if by_compensation else _operation_pending,
        result=result,
        validate_result=validate_result,
        answer=answer,
        # Every keyed kind's adapter method is named as its message type.
        call=_calls(message_type),
        adapter_method=message_type,
        context=_compensation_context if by_compensation else _operation_context,
        indeterminate=indeterminate,
        unfenced_miss=AdapterIndeterminate if effect else AdapterFailed,
        grant_fingerprint=_grant_fingerprint if by_compensation else None,
        input_fingerprint=input_fingerprint,
        existing_event=events[0],
        admitted_event=events[1],
        observed_event=events[2],
    )


def _request_of(message: Any) -> Request:
    return message.request


def _operation_pending(request: Request) -> OctoError:
    return PendingOperation(request.operation_key)


def _compensation_pending(request: Request) -> OctoError:
    return PendingCompensation(request.operation_key)


def _grant_fingerprint(request: Request) -> str:
    return str(request.grant_fingerprint)


def _calls(method: str) -> Callable[[Any, Request, CapabilityGrant, AdapterContext], Any]:
    def call(
        adapter: Any, request: Request, grant: CapabilityGrant, context: AdapterContext
    ) -> Any:
        return getattr(adapter, method)(request, grant, context)

    return call


DISPATCH: Final = _row(
    "dispatch_operation",
    effect=True,
    by_compensation=False,
    authorize=SessionAuthorizer.authorize_operation,
    admit=WorkerOperationJournal.admit,
    observe=WorkerOperationJournal.observe,
    lookup=WorkerOperationJournal.lookup_operation,
    result=_operation_result,
    validate_result=SessionAuthorizer.validate_operation_result,
    answer=messages.OperationResult,
    indeterminate=lambda operation_key, _compensation_key, cause: IndeterminateOperation(
        operation_key, cause
    ),
    # The token computes it once; the journal's admission and observation read it too.
    input_fingerprint=lambda _request, auth: auth.input_fingerprint,
    events=("dispatch_existing", "dispatch_admitted", "dispatch_observed"),
)

COMPENSATE: Final = _row(
    "compensate_operation",
    effect=True,
    by_compensation=True,
    authorize=SessionAuthorizer.authorize_compensation,
    admit=WorkerOperationJournal.admit_compensation,
    observe=WorkerOperationJournal.observe_compensation,
    lookup=WorkerOperationJournal.lookup_compensation,
    result=_compensation_result,
    validate_result=SessionAuthorizer.validate_compensation_result,
    answer=messages.CompensationResult,
    indeterminate=_indeterminate_compensation,
    input_fingerprint=lambda _request, auth: auth.identity.input_fingerprint,
    events=("compensation_existing", "compensation_admitted", "compensation_observed"),
)

RECONCILE_OPERATION: Final = _row(
    "reconcile_operation",
    effect=False,
    by_compensation=False,
    authorize=SessionAuthorizer.authorize_reconciliation,
    admit=_validate_reconciliation,
    observe=WorkerOperationJournal.observe_reconciliation,
    lookup=WorkerOperationJournal.lookup_reconciliation,
    result=_operation_result,
    validate_result=SessionAuthorizer.validate_reconciliation_result,
    answer=messages.ReconciledOperation,
    events=("reconciliation_existing", "reconciliation_admitted", "reconciled"),
)

# The mirror of reconcile_operation for a compensation, looked up by its
# compensation key; the same path, the same shared budgets.
RECONCILE_COMPENSATION: Final = _row(
    "reconcile_compensation",
    effect=False,
    by_compensation=True,
    authorize=SessionAuthorizer.authorize_compensation_reconciliation,
    admit=_validate_compensation_reconciliation,
    observe=WorkerOperationJournal.observe_compensation_reconciliation,
    lookup=WorkerOperationJournal.lookup_compensation_reconciliation,
    result=_compensation_lookup_result,
    validate_result=SessionAuthorizer.validate_compensation_reconciliation_result,
    answer=messages.ReconciledCompensation,
    events=(
        "compensation_reconciliation_existing",
        "compensation_reconciliation_admitted",
        "compensation_reconciled",
    ),
)

# By message type; the message classes are listed so a decoded message finds its row.
KEYED_KINDS: Final[Mapping[str, KeyedKind]] = {
    kind.message_type: kind
    for kind in (DISPATCH, COMPENSATE, RECONCILE_OPERATION, RECONCILE_COMPENSATION)
}
KEYED_MESSAGES: Final[Mapping[type, KeyedKind]] = {
    messages.DispatchOperation: DISPATCH,
    messages.CompensateOperation: COMPENSATE,
    messages.ReconcileOperation: RECONCILE_OPERATION,
    messages.ReconcileCompensation: RECONCILE_COMPENSATION,
}
