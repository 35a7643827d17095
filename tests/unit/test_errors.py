"""The error hierarchy: names, groups, codes, positional fields and error text.

The class lists below are written out by hand, group by group (a class that
both sides raise is in the protocol's or the worker's group).
"""

from __future__ import annotations

import pickle
import re

import pytest

from octo_common import errors
from octo_common.errors import OctoError

# name -> positional fields, per group, as the spec tables list them.
PROTOCOL: dict[str, tuple[str, ...]] = {
    "UnsupportedVersion": ("actual",),
    "InvalidToken": ("field", "value"),
    "InvalidKeyNonce": (),
    "InvalidScopeKey": ("reason",),
    "DuplicateGrant": ("tool",),
    "InvalidGrant": ("reason",),
    "TooManyGrants": ("maximum",),
    "TooManyResources": ("maximum",),
    "AttenuationWidensLimits": (),
    "AttenuationExpandsResources": (),
    "UnknownSession": ("session_id",),
    "UnknownTool": ("tool",),
    "InvalidSessionKeyLength": ("actual", "expected"),
    "WeakSessionKey": (),
    "InvalidSequence": (),
    "SequenceExhausted": (),
    "DuplicateFrame": ("sequence", "message"),
    "StaleFrame": ("sequence", "highest"),
    "InvalidAuthenticatorState": (),
    "InvalidAuthenticationTag": (),
    "AuthorizationProvenanceMismatch": (),
    "DuplicateRequest": ("request_id",),
    "SessionRequestLimitExceeded": ("maximum",),
    "DuplicateResult": ("request_id",),
    "CancellationIdMatchesRequest": (),
    "OperationResultMismatch": (),
    "InvalidCompensationKey": ("value",),
    "InvalidCompensationGrantFingerprint": (),
    "CompensationNotGranted": ("tool",),
    "CompensationBudgetExhausted": ("tool", "maximum"),
    "CompensationGrantMismatch": (),
    "CompensationResultMismatch": (),
    "PayloadFormatMismatch": ("expected", "actual"),
    "InvalidJsonEnvelope": (),
    "JsonPayloadTooDeep": ("maximum",),
    "InvalidOperationFailure": (),
    "OperationFailureTooLarge": ("actual", "maximum"),
    "InputTooLarge": ("actual", "maximum"),
    "OutputTooLarge": ("actual", "maximum"),
    "CallBudgetExhausted": ("tool", "maximum"),
    "RequestMismatch": ("expected", "actual"),
    "WireFrameTooLarge": ("actual", "maximum"),
    "SerializationError": ("detail",),
}

JOURNAL: dict[str, tuple[str, ...]] = {
    "UnsupportedOperationJournalVersion": ("version",),
    "OperationRecordTooLarge": ("actual", "maximum"),
    "OperationJournalScopeMismatch": ("expected", "actual"),
    "InvalidOperationFingerprint": (),
    "RecordLocationMismatch": ("expected", "actual"),
    "JournalKeyNotLoaded": ("key",),
    "UnknownOperation": ("key",),
    "OperationPruned": ("key",),
    "OperationIdentityMismatch": ("key",),
    "InvalidWorkerOperationTransition": ("operation_key", "current", "observed"),
    "CompensationToolMismatch": ("key",),
    "CompensationRequiresSucceededOperation": ("operation_key", "state"),
    "UnknownCompensation": ("operation_key",),  # the field named operation_key
    "CompensationIdentityMismatch": ("key",),
    "InvalidWorkerCompensationTransition": ("operation_key", "current", "observed"),
}

WORKER: dict[str, tuple[str, ...]] = {
    "ZeroPerToolReconciliationLimit": (),
    "ZeroSessionReconciliationLimit": (),
    "InvalidTool": ("tool",),
    "DuplicateTool": ("tool",),
    "RequiresWorkerAuthenticator": (),
    "UnexpectedOpeningMessage": (),
    "MissingAdapter": ("tool",),
    "InvalidJournalLease": (),
    "SessionReplay": ("session_id",),
    "SessionClosed": ("session_id",),
    "SessionPoisoned": (),
    "JournalPersistenceFailed": ("cause",),
    "InvalidJournalRevision": ("expected", "actual"),
    "InvocationSafetyNotDeclared": ("tool",),
    "DurableOperationContractNotDeclared": ("tool",),
    "AdapterError": ("tool", "kind"),
    "IndeterminateOperation": ("operation_key", "cause"),
    "IndeterminateCompensation": ("operation_key", "compensation_key", "cause"),
    "PendingOperation": ("key",),
    "PendingCompensation": ("key",),
    "ReconciliationBudgetExhausted": ("tool", "maximum"),
    "ReconciliationSessionBudgetExhausted": ("maximum",),
    "UnexpectedMessage": ("kind",),
    "UnsupportedMessage": ("kind",),
    "ScopeMismatch": (),
    "InvalidFrameHeaders": (),
}

ADAPTER: dict[str, tuple[str, ...]] = {
    "AdapterUnsupported": ("method",),
    "AdapterInvalidJsonInput": (),
    "AdapterInvalidJsonOutput": (),
    "AdapterFailed": (),
    "AdapterIndeterminate": ("detail",),
}

LEDGER: dict[str, tuple[str, ...]] = {
    "LedgerTooLarge": (),
    "LedgerEncodingError": (),
    "InvalidLedgerEncoding": (),
    "UnsupportedLedgerVersion": ("version",),
    "InvalidPlanFingerprint": (),
    "TooManyOperations": (),
    "RevisionExhausted": (),
    "StaleRevision": ("actual", "minimum"),
    "EmptyOperationNonce": (),
    "OperationNonceTooLarge": ("actual", "maximum"),
    "InvalidStepId": ("step_id",),
    "InvalidOperationKey": ("key",),
    "InvalidInputFingerprint": (),
    "InputFingerprintMismatch": ("key",),
    "OperationBindingMismatch": ("key",),
    "InvalidCompensationTenantScope": ("scope",),
    "CompensationGrantDenied": ("tool", "tenant_scope"),
    "CompensationActionDenied": ("operation_key", "tool", "tenant_scope"),
    "CompensationInputFingerprintMismatch": ("compensation_key",),
    "CompensationAlreadyRecorded": ("operation_key",),
    "CompensationPolicyMismatch": ("key",),
    "CompensationRequestMismatch": (),
    "CompensationDispatchRequiresHostAuthenticator": (),
    "UnexpectedCompensationMessage": (),
    "InvalidCompensationStateTransition": ("compensation_key", "current", "observed"),
    "DuplicateOperationKey": ("key",),
    "PlanMismatch": (),
    "UnknownStep": ("step_id",),
    "ReconciliationMismatch": (),
    "ReconciliationRequiresHostAuthenticator": (),
    "OperationDispatchRequiresHostAuthenticator": (),
    "UnexpectedOperationDispatchMessage": (),
    "UnexpectedReconciliationMessage": (),
    "InvalidStateTransition": ("current", "observed"),
    "WorkerRequestRejected": ("rejection",),
}

WORKFLOW: dict[str, tuple[str, ...]] = {
    "PlanOwnershipMismatch": (),
    "ApprovalMismatch": (),
    "EmptyPlan": (),
    "TooManySteps": ("maximum",),
    "PlanSourceTooLarge": ("actual", "maximum"),
    "DuplicateStepId": ("step_id",),
}

STORAGE: dict[str, tuple[str, ...]] = {
    "InvalidStorageKey": (),
    "InvalidKeyId": (),
    "InvalidRecordNamespace": (),
    "InvalidRecordName": (),
    "DuplicateKeyId": ("key_id",),
    "UnknownKeyId": ("key_id",),
    "ActiveKeyCannotBeRetired": (),
    "PayloadTooLarge": ("actual", "maximum"),
    "RecordTooLarge": ("actual", "maximum"),
    "EnvelopeEncodingError": (),
    "InvalidEnvelope": (),
    "UnsupportedRecordFormat": ("version",),
    "InvalidRevision": (),
    "RevisionMismatch": ("backend", "envelope"),
    "InvalidRecordAuthenticationTag": (),
    "RollbackDetected": ("record_revision", "revision_floor"),
    "RevisionFloorMismatch": ("record_revision", "revision_floor"),
    "WriteConflict": ("expected", "actual", "revision_floor"),
    "InvalidReplacementRevision": ("expected", "actual"),
    "FencingRequired": ("current",),
    "InvalidFencingToken": (),
    "FencingTokenRejected": ("current", "supplied"),
    "FencingTokenExhausted": (),
    "RollbackAnchorMissing": (),
    "RollbackAnchorInvalid": (),
    "StorageBackendError": ("detail",),
}

GROUPS = {
    "ProtocolError": PROTOCOL,
    "JournalError": JOURNAL,
    "WorkerError": WORKER,
    "WorkerAdapterError": ADAPTER,
    "LedgerError": LEDGER,
    "WorkflowError": WORKFLOW,
    "StorageError": STORAGE,
}

ALL = [(group, name, fields) for group, table in GROUPS.items() for name, fields in table.items()]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_group_bases_derive_from_octo_error() -> None:
    for group in GROUPS:
        base = getattr(errors, group)
        assert issubclass(base, OctoError)
        assert base is not OctoError


def test_no_class_is_listed_twice() -> None:
    names = [name for _, name, _ in ALL]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(("group", "name", "fields"), ALL, ids=[n for _, n, _ in ALL])
def test_every_listed_class_exists_in_its_group(
    group: str, name: str, fields: tuple[str, ...]
) -> None:
    cls = getattr(errors, name, None)
    assert cls is not None, f"octo_common.errors.{name} is missing"
    assert issubclass(cls, getattr(errors, group))
    assert issubclass(cls, OctoError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize(("group", "name", "fields"), ALL, ids=[n for _, n, _ in ALL])
def test_code_is_the_snake_case_class_name(group: str, name: str, fields: tuple[str, ...]) -> None:
    cls = getattr(errors, name)
    expected = "serialization" if name == "SerializationError" else _snake(name)
    assert cls.code == expected


@pytest.mark.parametrize(("group", "name", "fields"), ALL, ids=[n for _, n, _ in ALL])
def test_fields_are_positional_and_kept_exactly(
    group: str, name: str, fields: tuple[str, ...]
) -> None:
    cls = getattr(errors, name)
    values = [f"value-{index}" for index in range(len(fields))]
    error = cls(*values)
    for field, value in zip(fields, values, strict=True):
        assert getattr(error, field) == value
    assert error.code == cls.code
    assert isinstance(str(error), str)
    assert isinstance(repr(error), str)


def test_examples_of_codes() -> None:
    assert errors.InvalidAuthenticationTag.code == "invalid_authentication_tag"
    assert errors.CompensationGrantMismatch.code == "compensation_grant_mismatch"
    assert errors.SerializationError.code == "serialization"
    assert errors.SerializationError("x").code == "serialization"
    assert errors.JsonPayloadTooDeep(32).code == "json_payload_too_deep"


def test_errors_pickle_by_value() -> None:
    error = errors.CompensationBudgetExhausted("math.add", 1)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is errors.CompensationBudgetExhausted
    assert (again.tool, again.maximum) == ("math.add", 1)


# Error text: untrusted strings escaped ------------------------------------------------


def test_h15_escaping_example() -> None:
    tool = "\x1b[2J" + "x" * 512
    error = errors.InvalidTool(tool)
    text = str(error)
    assert "\\x1b[2J" in text
    assert "\x1b" not in text
    assert "preview truncated" in text
    assert len(text.encode("utf-8")) < 768
    assert error.tool == tool  # the field keeps the exact value


def test_escaping_rules() -> None:
    text = str(errors.UnknownTool("a\\b`c\u00e9\n"))
    assert "`a\\\\b\\`c\\xc3\\xa9\\x0a`" in text
    short = str(errors.UnknownTool("x" * 96))
    assert "preview truncated" not in short
    long = str(errors.UnknownTool("x" * 97))
    assert "(97 bytes; preview truncated)" in long


def test_untrusted_text_never_reaches_repr_raw() -> None:
    error = errors.InvalidToken("session id", "\x00\x1b]0;pwned\x07")
    for text in (str(error), repr(error)):
        assert "\x1b" not in text
        assert "\x00" not in text
        assert "\x07" not in text


SECRET = "hunter2-secret-value"


@pytest.mark.parametrize(
    "error",
    [
        errors.DuplicateFrame(3, {"payload": SECRET}),
        errors.AdapterIndeterminate(SECRET),
        errors.AdapterFailed(SECRET),
        errors.AdapterInvalidJsonInput(SECRET),
        errors.AdapterInvalidJsonOutput(SECRET),
    ],
    ids=lambda e: type(e).__name__,
)
def test_hidden_fields_never_appear_in_error_text(error: OctoError) -> None:
    for text in (str(error), repr(error), str(error.args), repr(error.args)):
        assert SECRET not in text


def test_duplicate_frame_keeps_its_message_for_programs() -> None:
    message = {"payload": SECRET}
    error = errors.DuplicateFrame(3, message)
    assert error.message is message
    assert error.sequence == 3
    assert "3" in str(error)
