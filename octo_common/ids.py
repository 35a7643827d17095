"""Syntax of tokens, keys, fingerprints and rejection codes.

Pure predicates and validators; each failure raises the protocol's error
class with the exact field name the protocol gives the value.
"""

from __future__ import annotations

import re

from octo_common.errors import (
    InvalidCompensationKey,
    InvalidKeyNonce,
    InvalidToken,
)
from octo_common.limits import KEY_NONCE_BYTES

_TOKEN = re.compile(r"[a-z0-9._-]{1,128}")
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
_REJECTION_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")

TOKEN_FIELDS = frozenset(
    {
        "session id",
        "request id",
        "tool",
        "operation key",
        "compensation key",
        "tenant scope",
        "cancellation id",
        "resource selector",
        "operation journal scope",
        "rejection code",
    }
)


def is_token(value: object) -> bool:
    """True for 1..128 bytes of ``[a-z0-9._-]``."""
    return isinstance(value, str) and _TOKEN.fullmatch(value) is not None


_TOKEN_FULLMATCH = _TOKEN.fullmatch


def validate_token(field: str, value: str) -> None:
    """Raise ``InvalidToken(field, value)`` unless ``value`` is a token."""
    if type(value) is not str or _TOKEN_FULLMATCH(value) is None:
        if isinstance(value, str) and _TOKEN_FULLMATCH(value) is not None:
            return  # a str subclass holding a valid token
        raise InvalidToken(field, value)


_TOKEN_LINES = re.compile(r"[a-z0-9._-]{1,128}(?:\n[a-z0-9._-]{1,128})*").fullmatch


def all_tokens(*values: str) -> bool:
    """True when every value is a token (one regex for all of them)."""
    try:
        joined = "\n".join(values)
    except TypeError:
        return False  # a non-string value
    # A value holding a newline would split into two lines: count them.
    return joined.count("\n") == len(values) - 1 and _TOKEN_LINES(joined) is not None


def validate_tokens(*fields: tuple[str, str]) -> None:
    """``validate_token`` for several fields in order (one regex when all pass)."""
    if all_tokens(*[value for _, value in fields]):
        return
    for field, value in fields:
        validate_token(field, value)


def validate_compensation_key(value: str) -> None:
    """Token check first (field ``compensation key``), then the ``cmp-`` prefix."""
    validate_token("compensation key", value)
    if not value.startswith("cmp-"):
        raise InvalidCompensationKey(value)


def is_fingerprint(value: object) -> bool:
    """True for exactly 64 lowercase hex characters."""
    return isinstance(value, str) and _FINGERPRINT.fullmatch(value) is not None


def validate_rejection_code(value: str) -> None:
    """1..64 bytes, first in ``[a-z]``, the rest in ``[a-z0-9_]``."""
    if not (isinstance(value, str) and _REJECTION_CODE.fullmatch(value) is not None):
        raise InvalidToken("rejection code", value)


def parse_key_nonce_hex(text: str | bytes) -> bytes:
    """Decode a key nonce header: exactly 64 lowercase hex characters."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise InvalidKeyNonce() from None
    if not isinstance(text, str) or _FINGERPRINT.fullmatch(text) is None:
        raise InvalidKeyNonce()
    return bytes.fromhex(text)


def validate_key_nonce(nonce: bytes) -> None:
    """A raw key nonce is exactly 32 bytes."""
    if not isinstance(nonce, bytes | bytearray) or len(nonce) != KEY_NONCE_BYTES:
        raise InvalidKeyNonce()
