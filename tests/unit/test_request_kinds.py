"""The keyed request kinds (octo_worker.session.request_kinds): what each row builds, row by row."""

from __future__ import annotations

import pytest

from octo_common.errors import (
    IndeterminateCompensation,
    IndeterminateOperation,
    OctoError,
    PendingCompensation,
    PendingOperation,
)
from octo_common.messages import (
    CompensateOperation,
    CompensationReconcileRequest,
    CompensationReconcileResult,
    CompensationResult,
    DispatchOperation,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    OperationResult,
    ReconcileCompensation,
    ReconciledCompensation,
    ReconciledOperation,
    ReconcileOperation,
)
from octo_common.payload import ToolPayload
from octo_common.states import Running, Succeeded
from octo_worker.adapters.contract import AdapterContext
from octo_worker.session.request_kinds import (
    COMPENSATE,
    DISPATCH,
    KEYED_KINDS,
    RECONCILE_COMPENSATION,
    RECONCILE_OPERATION,
    KeyedKind,
)

SESSION = "session-1"
SCOPE = "tenant-a"
BINDING = OperationCompensationBinding("t.op", "op-1", "cmp-1", SCOPE, "ab" * 32)
DISPATCH_REQUEST = OperationDispatchRequest(SESSION, "d-1", "t.op", "op-1", ToolPayload.text("x"))
COMPENSATE_REQUEST = OperationCompensationRequest(SESSION, "c-1", BINDING, ToolPayload.text("y"))
RECONCILE_REQUEST = OperationReconcileRequest(SESSION, "r-1", "t.op", "op-1")
LOOKUP_REQUEST = CompensationReconcileRequest(
    SESSION, "l-1", "t.op", "op-1", "cmp-1", SCOPE, "ab" * 32
)


def same(error: OctoError, expected: OctoError) -> bool:
    """Errors compare by identity: the same class, code and (escaped) text."""
    return (type(error), error.code, str(error)) == (type(expected), expected.code, str(expected))


ROWS = [
    (DISPATCH, DispatchOperation(DISPATCH_REQUEST), ("d-1", "op-1", None)),
    (COMPENSATE, CompensateOperation(COMPENSATE_REQUEST), ("c-1", "op-1", "cmp-1")),
    (RECONCILE_OPERATION, ReconcileOperation(RECONCILE_REQUEST), ("r-1", "op-1", None)),
    (RECONCILE_COMPENSATION, ReconcileCompensation(LOOKUP_REQUEST), ("l-1", "op-1", "cmp-1")),
]


@pytest.mark.parametrize(
    ("kind", "message", "names"), ROWS, ids=lambda v: getattr(v, "message_type", "")
)
def test_a_row_reads_its_request_and_names(
    kind: KeyedKind, message: object, names: tuple[str, str, str | None]
) -> None:
    request = kind.request_of(message)
    assert request is message.request  # type: ignore[attr-defined]
    assert kind.names(request) == names


def test_dispatch_builds_operation_answers() -> None:
    status = Succeeded(ToolPayload.text("done"))
    result = DISPATCH.result(SESSION, DISPATCH_REQUEST, status)
    assert result == OperationReconcileResult(SESSION, "d-1", "t.op", "op-1", status)
    assert DISPATCH.answer(result) == OperationResult(result)
    assert same(DISPATCH.pending(DISPATCH_REQUEST), PendingOperation("op-1"))
    assert DISPATCH.indeterminate is not None
    assert same(
        DISPATCH.indeterminate("op-1", None, "adapter"), IndeterminateOperation("op-1", "adapter")
    )
    assert DISPATCH.effect and DISPATCH.adapter_method == "dispatch_operation"


def test_compensate_builds_compensation_answers() -> None:
    status = Running()
    result = COMPENSATE.result(SESSION, COMPENSATE_REQUEST, status)
    assert result == OperationCompensationResult(SESSION, "c-1", BINDING, status)
    assert COMPENSATE.answer(result) == CompensationResult(result)
    assert same(COMPENSATE.pending(COMPENSATE_REQUEST), PendingCompensation("op-1"))
    assert COMPENSATE.indeterminate is not None
    refusal = COMPENSATE.indeterminate("op-1", "cmp-1", "journal")
    assert same(refusal, IndeterminateCompensation("op-1", "cmp-1", "journal"))
    assert COMPENSATE.grant_fingerprint is not None
    assert COMPENSATE.grant_fingerprint(COMPENSATE_REQUEST) == "ab" * 32
    assert COMPENSATE.effect and COMPENSATE.adapter_method == "compensate_operation"


def test_reconcile_is_a_lookup_answering_reconciled_operation() -> None:
    status = Succeeded(ToolPayload.text("done"))
    result = RECONCILE_OPERATION.result(SESSION, RECONCILE_REQUEST, status)
    assert RECONCILE_OPERATION.answer(result) == ReconciledOperation(result)
    assert same(RECONCILE_OPERATION.pending(RECONCILE_REQUEST), PendingOperation("op-1"))
    assert not RECONCILE_OPERATION.effect and RECONCILE_OPERATION.indeterminate is None
    assert RECONCILE_OPERATION.adapter_method == "reconcile_operation"


def test_reconcile_compensation_is_a_lookup_answering_reconciled_compensation() -> None:
    # The mirror of reconcile_operation, by compensation key.
    status = Succeeded(ToolPayload.text("undone"))
    result = RECONCILE_COMPENSATION.result(SESSION, LOOKUP_REQUEST, status)
    assert result == CompensationReconcileResult(
        SESSION, "l-1", "t.op", "op-1", "cmp-1", SCOPE, "ab" * 32, status
    )
    assert result.matches_request(LOOKUP_REQUEST)
    assert RECONCILE_COMPENSATION.answer(result) == ReconciledCompensation(result)
    assert same(RECONCILE_COMPENSATION.pending(LOOKUP_REQUEST), PendingCompensation("op-1"))
    assert not RECONCILE_COMPENSATION.effect and RECONCILE_COMPENSATION.indeterminate is None
    assert RECONCILE_COMPENSATION.adapter_method == "reconcile_compensation"
    assert RECONCILE_COMPENSATION.grant_fingerprint is not None
    assert RECONCILE_COMPENSATION.grant_fingerprint(LOOKUP_REQUEST) == "ab" * 32
    assert KEYED_KINDS["reconcile_compensation"] is RECONCILE_COMPENSATION


def test_the_two_lookup_kinds_share_one_path() -> None:
    # Both are lookups (no admission, no ack before the adapter, no
    # indeterminate answer): the session spends one set of budgets for both.
    lookups = [kind for kind in KEYED_KINDS.values() if not kind.effect]
    assert lookups == [RECONCILE_OPERATION, RECONCILE_COMPENSATION]


def test_contexts_name_the_key_each_kind_is_idempotent_by() -> None:
    deadline = 12.5
    assert DISPATCH.context(SCOPE, SESSION, DISPATCH_REQUEST, deadline) == (
        AdapterContext.for_operation(SCOPE, SESSION, "op-1", deadline)
    )
    assert RECONCILE_OPERATION.context(SCOPE, SESSION, RECONCILE_REQUEST, deadline) == (
        AdapterContext.for_operation(SCOPE, SESSION, "op-1", deadline)
    )
    assert COMPENSATE.context(SCOPE, SESSION, COMPENSATE_REQUEST, deadline) == (
        AdapterContext.for_compensation(SCOPE, SESSION, "cmp-1", deadline)
    )
    assert RECONCILE_COMPENSATION.context(SCOPE, SESSION, LOOKUP_REQUEST, deadline) == (
        AdapterContext.for_compensation(SCOPE, SESSION, "cmp-1", deadline)
    )
