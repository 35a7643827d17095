"""Authorizing a compensation lookup: a reconciliation that spends a request id only.

Fixtures as in test_authorizer: ``math.add`` with two calls,
128-byte limits and one compensation; ``text.echo`` has no compensation
budget at all, which a lookup does not need.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import pytest

from octo_common.authorizer import (
    AuthorizedCompensationReconciliation,
    AuthorizedOperationReconciliation,
    SessionAuthorizer,
)
from octo_common.errors import (
    AuthorizationProvenanceMismatch,
    CompensationResultMismatch,
    DuplicateRequest,
    DuplicateResult,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidOperationFailure,
    InvalidToken,
    OctoError,
    OutputTooLarge,
    PayloadFormatMismatch,
    SessionRequestLimitExceeded,
    UnknownSession,
    UnknownTool,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CompensationReconcileRequest,
    CompensationReconcileResult,
    OperationReconcileRequest,
    OperationReconcileResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, OperationStatus, Running, Succeeded

SESSION = "session-1"
TOOL = "math.add"
ECHO = "text.echo"
OP_KEY = "release-42-add"
CMP_KEY = "cmp-release-42-add-undo"
TENANT = "tenant-release"
LIMIT = 1024
TOTAL = ToolPayload.json({"total": 42})

GC = CapabilityGrant(TOOL, "json", 2, 128, 128).with_compensation_limit(1)
ECHO_GRANT = CapabilityGrant(ECHO, "text", max_calls=1)
FINGERPRINT = GC.compensation_fingerprint()


def authorizer(*grants: CapabilityGrant) -> SessionAuthorizer:
    return SessionAuthorizer(CapabilityManifest(SESSION, list(grants or (GC, ECHO_GRANT))))


def lookup(request_id: str = "rc-1", **changes: str) -> CompensationReconcileRequest:
    fields = {
        "session_id": SESSION,
        "request_id": request_id,
        "tool": TOOL,
        "operation_key": OP_KEY,
        "compensation_key": CMP_KEY,
        "tenant_scope": TENANT,
        "grant_fingerprint": FINGERPRINT,
    }
    fields.update(changes)
    return CompensationReconcileRequest(**fields)  # type: ignore[arg-type]


def answer(
    request: CompensationReconcileRequest, status: OperationStatus | None = None, **changes: str
) -> CompensationReconcileResult:
    fields = {
        "session_id": request.session_id,
        "request_id": request.request_id,
        "tool": request.tool,
        "operation_key": request.operation_key,
        "compensation_key": request.compensation_key,
        "tenant_scope": request.tenant_scope,
        "grant_fingerprint": request.grant_fingerprint,
    }
    fields.update(changes)
    return CompensationReconcileResult(**fields, status=status or Running())  # type: ignore[arg-type]


def refused(
    auth: SessionAuthorizer, error: type[OctoError], call: Callable[[], object]
) -> OctoError:
    """Run ``call``, expect ``error`` and check that nothing changed."""
    before = auth.export_state()
    with pytest.raises(error) as info:
        call()
    assert auth.export_state() == before
    return info.value


def unvalidated(struct: Any, **changes: Any) -> Any:
    """A copy with ``changes`` that skips construction-time validation."""
    return msgspec.structs.replace(struct, **changes)


def fill_request_ids(auth: SessionAuthorizer) -> None:
    index = 0
    while auth.request_id_count() < LIMIT:
        auth.reserve_request_id(f"filler-{index}")
        index += 1


# Authorization ------------------------------------------------------------------------


def test_a_compensation_lookup_spends_a_request_id_and_no_budget() -> None:
    auth = authorizer()
    before = auth.export_state()

    token = auth.authorize_compensation_reconciliation(lookup("rc-1"))

    assert isinstance(token, AuthorizedCompensationReconciliation)
    assert (token.request, token.grant) == (lookup("rc-1"), GC)
    assert (token.session_id, token.request_id, token.tool) == (SESSION, "rc-1", TOOL)
    assert (token.operation_key, token.compensation_key) == (OP_KEY, CMP_KEY)
    after = auth.export_state()
    assert after.calls_by_tool == before.calls_by_tool == {}
    assert after.compensations_by_tool == {}
    assert after.compensation_identities == ()
    assert [(r.request_id, r.completed) for r in after.request_ids] == [("rc-1", False)]


def test_a_lookup_needs_no_compensation_budget_and_no_current_fingerprint() -> None:
    # A lookup performs no effect: a tool without compensation budget, and a
    # fingerprint that is not the current grant's, still authorize; the
    # journal decides whether the key holds exactly this compensation.
    auth = authorizer()
    auth.authorize_compensation_reconciliation(
        lookup("rc-1", tool=ECHO, grant_fingerprint=ECHO_GRANT.compensation_fingerprint())
    )
    auth.authorize_compensation_reconciliation(lookup("rc-2", grant_fingerprint="f" * 64))
    assert auth.compensations_for(ECHO) == auth.compensations_for(TOOL) == 0
    assert auth.calls_for(ECHO) == auth.calls_for(TOOL) == 0


def test_repeated_lookups_of_one_compensation_each_spend_only_their_own_id() -> None:
    auth = authorizer()
    for index in range(5):
        auth.authorize_compensation_reconciliation(lookup(f"rc-{index}"))
    state = auth.export_state()
    assert len(state.request_ids) == 5
    assert state.compensations_by_tool == {} and state.compensation_identities == ()


def test_the_lookup_check_order_is_that_of_a_reconciliation() -> None:
    auth = authorizer()
    auth.authorize_compensation_reconciliation(lookup("rc-1"))

    # 1. the request itself (header rules), before the session
    for bad, error in (
        ({"compensation_key": "undo-1"}, InvalidCompensationKey),
        ({"grant_fingerprint": "F" * 64}, InvalidCompensationGrantFingerprint),
        ({"tenant_scope": "Tenant"}, InvalidToken),
    ):
        refused(
            auth,
            error,
            partial(
                auth.authorize_compensation_reconciliation,
                unvalidated(lookup("rc-1", session_id="session-2"), **bad),
            ),
        )
    # 2. session, 3. tool, 4. duplicate, 5. capacity
    refused(
        auth,
        UnknownSession,
        lambda: auth.authorize_compensation_reconciliation(
            lookup("rc-1", session_id="session-2", tool="no.tool")
        ),
    )
    refused(
        auth,
        UnknownTool,
        lambda: auth.authorize_compensation_reconciliation(lookup("rc-1", tool="no.tool")),
    )
    refused(auth, DuplicateRequest, lambda: auth.authorize_compensation_reconciliation(lookup()))
    fill_request_ids(auth)
    refused(auth, DuplicateRequest, lambda: auth.authorize_compensation_reconciliation(lookup()))
    refused(
        auth,
        SessionRequestLimitExceeded,
        lambda: auth.authorize_compensation_reconciliation(lookup("rc-2")),
    )


def test_lookups_share_request_ids_with_operation_reconciliations() -> None:
    auth = authorizer()
    auth.authorize_reconciliation(OperationReconcileRequest(SESSION, "rec-1", TOOL, OP_KEY))
    refused(
        auth, DuplicateRequest, lambda: auth.authorize_compensation_reconciliation(lookup("rec-1"))
    )
    auth.authorize_compensation_reconciliation(lookup("rc-1"))
    refused(
        auth,
        DuplicateRequest,
        lambda: auth.authorize_reconciliation(
            OperationReconcileRequest(SESSION, "rc-1", TOOL, OP_KEY)
        ),
    )


# Result validation ---------------------------------------------------------------------


def test_a_valid_answer_completes_the_request_once() -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())

    auth.validate_compensation_reconciliation_result(token, answer(lookup(), Succeeded(TOTAL)))

    assert auth.is_completed("rc-1")
    error = refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_compensation_reconciliation_result(token, answer(lookup())),
    )
    assert error.request_id == "rc-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": "rc-2"},
        {"tool": ECHO},
        {"operation_key": "op-other"},
        {"compensation_key": "cmp-other"},
        {"tenant_scope": "tenant-other"},
        {"grant_fingerprint": "0" * 64},
    ],
    ids=["request-id", "tool", "operation-key", "compensation-key", "tenant", "fingerprint"],
)
def test_an_answer_must_echo_every_identity_field(change: dict[str, Any]) -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    refused(
        auth,
        CompensationResultMismatch,
        partial(
            auth.validate_compensation_reconciliation_result, token, answer(lookup(), **change)
        ),
    )
    assert not auth.is_completed("rc-1")


def test_an_answer_is_checked_against_the_grant() -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    too_large = ToolPayload.json({"pad": "x" * 200})
    refused(
        auth,
        OutputTooLarge,
        lambda: auth.validate_compensation_reconciliation_result(
            token, answer(lookup(), Succeeded(too_large))
        ),
    )
    refused(
        auth,
        PayloadFormatMismatch,
        lambda: auth.validate_compensation_reconciliation_result(
            token, answer(lookup(), Succeeded(ToolPayload.text("ok")))
        ),
    )
    auth.validate_compensation_reconciliation_result(token, answer(lookup(), Cancelled()))


def test_the_validator_checks_provenance_then_the_result_then_the_session() -> None:
    auth, other = authorizer(), authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    foreign = other.authorize_compensation_reconciliation(lookup())
    broken = unvalidated(
        answer(lookup(), session_id="session-2", request_id="rc-9"),
        status=unvalidated(Failed("x"), message=""),
    )

    refused(
        auth,
        AuthorizationProvenanceMismatch,
        partial(auth.validate_compensation_reconciliation_result, foreign, broken),
    )
    refused(
        auth,
        InvalidOperationFailure,
        partial(auth.validate_compensation_reconciliation_result, token, broken),
    )
    refused(
        auth,
        UnknownSession,
        partial(
            auth.validate_compensation_reconciliation_result,
            token,
            unvalidated(broken, status=Running()),
        ),
    )


def test_a_restored_authorizer_refuses_the_tokens_of_the_original() -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    restored = SessionAuthorizer.restore(auth.manifest, auth.export_state())
    refused(
        restored,
        AuthorizationProvenanceMismatch,
        lambda: restored.validate_compensation_reconciliation_result(token, answer(lookup())),
    )
    # The retained id survived the restore, so it cannot be authorized again.
    refused(
        restored,
        DuplicateRequest,
        lambda: restored.authorize_compensation_reconciliation(lookup()),
    )


def test_at_capacity_the_validator_still_completes_a_lookup() -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    fill_request_ids(auth)
    auth.validate_compensation_reconciliation_result(token, answer(lookup(), Failed("gone")))
    assert auth.is_completed("rc-1") and auth.request_id_count() == LIMIT


def test_a_token_of_the_wrong_kind_is_a_programming_error() -> None:
    auth = authorizer()
    operation_token = auth.authorize_reconciliation(
        OperationReconcileRequest(SESSION, "rec-1", TOOL, OP_KEY)
    )
    lookup_token = auth.authorize_compensation_reconciliation(lookup())
    with pytest.raises(TypeError):
        auth.validate_compensation_reconciliation_result(
            operation_token,  # type: ignore[arg-type]
            answer(lookup()),
        )
    with pytest.raises(TypeError):
        auth.validate_reconciliation_result(
            lookup_token,  # type: ignore[arg-type]
            OperationReconcileResult(SESSION, "rc-1", TOOL, OP_KEY, Running()),
        )
    assert not isinstance(lookup_token, AuthorizedOperationReconciliation)


def test_lookup_tokens_are_in_process_values() -> None:
    auth = authorizer()
    token = auth.authorize_compensation_reconciliation(lookup())
    assert copy.copy(token) is token and copy.deepcopy(token) is token
    assert hash(token) == hash(copy.copy(token))
    assert token != authorizer().authorize_compensation_reconciliation(lookup())
    with pytest.raises(TypeError):
        pickle.dumps(token)
    with pytest.raises(TypeError):
        AuthorizedCompensationReconciliation(lookup())
    with pytest.raises(AttributeError):
        token.request = lookup("rc-2")  # type: ignore[misc]
    assert "grant" not in repr(token) and "rc-1" in repr(token)
