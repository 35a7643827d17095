"""SessionAuthorizer scenarios.

Fixtures: ``G`` is the JSON grant ``math.add`` with two calls,
128-byte input and output limits and the ``math-api`` network origin;
``GC = G.with_compensation_limit(1)``.
"""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octo_common.authorizer import (
    AuthorizedInvocation,
    AuthorizedOperationCompensation,
    AuthorizedOperationInvocation,
    AuthorizedOperationReconciliation,
    AuthorizerState,
    CompensationIdentity,
    RetainedRequestId,
    SessionAuthorizer,
)
from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    AuthorizationProvenanceMismatch,
    CallBudgetExhausted,
    CompensationBudgetExhausted,
    CompensationGrantMismatch,
    CompensationNotGranted,
    CompensationResultMismatch,
    DuplicateRequest,
    DuplicateResult,
    InputTooLarge,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidJsonEnvelope,
    InvalidOperationFailure,
    InvalidToken,
    JsonPayloadTooDeep,
    OctoError,
    OperationResultMismatch,
    OutputTooLarge,
    PayloadFormatMismatch,
    RequestMismatch,
    SerializationError,
    SessionRequestLimitExceeded,
    UnknownSession,
    UnknownTool,
    UnsupportedVersion,
)
from octo_common.grants import (
    CapabilityGrant,
    CapabilityManifest,
    ManifestAttenuation,
    ResourceKind,
    ResourceSelector,
)
from octo_common.messages import (
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    ToolInvocation,
    ToolResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, Running, Succeeded
from tests.vectors import vectors_path

VECTORS = vectors_path()

SESSION = "session-1"
TOOL = "math.add"
ECHO = "text.echo"
OP_KEY = "release-42-add"
CMP_KEY = "cmp-release-42-add-undo"
TENANT = "tenant-release"
LIMIT = 1024

ADD = ToolPayload.json({"left": 20, "right": 22})
UNDO = ToolPayload.json({"undo": "release"})
TOTAL = ToolPayload.json({"total": 42})


def grant_g() -> CapabilityGrant:
    return CapabilityGrant(
        TOOL,
        "json",
        max_calls=2,
        max_input_bytes=128,
        max_output_bytes=128,
        resources=(ResourceSelector(ResourceKind("network_origin"), "math-api"),),
    )


def grant_gc(limit: int = 1) -> CapabilityGrant:
    return grant_g().with_compensation_limit(limit)


def echo_grant(max_calls: int = 3) -> CapabilityGrant:
    return CapabilityGrant(ECHO, "text", max_calls=max_calls)


def authorizer(*grants: CapabilityGrant) -> SessionAuthorizer:
    return SessionAuthorizer(CapabilityManifest(SESSION, list(grants or (grant_gc(),))))


def invocation(
    request_id: str, payload: ToolPayload = ADD, *, tool: str = TOOL, session: str = SESSION
) -> ToolInvocation:
    return ToolInvocation(session, request_id, tool, payload)


def dispatch(
    request_id: str,
    payload: ToolPayload = ADD,
    *,
    tool: str = TOOL,
    key: str = OP_KEY,
    session: str = SESSION,
) -> OperationDispatchRequest:
    return OperationDispatchRequest(session, request_id, tool, key, payload)


def reconcile(
    request_id: str, *, tool: str = TOOL, key: str = OP_KEY, session: str = SESSION
) -> OperationReconcileRequest:
    return OperationReconcileRequest(session, request_id, tool, key)


def binding(
    *,
    tool: str = TOOL,
    key: str = OP_KEY,
    cmp_key: str = CMP_KEY,
    tenant: str = TENANT,
    fingerprint: str | None = None,
    grant: CapabilityGrant | None = None,
) -> OperationCompensationBinding:
    if fingerprint is None:
        fingerprint = (grant or grant_gc()).compensation_fingerprint()
    return OperationCompensationBinding(tool, key, cmp_key, tenant, fingerprint)


def compensation(
    request_id: str,
    payload: ToolPayload = UNDO,
    *,
    session: str = SESSION,
    **bind: Any,
) -> OperationCompensationRequest:
    return OperationCompensationRequest(session, request_id, binding(**bind), payload)


def oversized_json(size: int) -> ToolPayload:
    """A JSON payload whose compact encoding is exactly ``size`` bytes."""
    payload = ToolPayload.json({"pad": "x" * (size - len('{"pad":""}'))})
    assert payload.validate_for("json") == size
    return payload


def refused(
    auth: SessionAuthorizer, error: type[OctoError], call: Callable[[], object]
) -> OctoError:
    """Run ``call``, expect ``error`` and check that nothing changed."""
    before = auth.export_state()
    with pytest.raises(error) as info:
        call()
    assert auth.export_state() == before
    return info.value


def fill_request_ids(auth: SessionAuthorizer, prefix: str = "filler") -> None:
    index = 0
    while auth.request_id_count() < LIMIT:
        auth.reserve_request_id(f"{prefix}-{index}")
        index += 1


# Construction -----------------------------------------------------------------


def test_a_fresh_authorizer_reports_zero_and_an_empty_state() -> None:
    auth = authorizer()

    assert auth.manifest == CapabilityManifest(SESSION, [grant_gc()])
    assert auth.calls_for(TOOL) == 0
    assert auth.compensations_for(TOOL) == 0
    assert auth.calls_for("no.such-tool") == 0
    assert auth.export_state() == AuthorizerState({}, {}, (), ())


def test_a_zero_grant_manifest_authorizes_nothing() -> None:
    manifest = CapabilityManifest(SESSION, [grant_g()]).attenuate(
        ManifestAttenuation(allowed_tools=frozenset())
    )
    auth = SessionAuthorizer(manifest)

    error = refused(auth, UnknownTool, lambda: auth.authorize(invocation("invoke-1")))
    assert error.tool == TOOL  # type: ignore[attr-defined]


# authorize / authorize_operation ---------------------------------------


def test_authorize_spends_one_call_and_retains_the_request_id() -> None:
    auth = authorizer()

    token = auth.authorize(invocation("invoke-1"))

    assert isinstance(token, AuthorizedInvocation)
    assert token.request == invocation("invoke-1")
    assert token.grant == grant_gc()
    assert token.request_id == "invoke-1"
    assert auth.calls_for(TOOL) == 1
    assert auth.compensations_for(TOOL) == 0
    assert auth.export_state().request_ids == (RetainedRequestId("invoke-1", False),)


def test_a_refused_scalar_payload_keeps_its_request_id_free_and_the_third_call_is_refused() -> None:
    auth = authorizer()

    refused(
        auth,
        InvalidJsonEnvelope,
        lambda: auth.authorize(invocation("invoke-1", ToolPayload.json(7))),
    )
    auth.authorize(invocation("invoke-1"))
    auth.authorize(invocation("invoke-2"))
    error = refused(auth, CallBudgetExhausted, lambda: auth.authorize(invocation("invoke-3")))

    assert (error.tool, error.maximum) == (TOOL, 2)  # type: ignore[attr-defined]
    assert auth.calls_for(TOOL) == 2


def test_a_payload_deeper_than_32_is_refused() -> None:
    # {} wrapped in 32 arrays.
    value: Any = {}
    for _ in range(32):
        value = [value]
    auth = authorizer(CapabilityGrant(TOOL, "json", max_input_bytes=1024))

    error = refused(
        auth, JsonPayloadTooDeep, lambda: auth.authorize(invocation("i-1", ToolPayload.json(value)))
    )
    assert error.maximum == 32  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", ["authorize", "authorize_operation"])
class TestCallAuthorizationOrder:
    """Each check of a call wins over every later one and changes nothing."""

    def build(self, method: str, request_id: str, payload: ToolPayload = ADD, **kw: Any) -> Any:
        if method == "authorize":
            return invocation(request_id, payload, **kw)
        return dispatch(request_id, payload, **kw)

    def test_unknown_session_comes_before_unknown_tool(self, method: str) -> None:
        auth = authorizer()
        request = self.build(
            method, "r-1", ToolPayload.text("x"), session="session-2", tool="no.tool"
        )

        error = refused(auth, UnknownSession, lambda: getattr(auth, method)(request))
        assert error.session_id == "session-2"  # type: ignore[attr-defined]

    def test_unknown_tool_comes_before_the_payload_check(self, method: str) -> None:
        auth = authorizer()
        request = self.build(method, "r-1", ToolPayload.text("x"), tool="no.tool")

        error = refused(auth, UnknownTool, lambda: getattr(auth, method)(request))
        assert error.tool == "no.tool"  # type: ignore[attr-defined]

    def test_the_payload_must_have_the_grant_format(self, method: str) -> None:
        auth = authorizer()
        request = self.build(method, "r-1", ToolPayload.text("x" * 500))

        error = refused(auth, PayloadFormatMismatch, lambda: getattr(auth, method)(request))
        assert (error.expected, error.actual) == ("json", "text")  # type: ignore[attr-defined]

    def test_input_over_the_limit_is_refused_with_its_size(self, method: str) -> None:
        auth = authorizer()
        getattr(auth, method)(self.build(method, "r-0", oversized_json(128)))  # exactly 128 passes

        error = refused(
            auth,
            InputTooLarge,
            lambda: getattr(auth, method)(self.build(method, "r-1", oversized_json(129))),
        )
        assert (error.actual, error.maximum) == (129, 128)  # type: ignore[attr-defined]

    def test_input_size_comes_before_duplicate_request(self, method: str) -> None:
        auth = authorizer()
        getattr(auth, method)(self.build(method, "r-1"))

        refused(
            auth,
            InputTooLarge,
            lambda: getattr(auth, method)(self.build(method, "r-1", oversized_json(129))),
        )

    def test_duplicate_request_comes_before_the_call_budget(self, method: str) -> None:
        auth = authorizer()
        getattr(auth, method)(self.build(method, "r-1"))
        getattr(auth, method)(self.build(method, "r-2"))

        error = refused(
            auth, DuplicateRequest, lambda: getattr(auth, method)(self.build(method, "r-1"))
        )
        assert error.request_id == "r-1"  # type: ignore[attr-defined]
        refused(auth, CallBudgetExhausted, lambda: getattr(auth, method)(self.build(method, "r-3")))

    def test_the_call_budget_comes_before_the_request_limit(self, method: str) -> None:
        auth = authorizer()
        getattr(auth, method)(self.build(method, "r-1"))
        getattr(auth, method)(self.build(method, "r-2"))
        fill_request_ids(auth)

        refused(auth, CallBudgetExhausted, lambda: getattr(auth, method)(self.build(method, "r-3")))

    def test_the_request_limit_spends_nothing(self, method: str) -> None:
        auth = authorizer()
        fill_request_ids(auth)

        error = refused(
            auth,
            SessionRequestLimitExceeded,
            lambda: getattr(auth, method)(self.build(method, "r-1")),
        )
        assert error.maximum == LIMIT  # type: ignore[attr-defined]
        assert auth.calls_for(TOOL) == 0


def test_invoke_and_dispatch_share_one_call_budget() -> None:
    auth = authorizer()
    auth.authorize(invocation("invoke-1"))
    token = auth.authorize_operation(dispatch("dispatch-1"))

    assert isinstance(token, AuthorizedOperationInvocation)
    assert token.request == dispatch("dispatch-1")
    refused(auth, CallBudgetExhausted, lambda: auth.authorize_operation(dispatch("dispatch-2")))
    refused(auth, CallBudgetExhausted, lambda: auth.authorize(invocation("invoke-2")))


def test_each_tool_has_its_own_call_budget() -> None:
    auth = authorizer(grant_g(), echo_grant(max_calls=1))
    auth.authorize(invocation("e-1", ToolPayload.text("hello"), tool=ECHO))

    refused(
        auth,
        CallBudgetExhausted,
        lambda: auth.authorize(invocation("e-2", ToolPayload.text("x"), tool=ECHO)),
    )
    auth.authorize(invocation("m-1"))
    assert (auth.calls_for(ECHO), auth.calls_for(TOOL)) == (1, 1)


def test_a_text_payload_is_measured_in_utf8_bytes() -> None:
    auth = authorizer(CapabilityGrant(ECHO, "text", max_calls=2, max_input_bytes=4))
    auth.authorize(invocation("e-1", ToolPayload.text("éé"), tool=ECHO))

    error = refused(
        auth,
        InputTooLarge,
        lambda: auth.authorize(invocation("e-2", ToolPayload.text("ééé"), tool=ECHO)),
    )
    assert (error.actual, error.maximum) == (6, 4)  # type: ignore[attr-defined]


# reserve_request_id --------------------------------------------------------------


def test_reserve_request_id_reports_a_duplicate_before_the_limit() -> None:
    auth = authorizer()
    fill_request_ids(auth)

    refused(auth, DuplicateRequest, lambda: auth.reserve_request_id("filler-0"))
    error = refused(auth, SessionRequestLimitExceeded, lambda: auth.reserve_request_id("fresh"))
    assert error.maximum == LIMIT  # type: ignore[attr-defined]
    assert len(auth.export_state().request_ids) == LIMIT


def test_reserve_request_id_requires_a_token() -> None:
    auth = authorizer()

    error = refused(auth, InvalidToken, lambda: auth.reserve_request_id("Not A Token"))
    assert error.field == "request id"  # type: ignore[attr-defined]


# authorize_reconciliation --------------------------------------------------


def test_reconciliation_spends_a_request_id_but_no_call() -> None:
    auth = authorizer()
    auth.authorize(invocation("i-1"))
    auth.authorize(invocation("i-2"))

    token = auth.authorize_reconciliation(reconcile("rec-1"))

    assert isinstance(token, AuthorizedOperationReconciliation)
    assert (token.request, token.grant, token.request_id) == (
        reconcile("rec-1"),
        grant_gc(),
        "rec-1",
    )
    assert auth.calls_for(TOOL) == 2
    assert [r.request_id for r in auth.export_state().request_ids] == ["i-1", "i-2", "rec-1"]


def test_reconciliation_check_order() -> None:
    auth = authorizer()
    auth.authorize_reconciliation(reconcile("rec-1"))

    refused(
        auth,
        UnknownSession,
        lambda: auth.authorize_reconciliation(
            reconcile("rec-1", session="session-2", tool="no.tool")
        ),
    )
    refused(
        auth, UnknownTool, lambda: auth.authorize_reconciliation(reconcile("rec-1", tool="no.tool"))
    )
    refused(auth, DuplicateRequest, lambda: auth.authorize_reconciliation(reconcile("rec-1")))
    fill_request_ids(auth)
    refused(auth, DuplicateRequest, lambda: auth.authorize_reconciliation(reconcile("rec-1")))
    refused(
        auth, SessionRequestLimitExceeded, lambda: auth.authorize_reconciliation(reconcile("rec-2"))
    )


# authorize_compensation ----------------------------------------------------


def test_compensation_budget_follows_identities() -> None:
    auth = authorizer()

    first = auth.authorize_compensation(compensation("cmp-req-1"))
    assert isinstance(first, AuthorizedOperationCompensation)
    assert auth.compensations_for(TOOL) == 1

    retransmission = auth.authorize_compensation(compensation("cmp-req-2"))
    assert retransmission.request_id == "cmp-req-2"
    assert auth.compensations_for(TOOL) == 1
    assert len(auth.export_state().compensation_identities) == 1

    error = refused(
        auth,
        CompensationBudgetExhausted,
        lambda: auth.authorize_compensation(compensation("cmp-req-3", cmp_key="cmp-other")),
    )
    assert (error.tool, error.maximum) == (TOOL, 1)  # type: ignore[attr-defined]
    assert auth.calls_for(TOOL) == 0


def test_a_changed_grant_fingerprint_is_a_mismatch() -> None:
    # A grant whose max_output_bytes changed.
    auth = authorizer()
    changed = CapabilityGrant(
        TOOL,
        "json",
        max_calls=2,
        max_input_bytes=128,
        max_output_bytes=129,
        max_compensations=1,
        resources=(ResourceSelector(ResourceKind("network_origin"), "math-api"),),
    )

    refused(
        auth,
        CompensationGrantMismatch,
        lambda: auth.authorize_compensation(compensation("c-1", grant=changed)),
    )


def test_compensation_under_a_grant_without_budget_is_not_granted() -> None:
    # Under G; checked before the fingerprint.
    auth = authorizer(grant_g())

    error = refused(
        auth,
        CompensationNotGranted,
        lambda: auth.authorize_compensation(compensation("c-1", grant=grant_gc())),
    )
    assert error.tool == TOOL  # type: ignore[attr-defined]


def test_the_grant_fingerprint_is_the_vector_fingerprint_of_the_active_grant() -> None:
    if not VECTORS.exists():
        pytest.skip(f"reference vectors absent at {VECTORS}")
    vectors = json.loads(VECTORS.read_text())
    default_text = next(v for v in vectors["grant_fingerprints"] if v["id"] == "grant-text-default")
    # The vector is the fingerprint of CapabilityGrant.text("text.echo") with no compensation
    # budget; granting one compensation changes the fingerprint.
    auth = authorizer(CapabilityGrant.text(ECHO).with_compensation_limit(1))
    request = compensation(
        "c-1", ToolPayload.text("undo"), tool=ECHO, fingerprint=default_text["fingerprint"]
    )

    refused(auth, CompensationGrantMismatch, lambda: auth.authorize_compensation(request))


def test_the_identity_records_the_vector_input_fingerprint() -> None:
    if not VECTORS.exists():
        pytest.skip(f"reference vectors absent at {VECTORS}")
    vectors = json.loads(VECTORS.read_text())
    case = next(v for v in vectors["canonical_inputs"] if v["id"] == "text-unicode")
    grant = CapabilityGrant.text(ECHO).with_compensation_limit(1)
    auth = authorizer(grant)

    token = auth.authorize_compensation(
        compensation("c-1", ToolPayload.text(case["input"]), tool=ECHO, grant=grant)
    )

    expected = CompensationIdentity(
        ECHO,
        OP_KEY,
        CMP_KEY,
        TENANT,
        grant.compensation_fingerprint(),
        case["worker_input_fingerprint"],
    )
    assert token.identity == expected
    assert auth.export_state().compensation_identities == (expected,)


@pytest.mark.parametrize(
    ("variant", "payload"),
    [
        ({"cmp_key": "cmp-another-key"}, UNDO),
        ({"tenant": "tenant-other"}, UNDO),
        ({"key": "release-43-add"}, UNDO),
        ({}, ToolPayload.json({"undo": "release", "again": True})),
    ],
    ids=["compensation-key", "tenant", "operation-key", "input"],
)
def test_every_different_identity_needs_budget(
    variant: dict[str, str], payload: ToolPayload
) -> None:
    # Two compensations, so the second identity fits and the third does not.
    auth = authorizer(grant_gc(2))
    fingerprint = grant_gc(2).compensation_fingerprint()
    auth.authorize_compensation(compensation("c-1", fingerprint=fingerprint))

    auth.authorize_compensation(compensation("c-2", payload, fingerprint=fingerprint, **variant))

    assert auth.compensations_for(TOOL) == 2
    assert len(auth.export_state().compensation_identities) == 2
    refused(
        auth,
        CompensationBudgetExhausted,
        lambda: auth.authorize_compensation(
            compensation("c-3", fingerprint=fingerprint, cmp_key="cmp-third")
        ),
    )
    # Both admitted identities stay free to retransmit.
    auth.authorize_compensation(compensation("c-4", payload, fingerprint=fingerprint, **variant))
    auth.authorize_compensation(compensation("c-5", fingerprint=fingerprint))
    assert auth.compensations_for(TOOL) == 2


def test_compensation_never_spends_or_needs_the_call_budget() -> None:
    auth = authorizer()
    auth.authorize(invocation("i-1"))
    auth.authorize(invocation("i-2"))

    auth.authorize_compensation(compensation("c-1"))

    assert (auth.calls_for(TOOL), auth.compensations_for(TOOL)) == (2, 1)


def test_compensation_check_order() -> None:
    auth = authorizer()
    auth.authorize_compensation(compensation("c-1"))
    too_large = oversized_json(129)

    refused(
        auth,
        UnknownSession,
        lambda: auth.authorize_compensation(
            compensation("c-2", session="session-2", tool="no.tool")
        ),
    )
    refused(
        auth,
        UnknownTool,
        lambda: auth.authorize_compensation(
            compensation("c-2", tool="no.tool", fingerprint="0" * 64)
        ),
    )
    refused(
        auth,
        CompensationGrantMismatch,
        lambda: auth.authorize_compensation(compensation("c-2", too_large, fingerprint="0" * 64)),
    )
    refused(
        auth,
        PayloadFormatMismatch,
        lambda: auth.authorize_compensation(compensation("c-1", ToolPayload.text("undo"))),
    )
    refused(
        auth, InputTooLarge, lambda: auth.authorize_compensation(compensation("c-1", too_large))
    )
    # A retained id is reported before the exhausted budget.
    refused(
        auth,
        DuplicateRequest,
        lambda: auth.authorize_compensation(compensation("c-1", cmp_key="cmp-x")),
    )
    fill_request_ids(auth)
    # The budget is checked before the request limit.
    refused(
        auth,
        CompensationBudgetExhausted,
        lambda: auth.authorize_compensation(compensation("c-2", cmp_key="cmp-x")),
    )
    refused(
        auth, SessionRequestLimitExceeded, lambda: auth.authorize_compensation(compensation("c-2"))
    )
    assert auth.compensations_for(TOOL) == 1


# Header validation comes first; the payload is checked at its own place in the order ----


def unvalidated(value: Any, **changes: Any) -> Any:
    """A copy with ``changes`` that skips construction-time validation (as a bug would)."""
    return msgspec.structs.replace(value, **changes)


def test_header_validation_precedes_the_session_check() -> None:
    auth = authorizer()
    cases: list[tuple[type[OctoError], Callable[[], object]]] = [
        (
            InvalidToken,
            partial(
                auth.authorize,
                unvalidated(invocation("i-1", session="session-2"), request_id="Bad Id"),
            ),
        ),
        (
            UnsupportedVersion,
            partial(
                auth.authorize_operation,
                unvalidated(dispatch("d-1", session="session-2"), protocol_version=4),
            ),
        ),
        (
            InvalidToken,
            partial(
                auth.authorize_reconciliation,
                unvalidated(reconcile("r-1", session="session-2"), operation_key="Bad Key"),
            ),
        ),
        (
            InvalidCompensationKey,
            partial(
                auth.authorize_compensation,
                unvalidated(compensation("c-1", session="session-2"), compensation_key="undo"),
            ),
        ),
        (
            InvalidCompensationGrantFingerprint,
            partial(
                auth.authorize_compensation,
                unvalidated(compensation("c-1", session="session-2"), grant_fingerprint="F" * 64),
            ),
        ),
    ]

    for error, call in cases:
        refused(auth, error, call)


def test_the_payload_is_checked_only_after_session_tool_and_grant() -> None:
    auth = authorizer()
    scalar = ToolPayload.json(3)

    refused(
        auth,
        UnknownSession,
        partial(auth.authorize, invocation("i-1", scalar, session="session-2")),
    )
    refused(
        auth,
        UnknownTool,
        partial(
            auth.authorize_operation, unvalidated(dispatch("d-1", tool="no.tool"), payload=scalar)
        ),
    )
    refused(
        auth,
        UnknownSession,
        partial(
            auth.authorize_compensation,
            unvalidated(compensation("c-1", session="session-2"), payload=scalar),
        ),
    )
    refused(
        auth,
        CompensationGrantMismatch,
        partial(
            auth.authorize_compensation,
            unvalidated(compensation("c-1", fingerprint="0" * 64), payload=scalar),
        ),
    )
    refused(
        auth,
        InvalidJsonEnvelope,
        partial(auth.authorize_compensation, unvalidated(compensation("c-1"), payload=scalar)),
    )
    refused(
        auth,
        InvalidJsonEnvelope,
        partial(auth.authorize_operation, unvalidated(dispatch("d-1"), payload=scalar)),
    )


def test_validators_check_provenance_then_the_result_then_the_session() -> None:
    auth, other = authorizer(), authorizer()
    token = auth.authorize_operation(dispatch("d-1"))
    foreign = other.authorize_operation(dispatch("d-1"))
    # Wrong session, wrong request id and an empty failure message at once.
    broken = unvalidated(
        OperationReconcileResult("session-2", "d-2", TOOL, OP_KEY, Running()),
        status=unvalidated(Failed("x"), message=""),
    )

    refused(
        auth,
        AuthorizationProvenanceMismatch,
        partial(auth.validate_operation_result, foreign, broken),
    )
    refused(auth, InvalidOperationFailure, partial(auth.validate_operation_result, token, broken))
    refused(
        auth,
        UnknownSession,
        partial(auth.validate_operation_result, token, unvalidated(broken, status=Running())),
    )
    invoke_token = authorizer().authorize(invocation("i-1"))
    refused(
        auth,
        AuthorizationProvenanceMismatch,
        partial(
            auth.validate_result,
            invoke_token,
            unvalidated(ToolResult(SESSION, "i-1", TOTAL), request_id="Bad"),
        ),
    )


# Request-id capacity ---------------------------------------------


def test_at_capacity_every_authorization_is_refused_and_every_validator_still_works() -> None:
    auth = authorizer(grant_gc(2), echo_grant())
    invoke_token = auth.authorize(invocation("invoke-1", ToolPayload.text("hi"), tool=ECHO))
    dispatch_token = auth.authorize_operation(dispatch("dispatch-1"))
    reconcile_token = auth.authorize_reconciliation(reconcile("reconcile-1"))
    fingerprint = grant_gc(2).compensation_fingerprint()
    compensation_token = auth.authorize_compensation(
        compensation("compensate-1", fingerprint=fingerprint)
    )
    fill_request_ids(auth)

    for call in (
        lambda: auth.authorize(invocation("e-1", ToolPayload.text("x"), tool=ECHO)),
        lambda: auth.authorize_operation(dispatch("d-2", key="op-2")),
        lambda: auth.authorize_reconciliation(reconcile("r-2")),
        lambda: auth.authorize_compensation(
            compensation("c-2", fingerprint=fingerprint, cmp_key="cmp-2")
        ),
        lambda: auth.authorize_compensation(compensation("c-3", fingerprint=fingerprint)),
    ):
        refused(auth, SessionRequestLimitExceeded, call)
    for call in (
        lambda: auth.authorize(invocation("invoke-1", ToolPayload.text("x"), tool=ECHO)),
        lambda: auth.authorize_operation(dispatch("filler-7")),
        lambda: auth.authorize_reconciliation(reconcile("dispatch-1")),
        lambda: auth.authorize_compensation(compensation("reconcile-1", fingerprint=fingerprint)),
    ):
        refused(auth, DuplicateRequest, call)
    assert (auth.calls_for(TOOL), auth.calls_for(ECHO), auth.compensations_for(TOOL)) == (1, 1, 1)

    auth.validate_result(invoke_token, ToolResult(SESSION, "invoke-1", ToolPayload.text("done")))
    auth.validate_operation_result(
        dispatch_token,
        OperationReconcileResult(SESSION, "dispatch-1", TOOL, OP_KEY, Succeeded(TOTAL)),
    )
    auth.validate_reconciliation_result(
        reconcile_token, OperationReconcileResult(SESSION, "reconcile-1", TOOL, OP_KEY, Running())
    )
    auth.validate_compensation_result(
        compensation_token,
        OperationCompensationResult(
            SESSION, "compensate-1", binding(fingerprint=fingerprint), Cancelled()
        ),
    )

    state = auth.export_state()
    assert len(state.request_ids) == LIMIT
    completed = {r.request_id for r in state.request_ids if r.completed}
    assert completed == {"invoke-1", "dispatch-1", "reconcile-1", "compensate-1"}


# Result validators ---------------------------------------------------------


def test_validate_result_marks_the_request_completed_once() -> None:
    auth = authorizer()
    token = auth.authorize(invocation("invoke-1"))

    auth.validate_result(token, ToolResult(SESSION, "invoke-1", TOTAL))

    assert auth.export_state().request_ids == (RetainedRequestId("invoke-1", True),)
    error = refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_result(token, ToolResult(SESSION, "invoke-1", TOTAL)),
    )
    assert error.request_id == "invoke-1"  # type: ignore[attr-defined]


def test_validate_result_check_order() -> None:
    auth = authorizer()
    token = auth.authorize(invocation("invoke-1"))
    too_large = oversized_json(129)

    refused(
        auth,
        UnknownSession,
        lambda: auth.validate_result(token, ToolResult("session-2", "other", too_large)),
    )
    error = refused(
        auth,
        RequestMismatch,
        lambda: auth.validate_result(token, ToolResult(SESSION, "other", too_large)),
    )
    assert (error.expected, error.actual) == ("invoke-1", "other")  # type: ignore[attr-defined]
    refused(
        auth,
        PayloadFormatMismatch,
        lambda: auth.validate_result(token, ToolResult(SESSION, "invoke-1", ToolPayload.text("x"))),
    )
    error = refused(
        auth,
        OutputTooLarge,
        lambda: auth.validate_result(token, ToolResult(SESSION, "invoke-1", too_large)),
    )
    assert (error.actual, error.maximum) == (129, 128)  # type: ignore[attr-defined]

    # None of the refusals completed the request.
    auth.validate_result(token, ToolResult(SESSION, "invoke-1", oversized_json(128)))
    refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_result(token, ToolResult(SESSION, "invoke-1", too_large)),
    )


def test_validate_operation_result_matches_the_dispatch() -> None:
    auth = authorizer()
    token = auth.authorize_operation(dispatch("dispatch-1"))

    for result in (
        OperationReconcileResult(SESSION, "dispatch-2", TOOL, OP_KEY, Running()),
        OperationReconcileResult(SESSION, "dispatch-1", TOOL, "op-other", Running()),
        OperationReconcileResult(SESSION, "dispatch-1", ECHO, OP_KEY, Running()),
    ):
        refused(
            auth, OperationResultMismatch, partial(auth.validate_operation_result, token, result)
        )
    refused(
        auth,
        UnknownSession,
        lambda: auth.validate_operation_result(
            token, OperationReconcileResult("session-2", "dispatch-2", TOOL, OP_KEY, Running())
        ),
    )
    refused(
        auth,
        OutputTooLarge,
        lambda: auth.validate_operation_result(
            token,
            OperationReconcileResult(
                SESSION, "dispatch-1", TOOL, OP_KEY, Succeeded(oversized_json(129))
            ),
        ),
    )
    refused(
        auth,
        PayloadFormatMismatch,
        lambda: auth.validate_operation_result(
            token,
            OperationReconcileResult(
                SESSION, "dispatch-1", TOOL, OP_KEY, Succeeded(ToolPayload.text("ok"))
            ),
        ),
    )

    auth.validate_operation_result(
        token, OperationReconcileResult(SESSION, "dispatch-1", TOOL, OP_KEY, Failed("boom"))
    )
    refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_operation_result(
            token,
            OperationReconcileResult(
                SESSION, "dispatch-1", TOOL, OP_KEY, Succeeded(oversized_json(129))
            ),
        ),
    )


def test_validate_reconciliation_result_matches_the_request() -> None:
    auth = authorizer()
    token = auth.authorize_reconciliation(reconcile("rec-1"))

    refused(
        auth,
        OperationResultMismatch,
        lambda: auth.validate_reconciliation_result(
            token, OperationReconcileResult(SESSION, "rec-1", TOOL, "op-other", Running())
        ),
    )
    refused(
        auth,
        OutputTooLarge,
        lambda: auth.validate_reconciliation_result(
            token,
            OperationReconcileResult(
                SESSION, "rec-1", TOOL, OP_KEY, Succeeded(oversized_json(129))
            ),
        ),
    )
    auth.validate_reconciliation_result(
        token, OperationReconcileResult(SESSION, "rec-1", TOOL, OP_KEY, Succeeded(TOTAL))
    )
    refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_reconciliation_result(
            token, OperationReconcileResult(SESSION, "rec-1", TOOL, OP_KEY, Succeeded(TOTAL))
        ),
    )


@pytest.mark.parametrize(
    "variant",
    [
        {"cmp_key": "cmp-other"},
        {"tenant": "tenant-other"},
        {"fingerprint": "0" * 64},
        {"key": "op-other"},
    ],
    ids=["compensation-key", "tenant", "fingerprint", "operation-key"],
)
def test_validate_compensation_result_matches_every_binding_field(variant: dict[str, Any]) -> None:
    auth = authorizer()
    token = auth.authorize_compensation(compensation("c-1"))

    refused(
        auth,
        CompensationResultMismatch,
        lambda: auth.validate_compensation_result(
            token, OperationCompensationResult(SESSION, "c-1", binding(**variant), Running())
        ),
    )
    auth.validate_compensation_result(
        token, OperationCompensationResult(SESSION, "c-1", binding(), Succeeded(TOTAL))
    )
    refused(
        auth,
        DuplicateResult,
        lambda: auth.validate_compensation_result(
            token, OperationCompensationResult(SESSION, "c-1", binding(), Succeeded(TOTAL))
        ),
    )


def test_validators_never_reserve_request_ids() -> None:
    auth = authorizer()
    token = auth.authorize_operation(dispatch("dispatch-1"))
    before = len(auth.export_state().request_ids)

    auth.validate_operation_result(
        token, OperationReconcileResult(SESSION, "dispatch-1", TOOL, OP_KEY, Running())
    )

    assert len(auth.export_state().request_ids) == before


# Provenance and tokens ----------------------------------------------------------


def test_a_token_of_another_instance_is_refused_first() -> None:
    first, second = authorizer(), authorizer()
    token = first.authorize(invocation("invoke-1"))
    second.authorize(invocation("invoke-1"))

    # Even a result that would fail every later check reports provenance.
    refused(
        second,
        AuthorizationProvenanceMismatch,
        lambda: second.validate_result(
            token, ToolResult("session-2", "other", ToolPayload.text("x"))
        ),
    )
    refused(
        second,
        AuthorizationProvenanceMismatch,
        lambda: second.validate_result(token, ToolResult(SESSION, "invoke-1", TOTAL)),
    )
    first.validate_result(token, ToolResult(SESSION, "invoke-1", TOTAL))


def test_a_restored_authorizer_refuses_the_tokens_of_the_original() -> None:
    auth = authorizer()
    tokens: list[tuple[str, Any, Any]] = [
        (
            "validate_result",
            auth.authorize(invocation("invoke-1")),
            ToolResult(SESSION, "invoke-1", TOTAL),
        ),
        (
            "validate_operation_result",
            auth.authorize_operation(dispatch("dispatch-1")),
            OperationReconcileResult(SESSION, "dispatch-1", TOOL, OP_KEY, Running()),
        ),
        (
            "validate_reconciliation_result",
            auth.authorize_reconciliation(reconcile("reconcile-1")),
            OperationReconcileResult(SESSION, "reconcile-1", TOOL, OP_KEY, Running()),
        ),
        (
            "validate_compensation_result",
            auth.authorize_compensation(compensation("compensate-1")),
            OperationCompensationResult(SESSION, "compensate-1", binding(), Running()),
        ),
    ]
    restored = SessionAuthorizer.restore(auth.manifest, auth.export_state())

    for method, token, result in tokens:
        refused(
            restored,
            AuthorizationProvenanceMismatch,
            partial(getattr(restored, method), token, result),
        )
    for method, token, result in tokens:
        getattr(auth, method)(token, result)


def test_tokens_compare_by_content_and_provenance() -> None:
    first, second = authorizer(), authorizer()
    token = first.authorize(invocation("invoke-1"))
    twin = second.authorize(invocation("invoke-1"))

    assert token == copy.copy(token)
    assert token == copy.deepcopy(token)
    assert hash(token) == hash(copy.copy(token))
    assert token != twin
    assert {token, copy.copy(token), twin} == {token, twin}
    assert token != first.authorize(invocation("invoke-2"))
    # A copy keeps the provenance, so its issuer accepts it.
    first.validate_result(copy.copy(token), ToolResult(SESSION, "invoke-1", TOTAL))


def test_tokens_of_different_kinds_are_never_equal() -> None:
    auth = authorizer()
    operation = auth.authorize_operation(dispatch("d-1"))
    reconciliation = auth.authorize_reconciliation(reconcile("r-1"))

    assert operation != reconciliation
    assert operation != operation.request


def test_tokens_cannot_be_pickled_forged_or_changed() -> None:
    auth = authorizer()
    token = auth.authorize(invocation("invoke-1"))

    with pytest.raises(TypeError):
        pickle.dumps(token)
    with pytest.raises(TypeError):
        token.__reduce__()
    with pytest.raises(TypeError):
        AuthorizedInvocation(invocation("invoke-1"), grant_gc())
    with pytest.raises(AttributeError):
        token._request = invocation("invoke-2")
    assert "left" not in repr(token) and "invoke-1" in repr(token)


def test_a_dispatch_token_computes_its_input_fingerprint_once() -> None:
    from octo_common.digest import worker_input_fingerprint

    auth = authorizer()
    token = auth.authorize_operation(dispatch("d-1"))
    other = authorizer().authorize_operation(dispatch("d-1"))

    fingerprint = token.input_fingerprint
    assert fingerprint == worker_input_fingerprint(ADD)
    assert token.input_fingerprint is fingerprint
    assert copy.copy(token) is token and copy.copy(token).input_fingerprint is fingerprint
    # Remembering it changes neither equality nor immutability.
    assert token != other and token == copy.deepcopy(token)
    with pytest.raises(AttributeError):
        token._input_fingerprint = "0" * 64
    with pytest.raises(TypeError):
        pickle.dumps(token)


def test_a_token_of_the_wrong_kind_is_a_programming_error() -> None:
    auth = authorizer()
    token = auth.authorize_reconciliation(reconcile("r-1"))

    with pytest.raises(TypeError):
        auth.validate_operation_result(
            token,  # type: ignore[arg-type]
            OperationReconcileResult(SESSION, "r-1", TOOL, OP_KEY, Running()),
        )


# export_state / restore ------------------------------------------------------------


def busy_authorizer() -> SessionAuthorizer:
    auth = authorizer(grant_gc(2), echo_grant())
    auth.authorize(invocation("e-1", ToolPayload.text("hi"), tool=ECHO))
    token = auth.authorize_operation(dispatch("d-1"))
    auth.validate_operation_result(
        token, OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Running())
    )
    auth.authorize_reconciliation(reconcile("r-1"))
    fingerprint = grant_gc(2).compensation_fingerprint()
    auth.authorize_compensation(compensation("c-1", fingerprint=fingerprint, cmp_key="cmp-b"))
    auth.authorize_compensation(compensation("c-2", fingerprint=fingerprint, cmp_key="cmp-a"))
    auth.authorize_compensation(compensation("c-3", fingerprint=fingerprint, cmp_key="cmp-b"))
    auth.reserve_request_id("reserved-1")
    return auth


def test_export_state_is_canonical_and_encodable() -> None:
    state = busy_authorizer().export_state()

    assert state.calls_by_tool == {ECHO: 1, TOOL: 1}
    assert state.compensations_by_tool == {TOOL: 2}
    assert [i.compensation_key for i in state.compensation_identities] == ["cmp-a", "cmp-b"]
    assert state.request_ids == (
        RetainedRequestId("e-1", False),
        RetainedRequestId("d-1", True),
        RetainedRequestId("r-1", False),
        RetainedRequestId("c-1", False),
        RetainedRequestId("c-2", False),
        RetainedRequestId("c-3", False),
        RetainedRequestId("reserved-1", False),
    )
    encoded = msgspec.json.encode(state)
    assert msgspec.json.decode(encoded, type=AuthorizerState) == state


def test_export_state_follows_every_mutation_and_earlier_exports_never_change() -> None:
    auth = authorizer(grant_gc(2), echo_grant())
    first = auth.export_state()
    assert auth.export_state() == first == AuthorizerState({}, {}, (), ())

    token = auth.authorize_operation(dispatch("d-1"))
    second = auth.export_state()
    assert second == AuthorizerState({TOOL: 1}, {}, (), (RetainedRequestId("d-1", False),))
    assert first == AuthorizerState({}, {}, (), ())

    auth.validate_operation_result(
        token, OperationReconcileResult(SESSION, "d-1", TOOL, OP_KEY, Running())
    )
    third = auth.export_state()
    assert third.request_ids == (RetainedRequestId("d-1", True),)
    assert second.request_ids == (RetainedRequestId("d-1", False),)

    fingerprint = grant_gc(2).compensation_fingerprint()
    auth.authorize_compensation(compensation("c-1", fingerprint=fingerprint))
    auth.authorize_reconciliation(reconcile("r-1"))
    auth.reserve_request_id("reserved-1")
    fourth = auth.export_state()
    assert fourth.compensations_by_tool == {TOOL: 1}
    assert len(fourth.compensation_identities) == 1
    assert [r.request_id for r in fourth.request_ids] == ["d-1", "c-1", "r-1", "reserved-1"]
    assert third.compensations_by_tool == {}

    # A caller that changes its export's maps changes neither the authorizer
    # nor any later export.
    fourth.calls_by_tool[TOOL] = 99
    fourth.compensations_by_tool.clear()
    fifth = auth.export_state()
    assert fifth.calls_by_tool == {TOOL: 1}
    assert fifth.compensations_by_tool == {TOOL: 1}
    assert auth.calls_for(TOOL) == 1
    restored = SessionAuthorizer.restore(auth.manifest, fifth)
    assert restored.export_state() == fifth


def test_restore_rebuilds_an_equal_authorizer_that_keeps_its_budgets() -> None:
    original = busy_authorizer()
    state = msgspec.json.decode(msgspec.json.encode(original.export_state()), type=AuthorizerState)

    restored = SessionAuthorizer.restore(original.manifest, state)

    assert restored is not original
    assert restored.export_state() == original.export_state()
    assert restored.manifest == original.manifest
    fingerprint = grant_gc(2).compensation_fingerprint()
    refused(restored, DuplicateRequest, lambda: restored.authorize_reconciliation(reconcile("d-1")))
    refused(
        restored,
        CompensationBudgetExhausted,
        lambda: restored.authorize_compensation(
            compensation("c-9", fingerprint=fingerprint, cmp_key="cmp-c")
        ),
    )
    # An identity admitted before the restart is still free to retransmit.
    restored.authorize_compensation(compensation("c-9", fingerprint=fingerprint, cmp_key="cmp-a"))
    restored.authorize(invocation("e-2", ToolPayload.text("again"), tool=ECHO))
    assert (
        restored.calls_for(ECHO),
        restored.calls_for(TOOL),
        restored.compensations_for(TOOL),
    ) == (2, 1, 2)


def test_restore_validates_the_manifest() -> None:
    manifest = msgspec.structs.replace(CapabilityManifest(SESSION, [grant_g()]), protocol_version=4)

    with pytest.raises(OctoError) as info:
        SessionAuthorizer.restore(manifest, make_state())
    assert info.value.code == "unsupported_version"
    with pytest.raises(OctoError):
        SessionAuthorizer(manifest)


def rid(request_id: str, completed: Any = False) -> RetainedRequestId:
    return RetainedRequestId(request_id, completed)


def make_state(
    *,
    calls_by_tool: dict[str, Any] | None = None,
    compensations_by_tool: dict[str, Any] | None = None,
    compensation_identities: tuple[CompensationIdentity, ...] = (),
    request_ids: tuple[RetainedRequestId, ...] = (),
) -> AuthorizerState:
    return AuthorizerState(
        calls_by_tool or {}, compensations_by_tool or {}, compensation_identities, request_ids
    )


def _identity(tool: str = TOOL, **changes: str) -> CompensationIdentity:
    fields = {
        "tool": tool,
        "operation_key": OP_KEY,
        "compensation_key": CMP_KEY,
        "tenant_scope": TENANT,
        "grant_fingerprint": grant_gc().compensation_fingerprint(),
        "input_fingerprint": "a" * 64,
    }
    fields.update(changes)
    return CompensationIdentity(**fields)


BAD_STATES: dict[str, AuthorizerState] = {
    "unknown tool in calls": make_state(calls_by_tool={"no.tool": 1}, request_ids=(rid("a"),)),
    "calls over the grant": make_state(
        calls_by_tool={TOOL: 3}, request_ids=tuple(rid(f"r-{i}") for i in range(3))
    ),
    "boolean counter": make_state(calls_by_tool={TOOL: True}, request_ids=(rid("a"),)),
    "negative counter": make_state(calls_by_tool={TOOL: -1}),
    "compensations over the grant": make_state(
        compensations_by_tool={TOOL: 2},
        compensation_identities=(_identity(), _identity(compensation_key="cmp-2")),
        request_ids=(rid("a"), rid("b")),
    ),
    "identities without budget": make_state(
        compensation_identities=(_identity(),), request_ids=(rid("a"),)
    ),
    "budget without identities": make_state(
        compensations_by_tool={TOOL: 1}, request_ids=(rid("a"),)
    ),
    "repeated identity": make_state(
        compensations_by_tool={TOOL: 1},
        compensation_identities=(_identity(), _identity()),
        request_ids=(rid("a"), rid("b")),
    ),
    "identity with a bad fingerprint": make_state(
        compensations_by_tool={TOOL: 1},
        compensation_identities=(_identity(input_fingerprint="A" * 64),),
        request_ids=(rid("a"),),
    ),
    "identity without cmp- key": make_state(
        compensations_by_tool={TOOL: 1},
        compensation_identities=(_identity(compensation_key="undo"),),
        request_ids=(rid("a"),),
    ),
    "identity of an unknown tool": make_state(
        compensation_identities=(_identity(tool="no.tool"),), request_ids=(rid("a"),)
    ),
    "more spent than retained": make_state(calls_by_tool={TOOL: 2}, request_ids=(rid("a"),)),
    "too many request ids": make_state(request_ids=tuple(rid(f"r-{i}") for i in range(LIMIT + 1))),
    "duplicate request id": make_state(request_ids=(rid("a"), rid("a", True))),
    "request id not a token": make_state(request_ids=(rid("Not A Token"),)),
    "completed flag not a boolean": make_state(request_ids=(rid("a", 1),)),
}


@pytest.mark.parametrize("name", list(BAD_STATES))
def test_restore_refuses_an_impossible_state(name: str) -> None:
    manifest = CapabilityManifest(SESSION, [grant_gc()])

    with pytest.raises(SerializationError):
        SessionAuthorizer.restore(manifest, BAD_STATES[name])


def test_restore_accepts_exactly_1024_request_ids() -> None:
    state = make_state(request_ids=tuple(rid(f"r-{i}") for i in range(LIMIT)))

    restored = SessionAuthorizer.restore(CapabilityManifest(SESSION, [grant_gc()]), state)

    assert restored.export_state() == state
    refused(restored, SessionRequestLimitExceeded, lambda: restored.reserve_request_id("one-more"))


def test_the_state_round_trips_through_the_strict_codec() -> None:
    state = busy_authorizer().export_state()

    assert decode_struct(encode_struct(state), AuthorizerState) == state


@pytest.mark.parametrize(
    "document",
    [
        b'{"calls_by_tool":{},"compensations_by_tool":{},"compensation_identities":[],'
        b'"request_ids":[],"extra":1}',
        b'{"calls_by_tool":{},"compensations_by_tool":{},"compensation_identities":[]}',
        b'{"calls_by_tool":{"math.add":true},"compensations_by_tool":{},'
        b'"compensation_identities":[],"request_ids":[]}',
        b'{"calls_by_tool":{},"compensations_by_tool":{},"compensation_identities":[],'
        b'"request_ids":[{"request_id":"a"}]}',
        b'{"calls_by_tool":{},"calls_by_tool":{},"compensations_by_tool":{},'
        b'"compensation_identities":[],"request_ids":[]}',
    ],
    ids=["unknown-field", "missing-field", "boolean-count", "missing-flag", "duplicate-key"],
)
def test_a_malformed_state_document_does_not_decode(document: bytes) -> None:
    with pytest.raises(SerializationError):
        decode_struct(document, AuthorizerState)


# Property: budgets hold and refusals change nothing ------------------------------

PROPERTY_TOOLS = (TOOL, ECHO, "no.tool")
PAYLOADS = {
    "json": ADD,
    "json-alt": UNDO,
    "scalar": ToolPayload.json(3),
    "large": oversized_json(129),
    "text": ToolPayload.text("hello"),
}
# Payloads each tool accepts within its limits.
ACCEPTABLE = {TOOL: {"json", "json-alt"}, ECHO: {"text"}}
ACTION = st.tuples(
    st.sampled_from(
        ["invoke", "dispatch", "reconcile", "compensate", "compensate-bad-fp", "reserve"]
    ),
    st.sampled_from([f"id-{i}" for i in range(12)]),
    st.sampled_from(PROPERTY_TOOLS),
    st.sampled_from(sorted(PAYLOADS)),
    st.sampled_from(["cmp-a", "cmp-b", "cmp-c"]),
    st.sampled_from([SESSION, SESSION, "session-2"]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ACTION, max_size=40))
def test_random_authorizations_respect_budgets_and_refusals_change_nothing(
    actions: list[tuple[str, str, str, str, str, str]],
) -> None:
    grants = {
        TOOL: grant_gc(2),
        ECHO: CapabilityGrant(ECHO, "text", max_calls=3, max_compensations=1),
    }
    auth = SessionAuthorizer(CapabilityManifest(SESSION, list(grants.values())))
    # A small model of what must have been spent, kept from the accepted calls.
    accepted_ids: list[str] = []
    model_calls = dict.fromkeys(grants, 0)
    model_identities: set[tuple[str, str, str]] = set()

    for kind, request_id, tool, payload_name, cmp_key, session in actions:
        payload = PAYLOADS[payload_name]
        grant = grants.get(tool, grant_gc(2))
        # An acceptable call with a fresh id and budget left must be accepted.
        well_formed = (
            session == SESSION
            and tool in grants
            and request_id not in accepted_ids
            and (kind in ("reconcile", "reserve") or payload_name in ACCEPTABLE[tool])
        )
        if kind in ("invoke", "dispatch"):
            must_accept = well_formed and model_calls[tool] < grant.max_calls
        elif kind == "compensate":
            new = (tool, cmp_key, payload_name) not in model_identities
            spent = sum(1 for identity in model_identities if identity[0] == tool)
            must_accept = well_formed and (not new or spent < grant.max_compensations)
        elif kind == "reserve":
            must_accept = request_id not in accepted_ids
        else:
            must_accept = well_formed and kind == "reconcile"
        before = auth.export_state()
        try:
            if kind == "invoke":
                auth.authorize(invocation(request_id, payload, tool=tool, session=session))
            elif kind == "dispatch":
                auth.authorize_operation(dispatch(request_id, payload, tool=tool, session=session))
            elif kind == "reconcile":
                auth.authorize_reconciliation(reconcile(request_id, tool=tool, session=session))
            elif kind == "reserve":
                auth.reserve_request_id(request_id)
            else:
                # "compensate-bad-fp" names a fingerprint no grant has.
                fingerprint = None if kind == "compensate" else "f" * 64
                request = compensation(
                    request_id,
                    payload,
                    session=session,
                    tool=tool,
                    cmp_key=cmp_key,
                    grant=grant,
                    fingerprint=fingerprint,
                )
                auth.authorize_compensation(request)
        except OctoError:
            assert not must_accept
            assert auth.export_state() == before
        else:
            accepted_ids.append(request_id)
            if kind in ("invoke", "dispatch"):
                model_calls[tool] += 1
            elif kind == "compensate":
                model_identities.add((tool, cmp_key, payload_name))
            else:
                assert kind != "compensate-bad-fp"

        for name, budget in grants.items():
            assert auth.calls_for(name) == model_calls[name] <= budget.max_calls
            spent = sum(1 for identity in model_identities if identity[0] == name)
            assert auth.compensations_for(name) == spent <= budget.max_compensations
        state = auth.export_state()
        assert [r.request_id for r in state.request_ids] == accepted_ids
        assert len(state.compensation_identities) == len(model_identities)

    final = auth.export_state()
    assert SessionAuthorizer.restore(auth.manifest, final).export_state() == final
