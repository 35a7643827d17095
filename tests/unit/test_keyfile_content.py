"""The content rule of a key file, without touching any file."""

from __future__ import annotations

import pytest

from octo_common.keyfile import KeyFileRefused, parse_key_content

KEY = bytes(range(1, 33))


@pytest.mark.parametrize(
    "content",
    [KEY, KEY.hex().encode(), KEY.hex().encode() + b"\n"],
    ids=["raw", "hex", "hex-newline"],
)
def test_the_three_accepted_forms_give_the_key(content: bytes) -> None:
    assert parse_key_content(content) == KEY


@pytest.mark.parametrize(
    "content",
    [
        b"",
        KEY[:31],
        KEY + b"\x00",
        KEY + b"\n",
        KEY.hex().upper().encode(),
        KEY.hex()[:-1].upper().encode() + b"a",  # one uppercase letter is enough
        KEY.hex().encode() + b"\n\n",
        KEY.hex().encode() + b"\r\n",
        KEY.hex().encode() + b" ",
        b" " + KEY.hex().encode(),
        KEY.hex().encode()[:63],
        KEY.hex().encode()[:63] + b"g",
        KEY.hex().encode() * 2,
    ],
)
def test_anything_else_holds_no_key(content: bytes) -> None:
    assert parse_key_content(content) is None


def test_a_raw_key_of_32_newlines_or_letters_is_still_raw() -> None:
    # Exactly 32 bytes are always the key itself, whatever they look like.
    assert parse_key_content(b"\n" * 32) == b"\n" * 32
    assert parse_key_content(b"ab" * 16) == b"ab" * 16


@pytest.mark.parametrize(
    ("reason", "detail", "expected"),
    [
        ("missing", "", "keys/a.key does not exist"),
        ("unopenable", "Permission denied", "cannot open keys/a.key (Permission denied)"),
        ("not_regular", "", "keys/a.key is not a regular file"),
        (
            "permissions",
            "644",
            "keys/a.key grants permissions to group or others (mode 644); run chmod 600 keys/a.key",
        ),
        ("unreadable", "Input/output error", "cannot read keys/a.key (Input/output error)"),
        ("format", "", "keys/a.key must hold 32 raw bytes or 64 lowercase hex characters"),
    ],
)
def test_each_refusal_names_the_path_and_the_problem(
    reason: str, detail: str, expected: str
) -> None:
    refused = KeyFileRefused(reason, "keys/a.key", detail)  # type: ignore[arg-type]
    assert (refused.reason, str(refused)) == (reason, expected)
