"""The worker's journal store under the names the protocol gives it.

``octo_worker.store`` is where callers find :class:`SqliteJournalStore` and
the commit value types; they live in :mod:`octo_worker.storage` (the
interface a session and the daemon use, the documents every backend keeps,
and the SQLite backend). This module holds nothing of its own.
"""

from __future__ import annotations

from octo_worker.storage.documents import NS_JOURNAL, NS_OUTBOX, NS_SESSION, NS_SESSION_OPEN
from octo_worker.storage.interface import (
    OutboxEntry,
    PersistedSession,
    PruneReport,
    ResealReport,
    ScopeMetadata,
    SessionDocuments,
    WorkerCommit,
    WorkerJournalLease,
)
from octo_worker.storage.sqlite import SqliteJournalStore, StoreStats

__all__ = [
    "NS_JOURNAL",
    "NS_OUTBOX",
    "NS_SESSION",
    "NS_SESSION_OPEN",
    "OutboxEntry",
    "PersistedSession",
    "PruneReport",
    "ResealReport",
    "ScopeMetadata",
    "SessionDocuments",
    "SqliteJournalStore",
    "StoreStats",
    "WorkerCommit",
    "WorkerJournalLease",
]
