"""The worker operation journal: durable deduplication as a pure view.

This module owns the journal's rules and nothing else:

* the row documents (``JournalRow``) and their strict decoding;
* ``WorkerOperationJournal``, a synchronous view over the rows the store
  loaded for the keys a handler asks about, with the admission, observation,
  compensation and reconciliation rules, the compensation lookup included;
* the ``JournalChangeset`` the view yields for the store to commit.

It must never do I/O, import asyncio or a store, call an adapter, or check an
authorization token's provenance (the journal accepts tokens from any
authorizer instance, which is how a later session recovers earlier work).
Every mutator is all-or-nothing: it builds a candidate record, validates it
completely (size included) and only then replaces the view's record.

The journal stores fingerprints of inputs, never raw input; it does store
terminal payloads and failure messages so that a duplicate can be answered.
Reprs show tool, key and state kind only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from octo_common.codec import decode_struct, encode_struct
from octo_common.digest import worker_input_fingerprint
from octo_common.errors import (
    CompensationIdentityMismatch,
    CompensationRequiresSucceededOperation,
    CompensationToolMismatch,
    InvalidCompensationGrantFingerprint,
    InvalidOperationFingerprint,
    InvalidWorkerCompensationTransition,
    InvalidWorkerOperationTransition,
    JournalKeyNotLoaded,
    OperationIdentityMismatch,
    OperationJournalScopeMismatch,
    OperationRecordTooLarge,
    RecordLocationMismatch,
    UnknownCompensation,
    UnknownOperation,
    UnknownTool,
    UnsupportedOperationJournalVersion,
)
from octo_common.ids import is_fingerprint, validate_compensation_key, validate_token
from octo_common.limits import (
    MAX_WORKER_OPERATION_RECORD_BYTES,
    WORKER_OPERATION_JOURNAL_FORMAT_VERSION,
)
from octo_common.states import (
    TERMINAL_KINDS,
    OperationStatus,
    Pending,
    StateKind,
    WorkerOperationState,
    accepts,
    validate_operation_status_for_grant,
    validate_state_for_grant,
)

if TYPE_CHECKING:
    from octo_common.authorizer import (
        AuthorizedCompensationReconciliation,
        AuthorizedOperationCompensation,
        AuthorizedOperationInvocation,
        AuthorizedOperationReconciliation,
    )
    from octo_common.grants import CapabilityGrant
    from octo_common.messages import (
        CompensationReconcileRequest,
        OperationCompensationRequest,
        OperationDispatchRequest,
        OperationReconcileRequest,
    )

__all__ = [
    "Dispatch",
    "Existing",
    "JournalChangeset",
    "JournalRowChange",
    "WorkerCompensationRecord",
    "WorkerOperationJournal",
    "WorkerOperationRecord",
    "unresolved_record",
    "validate_record",
]

_SCOPE_FIELD = "operation journal scope"


# Records --------------------------------------------------------------------


class WorkerCompensationRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The single compensation attached to a succeeded operation."""

    compensation_key: str
    input_fingerprint: str
    grant_fingerprint: str
    state: WorkerOperationState

    def __repr__(self) -> str:
        return (
            f"WorkerCompensationRecord(compensation_key={self.compensation_key!r}, "
            f"state={_kind_text(self.state)})"
        )


class WorkerOperationRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One journal row's record: an operation key, its identity and its state.

    ``compensation`` is always written (``null`` when absent) and may be
    absent on decode, meaning None.
    """

    tool: str
    operation_key: str
    input_fingerprint: str
    state: WorkerOperationState
    compensation: WorkerCompensationRecord | None = None

    def __repr__(self) -> str:
        comp = "None" if self.compensation is None else _kind_text(self.compensation.state)
        return (
            f"WorkerOperationRecord(tool={self.tool!r}, operation_key={self.operation_key!r}, "
            f"state={_kind_text(self.state)}, compensation={comp})"
        )

    def to_row_json(self, scope: str) -> bytes:
        """Validate this record for ``scope``, then encode its row."""
        return validate_record(scope, self)

    @classmethod
    def from_row_json(cls, text: bytes | str, scope: str, key: str) -> WorkerOperationRecord:
        """Decode a row stored at (``scope``, ``key``), checks in a fixed order.

        Size before parsing; strict parse (unknown keys rejected); format
        version; scope; location; then record validation.
        """
        size = _text_size(text)
        if size > MAX_WORKER_OPERATION_RECORD_BYTES:
            raise OperationRecordTooLarge(size, MAX_WORKER_OPERATION_RECORD_BYTES)
        row = decode_struct(text, _JournalRow)
        if row.format_version != WORKER_OPERATION_JOURNAL_FORMAT_VERSION:
            raise UnsupportedOperationJournalVersion(row.format_version)
        if row.scope != scope:
            raise OperationJournalScopeMismatch(scope, row.scope)
        if row.record.operation_key != key:
            raise RecordLocationMismatch(key, row.record.operation_key)
        validate_record(scope, row.record)
        return row.record


class _JournalRow(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The stored row document ``{"format_version":2,"scope":...,"record":{...}}``."""

    format_version: Annotated[int, msgspec.Meta(ge=0, le=255)]
    scope: str
    record: WorkerOperationRecord


def unresolved_record(record: WorkerOperationRecord) -> bool:
    """The operation, or its compensation, is ``pending`` or ``running``."""
    if record.state.kind not in TERMINAL_KINDS:
        return True
    compensation = record.compensation
    return compensation is not None and compensation.state.kind not in TERMINAL_KINDS


def _kind_text(state: Any) -> str:
    kind = getattr(state, "kind", None)
    return str(kind.value) if isinstance(kind, StateKind) else "?"


def _text_size(text: bytes | str) -> int:
    if isinstance(text, str):
        # Measure what the store would hold; a lone surrogate fails at parse.
        return len(text.encode("utf-8", "surrogatepass"))
    return len(text)


# The row documents of the records validated last, by record identity (each
# entry keeps its record alive, so an id is not reused while remembered). A
# view validates every candidate before it changes, and the store validates
# the same record object again when it commits it. Records are immutable all
# the way down (frozen structs, immutable payloads), so the same object under
# the same scope always validates to the same document.
_VALIDATED: OrderedDict[int, tuple[WorkerOperationRecord, str, bytes]] = OrderedDict()
_VALIDATED_MAX = 256


def validate_record(scope: str, record: WorkerOperationRecord) -> bytes:
    """Record validation in order; returns the compact row document.

    1. scope token; 2. tool and operation key tokens; 3. input fingerprint;
    4. state; 5. a compensation requires a succeeded operation; 6. the
    compensation's key, fingerprints and state; 7. the row size.

    A record object that passed under the same scope a moment ago is not
    checked again: its remembered document is returned.
    """
    remembered = _VALIDATED.get(id(record))
    if remembered is not None and remembered[0] is record and remembered[1] == scope:
        return remembered[2]
    encoded = _validate_record(scope, record)
    _VALIDATED[id(record)] = (record, scope, encoded)
    if len(_VALIDATED) > _VALIDATED_MAX:
        _VALIDATED.popitem(last=False)
    return encoded


def _validate_record(scope: str, record: WorkerOperationRecord) -> bytes:
    validate_token(_SCOPE_FIELD, scope)
    validate_token("tool", record.tool)
    validate_token("operation key", record.operation_key)
    if not is_fingerprint(record.input_fingerprint):
        raise InvalidOperationFingerprint()
    record.state.validate()
    comp = record.compensation
    if comp is not None:
        if record.state.kind is not StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(record.operation_key, record.state.kind)
        validate_compensation_key(comp.compensation_key)
        if not is_fingerprint(comp.input_fingerprint):
            raise InvalidOperationFingerprint()
        if not is_fingerprint(comp.grant_fingerprint):
            raise InvalidCompensationGrantFingerprint()
        comp.state.validate()
    encoded = encode_struct(_JournalRow(WORKER_OPERATION_JOURNAL_FORMAT_VERSION, scope, record))
    if len(encoded) > MAX_WORKER_OPERATION_RECORD_BYTES:
        raise OperationRecordTooLarge(len(encoded), MAX_WORKER_OPERATION_RECORD_BYTES)
    return encoded


# Outcomes and change sets ---------------------------------------------------


class Dispatch(msgspec.Struct, frozen=True):
    """Admission outcome: the key is new; the caller commits, then runs the adapter once."""


class Existing(msgspec.Struct, frozen=True):
    """Admission or lookup outcome: the key is known; answer from ``state``, never rerun."""

    state: WorkerOperationState

    def __repr__(self) -> str:
        return f"Existing(state={_kind_text(self.state)})"


class JournalRowChange(msgspec.Struct, frozen=True):
    """A row to write, with the revision it was loaded at (None: a new row)."""

    record: WorkerOperationRecord
    base_revision: int | None


class JournalChangeset(msgspec.Struct, frozen=True):
    """Every row a view created or changed, keyed by operation key, for one commit."""

    scope: str
    rows: dict[str, JournalRowChange]

    def __bool__(self) -> bool:
        return bool(self.rows)


_MISSING: Any = object()


# The view -------------------------------------------------------------------


class WorkerOperationJournal:
    """A pure view over the loaded rows of one tenant scope.

    ``records`` maps each loaded operation key to ``(record, revision)`` or
    to None when the key has no row; ``revision`` is the scope revision at
    which the row was last written. Asking about any other key raises
    ``JournalKeyNotLoaded`` (a programming error, never a protocol answer).
    """

    __slots__ = ("_base", "_changed", "_records", "_scope")

    def __init__(
        self,
        scope: str,
        records: Mapping[str, tuple[WorkerOperationRecord, int] | None],
    ) -> None:
        validate_token(_SCOPE_FIELD, scope)
        self._scope = scope
        self._records: dict[str, WorkerOperationRecord | None] = {}
        self._base: dict[str, int | None] = {}
        self._changed: dict[str, WorkerOperationRecord] = {}
        for key, loaded in records.items():
            if loaded is None:
                self._records[key] = None
                self._base[key] = None
                continue
            record, revision = loaded
            if record.operation_key != key:
                raise RecordLocationMismatch(key, record.operation_key)
            self._records[key] = record
            self._base[key] = revision

    def __repr__(self) -> str:
        return (
            f"WorkerOperationJournal(scope={self._scope!r}, loaded={len(self._records)}, "
            f"changed={len(self._changed)})"
        )

    # Reading --------------------------------------------------------------

    @property
    def scope(self) -> str:
        return self._scope

    def operation(self, key: str) -> WorkerOperationRecord | None:
        """The record for ``key``, or None when the loaded key has no row."""
        return self._loaded(key)

    def validate_scope(self, expected: str) -> None:
        """``expected`` must be a token and equal this journal's scope."""
        validate_token(_SCOPE_FIELD, expected)
        if expected != self._scope:
            raise OperationJournalScopeMismatch(expected, self._scope)

    def changeset(self) -> JournalChangeset:
        """Every row created or changed since loading, with its base revision."""
        return JournalChangeset(
            self._scope,
            {
                key: JournalRowChange(record, self._base[key])
                for key, record in self._changed.items()
            },
        )

    def rebase(self, revision: int) -> None:
        """Record that the store committed this view's changeset at ``revision``.

        Afterwards the changeset is empty and every row written by that
        commit has ``revision`` as its base, so the same view can build the
        next commit of the same handling (admission, then observation).
        """
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise ValueError("a committed revision is a positive integer")
        for key in self._changed:
            self._base[key] = revision
        self._changed = {}

    # Operations ---------------------------------------------------

    def admit(self, auth: AuthorizedOperationInvocation) -> Dispatch | Existing:
        """Admit an authorized dispatch: ``Dispatch()`` for a new key (a pending row
        is recorded), ``Existing(state)`` for a known one (nothing changes)."""
        request = auth.request
        key = request.operation_key
        current = self._loaded(key)
        fingerprint = auth.input_fingerprint
        existing = self._existing_operation(current, request, auth.grant, fingerprint)
        if existing is not None:
            return existing
        candidate = WorkerOperationRecord(request.tool, key, fingerprint, Pending(), None)
        self._replace(key, candidate)
        return Dispatch()

    def observe(
        self, auth: AuthorizedOperationInvocation, status: OperationStatus
    ) -> WorkerOperationState:
        """Record the adapter's status for an admitted key; returns the new state."""
        request = auth.request
        key = request.operation_key
        current = self._loaded(key)
        validate_operation_status_for_grant(status, auth.grant)
        fingerprint = auth.input_fingerprint
        if current is None:
            raise UnknownOperation(key)
        if current.tool != request.tool or current.input_fingerprint != fingerprint:
            raise OperationIdentityMismatch(key)
        self._check_operation_transition(key, current.state, status)
        if status == current.state:
            return current.state
        self._replace(key, msgspec.structs.replace(current, state=status))
        return status

    def validate_reconciliation(self, auth: AuthorizedOperationReconciliation) -> None:
        """The key is known under the same tool and its state fits the current grant."""
        self._reconcilable(auth.request, auth.grant)

    def observe_reconciliation(
        self, auth: AuthorizedOperationReconciliation, status: OperationStatus
    ) -> WorkerOperationState:
        """Record a reconciliation lookup; the row joins the changeset even unchanged."""
        request = auth.request
        key = request.operation_key
        current = self._reconcilable(request, auth.grant)
        validate_operation_status_for_grant(status, auth.grant)
        self._check_operation_transition(key, current.state, status)
        candidate = (
            current if status == current.state else msgspec.structs.replace(current, state=status)
        )
        self._replace(key, candidate)
        return candidate.state

    # Compensation -------------------------------------------------

    def admit_compensation(self, auth: AuthorizedOperationCompensation) -> Dispatch | Existing:
        """Admit the one compensation of a succeeded original: ``Dispatch()`` attaches a
        pending compensation, ``Existing(state)`` answers a known identical one."""
        request = auth.request
        key = request.operation_key
        original = self._loaded(key)
        fingerprint, existing = self._existing_compensation(original, request, auth.grant)
        if existing is not None:
            return existing
        assert original is not None  # _existing_compensation raised otherwise
        candidate = msgspec.structs.replace(
            original,
            compensation=WorkerCompensationRecord(
                request.compensation_key, fingerprint, request.grant_fingerprint, Pending()
            ),
        )
        self._replace(key, candidate)
        return Dispatch()

    def observe_compensation(
        self, auth: AuthorizedOperationCompensation, status: OperationStatus
    ) -> WorkerOperationState:
        """Record the adapter's status for an admitted compensation; returns the new state."""
        request = auth.request
        key = request.operation_key
        original = self._loaded(key)
        validate_operation_status_for_grant(status, auth.grant)
        self._check_compensation_scope(request.tenant_scope)
        fingerprint = worker_input_fingerprint(request.payload)
        if original is None:
            raise UnknownOperation(key)
        if original.tool != request.tool:
            raise CompensationToolMismatch(key)
        comp = original.compensation
        if comp is None:
            raise UnknownCompensation(key)
        self._check_compensation_identity(key, comp, request, fingerprint)
        self._check_compensation_transition(key, comp.state, status)
        if status == comp.state:
            return comp.state
        candidate = msgspec.structs.replace(
            original, compensation=msgspec.structs.replace(comp, state=status)
        )
        self._replace(key, candidate)
        return status

    # Compensation reconciliation ---------------------------------------

    def validate_compensation_reconciliation(
        self, auth: AuthorizedCompensationReconciliation
    ) -> None:
        """The key holds a compensation with exactly this identity, and its state
        fits the current grant. Nothing changes."""
        self._compensation_reconcilable(auth.request, auth.grant)

    def observe_compensation_reconciliation(
        self, auth: AuthorizedCompensationReconciliation, status: OperationStatus
    ) -> WorkerOperationState:
        """Record a compensation lookup; the row joins the changeset even unchanged.

        A ``pending`` or ``running`` compensation moves to the observed state;
        a terminal one only accepts itself (``InvalidWorkerCompensationTransition``).
        The original operation never changes.
        """
        request = auth.request
        key = request.operation_key
        original, comp = self._compensation_reconcilable(request, auth.grant)
        validate_operation_status_for_grant(status, auth.grant)
        self._check_compensation_transition(key, comp.state, status)
        if status == comp.state:
            self._replace(key, original)
            return comp.state
        changed = msgspec.structs.replace(comp, state=status)
        self._replace(key, msgspec.structs.replace(original, compensation=changed))
        return status

    # Read-only lookups for duplicate frames --------------------

    def lookup_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant | None
    ) -> Existing:
        """The stored state for a duplicate dispatch frame (never mutates)."""
        key = request.operation_key
        current = self._loaded(key)
        if grant is None:
            raise UnknownTool(request.tool)
        existing = self._existing_operation(
            current, request, grant, worker_input_fingerprint(request.payload)
        )
        if existing is None:
            raise UnknownOperation(key)
        return existing

    def lookup_reconciliation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant | None
    ) -> Existing:
        """The stored state for a duplicate reconciliation frame (never mutates)."""
        self._loaded(request.operation_key)
        if grant is None:
            raise UnknownTool(request.tool)
        return Existing(self._reconcilable(request, grant).state)

    def lookup_compensation(
        self, request: OperationCompensationRequest, grant: CapabilityGrant | None
    ) -> Existing:
        """The stored compensation state for a duplicate compensation frame (never mutates)."""
        key = request.operation_key
        original = self._loaded(key)
        if grant is None:
            raise UnknownTool(request.tool)
        _, existing = self._existing_compensation(original, request, grant)
        if existing is None:
            raise UnknownCompensation(key)
        return existing

    def lookup_compensation_reconciliation(
        self, request: CompensationReconcileRequest, grant: CapabilityGrant | None
    ) -> Existing:
        """The stored compensation state for a duplicate compensation lookup (never mutates)."""
        self._loaded(request.operation_key)
        if grant is None:
            raise UnknownTool(request.tool)
        _, comp = self._compensation_reconcilable(request, grant)
        return Existing(comp.state)

    # Internals --------------------------------------------------------------

    def _loaded(self, key: str) -> WorkerOperationRecord | None:
        record = self._records.get(key, _MISSING)
        if record is _MISSING:
            raise JournalKeyNotLoaded(key)
        return record  # type: ignore[no-any-return]

    def _replace(self, key: str, candidate: WorkerOperationRecord) -> None:
        # Validation (size included) happens before the view changes at all.
        validate_record(self._scope, candidate)
        self._records[key] = candidate
        self._changed[key] = candidate

    @staticmethod
    def _existing_operation(
        current: WorkerOperationRecord | None,
        request: OperationDispatchRequest,
        grant: CapabilityGrant,
        fingerprint: str,
    ) -> Existing | None:
        """``admit`` steps 1-2: None when the key has no record.

        ``fingerprint`` is the request's input fingerprint, computed once by the caller.
        """
        if current is None:
            return None
        if current.tool != request.tool or current.input_fingerprint != fingerprint:
            raise OperationIdentityMismatch(request.operation_key)
        validate_state_for_grant(current.state, grant)
        return Existing(current.state)

    def _reconcilable(
        self, request: OperationReconcileRequest, grant: CapabilityGrant
    ) -> WorkerOperationRecord:
        """``validate_reconciliation`` steps 1-3; returns the record."""
        key = request.operation_key
        current = self._loaded(key)
        if current is None:
            raise UnknownOperation(key)
        if current.tool != request.tool:
            raise OperationIdentityMismatch(key)
        validate_state_for_grant(current.state, grant)
        return current

    def _existing_compensation(
        self,
        original: WorkerOperationRecord | None,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
    ) -> tuple[str, Existing | None]:
        """``admit_compensation`` steps 1-6: (input fingerprint, Existing or None)."""
        key = request.operation_key
        self._check_compensation_scope(request.tenant_scope)
        fingerprint = worker_input_fingerprint(request.payload)
        if original is None:
            raise UnknownOperation(key)
        if original.tool != request.tool:
            raise CompensationToolMismatch(key)
        if original.state.kind is not StateKind.SUCCEEDED:
            raise CompensationRequiresSucceededOperation(key, original.state.kind)
        comp = original.compensation
        if comp is None:
            return fingerprint, None
        self._check_compensation_identity(key, comp, request, fingerprint)
        validate_state_for_grant(comp.state, grant)
        return fingerprint, Existing(comp.state)

    def _compensation_reconcilable(
        self, request: CompensationReconcileRequest, grant: CapabilityGrant
    ) -> tuple[WorkerOperationRecord, WorkerCompensationRecord]:
        """``validate_compensation_reconciliation``: (original, its compensation).

        The checks of ``observe_compensation`` without an input (a lookup
        carries no payload): scope, original, tool, compensation, then its key
        and grant fingerprint; then the stored state against ``grant``.
        """
        key = request.operation_key
        original = self._loaded(key)
        self._check_compensation_scope(request.tenant_scope)
        if original is None:
            raise UnknownOperation(key)
        if original.tool != request.tool:
            raise CompensationToolMismatch(key)
        comp = original.compensation
        if comp is None:
            raise UnknownCompensation(key)
        if (
            comp.compensation_key != request.compensation_key
            or comp.grant_fingerprint != request.grant_fingerprint
        ):
            raise CompensationIdentityMismatch(key)
        validate_state_for_grant(comp.state, grant)
        return original, comp

    def _check_compensation_scope(self, tenant_scope: str) -> None:
        self.validate_scope(tenant_scope)

    @staticmethod
    def _check_compensation_identity(
        key: str,
        comp: WorkerCompensationRecord,
        request: OperationCompensationRequest,
        fingerprint: str,
    ) -> None:
        if (
            comp.compensation_key != request.compensation_key
            or comp.input_fingerprint != fingerprint
            or comp.grant_fingerprint != request.grant_fingerprint
        ):
            raise CompensationIdentityMismatch(key)

    @staticmethod
    def _check_operation_transition(
        key: str, current: WorkerOperationState, observed: OperationStatus
    ) -> None:
        # `pending` is never an observation, whatever the table says.
        if observed.kind is StateKind.PENDING or not accepts(current, observed):
            raise InvalidWorkerOperationTransition(key, current.kind, observed.kind)

    @staticmethod
    def _check_compensation_transition(
        key: str, current: WorkerOperationState, observed: OperationStatus
    ) -> None:
        # The one transition table; `pending` is never an observation.
        if observed.kind is StateKind.PENDING or not accepts(current, observed):
            raise InvalidWorkerCompensationTransition(key, current.kind, observed.kind)
