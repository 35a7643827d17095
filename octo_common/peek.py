"""One field of an unopened frame or delivery, read without deciding anything.

Owns :func:`peek_operation_key` (the operation key of a keyed request
frame: it picks the worker's per-key lock and the key a metric is about)
and :func:`header_text` (an AMQP header value as text, as pamqp decodes
it). A peek never authenticates, never changes state and never replaces
the strict parse: whatever it returns, ``SessionAuthenticator.open`` and
:func:`octo_common.transport.check_delivery` remain the authority, and a
frame or header it cannot read gives None. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

import msgspec

from octo_common.codec import parse_json
from octo_common.errors import OctoError
from octo_common.ids import is_token

__all__ = ["KEYED_REQUEST_TYPES", "header_text", "peek_operation_key"]

# Every request about one operation key's row: its handling
# holds that key's lock.
KEYED_REQUEST_TYPES: Final = frozenset(
    {
        "dispatch_operation",
        "compensate_operation",
        "reconcile_operation",
        "reconcile_compensation",
    }
)


class _PeekRequest(msgspec.Struct):
    operation_key: str


class _PeekMessage(msgspec.Struct):
    type: str
    request: _PeekRequest | None = None


class _PeekFrame(msgspec.Struct):
    message: _PeekMessage


# Decodes only the three fields a peek needs and skips the rest. For
# well-formed JSON it finds the same key as the strict parse below
# (duplicate keys are last-wins in both); anything it cannot decode goes to
# the strict parse.
_PEEK: Final = msgspec.json.Decoder(_PeekFrame)


def peek_operation_key(frame: bytes) -> str | None:
    """The operation key of a keyed request frame (dispatch, compensate,
    reconcile an operation or a compensation), or None for any other frame or
    one that does not parse.

    The key is the request's own ``operation_key`` (never a look-alike
    inside a payload) and is a token.
    """
    try:
        peeked = _PEEK.decode(frame)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        pass
    else:
        message = peeked.message
        if message.type not in KEYED_REQUEST_TYPES or message.request is None:
            return None
        key = message.request.operation_key
        return key if is_token(key) else None
    try:
        tree = parse_json(frame)
    except OctoError:
        return None
    if not isinstance(tree, dict):
        return None
    found = tree.get("message")
    if not isinstance(found, dict) or found.get("type") not in KEYED_REQUEST_TYPES:
        return None
    request = found.get("request")
    if not isinstance(request, dict):
        return None
    found_key = request.get("operation_key")
    return found_key if isinstance(found_key, str) and is_token(found_key) else None


def header_text(value: object) -> str | None:
    """A header value as text: pamqp decodes an AMQP long string as ``str``, or as
    ``bytes`` when it is not UTF-8 (then only ASCII counts); any other type
    (numbers, tables, byte arrays) is not a header text."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            return None
    return None
