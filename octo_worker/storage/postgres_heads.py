"""The PostgreSQL journal's store head: its migration, its check and its moves (``store_head``).

Owns the ``store_head`` table of a journal schema (one row: the sealed
digest of every scope head), the migration that creates it and builds it
from the scope heads as they are in the migration's own transaction
(:func:`migrations`: the SQL migrations of ``postgres_sql`` and this one),
the check of the store head against every scope head in the caller's
snapshot (:func:`check_store_heads`), and its move by the scope heads a
transaction changed, under its row lock (:func:`move_store_head`). The
caller holds the transaction; a transaction that moves scope heads locks
them first and the store head last, so two never wait for each other in a
cycle. Every commit of the schema takes the store head's row lock until it
commits: commits of different scopes in one schema are serialised on it
(each worker's group commit makes that one lock per batch).

It must never decide what a store head means (``store_head`` does), commit
or roll back, or write the store head without having verified its seal.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from octo_common.errors import StorageBackendError
from octo_common.records import StorageKeyring
from octo_common.runtime.postgres import PostgresMigrationStep
from octo_worker.storage.postgres_sql import MIGRATIONS
from octo_worker.storage.scope_head import ScopeHead
from octo_worker.storage.store_head import (
    HeadMove,
    HeadState,
    JournalStoreHead,
    check_store,
    digest_of_heads,
    moved,
)

__all__ = [
    "SCHEMA_VERSION",
    "check_store_heads",
    "migrations",
    "move_store_head",
    "reseal_store_head",
    "verify_store",
]

_CREATE: Final = """
    CREATE TABLE {s}.store_head (
        id SMALLINT PRIMARY KEY CHECK (id = 1),
        revision BIGINT NOT NULL CHECK (revision >= 0),
        row_count BIGINT NOT NULL CHECK (row_count >= 0),
        digest BYTEA NOT NULL,
        key_id TEXT NOT NULL,
        auth_tag TEXT NOT NULL
    )
"""
_INSERT: Final = (
    "INSERT INTO {s}.store_head (id, revision, row_count, digest, key_id, auth_tag) "
    "VALUES (1, $1, $2, $3, $4, $5)"
)
_SELECT: Final = (
    "SELECT revision, row_count, digest, key_id, auth_tag FROM {s}.store_head WHERE id = 1"
)
_UPDATE: Final = (
    "UPDATE {s}.store_head SET revision = $1, row_count = $2, digest = $3, key_id = $4, "
    "auth_tag = $5 WHERE id = 1"
)
_HEADS: Final = (
    "SELECT name, revision, fence, row_count, digest, key_id, auth_tag FROM {s}.heads "
    "WHERE namespace = 'worker-journal'"
)

SCHEMA_VERSION: Final = len(MIGRATIONS) + 1


def _quoted(schema: str) -> str:
    return f'"{schema}"'


async def _head_states(
    connection: Any, quoted: str, keyring: StorageKeyring | None
) -> list[HeadState]:
    states: list[HeadState] = []
    for name, *row in await connection.fetch(_HEADS.format(s=quoted)):
        if not isinstance(name, str):
            raise StorageBackendError("malformed scope head row")
        head = ScopeHead.from_row(name, tuple(row))
        if keyring is not None:
            head.verify(keyring)
        states.append((name, head.fence, head.revision))
    return states


def _create_store_head(keyring: StorageKeyring) -> Callable[[Any, str], Awaitable[None]]:
    async def build(connection: Any, quoted: str) -> None:
        await connection.execute(_CREATE.format(s=quoted))
        heads = await _head_states(connection, quoted, None)
        head = JournalStoreHead.sealed(keyring, 0, digest_of_heads(heads))
        await connection.execute(_INSERT.format(s=quoted), *head.row())

    return build


def migrations(keyring: StorageKeyring) -> tuple[tuple[PostgresMigrationStep, ...], ...]:
    """Every migration of a journal schema; the last one (2 -> 3) creates the store head
    and builds it, sealed with ``keyring``, in the migration's transaction."""
    steps: tuple[tuple[PostgresMigrationStep, ...], ...] = (
        *MIGRATIONS,
        (_create_store_head(keyring),),
    )
    assert len(steps) == SCHEMA_VERSION
    return steps


async def _read(connection: Any, quoted: str, *, lock: bool) -> JournalStoreHead:
    rows = await connection.fetch(_SELECT.format(s=quoted) + (" FOR UPDATE" if lock else ""))
    return JournalStoreHead.from_row(tuple(rows[0]) if len(rows) == 1 else None)


async def check_store_heads(connection: Any, schema: str, keyring: StorageKeyring) -> int:
    """The store head against every scope head (each one's seal verified), in the
    caller's snapshot (O(scopes)); how many scope heads there are."""
    quoted = _quoted(schema)
    heads = await _head_states(connection, quoted, keyring)
    check_store(await _read(connection, quoted, lock=False), heads, keyring)
    return len(heads)


async def verify_store(connection: Any, *, schema: str, keyring: StorageKeyring) -> int:
    """:func:`check_store_heads` in a read-only repeatable-read transaction of its own."""
    async with connection.transaction(isolation="repeatable_read", readonly=True):
        return await check_store_heads(connection, schema, keyring)


def _state(head: HeadState | ScopeHead) -> HeadState:
    return (head.scope, head.fence, head.revision) if isinstance(head, ScopeHead) else head


async def move_store_head(
    connection: Any,
    schema: str,
    moves: Sequence[tuple[HeadState | ScopeHead | None, HeadState | ScopeHead]],
    keyring: StorageKeyring,
) -> None:
    """Move the store head by ``moves`` (each scope head before, None when it is new,
    and after) and reseal it, under its row lock, inside the caller's transaction
    (after the scope heads' locks)."""
    if not moves:
        return
    quoted = _quoted(schema)
    states: list[HeadMove] = [
        (None if old is None else _state(old), _state(new)) for old, new in moves
    ]
    head = moved(await _read(connection, quoted, lock=True), states, keyring)
    await connection.execute(_UPDATE.format(s=quoted), *head.row())


async def reseal_store_head(connection: Any, schema: str, keyring: StorageKeyring) -> bool:
    """Reseal the store head with the active key if another key sealed it (its seal
    verified first, its digest unchanged); whether it did."""
    quoted = _quoted(schema)
    head = await _read(connection, quoted, lock=True)
    if head.key_id == keyring.active_id:
        return False
    await connection.execute(_UPDATE.format(s=quoted), *moved(head, [], keyring).row())
    return True
