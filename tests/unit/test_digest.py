"""BLAKE3 derivations: domains, LP/BE64 framing and the grant encoding (W§1, W§2, W§5.8, H§4-§8).

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
    # W§5.8: the exact hashed bytes for CapabilityGrant.text("text.echo").
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
