"""``octo-host resolve`` and ``audit show``: an operator's audited decision, and the record.

``resolve`` (an ``op-`` key decides an operation, a ``cmp-`` key a
compensation) appends the decision to the run's audit record
(:func:`octo_host.audit.record_decision`), then sends it to the worker in a
sealed lookup request: the worker records it in its journal for a key it
holds ``pending`` or ``running`` (the adapter is not called, no effect runs)
and answers the state its journal then holds, which the ledger records. A
worker whose journal holds no row for the key leaves the ledger to decide
alone, as ``--host-only`` does.

It must never send anything but that lookup request, or print an operator's
reason outside ``audit show``.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
from typing import Any

from octo_common.errors import UnknownCompensation, UnknownOperation, WorkerRequestRejected
from octo_common.messages import Resolution
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
    printable,
)
from octo_host.audit import (
    AuditEntry,
    ResolutionRefused,
    apply_decision,
    check_decision,
    load_audit,
    record_decision,
)
from octo_host.cli.context import (
    close_quietly,
    config_of,
    ledger_lock,
    load_recorded,
    open_store,
    plan_for,
    run_of,
    scope_of,
    stored_ledger,
    with_client,
)
from octo_host.cli.options import SCOPE_HELP, Verbs, token_arg
from octo_host.client import HostClient
from octo_host.config import HostConfig
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
        nargs="?",
        metavar="RUN",
        help="the workflow run's id (default: the run whose ledger holds KEY)",
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
    resolve.add_argument("--scope", type=token_arg, metavar="S", help=SCOPE_HELP)
    resolve.add_argument(
        "--host-only",
        action="store_true",
        help="decide the ledger alone, telling no worker (a worker that is gone for good)",
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
    """Audit the decision, tell the worker (its journal records it, nothing runs), and
    record its answer in the ledger; ``--host-only`` (or a worker that holds no row
    for the key) decides the ledger alone."""
    config = config_of(args)
    operator = args.operator if args.operator is not None else _login_name()
    if not operator:
        raise CliError(EXIT_USAGE, "--operator: no name given and $USER is not set", "usage")
    if args.host_only:
        document = asyncio.run(_resolve_on_host(args, config, operator))
    else:
        asyncio.run(_check_first(args, config, operator))  # refused before the broker
        document = asyncio.run(_resolve_on_both(args, config, operator))
    state = document.get("worker_state")
    agrees = state is None or state == document["to"]
    out.line(
        f"{document['operation_key']}: {document['from']} -> {document['to']} "
        f"(ledger revision {document['ledger_revision']}; audited as {printable(operator)})"
    )
    out.line(f"worker journal: {document['worker']}")
    out.document({"ok": agrees, **document})
    if not agrees:
        out.error(
            f"the worker's journal already held {state}: the ledger follows it "
            f"and the decision ({document['to']}) was not applied"
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK


async def _check_first(args: argparse.Namespace, config: HostConfig, operator: str) -> None:
    with ledger_lock(config):
        async with open_store(config, create=False) as store:
            args.run = await run_of(store, args.run, args.key)
            plan = None
            if args.plan is not None:
                ledger = await stored_ledger(store, args.run)
                plan = plan_for(config, WorkflowEngine(), ledger, args.plan)
            try:
                await check_decision(
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


async def _resolve_on_host(
    args: argparse.Namespace, config: HostConfig, operator: str
) -> dict[str, Any]:
    with ledger_lock(config):
        async with open_store(config, create=False) as store:
            args.run = await run_of(store, args.run, args.key)
            plan = None
            if args.plan is not None:
                ledger = await stored_ledger(store, args.run)
                plan = plan_for(config, WorkflowEngine(), ledger, args.plan)
            try:
                entry = await record_decision(
                    store,
                    args.run,
                    args.key,
                    args.state,
                    operator=operator,
                    reason=args.reason,
                    plan=plan,
                )
                await apply_decision(store, entry, plan=plan)
            except ResolutionRefused as error:
                raise CliError(EXIT_CHECK_FAILED, str(error), error.code) from None
    return {**_entry_doc(entry), "worker": "not told (--host-only)"}


async def _resolve_on_both(
    args: argparse.Namespace, config: HostConfig, operator: str
) -> dict[str, Any]:
    scope = scope_of(config, args.scope)
    manifest = config.manifest(scope)

    async def body(client: HostClient) -> dict[str, Any]:
        run = await load_recorded(client, config, args.run, args.plan)
        try:
            # Audited first: a crash after this leaves a recorded decision the
            # ledger does not show yet (audit show: NOT IN LEDGER), never the reverse.
            entry = await record_decision(
                client.store,
                args.run,
                args.key,
                args.state,
                operator=operator,
                reason=args.reason,
                plan=run.plan,
            )
        except ResolutionRefused as error:
            raise CliError(EXIT_CHECK_FAILED, str(error), error.code) from None
        resolution = Resolution(entry.to_state.value, operator, args.reason, args.run)  # type: ignore[arg-type]
        session = await client.open_session(scope, manifest)
        try:
            state = await client.resolve(session, run, args.key, resolution)
        except WorkerRequestRejected as error:
            if error.rejection_code not in (UnknownOperation.code, UnknownCompensation.code):
                raise
            # The worker's journal holds no row for the key (never admitted, or
            # the journal was lost): nothing there to settle; the ledger alone.
            await apply_decision(client.store, entry, plan=run.plan)
            return {**_entry_doc(entry), "worker": f"holds no row for it ({error.rejection_code})"}
        finally:
            await close_quietly(client, session)
        return {
            **_entry_doc(entry),
            "worker": f"recorded {state.kind.value} (scope {scope})",
            "worker_state": state.kind.value,
        }

    result: dict[str, Any] = await with_client(config, scope, body)
    return result


def _entry_doc(entry: AuditEntry) -> dict[str, Any]:
    return {
        "run": entry.run,
        "operation_key": entry.key,
        "from": entry.from_state.value,
        "to": entry.to_state.value,
        "operator": entry.operator,
        "time": entry.time,
        "ledger_revision": entry.ledger_revision,
    }


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
