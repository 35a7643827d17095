"""The rollback anchor of a shared (PostgreSQL) journal: a file every worker of it sees.

A journal's store head (``store_head``) catches a scope deleted or put back
whole, but not the whole database put back to an earlier copy (every scope
head and the store head together). The anchor is what does: a file outside
the database, on storage every worker of the journal mounts (for example
an NFS or cluster file system), holding the highest store head revision
any of them committed. :class:`StoreAnchor` owns it:

* **written** after every transaction that moved the store head (a fence
  reservation, a commit batch) has committed, once per transaction, by the
  worker that committed it: under a lock of its own process (POSIX locks
  do not exclude the threads of one process) and an exclusive POSIX lock of
  ``<path>.lock`` (``lockf``, which network file systems honour across
  machines) it reads
  the file, keeps the larger of what it holds and the revision committed,
  and replaces the file atomically (``anchorfile``). So the value never goes
  down, whichever worker writes last.
* **read** before every check of the store head (each scope load, every
  start, ``journal verify``), before the read snapshot begins: the
  database's store head revision must not be below it, else
  ``RollbackDetected``. Read before the snapshot, the anchor is never newer
  than what that snapshot can see (it is only ever written after a commit).

The window that remains: a transaction whose anchor write has not happened
yet (between its commit and its anchor write, or whose write failed: its
callers are then told the commit failed) is not anchored, so a copy of the
database that lacks only such transactions restores unnoticed, and a
database restored together with the anchor file is not caught by anything.
A missing anchor file fails every open (``RollbackAnchorMissing``) until
``octo-worker journal init-anchor`` writes it from the database as it is.

It must never lower the anchored revision, write the file outside its lock,
or put a path's content or a key in an error.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Final

from octo_common.errors import RollbackDetected
from octo_common.records import StorageRecordKey
from octo_common.runtime.anchorfile import read_anchor, write_anchor

__all__ = ["STORE_ANCHOR_NAMESPACE", "StoreAnchor"]

STORE_ANCHOR_NAMESPACE: Final = "worker-journal-store"


class StoreAnchor:
    """The anchor file of one shared journal (one database schema); blocking file I/O."""

    __slots__ = ("_key", "_lock_path", "_writing", "path")

    def __init__(self, path: str | os.PathLike[str], schema: str) -> None:
        self.path = Path(os.fspath(path))
        # Two commits' anchor writes may run at once on the threads of one
        # process, which one POSIX lock does not keep apart.
        self._writing = threading.Lock()
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._key = StorageRecordKey(STORE_ANCHOR_NAMESPACE, schema)

    def read(self) -> int:
        """The anchored store head revision (0: the file anchors no revision of this
        schema yet); ``RollbackAnchorMissing`` / ``RollbackAnchorInvalid`` as the file's."""
        return read_anchor(self.path).get(self._key, 0)

    def check(self, revision: int, anchored: int) -> None:
        """A store head at ``revision``, read after ``anchored`` was: never below it."""
        if revision < anchored:
            raise RollbackDetected(revision, anchored)

    def advance(self, revision: int) -> None:
        """Raise the anchored revision to ``revision`` (never lower it), under the lock."""
        self._locked_write(revision, keep_higher=True)

    def initialize(self, revision: int) -> None:
        """Anchor exactly ``revision`` (an operator's explicit step), under the lock."""
        self._locked_write(revision, keep_higher=False)

    def _locked_write(self, revision: int, *, keep_higher: bool) -> None:
        with self._writing:
            self._write_between_processes(revision, keep_higher=keep_higher)

    def _write_between_processes(self, revision: int, *, keep_higher: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self._lock_path, flags, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            # An advance needs the file (a missing one is refused, never recreated).
            exists = keep_higher or self.path.exists()
            anchored = read_anchor(self.path) if exists else {}
            current = anchored.get(self._key, 0)
            if keep_higher and current >= revision:
                return
            anchored[self._key] = revision
            write_anchor(self.path, anchored)
        finally:
            os.close(fd)  # releases the lock
