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
from octo_worker.storage.sealing import check_written, written_key_id, written_tag

__all__ = [
    "SCHEMA_VERSION",
    "migrate",
    "migrations",
    "needs_rekey",
    "rekey_journal_items",
    "rekey_rotated",
    "reseal_written_at",
    "seal_written_at",
]

_log = structlog.get_logger("octo_worker.store")

# The PostgreSQL journal's schema: 3 -> 4 makes the journal items keyed hashes,
# 4 -> 5 seals each journal row's ``written_at`` (``sealing.written_tag``).
SCHEMA_VERSION: Final = STORE_HEAD_SCHEMA + 2

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
    then 3 -> 4, the journal items rekeyed under both keyrings, and 4 -> 5, each
    journal row's ``written_at`` sealed."""
    steps = (
        *store_head_migrations(keyring),
        (rekey_journal_items(keyring, data_keyring),),
        (seal_written_at(keyring),),
    )
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


_SELECT_WRITTEN: Final = """
    SELECT id, revision, written_at, written_tag FROM {s}.items
     WHERE name = $1 AND namespace = 'worker-journal'
"""
_JOURNAL_SCOPES: Final = "SELECT DISTINCT name FROM {s}.items WHERE namespace = 'worker-journal'"
_UPDATE_WRITTEN: Final = (
    "UPDATE {s}.items SET written_tag = $1 WHERE id = $2 AND revision = $3 AND written_at = $4"
)


def seal_written_at(keyring: StorageKeyring) -> Callable[[Connection, str], Awaitable[None]]:
    """The 4 -> 5 step: the ``written_tag`` column, and each scope's journal rows'
    ``written_at`` sealed as it stands once the scope's rows match its sealed head
    (a scope that does not keeps its rows untagged: refused at its load)."""

    async def run(connection: Connection, quoted: str) -> None:
        await connection.execute(
            f"ALTER TABLE {quoted}.items ADD COLUMN IF NOT EXISTS written_tag TEXT"
        )
        check = ItemRekeying(keyring, None)
        scopes = await connection.fetch(_JOURNAL_SCOPES.format(s=quoted))
        for scope in sorted(str(row[0]) for row in scopes):
            found = await connection.fetchrow(_LOCK_HEAD.format(s=quoted), scope)
            head = None if found is None else ScopeHead.from_row(scope, tuple(found))
            try:
                check.checked_head(scope, head, await _scope_rows(connection, quoted, scope))
            except OctoError as error:
                _log.warning("journal_written_at_not_sealed", scope=scope, error=error.code)
                continue
            rows = await connection.fetch(_SELECT_WRITTEN.format(s=quoted), scope)
            await connection.executemany(
                _UPDATE_WRITTEN.format(s=quoted),
                [
                    (written_tag(keyring, scope, revision, when), row_id, revision, when)
                    for row_id, revision, when, _ in rows
                ],
            )

    return run


async def reseal_written_at(
    connection: Connection, quoted: str, keyring: StorageKeyring, scope: str
) -> int:
    """Seal again, with the active key, every journal row's ``written_at`` of ``scope``
    that another key sealed, each checked first (inside the caller's transaction)."""
    changes = []
    for row_id, revision, when, tag in await connection.fetch(
        _SELECT_WRITTEN.format(s=quoted), scope
    ):
        if written_key_id(tag) == keyring.active_id:
            continue
        check_written(keyring, scope, revision, when, tag)
        changes.append((written_tag(keyring, scope, revision, when), row_id, revision, when))
    if changes:
        await connection.executemany(_UPDATE_WRITTEN.format(s=quoted), changes)
    return len(changes)
