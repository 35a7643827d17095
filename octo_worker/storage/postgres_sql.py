"""The SQL of the PostgreSQL journal store: its schema migrations and its statements.

Every statement names its tables through ``{s}``, the quoted schema, filled
in once per store by :func:`statements`; values are always bound
parameters, never text. The row namespaces are written out as literals
(``documents.NS_*``; a unit test checks they agree).
The tables mirror the SQLite journal's (``sqlite_rows``, ``sqlite_heads``):
``heads`` (one row per scope: revision, fence, the digest and count of its
rows, and the head's seal, ``scope_head``) and ``items`` (every sealed row,
with the metadata ``written_at`` (sealed in ``written_tag`` from schema 5), ``closed`` and
``session``).

This module must never hold behaviour beyond filling in the schema name, or
a statement that writes a row without the compare-and-swap guard it
documents.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DEFAULT_SCHEMA", "MIGRATIONS", "RESEAL_BATCH", "SCHEMA_VERSION", "statements"]

DEFAULT_SCHEMA: Final = "octo_journal"
# Rows re-sealed per batch (``reseal``; the LIMIT of ``select_batch``).
RESEAL_BATCH: Final = 1000

MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (
    (
        """
        CREATE TABLE {s}.heads (
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            revision BIGINT NOT NULL CHECK (revision >= 0),
            fence BIGINT NOT NULL CHECK (fence >= 0),
            row_count BIGINT NOT NULL CHECK (row_count >= 0),
            digest BYTEA NOT NULL,
            key_id TEXT NOT NULL,
            auth_tag TEXT NOT NULL,
            PRIMARY KEY (namespace, name)
        )
        """,
        # ``id`` orders the outbox rows one commit inserted and pages reseal.
        """
        CREATE TABLE {s}.items (
            id BIGINT GENERATED ALWAYS AS IDENTITY,
            namespace TEXT NOT NULL,
            name TEXT NOT NULL,
            item TEXT NOT NULL,
            revision BIGINT NOT NULL,
            envelope BYTEA NOT NULL,
            written_at DOUBLE PRECISION NOT NULL,
            closed BOOLEAN NOT NULL DEFAULT FALSE,
            session TEXT,
            PRIMARY KEY (name, namespace, item)
        )
        """,
        "CREATE UNIQUE INDEX items_by_id ON {s}.items (name, id)",
        "CREATE INDEX items_by_revision ON {s}.items (name, namespace, revision, id)",
        "CREATE INDEX items_live_sessions ON {s}.items (name, item) "
        "WHERE namespace IN ('worker-session', 'worker-session-open') AND NOT closed",
        "CREATE INDEX items_outbox_sessions ON {s}.items (name, session) "
        "WHERE namespace = 'worker-outbox'",
    ),
    # 1 -> 2: a session's request rows (``worker-session-request``, one per
    # retained request id) found by their session column. No row exists
    # before it; a state document written before it holds its request ids
    # inline and still loads.
    (
        "CREATE INDEX items_request_sessions ON {s}.items (name, session) "
        "WHERE namespace = 'worker-session-request'",
    ),
)
"""Forward migrations: entry ``i`` moves the schema from version ``i`` to ``i + 1``."""

SCHEMA_VERSION: Final = len(MIGRATIONS)

# A scope's first head, created sealed at fence 1 (nothing when
# another worker created it first: the caller runs again), ...
_CREATE_HEAD = """
    INSERT INTO {s}.heads AS h (namespace, name, revision, fence, row_count, digest, key_id,
                                auth_tag)
    VALUES ('worker-journal', $1, 0, 1, $2, $3, $4, $5)
    ON CONFLICT (namespace, name) DO NOTHING
    RETURNING h.fence
"""
# ... or the fence of the head read (and locked) raised by ONE statement that
# compares it, and the revision, with what was read (compare-and-swap in SQL);
# the head is resealed with it.
_RAISE_FENCE = """
    UPDATE {s}.heads SET fence = $2, key_id = $3, auth_tag = $4
     WHERE namespace = 'worker-journal' AND name = $1 AND fence = $5 AND revision = $6
       AND $2 = $5 + 1
    RETURNING fence
"""
_LOCK_HEAD = """
    SELECT revision, fence, row_count, digest, key_id, auth_tag FROM {s}.heads
     WHERE namespace = 'worker-journal' AND name = $1
       FOR UPDATE
"""
# A reservation that waited its lock timeout on a head: end the sessions of
# the journal's workers whose transaction has held a write lock on the heads
# for longer than the idle-transaction timeout ($1 seconds). An owner's commit
# holds it for milliseconds; one held that long belongs to a worker paused or
# cut off in the middle of a transaction (a paused client is not "idle" to the
# server while it owes the rest of a message or has not read a result), which
# the broker has already replaced. Reads take no such lock and are spared.
_END_STALE_HOLDERS = """
    SELECT count(pg_terminate_backend(a.pid)) FROM pg_stat_activity AS a
     WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
       AND a.application_name = 'octo-worker-journal'
       AND a.xact_start < now() - make_interval(secs => $1)
       AND EXISTS (SELECT 1 FROM pg_locks AS l
                    WHERE l.pid = a.pid AND l.granted AND l.relation = '{s}.heads'::regclass
                      AND l.mode IN ('RowShareLock', 'RowExclusiveLock'))
"""
_SELECT_HEAD_ROW = """
    SELECT revision, fence, row_count, digest, key_id, auth_tag FROM {s}.heads
     WHERE namespace = 'worker-journal' AND name = $1
"""
# A head resealed at the same revision and fence (a prune moved its digest, or
# a reseal moved it onto the active key), under its lock.
_RESEAL_HEAD = """
    UPDATE {s}.heads SET row_count = $4, digest = $5, key_id = $6, auth_tag = $7
     WHERE namespace = 'worker-journal' AND name = $1 AND revision = $2 AND fence = $3
    RETURNING 1
"""

# The heads of a batch's scopes, locked in name order (two transactions never
# wait for each other in a cycle); a scope without a head has none to lock.
_LOCK_HEADS = """
    SELECT name, revision, fence, row_count, digest, key_id, auth_tag FROM {s}.heads
     WHERE namespace = 'worker-journal' AND name = ANY($1::text[])
     ORDER BY name
       FOR UPDATE
"""

# One change set's row writes (or a whole batch's, each row once:
# ``postgres_batch``), all or nothing, in ONE statement: the current
# revision of every row is compared with its base (absent for NULL) in SQL;
# the first one that differs is returned (by its position, with what the row
# holds) and nothing is written; otherwise every row is written at its
# revision ($6, the change set's for each of its rows), the opening rows of
# the sessions it closes are marked, the outbox rows it releases deleted
# (returned, with their revisions, for the scope's digest), and the rows
# written counted. The data-modifying parts run on one snapshot, so they
# never see each other's rows: the rows they touch are disjoint by
# construction (a row is written once per statement; an opening row is
# inserted, never updated; only outbox rows are deleted).
_WRITE_CHANGE_SET = """
    WITH w AS (
        SELECT * FROM unnest($3::text[], $4::text[], $5::bigint[], $6::bigint[], $7::bytea[],
                             $8::boolean[], $9::text[], $12::text[])
          WITH ORDINALITY AS w(namespace, item, base, revision, envelope, closed, session, tag, n)
    ),
    bad AS (
        SELECT w.n, i.revision AS actual
          FROM w LEFT JOIN {s}.items AS i
            ON i.name = $1 AND i.namespace = w.namespace AND i.item = w.item
         WHERE i.revision IS DISTINCT FROM w.base
         ORDER BY w.n
         LIMIT 1
    ),
    upd AS (
        UPDATE {s}.items AS i
           SET revision = w.revision, envelope = w.envelope, written_at = $2,
               written_tag = w.tag, closed = w.closed
          FROM w
         WHERE NOT EXISTS (SELECT 1 FROM bad) AND w.base IS NOT NULL
           AND i.name = $1 AND i.namespace = w.namespace AND i.item = w.item
           AND i.revision = w.base
        RETURNING 1
    ),
    ins AS (
        INSERT INTO {s}.items (namespace, name, item, revision, envelope, written_at,
                                 written_tag, closed, session)
        SELECT w.namespace, $1, w.item, w.revision, w.envelope, $2, w.tag, w.closed, w.session
          FROM w
         WHERE NOT EXISTS (SELECT 1 FROM bad) AND w.base IS NULL
        ON CONFLICT DO NOTHING
        RETURNING 1
    ),
    marked AS (
        UPDATE {s}.items SET closed = TRUE
         WHERE NOT EXISTS (SELECT 1 FROM bad)
           AND name = $1 AND namespace = 'worker-session-open' AND item = ANY($10::text[])
           AND NOT closed
        RETURNING 1
    ),
    released AS (
        DELETE FROM {s}.items
         WHERE NOT EXISTS (SELECT 1 FROM bad)
           AND name = $1 AND namespace = 'worker-outbox' AND item = ANY($11::text[])
        RETURNING item, revision
    )
    SELECT (SELECT n FROM bad), (SELECT actual FROM bad),
           (SELECT count(*) FROM upd) + (SELECT count(*) FROM ins),
           (SELECT count(*) FROM marked),
           (SELECT array_agg(item) FROM released), (SELECT array_agg(revision) FROM released)
"""

_CURRENT = "SELECT revision FROM {s}.items WHERE name = $1 AND namespace = $2 AND item = $3"

# The heads a batch moved, resealed, each still at the fence it was read with.
_ADVANCE_HEADS = """
    UPDATE {s}.heads AS h
       SET revision = a.revision, row_count = a.row_count, digest = a.digest,
           key_id = a.key_id, auth_tag = a.auth_tag
      FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bytea[], $6::text[],
                  $7::text[]) AS a(name, revision, fence, row_count, digest, key_id, auth_tag)
     WHERE h.namespace = 'worker-journal' AND h.name = a.name AND h.fence = a.fence
       AND h.revision < a.revision
    RETURNING 1
"""

# Reads: one statement each, so the head ({head}: the scope's head revision)
# and the rows come from one snapshot.
_HEAD = (
    "(SELECT h.revision FROM {s}.heads AS h "
    "WHERE h.namespace = 'worker-journal' AND h.name = $1) AS head"
)
_SELECT_ITEMS = """
    SELECT {head}, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace = $2 AND item = ANY($3::text[])
"""
_SELECT_NAMESPACE = """
    SELECT {head}, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace = $2
     ORDER BY revision, id
"""
_SELECT_OUTBOX_OF = """
    SELECT {head}, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-outbox' AND session = $2
     ORDER BY revision, id
"""
# Sessions with their request rows, in one statement (one snapshot).
_SELECT_SESSIONS = """
    SELECT {head}, namespace, item, revision, envelope FROM {s}.items
     WHERE name = $1
       AND namespace IN ('worker-session', 'worker-session-open', 'worker-session-request')
     ORDER BY item
"""
# The live sessions through their partial index, and the closed ones named;
# the request rows of those sessions through theirs.
_SELECT_LIVE_SESSIONS = """
    SELECT {head}, namespace, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace IN ('worker-session', 'worker-session-open') AND NOT closed
    UNION ALL
    SELECT {head}, namespace, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace IN ('worker-session', 'worker-session-open') AND closed
       AND item = ANY($2::text[])
    UNION ALL
    SELECT {head}, namespace, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-session-request'
       AND session IN (SELECT item FROM {s}.items
                        WHERE name = $1 AND namespace = 'worker-session'
                          AND (NOT closed OR item = ANY($2::text[])))
"""
_SELECT_PRUNABLE = """
    SELECT {head}, item, revision, envelope, written_at, written_tag FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-journal' AND written_at < $2
     ORDER BY revision, id
"""
_SELECT_BATCH = """
    SELECT {head}, id, namespace, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND id > $2
     ORDER BY id
     LIMIT 1000
"""
_SELECT_HEAD = (
    "SELECT revision, fence FROM {s}.heads WHERE namespace = 'worker-journal' AND name = $1"
)
# Every row of a scope, for its digest (``scope_head``): the five namespaces.
_SELECT_SCOPE_ROWS = """
    SELECT namespace, item, revision FROM {s}.items
     WHERE name = $1
       AND namespace IN ('worker-journal', 'worker-session', 'worker-session-open', 'worker-outbox',
                         'worker-session-request')
"""
_SELECT_SCOPES = "SELECT name FROM {s}.heads WHERE namespace = 'worker-journal' ORDER BY name"
# Every scope with a head or a row (through the (name, id) index).
_SELECT_STORED_SCOPES = """
    SELECT name FROM {s}.heads WHERE namespace = 'worker-journal'
    UNION SELECT DISTINCT name FROM {s}.items ORDER BY name
"""
_SELECT_WRITTEN = """
    SELECT item, written_at FROM {s}.items WHERE name = $1 AND namespace = 'worker-journal'
"""
# Every distinct (revision, written_at, seal) of a scope's journal rows, checked at load.
_SELECT_WRITTEN_TAGS = """
    SELECT DISTINCT revision, written_at, written_tag FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-journal'
"""
_COUNT_CLOSED = """
    SELECT count(*) FROM {s}.items WHERE name = $1 AND namespace = 'worker-session' AND closed
"""

# Maintenance: each in a transaction that holds the scope's head lock, so
# it never runs between a commit's reads and writes.
_PRUNE_ROWS = """
    UPDATE {s}.items AS i SET envelope = v.new
      FROM unnest($2::text[], $3::bigint[], $4::bytea[], $5::bytea[])
           AS v(item, revision, old, new)
     WHERE i.name = $1 AND i.namespace = 'worker-journal' AND i.item = v.item
       AND i.revision = v.revision AND i.envelope = v.old
    RETURNING 1
"""
_REPLACE_ENVELOPES = """
    UPDATE {s}.items AS i SET envelope = c.new
      FROM unnest($2::bigint[], $3::bigint[], $4::bytea[], $5::bytea[])
           AS c(id, revision, old, new)
     WHERE i.name = $1 AND i.id = c.id AND i.revision = c.revision AND i.envelope = c.old
    RETURNING 1
"""
_MARK_CLOSED = """
    UPDATE {s}.items SET closed = TRUE
     WHERE name = $1 AND namespace IN ('worker-session', 'worker-session-open')
       AND item = ANY($2::text[])
"""


def statements(schema: str) -> dict[str, str]:
    """Every statement by name, with ``{s}`` filled in as the quoted ``schema`` (a name
    :func:`~octo_common.runtime.postgres.check_schema` accepted) and ``{head}`` as
    the scope's head revision."""
    quoted = f'"{schema}"'
    head = _HEAD.format(s=quoted)
    return {
        name: text.format(s=quoted, head=head)
        for name, text in (
            ("create_head", _CREATE_HEAD),
            ("raise_fence", _RAISE_FENCE),
            ("lock_head", _LOCK_HEAD),
            ("end_stale_holders", _END_STALE_HOLDERS),
            ("select_head_row", _SELECT_HEAD_ROW),
            ("reseal_head", _RESEAL_HEAD),
            ("lock_heads", _LOCK_HEADS),
            ("write_change_set", _WRITE_CHANGE_SET),
            ("current", _CURRENT),
            ("advance_heads", _ADVANCE_HEADS),
            ("select_items", _SELECT_ITEMS),
            ("select_namespace", _SELECT_NAMESPACE),
            ("select_outbox_of", _SELECT_OUTBOX_OF),
            ("select_sessions", _SELECT_SESSIONS),
            ("select_live_sessions", _SELECT_LIVE_SESSIONS),
            ("select_prunable", _SELECT_PRUNABLE),
            ("select_written_tags", _SELECT_WRITTEN_TAGS),
            ("select_batch", _SELECT_BATCH),
            ("select_head", _SELECT_HEAD),
            ("select_scopes", _SELECT_SCOPES),
            ("select_stored_scopes", _SELECT_STORED_SCOPES),
            ("select_written", _SELECT_WRITTEN),
            ("count_closed", _COUNT_CLOSED),
            ("select_scope_rows", _SELECT_SCOPE_ROWS),
            ("prune_rows", _PRUNE_ROWS),
            ("replace_envelopes", _REPLACE_ENVELOPES),
            ("mark_closed", _MARK_CLOSED),
        )
    }
