"""The PostgreSQL ledger's sealed store head (the counterpart of ``sqlite_head``'s).

A PostgreSQL ledger schema holds, beside its records, one ``store_head`` row
(``head``: a revision, the digest of every record as (namespace, name,
revision), the seal). :class:`PostgresHeadGuard` is what
``PostgresRecordBackend`` asks:

* **migration** (schema 1 -> 2, ``postgres_sql``): the table is created with
  its row left to be built (digest NULL), and, when the backend is bound to a keyring, that
  row is sealed as such with the storage key (``head.seal_unbuilt``) in the
  migration's transaction (:meth:`migration_step`);
* **open** (O(records), once per pool, every host): in one transaction
  holding the row's lock, a row left to be built is built from the records
  if, and only if, it carries the migration's seal (a digest set to NULL
  without it, or a deleted row, is ``RollbackDetected``); otherwise the
  seal is verified and the digest recomputed over every record must match
  (a record deleted, or put back to an older sealed version with its head
  row, is ``RollbackDetected``);
* **commit** (O(records written)): inside the write transaction, after the
  records' head rows are locked, the store head row is locked, verified,
  moved by the written records, one revision up, and resealed.

Every write transaction of every host sharing the schema takes the store
head's row lock until it commits, so their commits are serialised on it
(each backend's group commit makes that one lock per batch). A store
without a keyring (a bare backend) keeps the head unsealed; a keyed one
refuses an unsealed head. It must never let a write through on a head it
could not authenticate (with a keyring), or put key material in an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from octo_common.errors import OctoError, RevisionExhausted, RollbackDetected
from octo_common.records import StorageKeyring, StorageRecordKey
from octo_common.setdigest import SetDigest
from octo_host.storage.head import LEDGER_ROWS_DOMAIN, StoreHead, seal_unbuilt, verify_unbuilt

__all__ = ["PostgresHeadGuard"]

_SELECT = "SELECT revision, record_count, digest, key_id, auth_tag FROM {s}.store_head"
_UPDATE = (
    "UPDATE {s}.store_head SET revision = $1, record_count = $2, digest = $3, key_id = $4, "
    "auth_tag = $5 WHERE id = 1"
)
_RECORDS = "SELECT namespace, name, revision FROM {s}.items WHERE item = ''"
_SEAL_UNBUILT = (
    "UPDATE {s}.store_head SET key_id = $1, auth_tag = $2 WHERE id = 1 AND digest IS NULL"
)

# One record written by a transaction: its key, its revision before (None:
# absent) and after.
Change = tuple[StorageRecordKey, int | None, int]


class PostgresHeadGuard:
    """The store head of one ledger schema (see the module docstring)."""

    def __init__(self, schema: str, ceiling: int) -> None:
        self._quoted = f'"{schema}"'
        self._ceiling = ceiling
        self.keyring: StorageKeyring | None = None

    def bind(self, keyring: StorageKeyring) -> None:
        if self.keyring is not None and self.keyring is not keyring:
            raise ValueError("this backend already seals its head with another keyring")
        self.keyring = keyring

    def _sql(self, text: str) -> str:
        return text.format(s=self._quoted)

    def migration_step(self) -> Callable[[Any, str], Awaitable[None]]:
        """The step after :data:`HEAD_MIGRATION`: its row sealed as "to be built"."""

        async def seal(connection: Any, _quoted: str) -> None:
            if self.keyring is not None:
                await connection.execute(self._sql(_SEAL_UNBUILT), *seal_unbuilt(self.keyring))

        return seal

    async def _locked(self, connection: Any) -> StoreHead | tuple[object, object]:
        """The head row under its lock: a head, or (key_id, tag) of a row to be built."""
        rows = await connection.fetch(self._sql(_SELECT) + " FOR UPDATE")
        if len(rows) != 1:
            raise RollbackDetected(None, 0)  # the head row was deleted
        row = tuple(rows[0])
        if row[2] is None:
            return row[3], row[4]
        value = row[2]
        return StoreHead.from_row((row[0], row[1], bytes(value), row[3], row[4]))

    async def open(self, connection: Any) -> StoreHead:
        """The open check (and the build of a head left to be built), in one transaction."""
        async with connection.transaction():
            stored = await self._locked(connection)
            records = [
                (str(namespace), str(name), int(revision))
                for namespace, name, revision in await connection.fetch(self._sql(_RECORDS))
            ]
            computed = SetDigest.of(LEDGER_ROWS_DOMAIN, records)
            if not isinstance(stored, StoreHead):
                if self.keyring is not None:
                    # Only the migration's own sealed record says "to be built".
                    key_id, tag = stored
                    try:
                        verify_unbuilt(
                            self.keyring,
                            key_id if isinstance(key_id, str) else None,
                            tag if isinstance(tag, str) else None,
                        )
                    except OctoError:
                        raise RollbackDetected(None, 0) from None
                head = StoreHead(0, computed).sealed_with(self.keyring)
                await connection.execute(self._sql(_UPDATE), *head.row())
                return head
            if self.keyring is not None:
                stored.verify(self.keyring)
            if stored.digest != computed:
                raise RollbackDetected(None, stored.revision)
            return stored

    async def seal(self, connection: Any, changes: Sequence[Change]) -> None:
        """Move the head by ``changes`` and reseal it, inside the write transaction."""
        if not changes:
            return
        stored = await self._locked(connection)
        if not isinstance(stored, StoreHead):
            raise RollbackDetected(None, 0)  # never built: no open of this backend built it
        if self.keyring is not None:
            stored.verify(self.keyring)
        if stored.revision >= self._ceiling:
            raise RevisionExhausted()
        digest = stored.digest.copy()
        try:
            for key, old, new in changes:
                digest.replace(key.namespace, key.name, old, new)
        except ValueError:
            raise RollbackDetected(None, stored.revision) from None
        head = StoreHead(stored.revision + 1, digest).sealed_with(self.keyring)
        await connection.execute(self._sql(_UPDATE), *head.row())
