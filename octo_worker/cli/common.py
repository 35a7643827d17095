"""What every verb of ``octo-worker`` works with: configuration, the broker, the journal.

Owns the default configuration path, loading the configuration, the event
loop a long-running verb runs on, and the argument types several verbs
take; the command's name, a verb's broker connection and the journal opened
beside a running daemon are :mod:`octo_worker.inspection`'s (the console
shares them), re-exported here for the verbs. It must never print (the verbs do) or leave a
connection or a store open.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import urllib.parse
from collections.abc import Coroutine, Iterable
from typing import Any, Final, TypeVar

from octo_common.errors import OctoError
from octo_common.ids import is_token
from octo_common.runtime.output import (
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    printable,
)
from octo_worker.config import WorkerConfig, load_config
from octo_worker.inspection import PROG, broker_connection, journal_store

__all__ = [
    "DEFAULT_CONFIG",
    "PROG",
    "Verbs",
    "broker_connection",
    "check_tokens",
    "config_of",
    "delivery_limit",
    "event_loop_refusal",
    "journal_store",
    "parse_duration",
    "positive_int",
    "run_event_loop",
    "storage_failure",
    "uvloop_installed",
    "verb_group",
    "vhost",
]

DEFAULT_CONFIG: Final = "/etc/octo/worker.toml"
Verbs = Any  # argparse's sub-parsers action, which each verb module's ``register`` adds to
T = TypeVar("T")


def config_of(args: argparse.Namespace) -> WorkerConfig:
    return load_config(args.config)


def verb_group(verbs: Verbs, name: str, help_text: str) -> Verbs:
    """Add the verb group ``name`` (``journal``, ``dlq``...); returns the sub-parsers its
    verbs are added to (one is required; the chosen one is ``args.<name>_verb``)."""
    group = verbs.add_parser(name, help=help_text)
    return group.add_subparsers(
        dest=f"{name}_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )


def run_event_loop(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """Run ``main`` to completion on the configured event loop (``[worker] event_loop``).

    ``auto`` takes uvloop when it is importable (about a fifth less CPU per
    delivery on the machines measured, see README) and asyncio otherwise;
    ``uvloop`` insists on it; ``asyncio`` is the standard library loop.
    """
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                main.close()
                raise event_loop_refusal() from None
        else:
            result: T = uvloop.run(main)
            return result
    return asyncio.run(main)


def event_loop_refusal() -> CliError:
    """``run``'s refusal of ``event_loop = "uvloop"`` without uvloop (``check`` reports it)."""
    return CliError(
        EXIT_USAGE, "worker.event_loop: uvloop is not installed", "invalid_configuration"
    )


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def delivery_limit(text: str) -> int:
    value = positive_int(text)
    if value > 2**31 - 1:
        raise argparse.ArgumentTypeError("must be at most 2147483647")
    return value


_DURATION = re.compile(r"([1-9][0-9]{0,8})([smhdw])")

_UNIT_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> int:
    """``30d``, ``12h``, ``45m``, ``90s``, ``2w`` → seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration (a number and one of s, m, h, d, w: 30d, 12h)"
        )
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def vhost(url: str) -> str:
    path = urllib.parse.urlsplit(url).path
    return urllib.parse.unquote(path[1:]) if len(path) > 1 else "/"


def check_tokens(option: str, values: Iterable[str]) -> None:
    for value in values:
        if not is_token(value):
            raise CliError(EXIT_USAGE, f"{option}: {printable(value)!r} is not a token", "usage")


def storage_failure(where: str, error: OctoError) -> CliError:
    return CliError(EXIT_STORAGE, f"{where}: {error.code}: {error}", error.code)
