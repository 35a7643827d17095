"""BLAKE3 derivations: domains, LP/BE64 framing, the grant encoding and adapter keys.

Each expected digest is recomputed here with the ``blake3`` package from the
byte layout the spec writes out, never with the module under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import pytest

from octo_common import digest
from octo_common.digest import (
    be64,
    compensation_key_for,
    ledger_input_fingerprint,
    lp,
    message_id,
    operation_key_for,
    plan_fingerprint,
    worker_input_fingerprint,
)
from octo_common.errors import InvalidCompensationKey, InvalidToken
from octo_common.grants import CapabilityGrant
from octo_common.payload import ToolPayload


def _h(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


@dataclass(frozen=True)
class _Step:
    id: str
    source: str


def test_domain_strings_are_exact() -> None:
    assert digest.WORKER_INPUT_DOMAIN == b"octo-worker-operation-input-v1"
    assert digest.GRANT_DOMAIN == b"octo-compensation-grant-v1"
    assert digest.PLAN_DOMAIN == b"octo-workflow-plan-v1"
    assert digest.LEDGER_INPUT_DOMAIN == b"octo-workflow-operation-input-v1"
    assert digest.OPERATION_KEY_DOMAIN == b"octo-workflow-operation-key-v1"
    assert digest.COMPENSATION_KEY_DOMAIN == b"octo-workflow-compensation-key-v1"
    assert digest.STORAGE_RECORD_DOMAIN == b"octo-storage-record-v1"
    assert digest.FRAME_AUTH_DOMAIN == "octo-worker-auth-v5"
    assert digest.SESSION_KEY_CONTEXT == "octo 2026-12 worker session key v1"


def test_be64_is_eight_big_endian_bytes() -> None:
    assert be64(0) == b"\x00" * 8
    assert be64(1) == b"\x00" * 7 + b"\x01"
    assert be64(0x0102030405060708) == bytes(range(1, 9))
    assert be64(2**64 - 1) == b"\xff" * 8


def test_be64_refuses_values_outside_u64() -> None:
    with pytest.raises(OverflowError):
        be64(2**64)


def test_lp_is_length_then_bytes() -> None:
    assert lp(b"") == b"\x00" * 8
    assert lp(b"abc") == b"\x00" * 7 + b"\x03abc"
    assert lp("é".encode()) == b"\x00" * 7 + b"\x02\xc3\xa9"
    assert lp(b"x" * 300) == b"\x00" * 6 + b"\x01\x2c" + b"x" * 300


def test_worker_input_fingerprint_has_no_extra_length_prefix() -> None:
    payload = ToolPayload.text("release")
    canonical = b"text" + be64(7) + b"release"
    assert worker_input_fingerprint(payload) == _h(b"octo-worker-operation-input-v1" + canonical)


def test_worker_input_fingerprint_of_json_uses_canonical_bytes() -> None:
    payload = ToolPayload.json({"b": 2, "a": 1})
    canonical = b"json" + be64(13) + b'{"a":1,"b":2}'
    expected = _h(b"octo-worker-operation-input-v1" + canonical)
    assert worker_input_fingerprint(payload) == expected
    assert worker_input_fingerprint(ToolPayload.json({"a": 1, "b": 2})) == expected


def test_ledger_input_fingerprint_is_length_prefixed() -> None:
    data = b"json" + be64(2) + b"{}"
    assert ledger_input_fingerprint(data) == _h(b"octo-workflow-operation-input-v1" + _lp(data))
    assert ledger_input_fingerprint(b"") == _h(b"octo-workflow-operation-input-v1" + be64(0))


def test_worker_and_ledger_fingerprints_differ_for_the_same_bytes() -> None:
    payload = ToolPayload.text("release")
    canonical = b"text" + be64(7) + b"release"
    assert worker_input_fingerprint(payload) != ledger_input_fingerprint(canonical)


def test_grant_encoding_and_fingerprint_example() -> None:
    # The exact hashed bytes for CapabilityGrant.text("text.echo").
    encoded = (
        b'{"tool":"text.echo","format":"text","max_calls":1,"max_input_bytes":16384,'
        b'"max_output_bytes":65536,"max_compensations":0,"resources":[]}'
    )
    expected = _h(b"octo-compensation-grant-v1" + be64(len(encoded)) + encoded)
    assert CapabilityGrant.text("text.echo").compensation_fingerprint() == expected
    assert digest.grant_fingerprint_of_encoding(encoded) == expected


def test_plan_fingerprint_layout() -> None:
    steps = [_Step("build", "make"), _Step("publish", "échec")]
    data = (
        b"octo-workflow-plan-v1"
        + be64(2)
        + _lp(b"build")
        + _lp(b"make")
        + _lp(b"publish")
        + _lp("échec".encode())
    )
    assert plan_fingerprint(steps) == _h(data)
    assert plan_fingerprint([]) == _h(b"octo-workflow-plan-v1" + be64(0))


def test_plan_fingerprint_depends_on_order_and_boundaries() -> None:
    one = plan_fingerprint([_Step("a", "bc")])
    other = plan_fingerprint([_Step("ab", "c")])
    assert one != other
    first = plan_fingerprint([_Step("a", "x"), _Step("b", "y")])
    assert first != plan_fingerprint([_Step("b", "y"), _Step("a", "x")])


def test_operation_key_layout() -> None:
    plan = "ab" * 32
    data = (
        b"octo-workflow-operation-key-v1"
        + _lp(plan.encode())
        + _lp(b"step-1")
        + _lp(b"math.add")
        + _lp(b"\x00input")
        + _lp(b"nonce")
    )
    key = operation_key_for(plan, "step-1", "math.add", b"\x00input", b"nonce")
    assert key == "op-" + _h(data)


def test_compensation_key_layout() -> None:
    plan = "cd" * 32
    grant_fp = "ef" * 32
    data = (
        b"octo-workflow-compensation-key-v1"
        + _lp(plan.encode())
        + _lp(b"op-1")
        + _lp(b"math.add")
        + _lp(b"tenant-release")
        + _lp(grant_fp.encode())
        + _lp(b"undo")
        + _lp(b"n")
    )
    key = compensation_key_for(plan, "op-1", "math.add", "tenant-release", grant_fp, b"undo", b"n")
    assert key == "cmp-" + _h(data)


def test_message_id_is_the_plain_hash_of_the_frame() -> None:
    frame = b'{"sequence":1,"message":{},"auth_tag":"00"}'
    assert message_id(frame) == _h(frame)
    assert len(message_id(b"")) == 64


def test_keyed_hash_and_derive_key_use_blake3_modes() -> None:
    key = bytes(range(32))
    assert digest.keyed_blake3(key, b"data") == blake3.blake3(b"data", key=key).digest()
    context = "octo 2026-12 worker session key v1"
    assert digest.derive_key(context, b"m") == (
        blake3.blake3(b"m", derive_key_context=context).digest()
    )


# Adapter idempotency keys ------------------------------------------------------

_ADAPTER_CONTEXT = "octo 2026-12 adapter idempotency key v1"


def _adapter_key(scope: str, kind: str, key: str) -> str:
    """The adapter key: derive_key(context, LP(scope) ‖ LP(kind) ‖ LP(key)), 64 hex."""
    material = _lp(scope.encode()) + _lp(kind.encode()) + _lp(key.encode())
    return blake3.blake3(material, derive_key_context=_ADAPTER_CONTEXT).hexdigest()


# Computed once with the blake3 package from the formula above (never with octo code).
ADAPTER_KEY_ANSWERS = [
    (
        "tenant-a",
        "operation",
        "op-release-42",
        "93e36e31716dcb9a326bc6f852a3ab8dfd24b75d6f76b66ca87f6c533b7fde69",
    ),
    (
        "tenant-b",
        "operation",
        "op-release-42",
        "989353999ae79820eeaf9ac7846c5ce71ce879463a7913f6e834d42f16496364",
    ),
    (
        "tenant-a",
        "compensation",
        "cmp-release-42-undo",
        "ee8f592a297cc7c0abedf7cbfae0f5331f071db318317b248c3e772d8dcd42e7",
    ),
    (
        "tenant-a",
        "invoke",
        "invoke-1",
        "f290c42ee97b7413653ad8d81ade253e210680c6f1cae52838aeb2fbcd4580e8",
    ),
]


def test_adapter_idempotency_context_is_exact() -> None:
    assert digest.ADAPTER_IDEMPOTENCY_KEY_CONTEXT == _ADAPTER_CONTEXT
    assert digest.ADAPTER_IDEMPOTENCY_KINDS == ("operation", "compensation", "invoke")


@pytest.mark.parametrize(("scope", "kind", "key", "expected"), ADAPTER_KEY_ANSWERS)
def test_adapter_idempotency_key_known_answers(
    scope: str, kind: digest.AdapterIdempotencyKind, key: str, expected: str
) -> None:
    assert _adapter_key(scope, kind, key) == expected  # the fixed value is the formula's
    assert digest.adapter_idempotency_key(scope, kind, key) == expected


@pytest.mark.parametrize(
    ("scope", "kind", "key"),
    [
        ("t", "operation", "k"),
        ("tenant." * 18 + "xy", "operation", "op-" + "9" * 125),
        ("tenant-a", "compensation", "cmp-"),
        ("tenant-a", "invoke", "r" * 128),
    ],
)
def test_adapter_idempotency_key_follows_the_formula(
    scope: str, kind: digest.AdapterIdempotencyKind, key: str
) -> None:
    value = digest.adapter_idempotency_key(scope, kind, key)
    assert value == _adapter_key(scope, kind, key)
    assert len(value) == 64 and value == value.lower()


def test_two_scopes_never_share_an_adapter_key_for_the_same_operation_key() -> None:
    keys = {
        digest.adapter_idempotency_key(scope, "operation", "op-release-42")
        for scope in ("tenant-a", "tenant-b", "tenant-c")
    }
    assert len(keys) == 3


def test_the_kind_separates_keys_with_equal_text() -> None:
    # An operation key and a request id may be spelled alike; their adapter keys differ.
    assert digest.adapter_idempotency_key(
        "tenant-a", "operation", "cmp-1"
    ) != digest.adapter_idempotency_key("tenant-a", "compensation", "cmp-1")
    assert digest.adapter_idempotency_key(
        "tenant-a", "operation", "x-1"
    ) != digest.adapter_idempotency_key("tenant-a", "invoke", "x-1")


def test_length_prefixes_keep_scope_and_key_boundaries_apart() -> None:
    assert digest.adapter_idempotency_key(
        "tenant-ab", "operation", "c"
    ) != digest.adapter_idempotency_key("tenant-a", "operation", "bc")


def test_adapter_idempotency_key_refuses_other_kinds() -> None:
    for kind in ("dispatch", "Operation", "", "reconcile"):
        with pytest.raises(ValueError):
            digest.adapter_idempotency_key("tenant-a", kind, "op-1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("scope", "kind", "key", "field"),
    [
        ("Tenant", "operation", "op-1", "tenant scope"),
        ("", "invoke", "r-1", "tenant scope"),
        ("tenant-a", "operation", "op 1", "operation key"),
        ("tenant-a", "operation", "o" * 129, "operation key"),
        ("tenant-a", "compensation", "CMP-1", "compensation key"),
        ("tenant-a", "invoke", "r/1", "request id"),
    ],
)
def test_adapter_idempotency_key_refuses_bad_tokens(
    scope: str, kind: digest.AdapterIdempotencyKind, key: str, field: str
) -> None:
    with pytest.raises(InvalidToken) as raised:
        digest.adapter_idempotency_key(scope, kind, key)
    assert raised.value.field == field


def test_a_compensation_key_needs_its_prefix() -> None:
    with pytest.raises(InvalidCompensationKey):
        digest.adapter_idempotency_key("tenant-a", "compensation", "undo-1")
