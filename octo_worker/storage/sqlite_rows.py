"""What the SQLite journal store's threads share: schema, statements' pieces, errors.

Owns the schema and its forward-only migrations (the last one builds the
scope heads' digests: ``sqlite_heads``), the SQL fragments both
threads use, the read-only connection, and how a sqlite or OS failure is
told (:func:`backend_error`: class and code, never a path or data). Row
shapes and change sets are every backend's (``changes``). It must never do
I/O itself beyond opening a read-only connection.
"""

from __future__ import annotations

import os
import sqlite3
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from octo_common.errors import (
    OctoError,
    StorageBackendError,
)
from octo_common.limits import SQLITE_BUSY_TIMEOUT_SECONDS
from octo_common.records import StorageKeyring
from octo_common.runtime.sqlite import MigrationStep
from octo_worker.storage.documents import (
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
)
from octo_worker.storage.scope_head import DIGEST_FORMAT
from octo_worker.storage.sqlite_heads import (
    HEAD_COLUMNS,
    STORE_HEAD_SCHEMA,
    create_store_head,
    seal_existing_heads,
)
from octo_worker.storage.sqlite_rekey import rekey_journal_items, seal_written_at

T = TypeVar("T")

# Rows re-sealed per batch (``reseal``): one short read and one write each.
RESEAL_BATCH: Final = 1000

BY_ITEMS: Final = "WHERE namespace = ? AND name = ? AND item"
# The partial index's condition, repeated word for word by the query that
# uses it (SQLite matches the terms, so the namespaces are literals here).
LIVE_SESSION_ROWS: Final = f"namespace IN ('{NS_SESSION}', '{NS_SESSION_OPEN}') AND closed = 0"
# The outbox index's condition, likewise repeated by the query that uses it.
OUTBOX_ROWS: Final = f"namespace = '{NS_OUTBOX}'"
# The request rows index's condition, likewise.
REQUEST_ROWS: Final = f"namespace = '{NS_SESSION_REQUEST}'"
SQL_CHUNK: Final = 500  # well under SQLite's bound on host parameters

# Forward-only migrations: index i moves the schema from version i to i + 1;
# the last one (4 -> 5, the scope heads' digests) is ``migrations(keyring)``'s.
_SQL_MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
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

# 5 -> 6: the request rows of a session (``worker-session-request``, one per
# retained request id) found by their session column through a partial
# index. No row exists before it; a state document written before it holds
# its request ids inline and still loads (``documents.read_session``).
_REQUEST_ROWS_MIGRATION: Final = (
    f"CREATE INDEX items_request_sessions ON items (name, session) WHERE {REQUEST_ROWS}",
)

# 7 -> 8: every journal row's item becomes its operation key's keyed hash
# (``journal_items``), each row sealed again under it and each scope head
# resealed over its rows so renamed, at its own revision and fence (the store
# head, over scope heads' revisions and fences, does not move: ``item_rekey``).
# Before it, items are operation keys in clear.
# 8 -> 9: each journal row's ``written_at`` sealed in a ``written_tag`` column
# (``sealing.written_tag``), scope by scope once its rows match its sealed head.

SCHEMA_VERSION: Final = len(_SQL_MIGRATIONS) + 5
# The heads carry digests from schema DIGEST_FORMAT (5) on: the anchor's digest mark.
DIGEST_SCHEMA_VERSION: Final = DIGEST_FORMAT
# Journal items are keyed hashes from this schema on (a read-only look at an
# older journal reads them in clear).
KEYED_ITEMS_SCHEMA_VERSION: Final = 8
# Journal rows' ``written_at`` is sealed from this schema on.
WRITTEN_AT_SCHEMA_VERSION: Final = 9


def migrations(
    keyring: StorageKeyring, data_keyring: StorageKeyring | None
) -> tuple[tuple[MigrationStep, ...], ...]:
    """Every migration; 4 -> 5 adds the scope heads' digests and 6 -> 7 the store head,
    each built and sealed with ``keyring`` in the migration's transaction; 7 -> 8
    rekeys the journal items under both keyrings; 8 -> 9 seals each journal row's
    ``written_at``."""
    steps: tuple[tuple[MigrationStep, ...], ...] = (
        *_SQL_MIGRATIONS,
        (*HEAD_COLUMNS, seal_existing_heads(keyring)),
        _REQUEST_ROWS_MIGRATION,
        (create_store_head(keyring),),
        (rekey_journal_items(keyring, data_keyring),),
        (seal_written_at(keyring),),
    )
    assert len(steps) == WRITTEN_AT_SCHEMA_VERSION == SCHEMA_VERSION > STORE_HEAD_SCHEMA
    return steps


def select_in_chunks(
    connection: sqlite3.Connection, select: str, fixed: tuple[Any, ...], values: Sequence[str]
) -> list[tuple[Any, ...]]:
    """The rows of ``select`` followed by ``IN (?, ...)`` over ``values``, SQL_CHUNK at
    a time; ``fixed`` binds ``select``'s own placeholders. Only "?" placeholders
    are formatted in: every value is bound."""
    found: list[tuple[Any, ...]] = []
    for start in range(0, len(values), SQL_CHUNK):
        chunk = values[start : start + SQL_CHUNK]
        sql = f"{select} IN ({','.join('?' * len(chunk))})"
        found.extend(connection.execute(sql, (*fixed, *chunk)).fetchall())
    return found


def schema_version(connection: sqlite3.Connection) -> int:
    """The schema version the database has now (0 for a database without one)."""
    try:
        row = connection.execute("SELECT version FROM schema_version").fetchone()
    except sqlite3.OperationalError:
        return 0
    return 0 if row is None else int(row[0])


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
