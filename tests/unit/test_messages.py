"""Wire structs and the WorkerMessage union.

Expected wire bytes are written out by hand.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from octo_common._struct import ProtocolStruct, leading_keyword
from octo_common.errors import (
    CancellationIdMatchesRequest,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    InvalidJsonEnvelope,
    InvalidOperationFailure,
    InvalidToken,
    JsonPayloadTooDeep,
    SerializationError,
    TooManyGrants,
    UnsupportedVersion,
    WireFrameTooLarge,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest, ResourceSelector
from octo_common.messages import (
    Cancel,
    CancellationResult,
    CloseSession,
    CompensateOperation,
    CompensationReconcileRequest,
    CompensationReconcileResult,
    CompensationResult,
    DispatchOperation,
    Invoke,
    OpenSession,
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
    RequestRejected,
    Result,
    ToolInvocation,
    ToolResult,
    WorkerCancellationRequest,
    WorkerCancellationResult,
    decode_message,
    encode_message,
    message_type,
    operation_key_of,
    request_id_of,
    session_id_of,
)
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, Pending, Running, Succeeded

FP = "0123456789abcdef" * 4
MIB = 1_048_576

GRANT = CapabilityGrant(
    "math.add", "json", 2, 128, 128, 1, (ResourceSelector("network_origin", "math-api"),)
)
BINDING = OperationCompensationBinding(
    "math.add", "release-42-add", "cmp-release-42-add-undo", "tenant-release", FP
)
DISPATCH = OperationDispatchRequest(
    "session-1", "dispatch-1", "text.echo", "op-release-42", ToolPayload.text("release")
)
RECONCILE = OperationReconcileRequest("session-1", "reconcile-1", "text.echo", "op-release-42")
COMPENSATE = OperationCompensationRequest(
    "session-1", "compensation-request-1", BINDING, ToolPayload.json({"undo": "release"})
)
RECONCILE_COMPENSATION = CompensationReconcileRequest(
    "session-1",
    "reconcile-compensation-1",
    "math.add",
    "release-42-add",
    "cmp-release-42-add-undo",
    "tenant-release",
    FP,
)

ALL_MESSAGES: dict[str, Any] = {
    "open_session": OpenSession(CapabilityManifest("session-1", [GRANT])),
    "invoke": Invoke(ToolInvocation("session-1", "invoke-1", "math.add", ToolPayload.json([1]))),
    "result": Result(ToolResult("session-1", "invoke-1", ToolPayload.text("done"))),
    "dispatch_operation": DispatchOperation(DISPATCH),
    "operation_result": OperationResult(
        OperationReconcileResult(
            "session-1",
            "dispatch-1",
            "text.echo",
            "op-release-42",
            Succeeded(ToolPayload.text("done")),
        )
    ),
    "compensate_operation": CompensateOperation(COMPENSATE),
    "compensation_result": CompensationResult(
        OperationCompensationResult("session-1", "compensation-request-1", BINDING, Cancelled())
    ),
    "reconcile_operation": ReconcileOperation(RECONCILE),
    "reconciled_operation": ReconciledOperation(
        OperationReconcileResult(
            "session-1", "reconcile-1", "text.echo", "op-release-42", Failed("boom")
        )
    ),
    "reconcile_compensation": ReconcileCompensation(RECONCILE_COMPENSATION),
    "reconciled_compensation": ReconciledCompensation(
        CompensationReconcileResult(
            "session-1",
            "reconcile-compensation-1",
            "math.add",
            "release-42-add",
            "cmp-release-42-add-undo",
            "tenant-release",
            FP,
            Succeeded(ToolPayload.json({"removed": True})),
        )
    ),
    "cancel": Cancel(WorkerCancellationRequest("session-1", "cancel-1", "invoke-1", "math.add")),
    "cancellation_result": CancellationResult(
        WorkerCancellationResult("session-1", "cancel-1", "invoke-1", "math.add", "unsupported")
    ),
    "close_session": CloseSession("session-1"),
    "request_rejected": RequestRejected(
        "session-1", "dispatch-2", "pending_operation", "op-release-42"
    ),
}


# Constructors --------------------------------------------------------------


def test_constructors_validate_tokens() -> None:
    with pytest.raises(InvalidToken) as raised:
        ToolInvocation(session_id="S", request_id="r", tool="t", payload=ToolPayload.text("x"))
    assert (raised.value.field, raised.value.value) == ("session id", "S")
    with pytest.raises(InvalidToken) as raised:
        ToolInvocation("s", "Request 1", "t", ToolPayload.text("x"))
    assert raised.value.field == "request id"
    with pytest.raises(InvalidToken) as raised:
        OperationReconcileRequest("s", "r", "t", "op:1")
    assert raised.value.field == "operation key"
    with pytest.raises(InvalidToken) as raised:
        WorkerCancellationRequest("s", "c/1", "r", "t")
    assert raised.value.field == "cancellation id"
    with pytest.raises(InvalidToken) as raised:
        ToolResult("s", "r" * 129, ToolPayload.text("x"))
    assert raised.value.field == "request id"
    assert ToolResult("s", "r" * 128, ToolPayload.text("x")).request_id == "r" * 128


def test_constructors_set_protocol_version_5() -> None:
    assert ToolInvocation("s", "r", "t", ToolPayload.text("x")).protocol_version == 5
    assert CloseSession("s").protocol_version == 5
    assert RequestRejected("s", "r", "code").protocol_version == 5
    assert COMPENSATE.protocol_version == 5


def test_the_constructors_version_default_is_not_a_decoding_default() -> None:
    # Every message whose encoding carries a version: without it, it does not decode.
    versioned = 0
    for name, message in ALL_MESSAGES.items():
        data = encode_message(message)
        if b'"protocol_version":5,' not in data:
            continue
        versioned += 1
        with pytest.raises(SerializationError):
            decode_message(data.replace(b'"protocol_version":5,', b"", 1))
        assert decode_message(data) == message, name
    assert versioned == len(ALL_MESSAGES)


def test_a_leading_keyword_field_must_come_first_on_the_wire() -> None:
    with pytest.raises(TypeError, match="first on the wire"):

        class Late(ProtocolStruct, frozen=True):
            session_id: str
            protocol_version: int = leading_keyword(default=5, kw_only=True)

    with pytest.raises(TypeError, match="one leading keyword field"):

        class Twice(ProtocolStruct, frozen=True):
            protocol_version: int = leading_keyword(default=5, kw_only=True)
            revision: int = leading_keyword(default=1, kw_only=True)

    with pytest.raises(TypeError, match="keyword-only"):
        leading_keyword(default=5, kw_only=False)


def test_binding_validates_key_tenant_and_fingerprint() -> None:
    with pytest.raises(InvalidToken) as raised:
        OperationCompensationBinding("t", "k", "Cmp-x", "tenant", FP)
    assert raised.value.field == "compensation key"
    with pytest.raises(InvalidCompensationKey) as no_prefix:
        OperationCompensationBinding("t", "k", "undo-x", "tenant", FP)
    assert no_prefix.value.value == "undo-x"
    OperationCompensationBinding("t", "k", "cmp-", "tenant", FP)  # `cmp-` alone is valid
    with pytest.raises(InvalidToken) as raised:
        OperationCompensationBinding("t", "k", "cmp-x", "Tenant", FP)
    assert raised.value.field == "tenant scope"
    for bad in (FP.upper(), FP[:63], FP + "0", "g" * 64):
        with pytest.raises(InvalidCompensationGrantFingerprint):
            OperationCompensationBinding("t", "k", "cmp-x", "tenant", bad)


def test_dispatch_constructor_checks_the_payload() -> None:
    with pytest.raises(InvalidJsonEnvelope):
        OperationDispatchRequest("s", "r", "t", "k", ToolPayload.json("scalar"))
    deep: Any = {}
    for _ in range(32):
        deep = [deep]
    with pytest.raises(JsonPayloadTooDeep):
        OperationCompensationRequest("s", "r", BINDING, ToolPayload.json(deep))


def test_invocation_constructor_does_not_check_the_payload() -> None:
    invocation = ToolInvocation("s", "r", "t", ToolPayload.json(42))
    assert invocation.payload == ToolPayload.json(42)


def test_cancellation_id_must_differ_from_the_request_id() -> None:
    with pytest.raises(CancellationIdMatchesRequest):
        WorkerCancellationRequest("s", "same", "same", "t")
    with pytest.raises(CancellationIdMatchesRequest):
        WorkerCancellationResult("s", "same", "same", "t", "acknowledged")


def test_request_rejected_validates_code_and_keys() -> None:
    for bad in ("", "Pending", "9lives", "pending-operation", "x" * 65):
        with pytest.raises(InvalidToken) as raised:
            RequestRejected("s", "r", bad)
        assert raised.value.field == "rejection code"
    RequestRejected("s", "r", "x" * 64)
    with pytest.raises(InvalidToken) as raised:
        RequestRejected("s", "r", "code", operation_key="Bad Key")
    assert raised.value.field == "operation key"
    with pytest.raises(InvalidCompensationKey):
        RequestRejected("s", "r", "code", compensation_key="undo-1")


def test_status_of_a_result_is_validated() -> None:
    with pytest.raises(InvalidOperationFailure):
        OperationReconcileResult("s", "r", "t", "k", Failed(""))
    with pytest.raises(InvalidJsonEnvelope):
        OperationCompensationResult("s", "r", BINDING, Succeeded(ToolPayload.json(1)))


def test_pending_is_not_a_result_status() -> None:
    # "pending" is not an OperationStatus; a result carrying it could not be decoded.
    with pytest.raises(SerializationError):
        OperationReconcileResult("s", "r", "t", "k", Pending())  # type: ignore[arg-type]
    with pytest.raises(SerializationError):
        OperationCompensationResult("s", "r", BINDING, Pending())  # type: ignore[arg-type]


def test_binding_fields_are_readable_on_request_and_result() -> None:
    result = OperationCompensationResult("session-1", "compensation-request-1", BINDING, Running())
    for struct in (COMPENSATE, result):
        assert struct.tool == "math.add"
        assert struct.operation_key == "release-42-add"
        assert struct.compensation_key == "cmp-release-42-add-undo"
        assert struct.tenant_scope == "tenant-release"
        assert struct.grant_fingerprint == FP
        assert struct.binding == BINDING


def test_structs_are_frozen_values() -> None:
    again = OperationDispatchRequest(
        "session-1", "dispatch-1", "text.echo", "op-release-42", ToolPayload.text("release")
    )
    assert again == DISPATCH
    assert hash(again) == hash(DISPATCH)
    with pytest.raises(AttributeError):
        DISPATCH.request_id = "other"  # type: ignore[misc]


# Wire form (field order, bytes written by hand) ------------------------------------------


W42_EXAMPLES = [
    (
        DispatchOperation(DISPATCH),
        '{"type":"dispatch_operation","request":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"dispatch-1","tool":"text.echo","operation_key":"op-release-42",'
        '"payload":{"format":"text","value":"release"}}}',
    ),
    (
        OperationResult(
            OperationReconcileResult(
                "session-1",
                "dispatch-1",
                "text.echo",
                "op-release-42",
                Succeeded(ToolPayload.text("done")),
            )
        ),
        '{"type":"operation_result","result":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"dispatch-1","tool":"text.echo","operation_key":"op-release-42",'
        '"status":{"state":"succeeded","payload":{"format":"text","value":"done"}}}}',
    ),
    (
        ReconcileOperation(RECONCILE),
        '{"type":"reconcile_operation","request":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"reconcile-1","tool":"text.echo","operation_key":"op-release-42"}}',
    ),
    (
        ReconciledOperation(
            OperationReconcileResult(
                "session-1", "reconcile-1", "text.echo", "op-release-42", Failed("boom")
            )
        ),
        '{"type":"reconciled_operation","result":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"reconcile-1","tool":"text.echo","operation_key":"op-release-42",'
        '"status":{"state":"failed","message":"boom"}}}',
    ),
    (
        CompensateOperation(COMPENSATE),
        '{"type":"compensate_operation","request":{"protocol_version":5,"session_id":"session-1",'
        '"request_id":"compensation-request-1","tool":"math.add","operation_key":"release-42-add",'
        '"compensation_key":"cmp-release-42-add-undo","tenant_scope":"tenant-release",'
        f'"grant_fingerprint":"{FP}","payload":{{"format":"json","value":{{"undo":"release"}}}}}}}}',
    ),
    (
        CloseSession("session-1"),
        '{"type":"close_session","protocol_version":5,"session_id":"session-1"}',
    ),
    (
        RequestRejected("session-1", "dispatch-2", "pending_operation", "op-release-42"),
        '{"type":"request_rejected","protocol_version":5,"session_id":"session-1",'
        '"request_id":"dispatch-2","code":"pending_operation","operation_key":"op-release-42"}',
    ),
]


@pytest.mark.parametrize(("message", "wire"), W42_EXAMPLES)
def test_w42_wire_examples(message: Any, wire: str) -> None:
    assert encode_message(message) == wire.encode()
    assert decode_message(wire.encode()) == message


def test_remaining_wire_shapes() -> None:
    assert (
        encode_message(ALL_MESSAGES["compensation_result"])
        == (
            '{"type":"compensation_result","result":{"protocol_version":5,"session_id":"session-1",'
            '"request_id":"compensation-request-1","tool":"math.add","operation_key":"release-42-add",'
            '"compensation_key":"cmp-release-42-add-undo","tenant_scope":"tenant-release",'
            f'"grant_fingerprint":"{FP}","status":{{"state":"cancelled"}}}}}}'
        ).encode()
    )
    assert encode_message(ALL_MESSAGES["cancellation_result"]) == (
        b'{"type":"cancellation_result","result":{"protocol_version":5,"session_id":"session-1",'
        b'"cancellation_id":"cancel-1","request_id":"invoke-1","tool":"math.add","outcome":"unsupported"}}'
    )
    assert encode_message(ALL_MESSAGES["invoke"]) == (
        b'{"type":"invoke","invocation":{"protocol_version":5,"session_id":"session-1",'
        b'"request_id":"invoke-1","tool":"math.add","payload":{"format":"json","value":[1]}}}'
    )
    assert encode_message(ALL_MESSAGES["open_session"]) == (
        b'{"type":"open_session","manifest":{"protocol_version":5,"session_id":"session-1",'
        b'"grants":[{"tool":"math.add","format":"json","max_calls":2,"max_input_bytes":128,'
        b'"max_output_bytes":128,"max_compensations":1,'
        b'"resources":[{"kind":"network_origin","id":"math-api"}]}]}}'
    )


def test_request_rejected_omits_none_keys() -> None:
    assert encode_message(RequestRejected("s", "r", "session_poisoned")) == (
        b'{"type":"request_rejected","protocol_version":5,"session_id":"s","request_id":"r",'
        b'"code":"session_poisoned"}'
    )
    assert encode_message(RequestRejected("s", "r", "c", compensation_key="cmp-1")) == (
        b'{"type":"request_rejected","protocol_version":5,"session_id":"s","request_id":"r",'
        b'"code":"c","compensation_key":"cmp-1"}'
    )


@pytest.mark.parametrize("name", list(ALL_MESSAGES))
def test_every_message_type_round_trips(name: str) -> None:
    message = ALL_MESSAGES[name]
    data = encode_message(message)
    assert json.loads(data)["type"] == name
    assert message_type(message) == name
    decoded = decode_message(data)
    assert decoded == message
    assert type(decoded) is type(message)
    assert encode_message(decoded) == data
    assert decode_message(data.decode()) == message


def test_session_and_request_ids_of_messages() -> None:
    for message in ALL_MESSAGES.values():
        assert session_id_of(message) == "session-1"
    assert session_id_of(OpenSession(CapabilityManifest("other-session", []))) == "other-session"
    assert request_id_of(ALL_MESSAGES["dispatch_operation"]) == "dispatch-1"
    assert request_id_of(ALL_MESSAGES["cancel"]) == "cancel-1"


# Decoding: unknown keys ----------------------------------------------------


def _with_extra(name: str, path: tuple[Any, ...]) -> bytes:
    document = json.loads(encode_message(ALL_MESSAGES[name]))
    node = document
    for key in path:
        node = node[key]
    node["zz_unknown"] = {"nested": [1, 2]}
    return json.dumps(document).encode()


IGNORED = [
    ("open_session", ()),
    ("open_session", ("manifest",)),
    ("open_session", ("manifest", "grants", 0)),
    ("open_session", ("manifest", "grants", 0, "resources", 0)),
    ("invoke", ()),
    ("invoke", ("invocation",)),
    ("invoke", ("invocation", "payload")),
    ("result", ("result",)),
    ("operation_result", ("result",)),
    ("operation_result", ("result", "status")),
    ("reconcile_operation", ("request",)),
    ("reconciled_operation", ("result",)),
    ("reconciled_operation", ("result", "status")),
    ("reconcile_compensation", ()),
    ("reconciled_compensation", ()),
    ("reconciled_compensation", ("result", "status")),
    ("dispatch_operation", ()),
    ("dispatch_operation", ("request", "payload")),
    ("close_session", ()),
]

REJECTED = [
    ("dispatch_operation", ("request",)),
    ("compensate_operation", ("request",)),
    ("compensation_result", ("result",)),
    ("reconcile_compensation", ("request",)),
    ("reconciled_compensation", ("result",)),
    ("cancel", ("request",)),
    ("cancellation_result", ("result",)),
    ("request_rejected", ()),
]


@pytest.mark.parametrize(("name", "path"), IGNORED)
def test_unknown_keys_are_ignored_and_dropped(name: str, path: tuple[Any, ...]) -> None:
    data = _with_extra(name, path)
    decoded = decode_message(data)
    assert decoded == ALL_MESSAGES[name]
    assert b"zz_unknown" not in encode_message(decoded)


@pytest.mark.parametrize(("name", "path"), REJECTED)
def test_unknown_keys_are_rejected_in_strict_types(name: str, path: tuple[Any, ...]) -> None:
    with pytest.raises(SerializationError):
        decode_message(_with_extra(name, path))


def test_unknown_type_is_a_serialization_error() -> None:
    for data in (
        b'{"type":"teleport","session_id":"s"}',
        b'{"type":"Invoke"}',
        b'{"protocol_version":5,"session_id":"s"}',
        b'{"type":5}',
        b"[]",
        b'"close_session"',
    ):
        with pytest.raises(SerializationError):
            decode_message(data)


def test_version_out_of_range_versus_unsupported() -> None:
    base = b'{"type":"close_session","protocol_version":%d,"session_id":"s"}'
    with pytest.raises(SerializationError):
        decode_message(base % 70000)
    with pytest.raises(SerializationError):
        decode_message(base % -1)
    with pytest.raises(UnsupportedVersion) as raised:
        decode_message(base % 6)
    assert raised.value.actual == 6
    with pytest.raises(UnsupportedVersion):
        decode_message(base % 4)
    with pytest.raises(SerializationError):
        decode_message(b'{"type":"close_session","protocol_version":5.0,"session_id":"s"}')
    with pytest.raises(SerializationError):
        decode_message(b'{"type":"close_session","protocol_version":true,"session_id":"s"}')


def test_inner_version_is_checked() -> None:
    data = encode_message(ALL_MESSAGES["dispatch_operation"]).replace(
        b'"protocol_version":5', b'"protocol_version":6'
    )
    with pytest.raises(UnsupportedVersion):
        decode_message(data)


def test_duplicate_struct_keys_are_rejected_but_payload_keys_last_win() -> None:
    with pytest.raises(SerializationError):
        decode_message(
            b'{"type":"close_session","protocol_version":5,"session_id":"s","session_id":"s"}'
        )
    with pytest.raises(SerializationError):
        decode_message(
            b'{"type":"close_session","type":"close_session","protocol_version":5,"session_id":"s"}'
        )
    data = (
        b'{"type":"invoke","invocation":{"protocol_version":5,"session_id":"s","request_id":"r",'
        b'"tool":"t","payload":{"format":"json","value":{"a":1,"a":2}}}}'
    )
    decoded = decode_message(data)
    assert isinstance(decoded, Invoke)
    assert decoded.invocation.payload == ToolPayload.json({"a": 2})


# Decode-time validation ---------------------------------------------------


def _replace(name: str, old: bytes, new: bytes) -> bytes:
    data = encode_message(ALL_MESSAGES[name])
    assert old in data
    return data.replace(old, new)


def test_invoke_checks_only_the_header() -> None:
    data = (
        b'{"type":"invoke","invocation":{"protocol_version":5,"session_id":"s","request_id":"r",'
        b'"tool":"t","payload":{"format":"json","value":7}}}'
    )
    assert isinstance(decode_message(data), Invoke)
    with pytest.raises(InvalidToken):
        decode_message(data.replace(b'"tool":"t"', b'"tool":"T"'))


def test_result_checks_only_the_header() -> None:
    data = _replace(
        "result", b'{"format":"text","value":"done"}', b'{"format":"json","value":null}'
    )
    assert isinstance(decode_message(data), Result)


def test_dispatch_checks_its_payload() -> None:
    text_payload = b'{"format":"text","value":"release"}'
    with pytest.raises(InvalidJsonEnvelope):
        decode_message(
            _replace("dispatch_operation", text_payload, b'{"format":"json","value":"x"}')
        )
    with pytest.raises(JsonPayloadTooDeep):
        deep = b"[" * 32 + b"{}" + b"]" * 32
        decode_message(
            _replace("dispatch_operation", text_payload, b'{"format":"json","value":' + deep + b"}")
        )
    with pytest.raises(SerializationError):
        decode_message(_replace("dispatch_operation", b'"value":"release"', b'"value":1'))


def test_compensation_request_checks_key_and_fingerprint() -> None:
    with pytest.raises(InvalidCompensationKey):
        decode_message(
            _replace("compensate_operation", b"cmp-release-42-add-undo", b"release-42-add-undo")
        )
    with pytest.raises(InvalidCompensationGrantFingerprint):
        decode_message(_replace("compensate_operation", FP.encode(), FP.upper().encode()))
    with pytest.raises(InvalidToken):
        decode_message(_replace("compensate_operation", b"tenant-release", b"tenant release"))


def test_results_check_their_status() -> None:
    with pytest.raises(InvalidOperationFailure):
        decode_message(_replace("reconciled_operation", b'"message":"boom"', b'"message":""'))
    with pytest.raises(SerializationError):
        decode_message(
            _replace(
                "reconciled_operation",
                b'{"state":"failed","message":"boom"}',
                b'{"state":"pending"}',
            )
        )
    with pytest.raises(InvalidCompensationGrantFingerprint):
        decode_message(_replace("compensation_result", FP.encode(), b"00"))


def test_cancel_checks_the_ids() -> None:
    with pytest.raises(CancellationIdMatchesRequest):
        decode_message(
            _replace("cancel", b'"cancellation_id":"cancel-1"', b'"cancellation_id":"invoke-1"')
        )
    with pytest.raises(SerializationError):
        decode_message(_replace("cancellation_result", b'"unsupported"', b'"maybe"'))


def test_open_session_validates_the_whole_manifest() -> None:
    grants = ",".join(
        f'{{"tool":"t{i}","format":"text","max_calls":1,"max_input_bytes":1,"max_output_bytes":1}}'
        for i in range(129)
    )
    data = (
        '{"type":"open_session","manifest":{"protocol_version":5,"session_id":"s","grants":['
        + grants
        + "]}}"
    ).encode()
    with pytest.raises(TooManyGrants):
        decode_message(data)


def test_request_rejected_checks_the_code() -> None:
    with pytest.raises(InvalidToken):
        decode_message(_replace("request_rejected", b"pending_operation", b"Pending"))


# matches_request / matches_dispatch -------------------------------------------------


def _result_for(request: Any, **changes: str) -> OperationReconcileResult:
    fields = {
        "session_id": request.session_id,
        "request_id": request.request_id,
        "tool": request.tool,
        "operation_key": request.operation_key,
    }
    fields.update(changes)
    return OperationReconcileResult(**fields, status=Running())


def test_reconcile_result_matching() -> None:
    assert _result_for(RECONCILE).matches_request(RECONCILE)
    assert _result_for(DISPATCH).matches_dispatch(DISPATCH)
    for field, value in (
        ("session_id", "session-2"),
        ("request_id", "other"),
        ("tool", "math.add"),
        ("operation_key", "op-other"),
    ):
        assert not _result_for(RECONCILE, **{field: value}).matches_request(RECONCILE)
        assert not _result_for(DISPATCH, **{field: value}).matches_dispatch(DISPATCH)


def test_compensation_result_matching() -> None:
    def result(
        binding: OperationCompensationBinding, request_id: str = "compensation-request-1"
    ) -> OperationCompensationResult:
        return OperationCompensationResult("session-1", request_id, binding, Running())

    assert result(BINDING).matches_request(COMPENSATE)
    assert not result(BINDING, "other").matches_request(COMPENSATE)
    variants = [
        OperationCompensationBinding(
            "math.sub", "release-42-add", "cmp-release-42-add-undo", "tenant-release", FP
        ),
        OperationCompensationBinding(
            "math.add", "other-op", "cmp-release-42-add-undo", "tenant-release", FP
        ),
        OperationCompensationBinding(
            "math.add", "release-42-add", "cmp-other", "tenant-release", FP
        ),
        OperationCompensationBinding(
            "math.add", "release-42-add", "cmp-release-42-add-undo", "tenant-other", FP
        ),
        OperationCompensationBinding(
            "math.add", "release-42-add", "cmp-release-42-add-undo", "tenant-release", "f" * 64
        ),
    ]
    for binding in variants:
        assert not result(binding).matches_request(COMPENSATE)


def test_request_rejected_matching() -> None:
    assert RequestRejected("session-1", "dispatch-1", "pending_operation").matches_request(DISPATCH)
    assert RequestRejected("session-1", "dispatch-1", "x", "op-release-42").matches_request(
        DISPATCH
    )
    assert not RequestRejected("session-1", "dispatch-1", "x", "op-other").matches_request(DISPATCH)
    assert not RequestRejected("session-2", "dispatch-1", "x").matches_request(DISPATCH)
    assert not RequestRejected("session-1", "dispatch-9", "x").matches_request(DISPATCH)
    assert RequestRejected(
        "session-1", "compensation-request-1", "x", "release-42-add", "cmp-release-42-add-undo"
    ).matches_request(COMPENSATE)
    assert not RequestRejected(
        "session-1", "compensation-request-1", "x", compensation_key="cmp-other"
    ).matches_request(COMPENSATE)
    # A compensation key on a rejection of a request that has none never matches.
    assert not RequestRejected(
        "session-1", "dispatch-1", "x", compensation_key="cmp-1"
    ).matches_request(DISPATCH)


# 1 MiB bound ------------------------------------------------------------------


def _invoke_of_size(size: int) -> Invoke:
    empty = len(encode_message(Invoke(ToolInvocation("s", "r", "t", ToolPayload.text("")))))
    return Invoke(ToolInvocation("s", "r", "t", ToolPayload.text("x" * (size - empty))))


def test_exactly_one_mib_is_accepted() -> None:
    message = _invoke_of_size(MIB)
    data = encode_message(message)
    assert len(data) == MIB
    assert decode_message(data) == message


def test_one_byte_over_one_mib_is_refused_both_ways() -> None:
    with pytest.raises(WireFrameTooLarge) as raised:
        encode_message(_invoke_of_size(MIB + 1))
    assert (raised.value.actual, raised.value.maximum) == (MIB + 1, MIB)
    data = encode_message(_invoke_of_size(MIB))[:-1] + b" }"
    assert len(data) == MIB + 1
    with pytest.raises(WireFrameTooLarge):
        decode_message(data)


def test_the_length_check_precedes_parsing() -> None:
    with pytest.raises(WireFrameTooLarge):
        decode_message(b"\xff" * (MIB + 1))


def test_a_status_payload_value_is_last_wins_but_the_status_object_is_strict() -> None:
    base = (
        b'{"type":"operation_result","result":{"protocol_version":5,"session_id":"s",'
        b'"request_id":"r","tool":"t","operation_key":"k","status":%s}}'
    )
    decoded = decode_message(
        base % b'{"state":"succeeded","payload":{"format":"json","value":{"a":1,"a":2}}}'
    )
    assert isinstance(decoded, OperationResult)
    assert decoded.result.status == Succeeded(ToolPayload.json({"a": 2}))
    with pytest.raises(SerializationError):
        decode_message(base % b'{"state":"failed","message":"x","message":"y"}')
    with pytest.raises(SerializationError):
        decode_message(base % b'{"state":"running","state":"running"}')


def test_text_input_with_a_lone_surrogate_is_a_serialization_error() -> None:
    with pytest.raises(SerializationError):
        decode_message('{"type":"close_session","protocol_version":5,"session_id":"\ud800"}')


def test_an_explicit_protocol_version_is_validated() -> None:
    assert CloseSession("s", protocol_version=5) == CloseSession("s")
    with pytest.raises(UnsupportedVersion):
        CloseSession("s", protocol_version=6)


# Compensation reconciliation ---------------------------------------------------------


def _compensation_lookup(**changes: Any) -> CompensationReconcileRequest:
    fields = {
        "session_id": "session-1",
        "request_id": "reconcile-compensation-1",
        "tool": "math.add",
        "operation_key": "release-42-add",
        "compensation_key": "cmp-release-42-add-undo",
        "tenant_scope": "tenant-release",
        "grant_fingerprint": FP,
    }
    fields.update(changes)
    return CompensationReconcileRequest(**fields)  # type: ignore[arg-type]


def _compensation_lookup_result(
    request: CompensationReconcileRequest, status: Any = None, **changes: Any
) -> CompensationReconcileResult:
    fields = {
        name: getattr(request, name)
        for name in (
            "session_id",
            "request_id",
            "tool",
            "operation_key",
            "compensation_key",
            "tenant_scope",
            "grant_fingerprint",
        )
    }
    fields.update(changes)
    return CompensationReconcileResult(**fields, status=status or Running())


def test_d11_wire_shapes_follow_the_field_order_of_d11() -> None:
    assert (
        encode_message(ALL_MESSAGES["reconcile_compensation"])
        == (
            '{"type":"reconcile_compensation","request":{"protocol_version":5,'
            '"session_id":"session-1","request_id":"reconcile-compensation-1","tool":"math.add",'
            '"operation_key":"release-42-add","compensation_key":"cmp-release-42-add-undo",'
            f'"tenant_scope":"tenant-release","grant_fingerprint":"{FP}"}}}}'
        ).encode()
    )
    assert (
        encode_message(ALL_MESSAGES["reconciled_compensation"])
        == (
            '{"type":"reconciled_compensation","result":{"protocol_version":5,'
            '"session_id":"session-1","request_id":"reconcile-compensation-1","tool":"math.add",'
            '"operation_key":"release-42-add","compensation_key":"cmp-release-42-add-undo",'
            f'"tenant_scope":"tenant-release","grant_fingerprint":"{FP}",'
            '"status":{"state":"succeeded","payload":{"format":"json","value":{"removed":true}}}}}'
        ).encode()
    )


def test_d11_structs_take_seven_fields_by_position_or_keyword_and_set_version_5() -> None:
    positional = CompensationReconcileRequest(
        "session-1",
        "reconcile-compensation-1",
        "math.add",
        "release-42-add",
        "cmp-release-42-add-undo",
        "tenant-release",
        FP,
    )
    assert positional == _compensation_lookup() == RECONCILE_COMPENSATION
    assert positional.protocol_version == 5
    assert positional.binding == BINDING
    assert ReconcileCompensation(positional).request is positional
    result = _compensation_lookup_result(positional, Failed("gone"))
    assert result.protocol_version == 5
    assert result.binding == BINDING
    assert ReconciledCompensation(result).result is result
    assert hash(positional) == hash(_compensation_lookup())
    with pytest.raises(AttributeError):
        positional.compensation_key = "cmp-other"  # type: ignore[misc]


def test_d11_request_validates_every_header_rule() -> None:
    for field, bad, token_field in (
        ("session_id", "S", "session id"),
        ("request_id", "r 1", "request id"),
        ("tool", "Math", "tool"),
        ("operation_key", "op:1", "operation key"),
        ("compensation_key", "Cmp-1", "compensation key"),
        ("tenant_scope", "tenant release", "tenant scope"),
    ):
        with pytest.raises(InvalidToken) as raised:
            _compensation_lookup(**{field: bad})
        assert raised.value.field == token_field
    with pytest.raises(InvalidCompensationKey):
        _compensation_lookup(compensation_key="undo-1")
    _compensation_lookup(compensation_key="cmp-")  # `cmp-` alone is valid
    _compensation_lookup(operation_key="cmp-looks-like-one")  # the worker has no op- rule
    for bad in (FP.upper(), FP[:63], FP + "0", "g" * 64):
        with pytest.raises(InvalidCompensationGrantFingerprint):
            _compensation_lookup(grant_fingerprint=bad)
    with pytest.raises(UnsupportedVersion):
        _compensation_lookup(protocol_version=6)


def test_d11_result_validates_its_status() -> None:
    with pytest.raises(InvalidOperationFailure):
        _compensation_lookup_result(RECONCILE_COMPENSATION, Failed(""))
    with pytest.raises(InvalidJsonEnvelope):
        _compensation_lookup_result(RECONCILE_COMPENSATION, Succeeded(ToolPayload.json(1)))
    with pytest.raises(SerializationError):
        _compensation_lookup_result(RECONCILE_COMPENSATION, Pending())
    with pytest.raises(InvalidCompensationKey):
        _compensation_lookup_result(RECONCILE_COMPENSATION, compensation_key="undo-1")


def test_d11_messages_are_validated_when_decoded() -> None:
    with pytest.raises(InvalidCompensationKey):
        decode_message(
            _replace("reconcile_compensation", b"cmp-release-42-add-undo", b"release-42-undo")
        )
    with pytest.raises(InvalidCompensationGrantFingerprint):
        decode_message(_replace("reconcile_compensation", FP.encode(), FP.upper().encode()))
    with pytest.raises(InvalidToken):
        decode_message(_replace("reconciled_compensation", b"tenant-release", b"Tenant"))
    with pytest.raises(SerializationError):
        decode_message(
            _replace(
                "reconciled_compensation",
                b'{"state":"succeeded","payload":{"format":"json","value":{"removed":true}}}',
                b'{"state":"pending"}',
            )
        )
    with pytest.raises(UnsupportedVersion):
        decode_message(
            _replace("reconcile_compensation", b'"protocol_version":5', b'"protocol_version":4')
        )
    # A payload is no field of a lookup: the strict struct refuses it.
    with pytest.raises(SerializationError):
        decode_message(
            _replace(
                "reconcile_compensation",
                f'"grant_fingerprint":"{FP}"'.encode(),
                f'"grant_fingerprint":"{FP}","payload":{{"format":"text","value":"x"}}'.encode(),
            )
        )


def test_d11_result_matches_all_eight_identity_fields() -> None:
    request = RECONCILE_COMPENSATION
    assert _compensation_lookup_result(request).matches_request(request)
    for field, value in (
        ("session_id", "session-2"),
        ("request_id", "other"),
        ("tool", "math.sub"),
        ("operation_key", "op-other"),
        ("compensation_key", "cmp-other"),
        ("tenant_scope", "tenant-other"),
        ("grant_fingerprint", "f" * 64),
    ):
        assert not _compensation_lookup_result(request, **{field: value}).matches_request(request)
    rejection = RequestRejected(
        "session-1",
        "reconcile-compensation-1",
        "unknown_compensation",
        "release-42-add",
        "cmp-release-42-add-undo",
    )
    assert rejection.matches_request(request)
    assert not RequestRejected(
        "session-1", "reconcile-compensation-1", "x", compensation_key="cmp-other"
    ).matches_request(request)


def test_d11_ids_of_the_messages() -> None:
    assert request_id_of(ALL_MESSAGES["reconcile_compensation"]) == "reconcile-compensation-1"
    assert request_id_of(ALL_MESSAGES["reconciled_compensation"]) == "reconcile-compensation-1"
    assert message_type(ALL_MESSAGES["reconcile_compensation"]) == "reconcile_compensation"
    assert operation_key_of(ALL_MESSAGES["reconciled_compensation"]) == "release-42-add"
