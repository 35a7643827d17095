"""``octo-host recover``: settle every unfinished key of a run after a restart.

``--inputs FILE`` reads ``{"operations": {KEY: input}, "compensations": {KEY:
{"inverse": input, "original": input}}}`` (inputs as JSON values: objects for
JSON tools, strings for text tools); the ledger keeps only fingerprints. An
operation is looked up without its input, which is needed only to send one
the worker never admitted; a compensation is looked up without one too, and
its inverse is needed only to send it again (the worker never admitted it,
or its adapter has no lookup).

It must never stop at one key's refusal (the others go on) or print a payload.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from octo_common.codec import parse_json
from octo_common.errors import OctoError, UnknownTool
from octo_common.payload import ToolPayload
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
    print_table,
    printable,
)
from octo_host.cli.context import (
    PROG,
    close_quietly,
    compensation_target,
    config_of,
    grant_format,
    plan_for,
    scope_of,
    stored_ledger,
    with_client,
)
from octo_host.cli.options import SCOPE_HELP, Verbs, payload_from_value, read_argument, token_arg
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationTarget

__all__ = ["cmd_recover", "register"]


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``recover`` to the verbs."""
    recover = verbs.add_parser(
        "recover", parents=[common], help="reconcile every unfinished key of a run"
    )
    recover.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    recover.add_argument("--scope", type=token_arg, metavar="S", help=SCOPE_HELP)
    recover.add_argument(
        "--inputs",
        metavar="FILE",
        help='JSON: {"operations": {KEY: input}, "compensations": {KEY: '
        '{"inverse": input, "original": input}}}',
    )
    recover.add_argument(
        "--plan",
        type=token_arg,
        metavar="NAME",
        help="the [[plans]] entry of the run (default: the one whose fingerprint the ledger holds)",
    )
    recover.set_defaults(handler=cmd_recover)


def _read_inputs(path: str | None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    if path is None:
        return {}, {}
    raw = read_argument("@" + path, "--inputs")
    try:
        document = parse_json(raw)
    except OctoError as exc:
        raise CliError(EXIT_USAGE, f"--inputs: not valid JSON ({exc.code})", "usage") from None
    if not isinstance(document, dict) or set(document) - {"operations", "compensations"}:
        raise CliError(
            EXIT_USAGE,
            '--inputs: expected an object with "operations" and/or "compensations"',
            "usage",
        )
    operations = document.get("operations", {})
    compensations = document.get("compensations", {})
    if not isinstance(operations, dict) or not isinstance(compensations, dict):
        raise CliError(EXIT_USAGE, "--inputs: operations and compensations are objects", "usage")
    for key, entry in compensations.items():
        if (
            not isinstance(entry, dict)
            or "inverse" not in entry
            or set(entry) - {"inverse", "original"}
        ):
            raise CliError(
                EXIT_USAGE,
                f'--inputs: compensations.{printable(key)}: expected {{"inverse", "original"}}',
                "usage",
            )
    return operations, compensations


def cmd_recover(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    scope = scope_of(config, args.scope)
    manifest = config.manifest(scope)
    raw_operations, raw_compensations = _read_inputs(args.inputs)
    no_input: set[str] = set()

    async def body(client: HostClient) -> dict[str, Any]:
        ledger = await stored_ledger(client.store, args.run)
        plan = plan_for(config, client.engine, ledger, args.plan)
        inputs: dict[str, ToolPayload] = {}
        compensations: dict[str, tuple[WorkflowCompensationTarget, ToolPayload]] = {}
        refused: dict[str, str] = {}
        for key, value in raw_operations.items():
            operation = ledger.operation(key)
            if operation is None:
                raise CliError(
                    EXIT_USAGE,
                    f"--inputs: operations: {printable(key)} is not in the run",
                    "usage",
                )
            try:
                fmt = grant_format(config, scope, operation.tool)
            except CliError:  # this key's grant is gone: the others go on
                refused[key] = UnknownTool.code  # what the worker would answer
                continue
            inputs[key] = payload_from_value(fmt, value, f"--inputs operations.{key}")
        for key, entry in raw_compensations.items():
            operation = ledger.operation(key)
            if operation is None:
                raise CliError(
                    EXIT_USAGE,
                    f"--inputs: compensations: {printable(key)} is not in the run",
                    "usage",
                )
            named = (
                key if operation.compensation is None else operation.compensation.compensation_key
            )
            try:
                fmt = grant_format(config, scope, operation.tool)
            except CliError:
                refused[named] = UnknownTool.code
                continue
            inverse = payload_from_value(fmt, entry["inverse"], f"--inputs compensations.{key}")
            original = (
                None
                if "original" not in entry
                else payload_from_value(fmt, entry["original"], f"--inputs compensations.{key}")
            )
            try:
                target = compensation_target(config, scope, operation, original)
            except (CliError, OctoError) as error:  # e.g. compensation revoked (max 0)
                refused[named] = error.code
                continue
            compensations[key] = (target, inverse)
        summary = await client.recover(
            args.run, plan, scope, manifest, inputs=inputs, compensations=compensations
        )
        await close_quietly(client, summary.session)
        # A key refused here was left out of what recover() may send: the reason it
        # is still unresolved (a compensation's lookup may have settled it anyway).
        unresolved, settled = set(summary.unresolved), set(summary.reconciled)
        errors = {
            **summary.errors,
            **{k: code for k, code in refused.items() if k in unresolved or k not in settled},
        }
        # An operation is looked up without its input; one the worker never admitted
        # (not reconciled) needs it to be sent. A compensation is always looked up
        # first, so one without an error code is unfinished there.
        no_input.update(
            key
            for key in summary.unresolved
            if key not in errors
            and key not in settled
            and ledger.operation(key) is not None
            and key not in inputs
        )
        return {
            "run": args.run,
            "revision": summary.run.revision,
            "operations": {k: v.value for k, v in summary.operations.items()},
            "compensations": {k: v.value for k, v in summary.compensations.items()},
            "reconciled": list(summary.reconciled),
            "retried": {
                key: operation.retry_of
                for key in dict.fromkeys(summary.retried)
                if (operation := summary.run.operation(key)) is not None
            },
            "unresolved": list(dict.fromkeys(summary.unresolved)),
            "errors": errors,
        }

    document = asyncio.run(with_client(config, scope, body))
    ok = not document["unresolved"]
    document = {"ok": ok, **document}
    out.line(f"run:       {document['run']}")
    out.line(f"revision:  {document['revision']}")
    rows = [["KEY", "STATE", "COMPENSATION", "RECONCILED", "RETRY OF"]]
    for key, state in document["operations"].items():
        rows.append(
            [
                key,
                state,
                document["compensations"].get(key, "-"),
                "yes" if key in document["reconciled"] or key in document["retried"] else "no",
                document["retried"].get(key) or "-",
            ]
        )
    if len(rows) > 1:
        print_table(rows, out)
    elif not document["unresolved"]:
        out.line("no operations")
    out.document(document)
    for key in document["unresolved"]:
        reason = document["errors"].get(key)
        if reason is None:
            reason = (
                "no input given (the worker never admitted it; --inputs sends it)"
                if key in no_input
                else f"not finished at the worker yet (next: {PROG} find {key})"
            )
        out.line(f"unresolved: {key}: {reason}")
    for key, code in document["errors"].items():
        if key not in document["unresolved"]:
            out.line(f"failed:    {key}: {code}")
    if not ok:
        unresolved = document["unresolved"]
        hint = (
            "give their inputs with --inputs, or reconcile / resolve them"
            if no_input
            else "see the reasons above; recover again later, or resolve them"
        )
        out.error(
            f"{len(unresolved)} key(s) unresolved: " + ", ".join(unresolved[:5]) + f" ({hint})"
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK
