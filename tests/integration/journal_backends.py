"""The worker journal's backends for the shared store tests: one database, opened and edited.

``journal_db`` (in this directory's ``conftest.py``) gives every test that
asks for it a :class:`JournalDatabase` of each backend in turn: a SQLite
file in ``tmp_path`` and a PostgreSQL schema of the test's own (marked
``postgres``). ``store()`` opens a new store object on it, as another
process would; the other methods read and edit the database behind the
store's back, as someone with access to the database would, in the same
words for both backends, so one test body checks both.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from octo_common.ids import is_token
from octo_common.records import StorageKeyring
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.documents import NS_JOURNAL
from octo_worker.storage.journal_items import JournalItems
from octo_worker.storage.postgres import PostgresJournalStore
from octo_worker.storage.scope_head import ScopeHead
from octo_worker.storage.sealing import written_tag
from octo_worker.storage.store_head import JournalStoreHead, digest_of_heads
from octo_worker.store import SqliteJournalStore
from tests.postgres import PostgresSchema

POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)
BACKENDS = ["sqlite", POSTGRES]


def default_keyring() -> StorageKeyring:
    return StorageKeyring("storage-v1", bytes([1]) * 32)


@dataclass
class JournalDatabase:
    """One journal database (a SQLite file or a PostgreSQL schema) and a back door into it."""

    kind: str
    path: Path
    place: PostgresSchema | None
    # Every keyring a store was opened with: a journal row's item at rest is
    # its operation key's keyed hash under one of them (``journal_items``).
    keyrings: list[StorageKeyring] = field(default_factory=list)

    @property
    def postgres(self) -> bool:
        return self.place is not None

    def store(self, keyring: StorageKeyring | None = None, **options: Any) -> JournalStoreBase:
        """A new journal store object on this database."""
        ring = keyring or default_keyring()
        self.keyrings.append(ring)
        if self.place is None:
            return SqliteJournalStore(self.path, ring, **options)
        return PostgresJournalStore(
            self.place.url,
            ring,
            password_file=self.place.password_file,
            schema=self.place.schema,
            **options,
        )

    # The back door: ``?`` placeholders, translated for PostgreSQL ----------------------

    async def sql(self, statement: str, *parameters: object) -> list[tuple[Any, ...]]:
        """Run ``statement`` (``?`` placeholders) on the database, outside any store."""
        if self.place is None:
            connection = sqlite3.connect(self.path, isolation_level=None)
            try:
                return [tuple(row) for row in connection.execute(statement, parameters).fetchall()]
            finally:
                connection.close()
        numbered = statement
        for index in range(1, len(parameters) + 1):
            numbered = numbered.replace("?", f"${index}", 1)
        pg = await self.place.connect()
        try:
            return [tuple(row) for row in await pg.fetch(numbered, *parameters)]
        finally:
            await pg.close()

    async def _names(self, item: str) -> list[str]:
        """``item`` and, should it be an operation key, its items at rest in every scope."""
        names = [item]
        if is_token(item):
            scopes = [str(row[0]) for row in await self.sql("SELECT DISTINCT name FROM items")]
            for ring in self.keyrings or [default_keyring()]:
                items = JournalItems(ring)
                for scope in scopes:
                    names.extend(items.candidates(scope, item))
        return list(dict.fromkeys(names))

    async def _where_item(self, item: str) -> tuple[str, list[str]]:
        """``item IN (...)`` over :meth:`_names`, and its parameters."""
        names = await self._names(item)
        return f"item IN ({', '.join('?' * len(names))})", names

    async def journal_item(self, scope: str, key: str) -> str:
        """The item ``key``'s journal row is stored under in ``scope`` (the last keyring's)."""
        return JournalItems(self.keyrings[-1] if self.keyrings else default_keyring()).item(
            scope, key
        )

    def _true(self) -> str:
        return "TRUE" if self.postgres else "1"

    async def envelopes(self) -> list[bytes]:
        return [bytes(row[0]) for row in await self.sql("SELECT envelope FROM items")]

    async def envelope(self, item: str) -> bytes:
        where, names = await self._where_item(item)
        (row,) = await self.sql(f"SELECT envelope FROM items WHERE {where}", *names)
        return bytes(row[0])

    async def set_envelope(self, item: str, envelope: bytes) -> None:
        where, names = await self._where_item(item)
        await self.sql(f"UPDATE items SET envelope = ? WHERE {where}", envelope, *names)

    async def set_revision(self, item: str, revision: int) -> None:
        where, names = await self._where_item(item)
        await self.sql(f"UPDATE items SET revision = ? WHERE {where}", revision, *names)

    async def copy_row(self, item: str, scope: str, *, to_scope: str, to_item: str) -> None:
        """Insert a copy of ``item``'s row of ``scope`` under another scope and key
        (a journal row under ``to_item``'s item at rest there)."""
        where, names = await self._where_item(item)
        ((namespace,),) = await self.sql(
            f"SELECT namespace FROM items WHERE name = ? AND {where}", scope, *names
        )
        if namespace == NS_JOURNAL:
            to_item = await self.journal_item(to_scope, to_item)
        columns = "namespace, name, item, revision, envelope, written_at"
        await self.sql(
            f"INSERT INTO items ({columns}) "
            "SELECT namespace, ?, ?, revision, envelope, written_at FROM items "
            f"WHERE name = ? AND {where}",
            to_scope,
            to_item,
            scope,
            *names,
        )

    async def rename_items(self, namespace: str, to_item: str) -> None:
        await self.sql("UPDATE items SET item = ? WHERE namespace = ?", to_item, namespace)

    async def delete_rows(self, namespace: str) -> None:
        await self.sql("DELETE FROM items WHERE namespace = ?", namespace)

    async def raise_head(self, scope: str) -> None:
        await self.sql("UPDATE heads SET revision = revision + 1 WHERE name = ?", scope)

    async def set_heads(self, *, revision: int, fence: int) -> None:
        await self.sql("UPDATE heads SET revision = ?, fence = ?", revision, fence)

    async def set_head(self, scope: str, keyring: StorageKeyring, **fields: int) -> None:
        """Move a scope head's revision or fence as its key holder would: resealed."""
        ((*row,),) = await self.sql(
            "SELECT revision, fence, row_count, digest, key_id, auth_tag FROM heads WHERE name = ?",
            scope,
        )
        head = ScopeHead.from_row(scope, tuple(row)).sealed(keyring, **fields)
        await self.sql(
            "UPDATE heads SET revision = ?, fence = ?, row_count = ?, digest = ?, key_id = ?, "
            "auth_tag = ? WHERE name = ?",
            *head.row(),
            scope,
        )
        await self.seal_store_head(keyring)

    async def seal_store_head(self, keyring: StorageKeyring) -> None:
        """Rebuild the store head over the scope heads as they are, as the key holder would."""
        heads = await self.sql("SELECT name, fence, revision FROM heads")
        ((revision,),) = await self.sql("SELECT revision FROM store_head")
        digest = digest_of_heads((str(n), int(f), int(r)) for n, f, r in heads)
        store = JournalStoreHead.sealed(keyring, int(revision) + 1, digest)
        await self.sql(
            "UPDATE store_head SET revision = ?, row_count = ?, digest = ?, key_id = ?, "
            "auth_tag = ?",
            *store.row(),
        )

    async def mark_closed(self, item: str, namespace: str | None = None) -> None:
        if namespace is None:
            where, names = await self._where_item(item)
            await self.sql(f"UPDATE items SET closed = {self._true()} WHERE {where}", *names)
        else:
            await self.sql(
                f"UPDATE items SET closed = {self._true()} WHERE item = ? AND namespace = ?",
                item,
                namespace,
            )

    async def closed_rows(self) -> list[tuple[str, str]]:
        rows = await self.sql(
            f"SELECT namespace, item FROM items WHERE closed = {self._true()} ORDER BY 2, 1"
        )
        return [(str(namespace), str(item)) for namespace, item in rows]

    async def set_schema_version(self, version: int) -> None:
        await self.sql("UPDATE schema_version SET version = ?", version)

    async def schema_version(self) -> int:
        ((version,),) = await self.sql("SELECT version FROM schema_version")
        return int(version)

    async def age_rows(self, seconds: float, keyring: StorageKeyring | None = None) -> None:
        """Every row written ``seconds`` earlier, its time sealed again with the key
        (what a journal that old holds: not a tamper)."""
        ring = keyring or (self.keyrings[-1] if self.keyrings else default_keyring())
        rows = await self.sql(
            "SELECT id, name, revision, written_at FROM items WHERE namespace = ?", NS_JOURNAL
        )
        await self.sql("UPDATE items SET written_at = written_at - ?", float(seconds))
        for row_id, name, revision, when in rows:
            earlier = float(when) - float(seconds)
            tag = written_tag(ring, str(name), int(revision), earlier)
            await self.sql("UPDATE items SET written_tag = ? WHERE id = ?", tag, row_id)

    async def set_outbox_session(self, old: str, new: str) -> None:
        await self.sql("UPDATE items SET session = ? WHERE session = ?", new, old)

    async def raw_bytes(self) -> bytes:
        """Every byte the database holds for its rows (the file and its WAL; the tables)."""
        if self.place is None:
            return b"".join(
                Path(str(self.path) + suffix).read_bytes()
                for suffix in ("", "-wal")
                if Path(str(self.path) + suffix).exists()
            )
        rows = await self.sql("SELECT namespace, name, item, envelope, session FROM items")
        return b"".join(
            b"".join(v if isinstance(v, bytes) else str(v).encode() for v in row) for row in rows
        )

    async def ids(self, namespace: str) -> Sequence[int]:
        rows = await self.sql("SELECT id FROM items WHERE namespace = ? ORDER BY id", namespace)
        return [int(row[0]) for row in rows]
