"""Every BLAKE3 derivation, each with its own domain.

Domain strings are raw ASCII at the start of the hashed input, with no length
prefix. ``LP(x)`` is the 8-byte big-endian length of ``x`` followed by ``x``.
This module computes digests only; it validates nothing but argument types,
except :func:`adapter_idempotency_key`, which refuses a kind or a key no
adapter context can name (its value leaves the worker, so it is never
derived from a malformed input).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final, Literal, Protocol

import blake3

from octo_common.ids import validate_compensation_key, validate_token

if TYPE_CHECKING:
    from octo_common.payload import ToolPayload

WORKER_INPUT_DOMAIN: Final = b"octo-worker-operation-input-v1"
GRANT_DOMAIN: Final = b"octo-compensation-grant-v1"
PLAN_DOMAIN: Final = b"octo-workflow-plan-v1"
PLAN_RETRY_DOMAIN: Final = b"octo-workflow-plan-retry-v1"
LEDGER_INPUT_DOMAIN: Final = b"octo-workflow-operation-input-v1"
OPERATION_KEY_DOMAIN: Final = b"octo-workflow-operation-key-v1"
COMPENSATION_KEY_DOMAIN: Final = b"octo-workflow-compensation-key-v1"
RETRY_KEY_DOMAIN: Final = b"octo-workflow-retry-key-v1"
STORAGE_RECORD_DOMAIN: Final = b"octo-storage-record-v1"
FRAME_AUTH_DOMAIN: Final = "octo-worker-auth-v5"
SESSION_KEY_CONTEXT: Final = "octo 2026-12 worker session key v1"
# The payload codec's key: derived from a session key, for frame encryption only.
FRAME_CIPHER_KEY_CONTEXT: Final = "octo 2026-12 session frame cipher key v1"
FRAME_CIPHER_DOMAIN: Final = b"octo-frame-cipher-v1"
ADAPTER_IDEMPOTENCY_KEY_CONTEXT: Final = "octo 2026-12 adapter idempotency key v1"

AdapterIdempotencyKind = Literal["operation", "compensation", "invoke"]
# What each kind derives over, and the field name its key is checked as.
ADAPTER_IDEMPOTENCY_KINDS: Final = ("operation", "compensation", "invoke")


def be64(n: int) -> bytes:
    """The 8-byte big-endian form of ``n``."""
    return n.to_bytes(8, "big")


def lp(data: bytes) -> bytes:
    """``LP(x)``: 8-byte big-endian length, then ``x``."""
    return len(data).to_bytes(8, "big") + data


def blake3_hex(data: bytes) -> str:
    """Unkeyed 32-byte BLAKE3 as 64 lowercase hex."""
    return str(blake3.blake3(data).hexdigest())


def keyed_blake3(key: bytes, data: bytes) -> bytes:
    """Keyed 32-byte BLAKE3."""
    return bytes(blake3.blake3(data, key=key).digest())


def derive_key(context: str, material: bytes) -> bytes:
    """BLAKE3 ``derive_key`` with a context string, 32 bytes."""
    return bytes(blake3.blake3(material, derive_key_context=context).digest())


def worker_input_fingerprint(payload: ToolPayload) -> str:
    """``BLAKE3("octo-worker-operation-input-v1" ‖ canonical bytes)``."""
    from octo_common.payload import canonical_operation_input_bytes

    return blake3_hex(WORKER_INPUT_DOMAIN + canonical_operation_input_bytes(payload))


def ledger_input_fingerprint(input_bytes: bytes) -> str:
    """``BLAKE3("octo-workflow-operation-input-v1" ‖ LP(input))``."""
    return blake3_hex(LEDGER_INPUT_DOMAIN + lp(bytes(input_bytes)))


def grant_fingerprint_of_encoding(encoded_grant: bytes) -> str:
    """``BLAKE3("octo-compensation-grant-v1" ‖ LP(E))`` over the compact grant."""
    return blake3_hex(GRANT_DOMAIN + lp(encoded_grant))


class _Step(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def source(self) -> str: ...


def plan_fingerprint(steps: Iterable[_Step]) -> str:
    """``BLAKE3(domain ‖ BE64(count) ‖ for each step: LP(id) ‖ LP(source))``."""
    steps = list(steps)
    parts = [PLAN_DOMAIN, be64(len(steps))]
    for step in steps:
        parts.append(lp(step.id.encode("utf-8")))
        parts.append(lp(step.source.encode("utf-8")))
    return blake3_hex(b"".join(parts))


def plan_fingerprint_with_retries(steps: Iterable[tuple[_Step, bytes | None]]) -> str:
    """The fingerprint of a plan where some step has a retry policy (its canonical
    encoding, None for a step without one):
    ``BLAKE3(retry domain ‖ BE64(count) ‖ for each step: LP(id) ‖ LP(source) ‖
    (0x00 | 0x01 ‖ LP(policy)))``. A plan without any policy keeps the plain
    fingerprint (:func:`plan_fingerprint`); the two domains never meet."""
    steps = list(steps)
    parts = [PLAN_RETRY_DOMAIN, be64(len(steps))]
    for step, policy in steps:
        parts.append(lp(step.id.encode("utf-8")))
        parts.append(lp(step.source.encode("utf-8")))
        parts.append(b"\x00" if policy is None else b"\x01" + lp(policy))
    return blake3_hex(b"".join(parts))


def retry_key_for(plan_fingerprint_hex: str, first_operation_key: str, attempt: int) -> str:
    """The key of attempt ``attempt`` (2 and up) of a logical operation:
    ``"op-"`` + hex ``BLAKE3(retry domain ‖ LP(plan fp) ‖ LP(first attempt's key) ‖
    BE64(attempt))``. Its own domain: never the key of a first attempt, and
    the same on every host that retries the same attempt."""
    data = b"".join(
        (
            RETRY_KEY_DOMAIN,
            lp(plan_fingerprint_hex.encode("ascii")),
            lp(first_operation_key.encode("utf-8")),
            be64(attempt),
        )
    )
    return "op-" + blake3_hex(data)


def operation_key_for(
    plan_fingerprint_hex: str, step_id: str, tool: str, input_bytes: bytes, nonce: bytes
) -> str:
    """``"op-"`` + hex BLAKE3 over the plan, step, tool, input and nonce."""
    data = b"".join(
        (
            OPERATION_KEY_DOMAIN,
            lp(plan_fingerprint_hex.encode("ascii")),
            lp(step_id.encode("utf-8")),
            lp(tool.encode("utf-8")),
            lp(bytes(input_bytes)),
            lp(bytes(nonce)),
        )
    )
    return "op-" + blake3_hex(data)


def compensation_key_for(
    plan_fingerprint_hex: str,
    operation_key: str,
    tool: str,
    tenant_scope: str,
    grant_fingerprint_hex: str,
    input_bytes: bytes,
    nonce: bytes,
) -> str:
    """``"cmp-"`` + hex BLAKE3 over the original, tenant, grant, input, nonce."""
    data = b"".join(
        (
            COMPENSATION_KEY_DOMAIN,
            lp(plan_fingerprint_hex.encode("ascii")),
            lp(operation_key.encode("utf-8")),
            lp(tool.encode("utf-8")),
            lp(tenant_scope.encode("utf-8")),
            lp(grant_fingerprint_hex.encode("ascii")),
            lp(bytes(input_bytes)),
            lp(bytes(nonce)),
        )
    )
    return "cmp-" + blake3_hex(data)


def storage_record_tag(
    key: bytes, namespace: str, name: str, key_id: str, revision: int, payload: bytes
) -> str:
    """Keyed BLAKE3 over the record location, key id, revision and payload."""
    data = b"".join(
        (
            STORAGE_RECORD_DOMAIN,
            b"\x01",
            lp(namespace.encode("utf-8")),
            lp(name.encode("utf-8")),
            lp(key_id.encode("utf-8")),
            be64(revision),
            lp(payload),
        )
    )
    return keyed_blake3(key, data).hex()


def message_id(frame: bytes) -> str:
    """The AMQP ``message_id`` of a frame, hex BLAKE3 of its bytes."""
    return blake3_hex(frame)


def adapter_idempotency_key(scope: str, kind: AdapterIdempotencyKind, key: str) -> str:
    """The key an adapter names its effect by, unique across tenant scopes.

    64 lowercase hex of BLAKE3 ``derive_key`` with context
    ``"octo 2026-12 adapter idempotency key v1"`` over
    ``LP(scope) ‖ LP(kind) ‖ LP(key)``. ``kind`` is ``"operation"`` (``key``
    is the operation key), ``"compensation"`` (the ``cmp-`` compensation key)
    or ``"invoke"`` (the request id). ``scope`` must be a token (field
    ``"tenant scope"``) and ``key`` must pass its own syntax rule
    (``InvalidToken`` / ``InvalidCompensationKey``); any other kind is a
    programming error (``ValueError``).
    """
    if kind == "operation":
        validate_token("tenant scope", scope)
        validate_token("operation key", key)
    elif kind == "compensation":
        validate_token("tenant scope", scope)
        validate_compensation_key(key)
    elif kind == "invoke":
        validate_token("tenant scope", scope)
        validate_token("request id", key)
    else:
        raise ValueError("an adapter idempotency key is for an operation, compensation or invoke")
    material = lp(scope.encode("ascii")) + lp(kind.encode("ascii")) + lp(key.encode("ascii"))
    return derive_key(ADAPTER_IDEMPOTENCY_KEY_CONTEXT, material).hex()
