"""What a session authorizer persists, and the checks a persisted state must pass.

Owns the value types of a :class:`~octo_common.authorizer.SessionAuthorizer`'s
state (:class:`CompensationIdentity`, :class:`RetainedRequestId`, the full
:class:`AuthorizerState` and the fixed-size :class:`AuthorizerCheckpoint` a
commit persists) and the validation ``SessionAuthorizer.restore`` runs on a
state before it builds anything (:func:`restore_counters`,
:func:`restore_identities`, :func:`restore_request_ids`): a state that no
sequence of authorizations can produce raises ``SerializationError``.

This module is pure: values and checks, no I/O, no keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NoReturn

import msgspec

from octo_common.errors import SerializationError
from octo_common.grants import CapabilityManifest
from octo_common.ids import is_fingerprint, is_token
from octo_common.limits import MAX_SESSION_REQUEST_IDS

__all__ = [
    "AuthorizerCheckpoint",
    "AuthorizerState",
    "CompensationIdentity",
    "RetainedRequestId",
    "bad_state",
    "restore_admitted",
    "restore_counters",
    "restore_identities",
    "restore_request_ids",
]

_MAX_U32 = 2**32 - 1


class CompensationIdentity(msgspec.Struct, frozen=True, forbid_unknown_fields=True, order=True):
    """One admitted compensation identity.

    Field order is the sort order of ``AuthorizerState.compensation_identities``.
    """

    tool: str
    operation_key: str
    compensation_key: str
    tenant_scope: str
    grant_fingerprint: str
    input_fingerprint: str


class RetainedRequestId(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A retained request id and whether its result was validated."""

    request_id: str
    completed: bool


class AuthorizerState(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a :class:`SessionAuthorizer` persists except provenance.

    ``calls_by_tool`` and ``compensations_by_tool`` hold only non-zero
    counters, keys sorted; ``compensation_identities`` is sorted;
    ``request_ids`` is in retention order. Every field is required, so a
    strict decode of a persisted document never fills in a missing part.
    """

    calls_by_tool: dict[str, int]
    compensations_by_tool: dict[str, int]
    compensation_identities: tuple[CompensationIdentity, ...]
    request_ids: tuple[RetainedRequestId, ...]


class AuthorizerCheckpoint(msgspec.Struct, frozen=True):
    """What a commit persists of a :class:`SessionAuthorizer` (incremental form).

    The counters and identities as in :class:`AuthorizerState`; the retained
    request ids as their number (``retained``: they are the first
    ``retained`` ids of retention order) and ``completed``, a bitmap whose
    bit ``i`` is set when the ``i``-th retained id has a validated result.
    Its size never depends on how many request ids are retained.
    """

    calls_by_tool: dict[str, int]
    compensations_by_tool: dict[str, int]
    compensation_identities: tuple[CompensationIdentity, ...]
    retained: int
    completed: int


# State validation ---------------------------------------------------------------


def bad_state(detail: str) -> NoReturn:
    raise SerializationError(f"authorizer state: {detail}")


def _is_count(value: object) -> bool:
    return type(value) is int and 0 <= value <= _MAX_U32


def restore_counters(
    manifest: CapabilityManifest, counters: object, name: str, limit: str
) -> dict[str, int]:
    if not isinstance(counters, Mapping):
        bad_state(f"{name} is not a map")
    restored: dict[str, int] = {}
    for tool, count in counters.items():
        if not isinstance(tool, str) or not _is_count(count):
            bad_state(f"{name} holds a malformed entry")
        grant = manifest.grant(tool)
        if grant is None:
            bad_state(f"{name} names a tool without a grant")
        if count > getattr(grant, limit):
            bad_state(f"{name} exceeds the grant's {limit}")
        if count:
            restored[tool] = count
    return restored


def restore_identities(
    manifest: CapabilityManifest, identities: object
) -> set[CompensationIdentity]:
    if not isinstance(identities, Sequence) or isinstance(identities, str | bytes):
        bad_state("compensation_identities is not a list")
    restored: set[CompensationIdentity] = set()
    for identity in identities:
        if not isinstance(identity, CompensationIdentity):
            bad_state("compensation identity is malformed")
        tokens = (identity.tool, identity.operation_key, identity.tenant_scope)
        if not all(isinstance(value, str) and is_token(value) for value in tokens):
            bad_state("compensation identity holds a malformed token")
        key = identity.compensation_key
        if not (isinstance(key, str) and is_token(key) and key.startswith("cmp-")):
            bad_state("compensation identity holds a malformed compensation key")
        fingerprints = (identity.grant_fingerprint, identity.input_fingerprint)
        if not all(isinstance(value, str) and is_fingerprint(value) for value in fingerprints):
            bad_state("compensation identity holds a malformed fingerprint")
        if manifest.grant(identity.tool) is None:
            bad_state("compensation identity names a tool without a grant")
        if identity in restored:
            bad_state("compensation identity repeated")
        restored.add(identity)
    return restored


def restore_request_ids(entries: object) -> dict[str, RetainedRequestId]:
    if not isinstance(entries, Sequence) or isinstance(entries, str | bytes):
        bad_state("request_ids is not a list")
    if len(entries) > MAX_SESSION_REQUEST_IDS:
        bad_state("more request ids than a session retains")
    restored: dict[str, RetainedRequestId] = {}
    for entry in entries:
        if not isinstance(entry, RetainedRequestId):
            bad_state("retained request id is malformed")
        request_id, completed = entry.request_id, entry.completed
        if not (isinstance(request_id, str) and is_token(request_id)):
            bad_state("retained request id is not a token")
        if type(completed) is not bool:
            bad_state("completed flag is not a boolean")
        if request_id in restored:
            bad_state("request id retained twice")
        # A fresh value of exactly this type, whatever the caller passed.
        restored[request_id] = RetainedRequestId(request_id, completed)
    return restored


def restore_admitted(
    admitted: object, positions: Mapping[str, int], identities: set[CompensationIdentity]
) -> dict[int, CompensationIdentity]:
    """Request id -> identity it admitted, as position -> identity: each id retained,
    each identity one of the state's, no identity linked twice."""
    if not isinstance(admitted, Mapping):
        bad_state("admitted is not a map")
    placed: dict[int, CompensationIdentity] = {}
    for request_id, identity in admitted.items():
        position = positions.get(request_id) if isinstance(request_id, str) else None
        if position is None:
            bad_state("an identity admitted by a request id not retained")
        if identity not in identities:
            bad_state("an admitted identity the state does not hold")
        placed[position] = identity
    if len(set(placed.values())) != len(placed):
        bad_state("an identity admitted twice")
    return placed
