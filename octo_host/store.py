"""The public import path of the host's storage (PROTOCOL.md §2.3, H§17).

The code lives in :mod:`octo_host.storage`, one module per part:

* :mod:`~octo_host.storage.contract`: the backend contract (H§17.3) and the
  compare-and-swap and fence rules every backend shares;
* :mod:`~octo_host.storage.authenticated`: ``AuthenticatedStore``
  (H§17.4-17.5) and ``ledger_record_key``;
* :mod:`~octo_host.storage.memory`: ``VolatileMemoryStore`` (H§17.6);
* :mod:`~octo_host.storage.sqlite`: ``SqliteRecordBackend`` and
  ``SqliteLedgerStore`` (H§17.7);
* :mod:`~octo_host.storage.anchor`, :mod:`~octo_host.storage.head` and
  :mod:`~octo_host.storage.sqlite_head`: the rollback anchor (H§17.10) and
  the sealed store head it checks (issue 21);
* :mod:`~octo_host.storage.postgres`: ``PostgresRecordBackend`` and
  ``PostgresLedgerStore`` (D13), with its SQL and connection settings beside
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
