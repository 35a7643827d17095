"""``octo-host ledger show`` and ``ledger init-anchor``: a run's ledger, the rollback anchor.

It must never show inputs (the ledger holds fingerprints only) or replace an
anchor without ``--force``.
"""

from __future__ import annotations

import argparse
import asyncio

from octo_common.runtime.output import EXIT_OK, OneLineParser, Output, anchor_to_write, print_table
from octo_host.cli.context import config_of, open_store, plan_for, plan_name, stored_ledger
from octo_host.cli.options import Verbs, token_arg
from octo_host.cli.results import operation_doc
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.store import initialise_anchor

__all__ = ["cmd_ledger_init_anchor", "cmd_ledger_show", "register"]


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``ledger show`` and ``ledger init-anchor`` to the verbs."""
    ledger = verbs.add_parser("ledger", help="the run ledgers")
    ledger_verbs = ledger.add_subparsers(
        dest="ledger_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    show = ledger_verbs.add_parser("show", parents=[common], help="one run's ledger (no inputs)")
    show.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    show.add_argument("--plan", type=token_arg, metavar="NAME", help="check against this plan")
    show.set_defaults(handler=cmd_ledger_show)
    anchor = ledger_verbs.add_parser(
        "init-anchor", parents=[common], help="create the rollback anchor file (ledger.anchor)"
    )
    anchor.add_argument("--force", action="store_true", help="replace an existing anchor")
    anchor.set_defaults(handler=cmd_ledger_init_anchor)


def cmd_ledger_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def load() -> tuple[WorkflowOperationLedger, str | None]:
        async with open_store(config, create=False) as store:
            ledger = await stored_ledger(store, args.run)
        if args.plan is not None:
            plan_for(config, WorkflowEngine(), ledger, args.plan)
            return ledger, args.plan
        return ledger, plan_name(config, ledger.plan_fingerprint)

    ledger, named_plan = asyncio.run(load())
    operations = [operation_doc(op) for op in ledger.operations]
    out.line(f"run:              {args.run}")
    out.line(f"format version:   {ledger.format_version}")
    out.line(f"revision:         {ledger.revision}")
    out.line(f"plan fingerprint: {ledger.plan_fingerprint}")
    out.line(f"plan:             {named_plan or '(not among [[plans]])'}")
    if operations:
        rows = [["STEP", "TOOL", "KEY", "STATE", "ATTEMPT", "COMPENSATION", "COMP. STATE"]]
        for op in operations:
            compensation = op["compensation"]
            failure = op["failure"]
            retry_of = op["retry_of"]
            rows.append(
                [
                    op["step"],
                    op["tool"],
                    op["operation_key"],
                    op["state"] if failure is None else f"{op['state']} [{failure}]",
                    str(op["attempt"])
                    if retry_of is None
                    else f"{op['attempt']} (after {retry_of})",
                    "-" if compensation is None else compensation["compensation_key"],
                    "-" if compensation is None else compensation["state"],
                ]
            )
        out.line()
        print_table(rows, out)
    else:
        out.line("no operations")
    out.document(
        {
            "ok": True,
            "run": args.run,
            "format_version": ledger.format_version,
            "revision": ledger.revision,
            "plan_fingerprint": ledger.plan_fingerprint,
            "plan": named_plan,
            "operations": operations,
        }
    )
    return EXIT_OK


def cmd_ledger_init_anchor(args: argparse.Namespace, out: Output) -> int:
    anchor = anchor_to_write(
        config_of(args).anchor_path, "ledger.anchor", args.force, "--force replaces it"
    )
    anchor.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    initialise_anchor(anchor, overwrite=args.force)
    out.line(f"created {anchor}")
    out.document({"ok": True, "anchor": str(anchor)})
    return EXIT_OK
