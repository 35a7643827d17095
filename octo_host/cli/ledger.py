"""``octo-host ledger show``, ``ledger init-anchor`` and ``find``: a run's ledger, the
rollback anchor, and the run that holds a key.

``find KEY`` searches every run's ledger (each authenticated as it is
loaded) for an operation key or a compensation's ``cmp-`` key, and prints
the run, the key's state and the complete commands that settle it.

It must never show inputs (the ledger holds fingerprints only) or replace an
anchor without ``--force``.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
from typing import Any

from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    CliError,
    OneLineParser,
    Output,
    anchor_to_write,
    print_table,
)
from octo_host.cli.context import (
    config_of,
    open_store,
    plan_for,
    plan_name,
    runs_holding,
    stored_ledger,
)
from octo_host.cli.options import Verbs, token_arg
from octo_host.cli.results import operation_doc
from octo_host.client.runs import stored_routes
from octo_host.engine import WorkflowEngine
from octo_host.ledger import WorkflowOperationLedger
from octo_host.store import initialise_anchor

__all__ = ["cmd_find", "cmd_ledger_init_anchor", "cmd_ledger_show", "register"]


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
    find = verbs.add_parser(
        "find", parents=[common], help="the run that holds an operation or compensation key"
    )
    find.add_argument("key", type=token_arg, metavar="KEY", help="op-... or cmp-...")
    find.set_defaults(handler=cmd_find)


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
                    "-" if compensation is None else _state_cell(compensation),
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


def cmd_find(args: argparse.Namespace, out: Output) -> int:
    """The run holding ``KEY`` (exit 1 when none does), its state and next commands."""
    config = config_of(args)
    key = args.key

    async def search() -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        async with open_store(config, create=False) as store:
            for run in await runs_holding(store, key):
                ledger = await stored_ledger(store, run)
                operation = ledger.operation(key) or ledger.compensated_operation(key)
                if operation is not None:
                    scope = (await stored_routes(store, run)).get(operation.operation_key)
                    # Every attempt of the step's logical operation (a retry policy's chain).
                    attempts = [op.operation_key for op in ledger.attempts(operation.operation_key)]
                    found.append(
                        {
                            "run": run,
                            "scope": scope,
                            **operation_doc(operation),
                            "attempts": attempts,
                        }
                    )
        return found

    found = asyncio.run(search())
    if not found:
        raise CliError(EXIT_CHECK_FAILED, f"no run's ledger holds {key}", "not_found")
    for index, item in enumerate(found):
        if index:
            out.line()
        compensation = item["compensation"]
        own = compensation if key.startswith("cmp-") and compensation is not None else item
        state = str(own["state"])
        item["commands"] = _next_commands(item["run"], key, state, item["scope"])
        out.line(f"run:            {item['run']}")
        out.line(f"key:            {key}")
        out.line(f"step / tool:    {item['step']} / {item['tool']}")
        if own is compensation:
            out.line(f"operation key:  {item['operation_key']} ({_state_cell(item)})")
        out.line(f"state:          {_state_cell(own)}")
        attempts = item["attempts"]
        if len(attempts) > 1:
            number = attempts.index(item["operation_key"]) + 1
            out.line(f"attempt:        {number} of {len(attempts)} (first {attempts[0]})")
            if number < len(attempts):
                out.line(f"replaced by:    {attempts[number]}")
        out.line(f"scope:          {item['scope'] or '(never dispatched)'}")
        for command in item["commands"]:
            out.line(f"next:           {command}")
    out.document({"ok": True, "key": key, "runs": found})
    return EXIT_OK


def _next_commands(run: str, key: str, state: str, scope: str | None) -> list[str]:
    """The complete commands that settle ``key`` of ``run`` in ``state`` (the decision
    and its reason are the operator's to fill in)."""
    named = f"{shlex.quote(run)} {shlex.quote(key)}"
    if scope is not None:
        named += f" --scope {shlex.quote(scope)}"
    if state in ("pending", "running"):
        return [
            f"octo-host reconcile {named}",
            f"octo-host resolve {named} --state succeeded|failed|cancelled --reason TEXT",
        ]
    return [f"octo-host ledger show {shlex.quote(run)}"]


def _state_cell(record: dict[str, Any]) -> str:
    """A record's state, with its failure code when it has one: ``failed [input_refused]``."""
    failure = record.get("failure")
    return str(record["state"]) if failure is None else f"{record['state']} [{failure}]"


def cmd_ledger_init_anchor(args: argparse.Namespace, out: Output) -> int:
    anchor = anchor_to_write(
        config_of(args).anchor_path, "ledger.anchor", args.force, "--force replaces it"
    )
    anchor.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    initialise_anchor(anchor, overwrite=args.force)
    out.line(f"created {anchor}")
    out.document({"ok": True, "anchor": str(anchor)})
    return EXIT_OK
