"""A field without a stated default is required when decoding.

Every struct Octo decodes from the wire or from a stored document is checked
field by field: a valid document is built, then each field is removed in
turn. Removing a field the documents give a default for (a grant's
``max_compensations`` and ``resources``, a record's ``compensation``, the
optional keys of ``request_rejected``, every attenuation field, a ledger
operation's ``compensation``) decodes to that default; removing any other
field is the decoding layer's error, never a silent default. A grant without
``max_calls`` is the case the protocol names; the constructor still fills
its defaults.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from typing import Any

import pytest

from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    InvalidEnvelope,
    InvalidLedgerEncoding,
    OctoError,
    RollbackAnchorInvalid,
    SerializationError,
)
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole, decode_frame
from octo_common.grants import (
    CapabilityGrant,
    CapabilityManifest,
    GrantAttenuation,
    ManifestAttenuation,
    ResourceKind,
    ResourceSelector,
)
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
    WorkerMessage,
    decode_message,
    encode_message,
)
from octo_common.payload import ToolPayload
from octo_common.records import (
    StorageKey,
    StorageKeyring,
    StorageRecordKey,
    decode_anchor,
    encode_anchor,
    open_record,
    seal_record,
)
from octo_common.states import Failed, Pending, StateKind, Succeeded
from octo_host import audit as audit_module
from octo_host.ledger import WorkflowOperationLedger
from octo_worker.journal import WorkerCompensationRecord, WorkerOperationRecord
from octo_worker.storage import documents

SESSION = "session-1"
FP = "ab" * 32
GRANT = CapabilityGrant(
    "release.publish",
    "json",
    3,
    1024,
    2048,
    1,
    [ResourceSelector(ResourceKind.SECRET, "release-token")],
)
BINDING = OperationCompensationBinding("release.publish", "op-1", "cmp-1", "tenant-a", FP)
PAYLOAD = ToolPayload.json({"a": 1})

Decoder = Callable[[bytes], Any]
Path = tuple[str | int, ...]


class Case(typing.NamedTuple):
    """A valid document, where its object sits, and which of its keys may be absent."""

    name: str
    document: bytes
    decode: Decoder
    error: type[OctoError]
    path: Path = ()
    # key -> how to read the decoded value's field, and the stated default
    optional: dict[str, tuple[Callable[[Any], Any], Any]] = {}


def _message(message: WorkerMessage) -> bytes:
    return encode_message(message)


def _frame() -> bytes:
    host = SessionAuthenticator(
        SESSION, SessionKey.from_bytes(bytes(range(1, 33))), SessionRole.HOST
    )
    return host.seal(CloseSession(SESSION))


MESSAGE_CASES: dict[str, tuple[bytes, list[Path]]] = {
    "open_session": (
        _message(OpenSession(CapabilityManifest(SESSION, [GRANT]))),
        [(), ("manifest",), ("manifest", "grants", 0), ("manifest", "grants", 0, "resources", 0)],
    ),
    "invoke": (
        _message(Invoke(ToolInvocation(SESSION, "r-1", "text.echo", ToolPayload.text("x")))),
        [(), ("invocation",), ("invocation", "payload")],
    ),
    "result": (
        _message(Result(ToolResult(SESSION, "r-1", PAYLOAD))),
        [(), ("result",), ("result", "payload")],
    ),
    "dispatch_operation": (
        _message(DispatchOperation(OperationDispatchRequest(SESSION, "r-1", "t", "op-1", PAYLOAD))),
        [(), ("request",), ("request", "payload")],
    ),
    "operation_result": (
        _message(
            OperationResult(
                OperationReconcileResult(SESSION, "r-1", "t", "op-1", Succeeded(PAYLOAD))
            )
        ),
        [(), ("result",), ("result", "status"), ("result", "status", "payload")],
    ),
    "compensate_operation": (
        _message(
            CompensateOperation(OperationCompensationRequest(SESSION, "r-2", BINDING, PAYLOAD))
        ),
        [(), ("request",), ("request", "payload")],
    ),
    "compensation_result": (
        _message(
            CompensationResult(
                OperationCompensationResult(SESSION, "r-2", BINDING, Failed("it broke"))
            )
        ),
        [(), ("result",), ("result", "status")],
    ),
    "reconcile_operation": (
        _message(ReconcileOperation(OperationReconcileRequest(SESSION, "r-3", "t", "op-1"))),
        [(), ("request",)],
    ),
    "reconciled_operation": (
        _message(
            ReconciledOperation(
                OperationReconcileResult(SESSION, "r-3", "t", "op-1", Failed("gone"))
            )
        ),
        [(), ("result",), ("result", "status")],
    ),
    "reconcile_compensation": (
        _message(
            ReconcileCompensation(
                CompensationReconcileRequest(
                    SESSION, "r-4", "release.publish", "op-1", "cmp-1", "tenant-a", FP
                )
            )
        ),
        [(), ("request",)],
    ),
    "reconciled_compensation": (
        _message(
            ReconciledCompensation(
                CompensationReconcileResult(
                    SESSION,
                    "r-4",
                    "release.publish",
                    "op-1",
                    "cmp-1",
                    "tenant-a",
                    FP,
                    Succeeded(PAYLOAD),
                )
            )
        ),
        [(), ("result",), ("result", "status"), ("result", "status", "payload")],
    ),
    "cancel": (
        _message(Cancel(WorkerCancellationRequest(SESSION, "c-1", "r-1", "t"))),
        [(), ("request",)],
    ),
    "cancellation_result": (
        _message(
            CancellationResult(WorkerCancellationResult(SESSION, "c-1", "r-1", "t", "too_late"))
        ),
        [(), ("result",)],
    ),
    "close_session": (_message(CloseSession(SESSION)), [()]),
    "request_rejected": (
        _message(RequestRejected(SESSION, "r-2", "pending_compensation", "op-1", "cmp-1")),
        [()],
    ),
}

_GRANT_OPTIONAL: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "max_compensations": (lambda m: m.manifest.grants[0].max_compensations, 0),
    "resources": (lambda m: m.manifest.grants[0].resources, ()),
}
_REJECTED_OPTIONAL: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "operation_key": (lambda m: m.operation_key, None),
    "compensation_key": (lambda m: m.compensation_key, None),
}


def _message_cases() -> list[Case]:
    cases = []
    for tag, (document, paths) in MESSAGE_CASES.items():
        for path in paths:
            optional = {}
            if path == ("manifest", "grants", 0):
                optional = _GRANT_OPTIONAL
            if tag == "request_rejected":
                optional = _REJECTED_OPTIONAL
            cases.append(
                Case(
                    f"{tag}:{'.'.join(map(str, path)) or 'message'}",
                    document,
                    decode_message,
                    SerializationError,
                    path,
                    optional,
                )
            )
    return cases


def _journal_row() -> bytes:
    compensation = WorkerCompensationRecord("cmp-1", FP, FP, Pending())
    record = WorkerOperationRecord("t", "op-1", FP, Succeeded(PAYLOAD), compensation)
    return record.to_row_json("tenant-a")


def _opening_document() -> bytes:
    manifest = CapabilityManifest(SESSION, [GRANT])
    return encode_struct(
        documents.OpeningDocument(1, "tenant-a", SESSION, "00" * 32, "reply-q", manifest)
    )


def _state_document() -> bytes:
    state = {
        "format_version": 1,
        "scope": "tenant-a",
        "session_id": SESSION,
        "status": "open",
        "authenticator": {"next_outgoing": 2, "inbound_highest": 3, "inbound_seen": "0" * 256},
        "authorizer": {
            "calls_by_tool": {"t": 1},
            "compensations_by_tool": {"t": 1},
            "compensation_identities": [
                {
                    "tool": "t",
                    "operation_key": "op-1",
                    "compensation_key": "cmp-1",
                    "tenant_scope": "tenant-a",
                    "grant_fingerprint": FP,
                    "input_fingerprint": FP,
                }
            ],
            "request_ids": [{"request_id": "r-1", "completed": True}],
        },
        "reconciliations": {"total": 1, "by_tool": {"t": 1}},
    }
    return json.dumps(state, separators=(",", ":")).encode()


def _outbox_document() -> bytes:
    return encode_struct(documents.OutboxDocument(1, "tenant-a", SESSION, "reply-q", "r-1", "e30"))


RING = StorageKeyring("k1", StorageKey(bytes(range(32))))
RECORD_KEY = StorageRecordKey("workflow-ledger", "run-1")


def _open_envelope(data: bytes) -> Any:
    return open_record(RING, RECORD_KEY, data, 1)


def _ledger() -> bytes:
    document = {
        "format_version": 2,
        "revision": 3,
        "plan_fingerprint": FP,
        "operations": [
            {
                "step_id": "step-1",
                "tool": "t",
                "operation_key": "op-1",
                "input_fingerprint": FP,
                "state": "succeeded",
                "compensation": {
                    "compensation_key": "cmp-1",
                    "input_fingerprint": FP,
                    "tenant_scope": "tenant-a",
                    "grant_fingerprint": FP,
                    "state": "pending",
                },
            }
        ],
    }
    return json.dumps(document, separators=(",", ":")).encode()


def _audit() -> bytes:
    entry = audit_module.AuditEntry(
        run="run-1",
        key="op-1",
        from_state=StateKind.PENDING,
        to_state=StateKind.FAILED,
        operator="alice",
        reason="checked by hand",
        time="2026-01-01T00:00:00Z",
        ledger_revision=2,
    )
    return encode_struct(audit_module._AuditDoc(1, "run-1", [entry]))


def _stored_cases() -> list[Case]:
    row = _journal_row()

    def decode_row(data: bytes) -> WorkerOperationRecord:
        return WorkerOperationRecord.from_row_json(data, "tenant-a", "op-1")

    def decode_opening(data: bytes) -> Any:
        return decode_struct(data, documents.OpeningDocument)

    def decode_state(data: bytes) -> Any:
        return decode_struct(data, documents.StateDocument)

    def decode_outbox(data: bytes) -> Any:
        return decode_struct(data, documents.OutboxDocument)

    def decode_audit(data: bytes) -> Any:
        return audit_module._decode(data, "run-1")

    opening, state = _opening_document(), _state_document()
    grant_in_opening = {
        "max_compensations": (lambda d: d.manifest.grants[0].max_compensations, 0),
        "resources": (lambda d: d.manifest.grants[0].resources, ()),
    }
    return [
        Case("grant", encode_struct(GRANT), _decode_grant, SerializationError, (), _GRANT_ALONE),
        Case(
            "grant.resources.0",
            encode_struct(GRANT),
            _decode_grant,
            SerializationError,
            ("resources", 0),
        ),
        Case("frame", _frame(), decode_frame, SerializationError),
        Case("journal-row", row, decode_row, SerializationError),
        Case(
            "journal-row.record",
            row,
            decode_row,
            SerializationError,
            ("record",),
            {"compensation": (lambda r: r.compensation, None)},
        ),
        Case("journal-row.record.state", row, decode_row, SerializationError, ("record", "state")),
        Case(
            "journal-row.record.compensation",
            row,
            decode_row,
            SerializationError,
            ("record", "compensation"),
        ),
        Case("session-opening", opening, decode_opening, SerializationError),
        Case(
            "session-opening.manifest", opening, decode_opening, SerializationError, ("manifest",)
        ),
        Case(
            "session-opening.manifest.grants.0",
            opening,
            decode_opening,
            SerializationError,
            ("manifest", "grants", 0),
            grant_in_opening,
        ),
        Case("session-state", state, decode_state, SerializationError),
        Case(
            "session-state.authenticator",
            state,
            decode_state,
            SerializationError,
            ("authenticator",),
        ),
        Case("session-state.authorizer", state, decode_state, SerializationError, ("authorizer",)),
        Case(
            "session-state.authorizer.compensation_identities.0",
            state,
            decode_state,
            SerializationError,
            ("authorizer", "compensation_identities", 0),
        ),
        Case(
            "session-state.authorizer.request_ids.0",
            state,
            decode_state,
            SerializationError,
            ("authorizer", "request_ids", 0),
        ),
        Case(
            "session-state.reconciliations",
            state,
            decode_state,
            SerializationError,
            ("reconciliations",),
        ),
        Case("outbox", _outbox_document(), decode_outbox, SerializationError),
        Case(
            "storage-envelope",
            seal_record(RING, RECORD_KEY, 1, b"{}"),
            _open_envelope,
            InvalidEnvelope,
        ),
        Case("anchor", encode_anchor({RECORD_KEY: 4}), decode_anchor, RollbackAnchorInvalid),
        Case(
            "anchor.records.0",
            encode_anchor({RECORD_KEY: 4}),
            decode_anchor,
            RollbackAnchorInvalid,
            ("records", 0),
        ),
        Case("ledger", _ledger(), WorkflowOperationLedger.from_json, InvalidLedgerEncoding),
        Case(
            "ledger.operations.0",
            _ledger(),
            WorkflowOperationLedger.from_json,
            InvalidLedgerEncoding,
            ("operations", 0),
            {"compensation": (lambda ledger: ledger.operation("op-1").compensation, None)},
        ),
        Case(
            "ledger.operations.0.compensation",
            _ledger(),
            WorkflowOperationLedger.from_json,
            InvalidLedgerEncoding,
            ("operations", 0, "compensation"),
        ),
        Case("audit", _audit(), decode_audit, audit_module.AuditRecordInvalid),
        Case(
            "audit.entries.0",
            _audit(),
            decode_audit,
            audit_module.AuditRecordInvalid,
            ("entries", 0),
        ),
    ]


def _decode_grant(data: bytes) -> CapabilityGrant:
    return decode_struct(data, CapabilityGrant)


_GRANT_ALONE: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "max_compensations": (lambda g: g.max_compensations, 0),
    "resources": (lambda g: g.resources, ()),
}

CASES = _message_cases() + _stored_cases()


def _object_at(tree: Any, path: Path) -> dict[str, Any]:
    node = tree
    for step in path:
        node = node[step]
    assert isinstance(node, dict)
    return node


def _without(document: bytes, path: Path, key: str) -> bytes:
    tree = json.loads(document)
    del _object_at(tree, path)[key]
    return json.dumps(tree, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_field_without_a_stated_default_is_required(case: Case) -> None:
    case.decode(case.document)  # the whole document is valid
    keys = list(_object_at(json.loads(case.document), case.path))
    assert set(case.optional) <= set(keys), "every optional field is present in the document"
    for key in keys:
        reduced = _without(case.document, case.path, key)
        if key in case.optional:
            read, default = case.optional[key]
            assert read(case.decode(reduced)) == default, key
        else:
            with pytest.raises(case.error):
                case.decode(reduced)


def test_every_message_type_is_covered() -> None:
    tags = {variant.__struct_config__.tag for variant in typing.get_args(WorkerMessage)}
    # A new message type needs its own entry in MESSAGE_CASES (and its audit).
    assert tags == set(MESSAGE_CASES), "MESSAGE_CASES must cover every WorkerMessage variant"


def test_a_grant_without_max_calls_is_a_serialization_error() -> None:
    # Absent max_calls is never read as the default 1.
    text = (
        '{"tool":"release.publish","format":"json","max_input_bytes":1024,"max_output_bytes":2048}'
    )
    with pytest.raises(SerializationError):
        decode_struct(text, CapabilityGrant)
    manifest = (
        '{"type":"open_session","manifest":{"protocol_version":5,"session_id":"session-1",'
        '"grants":[' + text + "]}}"
    )
    with pytest.raises(SerializationError):
        decode_message(manifest)


def test_the_constructor_keeps_the_w61_defaults() -> None:
    assert CapabilityGrant("t", "json") == CapabilityGrant("t", "json", 1, 16384, 65536, 0, ())
    assert CapabilityGrant("t", "text", 5) == CapabilityGrant("t", "text", 5, 16384, 65536)
    assert CapabilityGrant("t", "text", max_output_bytes=9).max_output_bytes == 9
    assert CapabilityGrant("t", "text", max_output_bytes=9).max_calls == 1
    assert CapabilityGrant(tool="t", format="json", max_input_bytes=7).max_input_bytes == 7
    assert CapabilityGrant.text("t").max_calls == 1


def test_attenuations_have_only_optional_fields() -> None:
    assert decode_struct("{}", GrantAttenuation) == GrantAttenuation()
    assert decode_struct("{}", ManifestAttenuation) == ManifestAttenuation()
