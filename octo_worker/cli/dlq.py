"""``octo-worker dlq list|show|drop``: dead letters, read without the management plugin.

``list`` and ``show`` read the dead-letter log (the stream
``octo.v5.dead.log``) by offset: they change nothing on the broker (no
delivery count moves, nothing is requeued), each letter keeps its offset as
its id, and a listing is one bounded page of this worker's scopes unless
``--all-scopes``; reading is :mod:`octo_worker.inspection`'s, which the
console uses too. ``drop`` removes one letter (by message id) or all of them
from the queue ``octo.v5.dead``, the letters still waiting for an operator;
the log keeps its copy until retention removes it.

It must never print a frame body unless ``--body`` asks, or remove a
message it was not told to.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from typing import Any

from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Output,
    printable,
)
from octo_common.transport import DEAD_LOG_STREAM, DEAD_QUEUE
from octo_worker.cli.common import (
    Verbs,
    broker_connection,
    config_of,
    positive_int,
    verb_group,
)
from octo_worker.inspection import (
    LOG_PAGE_MAX,
    HeldMessages,
    dead_letter_entry,
    dead_queue,
    holding,
    read_dead_letter_log,
)

__all__ = [
    "cmd_dlq_drop",
    "cmd_dlq_list",
    "cmd_dlq_show",
    "register",
]


def _offset(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a letter id (an integer)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def _page_size(text: str) -> int:
    value = positive_int(text)
    if value > LOG_PAGE_MAX:
        raise argparse.ArgumentTypeError(f"{text!r}: at most {LOG_PAGE_MAX} letters a page")
    return value


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``dlq list``, ``dlq show`` and ``dlq drop`` to the verbs."""
    dlq_verbs = verb_group(verbs, "dlq", "read the dead-letter log, drain the dead-letter queue")
    dlist = dlq_verbs.add_parser(
        "list",
        parents=[common],
        help="one page of dead letters of this worker's scopes, oldest first (changes nothing)",
    )
    dlist.add_argument(
        "--after",
        type=_offset,
        default=None,
        metavar="ID",
        help="start after the letter with this id (the next page: the id the last page printed)",
    )
    dlist.add_argument(
        "--limit",
        type=_page_size,
        default=50,
        metavar="N",
        help=f"at most N letters (default 50, at most {LOG_PAGE_MAX})",
    )
    dlist.add_argument(
        "--all-scopes", action="store_true", help="every scope's letters, not only this worker's"
    )
    dlist.add_argument("--body", action="store_true", help="also print each frame body")
    dlist.set_defaults(handler=cmd_dlq_list)
    dshow = dlq_verbs.add_parser(
        "show", parents=[common], help="show the dead letter with id ID (changes nothing)"
    )
    dshow.add_argument(
        "id", type=_offset, metavar="ID", help="the letter's id, as `dlq list` printed it"
    )
    dshow.add_argument("--body", action="store_true", help="also print the frame body")
    dshow.add_argument(
        "--message-id", metavar="MID", help="refuse unless the letter has this message id"
    )
    dshow.set_defaults(handler=cmd_dlq_show)
    ddrop = dlq_verbs.add_parser(
        "drop",
        parents=[common],
        help=f"remove the letter with --message-id ID (or --all) from {DEAD_QUEUE}",
    )
    ddrop.add_argument("--message-id", metavar="ID", help="the message id of the frame to remove")
    ddrop.add_argument("--all", action="store_true", help="remove every dead-lettered frame")
    ddrop.set_defaults(handler=cmd_dlq_drop)


def _entry_line(entry: Mapping[str, Any]) -> str:
    return (
        f"{entry['id']:>6}  reason={entry['reason'] or '-'}  "
        f"scope={entry['queue_scope'] or '-'}  session={entry['session'] or '-'}  "
        f"message_id={entry['message_id'] or '-'}  size={entry['size']}"
    )


def _print_body(entry: Mapping[str, Any], out: Output) -> None:
    if "body_text" in entry:
        out.line("      body: " + printable(entry["body_text"], 1 << 20))


def cmd_dlq_list(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    scopes = None if args.all_scopes else [scope.name for scope in config.scopes]
    page = asyncio.run(
        read_dead_letter_log(
            config, after=args.after, limit=args.limit, scopes=scopes, body=args.body
        )
    )
    which = "every scope" if scopes is None else "scopes " + ", ".join(scopes)
    out.line(f"{DEAD_LOG_STREAM} ({which}): {len(page.entries)} letter(s)")
    for entry in page.entries:
        out.line(_entry_line(entry))
        _print_body(entry, out)
    if page.next_after is not None:
        out.line(f"more: {' '.join(['dlq', 'list', '--after', str(page.next_after)])}")
    out.document(
        {
            "ok": True,
            "log": DEAD_LOG_STREAM,
            "scopes": None if scopes is None else list(scopes),
            "after": page.after,
            "next_after": page.next_after,
            "entries": page.entries,
        }
    )
    return EXIT_OK


def cmd_dlq_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    after = None if args.id == 0 else args.id - 1
    page = asyncio.run(
        read_dead_letter_log(config, after=after, limit=1, scopes=None, body=args.body)
    )
    if not page.entries or page.entries[0]["id"] != args.id:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"no letter with id {args.id} in {DEAD_LOG_STREAM} (retention may have removed it)",
            "not_found",
        )
    entry = page.entries[0]
    if args.message_id is not None and entry["message_id"] != args.message_id:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"the letter with id {args.id} does not have message id "
            f"{printable(args.message_id, 64)}",
            "not_found",
        )
    for name, value in entry.items():
        if name in ("body_base64", "body_text"):
            continue
        out.line(f"{name + ':':<18} {'-' if value is None else value}")
    _print_body(entry, out)
    out.document({"ok": True, "entry": entry})
    return EXIT_OK


def _by_message_id(held: HeldMessages, message_id: str) -> tuple[int, Any]:
    for position, message in enumerate(held.messages, start=1):
        if message.message_id == message_id:
            return position, message
    raise CliError(
        EXIT_CHECK_FAILED,
        f"no message with message id {printable(message_id, 64)} in {DEAD_QUEUE}"
        f" (of {len(held.messages)} looked at)",
        "not_found",
    )


def cmd_dlq_drop(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def drop_all() -> int:
        async with broker_connection(config) as connection:
            queue = await dead_queue(connection)
            result = await queue.purge()
            return int(getattr(result, "message_count", 0) or 0)

    async def drop_one(message_id: str) -> dict[str, Any]:
        # Removing one letter from a queue means holding it all and acking
        # that one: an explicit change, never a view's.
        async with holding(config) as held:
            position, chosen = _by_message_id(held, message_id)
            entry = dead_letter_entry(position, chosen, False)
            await chosen.ack()
            held.messages.remove(chosen)  # everything else is requeued
            return entry

    if args.all:
        if args.message_id is not None:
            raise CliError(EXIT_USAGE, "--all takes no --message-id", "usage")
        dropped = asyncio.run(drop_all())
        out.line(f"dropped {dropped} message(s) from {DEAD_QUEUE}")
        out.document({"ok": True, "dropped": dropped})
        return EXIT_OK
    if args.message_id is None:
        raise CliError(
            EXIT_USAGE, "dlq drop needs --message-id ID (from dlq list or show) or --all", "usage"
        )
    entry = asyncio.run(drop_one(args.message_id))
    out.line(
        f"dropped: message_id={entry['message_id'] or '-'}  reason={entry['reason'] or '-'}  "
        f"scope={entry['queue_scope'] or '-'}  size={entry['size']}"
    )
    out.document({"ok": True, "dropped": 1, "entry": entry})
    return EXIT_OK
