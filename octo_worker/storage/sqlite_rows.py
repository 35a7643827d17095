"""What the SQLite journal store's threads share: schema, row shapes, checks, errors.

Owns the schema and its forward-only migrations, the shape of a prepared
change set (:class:`RowWrite`, :class:`PendingCommit`) and of a loaded row
(:class:`Row`), the validation and rendering of a ``WorkerCommit`` before
any I/O (:func:`prepare`), how one loaded row is authenticated and
decrypted (:func:`open_row`), the read-only connection, and how a sqlite or OS
failure is told (:func:`backend_error`: class and code, never a path or
data). It must never do I/O itself beyond opening a read-only connection.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sqlite3
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple, TypeVar

from octo_common.digest import message_id as frame_message_id
from octo_common.errors import (
    InvalidRevision,
    InvalidToken,
    OctoError,
    OperationJournalScopeMismatch,
    RecordLocationMismatch,
    StorageBackendError,
)
from octo_common.ids import validate_token
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS
from octo_common.records import StorageKeyring, StorageRecordKey, decrypt_document, open_record
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    is_message_id,
    outbox_document,
    session_header,
    state_status,
)
from octo_worker.storage.interface import WorkerCommit

T = TypeVar("T")

# Rows re-sealed per batch (``reseal``): one short read and one write each.
RESEAL_BATCH: Final = 1000

HEAD_NAMESPACE: Final = NS_JOURNAL
SESSION_ROWS: Final = frozenset({NS_SESSION, NS_SESSION_OPEN})
# Sessions whose last committed state revision the writer remembers for
# chained commits (SessionDocuments.chained); about 100 bytes each.
SESSION_TAIL_LIMIT: Final = 65536
BY_ITEMS: Final = "WHERE namespace = ? AND name = ? AND item IN "
# The partial index's condition, repeated word for word by the query that
# uses it (SQLite matches the terms, so the namespaces are literals here).
LIVE_SESSION_ROWS: Final = f"namespace IN ('{NS_SESSION}', '{NS_SESSION_OPEN}') AND closed = 0"
# The outbox index's condition, likewise repeated by the query that uses it.
OUTBOX_ROWS: Final = f"namespace = '{NS_OUTBOX}'"
SQL_CHUNK: Final = 500  # well under SQLite's bound on host parameters

# Forward-only migrations: index i moves the schema from version i to i + 1.
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """CREATE TABLE heads (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            revision INTEGER NOT NULL CHECK (revision >= 0),
            fence INTEGER NOT NULL CHECK (fence >= 0),
            PRIMARY KEY (namespace, name)
        ) WITHOUT ROWID""",
        # A rowid table: envelopes can be large, and the rowid orders the
        # outbox rows one commit inserted.
        """CREATE TABLE items (
            id INTEGER PRIMARY KEY,
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            item TEXT NOT NULL,
            revision INTEGER NOT NULL,
            envelope BLOB NOT NULL,
            UNIQUE (namespace, name, item)
        )""",
    ),
    # 1 -> 2: when each row was last written (unauthenticated metadata, used only
    # to choose prune candidates; rows written before the migration count as new).
    (
        "ALTER TABLE items ADD COLUMN written_at REAL NOT NULL DEFAULT 0",
        "UPDATE items SET written_at = CAST(strftime('%s', 'now') AS REAL)",
    ),
    # 2 -> 3: 1 on both rows of a closed session (unauthenticated metadata, used
    # only so that a start reads the live sessions alone, through the partial
    # index; rows of sessions closed before the migration read 0 until the
    # daemon's next start marks them).
    (
        "ALTER TABLE items ADD COLUMN closed INTEGER NOT NULL DEFAULT 0",
        f"CREATE INDEX items_live_sessions ON items (name, item) WHERE {LIVE_SESSION_ROWS}",
    ),
    # 3 -> 4: the session id of each outbox row (unauthenticated metadata, used
    # only to find one session's rows through the partial index; each row found
    # is authenticated and its document must name that session). Rows written
    # before the migration read NULL until the writer's open fills them in from
    # their authenticated documents (``JournalWriter.fill_outbox_sessions``).
    (
        "ALTER TABLE items ADD COLUMN session TEXT",
        f"CREATE INDEX items_outbox_sessions ON items (name, session) WHERE {OUTBOX_ROWS}",
    ),
)

SCHEMA_VERSION: Final = len(MIGRATIONS)


class RowWrite(NamedTuple):
    namespace: str
    item: str
    document: bytes
    # The revision the row must currently have; None: the row must be absent.
    base_revision: int | None
    # Session state rows only (SessionDocuments.link/after): this write's
    # link, and the link of the change set whose revision is its base.
    link: int | None = None
    after: int | None = None
    # Session state rows only: the document's status is ``closed``.
    closed: bool = False
    # Outbox rows only: the session the reply belongs to (the row's metadata).
    session: str | None = None


@dataclass(slots=True)
class PendingCommit:
    scope: str
    token: int
    writes: tuple[RowWrite, ...]
    new_sessions: tuple[str, ...]
    outbox_delete: tuple[str, ...]
    # The caller's window on the outcome: resolved with the revision or the
    # error (never an exception, so nothing is left unretrieved), or cancelled
    # with its caller, which the writer then skips.
    future: asyncio.Future[int | OctoError]


class Row(NamedTuple):
    item: str
    revision: int
    envelope: bytes


@functools.lru_cache(maxsize=4096)
def record_key(namespace: str, scope: str) -> StorageRecordKey:
    # Record keys validate on construction; rows of a scope reuse the same few.
    return StorageRecordKey(namespace, scope)


def open_row(
    keyring: StorageKeyring,
    data_keyring: StorageKeyring | None,
    scope: str,
    namespace: str,
    row: Row,
) -> bytes:
    """Authenticate (and decrypt) one row's envelope; the caller checks its document."""
    record = open_record(keyring, record_key(namespace, scope), row.envelope, row.revision)
    if data_keyring is None:
        return record.payload
    return decrypt_document(data_keyring, namespace, scope, row.item, row.revision, record.payload)


_VALID_SCOPES: set[str] = set()


def check_scope(scope: str) -> None:
    """A scope is a token (field ``operation journal scope``); valid ones are remembered."""
    if type(scope) is str and scope in _VALID_SCOPES:
        return
    validate_token("operation journal scope", scope)
    if len(_VALID_SCOPES) >= 4096:
        _VALID_SCOPES.clear()
    _VALID_SCOPES.add(scope)


def check_base_revision(value: object) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise InvalidRevision()


def prepare(scope: str, changes: WorkerCommit) -> tuple[tuple[RowWrite, ...], tuple[str, ...]]:
    """Validate a change set and render its documents, before any I/O."""
    writes: list[RowWrite] = []
    new_sessions: list[str] = []
    journal = changes.journal
    if journal is not None:
        if journal.scope != scope:
            raise OperationJournalScopeMismatch(scope, journal.scope)
        for key, change in journal.rows.items():
            if change.record.operation_key != key:
                raise RecordLocationMismatch(key, change.record.operation_key)
            check_base_revision(change.base_revision)
            document = change.record.to_row_json(scope)
            writes.append(RowWrite(NS_JOURNAL, key, document, change.base_revision))
    for session_id, documents in changes.sessions.items():
        validate_token("session id", session_id)
        check_base_revision(documents.base_revision)
        closed = state_status(documents.state, scope, session_id) == "closed"
        link, after = documents.link, documents.after
        for value in (link, after):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError("a commit link is a positive int")
        if after is not None:
            if documents.base_revision is not None or documents.opening is not None:
                raise ValueError("a chained commit names neither a base revision nor an opening")
            writes.append(
                RowWrite(NS_SESSION, session_id, documents.state, None, link, after, closed)
            )
            continue
        writes.append(
            RowWrite(
                NS_SESSION, session_id, documents.state, documents.base_revision, link, None, closed
            )
        )
        if documents.base_revision is None:
            if documents.opening is None:
                raise ValueError("a new session must supply its opening document")
            session_header(documents.opening, scope, session_id)
            writes.append(RowWrite(NS_SESSION_OPEN, session_id, documents.opening, None))
            new_sessions.append(session_id)
        elif documents.opening is not None:
            raise ValueError("a session's opening document is written once, when it opens")
    for entry in changes.outbox_insert:
        validate_token("session id", entry.session_id)
        expected_id = frame_message_id(entry.frame)
        if entry.message_id != expected_id:
            raise RecordLocationMismatch(expected_id, entry.message_id)
        document = outbox_document(
            scope, entry.session_id, entry.reply_to, entry.correlation_id, entry.frame
        )
        writes.append(
            RowWrite(NS_OUTBOX, entry.message_id, document, None, session=entry.session_id)
        )
    for message in changes.outbox_delete:
        if not is_message_id(message):
            raise InvalidToken("message id", message)
    return tuple(writes), tuple(new_sessions)


def note_tails(
    tails: dict[tuple[str, str], tuple[int, int] | None],
    pending: PendingCommit,
    revision: int | None,
) -> None:
    """Note what a change set did to session state rows (None: nothing to chain on)."""
    for write in pending.writes:
        if write.namespace == NS_SESSION:
            link = write.link
            name = (pending.scope, write.item)
            tails[name] = None if link is None or revision is None else (link, revision)


def backend_error(exc: BaseException) -> StorageBackendError:
    """Describe a sqlite/OS failure by class and code only (no paths, no data)."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorname", None) or "unknown"
        return StorageBackendError(f"sqlite {type(exc).__name__} {code}")
    if isinstance(exc, OSError):
        name = os.strerror(exc.errno) if exc.errno is not None else "unknown"
        return StorageBackendError(f"os {type(exc).__name__} {name}")
    return StorageBackendError(type(exc).__name__)


def guarded(function: Callable[[], T]) -> T:
    try:
        return function()
    except OctoError:
        raise
    except (sqlite3.Error, OSError) as exc:
        raise backend_error(exc) from None


def connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot write the database (``mode=ro``): closing it
    as the last connection never checkpoints a WAL left by a crashed writer."""
    uri = "file:" + urllib.parse.quote(os.fspath(path.absolute())) + "?mode=ro"
    return sqlite3.connect(
        uri,
        uri=True,
        timeout=SQLITE_BUSY_TIMEOUT_SECONDS,
        isolation_level=None,
        check_same_thread=False,
    )
