"""The request and result bodies of the wire messages.

Every struct here is a frozen value that compares by value; field order is
the serialization order, which tags, sizes and fingerprints are
computed over. Built by user code, a struct sets ``protocol_version = 5``
and validates itself. Import them from :mod:`octo_common.messages`,
which carries them in its messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from octo_common._struct import ProtocolStruct, laid_flat, leading_keyword, part_field
from octo_common.errors import (
    CancellationIdMatchesRequest,
    InvalidCompensationGrantFingerprint,
    InvalidCompensationKey,
    SerializationError,
    UnsupportedVersion,
)
from octo_common.ids import (
    all_tokens,
    is_fingerprint,
    validate_compensation_key,
    validate_token,
)
from octo_common.limits import PROTOCOL_VERSION
from octo_common.payload import ToolPayload
from octo_common.states import Cancelled, Failed, FailureCode, OperationStatus, Running, Succeeded

U16 = Annotated[int, msgspec.Meta(ge=0, le=65535)]


def check_version(version: int) -> None:
    """``UnsupportedVersion`` unless ``version`` is this protocol's (5)."""
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(version)


def _check_status(status: Any) -> None:
    if not isinstance(status, Running | Succeeded | Failed | Cancelled):
        raise SerializationError("a result status is running, succeeded, failed or cancelled")
    status.validate()


def _check_fingerprint(value: str) -> None:
    if not is_fingerprint(value):
        raise InvalidCompensationGrantFingerprint()


class _Versioned(ProtocolStruct, frozen=True):
    """A struct whose first wire field is the protocol version (5 unless given)."""

    protocol_version: U16 = leading_keyword(default=PROTOCOL_VERSION, kw_only=True)


# Requests and results -----------------------------------------------


class ToolInvocation(_Versioned, frozen=True):
    session_id: str
    request_id: str
    tool: str
    payload: ToolPayload

    def validate(self) -> None:
        """Header only: an invocation's payload is checked by the authorizer."""
        check_version(self.protocol_version)
        if all_tokens(self.session_id, self.request_id, self.tool):
            return
        validate_token("session id", self.session_id)
        validate_token("request id", self.request_id)
        validate_token("tool", self.tool)


class ToolResult(_Versioned, frozen=True):
    session_id: str
    request_id: str
    payload: ToolPayload

    def validate(self) -> None:
        check_version(self.protocol_version)
        validate_token("session id", self.session_id)
        validate_token("request id", self.request_id)


class WorkerCancellationRequest(_Versioned, frozen=True, forbid_unknown_fields=True):
    """Reserved: decodes and validates; a worker refuses it."""

    session_id: str
    cancellation_id: str
    request_id: str
    tool: str

    def validate(self) -> None:
        check_version(self.protocol_version)
        validate_token("session id", self.session_id)
        validate_token("cancellation id", self.cancellation_id)
        validate_token("request id", self.request_id)
        validate_token("tool", self.tool)
        if self.cancellation_id == self.request_id:
            raise CancellationIdMatchesRequest()


class WorkerCancellationResult(_Versioned, frozen=True, forbid_unknown_fields=True):
    """Reserved."""

    session_id: str
    cancellation_id: str
    request_id: str
    tool: str
    outcome: Literal["acknowledged", "too_late", "unsupported"]

    def validate(self) -> None:
        check_version(self.protocol_version)
        validate_token("session id", self.session_id)
        validate_token("cancellation id", self.cancellation_id)
        validate_token("request id", self.request_id)
        validate_token("tool", self.tool)
        if self.cancellation_id == self.request_id:
            raise CancellationIdMatchesRequest()


class OperationDispatchRequest(_Versioned, frozen=True, forbid_unknown_fields=True):
    session_id: str
    request_id: str
    tool: str
    operation_key: str
    payload: ToolPayload

    def validate_header(self) -> None:
        check_version(self.protocol_version)
        if all_tokens(self.session_id, self.request_id, self.tool, self.operation_key):
            return
        validate_token("session id", self.session_id)
        validate_token("request id", self.request_id)
        validate_token("tool", self.tool)
        validate_token("operation key", self.operation_key)

    def validate(self) -> None:
        self.validate_header()
        self.payload.validate_for(self.payload.format)


class Resolution(ProtocolStruct, frozen=True, forbid_unknown_fields=True):
    """An operator's audited decision for a stuck key, carried by a lookup request.

    A ``reconcile_operation`` / ``reconcile_compensation`` that carries one
    asks the worker to record ``state`` for a key its journal holds
    ``pending`` or ``running`` instead of asking the adapter, and to answer
    what the journal then holds (a key it holds terminal is answered as it
    is: a decision never overwrites an outcome). No effect runs, and none is
    run again: the adapter is not called. ``operator`` (1..128 printable
    characters), ``reason`` (1..1024 bytes) and ``run`` (the host's run, a
    token) are the decision's audit, kept in the journal with the state.
    """

    state: Literal["succeeded", "failed", "cancelled"]
    operator: str
    reason: str
    run: str

    def validate(self) -> None:
        if self.state not in ("succeeded", "failed", "cancelled"):
            raise SerializationError("a resolution decides succeeded, failed or cancelled")
        operator = self.operator
        if not 1 <= len(operator) <= 128 or not operator.isprintable():
            raise SerializationError("a resolution's operator is 1..128 printable characters")
        size = len(self.reason.encode("utf-8", "surrogatepass"))
        if not 1 <= size <= 1024 or not self.reason.strip():
            raise SerializationError("a resolution's reason is 1..1024 bytes of text")
        validate_token("run", self.run)

    def status(self, payload_format: str) -> OperationStatus:
        """The state the journal records for this decision, its audit inside:
        ``failed`` with the code ``resolved_by_operator`` and the operator and
        reason as its text; ``succeeded`` with the operator and run as its
        output (in the grant's ``payload_format``); ``cancelled``."""
        if self.state == "failed":
            return Failed(
                f"resolved by operator {self.operator} (run {self.run}): {self.reason}",
                FailureCode.RESOLVED_BY_OPERATOR.value,
            )
        if self.state == "succeeded":
            if payload_format == "json":
                decided = {"resolved_by_operator": self.operator, "run": self.run}
                return Succeeded(ToolPayload.json(decided))
            return Succeeded(
                ToolPayload.text(f"resolved by operator {self.operator} (run {self.run})")
            )
        return Cancelled()


class OperationReconcileRequest(_Versioned, frozen=True, omit_defaults=True):
    """``reconcile_operation``: the adapter's status lookup of a key, or, with a
    ``resolution`` (omitted from the encoding when None), an operator's decision."""

    session_id: str
    request_id: str
    tool: str
    operation_key: str
    resolution: Resolution | None = None

    def validate(self) -> None:
        check_version(self.protocol_version)
        if not all_tokens(self.session_id, self.request_id, self.tool, self.operation_key):
            validate_token("session id", self.session_id)
            validate_token("request id", self.request_id)
            validate_token("tool", self.tool)
            validate_token("operation key", self.operation_key)
        if self.resolution is not None:
            self.resolution.validate()


class OperationReconcileResult(_Versioned, frozen=True):
    """The result of a dispatch (``operation_result``) or a reconciliation."""

    session_id: str
    request_id: str
    tool: str
    operation_key: str
    status: OperationStatus

    def validate(self) -> None:
        check_version(self.protocol_version)
        if not all_tokens(self.session_id, self.request_id, self.tool, self.operation_key):
            validate_token("session id", self.session_id)
            validate_token("request id", self.request_id)
            validate_token("tool", self.tool)
            validate_token("operation key", self.operation_key)
        _check_status(self.status)

    def matches_request(self, request: Any) -> bool:
        """Equal version, session, request id, tool and operation key."""
        return bool(
            self.protocol_version == request.protocol_version
            and self.session_id == request.session_id
            and self.request_id == request.request_id
            and self.tool == request.tool
            and self.operation_key == request.operation_key
        )

    def matches_dispatch(self, dispatch: Any) -> bool:
        return self.matches_request(dispatch)


class OperationCompensationBinding(ProtocolStruct, frozen=True):
    """What a compensation is bound to."""

    tool: str
    operation_key: str
    compensation_key: str
    tenant_scope: str
    grant_fingerprint: str

    def validate(self) -> None:
        validate_token("tool", self.tool)
        validate_token("operation key", self.operation_key)
        validate_compensation_key(self.compensation_key)
        validate_token("tenant scope", self.tenant_scope)
        _check_fingerprint(self.grant_fingerprint)


class _CompensationFields(_Versioned, frozen=True):
    """The identity of a compensation: its request, then its binding laid flat."""

    session_id: str
    request_id: str
    tool: str
    operation_key: str
    compensation_key: str
    tenant_scope: str
    grant_fingerprint: str

    def _validate_header(self) -> None:
        check_version(self.protocol_version)
        if all_tokens(
            self.session_id,
            self.request_id,
            self.tool,
            self.operation_key,
            self.compensation_key,
            self.tenant_scope,
        ):
            # Every token passes, so only the cmp- prefix and the fingerprint remain.
            if not self.compensation_key.startswith("cmp-"):
                raise InvalidCompensationKey(self.compensation_key)
            _check_fingerprint(self.grant_fingerprint)
            return
        validate_token("session id", self.session_id)
        validate_token("request id", self.request_id)
        validate_token("tool", self.tool)
        validate_token("operation key", self.operation_key)
        validate_compensation_key(self.compensation_key)
        validate_token("tenant scope", self.tenant_scope)
        _check_fingerprint(self.grant_fingerprint)

    @property
    def binding(self) -> OperationCompensationBinding:
        return OperationCompensationBinding(
            self.tool,
            self.operation_key,
            self.compensation_key,
            self.tenant_scope,
            self.grant_fingerprint,
        )


class _BoundCompensation(_CompensationFields, frozen=True):
    """A compensation built from its binding: the constructor takes the binding,
    the wire carries its five fields flat."""

    tool: str = part_field(init=False)
    operation_key: str = part_field(init=False)
    compensation_key: str = part_field(init=False)
    tenant_scope: str = part_field(init=False)
    grant_fingerprint: str = part_field(init=False)
    binding: OperationCompensationBinding = laid_flat()


class OperationCompensationRequest(_BoundCompensation, frozen=True, forbid_unknown_fields=True):
    payload: ToolPayload

    def validate_header(self) -> None:
        self._validate_header()

    def validate(self) -> None:
        self._validate_header()
        self.payload.validate_for(self.payload.format)


class OperationCompensationResult(_BoundCompensation, frozen=True, forbid_unknown_fields=True):
    status: OperationStatus

    def validate(self) -> None:
        self._validate_header()
        _check_status(self.status)

    def matches_request(self, request: Any) -> bool:
        """The five operation fields plus key, tenant and fingerprint."""
        return bool(
            self.protocol_version == request.protocol_version
            and self.session_id == request.session_id
            and self.request_id == request.request_id
            and self.tool == request.tool
            and self.operation_key == request.operation_key
            and self.compensation_key == request.compensation_key
            and self.tenant_scope == request.tenant_scope
            and self.grant_fingerprint == request.grant_fingerprint
        )


class CompensationReconcileRequest(
    _CompensationFields, frozen=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Ask the worker to look a compensation up by its key (no effect).

    The seven fields name the compensation exactly as the ledger and the
    journal hold it; there is no payload. Validated like the header of a
    ``compensate_operation``: tokens, the ``cmp-`` key, the tenant scope and
    the grant fingerprint syntax. Unknown keys are rejected on decode, as for
    every struct that carries a compensation binding. With a ``resolution``
    (omitted from the encoding when None) it carries an operator's decision
    instead (see :class:`Resolution`).
    """

    resolution: Resolution | None = None

    def validate(self) -> None:
        self._validate_header()
        if self.resolution is not None:
            self.resolution.validate()


class CompensationReconcileResult(_CompensationFields, frozen=True, forbid_unknown_fields=True):
    """The status a compensation lookup observed (``reconciled_compensation``)."""

    status: OperationStatus

    def validate(self) -> None:
        self._validate_header()
        _check_status(self.status)

    def matches_request(self, request: Any) -> bool:
        """All eight identity fields equal (the identity of a compensation result)."""
        return bool(
            self.protocol_version == request.protocol_version
            and self.session_id == request.session_id
            and self.request_id == request.request_id
            and self.tool == request.tool
            and self.operation_key == request.operation_key
            and self.compensation_key == request.compensation_key
            and self.tenant_scope == request.tenant_scope
            and self.grant_fingerprint == request.grant_fingerprint
        )
