"""The ``octo-host`` entry point: the parser of every verb, logging, how an error ends a command.

It must never print a traceback: an error is one line on stderr and an exit
status (see :mod:`octo_host.cli`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import structlog

from octo_common.errors import OctoError, StorageError
from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_CHECK_FAILED,
    EXIT_STORAGE,
    EXIT_USAGE,
    Failure,
    drop_exception_text,
    quiet_logging,
    run_verb,
    verb_parser,
)
from octo_common.transport import PublishFailed, PublishReturned
from octo_host.amqp import BrokerUnavailable
from octo_host.cli.audit import register as add_audit_verbs
from octo_host.cli.compensate import register as add_compensate_verb
from octo_host.cli.context import PROG
from octo_host.cli.keys import register as add_keys_verbs
from octo_host.cli.ledger import register as add_ledger_verbs
from octo_host.cli.operations import register as add_operation_verbs
from octo_host.cli.options import common_options
from octo_host.cli.recover import register as add_recover_verb
from octo_host.config import InvalidConfiguration

__all__ = ["build_parser", "main"]


def _configure_logging(args: argparse.Namespace) -> None:
    """Quiet by default (errors are reported as one line); ``--verbose``: lines on
    stderr, human-readable on a terminal and JSON otherwise."""
    quiet_logging()
    if not getattr(args, "verbose", False):
        return
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            drop_exception_text,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser, verbs = verb_parser(
        PROG,
        "Drive and inspect Octo workflow runs (the host side).",
        "Exit status: 0 ok, 1 refused / not found / not succeeded, 2 usage or "
        "configuration error, 3 broker unreachable, 4 storage error.",
    )
    for add in (
        add_keys_verbs,
        add_ledger_verbs,
        add_operation_verbs,
        add_compensate_verb,
        add_recover_verb,
        add_audit_verbs,
    ):
        add(verbs, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``octo-host`` command; returns the exit status."""
    return run_verb(PROG, argv, build_parser, _report, _configure_logging)


def _report(error: Exception) -> Failure | None:
    """How an Octo error ends a host command (None: an internal error)."""
    if isinstance(error, InvalidConfiguration):
        return (EXIT_USAGE, str(error), error.code)
    if isinstance(error, PublishReturned):
        where = f"no worker queue {error.routing_key} (is a worker serving the scope?)"
        return (EXIT_BROKER, f"{error.code}: {where}", error.code)
    if isinstance(error, BrokerUnavailable | PublishFailed):
        return (EXIT_BROKER, f"broker: {error.code}: {error}", error.code)
    if isinstance(error, StorageError):
        return (EXIT_STORAGE, f"ledger storage: {error.code}: {error}", error.code)
    if isinstance(error, OctoError):
        return (EXIT_CHECK_FAILED, f"refused: {error.code}: {error}", error.code)
    return None
