"""``octo-worker topology declare`` and ``topology show``: the broker side of the configured scopes.

``declare`` declares the exchanges, the scopes' queues (and reply queues
named with ``--host-id``) and applies the delivery-limit and dead-letter
policies; ``show`` prints each queue's message and consumer counts.

It must never print the broker URL's credentials.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Output,
    print_table,
)
from octo_common.transport import DEAD_OVERFLOW, DEAD_POLICY_NAME, WORKER_POLICY_NAME
from octo_worker.cli.common import (
    Verbs,
    broker_connection,
    check_tokens,
    config_of,
    delivery_limit,
    verb_group,
    vhost,
)
from octo_worker.config import WorkerConfig
from octo_worker.daemon.topology import (
    TopologyError,
    TopologyReport,
    declare_topology,
    describe_topology,
    open_confirm_channel,
)

__all__ = ["cmd_topology_declare", "cmd_topology_show", "register"]


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``topology declare`` and ``topology show`` to the verbs."""
    topology_verbs = verb_group(verbs, "topology", "broker exchanges, queues and policy")
    declare = topology_verbs.add_parser(
        "declare", parents=[common], help="declare the configured scopes' topology and policy"
    )
    declare.add_argument(
        "--delivery-limit",
        type=delivery_limit,
        default=None,
        metavar="N",
        help="policy delivery limit (default: [broker] delivery_limit)",
    )
    declare.add_argument(
        "--host-id",
        action="append",
        default=[],
        metavar="ID",
        help="also declare the reply queue octo.v5.reply.ID (repeatable)",
    )
    declare.add_argument(
        "--skip-policy",
        action="store_true",
        help="declare queues only; the policy comes from rabbitmq-definitions.json",
    )
    declare.set_defaults(handler=cmd_topology_declare)
    show = topology_verbs.add_parser(
        "show", parents=[common], help="message and consumer counts of the queues"
    )
    show.add_argument(
        "--host-id",
        action="append",
        default=[],
        metavar="ID",
        help="also show the reply queue octo.v5.reply.ID (repeatable)",
    )
    show.set_defaults(handler=cmd_topology_show)


def cmd_topology_declare(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    limit = None if args.skip_policy else (args.delivery_limit or config.broker.delivery_limit)
    if limit is not None and not 1 <= limit <= 2**31 - 1:
        # Only reachable through the configuration (the option is checked by argparse).
        raise CliError(
            EXIT_USAGE,
            "broker.delivery_limit: must be between 1 and 2147483647",
            "invalid_configuration",
        )
    report = asyncio.run(_declare(config, list(args.host_id), limit))
    via, dead_via = report.policy_applied_via, report.dead_letter_policy_applied_via
    broker = config.broker
    dead_bound = (
        f"max-length={broker.dead_letter_max_length} "
        f"max-length-bytes={broker.dead_letter_max_bytes} overflow={DEAD_OVERFLOW}"
    )
    for queue in report.queues:
        out.line(f"declared {queue}")
    if limit is None:
        out.line("policy: not applied (--skip-policy)")
        out.line("dead-letter policy: not applied (--skip-policy)")
    else:
        out.line(f"policy: {WORKER_POLICY_NAME} delivery-limit={limit} applied via {via}")
        out.line(f"dead-letter policy: {DEAD_POLICY_NAME} {dead_bound} applied via {dead_via}")
    out.document(
        {
            "ok": True,
            "queues": list(report.queues),
            "policy": None
            if limit is None
            else {"name": WORKER_POLICY_NAME, "delivery_limit": limit, "applied_via": via},
            "dead_letter_policy": None
            if limit is None
            else {
                "name": DEAD_POLICY_NAME,
                "max_length": broker.dead_letter_max_length,
                "max_length_bytes": broker.dead_letter_max_bytes,
                "overflow": DEAD_OVERFLOW,
                "applied_via": dead_via,
            },
        }
    )
    return EXIT_OK


async def _declare(config: WorkerConfig, host_ids: list[str], limit: int | None) -> TopologyReport:
    check_tokens("--host-id", host_ids)
    async with broker_connection(config) as connection:
        channel = await open_confirm_channel(connection)
        try:
            report = await declare_topology(
                channel,
                [scope.name for scope in config.scopes],
                host_ids=host_ids,
                delivery_limit=limit,
                dead_letter_max_length=config.broker.dead_letter_max_length,
                dead_letter_max_bytes=config.broker.dead_letter_max_bytes,
                vhost=vhost(config.broker.url),
            )
        except TopologyError as error:
            raise CliError(EXIT_BROKER, f"topology: {error.reason}", error.code) from None
    return report


def cmd_topology_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    statuses = asyncio.run(_describe(config, list(args.host_id)))
    rows = [["QUEUE", "EXISTS", "MESSAGES", "CONSUMERS"]]
    for status in statuses:
        rows.append(
            [
                status.name,
                "yes" if status.exists else "no",
                "-" if status.messages is None else str(status.messages),
                "-" if status.consumers is None else str(status.consumers),
            ]
        )
    print_table(rows, out)
    out.document(
        {
            "ok": True,
            "queues": [
                {
                    "name": s.name,
                    "exists": s.exists,
                    "messages": s.messages,
                    "consumers": s.consumers,
                }
                for s in statuses
            ],
        }
    )
    return EXIT_OK


async def _describe(config: WorkerConfig, host_ids: list[str]) -> list[Any]:
    check_tokens("--host-id", host_ids)
    async with broker_connection(config) as connection:
        channel = await connection.channel()
        return await describe_topology(
            channel, [scope.name for scope in config.scopes], host_ids=host_ids
        )
