"""A host service that opens help-desk tickets through Octo, with the short API.

    python examples/host_service.py --config host.toml open "printer on fire" "disk full"
    python examples/host_service.py --config host.toml close "disk full"

Each ticket is one run of the configured plan ``ticket`` (one step,
``open``), named after its title, so running the same command again is the
same job: ``execute`` finds the key the first run recorded and reconciles
it, and the desk never gets a second ticket. ``close`` undoes one ticket
through its one compensation (``tickets.open``'s inverse, allowed by
``[[actions]]``). Prints one JSON line per ticket; exits 1 when an outcome
is not known yet (pending or running): run the same command again later,
which reconciles before anything is sent again.

The worker serves ``tickets.open`` (``examples/octo-example-tickets``); the
host configuration grants it and names the plan::

    [[grants]]
    scope = "helpdesk"
    tool = "tickets.open"
    format = "json"
    max_calls = 64
    max_compensations = 1

    [[actions]]
    tool = "tickets.open"
    inverse = { close = "ticket" }

    [[plans]]
    name = "ticket"
    steps = [{ id = "open", source = "open the help-desk ticket" }]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys

import structlog

from octo_common.payload import ToolPayload
from octo_common.states import StateKind
from octo_host.client import HostClient

TOOL = "tickets.open"


def run_name(title: str) -> str:
    """One run per ticket title (a token, whatever the title holds)."""
    return "ticket-" + hashlib.sha256(title.encode()).hexdigest()[:24]


async def open_tickets(config: str, titles: list[str]) -> list[StateKind]:
    states = []
    async with HostClient.from_config(config) as client:
        for title in titles:
            run = await client.load_run(run_name(title), "ticket")
            payload = ToolPayload.json({"title": title})
            state = await client.execute(run, "open", TOOL, payload, b"v1")
            print(json.dumps({"title": title, "run": run.name, "state": state.kind.value}))
            states.append(state.kind)
    return states


async def close_tickets(config: str, titles: list[str]) -> list[StateKind]:
    states = []
    async with HostClient.from_config(config) as client:
        for title in titles:
            run = await client.load_run(run_name(title), "ticket")
            key = run.ledger.operations[0].operation_key
            inverse = ToolPayload.json({"close": "ticket"})
            state = await client.undo(run, key, inverse, b"close")
            print(json.dumps({"title": title, "run": run.name, "closed": state.kind.value}))
            states.append(state.kind)
    return states


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", required=True, help="the host.toml octo-host reads")
    parser.add_argument("verb", choices=["open", "close"])
    parser.add_argument("titles", nargs="+")
    args = parser.parse_args(argv)
    # Octo logs through structlog: warnings and errors to stderr, results to stdout.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    verb = open_tickets if args.verb == "open" else close_tickets
    states = asyncio.run(verb(args.config, args.titles))
    return 0 if all(state == StateKind.SUCCEEDED for state in states) else 1


if __name__ == "__main__":
    sys.exit(main())
