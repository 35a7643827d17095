"""The host ledger's strict JSON documents: what is read and what is written.

Read: ``LedgerDoc`` (unknown fields refused; a record's ``failure`` code
and a retry's ``retry_of`` and ``attempt`` optional). Written: a record
without a failure code is encoded exactly as before the field existed; one
with a code adds ``"failure"`` last (the ``...Failed`` subclasses); a retry
adds ``"retry_of"`` and ``"attempt"`` after its compensation. Pure structs;
the ledger (``octo_host.ledger``) converts them to and from its records and
checks their syntax.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from octo_common.states import StateKind

__all__ = [
    "CompensationDoc",
    "CompensationOut",
    "CompensationOutFailed",
    "LedgerDoc",
    "LedgerOut",
    "OperationDoc",
    "OperationOut",
    "OperationOutFailed",
]


class CompensationOut(msgspec.Struct):
    compensation_key: str
    input_fingerprint: str
    tenant_scope: str
    grant_fingerprint: str
    state: StateKind


class CompensationOutFailed(CompensationOut, kw_only=True):
    failure: str


class CompensationDoc(CompensationOut, forbid_unknown_fields=True):
    failure: str | None = None


class OperationOut(msgspec.Struct):
    step_id: str
    tool: str
    operation_key: str
    input_fingerprint: str
    state: StateKind
    compensation: CompensationOut | None = None
    # A retry's link to the attempt it replaces, and its number: written only
    # for a retry, so a first attempt is encoded as before they existed.
    retry_of: str | msgspec.UnsetType = msgspec.UNSET
    attempt: int | msgspec.UnsetType = msgspec.UNSET


class OperationOutFailed(OperationOut, kw_only=True):
    failure: str


class OperationDoc(msgspec.Struct, forbid_unknown_fields=True):
    step_id: str
    tool: str
    operation_key: str
    input_fingerprint: str
    state: StateKind
    compensation: CompensationDoc | None = None
    failure: str | None = None
    retry_of: str | None = None
    attempt: Annotated[int, msgspec.Meta(ge=2)] | None = None


class LedgerOut(msgspec.Struct):
    format_version: int
    revision: int
    plan_fingerprint: str
    operations: list[OperationOut]


class LedgerDoc(msgspec.Struct, forbid_unknown_fields=True):
    format_version: Annotated[int, msgspec.Meta(ge=0, le=255)]
    # msgspec bounds stop at int64; the u64 ceiling is checked after decoding.
    revision: Annotated[int, msgspec.Meta(ge=0)]
    plan_fingerprint: str
    operations: list[OperationDoc]
