"""``octo-host compensate``: record and send the one compensation of a succeeded operation.

It resumes a recorded, unfinished compensation with the same inverse under a
fresh approval and refuses any other second compensation.

It must never record a second compensation for an operation, or print a payload.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from typing import Any

from octo_common.errors import CompensationAlreadyRecorded
from octo_common.payload import canonical_operation_input_bytes
from octo_common.runtime.output import EXIT_USAGE, CliError, OneLineParser, Output
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.cli.context import (
    close_quietly,
    compensation_target,
    config_of,
    grant_format,
    load_recorded,
    recorded_operation,
    scope_of,
    with_client,
)
from octo_host.cli.options import SCOPE_HELP, Verbs, payload_of, token_arg
from octo_host.cli.results import finish, operation_result, result_lines
from octo_host.client import HostClient
from octo_host.compensation import WorkflowCompensationDispatch

__all__ = ["cmd_compensate", "register"]


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``compensate`` to the verbs."""
    compensate = verbs.add_parser(
        "compensate", parents=[common], help="record and send the one compensation"
    )
    compensate.add_argument(
        "run",
        type=token_arg,
        metavar="RUN",
        help="the workflow run's id (one ledger record per run)",
    )
    compensate.add_argument(
        "key", type=token_arg, metavar="KEY", help="the succeeded operation's key (op-...)"
    )
    compensate.add_argument("--scope", type=token_arg, metavar="S", help=SCOPE_HELP)
    compensate.add_argument(
        "--payload", required=True, metavar="JSON|@FILE", help="the inverse input"
    )
    compensate.add_argument(
        "--nonce",
        required=True,
        metavar="TEXT",
        help="part of the cmp- key: the same nonce and inverse give the same key again",
    )
    compensate.add_argument(
        "--original",
        metavar="JSON|@FILE",
        help="the original operation's input (needed when [[actions]] match fields)",
    )
    compensate.add_argument(
        "--plan",
        type=token_arg,
        metavar="NAME",
        help="the [[plans]] entry of the run (default: the one whose fingerprint the ledger holds)",
    )
    compensate.set_defaults(handler=cmd_compensate)


def cmd_compensate(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    scope = scope_of(config, args.scope)
    manifest = config.manifest(scope)
    nonce = args.nonce.encode("utf-8")

    async def body(client: HostClient) -> tuple[dict[str, Any], StateKind]:
        run = await load_recorded(client, config, args.run, args.plan)
        operation = recorded_operation(run, args.key)
        fmt = grant_format(config, scope, operation.tool)
        inverse = payload_of(fmt, args.payload, "--payload")
        original = None if args.original is None else payload_of(fmt, args.original, "--original")
        rule = config.action(operation.tool)
        if rule is not None and rule.match and original is None:
            raise CliError(
                EXIT_USAGE,
                f"--original: required for {operation.tool} (its [[actions]] entry matches "
                f"{', '.join(rule.match)} against the original input)",
                "usage",
            )
        target = compensation_target(config, scope, operation, original)
        existing = operation.compensation
        compensation_key: str | None = None
        if existing is None:
            try:
                compensation_key = await client.record_compensation(run, target, inverse, nonce)
            except CompensationAlreadyRecorded:
                # Another host sharing the ledger recorded one first: resumed below
                # if it is this inverse, refused otherwise.
                existing = recorded_operation(run, args.key).compensation
                if existing is None:
                    raise
        if compensation_key is None:
            assert existing is not None
            if existing.state in TERMINAL_KINDS or not existing.matches_input(
                canonical_operation_input_bytes(inverse)
            ):
                raise CompensationAlreadyRecorded(args.key)
            # The recorded intent, resumed under a fresh approval (same key and input).
            compensation_key = existing.compensation_key
        session = await client.open_session(scope, manifest)
        try:
            state = await client.compensate(
                session,
                run,
                target,
                WorkflowCompensationDispatch(f"c-{secrets.token_hex(8)}", inverse),
            )
        finally:
            await close_quietly(client, session)
        document = operation_result(run, args.key, state, None)
        settled = run.operation(args.key)
        assert settled is not None and settled.compensation is not None
        document["compensation_key"] = compensation_key
        document["compensation_state"] = settled.compensation.state.value
        return document, state.kind

    document, state = asyncio.run(with_client(config, scope, body))
    lines = result_lines(document)
    lines.append(f"compensation state: {document['compensation_state']}")
    return finish(out, document, lines, state, f"compensation {document['compensation_key']}")
