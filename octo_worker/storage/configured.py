"""The journal store a ``worker.toml`` names: SQLite by default, PostgreSQL with ``[storage] url``.

Owns :func:`configured_store`, the one place the daemon and the ``octo-worker``
verbs build their journal store from a configuration: the keyrings, the
SQLite file and its anchor, or the PostgreSQL URL, schema and password
file. It must never read a key or a password itself (the
configuration and the store do, each at its own time) or open the database
(the store's first awaited call does).
"""

from __future__ import annotations

from collections.abc import Callable

from octo_worker.config import WorkerConfig
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.postgres import PostgresJournalStore
from octo_worker.storage.sqlite import SqliteJournalStore

__all__ = ["configured_store"]


def configured_store(
    config: WorkerConfig,
    *,
    read_only: bool = False,
    maintenance: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> JournalStoreBase:
    """The journal store of ``config`` (no I/O beyond reading the key files)."""
    keyring = config.storage_keyring()
    data_keyring = config.data_keyring()
    storage = config.storage
    if storage.url is not None:
        return PostgresJournalStore(
            storage.url,
            keyring,
            password_file=config.storage_password_path,
            schema=storage.schema,
            anchor_path=config.anchor_path,
            data_keyring=data_keyring,
            on_batch=on_batch,
            read_only=read_only,
            maintenance=maintenance,
        )
    return SqliteJournalStore(
        config.journal_path,
        keyring,
        anchor_path=config.anchor_path,
        data_keyring=data_keyring,
        on_batch=on_batch,
        read_only=read_only,
        maintenance=maintenance,
    )
