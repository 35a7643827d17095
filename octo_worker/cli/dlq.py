"""``octo-worker dlq list|show|drop``: the dead-letter queue, read without the management plugin.

Owns listing and showing the frames of the queue held whole (holding it
and each frame's entry are :mod:`octo_worker.inspection`'s, which the
console uses too; the body only with ``--body``), and dropping one frame by
message id.

It must never print a frame body unless ``--body`` asks, or remove a
message it was not told to.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Output,
    printable,
)
from octo_common.transport import DEAD_QUEUE
from octo_worker.cli.common import (
    Verbs,
    broker_connection,
    config_of,
    positive_int,
    verb_group,
)
from octo_worker.inspection import (
    MAX_HELD_BYTES,
    MAX_HELD_MESSAGES,
    HeldMessages,
    dead_letter_entry,
    dead_queue,
    holding,
)

__all__ = [
    "cmd_dlq_drop",
    "cmd_dlq_list",
    "cmd_dlq_show",
    "register",
]


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``dlq list``, ``dlq show`` and ``dlq drop`` to the verbs."""
    dlq_verbs = verb_group(verbs, "dlq", f"inspect and drain {DEAD_QUEUE}")
    dlist = dlq_verbs.add_parser("list", parents=[common], help="list dead-lettered frames")
    dlist.add_argument(
        "--limit", type=positive_int, default=50, metavar="N", help="at most N frames (default 50)"
    )
    dlist.add_argument("--body", action="store_true", help="also print each frame body")
    dlist.set_defaults(handler=cmd_dlq_list)
    dshow = dlq_verbs.add_parser("show", parents=[common], help="show the frame at position N")
    dshow.add_argument(
        "position", type=positive_int, metavar="N", help="the position `dlq list` printed"
    )
    dshow.add_argument("--body", action="store_true", help="also print the frame body")
    dshow.add_argument("--message-id", metavar="ID", help="refuse unless N has this message id")
    dshow.set_defaults(handler=cmd_dlq_show)
    ddrop = dlq_verbs.add_parser(
        "drop", parents=[common], help="remove the frame with --message-id ID (or --all)"
    )
    ddrop.add_argument(
        "position", type=positive_int, nargs="?", metavar="N", help="also check its position"
    )
    ddrop.add_argument("--message-id", metavar="ID", help="the message id of the frame to remove")
    ddrop.add_argument("--all", action="store_true", help="remove every dead-lettered frame")
    ddrop.set_defaults(handler=cmd_dlq_drop)


def _rotation_note(held: HeldMessages, out: Output) -> None:
    if not held.complete:
        out.line(
            f"note: {DEAD_QUEUE} is larger than one inspection holds "
            f"({MAX_HELD_MESSAGES} messages / {MAX_HELD_BYTES // (1024 * 1024)} MiB); "
            "the inspected messages moved to its tail"
        )


def _entry_line(entry: Mapping[str, Any]) -> str:
    return (
        f"{entry['position']:>4}  reason={entry['reason'] or '-'}  scope={entry['scope'] or '-'}  "
        f"session={entry['session'] or '-'}  message_id={entry['message_id'] or '-'}  "
        f"size={entry['size']}"
    )


def _print_body(entry: Mapping[str, Any], out: Output) -> None:
    if "body_text" in entry:
        out.line("      body: " + printable(entry["body_text"], 1 << 20))


def cmd_dlq_list(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def peek() -> tuple[HeldMessages, list[dict[str, Any]]]:
        async with holding(config) as held:
            return held, held.entries(args.limit, args.body)

    held, entries = asyncio.run(peek())
    total = max(held.total, len(held.messages))
    out.line(f"{DEAD_QUEUE}: {total} message(s); showing {len(entries)}")
    for entry in entries:
        out.line(_entry_line(entry))
        _print_body(entry, out)
    _rotation_note(held, out)
    out.document(
        {
            "ok": True,
            "queue": DEAD_QUEUE,
            "messages": total,
            "order_kept": held.complete,
            "entries": entries,
        }
    )
    return EXIT_OK


def _chosen(held: HeldMessages, position: int, message_id: str | None) -> AbstractIncomingMessage:
    messages = held.messages
    if len(messages) < position:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"no message at position {position} ({DEAD_QUEUE} holds {len(messages)})",
            "not_found",
        )
    chosen = messages[position - 1]
    if message_id is not None and chosen.message_id != message_id:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"the message at position {position} does not have message id "
            f"{printable(message_id, 64)} (the queue changed; list it again)",
            "not_found",
        )
    return chosen


def _by_message_id(held: HeldMessages, message_id: str) -> tuple[int, AbstractIncomingMessage]:
    for position, message in enumerate(held.messages, start=1):
        if message.message_id == message_id:
            return position, message
    raise CliError(
        EXIT_CHECK_FAILED,
        f"no message with message id {printable(message_id, 64)} in {DEAD_QUEUE}"
        f" (of {len(held.messages)} looked at)",
        "not_found",
    )


def cmd_dlq_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def show() -> dict[str, Any]:
        async with holding(config) as held:
            chosen = _chosen(held, args.position, args.message_id)
            return dead_letter_entry(args.position, chosen, args.body)

    entry = asyncio.run(show())
    for name, value in entry.items():
        if name in ("body_base64", "body_text"):
            continue
        out.line(f"{name + ':':<18} {'-' if value is None else value}")
    _print_body(entry, out)
    out.document({"ok": True, "entry": entry})
    return EXIT_OK


def cmd_dlq_drop(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def drop_all() -> int:
        async with broker_connection(config) as connection:
            queue = await dead_queue(connection)
            result = await queue.purge()
            return int(getattr(result, "message_count", 0) or 0)

    async def drop_one(message_id: str) -> dict[str, Any]:
        async with holding(config) as held:
            if args.position is not None:
                position = args.position
                chosen = _chosen(held, position, message_id)
            else:
                position, chosen = _by_message_id(held, message_id)
            entry = dead_letter_entry(position, chosen, False)
            await chosen.ack()
            held.messages.remove(chosen)  # everything else is requeued
            return entry

    if args.all:
        if args.message_id is not None or args.position is not None:
            raise CliError(EXIT_USAGE, "--all takes no position and no --message-id", "usage")
        dropped = asyncio.run(drop_all())
        out.line(f"dropped {dropped} message(s) from {DEAD_QUEUE}")
        out.document({"ok": True, "dropped": dropped})
        return EXIT_OK
    if args.message_id is None:
        # The broker may requeue the held messages in another order, so a
        # position alone could name another frame by now.
        raise CliError(
            EXIT_USAGE,
            "dlq drop needs --message-id ID (from dlq list or show) or --all",
            "usage",
        )
    entry = asyncio.run(drop_one(args.message_id))
    out.line(f"dropped: {_entry_line(entry).strip()}")
    out.document({"ok": True, "dropped": 1, "entry": entry})
    return EXIT_OK
