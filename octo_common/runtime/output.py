"""What the ``octo-worker`` and ``octo-host`` commands print, and how they fail.

Owns the command-line conventions both CLIs share: :class:`Output` (human
lines, or one JSON document with ``--json``; errors as one line on stderr
prefixed with the program name), :class:`CliError` (a failure reported as
one line and an exit status), :class:`OneLineParser` (argparse usage errors
as one line, exit status 2), :func:`fail` and :func:`stdout_gone` (a reader
that closed standard output, ``| head``, ends the command quietly), the
escaping of untrusted text for a terminal (:func:`printable`), and the
structlog processors that keep exception text out of logs.

It must never print a key, a password or raw untrusted text: every value
that came from a frame, a header or the operator's input goes through
:func:`printable` or the JSON encoder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TextIO

import structlog

__all__ = [
    "EXIT_BROKER",
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "CliError",
    "Failure",
    "OneLineParser",
    "Output",
    "StdoutGone",
    "drop_event",
    "drop_exception_text",
    "fail",
    "one_line",
    "print_table",
    "printable",
    "quiet_logging",
    "run_command",
    "stdout_gone",
]

# Exit statuses of both commands.
EXIT_OK: Final = 0
EXIT_CHECK_FAILED: Final = 1  # a check failed, refused, not found, an internal error
EXIT_USAGE: Final = 2  # usage or configuration error
EXIT_BROKER: Final = 3  # broker unreachable or a publish failed
EXIT_STORAGE: Final = 4  # journal or ledger storage error


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

    Bytes are read as UTF-8 (an undecodable byte becomes ``\\xNN``); every
    character outside printable ASCII becomes ``\\uXXXX`` (``\\UXXXXXXXX``
    beyond the Basic Multilingual Plane), so distinct characters never
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
