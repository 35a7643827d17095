"""What the ``octo-worker`` and ``octo-host`` commands print, and how they fail.

Owns the command-line conventions both CLIs share: :class:`Output` (human
lines, or one JSON document with ``--json``; errors as one line on stderr
prefixed with the program name), :class:`CliError` (a failure reported as
one line and an exit status), :class:`OneLineParser` (argparse usage errors
as one line, exit status 2), :func:`fail` and :func:`stdout_gone` (a reader
that closed standard output, ``| head``, ends the command quietly), the
escaping of untrusted text for a terminal (:func:`printable`), and the
structlog processors that keep exception text out of logs; and the pieces
of a command both CLIs are built from: :func:`common_options` (``--config``,
``--json``), :func:`verb_parser` (a parser whose verbs are sub-parsers),
:func:`run_verb` (parse, then run the chosen verb's handler),
:func:`state_detail` (a state without its content),
:func:`anchor_to_write` (the anchor an ``init-anchor`` verb may write) and
:func:`broker_unreachable` (the one-line error when the broker cannot be
reached).

It must never print a key, a password or raw untrusted text: every value
that came from a frame, a header or the operator's input goes through
:func:`printable` or the JSON encoder.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn, TextIO

import structlog

from octo_common.states import Failed, Succeeded

__all__ = [
    "EXIT_BROKER",
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_SUPERSEDED",
    "EXIT_USAGE",
    "CliError",
    "Failure",
    "OneLineParser",
    "Output",
    "StdoutGone",
    "anchor_to_write",
    "broker_unreachable",
    "common_options",
    "drop_event",
    "drop_exception_text",
    "fail",
    "one_line",
    "print_table",
    "printable",
    "quiet_logging",
    "run_command",
    "run_verb",
    "state_detail",
    "state_line",
    "stdout_gone",
    "verb_parser",
]

# Exit statuses of both commands.
EXIT_OK: Final = 0
EXIT_CHECK_FAILED: Final = 1  # a check failed, refused, not found, an internal error
EXIT_USAGE: Final = 2  # usage or configuration error
EXIT_BROKER: Final = 3  # broker unreachable or a publish failed
EXIT_STORAGE: Final = 4  # journal or ledger storage error
EXIT_SUPERSEDED: Final = 5  # another worker's fence took every scope


class CliError(Exception):
    """A failure the command reports as one line and an exit status."""

    def __init__(self, status: int, message: str, code: str = "error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class StdoutGone(Exception):
    """The reader of standard output went away (``| head``)."""


@dataclass
class Output:
    """Where a verb writes: human lines, or one JSON document with ``--json``."""

    prog: str
    json_mode: bool
    stdout: TextIO
    stderr: TextIO

    def line(self, text: str = "") -> None:
        if not self.json_mode:
            self._write(text)

    def document(self, value: Any) -> None:
        if self.json_mode:
            self._write(json.dumps(value, indent=2, sort_keys=False))

    def _write(self, text: str) -> None:
        try:
            print(text, file=self.stdout)
        except BrokenPipeError:
            raise StdoutGone() from None

    def error(self, message: str) -> None:
        print(f"{self.prog}: {one_line(message)}", file=self.stderr)


def one_line(text: str) -> str:
    """``text`` with every run of white space (newlines included) as one space."""
    return " ".join(text.split())


_UNPRINTABLE: Final = re.compile(r"[^\x20-\x7e]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def printable(value: object, limit: int = 200) -> str:
    """Untrusted text, safe for a terminal: printable ASCII, escaped, bounded.

    Bytes are read as UTF-8 (an undecodable byte becomes ``\\x`` and two
    hex digits); every character outside printable ASCII becomes ``\\u`` and
    four hex digits (``\\U`` and eight beyond the Basic Multilingual
    Plane), so distinct characters never
    print alike. Longer results are cut at ``limit`` characters and end in
    ``...``.
    """
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    text = _UNPRINTABLE.sub(_escape, text)
    return text if len(text) <= limit else text[:limit] + "..."


def print_table(rows: Sequence[Sequence[str]], out: Output) -> None:
    """Rows as left-aligned columns two spaces apart (nothing for no rows)."""
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = (cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        out.line("  ".join(cells).rstrip())


def stdout_gone() -> int:
    """The reader of our output went away (``| head``): stop quietly.

    Standard output is pointed at the null device, so that neither an error
    document nor the interpreter's last flush meets the closed pipe again.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_CHECK_FAILED


def fail(out: Output, status: int, message: str, code: str) -> int:
    """Report a failure: one line on stderr, and with ``--json`` one error document."""
    out.error(message)
    try:
        out.document({"ok": False, "error": {"code": code, "message": one_line(message)}})
    except StdoutGone:
        stdout_gone()
    return status


Failure = tuple[int, str, str]
"""How a command reports an error: (exit status, one-line message, code)."""


def run_command(
    out: Output, body: Callable[[], int], report: Callable[[Exception], Failure | None]
) -> int:
    """Run one verb and turn every way it can end into an exit status.

    ``CliError`` is reported as it says; any other exception goes to
    ``report`` first (the command's own mapping of Octo errors), and one it
    does not know is an internal error naming only its class (never a
    traceback). A closed standard output ends the command quietly; Ctrl-C
    is 130.
    """
    try:
        return body()
    except CliError as error:
        return fail(out, error.status, error.message, error.code)
    except KeyboardInterrupt:
        return 130
    except StdoutGone:
        return stdout_gone()
    except Exception as error:  # the last line of defence: never a traceback
        reported = report(error)
        if reported is not None:
            return fail(out, *reported)
        return fail(out, EXIT_CHECK_FAILED, f"internal error ({type(error).__name__})", "internal")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        _, _, verb = self.prog.partition(" ")  # the error line already names the program
        text = f"{verb.strip()}: {message}" if verb.strip() else message
        raise CliError(EXIT_USAGE, f"{text} (see --help)", "usage")


def common_options(default_config: str, what: str) -> OneLineParser:
    """The options every verb takes: ``--config PATH`` and ``--json``.

    ``what`` names the configuration in the help (``worker``, ``host``).
    """
    common = OneLineParser(add_help=False)
    common.add_argument(
        "--config",
        default=default_config,
        metavar="PATH",
        help=f"{what} configuration (default {default_config})",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document")
    return common


def installed_version() -> str:
    """The installed Octo distribution's version (``unknown`` when it is not installed)."""
    try:
        return importlib.metadata.version("octo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def verb_parser(
    prog: str, description: str, epilog: str
) -> tuple[OneLineParser, argparse._SubParsersAction[OneLineParser]]:
    """A command's parser and the sub-parsers its verbs are added to (one is required)."""
    parser = OneLineParser(prog=prog, description=description, epilog=epilog)
    parser.add_argument("--version", action="version", version=f"{prog} {installed_version()}")
    verbs = parser.add_subparsers(
        dest="verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    return parser, verbs


def run_verb(
    prog: str,
    argv: Sequence[str] | None,
    build_parser: Callable[[], argparse.ArgumentParser],
    report: Callable[[Exception], Failure | None],
    prepare: Callable[[argparse.Namespace], None],
) -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None) and run the verb's ``handler(args, out)``.

    Each verb's parser sets ``handler``. ``prepare(args)`` runs first (the
    command's logging); every way the verb can end becomes an exit status
    (:func:`run_command`). ``--help`` ends with status 0.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    out = Output(prog, "--json" in arguments, sys.stdout, sys.stderr)

    def body() -> int:
        try:
            args = build_parser().parse_args(arguments)
        except SystemExit as exit_:  # --help / --version
            return exit_.code if isinstance(exit_.code, int) else EXIT_OK
        out.json_mode = bool(getattr(args, "json", False))
        prepare(args)
        handler: Callable[[argparse.Namespace, Output], int] = args.handler
        return handler(args, out)

    return run_command(out, body, report)


def state_detail(state: Any, *, reveal: bool = False) -> dict[str, Any]:
    """A state without its content: a payload and failure text become sizes; a
    failure's code (``failure_code``) is shown, its text (``failure_text``) only
    with ``reveal`` (where the journal's data key is at hand and the operator
    asked)."""
    detail: dict[str, Any] = {"state": state.kind.value}
    if isinstance(state, Succeeded):
        payload = state.payload
        size = (
            len(str(payload.value).encode("utf-8", "surrogatepass"))
            if payload.format == "text"
            else len(payload.value_bytes())
        )
        detail["payload"] = {"format": payload.format, "bytes": size}
    elif isinstance(state, Failed):
        if state.code is not None:
            detail["failure_code"] = state.code
        detail["message_bytes"] = len(state.message.encode("utf-8", "surrogatepass"))
        if reveal:
            detail["failure_text"] = state.message
    return detail


def anchor_to_write(anchor: Path | None, key: str, force: bool, replace_hint: str) -> Path:
    """The rollback anchor an ``init-anchor`` verb may write: configured as ``key``,
    and absent unless ``force`` (``replace_hint`` says what ``--force`` does)."""
    if anchor is None:
        raise CliError(EXIT_USAGE, f"{key} is not configured", "invalid_configuration")
    if anchor.exists() and not force:
        raise CliError(EXIT_CHECK_FAILED, f"{anchor} already exists ({replace_hint})", "exists")
    return anchor


def state_line(
    detail: Mapping[str, Any], *, payload: str = "payload", failure: str = "failure message"
) -> str:
    """One line of a :func:`state_detail`: the state, then the sizes it carries.

    ``payload`` and ``failure`` name the two sizes as the command calls them
    (``succeeded (payload: json, 12 bytes)``, ``failed (failure message: 40
    bytes)``).
    """
    text = str(detail["state"])
    if "failure_code" in detail:
        text += f" [{detail['failure_code']}]"
    sizes = detail.get("payload")
    if sizes is not None:
        text += f" ({payload}: {sizes['format']}, {sizes['bytes']} bytes)"
    if "message_bytes" in detail:
        text += f" ({failure}: {detail['message_bytes']} bytes)"
    return text


def broker_unreachable(redacted_url: str, reason: str, code: str) -> CliError:
    """The error of a verb that cannot reach the broker at ``redacted_url`` (no credentials)."""
    return CliError(EXIT_BROKER, f"broker {redacted_url} unreachable: {reason}", code)


# Logging ------------------------------------------------------------------------------

_EXCEPTION_KEYS: Final = ("exc_info", "exception", "stack", "stack_info")


def drop_exception_text(_logger: Any, _method: str, event: Any) -> Any:
    """structlog processor: never render an exception's text or traceback.

    Exception text may be adapter or operator text: only the exception's
    class name survives (``error_type``); call sites log error codes
    explicitly.
    """
    info = event.pop("exc_info", None)
    for key in _EXCEPTION_KEYS:
        event.pop(key, None)
    error: object = None
    if isinstance(info, BaseException):
        error = info
    elif isinstance(info, tuple) and len(info) == 3:
        error = info[1]
    elif info:
        error = sys.exc_info()[1]
    if isinstance(error, BaseException):
        event.setdefault("error_type", type(error).__name__)
    return event


def drop_event(_logger: Any, _method: str, _event: Any) -> NoReturn:
    """structlog processor that drops every event."""
    raise structlog.DropEvent


def quiet_logging() -> None:
    """For the operator verbs: library and Octo module logs stay silent.

    Those verbs report every failure themselves, as one line; a library
    warning (aiormq's "error when creating transport") would be a second one.
    """
    structlog.configure(
        processors=[drop_event],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(logging.NullHandler())
    root.setLevel(logging.CRITICAL + 1)
