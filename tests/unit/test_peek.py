"""Peeks at unopened frames and headers (pure): they agree with the strict parse or say None."""

from __future__ import annotations

import pytest

from octo_common.peek import KEYED_REQUEST_TYPES, header_text, peek_operation_key


def test_the_keyed_types_are_the_four_keyed_requests() -> None:
    assert {
        "dispatch_operation",
        "compensate_operation",
        "reconcile_operation",
        "reconcile_compensation",
    } == KEYED_REQUEST_TYPES


@pytest.mark.parametrize(
    ("frame", "key"),
    [
        # A payload may hold a field that looks like a key; only the request's own counts.
        (
            b'{"auth_tag":"00","message":{"invocation":{"payload":{"format":"json","value":'
            b'{"operation_key":"op-lookalike"}},"request_id":"r","session_id":"s","tool":"t"},'
            b'"type":"invoke"},"sequence":1}',
            None,
        ),
        (
            b'{"message":{"request":{"operation_key":"op-own","payload":{"format":"json",'
            b'"value":{"operation_key":"op-lookalike"}}},"type":"dispatch_operation"}}',
            "op-own",
        ),
        (
            b'{"message":{"request":{"payload":{"format":"json","value":'
            b'{"operation_key":"op-lookalike"}},"operation_key":"op-last"},'
            b'"type":"compensate_operation"}}',
            "op-last",
        ),
        (b'{"message":{"type":"reconcile_operation","request":{"operation_key":"op-r"}}}', "op-r"),
        (
            b'{"message":{"type":"reconcile_compensation","request":{"operation_key":"op-c",'
            b'"compensation_key":"cmp-c"}}}',
            "op-c",
        ),
        (
            b'{"message":{"type":"reconciled_compensation","result":{"operation_key":"op-y"}}}',
            None,
        ),
        (b'{"message":{"type":"operation_result","result":{"operation_key":"op-x"}}}', None),
        (b"not json", None),
    ],
)
def test_peek_finds_only_the_request_key_of_a_keyed_frame(frame: bytes, key: str | None) -> None:
    assert peek_operation_key(frame) == key


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("tenant-a", "tenant-a"),
        (b"tenant-a", "tenant-a"),
        (b"\xff", None),
        (bytearray(b"tenant-a"), None),
        (7, None),
        (None, None),
        ({"a": 1}, None),
    ],
)
def test_header_text_reads_only_long_strings(value: object, text: str | None) -> None:
    assert header_text(value) == text
