"""The SQL of the PostgreSQL ledger backend: its schema migrations and its statements.

The migrations run through ``octo_common.runtime.postgres.migrate_schema``.

Every statement names its tables through ``{s}``, the quoted schema, filled
in once per backend by :func:`statements`. Values are always bound
parameters, never text.

This module must never hold behaviour beyond filling in the schema name, or
a statement that writes without the compare-and-swap guard it documents.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "statements"]

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """
        CREATE TABLE {s}.heads (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            revision BIGINT NOT NULL CHECK (revision >= 0),
            fence BIGINT NOT NULL CHECK (fence >= 0),
            PRIMARY KEY (namespace, name)
        )
        """,
        """
        CREATE TABLE {s}.items (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            item TEXT NOT NULL,
            revision BIGINT NOT NULL,
            envelope BYTEA NOT NULL,
            PRIMARY KEY (namespace, name, item),
            FOREIGN KEY (namespace, name) REFERENCES {s}.heads (namespace, name)
        )
        """,
    ),
    # 1 -> 2: the store head (``postgres_head``), created to be built from the
    # records at the next open; the backend appends the step that seals that
    # row as such with its storage key.
    (
        """
        CREATE TABLE {s}.store_head (
            id SMALLINT PRIMARY KEY CHECK (id = 1),
            revision BIGINT NOT NULL CHECK (revision >= 0),
            record_count BIGINT NOT NULL CHECK (record_count >= 0),
            digest BYTEA,
            key_id TEXT,
            auth_tag TEXT
        )
        """,
        "INSERT INTO {s}.store_head (id, revision, record_count, digest) VALUES (1, 0, 0, NULL)",
    ),
)
"""Forward migrations: entry ``i`` moves the schema from version ``i`` to ``i + 1``."""

SCHEMA_VERSION: Final = len(MIGRATIONS)

_SELECT_VERSION = "SELECT version FROM {s}.schema_version"
_SELECT_NAMES = "SELECT DISTINCT name FROM {s}.items WHERE namespace = $1 ORDER BY name"

# One statement, so one snapshot; head and item read independently (as SQLite's).
_SELECT_RECORD = """
    SELECT
      (SELECT revision FROM {s}.heads WHERE namespace = $1 AND name = $2),
      (SELECT fence FROM {s}.heads WHERE namespace = $1 AND name = $2),
      (SELECT revision FROM {s}.items WHERE namespace = $1 AND name = $2 AND item = ''),
      (SELECT envelope FROM {s}.items WHERE namespace = $1 AND name = $2 AND item = '')
"""

# Locks the head of every record a transaction touches, in key order (so two
# transactions never wait for each other in a cycle), creating an absent head
# as revision 0, fence 0: exactly what an absent record is. The no-op
# update is what locks an existing row and returns its latest committed state.
_LOCK_HEADS = """
    INSERT INTO {s}.heads AS h (namespace, name, revision, fence)
    SELECT k.namespace, k.name, 0, 0
      FROM unnest($1::text[], $2::text[]) AS k(namespace, name)
     ORDER BY k.namespace, k.name
    ON CONFLICT (namespace, name) DO UPDATE SET fence = h.fence
    RETURNING h.namespace, h.name, h.revision, h.fence
"""

# A separate statement, so a fresh snapshot: it sees what the previous holder
# of the locks committed.
_SELECT_ITEMS = """
    SELECT i.namespace, i.name, i.revision, i.envelope
      FROM {s}.items AS i
      JOIN unnest($1::text[], $2::text[]) AS k(namespace, name)
        ON i.namespace = k.namespace AND i.name = k.name
     WHERE i.item = ''
"""

# The caller's compare-and-swap, checked in SQL: the head must be at the
# expected floor under the required fence and the item at the expected
# revision, or nothing is written and no row is returned.
_WRITE_RECORD = """
    WITH head AS (
        UPDATE {s}.heads SET revision = $3
         WHERE namespace = $1 AND name = $2 AND revision = $4 AND fence = $5
           AND (SELECT revision FROM {s}.items
                 WHERE namespace = $1 AND name = $2 AND item = '')
               IS NOT DISTINCT FROM $6::bigint
        RETURNING namespace, name
    )
    INSERT INTO {s}.items (namespace, name, item, revision, envelope)
    SELECT namespace, name, '', $3, $7 FROM head
    ON CONFLICT (namespace, name, item)
    DO UPDATE SET revision = excluded.revision, envelope = excluded.envelope
    RETURNING revision
"""

# One statement reads and raises the fence (reserve_fence: current + 1, never 0).
_RESERVE_FENCE = """
    UPDATE {s}.heads SET fence = fence + 1
     WHERE namespace = $1 AND name = $2 AND fence < $3
    RETURNING fence
"""

_ESTABLISH_FENCE = """
    UPDATE {s}.heads SET fence = $3
     WHERE namespace = $1 AND name = $2 AND fence < $3
    RETURNING fence
"""


def statements(schema: str) -> dict[str, str]:
    """Every statement by name, with ``{s}`` filled in as the quoted ``schema`` (a name
    :func:`~octo_common.runtime.postgres.check_schema` accepted)."""
    quoted = f'"{schema}"'
    return {
        name: text.format(s=quoted)
        for name, text in (
            ("select_version", _SELECT_VERSION),
            ("select_names", _SELECT_NAMES),
            ("select_record", _SELECT_RECORD),
            ("lock_heads", _LOCK_HEADS),
            ("select_items", _SELECT_ITEMS),
            ("write_record", _WRITE_RECORD),
            ("reserve_fence", _RESERVE_FENCE),
            ("establish_fence", _ESTABLISH_FENCE),
        )
    }
