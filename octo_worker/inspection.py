"""What both operator tools read: the journal and the dead-letter queue.

The ``octo-worker`` verbs (:mod:`octo_worker.cli`) and the console
(:mod:`octo_worker.console`) share these helpers, so neither package imports
the other: the command's name, a broker connection for one verb (bounded
connect, closed after), the journal opened read-only or for maintenance
beside a running daemon, holding the whole dead-letter queue (bounded)
unacknowledged on one channel and requeuing it in delivery order, each
dead-lettered frame's entry, a page of the dead-letter log read by offset
(which changes nothing on the broker), a journal row's summary and detail,
and when a failure's text may be shown: only where the journal's data key
is configured and the operator asked (``journal show --reveal``,
``[console] reveal_failures``), each reveal appended first to the audit
file ``failure-text-reveals.jsonl`` in the state directory.

It must never print (the verbs and pages do), leave a connection or a store
open, show a payload or a key, hand on a failure message without an audited
reveal, or remove a message.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import getpass
import json
import os
from collections.abc import AsyncIterator, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final

import aiormq
from aio_pika.abc import AbstractConnection, AbstractIncomingMessage, AbstractQueue

from octo_common.errors import OctoError
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
    broker_unreachable,
    printable,
    state_detail,
)
from octo_common.transport import (
    DEAD_LOG_STREAM,
    DEAD_QUEUE,
    HEADER_KEY_NONCE,
    HEADER_REASON,
    HEADER_SCOPE,
    HEADER_SESSION,
    WORKER_QUEUE_PREFIX,
)
from octo_worker.config import WorkerConfig
from octo_worker.daemon.topology import TopologyError, connect
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.configured import configured_store

__all__ = [
    "MAX_HELD_BYTES",
    "MAX_HELD_MESSAGES",
    "PROG",
    "LOG_PAGE_MAX",
    "LOG_SCAN_MAX",
    "DeadLetterPage",
    "REVEAL_AUDIT_FILE",
    "HeldMessages",
    "audit_reveal",
    "broker_connection",
    "check_reveal",
    "dead_letter_entry",
    "dead_queue",
    "holding",
    "letter_scope",
    "read_dead_letter_log",
    "journal_store",
    "record_detail",
    "record_summary",
    "revealed",
    "who",
]

PROG: Final = "octo-worker"

# A broker probe from the command line should answer fast even when the
# configured connect timeout is generous.
_PROBE_TIMEOUT_SECONDS: Final = 5.0


@contextlib.asynccontextmanager
async def broker_connection(config: WorkerConfig) -> AsyncIterator[AbstractConnection]:
    url = config.broker_url()
    timeout = min(config.broker.connect_timeout_seconds, _PROBE_TIMEOUT_SECONDS)
    try:
        connection = await connect(
            url,
            timeout=timeout,
            name="octo-worker-cli",
            ssl_context=config.broker_tls_context(),
        )
    except TopologyError as error:
        raise broker_unreachable(config.redacted_broker_url(), error.reason, error.code) from None
    try:
        yield connection
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(connection.close(), timeout=5.0)


@contextlib.asynccontextmanager
async def journal_store(
    config: WorkerConfig, *, maintenance: bool = False
) -> AsyncIterator[JournalStoreBase]:
    """The journal, read-only, or for maintenance (rows only, never a revision):
    beside a running daemon neither may migrate the schema or rewrite the
    anchor file the daemon replaces after each commit. SQLite or PostgreSQL,
    as ``[storage]`` says."""
    path = config.journal_location()
    if not config.shared_journal and not config.journal_path.exists():
        raise CliError(
            EXIT_CHECK_FAILED,
            f"journal database {path} does not exist (the daemon creates it when it starts)",
            "not_found",
        )
    store = configured_store(config, read_only=not maintenance, maintenance=maintenance)
    try:
        try:
            await store.scopes()  # opens the database (and checks the anchor)
        except OctoError as error:
            hint = ""
            if error.code == "rollback_anchor_missing":
                hint = f" (create it with: {PROG} journal init-anchor)"
            raise CliError(
                EXIT_STORAGE,
                f"journal {path}: cannot open: {error.code}: {error}{hint}",
                error.code,
            ) from None
        yield store
    finally:
        with contextlib.suppress(Exception):
            await store.close()


def _header(headers: Mapping[str, Any], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    return printable(value, 128)


def _death_reason(headers: Mapping[str, Any]) -> str | None:
    """Why the broker itself dead-lettered a frame (delivery limit, rejection)."""
    first = headers.get("x-first-death-reason")
    if first is not None:
        return printable(first, 64)
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        reason = deaths[0].get("reason")
        if reason is not None:
            return printable(reason, 64)
    return None


def letter_scope(routing_key: str | None, headers: Mapping[str, Any]) -> str | None:
    """The tenant scope whose queue a dead letter came from.

    The worker's copy keeps the delivery's routing key (the scope's queue),
    and so does the broker's own dead-lettering; the ``x-death`` record names
    the queue too. A letter published straight to the dead-letter exchange
    has neither: its ``octo-scope`` header, when it has one, is all there is.
    """
    for queue in (routing_key, _death_queue(headers)):
        if queue is not None and queue.startswith(WORKER_QUEUE_PREFIX):
            return printable(queue[len(WORKER_QUEUE_PREFIX) :], 128)
    return _header(headers, HEADER_SCOPE)


def _death_queue(headers: Mapping[str, Any]) -> str | None:
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], Mapping):
        queue = deaths[0].get("queue")
        if isinstance(queue, bytes):
            queue = queue.decode("utf-8", "replace")
        if isinstance(queue, str):
            return queue
    return None


def dead_letter_entry(
    position: int, message: AbstractIncomingMessage, body: bool, *, key: str = "position"
) -> dict[str, Any]:
    """One dead letter's summary; ``position`` is its place in the queue, or
    (``key="id"``) its offset in the dead-letter log."""
    headers: Mapping[str, Any] = message.headers or {}
    reason = _header(headers, HEADER_REASON)
    broker_reason = _death_reason(headers)
    entry: dict[str, Any] = {
        key: position,
        "reason": reason or (f"broker:{broker_reason}" if broker_reason else None),
        "queue_scope": letter_scope(message.routing_key, headers),
        "scope": _header(headers, HEADER_SCOPE),
        "session": _header(headers, HEADER_SESSION),
        "key_nonce_present": HEADER_KEY_NONCE in headers,
        "message_id": None if message.message_id is None else printable(message.message_id, 128),
        # Whether the printable id is the real one (a command can name it).
        "message_id_exact": message.message_id is not None
        and printable(message.message_id, 128) == message.message_id,
        "correlation_id": None
        if message.correlation_id is None
        else printable(message.correlation_id, 128),
        "routing_key": None if message.routing_key is None else printable(message.routing_key),
        "size": len(message.body),
        "delivery_count": headers.get("x-delivery-count")
        if isinstance(headers.get("x-delivery-count"), int)
        else None,
    }
    if body:
        entry["body_base64"] = base64.b64encode(message.body).decode("ascii")
        entry["body_text"] = message.body.decode("utf-8", "backslashreplace")
    return entry


async def dead_queue(connection: AbstractConnection) -> AbstractQueue:
    channel = await connection.channel(publisher_confirms=False)
    try:
        return await channel.declare_queue(DEAD_QUEUE, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"queue {DEAD_QUEUE} does not exist (run: {PROG} topology declare)",
            "not_found",
        ) from None


MAX_HELD_MESSAGES: Final = 10_000

MAX_HELD_BYTES: Final = 256 * 1024 * 1024


@dataclass
class HeldMessages:
    """Messages of the dead-letter queue, held unacknowledged on one channel."""

    messages: list[AbstractIncomingMessage]
    complete: bool  # False: the queue is larger than one inspection may hold
    total: int

    def entries(self, count: int, body: bool) -> list[dict[str, Any]]:
        return [dead_letter_entry(i + 1, m, body) for i, m in enumerate(self.messages[:count])]


@contextlib.asynccontextmanager
async def holding(config: WorkerConfig) -> AsyncIterator[HeldMessages]:
    """Hold the whole queue (bounded), then requeue every message not acked.

    A quorum queue puts a requeued message at its tail, so inspecting only
    the first N would rotate the queue and change every position. Holding
    everything and requeuing it in delivery order keeps the order (and the
    positions) as they were; only a queue beyond the bounds is rotated, and
    the listing says so. Nothing is lost: a message is only removed by an
    explicit ack (``drop``).
    """
    async with broker_connection(config) as connection:
        queue = await dead_queue(connection)
        total = int(queue.declaration_result.message_count or 0)
        held = HeldMessages([], True, total)
        size = 0
        try:
            while True:
                if len(held.messages) >= MAX_HELD_MESSAGES or size >= MAX_HELD_BYTES:
                    held.complete = False
                    break
                message = await queue.get(no_ack=False, fail=False, timeout=10)
                if message is None:
                    break
                held.messages.append(message)
                size += len(message.body)
            yield held
        finally:
            try:
                for message in held.messages:
                    await message.reject(requeue=True)
            except (aiormq.exceptions.AMQPError, ConnectionError):
                # The channel is gone: the broker requeues every unacked message itself.
                pass


# One page of the dead-letter log: at most this many letters shown, and this
# many read (other scopes' letters are read and skipped). Memory stays
# bounded by the page and the prefetch, whatever the log holds.
LOG_PAGE_MAX: Final = 200
LOG_SCAN_MAX: Final = 5_000
_LOG_PREFETCH: Final = 32
# The end of the log is when nothing more comes: nothing within the first
# wait (an empty log, or nothing after ``after``), or, once letters flow, no
# next one within the idle wait, at least three times what the first one
# took (a busy broker or machine is slow, and that says how slow).
_LOG_FIRST_SECONDS: Final = 2.0
_LOG_IDLE_SECONDS: Final = 0.5


@dataclass
class DeadLetterPage:
    """Letters of the dead-letter log after offset ``after``, oldest first."""

    entries: list[dict[str, Any]]
    after: int | None
    next_after: int | None  # where the next page starts; None: the end of the log
    scanned: int  # letters read for this page, shown or not
    scopes: tuple[str, ...] | None  # the scopes shown; None: every scope


async def read_dead_letter_log(
    config: WorkerConfig,
    *,
    after: int | None = None,
    limit: int = 50,
    scopes: Collection[str] | None = None,
    body: bool = False,
) -> DeadLetterPage:
    """Read one page of ``octo.v5.dead.log`` by offset; settle and change nothing.

    A stream consumer's ack only returns credit: the letters stay, no
    delivery count moves, and every letter keeps its offset (its ``id``).
    ``scopes`` keeps the letters that came from those scopes' queues
    (:func:`letter_scope`); None keeps every letter.
    """
    limit = max(1, min(limit, LOG_PAGE_MAX))
    wanted = None if scopes is None else frozenset(scopes)
    page = DeadLetterPage([], after, None, 0, None if wanted is None else tuple(sorted(wanted)))
    async with broker_connection(config) as connection:
        channel = await connection.channel(publisher_confirms=False)
        try:
            stream = await channel.declare_queue(DEAD_LOG_STREAM, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise CliError(
                EXIT_CHECK_FAILED,
                f"stream {DEAD_LOG_STREAM} does not exist (run: {PROG} topology declare, "
                "or start the daemon, which declares it)",
                "not_found",
            ) from None
        await channel.set_qos(prefetch_count=_LOG_PREFETCH)
        inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        start: int | str = "first" if after is None else after + 1
        tag = await stream.consume(inbox.put, arguments={"x-stream-offset": start})
        last = after
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = _LOG_FIRST_SECONDS
        try:
            while len(page.entries) < limit and page.scanned < LOG_SCAN_MAX:
                try:
                    message = await asyncio.wait_for(inbox.get(), wait)
                except TimeoutError:
                    return page  # the end of the log
                if wait == _LOG_FIRST_SECONDS:
                    wait = max(_LOG_IDLE_SECONDS, 3 * (loop.time() - started))
                offset = (message.headers or {}).get("x-stream-offset")
                await message.ack()  # credit for the next one; a stream keeps the letter
                # A stream starts at the chunk holding the offset: skip what came before.
                if not isinstance(offset, int) or (after is not None and offset <= after):
                    continue
                page.scanned += 1
                last = offset
                entry = dead_letter_entry(offset, message, body, key="id")
                if wanted is None or entry["queue_scope"] in wanted:
                    page.entries.append(entry)
            page.next_after = last
        finally:
            with contextlib.suppress(Exception):
                await stream.cancel(tag)
            with contextlib.suppress(Exception):
                await channel.close()
    return page


def _state_text(state: Any) -> str:
    return str(getattr(state, "kind", "?"))


def record_summary(scope: str, record: WorkerOperationRecord, revision: int) -> dict[str, Any]:
    compensation = record.compensation
    return {
        "scope": scope,
        "operation_key": record.operation_key,
        "tool": record.tool,
        "state": _state_text(record.state),
        "compensation_state": None if compensation is None else _state_text(compensation.state),
        "revision": revision,
    }


def record_detail(
    scope: str, record: WorkerOperationRecord, revision: int, *, reveal: bool = False
) -> dict[str, Any]:
    """A row as the verbs and the console show it; failure text only with ``reveal``."""
    compensation = record.compensation
    return {
        "scope": scope,
        "operation_key": record.operation_key,
        "tool": record.tool,
        "input_fingerprint": record.input_fingerprint,
        "revision": revision,
        **state_detail(record.state, reveal=reveal),
        "compensation": None
        if compensation is None
        else {
            "compensation_key": compensation.compensation_key,
            "input_fingerprint": compensation.input_fingerprint,
            "grant_fingerprint": compensation.grant_fingerprint,
            **state_detail(compensation.state, reveal=reveal),
        },
    }


def revealed(detail: Mapping[str, Any]) -> bool:
    """Whether a :func:`record_detail` holds failure text (its own or its compensation's)."""
    compensation = detail.get("compensation")
    return "failure_text" in detail or (compensation is not None and "failure_text" in compensation)


# Failure text, shown where the journal's data key is and the operator asked --------

REVEAL_AUDIT_FILE: Final = "failure-text-reveals.jsonl"


def check_reveal(config: WorkerConfig) -> None:
    """Refuse a reveal where the journal has no data key (exit 2): whoever may read
    the text at rest may read it here, nobody else."""
    if config.storage.data_key is None:
        raise CliError(
            EXIT_USAGE,
            "failure text is shown only where the journal's data key is configured "
            "([storage] data_key)",
            "reveal_needs_data_key",
        )


def who() -> str:
    """The operator's login name (``$USER``, then the password database), or ``unknown``."""
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (OSError, KeyError):
        return "unknown"


def audit_reveal(config: WorkerConfig, *, operator: str, via: str, scope: str, key: str) -> None:
    """Append one reveal to ``failure-text-reveals.jsonl`` in the state directory (one
    JSON line: UTC time, who, how, scope, key; never the text), created 0600, never
    through a link, synced. ``CliError`` (exit 4) when it cannot be written: nothing
    is revealed then."""
    entry = {
        "time": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "operator": operator[:128],
        "via": via,
        "scope": scope,
        "key": key,
    }
    line = (json.dumps(entry, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")
    path = config.state_path(REVEAL_AUDIT_FILE, "worker.state_dir")
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags, 0o600)
        try:
            os.write(descriptor, line)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except OSError as error:
        raise CliError(
            EXIT_STORAGE,
            f"the reveal could not be audited ({path}: {error.strerror}); nothing shown",
            "reveal_not_audited",
        ) from None
