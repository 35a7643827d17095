"""The keyed request kinds, one row each: what differs between them is data, not code.

A keyed request names an operation key; the session holds that key's lock,
loads its journal row and answers from the journal. Two paths serve every
kind (``octo_worker.session.answers``):

* an **effect** kind (``dispatch_operation``, ``compensate_operation``,
  W§10.6): authorize, check the adapter's contract, admit into the journal,
  commit the admission, ack, call the adapter once, observe, commit the
  answer with the outbox row, publish;
* a **lookup** kind (``reconcile_operation``, and D11's
  ``reconcile_compensation``): authorize (the request id only), let the
  journal check the key's identity, spend the session's reconciliation
  budgets (one set of counters shared by both lookup kinds), call the
  adapter's status lookup, observe, commit the answer, publish, ack.

A duplicate of any keyed kind is answered from the journal (D5) through
the row's ``lookup``, ``pending``, ``result`` and ``answer``.

Each row names the authorizer, journal and adapter methods, the result and
reply message types, the refusal for a key still pending and, for an effect
kind, the indeterminate refusal. This module holds no state and does no
I/O; it must never hold a rule that is not a difference between kinds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from octo_common import messages
from octo_common.authorizer import SessionAuthorizer
from octo_common.errors import (
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
    # The adapter (a ``WorkerAdapter``; this table imports no adapter I/O), request, grant, context.
    call: Callable[[Any, Request, CapabilityGrant, AdapterContext], Awaitable[Any]]
    adapter_method: str
    # (scope, session id, request, deadline) -> the adapter's context (D12).
    context: Callable[[str, str, Request, float], AdapterContext]
    # Effect kinds: (operation key, compensation key, cause) -> the refusal
    # of a request whose adapter ran and whose outcome is unknown.
    indeterminate: Callable[[str, str | None, str], OctoError] | None
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


DISPATCH: Final = KeyedKind(
    message_type="dispatch_operation",
    effect=True,
    request_of=lambda message: message.request,
    names=_operation_names,
    authorize=SessionAuthorizer.authorize_operation,
    admit=WorkerOperationJournal.admit,
    observe=WorkerOperationJournal.observe,
    lookup=WorkerOperationJournal.lookup_operation,
    pending=lambda request: PendingOperation(request.operation_key),
    result=_operation_result,
    validate_result=SessionAuthorizer.validate_operation_result,
    answer=messages.OperationResult,
    call=lambda adapter, request, grant, context: adapter.dispatch_operation(
        request, grant, context
    ),
    adapter_method="dispatch_operation",
    context=_operation_context,
    indeterminate=lambda operation_key, _compensation_key, cause: IndeterminateOperation(
        operation_key, cause
    ),
    grant_fingerprint=None,
    # The token computes it once; the journal's admission and observation read it too.
    input_fingerprint=lambda _request, auth: auth.input_fingerprint,
    existing_event="dispatch_existing",
    admitted_event="dispatch_admitted",
    observed_event="dispatch_observed",
)

COMPENSATE: Final = KeyedKind(
    message_type="compensate_operation",
    effect=True,
    request_of=lambda message: message.request,
    names=_compensation_names,
    authorize=SessionAuthorizer.authorize_compensation,
    admit=WorkerOperationJournal.admit_compensation,
    observe=WorkerOperationJournal.observe_compensation,
    lookup=WorkerOperationJournal.lookup_compensation,
    pending=lambda request: PendingCompensation(request.operation_key),
    result=_compensation_result,
    validate_result=SessionAuthorizer.validate_compensation_result,
    answer=messages.CompensationResult,
    call=lambda adapter, request, grant, context: adapter.compensate_operation(
        request, grant, context
    ),
    adapter_method="compensate_operation",
    context=_compensation_context,
    indeterminate=_indeterminate_compensation,
    grant_fingerprint=lambda request: request.grant_fingerprint,
    input_fingerprint=lambda _request, auth: auth.identity.input_fingerprint,
    existing_event="compensation_existing",
    admitted_event="compensation_admitted",
    observed_event="compensation_observed",
)

RECONCILE_OPERATION: Final = KeyedKind(
    message_type="reconcile_operation",
    effect=False,
    request_of=lambda message: message.request,
    names=_operation_names,
    authorize=SessionAuthorizer.authorize_reconciliation,
    admit=_validate_reconciliation,
    observe=WorkerOperationJournal.observe_reconciliation,
    lookup=WorkerOperationJournal.lookup_reconciliation,
    pending=lambda request: PendingOperation(request.operation_key),
    result=_operation_result,
    validate_result=SessionAuthorizer.validate_reconciliation_result,
    answer=messages.ReconciledOperation,
    call=lambda adapter, request, grant, context: adapter.reconcile_operation(
        request, grant, context
    ),
    adapter_method="reconcile_operation",
    context=_operation_context,
    indeterminate=None,
    grant_fingerprint=None,
    input_fingerprint=None,
    existing_event="reconciliation_existing",
    admitted_event="reconciliation_admitted",
    observed_event="reconciled",
)

# D11: the mirror of reconcile_operation for a compensation, looked up by its
# compensation key; the same path, the same shared budgets.
RECONCILE_COMPENSATION: Final = KeyedKind(
    message_type="reconcile_compensation",
    effect=False,
    request_of=lambda message: message.request,
    names=_compensation_names,
    authorize=SessionAuthorizer.authorize_compensation_reconciliation,
    admit=_validate_compensation_reconciliation,
    observe=WorkerOperationJournal.observe_compensation_reconciliation,
    lookup=WorkerOperationJournal.lookup_compensation_reconciliation,
    pending=lambda request: PendingCompensation(request.operation_key),
    result=_compensation_lookup_result,
    validate_result=SessionAuthorizer.validate_compensation_reconciliation_result,
    answer=messages.ReconciledCompensation,
    call=lambda adapter, request, grant, context: adapter.reconcile_compensation(
        request, grant, context
    ),
    adapter_method="reconcile_compensation",
    context=_compensation_context,
    indeterminate=None,
    grant_fingerprint=lambda request: request.grant_fingerprint,
    input_fingerprint=None,
    existing_event="compensation_reconciliation_existing",
    admitted_event="compensation_reconciliation_admitted",
    observed_event="compensation_reconciled",
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
