"""The per-session authorizer: budgets and request identities.

A :class:`SessionAuthorizer` owns one session's manifest, its call and
compensation budgets, the compensation identities it has admitted and the
request ids it retains (at most 1024, each with a ``completed`` flag). Every
``authorize_*`` method checks a request in one fixed order, every check before
any mutation, and returns an in-process authorization token; every
``validate_*`` method checks a result against such a token in one fixed
order. A compensation lookup
(``reconcile_compensation``) is authorized as a reconciliation: it spends
a request id only.

Rules this module keeps:

* Every method is all-or-nothing: all checks run before the first mutation, so
  an error leaves the state (``export_state()``) unchanged.
* A commit persists ``checkpoint()``: the counters and the retained request
  ids as a count and a completion bitmap, never the ids themselves nor the
  identities they admitted, so it costs the same whatever the number of
  retained ids. Retained ids are append-only (never released), so the first
  ``retained`` ids of retention order (``retained_rows``: each with the
  compensation identity it admitted, if any) are exactly the ids of a
  checkpoint; ``export_state_at`` rebuilds the full state of one (O(ids)).
* Tokens carry the provenance (object identity) of the issuing instance; a
  validator refuses a token of another instance first. A restored authorizer
  is a new instance and refuses the old instance's tokens.
* Tokens are never serialized: pickling raises ``TypeError``; ``copy`` keeps
  the provenance.

This module is pure: it must never do I/O, log, touch asyncio or keep keys.
It has no cancellation methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, NoReturn, TypeVar

from octo_common.authorizer_state import (
    AuthorizerCheckpoint,
    AuthorizerState,
    CompensationIdentity,
    RetainedRequestId,
    bad_state,
    restore_admitted,
    restore_counters,
    restore_identities,
    restore_request_ids,
)
from octo_common.digest import worker_input_fingerprint
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
    OperationResultMismatch,
    OutputTooLarge,
    RequestMismatch,
    SessionRequestLimitExceeded,
    UnknownSession,
    UnknownTool,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.ids import validate_token
from octo_common.limits import MAX_SESSION_REQUEST_IDS
from octo_common.messages import (
    CompensationReconcileRequest,
    CompensationReconcileResult,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    ToolInvocation,
    ToolResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import validate_operation_status_for_grant

__all__ = [
    "AuthorizedCompensationReconciliation",
    "AuthorizedInvocation",
    "AuthorizedOperationCompensation",
    "AuthorizedOperationInvocation",
    "AuthorizedOperationReconciliation",
    "AuthorizerCheckpoint",
    "AuthorizerState",
    "CompensationIdentity",
    "RetainedRequestId",
    "SessionAuthorizer",
]

# Tokens ---------------------------------------------------------------------


class _Provenance:
    """The identity of one authorizer instance; compared with ``is`` only."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<authorizer provenance>"

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("authorizer provenance cannot be serialized")


RequestT = TypeVar(
    "RequestT",
    ToolInvocation,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationCompensationRequest,
    CompensationReconcileRequest,
)


class _AuthorizationToken(Generic[RequestT]):
    """Common behaviour of the authorization tokens.

    Tokens are immutable, in-process values issued only by a
    :class:`SessionAuthorizer`. They are equal only when their type, request,
    grant and provenance are equal; a copy is the same token.
    """

    __slots__ = ("_grant", "_provenance", "_request")

    _request: RequestT
    _grant: CapabilityGrant
    _provenance: _Provenance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(f"{type(self).__name__} is issued by SessionAuthorizer only")

    @classmethod
    def _issue(cls, request: RequestT, grant: CapabilityGrant, provenance: _Provenance) -> Any:
        token = object.__new__(cls)
        object.__setattr__(token, "_request", request)
        object.__setattr__(token, "_grant", grant)
        object.__setattr__(token, "_provenance", provenance)
        return token

    @property
    def request(self) -> RequestT:
        """The authorized request, exactly as it was authorized."""
        return self._request

    @property
    def grant(self) -> CapabilityGrant:
        """The manifest's grant for the request's tool."""
        return self._grant

    @property
    def session_id(self) -> str:
        return self._request.session_id

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def tool(self) -> str:
        return self._request.tool

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _AuthorizationToken)
        return (
            self._provenance is other._provenance
            and self._request == other._request
            and self._grant == other._grant
        )

    def __hash__(self) -> int:
        # Payload values may be unhashable (JSON objects); the request id and
        # provenance are enough for a hash that agrees with equality.
        return hash((type(self).__name__, self._request.request_id, id(self._provenance)))

    def __copy__(self) -> _AuthorizationToken[RequestT]:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _AuthorizationToken[RequestT]:
        return self

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is an in-process value and cannot be pickled")

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is an in-process value and cannot be pickled")

    def __repr__(self) -> str:
        # Never the payload: only identifiers.
        return (
            f"{type(self).__name__}(session_id={self.session_id!r}, "
            f"request_id={self.request_id!r}, tool={self.tool!r})"
        )


class AuthorizedInvocation(_AuthorizationToken[ToolInvocation]):
    """Token for an ordinary ``invoke``."""

    __slots__ = ()


class AuthorizedOperationInvocation(_AuthorizationToken[OperationDispatchRequest]):
    """Token for a durable ``dispatch_operation``."""

    __slots__ = ("_input_fingerprint",)

    _input_fingerprint: str

    @property
    def operation_key(self) -> str:
        return self._request.operation_key

    @property
    def input_fingerprint(self) -> str:
        """``worker_input_fingerprint`` of the request's payload, computed once.

        The journal needs it at admission and again at observation.
        """
        try:
            return self._input_fingerprint
        except AttributeError:
            fingerprint = worker_input_fingerprint(self._request.payload)
            object.__setattr__(self, "_input_fingerprint", fingerprint)
            return fingerprint


class AuthorizedOperationReconciliation(_AuthorizationToken[OperationReconcileRequest]):
    """Token for a ``reconcile_operation``."""

    __slots__ = ()

    @property
    def operation_key(self) -> str:
        return self._request.operation_key


class AuthorizedOperationCompensation(_AuthorizationToken[OperationCompensationRequest]):
    """Token for a ``compensate_operation``."""

    __slots__ = ("_identity",)

    _identity: CompensationIdentity

    @property
    def operation_key(self) -> str:
        return self._request.operation_key

    @property
    def compensation_key(self) -> str:
        return self._request.compensation_key

    @property
    def identity(self) -> CompensationIdentity:
        """The six-value compensation identity this token was admitted under."""
        return self._identity


class AuthorizedCompensationReconciliation(_AuthorizationToken[CompensationReconcileRequest]):
    """Token for a ``reconcile_compensation``: authorized as a reconciliation."""

    __slots__ = ()

    @property
    def operation_key(self) -> str:
        return self._request.operation_key

    @property
    def compensation_key(self) -> str:
        return self._request.compensation_key


# The authorizer ---------------------------------------------------------------


class SessionAuthorizer:
    """Budgets and request identities of one session."""

    __slots__ = (
        "_admitted",
        "_calls",
        "_compensation_fingerprints",
        "_compensations",
        "_completed",
        "_identities",
        "_manifest",
        "_order",
        "_positions",
        "_provenance",
        "_unplaced",
    )

    def __init__(self, manifest: CapabilityManifest) -> None:
        manifest.validate()
        self._manifest = manifest
        # The grant fingerprint depends only on the immutable grant.
        self._compensation_fingerprints: dict[str, str] = {}
        self._calls: dict[str, int] = {}
        self._compensations: dict[str, int] = {}
        self._identities: set[CompensationIdentity] = set()
        # Each identity with the position of the request id that admitted it,
        # except those restored without that link (sorted; never added to).
        self._admitted: dict[int, CompensationIdentity] = {}
        self._unplaced: tuple[CompensationIdentity, ...] = ()
        # Retained request ids in retention order (append-only), each id's
        # position in it, and the completed flags as a bitmap over positions.
        self._order: list[str] = []
        self._positions: dict[str, int] = {}
        self._completed = 0
        self._provenance = _Provenance()

    def __repr__(self) -> str:
        return (
            f"SessionAuthorizer(session_id={self._manifest.session_id!r}, "
            f"request_ids={len(self._order)})"
        )

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError("SessionAuthorizer is persisted through export_state() only")

    # -- read-only views -------------------------------------------------------

    @property
    def manifest(self) -> CapabilityManifest:
        return self._manifest

    @property
    def session_id(self) -> str:
        return self._manifest.session_id

    def calls_for(self, tool: str) -> int:
        """Ordinary calls spent on ``tool`` (invoke and dispatch); 0 when none."""
        return self._calls.get(tool, 0)

    def compensations_for(self, tool: str) -> int:
        """Compensation identities admitted for ``tool``; 0 when none."""
        return self._compensations.get(tool, 0)

    def request_id_count(self) -> int:
        """How many request ids this authorizer retains (at most 1024)."""
        return len(self._order)

    def is_retained(self, request_id: str) -> bool:
        return request_id in self._positions

    def is_completed(self, request_id: str) -> bool:
        """Whether a result for ``request_id`` was validated."""
        position = self._positions.get(request_id)
        return position is not None and (self._completed >> position) & 1 == 1

    def retained_ids(self, start: int = 0) -> list[str]:
        """The retained request ids from position ``start`` on, in retention order."""
        return self._order[start:]

    def retained_rows(self, start: int = 0) -> list[tuple[str, CompensationIdentity | None]]:
        """The retained request ids from position ``start`` on, each with the
        compensation identity it admitted (None: none, or not known)."""
        admitted = self._admitted
        return [
            (request_id, admitted.get(position))
            for position, request_id in enumerate(self._order[start:], start)
        ]

    # -- request ids -----------------------------------------------------------

    def reserve_request_id(self, request_id: str) -> None:
        """Retain ``request_id``: duplicate first, then capacity."""
        validate_token("request id", request_id)
        self._check_request_id_free(request_id)
        self._check_request_capacity()
        self._retain(request_id)

    def _retain(self, request_id: str) -> None:
        # The only way a request id enters retention (after every check).
        self._positions[request_id] = len(self._order)
        self._order.append(request_id)

    def _check_request_id_free(self, request_id: str) -> None:
        if request_id in self._positions:
            raise DuplicateRequest(request_id)

    def _check_request_capacity(self) -> None:
        if len(self._order) >= MAX_SESSION_REQUEST_IDS:
            raise SessionRequestLimitExceeded(MAX_SESSION_REQUEST_IDS)

    # -- authorization ---------------------------------------------------------

    def _active_grant(self, session_id: str, tool: str) -> CapabilityGrant:
        if session_id != self._manifest.session_id:
            raise UnknownSession(session_id)
        grant = self._manifest.grant(tool)
        if grant is None:
            raise UnknownTool(tool)
        return grant

    @staticmethod
    def _check_input(payload: ToolPayload, grant: CapabilityGrant) -> None:
        size = payload.validate_for(grant.format)
        if size > grant.max_input_bytes:
            raise InputTooLarge(size, grant.max_input_bytes)

    def _spend_call(self, request: ToolInvocation | OperationDispatchRequest) -> CapabilityGrant:
        # Every check precedes the two mutations at the end.
        grant = self._active_grant(request.session_id, request.tool)
        self._check_input(request.payload, grant)
        self._check_request_id_free(request.request_id)
        spent = self._calls.get(request.tool, 0)
        if spent >= grant.max_calls:
            raise CallBudgetExhausted(request.tool, grant.max_calls)
        self._check_request_capacity()
        self._retain(request.request_id)
        self._calls[request.tool] = spent + 1
        return grant

    def authorize(self, invocation: ToolInvocation) -> AuthorizedInvocation:
        """Authorize an ordinary invocation, spending one call."""
        invocation.validate()
        grant = self._spend_call(invocation)
        token: AuthorizedInvocation = AuthorizedInvocation._issue(
            invocation, grant, self._provenance
        )
        return token

    def authorize_operation(
        self, request: OperationDispatchRequest
    ) -> AuthorizedOperationInvocation:
        """Authorize a durable dispatch; it spends a call like ``invoke``."""
        # The payload is checked against the grant's format in step 3.
        request.validate_header()
        grant = self._spend_call(request)
        token: AuthorizedOperationInvocation = AuthorizedOperationInvocation._issue(
            request, grant, self._provenance
        )
        return token

    def authorize_reconciliation(
        self, request: OperationReconcileRequest
    ) -> AuthorizedOperationReconciliation:
        """Authorize a reconciliation: one request id, no call budget."""
        request.validate()
        grant = self._active_grant(request.session_id, request.tool)
        self._check_request_id_free(request.request_id)
        self._check_request_capacity()
        self._retain(request.request_id)
        token: AuthorizedOperationReconciliation = AuthorizedOperationReconciliation._issue(
            request, grant, self._provenance
        )
        return token

    def authorize_compensation_reconciliation(
        self, request: CompensationReconcileRequest
    ) -> AuthorizedCompensationReconciliation:
        """Authorize a compensation lookup exactly as a reconciliation.

        Spends one request id and nothing else: no call or compensation
        budget, no compensation identity. Neither ``max_compensations`` nor
        the current grant's fingerprint is consulted: the lookup performs no
        effect, and the journal checks that the key holds a compensation with
        exactly this identity.
        """
        request.validate()
        grant = self._active_grant(request.session_id, request.tool)
        self._check_request_id_free(request.request_id)
        self._check_request_capacity()
        self._retain(request.request_id)
        token: AuthorizedCompensationReconciliation = AuthorizedCompensationReconciliation._issue(
            request, grant, self._provenance
        )
        return token

    def _compensation_fingerprint(self, grant: CapabilityGrant) -> str:
        fingerprint = self._compensation_fingerprints.get(grant.tool)
        if fingerprint is None:
            fingerprint = grant.compensation_fingerprint()
            self._compensation_fingerprints[grant.tool] = fingerprint
        return fingerprint

    def authorize_compensation(
        self, request: OperationCompensationRequest
    ) -> AuthorizedOperationCompensation:
        """Authorize a compensation against the compensation budget.

        An identity this authorizer already admitted costs a request id but no
        budget; a new identity needs budget. The call budget is never spent.
        """
        # Tokens, ``cmp-`` key and fingerprint syntax; the payload comes in step 6.
        request.validate_header()
        grant = self._active_grant(request.session_id, request.tool)
        if grant.max_compensations == 0:
            raise CompensationNotGranted(request.tool)
        if self._compensation_fingerprint(grant) != request.grant_fingerprint:
            raise CompensationGrantMismatch()
        self._check_input(request.payload, grant)
        self._check_request_id_free(request.request_id)
        identity = CompensationIdentity(
            tool=request.tool,
            operation_key=request.operation_key,
            compensation_key=request.compensation_key,
            tenant_scope=request.tenant_scope,
            grant_fingerprint=request.grant_fingerprint,
            input_fingerprint=worker_input_fingerprint(request.payload),
        )
        is_new = identity not in self._identities
        spent = self._compensations.get(request.tool, 0)
        if is_new and spent >= grant.max_compensations:
            raise CompensationBudgetExhausted(request.tool, grant.max_compensations)
        self._check_request_capacity()
        self._retain(request.request_id)
        if is_new:
            self._identities.add(identity)
            self._admitted[self._positions[request.request_id]] = identity
            self._compensations[request.tool] = spent + 1
        token: AuthorizedOperationCompensation = AuthorizedOperationCompensation._issue(
            request, grant, self._provenance
        )
        object.__setattr__(token, "_identity", identity)
        return token

    # -- result validation -----------------------------------------------------

    def _check_provenance(self, auth: _AuthorizationToken[Any], kind: type[Any]) -> None:
        if not isinstance(auth, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(auth).__name__}")
        if auth._provenance is not self._provenance:
            raise AuthorizationProvenanceMismatch()

    def _check_result_session(self, session_id: str) -> None:
        if session_id != self._manifest.session_id:
            raise UnknownSession(session_id)

    def _check_not_completed(self, request_id: str) -> None:
        if self.is_completed(request_id):
            raise DuplicateResult(request_id)

    def _mark_completed(self, request_id: str) -> None:
        # A token of this instance always names a retained id.
        self._completed |= 1 << self._positions[request_id]

    def validate_result(self, auth: AuthorizedInvocation, result: ToolResult) -> None:
        """Check an invocation result and mark its request completed."""
        self._check_provenance(auth, AuthorizedInvocation)
        result.validate()
        self._check_result_session(result.session_id)
        if result.request_id != auth.request_id:
            raise RequestMismatch(auth.request_id, result.request_id)
        self._check_not_completed(auth.request_id)
        grant = auth.grant
        size = result.payload.validate_for(grant.format)
        if size > grant.max_output_bytes:
            raise OutputTooLarge(size, grant.max_output_bytes)
        self._mark_completed(auth.request_id)

    def validate_operation_result(
        self, auth: AuthorizedOperationInvocation, result: OperationReconcileResult
    ) -> None:
        """Check a dispatch's ``operation_result``."""
        self._check_provenance(auth, AuthorizedOperationInvocation)
        result.validate()
        self._check_result_session(result.session_id)
        if not result.matches_dispatch(auth.request):
            raise OperationResultMismatch()
        self._check_not_completed(auth.request_id)
        validate_operation_status_for_grant(result.status, auth.grant)
        self._mark_completed(auth.request_id)

    def validate_reconciliation_result(
        self, auth: AuthorizedOperationReconciliation, result: OperationReconcileResult
    ) -> None:
        """Check a ``reconciled_operation`` result."""
        self._check_provenance(auth, AuthorizedOperationReconciliation)
        result.validate()
        self._check_result_session(result.session_id)
        if not result.matches_request(auth.request):
            raise OperationResultMismatch()
        self._check_not_completed(auth.request_id)
        validate_operation_status_for_grant(result.status, auth.grant)
        self._mark_completed(auth.request_id)

    def validate_compensation_result(
        self, auth: AuthorizedOperationCompensation, result: OperationCompensationResult
    ) -> None:
        """Check a ``compensation_result``."""
        self._check_provenance(auth, AuthorizedOperationCompensation)
        result.validate()
        self._check_result_session(result.session_id)
        if not result.matches_request(auth.request):
            raise CompensationResultMismatch()
        self._check_not_completed(auth.request_id)
        validate_operation_status_for_grant(result.status, auth.grant)
        self._mark_completed(auth.request_id)

    def validate_compensation_reconciliation_result(
        self, auth: AuthorizedCompensationReconciliation, result: CompensationReconcileResult
    ) -> None:
        """Check a ``reconciled_compensation`` result, as the other results are checked."""
        self._check_provenance(auth, AuthorizedCompensationReconciliation)
        result.validate()
        self._check_result_session(result.session_id)
        if not result.matches_request(auth.request):
            raise CompensationResultMismatch()
        self._check_not_completed(auth.request_id)
        validate_operation_status_for_grant(result.status, auth.grant)
        self._mark_completed(auth.request_id)

    # -- persistence -----------------------------------------------------------

    def checkpoint(self) -> AuthorizerCheckpoint:
        """What a commit persists now (see :class:`AuthorizerCheckpoint`).

        O(tools), never O(retained ids) nor O(identities): an identity goes
        with the request id that admitted it (``retained_rows``); only those
        restored without that link are here. The counter maps are copies (a
        caller that mutates them cannot alter this authorizer).
        """
        return AuthorizerCheckpoint(
            calls_by_tool={t: n for t, n in sorted(self._calls.items()) if n},
            compensations_by_tool={t: n for t, n in sorted(self._compensations.items()) if n},
            compensation_identities=self._unplaced,
            retained=len(self._order),
            completed=self._completed,
        )

    def export_state_at(self, checkpoint: AuthorizerCheckpoint) -> AuthorizerState:
        """The full state of ``checkpoint``, one this authorizer took earlier (its
        request ids are a prefix of this authorizer's: retained ids are never released)."""
        retained = checkpoint.retained
        if not 0 <= retained <= len(self._order):
            raise ValueError("a checkpoint retains more request ids than this authorizer")
        bits = checkpoint.completed
        identities = [*checkpoint.compensation_identities, *self.admitted_at(checkpoint).values()]
        return AuthorizerState(
            calls_by_tool=dict(checkpoint.calls_by_tool),
            compensations_by_tool=dict(checkpoint.compensations_by_tool),
            compensation_identities=tuple(sorted(identities)),
            request_ids=tuple(
                RetainedRequestId(request_id, (bits >> position) & 1 == 1)
                for position, request_id in enumerate(self._order[:retained])
            ),
        )

    def admitted_at(self, checkpoint: AuthorizerCheckpoint) -> dict[str, CompensationIdentity]:
        """Request id -> the compensation identity it admitted, for the ids of
        ``checkpoint`` (one this authorizer took earlier) whose link is known."""
        order = self._order
        return {
            order[position]: identity
            for position, identity in self._admitted.items()
            if position < checkpoint.retained
        }

    def rewound(self, checkpoint: AuthorizerCheckpoint) -> SessionAuthorizer:
        """A NEW authorizer as this one was at ``checkpoint`` (one it took earlier)."""
        return SessionAuthorizer.restore(
            self._manifest,
            self.export_state_at(checkpoint),
            admitted=self.admitted_at(checkpoint),
        )

    def export_state(self) -> AuthorizerState:
        """Everything but provenance, in a canonical order; O(retained ids)."""
        return self.export_state_at(self.checkpoint())

    @classmethod
    def restore(
        cls,
        manifest: CapabilityManifest,
        state: AuthorizerState,
        *,
        admitted: Mapping[str, CompensationIdentity] | None = None,
    ) -> SessionAuthorizer:
        """Rebuild an authorizer from ``export_state()`` as a NEW instance.

        The manifest is validated as by the constructor; a state that no
        sequence of authorizations under this manifest can produce raises
        ``SerializationError`` and builds nothing. Tokens of the exported
        instance are not accepted by the restored one. ``admitted`` links
        identities of the state to the retained request ids that admitted
        them (each a retained id, each identity one of the state's, linked
        once); the others are kept as not linked.
        """
        authorizer = cls(manifest)
        if not isinstance(state, AuthorizerState):
            bad_state("not an AuthorizerState")
        calls = restore_counters(manifest, state.calls_by_tool, "calls_by_tool", "max_calls")
        compensations = restore_counters(
            manifest, state.compensations_by_tool, "compensations_by_tool", "max_compensations"
        )
        identities = restore_identities(manifest, state.compensation_identities)
        per_tool: dict[str, int] = {}
        for identity in identities:
            per_tool[identity.tool] = per_tool.get(identity.tool, 0) + 1
        if per_tool != compensations:
            # Every admitted identity spent exactly one unit of its tool's budget.
            bad_state("compensation counters disagree with the identities")
        request_ids = restore_request_ids(state.request_ids)
        # Every spent call and every new identity retained its own request id,
        # and retained ids are never released.
        if sum(calls.values()) + sum(compensations.values()) > len(request_ids):
            bad_state("more budget spent than request ids retained")
        authorizer._calls = calls
        authorizer._compensations = compensations
        positions = {request_id: i for i, request_id in enumerate(request_ids)}
        placed = restore_admitted(admitted or {}, positions, identities)
        authorizer._identities = identities
        authorizer._admitted = placed
        linked = set(placed.values())
        authorizer._unplaced = tuple(sorted(i for i in identities if i not in linked))
        authorizer._order = list(request_ids)
        authorizer._positions = positions
        authorizer._completed = sum(
            1 << i for i, entry in enumerate(request_ids.values()) if entry.completed
        )
        return authorizer
