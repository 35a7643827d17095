"""Operator decisions on stuck operations, and their audit record.

When an operation, or a compensation (named by its ``cmp-`` key), stays
``pending`` or ``running`` and no worker answer can settle it (the worker's
journal is lost, a crash cut the adapter and it has no status lookup, the
provider confirms out of band), an operator may decide its state. This module
owns that decision:

* :func:`record_decision` checks it against the ledger (the one transition
  table, on a copy) and appends it to the audit record; then either the
  worker is told (``octo-host resolve``: the decision travels in a sealed
  lookup request, the worker records it in its journal without calling the
  adapter, and its answer is applied to the ledger like a lookup's), or, for
  a key no worker journal holds, :func:`apply_decision` writes the ledger
  alone with compare-and-swap
  (:meth:`~octo_host.ledger.WorkflowOperationLedger.resolve_by_operator`,
  :meth:`~octo_host.ledger.WorkflowOperationLedger.resolve_compensation_by_operator`).
  No effect ever runs or runs again;
* every decision is first appended to the run's audit record
  ``("workflow-audit", RUN)``, an authenticated record in the same
  :class:`~octo_host.store.SqliteLedgerStore` as the ledger, written with
  compare-and-swap so entries are only ever appended: the entry names the
  run, key, previous and new state, operator, reason, UTC time and the
  ledger revision the decision produces.

Order: the audit entry is durable before the ledger changes, so a crash in
between leaves a recorded decision that did not land (``ledger_agrees`` is
false in :func:`load_audit`) and never a ledger change without its entry.

It must never forge a worker answer (no reconcile request/result is built),
resolve a terminal operation or compensation, decide an original that has a
compensation (its compensation is decided instead), rewrite or drop an audit
entry, or log the reason (only ids, states and revisions are logged).
"""

from __future__ import annotations

import datetime
import unicodedata
from dataclasses import dataclass
from typing import Annotated

import msgspec

from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import OctoError, UnknownOperation
from octo_common.limits import MAX_WORKFLOW_OPERATIONS
from octo_common.records import StorageRecordKey
from octo_common.runtime.logs import library_logger
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.ledger import WorkflowOperationLedger
from octo_host.plan import WorkflowPlan
from octo_host.store import AuthenticatedStore, ledger_record_key

__all__ = [
    "AUDIT_NAMESPACE",
    "AuditEntry",
    "AuditRecordInvalid",
    "AuditedEntry",
    "ResolutionRefused",
    "audit_record_key",
    "apply_decision",
    "check_decision",
    "load_audit",
    "record_decision",
    "resolve_operation",
]

AUDIT_NAMESPACE = "workflow-audit"
AUDIT_FORMAT_VERSION = 1
MAX_REASON_BYTES = 1024
MAX_OPERATOR_CHARS = 128
# Each operation can be resolved at most once (the state is terminal afterwards).
MAX_AUDIT_ENTRIES = MAX_WORKFLOW_OPERATIONS


class ResolutionRefused(OctoError):
    """An operator decision that the ledger's rules do not allow (nothing changed)."""

    _fields = ("operation_key", "reason")
    _text = "operator resolution refused"
    operation_key: str
    reason: str

    def __str__(self) -> str:
        return f"resolution of {self.operation_key} refused: {self.reason}"


class AuditRecordInvalid(OctoError):
    """The audit record authenticated but does not hold a valid audit document."""

    _fields = ("detail",)
    _text = "invalid audit record"
    detail: str

    def __str__(self) -> str:
        return f"invalid audit record: {self.detail}"


def audit_record_key(run: str) -> StorageRecordKey:
    """The record key of a run's audit record: ``("workflow-audit", run)``."""
    return StorageRecordKey(AUDIT_NAMESPACE, run)


class AuditEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One operator decision, as stored."""

    run: str
    key: str
    from_state: StateKind = msgspec.field(name="from")
    to_state: StateKind = msgspec.field(name="to")
    operator: str
    reason: str
    time: str
    ledger_revision: Annotated[int, msgspec.Meta(ge=1)]

    def __repr__(self) -> str:
        # The reason is operator text: kept out of reprs (and so out of logs).
        return (
            f"AuditEntry(run={self.run!r}, key={self.key!r}, from={self.from_state.value!r}, "
            f"to={self.to_state.value!r}, operator={self.operator!r}, time={self.time!r}, "
            f"ledger_revision={self.ledger_revision})"
        )


class _AuditDoc(msgspec.Struct, forbid_unknown_fields=True):
    format_version: int
    run: str
    entries: list[AuditEntry]


@dataclass(frozen=True)
class AuditedEntry:
    """An entry and whether the stored ledger shows its decision."""

    entry: AuditEntry
    ledger_agrees: bool


def _decode(payload: bytes, run: str) -> list[AuditEntry]:
    doc = decode_struct(payload, _AuditDoc, error=AuditRecordInvalid)
    if doc.format_version != AUDIT_FORMAT_VERSION:
        raise AuditRecordInvalid(f"unsupported format version {doc.format_version}")
    if doc.run != run or any(entry.run != run for entry in doc.entries):
        raise AuditRecordInvalid("the record belongs to another run")
    if len(doc.entries) > MAX_AUDIT_ENTRIES:
        raise AuditRecordInvalid("too many entries")
    return list(doc.entries)


def _encode(run: str, entries: list[AuditEntry]) -> bytes:
    return encode_struct(_AuditDoc(AUDIT_FORMAT_VERSION, run, entries))


def _check_text(operation_key: str, operator: str, reason: str) -> None:
    def printable(text: str) -> bool:
        return all(unicodedata.category(c)[0] != "C" for c in text)

    if not operator or len(operator) > MAX_OPERATOR_CHARS or not printable(operator):
        raise ResolutionRefused(
            operation_key, f"the operator name must be 1..{MAX_OPERATOR_CHARS} printable characters"
        )
    size = len(reason.encode("utf-8", "surrogatepass"))
    if not reason.strip() or size > MAX_REASON_BYTES:
        raise ResolutionRefused(
            operation_key, f"a reason of 1..{MAX_REASON_BYTES} bytes is required"
        )
    try:
        reason.encode("utf-8")
    except UnicodeEncodeError:
        raise ResolutionRefused(operation_key, "the reason is not valid text") from None


def _utc_now() -> str:
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _decided_state(ledger: WorkflowOperationLedger, key: str) -> StateKind | None:
    """The state an entry's key names: an operation's, or a compensation's (``cmp-`` key)."""
    operation = ledger.operation(key)
    if operation is not None:
        return operation.state
    compensated = ledger.compensated_operation(key)
    if compensated is not None and compensated.compensation is not None:
        return compensated.compensation.state
    return None


async def load_audit(store: AuthenticatedStore, run: str) -> list[AuditedEntry]:
    """The run's audit entries, oldest first, each compared with the stored ledger."""
    record = await store.load(audit_record_key(run))
    if record is None:
        return []
    entries = _decode(record.payload, run)
    ledger_record = await store.load(ledger_record_key(run))
    ledger = (
        None if ledger_record is None else WorkflowOperationLedger.from_json(ledger_record.payload)
    )
    audited = []
    for entry in entries:
        state = None if ledger is None else _decided_state(ledger, entry.key)
        agrees = (
            ledger is not None
            and state is not None
            and ledger.revision >= entry.ledger_revision
            and state == entry.to_state
        )
        audited.append(AuditedEntry(entry, agrees))
    return audited


async def record_decision(
    store: AuthenticatedStore,
    run: str,
    operation_key: str,
    state: StateKind | str,
    *,
    operator: str,
    reason: str,
    plan: WorkflowPlan | None = None,
    time: str | None = None,
) -> AuditEntry:
    """Check an operator's decision for a stuck operation or compensation and append
    it to the run's audit record, before anything acts on it.

    ``operation_key`` names an operation, or a compensation by its ``cmp-``
    key. Refuses (``ResolutionRefused``, ``UnknownOperation`` or the ledger's
    transition errors; nothing written) a missing run or key, a terminal
    operation or compensation, an original that has a compensation, a
    non-terminal target state, and an empty reason. The entry names the
    ledger revision the decision produces (the next one). The last entry for
    the key is reused when it holds the same decision and the ledger does not
    show it yet (the same command run again after the worker was not reached).
    """
    decision = await _checked_decision(store, run, operation_key, state, operator, reason, plan)
    what, current, target, candidate, _ = decision
    audit_key = audit_record_key(run)
    audit = await store.load(audit_key)
    entries = [] if audit is None else _decode(audit.payload, run)
    for entry in reversed(entries):
        if entry.key == operation_key:
            if entry.to_state == target and entry.from_state == current:
                return entry
            break
    if len(entries) >= MAX_AUDIT_ENTRIES:
        raise ResolutionRefused(operation_key, "the audit record is full")
    entry = AuditEntry(
        run=run,
        key=operation_key,
        from_state=current,
        to_state=target,
        operator=operator,
        reason=reason,
        time=time or _utc_now(),
        ledger_revision=candidate.revision,
    )
    await store.compare_and_swap(
        audit_key, None if audit is None else audit.revision, _encode(run, [*entries, entry])
    )
    library_logger("octo.host.audit").info(
        f"{what}_decision_audited",
        run=run,
        operation_key=operation_key,
        state_from=current.value,
        state_to=target.value,
    )
    return entry


async def check_decision(
    store: AuthenticatedStore,
    run: str,
    operation_key: str,
    state: StateKind | str,
    *,
    operator: str,
    reason: str,
    plan: WorkflowPlan | None = None,
) -> None:
    """The refusals of :func:`record_decision`, writing nothing (before any broker)."""
    await _checked_decision(store, run, operation_key, state, operator, reason, plan)


async def apply_decision(
    store: AuthenticatedStore, entry: AuditEntry, *, plan: WorkflowPlan | None = None
) -> None:
    """Apply an audited decision to the ledger alone (compare-and-swap): the host's side
    only, for a key no worker journal holds. Refused as :func:`record_decision` refuses
    (the key must still be ``pending`` or ``running``)."""
    decision = await _checked_decision(
        store, entry.run, entry.key, entry.to_state, entry.operator, entry.reason, plan
    )
    what, current, target, candidate, record_revision = decision
    await store.compare_and_swap(
        ledger_record_key(entry.run), record_revision, candidate.to_json().encode("utf-8")
    )
    library_logger("octo.host.audit").info(
        f"{what}_resolved_by_operator",
        run=entry.run,
        operation_key=entry.key,
        state_from=current.value,
        state_to=target.value,
        revision=candidate.revision,
    )


async def resolve_operation(
    store: AuthenticatedStore,
    run: str,
    operation_key: str,
    state: StateKind | str,
    *,
    operator: str,
    reason: str,
    plan: WorkflowPlan | None = None,
    time: str | None = None,
) -> AuditEntry:
    """Decide a stuck operation or compensation on the host alone and audit it:
    :func:`record_decision`, then :func:`apply_decision` (both with compare-and-swap;
    ``WriteConflict`` when someone else wrote first). Nothing is sent to a worker;
    ``octo-host resolve`` sends the decision to the worker's journal too."""
    entry = await record_decision(
        store, run, operation_key, state, operator=operator, reason=reason, plan=plan, time=time
    )
    await apply_decision(store, entry, plan=plan)
    return entry


async def _checked_decision(
    store: AuthenticatedStore,
    run: str,
    operation_key: str,
    state: StateKind | str,
    operator: str,
    reason: str,
    plan: WorkflowPlan | None,
) -> tuple[str, StateKind, StateKind, WorkflowOperationLedger, int]:
    """(what, current state, target, the ledger with the decision applied, the stored
    ledger's revision), or the refusal; nothing is written."""
    try:
        target = StateKind(state)
    except ValueError:
        raise ResolutionRefused(
            operation_key, "the decided state must be succeeded, failed or cancelled"
        ) from None
    _check_text(operation_key, operator, reason)
    record = await store.load(ledger_record_key(run))
    if record is None:
        raise ResolutionRefused(operation_key, f"run {run!r} has no ledger")
    ledger = WorkflowOperationLedger.from_json(record.payload)
    if plan is not None:
        ledger.validate_for(plan)
    operation = ledger.operation(operation_key)
    compensated = ledger.compensated_operation(operation_key) if operation is None else None
    if compensated is not None and compensated.compensation is not None:
        what, current = "compensation", compensated.compensation.state
    elif operation is not None:
        what, current = "operation", operation.state
        compensation = operation.compensation
        if compensation is not None:
            hint = (
                f"; decide its compensation {compensation.compensation_key} instead"
                if compensation.state not in TERMINAL_KINDS
                else ""
            )
            raise ResolutionRefused(operation_key, f"the operation has a compensation{hint}")
    else:
        raise UnknownOperation(operation_key)
    if current in TERMINAL_KINDS:
        raise ResolutionRefused(operation_key, f"the {what} is already {current.value} (terminal)")
    if target not in TERMINAL_KINDS:
        raise ResolutionRefused(operation_key, "the decided state must be terminal")
    candidate = ledger.copy()
    if what == "compensation":
        candidate.resolve_compensation_by_operator(operation_key, target)
    else:
        candidate.resolve_by_operator(operation_key, target)
    return what, current, target, candidate, record.revision
