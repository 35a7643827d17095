"""What the console shows, gathered the way the operator verbs gather it.

The journal is read through ``octo-worker journal``'s own read-only store
helper and row summaries (the configured journal store, read-only:
``scopes``, ``list_records``, ``load_records``, ``load_sessions``,
``load_outbox``, ``head_revision``, ``scope_metadata``); the dead-letter
log (the stream ``octo.v5.dead.log``) through ``octo-worker dlq list``'s own
reader, one page at a time by offset: it settles nothing and moves no
delivery count (the management plugin may be off).

Every value handed to a page is a count, a state name, a revision, a time,
an identifier the CLI prints too (scope, operation and compensation key,
session and message id), or a header value already made printable and
bounded by the CLI's helper. This module must never hand on a payload,
a frame body, a key or a nonce, nor adapter failure text unless
``[console] reveal_failures`` is on, the journal's data key is configured
and the reveal was audited; it never writes the journal or acknowledges a
dead letter.
"""

from __future__ import annotations

import collections
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Final

from octo_common.errors import OctoError
from octo_common.ids import is_token
from octo_common.runtime.output import CliError
from octo_common.states import TERMINAL_KINDS
from octo_common.transport import DEAD_LOG_STREAM
from octo_worker.config import WorkerConfig
from octo_worker.inspection import (
    PROG,
    audit_reveal,
    journal_store,
    read_dead_letter_log,
    record_detail,
    record_summary,
    revealed,
)
from octo_worker.storage.base import JournalStoreBase

__all__ = [
    "DeadLetterView",
    "KeyView",
    "OverviewView",
    "ScopeView",
    "dead_letters",
    "key_view",
    "overview",
]

STATES: Final = ("pending", "running", "succeeded", "failed", "cancelled")
_TERMINAL: Final = frozenset(str(kind) for kind in TERMINAL_KINDS)
# Rows listed by name on the scope page (all of them are counted).
_LISTED_LIMIT: Final = 50
# Dead letters listed on the page (all of them are counted).
DEAD_LETTERS_SHOWN: Final = 50


class Slot(str):
    """A word of a shown command the operator fills in (``RUN``, ``FILE``): not quoted."""

    __slots__ = ()


RUN: Final = Slot("RUN")  # the host's run name: the worker never learns it
FILE: Final = Slot("FILE")
TEXT: Final = Slot("TEXT")
DECISION: Final = Slot("succeeded|failed|cancelled")


def command(*words: str) -> str:
    """A command line an operator can paste: every word but a ``Slot`` shell-quoted."""
    return " ".join(word if isinstance(word, Slot) else shlex.quote(word) for word in words)


def _cli(config_path: str, *words: str) -> str:
    return command(PROG, *words, "--config", config_path)


def _unresolved(summary: dict[str, Any]) -> bool:
    if summary["state"] not in _TERMINAL:
        return True
    compensation = summary["compensation_state"]
    return compensation is not None and compensation not in _TERMINAL


@dataclass
class StuckRow:
    """A row that is not settled: the operation or its compensation is not terminal."""

    operation_key: str
    tool: str
    state: str
    compensation_state: str | None
    revision: int
    age_seconds: float | None


@dataclass
class ScopeView:
    name: str
    configured: bool
    in_journal: bool
    revision: int = 0
    fence: int = 0
    states: dict[str, int] = field(default_factory=dict)
    compensations: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    oldest_pending_seconds: float | None = None
    oldest_pending_key: str | None = None
    sessions_open: int = 0
    sessions_poisoned: int = 0
    sessions_closed: int = 0
    poisoned_ids: list[str] = field(default_factory=list)
    outbox_pending: int = 0
    stuck: list[StuckRow] = field(default_factory=list)
    stuck_total: int = 0
    error: str | None = None
    poisoned_commands: list[str] = field(default_factory=list)


@dataclass
class OverviewView:
    journal: str
    scopes: list[ScopeView]
    error: str | None = None
    generated_at: float = field(default_factory=time.time)


def _or_now(written: float | None, now: float) -> float:
    return now if written is None else written


async def _scope_view(
    store: JournalStoreBase, name: str, configured: bool, config_path: str, now: float
) -> ScopeView:
    view = ScopeView(name, configured, True)
    records = await store.list_records(name)
    metadata = await store.scope_metadata(name)
    view.revision = await store.head_revision(name)
    view.fence = metadata.fence
    view.rows = len(records)
    summaries = [record_summary(name, record, revision) for record, revision in records]
    states = collections.Counter(summary["state"] for summary in summaries)
    view.states = {state: states.get(state, 0) for state in STATES}
    compensations = collections.Counter(
        summary["compensation_state"]
        for summary in summaries
        if summary["compensation_state"] is not None
    )
    view.compensations = {state: compensations.get(state, 0) for state in STATES}
    stuck = [summary for summary in summaries if _unresolved(summary)]
    view.stuck_total = len(stuck)
    # When each stuck key's row was last written (its item at rest is a keyed hash).
    written_at = {
        summary["operation_key"]: metadata.written(
            store.journal_items(name, summary["operation_key"])
        )
        for summary in stuck
    }
    oldest: tuple[float, str] | None = None
    for summary in stuck:
        written = written_at[summary["operation_key"]]
        if written is not None and (oldest is None or written < oldest[0]):
            oldest = (written, summary["operation_key"])
    if oldest is not None:
        view.oldest_pending_seconds = max(0.0, now - oldest[0])
        view.oldest_pending_key = oldest[1]
    stuck.sort(key=lambda s: _or_now(written_at[s["operation_key"]], now))
    for summary in stuck[:_LISTED_LIMIT]:
        written = written_at[summary["operation_key"]]
        view.stuck.append(
            StuckRow(
                summary["operation_key"],
                summary["tool"],
                summary["state"],
                summary["compensation_state"],
                summary["revision"],
                None if written is None else max(0.0, now - written),
            )
        )
    # Live sessions only: the store skips those it marked closed and counts them.
    sessions = await store.load_sessions(name, skip_closed_except=())
    statuses = collections.Counter(session.status for session in sessions.values())
    view.sessions_open = statuses.get("open", 0)
    view.sessions_poisoned = statuses.get("poisoned", 0)
    view.sessions_closed = statuses.get("closed", 0) + metadata.closed_sessions
    view.poisoned_ids = sorted(sid for sid, s in sessions.items() if s.status == "poisoned")[
        :_LISTED_LIMIT
    ]
    if view.sessions_poisoned:
        view.poisoned_commands = [
            _cli(config_path, "journal", "verify"),
            _cli(config_path, "check"),
            command("octo-host", "recover", RUN, "--scope", name, "--inputs", FILE),
        ]
    view.outbox_pending = len(await store.load_outbox(name))
    return view


async def overview(config: WorkerConfig, config_path: str) -> OverviewView:
    """Every scope of the journal and of the configuration, with its counts."""
    configured = [scope.name for scope in config.scopes]
    result = OverviewView(str(config.journal_path), [])
    try:
        async with journal_store(config) as store:
            in_journal = await store.scopes()
            now = time.time()
            for name in sorted(set(configured) | set(in_journal)):
                if name not in in_journal:
                    result.scopes.append(ScopeView(name, True, False))
                    continue
                try:
                    view = await _scope_view(store, name, name in configured, config_path, now)
                except OctoError as error:
                    view = ScopeView(name, name in configured, True, error=f"{error.code}")
                result.scopes.append(view)
    except CliError as error:
        result.error = error.message
        result.scopes = [ScopeView(name, True, False) for name in configured]
    return result


@dataclass
class KeyRow:
    detail: dict[str, Any]
    written_at: float | None
    commands: list[tuple[str, str]]


@dataclass
class KeyView:
    key: str
    rows: list[KeyRow]
    error: str | None = None
    invalid: bool = False


def _key_commands(detail: dict[str, Any], config_path: str) -> list[tuple[str, str]]:
    """(what it does, command) for the row's situation, as docs/operations.md's recovery table."""
    scope = detail["scope"]
    key = detail["operation_key"]
    state = detail["state"]
    compensation = detail["compensation"]
    commands = [
        (
            "show the row (payloads as format and size)",
            _cli(config_path, "journal", "show", key, "--scope", scope),
        )
    ]
    if state not in _TERMINAL:
        unsettled = key
    elif compensation is not None and compensation["state"] not in _TERMINAL:
        unsettled = compensation["compensation_key"]
    else:
        return commands
    # The host finds the run that holds the key: every command is complete but
    # for the operator's decision and reason.
    commands += [
        (
            "on the host: the run that holds it, its state there",
            command("octo-host", "find", unsettled),
        ),
        (
            "on the host: ask the worker's adapter what happened (a lookup: no input, no effect)",
            command("octo-host", "reconcile", unsettled, "--scope", scope),
        ),
        (
            "on the host, if it stays unsettled after checking the target: decide "
            "(audited; the worker's journal records it, no effect runs)",
            command(
                "octo-host",
                "resolve",
                unsettled,
                "--scope",
                scope,
                "--state",
                DECISION,
                "--reason",
                TEXT,
            ),
        ),
    ]
    return commands


async def key_view(
    config: WorkerConfig,
    config_path: str,
    key: str,
    scope: str | None = None,
    *,
    viewer: str = "console",
) -> KeyView:
    """The journal row of an ``op-`` key (or the row holding a ``cmp-`` key), per scope.

    With ``[console] reveal_failures`` and the journal's data key configured,
    a failed state's text is on the page, each reveal audited first (as
    ``viewer``); a reveal that cannot be audited shows nothing of the text.
    """
    view = KeyView(key, [])
    reveal = config.console.reveal_failures and config.storage.data_key is not None
    if not is_token(key) or (scope is not None and not is_token(scope)):
        view.error = "not a key: keys are tokens ([a-z0-9._-], 1..128)"
        view.invalid = True
        return view
    try:
        async with journal_store(config) as store:
            scopes = await store.scopes()
            for name in scopes if scope is None else [s for s in scopes if s == scope]:
                try:
                    if key.startswith("cmp-"):
                        # A compensation lives in the row of the operation it undoes.
                        entries = [
                            (record, revision)
                            for record, revision in await store.list_records(name)
                            if record.compensation is not None
                            and record.compensation.compensation_key == key
                        ]
                    else:
                        found = (await store.load_records(name, [key])).get(key)
                        entries = [] if found is None else [found]
                    metadata = await store.scope_metadata(name) if entries else None
                except OctoError as error:
                    view.error = f"scope {name}: {error.code}"
                    continue
                for record, revision in entries:
                    detail = record_detail(name, record, revision, reveal=reveal)
                    if revealed(detail):
                        try:
                            audit_reveal(
                                config, operator=viewer, via="console", scope=name, key=key
                            )
                        except CliError as error:
                            view.error = error.message
                            detail = record_detail(name, record, revision)
                    written = (
                        None
                        if metadata is None
                        else metadata.written(store.journal_items(name, record.operation_key))
                    )
                    view.rows.append(KeyRow(detail, written, _key_commands(detail, config_path)))
    except CliError as error:
        view.error = error.message
    return view


@dataclass
class DeadLetter:
    entry: dict[str, Any]
    commands: list[str]
    exact_id: bool


@dataclass
class DeadLetterView:
    log: str
    scopes: tuple[str, ...] | None  # the scopes shown; None: every scope
    after: int | None = None
    next_after: int | None = None
    reasons: list[tuple[str, int]] = field(default_factory=list)
    entries: list[DeadLetter] = field(default_factory=list)
    error: str | None = None


async def dead_letters(
    config: WorkerConfig, config_path: str, *, after: int | None = None, every_scope: bool = False
) -> DeadLetterView:
    """One page of the dead-letter log, as ``octo-worker dlq list`` reads it (by
    offset, changing nothing): reasons, and the commands of each letter."""
    scopes = None if every_scope else [scope.name for scope in config.scopes]
    view = DeadLetterView(DEAD_LOG_STREAM, None if scopes is None else tuple(scopes), after)
    try:
        page = await read_dead_letter_log(
            config, after=after, limit=DEAD_LETTERS_SHOWN, scopes=scopes
        )
    except CliError as error:
        view.error = error.message
        return view
    view.next_after = page.next_after
    reasons: collections.Counter[str] = collections.Counter()
    for entry in page.entries:
        reasons[entry["reason"] or "-"] += 1
        letter = str(entry["id"])
        # The printable id is the real one only for a plain id a shell can take.
        exact = entry["message_id"] is not None and entry["message_id_exact"]
        commands = [_cli(config_path, "dlq", "show", letter)]
        if exact:
            commands = [
                _cli(config_path, "dlq", "show", letter, "--message-id", entry["message_id"]),
                _cli(config_path, "dlq", "drop", "--message-id", entry["message_id"]),
            ]
        view.entries.append(DeadLetter(entry, commands, exact))
    view.reasons = reasons.most_common()
    return view
