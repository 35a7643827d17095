"""``octo-host resolve`` and ``audit show``: an operator's audited decision, and the record.

``resolve`` is :func:`octo_host.audit.resolve_operation` (an ``op-`` key
decides an operation, a ``cmp-`` key a compensation): no frame is sent.

It must never send a frame, or print an operator's reason outside ``audit show``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
from typing import Any

from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
    printable,
)
from octo_host.audit import ResolutionRefused, load_audit, resolve_operation
from octo_host.cli.context import config_of, ledger_lock, open_store, plan_for, stored_ledger
from octo_host.cli.options import Verbs, token_arg
from octo_host.engine import WorkflowEngine

__all__ = ["cmd_audit_show", "cmd_resolve", "register"]


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``resolve`` and ``audit show`` to the verbs."""
    resolve = verbs.add_parser(
        "resolve",
        parents=[common],
        help="an operator's audited decision for a stuck operation or compensation",
    )
    resolve.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    resolve.add_argument(
        "key", type=token_arg, metavar="KEY", help="an operation key, or a compensation's cmp- key"
    )
    resolve.add_argument(
        "--state",
        required=True,
        choices=["succeeded", "failed", "cancelled"],
        metavar="STATE",
        help="what the operator found in the target system: succeeded, failed or cancelled",
    )
    resolve.add_argument(
        "--reason", required=True, metavar="TEXT", help="why, kept in the run's audit record"
    )
    resolve.add_argument("--operator", metavar="NAME", help="default: $USER")
    resolve.add_argument(
        "--plan",
        type=token_arg,
        metavar="NAME",
        help="the [[plans]] entry of the run (default: the one whose fingerprint the ledger holds)",
    )
    resolve.set_defaults(handler=cmd_resolve)

    audit = verbs.add_parser("audit", help="operator decisions")
    audit_verbs = audit.add_subparsers(
        dest="audit_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    ashow = audit_verbs.add_parser("show", parents=[common], help="a run's audit entries")
    ashow.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    ashow.set_defaults(handler=cmd_audit_show)


def _login_name() -> str:
    """``$USER`` (then ``$LOGNAME`` and the password database), or empty."""
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (OSError, KeyError):
        return ""


def cmd_resolve(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    operator = args.operator if args.operator is not None else _login_name()
    if not operator:
        raise CliError(EXIT_USAGE, "--operator: no name given and $USER is not set", "usage")

    async def resolve() -> dict[str, Any]:
        with ledger_lock(config):
            async with open_store(config, create=False) as store:
                plan = None
                if args.plan is not None:
                    ledger = await stored_ledger(store, args.run)
                    plan = plan_for(config, WorkflowEngine(), ledger, args.plan)
                try:
                    entry = await resolve_operation(
                        store,
                        args.run,
                        args.key,
                        args.state,
                        operator=operator,
                        reason=args.reason,
                        plan=plan,
                    )
                except ResolutionRefused as error:
                    raise CliError(EXIT_CHECK_FAILED, str(error), error.code) from None
        return {
            "run": entry.run,
            "operation_key": entry.key,
            "from": entry.from_state.value,
            "to": entry.to_state.value,
            "operator": entry.operator,
            "time": entry.time,
            "ledger_revision": entry.ledger_revision,
        }

    document = asyncio.run(resolve())
    out.line(
        f"{document['operation_key']}: {document['from']} -> {document['to']} "
        f"(ledger revision {document['ledger_revision']}; audited as {printable(operator)})"
    )
    out.document({"ok": True, **document})
    return EXIT_OK


def cmd_audit_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def load() -> list[dict[str, Any]]:
        async with open_store(config, create=False) as store:
            audited = await load_audit(store, args.run)
        return [
            {
                "run": item.entry.run,
                "operation_key": item.entry.key,
                "from": item.entry.from_state.value,
                "to": item.entry.to_state.value,
                "operator": item.entry.operator,
                "reason": item.entry.reason,
                "time": item.entry.time,
                "ledger_revision": item.entry.ledger_revision,
                "ledger_agrees": item.ledger_agrees,
            }
            for item in audited
        ]

    entries = asyncio.run(load())
    if not entries:
        out.line(f"no operator decisions for run {args.run}")
    for entry in entries:
        agrees = "" if entry["ledger_agrees"] else "  [NOT IN LEDGER]"
        out.line(
            f"{entry['time']}  {entry['operation_key']}  {entry['from']} -> {entry['to']}  "
            f"revision {entry['ledger_revision']}  by {printable(entry['operator'])}{agrees}"
        )
        out.line(f"    reason: {printable(entry['reason'], 1024)}")
    out.document({"ok": True, "run": args.run, "entries": entries})
    return EXIT_OK
