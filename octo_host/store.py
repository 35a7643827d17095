"""The public import path of the host's storage.

The code lives in :mod:`octo_host.storage`, one module per part:

* :mod:`~octo_host.storage.contract`: the backend contract and the
  compare-and-swap and fence rules every backend shares;
* :mod:`~octo_host.storage.authenticated`: ``AuthenticatedStore``
  and ``ledger_record_key``;
* :mod:`~octo_host.storage.memory`: ``VolatileMemoryStore``;
* :mod:`~octo_host.storage.sqlite`: ``SqliteRecordBackend`` and
  ``SqliteLedgerStore``;
* :mod:`~octo_host.storage.anchor`, :mod:`~octo_host.storage.head` and
  :mod:`~octo_host.storage.sqlite_head`: the rollback anchor and
  the sealed store head it checks;
* :mod:`~octo_host.storage.postgres`: ``PostgresRecordBackend`` and
  ``PostgresLedgerStore``, with its SQL and connection settings beside
  it (not re-exported here: importing this module never loads the PostgreSQL
  driver).

This module only re-exports; it must never hold code of its own.
"""

from __future__ import annotations

from octo_common.runtime.keyfiles import read_storage_key as load_storage_key
from octo_host.storage.anchor import initialise_anchor
from octo_host.storage.authenticated import LEDGER_NAMESPACE, AuthenticatedStore, ledger_record_key
from octo_host.storage.contract import RecordBackend
from octo_host.storage.memory import VolatileMemoryStore
from octo_host.storage.sqlite import SqliteLedgerStore, SqliteRecordBackend

__all__ = [
    "LEDGER_NAMESPACE",
    "AuthenticatedStore",
    "RecordBackend",
    "SqliteLedgerStore",
    "SqliteRecordBackend",
    "VolatileMemoryStore",
    "initialise_anchor",
    "ledger_record_key",
    "load_storage_key",
]
