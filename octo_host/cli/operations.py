"""``octo-host dispatch`` and ``reconcile``: send a recorded operation, or ask for the state
of an operation or (``cmp-`` key) of a compensation.

``dispatch`` derives the ``op-`` key from plan, step, tool, input and nonce
(default nonce ``RUN/STEP``), so repeating the same command after a crash
finds the recorded key and settles it instead of creating another.

It must never create a second key for one step's input and nonce, or print
a payload.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from octo_common.errors import DuplicateOperationKey, UnknownCompensation, WorkerRequestRejected
from octo_common.payload import canonical_operation_input_bytes
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
)
from octo_common.states import StateKind
from octo_host.cli.context import (
    PROG,
    close_quietly,
    config_of,
    grant_format,
    load_recorded,
    plan_named,
    recorded_operation,
    run_of,
    scope_of,
    with_client,
)
from octo_host.cli.options import SCOPE_HELP, Verbs, payload_of, token_arg
from octo_host.cli.results import finish, operation_result, result_lines
from octo_host.client import HostClient, HostRun

__all__ = ["cmd_dispatch", "cmd_reconcile", "register"]


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``dispatch`` and ``reconcile`` to the verbs."""
    dispatch = verbs.add_parser(
        "dispatch", parents=[common], help="record an operation and dispatch it"
    )
    dispatch.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    dispatch.add_argument(
        "--plan",
        type=token_arg,
        required=True,
        metavar="NAME",
        help="the [[plans]] entry the run follows (a new run is created with it)",
    )
    dispatch.add_argument(
        "--step",
        required=True,
        metavar="STEP",
        help="the id of the plan's step this operation performs",
    )
    dispatch.add_argument(
        "--tool",
        type=token_arg,
        required=True,
        metavar="TOOL",
        help="the adapter's tool name, e.g. files.publish (a [[grants]] entry must allow it)",
    )
    dispatch.add_argument("--scope", type=token_arg, metavar="S", help=SCOPE_HELP)
    dispatch.add_argument(
        "--payload",
        required=True,
        metavar="JSON|@FILE",
        help="the operation's input: JSON text, or @FILE to read it from a file",
    )
    dispatch.add_argument(
        "--nonce", metavar="TEXT", help="key nonce (default RUN/STEP: the same command, same key)"
    )
    dispatch.set_defaults(handler=cmd_dispatch)

    reconcile = verbs.add_parser(
        "reconcile",
        parents=[common],
        help="ask the worker for a recorded operation's or compensation's state",
    )
    reconcile.add_argument(
        "run",
        type=token_arg,
        nargs="?",
        metavar="RUN",
        help="the workflow run's id (default: the run whose ledger holds KEY)",
    )
    reconcile.add_argument(
        "key",
        type=token_arg,
        metavar="KEY",
        help="an operation key, or a compensation's cmp- key (looked up, no input needed)",
    )
    reconcile.add_argument("--scope", type=token_arg, metavar="S", help=SCOPE_HELP)
    reconcile.add_argument(
        "--payload",
        metavar="JSON|@FILE",
        help="optional: the operation's input, checked against the recorded fingerprint "
        "(the lookup itself needs none)",
    )
    reconcile.add_argument(
        "--plan",
        type=token_arg,
        metavar="NAME",
        help="the [[plans]] entry of the run (default: the one whose fingerprint the ledger holds)",
    )
    reconcile.set_defaults(handler=cmd_reconcile)


def cmd_dispatch(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    scope, tool, step = scope_of(config, args.scope), args.tool, args.step
    payload = payload_of(grant_format(config, scope, tool), args.payload, "--payload")
    manifest = config.manifest(scope)
    nonce_text = args.nonce if args.nonce is not None else f"{args.run}/{step}"
    nonce = nonce_text.encode("utf-8")

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind]:
        plan = plan_named(config, client.engine, args.plan)
        run = await client.load_run(args.run, plan)
        data = canonical_operation_input_bytes(payload)
        key = client.engine.derive_operation_key(plan, step, tool, data, nonce)
        recorded = run.operation(key) is None
        if recorded:
            try:
                await client.record_operation(run, step, tool, payload, nonce, scope=scope)
            except DuplicateOperationKey:
                # Another host sharing the ledger recorded this step's intent first:
                # the run now holds it under the same derived key; it is settled.
                recorded = False
        session = await client.open_session(scope, manifest)
        try:
            state = await client.dispatch(session, run, key, payload)
            # The step's retry policy, if any: the attempt that replaces a key proven
            # not to have happened, recorded first, then sent.
            key, state = await client.follow_retries(session, run, key, payload, state)
        finally:
            await close_quietly(client, session)
        return operation_result(run, key, state, recorded), state.kind

    document, state = asyncio.run(with_client(config, scope, body))
    return finish(
        out, document, result_lines(document), state, f"operation {document['operation_key']}"
    )


def cmd_reconcile(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    scope = scope_of(config, args.scope)
    manifest = config.manifest(scope)

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind, str]:
        args.run = await run_of(client.store, args.run, args.key)
        run = await load_recorded(client, config, args.run, args.plan)
        if run.operation(args.key) is None:
            compensated = run.ledger.compensated_operation(args.key)
            if compensated is not None:
                return await _look_up_compensation(client, run, compensated.operation_key)
        operation = recorded_operation(run, args.key)
        # A lookup carries no input: what the ledger holds names the key. A given
        # input is only checked against the recorded fingerprint.
        payload = None
        if args.payload is not None:
            tool_format = grant_format(config, scope, operation.tool)
            payload = payload_of(tool_format, args.payload, "--payload")
            operation.verify_input(canonical_operation_input_bytes(payload))
        session = await client.open_session(scope, manifest)
        try:
            state = await client.reconcile(session, run, args.key, payload)
        except WorkerRequestRejected as error:
            if error.rejection_code != "unknown_operation":
                raise
            raise CliError(
                EXIT_CHECK_FAILED,
                f"the worker never admitted {args.key}; send it with: {PROG} recover "
                f"{args.run} --scope {scope} --inputs FILE (or dispatch it again)",
                "unknown_operation",
            ) from None
        finally:
            await close_quietly(client, session)
        document = operation_result(run, args.key, state, None)
        return document, state.kind, f"operation {args.key}"

    async def _look_up_compensation(
        client: HostClient, run: HostRun, operation_key: str
    ) -> tuple[dict[str, Any], StateKind, str]:
        # A lookup names the compensation as recorded; it takes no input, runs nothing.
        if args.payload is not None:
            raise CliError(
                EXIT_USAGE, "--payload: a compensation is looked up without input", "usage"
            )
        session = await client.open_session(scope, manifest)
        try:
            state = await client.reconcile_compensation(session, run, operation_key)
        except WorkerRequestRejected as error:
            if error.rejection_code != UnknownCompensation.code:
                raise
            raise CliError(
                EXIT_CHECK_FAILED,
                f"the worker never admitted {args.key}; send it with: {PROG} recover "
                f"{args.run} --scope {scope} --inputs FILE (its recorded inverse), "
                f"or {PROG} compensate",
                UnknownCompensation.code,
            ) from None
        finally:
            await close_quietly(client, session)
        document = operation_result(run, operation_key, state, None)
        settled = run.operation(operation_key)
        assert settled is not None and settled.compensation is not None
        document["compensation_key"] = args.key
        document["compensation_state"] = settled.compensation.state.value
        return document, state.kind, f"compensation {args.key}"

    document, state, what = asyncio.run(with_client(config, scope, body))
    lines = result_lines(document)
    if "compensation_state" in document:
        lines.append(f"compensation state: {document['compensation_state']}")
    return finish(out, document, lines, state, what)
