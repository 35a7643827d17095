"""Arguments of ``octo-host``: the options every verb takes, tokens, payloads.

This module owns the ``--config``/``--json``/``--verbose`` options, the token
argument type, and reading a payload (inline or ``@FILE``) in the grant's
format.

It must never echo a payload, a file's content or a key in an error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final, TypeAlias

from octo_common.codec import parse_json
from octo_common.errors import OctoError
from octo_common.ids import is_token
from octo_common.payload import ToolPayload
from octo_common.runtime.output import EXIT_USAGE, CliError, OneLineParser, printable
from octo_common.runtime.output import common_options as shared_common_options
from octo_host.config import DEFAULT_CONFIG

__all__ = [
    "MAX_PAYLOAD_FILE_BYTES",
    "SCOPE_HELP",
    "Verbs",
    "common_options",
    "payload_from_value",
    "payload_of",
    "read_argument",
    "token_arg",
]

Verbs: TypeAlias = "argparse._SubParsersAction[OneLineParser]"
"""What a verb group's ``register(verbs, common)`` adds its parsers to."""

SCOPE_HELP: Final = "tenant scope (default: the only [[scopes]] entry)"
MAX_PAYLOAD_FILE_BYTES: Final = 4 * 1024 * 1024


def token_arg(text: str) -> str:
    if not is_token(text):
        raise argparse.ArgumentTypeError(f"{printable(text)!r} is not a token ([a-z0-9._-])")
    return text


def common_options() -> OneLineParser:
    """``--config``, ``--json`` and ``--verbose``: the options every verb takes."""
    common = shared_common_options(DEFAULT_CONFIG, "host")
    common.add_argument(
        "--verbose",
        action="store_true",
        help="log on stderr (ids and states only): human-readable on a terminal, else JSON",
    )
    return common


def read_argument(text: str, option: str) -> str:
    """``@FILE`` → the file's UTF-8 text; anything else is the value itself."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:])
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_PAYLOAD_FILE_BYTES + 1)
    except OSError as exc:
        raise CliError(
            EXIT_USAGE, f"{option}: cannot read {path} ({exc.strerror})", "usage"
        ) from None
    if len(data) > MAX_PAYLOAD_FILE_BYTES:
        raise CliError(EXIT_USAGE, f"{option}: {path} is too large", "usage")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CliError(EXIT_USAGE, f"{option}: {path} is not UTF-8", "usage") from None


def payload_from_value(fmt: str, value: Any, option: str) -> ToolPayload:
    try:
        payload = ToolPayload.text(value) if fmt == "text" else ToolPayload.json(value)
        payload.validate_for(fmt)
    except (OctoError, TypeError, ValueError) as exc:
        code = getattr(exc, "code", "invalid")
        raise CliError(
            EXIT_USAGE, f"{option}: not a valid {fmt} payload ({code})", "usage"
        ) from None
    return payload


def payload_of(fmt: str, text: str, option: str) -> ToolPayload:
    """The payload of an option in the grant's format (never echoed in errors)."""
    raw = read_argument(text, option)
    if fmt == "text":
        return payload_from_value("text", raw, option)
    try:
        value = parse_json(raw)
    except OctoError as exc:
        raise CliError(EXIT_USAGE, f"{option}: not valid JSON ({exc.code})", "usage") from None
    return payload_from_value("json", value, option)
