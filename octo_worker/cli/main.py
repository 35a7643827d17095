"""The ``octo-worker`` entry point: the parser of every verb and how an error ends a command.

It must never print a traceback: an error is one line on stderr and an exit
status (see :mod:`octo_worker.cli`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from octo_common.errors import OctoError, StorageError
from octo_common.runtime.output import (
    EXIT_STORAGE,
    EXIT_USAGE,
    Failure,
    common_options,
    quiet_logging,
    run_verb,
    verb_parser,
)
from octo_worker.cli.adapters import register as add_adapters_verbs
from octo_worker.cli.common import DEFAULT_CONFIG, PROG
from octo_worker.cli.console import register as add_console_verb
from octo_worker.cli.dev import register as add_dev_verb
from octo_worker.cli.dlq import register as add_dlq_verbs
from octo_worker.cli.journal import register as add_journal_verbs
from octo_worker.cli.run import cmd_run
from octo_worker.cli.run import register as add_run_verbs
from octo_worker.cli.topology import register as add_topology_verbs
from octo_worker.config import InvalidConfiguration

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    common = common_options(DEFAULT_CONFIG, "worker")
    parser, verbs = verb_parser(
        PROG,
        "Run and operate the Octo worker daemon.",
        "Exit status: 0 ok, 1 check failed or not found, 2 usage or configuration "
        "error, 3 broker unreachable, 4 storage error, 5 run stopped because another "
        "worker took over every scope (a standby; a supervisor restarts it).",
    )
    for add in (
        add_dev_verb,
        add_run_verbs,
        add_topology_verbs,
        add_journal_verbs,
        add_adapters_verbs,
        add_dlq_verbs,
        add_console_verb,
    ):
        add(verbs, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``octo-worker`` command; returns the exit status."""
    return run_verb(PROG, argv, build_parser, _report, _prepare)


def _prepare(args: argparse.Namespace) -> None:
    # ``run`` configures its own logging; the operator verbs stay quiet.
    if args.handler is not cmd_run:
        quiet_logging()


def _report(error: Exception) -> Failure | None:
    """How an Octo error ends a worker command (None: an internal error)."""
    if isinstance(error, InvalidConfiguration):
        return (EXIT_USAGE, str(error), error.code)
    if isinstance(error, StorageError):
        return (EXIT_STORAGE, f"journal storage: {error}", error.code)
    if isinstance(error, OctoError):
        return (EXIT_USAGE, str(error), error.code)
    return None
