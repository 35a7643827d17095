"""The PostgreSQL journal's rekeying pass: its rows brought under the active key's item hash.

Owns the statements and the driver of ``item_rekey``'s pass on PostgreSQL:
the schema 3 -> 4 migration step (journal items become keyed hashes, in the
migration's transaction, under its advisory lock) and the same pass at a
writable open when rows are hashed under a key rotated away from (its own
transaction, under the same lock). Each scope's head is locked (``FOR
UPDATE``) before its rows are rewritten, so a commit of a worker sharing the
journal waits for the pass; each scope is a savepoint (a scope that fails
its check keeps its rows as they were).

It must never decide what a row or a head means (``item_rekey`` does) or
commit on its own: the caller holds the transaction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog

from octo_common.errors import OctoError
from octo_common.records import StorageKeyring
from octo_common.runtime.postgres import (
    Connection,
    PostgresMigrationStep,
    advisory_lock_key,
    migrate_schema,
)
from octo_worker.storage.item_rekey import REKEY_BATCH, ItemRekeying
from octo_worker.storage.postgres_heads import SCHEMA_VERSION as STORE_HEAD_SCHEMA
from octo_worker.storage.postgres_heads import migrations as store_head_migrations
from octo_worker.storage.scope_head import ScopeHead

__all__ = [
    "SCHEMA_VERSION",
    "migrate",
    "migrations",
    "needs_rekey",
    "rekey_journal_items",
    "rekey_rotated",
]

_log = structlog.get_logger("octo_worker.store")

# The PostgreSQL journal's schema: 3 -> 4 makes the journal items keyed hashes.
SCHEMA_VERSION: Final = STORE_HEAD_SCHEMA + 1

_STALE: Final = (
    "SELECT DISTINCT name FROM {s}.items "
    "WHERE namespace = 'worker-journal' AND substr(item, 1, $1) <> $2"
)
_LOCK_HEAD: Final = """
    SELECT revision, fence, row_count, digest, key_id, auth_tag FROM {s}.heads
     WHERE namespace = 'worker-journal' AND name = $1 FOR UPDATE
"""
_SCOPE_ROWS: Final = """
    SELECT namespace, item, revision FROM {s}.items
     WHERE name = $1
       AND namespace IN ('worker-journal', 'worker-session', 'worker-session-open', 'worker-outbox',
                         'worker-session-request')
"""
_JOURNAL_BATCH: Final = """
    SELECT id, item, revision, envelope FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-journal' AND id > $2 ORDER BY id LIMIT $3
"""
_REWRITE: Final = "UPDATE {s}.items SET item = $1, envelope = $2 WHERE id = $3"
_RESEAL_HEAD: Final = """
    UPDATE {s}.heads SET row_count = $4, digest = $5, key_id = $6, auth_tag = $7
     WHERE namespace = 'worker-journal' AND name = $1 AND revision = $2 AND fence = $3
"""


def migrations(
    keyring: StorageKeyring, data_keyring: StorageKeyring | None
) -> tuple[tuple[PostgresMigrationStep, ...], ...]:
    """Every migration of the PostgreSQL journal: the store head's (``postgres_heads``),
    then 3 -> 4, the journal items rekeyed under both keyrings."""
    steps = (*store_head_migrations(keyring), (rekey_journal_items(keyring, data_keyring),))
    assert len(steps) == SCHEMA_VERSION
    return steps


async def migrate(
    connection: Connection,
    schema: str,
    keyrings: tuple[StorageKeyring, StorageKeyring | None],
    *,
    rotated: bool,
) -> None:
    """A writable open's migrations (``migrate_schema``, under the journal's lock),
    then, with ``rotated``, the rows hashed under a key rotated away from rekeyed."""
    lock = f"octo-journal:{schema}"
    await migrate_schema(connection, schema, migrations(*keyrings), lock)
    if rotated:
        await rekey_rotated(connection, schema, lock, *keyrings)


async def needs_rekey(connection: Connection, quoted: str, keyring: StorageKeyring) -> bool:
    """Whether a journal row's item is not the active key's hash."""
    prefix = f"{keyring.active_id}:"
    found = await connection.fetchval(_STALE.format(s=quoted) + " LIMIT 1", len(prefix), prefix)
    return found is not None


async def rekey_rotated(
    connection: Connection,
    schema: str,
    lock: str,
    keyring: StorageKeyring,
    data_keyring: StorageKeyring | None,
) -> None:
    """Rows hashed under a storage key rotated away from, brought under the active
    key's item hash, in one transaction under the migration's lock ``lock``."""
    quoted = f'"{schema}"'
    if not await needs_rekey(connection, quoted, keyring):
        return
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", advisory_lock_key(lock))
        await rekey_journal_items(keyring, data_keyring)(connection, quoted)


def rekey_journal_items(
    keyring: StorageKeyring, data_keyring: StorageKeyring | None
) -> Callable[[Connection, str], Awaitable[None]]:
    """The pass as a migration step: ``step(connection, quoted_schema)``, run inside
    the caller's transaction."""

    async def run(connection: Connection, quoted: str) -> None:
        rekey = ItemRekeying(keyring, data_keyring)
        prefix = rekey.prefix
        stale = await connection.fetch(_STALE.format(s=quoted), len(prefix), prefix)
        for scope in sorted(str(row[0]) for row in stale):
            try:
                async with connection.transaction():  # a savepoint
                    await _rekey_scope(connection, quoted, rekey, scope)
            except OctoError as error:
                _log.warning("journal_items_not_rekeyed", scope=scope, error=error.code)

    return run


async def _scope_rows(connection: Connection, quoted: str, scope: str) -> list[Any]:
    return [tuple(row) for row in await connection.fetch(_SCOPE_ROWS.format(s=quoted), scope)]


async def _rekey_scope(
    connection: Connection, quoted: str, rekey: ItemRekeying, scope: str
) -> None:
    found = await connection.fetchrow(_LOCK_HEAD.format(s=quoted), scope)
    head = None if found is None else ScopeHead.from_row(scope, tuple(found))
    head = rekey.checked_head(scope, head, await _scope_rows(connection, quoted, scope))
    after = 0
    while True:
        batch = await connection.fetch(_JOURNAL_BATCH.format(s=quoted), scope, after, REKEY_BATCH)
        if not batch:
            break
        after = int(batch[-1][0])
        changes = rekey.rewrites(scope, [tuple(row) for row in batch])
        if changes:
            await connection.executemany(_REWRITE.format(s=quoted), changes)
        rekey.wrote(len(changes))
    sealed = rekey.resealed_head(head, await _scope_rows(connection, quoted, scope))
    revision, fence, count, digest, key_id, tag = sealed.row()
    await connection.execute(
        _RESEAL_HEAD.format(s=quoted), scope, revision, fence, count, digest, key_id, tag
    )
