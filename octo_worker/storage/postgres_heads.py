"""The PostgreSQL journal's store head: its migration, its check and its moves (``store_head``).

Owns the ``store_head`` table of a journal schema (one row: the sealed
digest of every scope head), the migration that creates it and builds it
from the scope heads as they are in the migration's own transaction
(:func:`migrations`: the SQL migrations of ``postgres_sql`` and this one),
the check of the store head against every scope head in the caller's
snapshot (:func:`check_store_heads`), its move by the scope heads a
transaction changed, under its row lock (:func:`move_store_head`), and
:class:`StoreHeads`, what a store holds of it: those, with the shared
journal's rollback anchor file (``store_anchor``) read before each check
and raised after each commit that moved the store head. The
caller holds the transaction; a transaction that moves scope heads locks
them first and the store head last, so two never wait for each other in a
cycle. Every commit of the schema takes the store head's row lock until it
commits: commits of different scopes in one schema are serialised on it
(each worker's group commit makes that one lock per batch).

It must never decide what a store head means (``store_head`` does), commit
or roll back, or write the store head without having verified its seal.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

from octo_common.errors import RollbackAnchorMissing, StorageBackendError
from octo_common.records import StorageKeyring
from octo_common.runtime.postgres import PostgresMigrationStep, schema_version
from octo_worker.storage.postgres_sql import MIGRATIONS
from octo_worker.storage.scope_head import ScopeHead
from octo_worker.storage.store_anchor import StoreAnchor
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
    "StoreHeads",
    "check_store_heads",
    "migrations",
    "move_store_head",
    "reseal_store_head",
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


async def check_store_heads(
    connection: Any, schema: str, keyring: StorageKeyring, anchored: int = 0
) -> int:
    """The store head against every scope head (each one's seal verified) and the
    anchored revision read before the caller's snapshot began, in that snapshot
    (O(scopes)); how many scope heads there are."""
    quoted = _quoted(schema)
    heads = await _head_states(connection, quoted, keyring)
    check_store(await _read(connection, quoted, lock=False), heads, keyring, anchored)
    return len(heads)


class StoreHeads:
    """One journal schema's store head as its store uses it: checked (against the
    anchor file too, when there is one), moved, and anchored after each commit."""

    __slots__ = ("anchor", "keyring", "moved", "schema", "version")

    def __init__(
        self,
        schema: str,
        keyring: StorageKeyring,
        anchor_path: str | os.PathLike[str] | None,
        version: int = SCHEMA_VERSION,
    ) -> None:
        self.schema = schema
        # The schema version the store supports (migrations after this one's too).
        self.version = version
        self.keyring = keyring
        self.anchor = None if anchor_path is None else StoreAnchor(anchor_path, schema)
        # The store head revision the last write transaction moved it to (0: none).
        self.moved = 0

    async def anchored(self) -> int:
        """The anchored revision (0 without an anchor), read before a snapshot begins."""
        return 0 if self.anchor is None else await asyncio.to_thread(self.anchor.read)

    async def check(self, connection: Any, anchored: int) -> int:
        """:func:`check_store_heads` inside the caller's snapshot."""
        return await check_store_heads(connection, self.schema, self.keyring, anchored)

    async def verify(self, connection: Any, anchored: int) -> int:
        """:meth:`check` in a read-only repeatable-read transaction of its own."""
        async with connection.transaction(isolation="repeatable_read", readonly=True):
            return await self.check(connection, anchored)

    async def move(
        self,
        connection: Any,
        moves: Sequence[tuple[HeadState | ScopeHead | None, HeadState | ScopeHead]],
    ) -> None:
        """:func:`move_store_head`, noting the revision it moved to (for :meth:`anchor_moved`);
        with an anchor configured but missing, nothing moves (``RollbackAnchorMissing``)."""
        if self.anchor is not None and not self.anchor.path.exists():
            raise RollbackAnchorMissing()
        self.moved = await move_store_head(connection, self.schema, moves, self.keyring)

    async def anchor_moved(self) -> None:
        """After the commit of a transaction that moved the store head: the anchor
        raised to its revision (``StorageBackendError`` when the file cannot be
        written: the transaction is committed all the same)."""
        moved, self.moved = self.moved, 0
        if self.anchor is not None and moved:
            try:
                await asyncio.to_thread(self.anchor.advance, moved)
            except OSError as exc:
                raise StorageBackendError(f"anchor: {type(exc).__name__}") from None

    async def schema_problems(self, connection: Any) -> list[str]:
        """``["ok"]`` when the schema is at the supported version. PostgreSQL has no
        per-database integrity pragma: pages are the server's (data checksums,
        ``amcheck``), and every row is still fully opened on each load."""
        version = await schema_version(connection, self.schema)
        if version != self.version:
            return [f"schema version {version} is not {self.version}"]
        return ["ok"]

    async def initialize_anchor(self, connection: Any) -> int:
        """Anchor the store head revision as it is now, its check passed first (an
        operator's explicit step); the revision anchored."""
        if self.anchor is None:
            raise ValueError("this store has no anchor_path")
        await self.verify(connection, 0)
        revision = (await _read(connection, _quoted(self.schema), lock=False)).revision
        await asyncio.to_thread(self.anchor.initialize, revision)
        return revision


def _state(head: HeadState | ScopeHead) -> HeadState:
    return (head.scope, head.fence, head.revision) if isinstance(head, ScopeHead) else head


async def move_store_head(
    connection: Any,
    schema: str,
    moves: Sequence[tuple[HeadState | ScopeHead | None, HeadState | ScopeHead]],
    keyring: StorageKeyring,
) -> int:
    """Move the store head by ``moves`` (each scope head before, None when it is new,
    and after) and reseal it, under its row lock, inside the caller's transaction
    (after the scope heads' locks); the revision it moved to (0: no move)."""
    if not moves:
        return 0
    quoted = _quoted(schema)
    states: list[HeadMove] = [
        (None if old is None else _state(old), _state(new)) for old, new in moves
    ]
    head = moved(await _read(connection, quoted, lock=True), states, keyring)
    await connection.execute(_UPDATE.format(s=quoted), *head.row())
    return head.revision


async def reseal_store_head(connection: Any, schema: str, keyring: StorageKeyring) -> bool:
    """Reseal the store head with the active key if another key sealed it (its seal
    verified first, its digest unchanged); whether it did."""
    quoted = _quoted(schema)
    head = await _read(connection, quoted, lock=True)
    if head.key_id == keyring.active_id:
        return False
    await connection.execute(_UPDATE.format(s=quoted), *moved(head, [], keyring).row())
    return True
