"""The SQLite database thread and schema migration both stores share.

Owns :class:`DatabaseThread`: one dedicated daemon thread that owns a
database connection and runs the work handed to it, in submission order,
in batches: whatever waits when the thread wakes is handed to the store's
``run_batch`` together, which is where a store puts its group commit (the
host's ledger backend groups the writes of a batch into one transaction;
the worker journal hands over one prepared batch at a time and runs each
item with :func:`run_each`). Each outcome goes back to the event loop of
the caller that submitted it, with one wake-up per loop per batch. Also
owns :func:`migrate_schema` (forward migrations under a ``schema_version``
table, SQL statements or functions run in the migration's transaction),
:func:`prepare_database_files` (how both stores create and secure their
database files: directory ``0o700``, database, ``-wal`` and ``-shm``
``0o600``, never through a link; :func:`check_database_files` once a
connection is open) and :func:`copy_error`.

It must never interpret what it runs: it does not know SQL, records or
keys, and never logs. A failure of ``run_batch`` itself fails every item of
that batch and leaves the thread serving the next one. It must never follow
a link to a database file or change the mode of anything reached through one.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import queue
import sqlite3
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

from octo_common.errors import OctoError, StorageBackendError
from octo_common.runtime.groupcommit import resolve_outcome

__all__ = [
    "DatabaseThread",
    "MigrationStep",
    "Outcome",
    "copy_error",
    "migrate_schema",
    "check_database_files",
    "prepare_database_files",
    "roll_back",
    "run_each",
]

W = TypeVar("W")
T = TypeVar("T")

Outcome = tuple[bool, Any]
"""``(True, value)`` or ``(False, exception)``: one item's result."""

_Callback = Callable[[Outcome], None]
_Job = tuple[W, _Callback, asyncio.AbstractEventLoop]


def copy_error(error: OctoError) -> OctoError:
    """A fresh instance of ``error`` (each caller of a failed batch gets its own)."""
    rebuild, arguments = error.__reduce__()[:2]
    copy = rebuild(*arguments)
    assert isinstance(copy, OctoError)
    return copy


def run_each(batch: Sequence[Callable[[], Any]]) -> list[Outcome]:
    """The plain ``run_batch``: call each function in order; each keeps its own outcome."""
    outcomes: list[Outcome] = []
    for function in batch:
        try:
            outcomes.append((True, function()))
        except BaseException as exc:  # delivered to the awaiting caller
            outcomes.append((False, exc))
    return outcomes


class DatabaseThread(Generic[W]):
    """One dedicated thread: work in, outcomes back to each caller's event loop.

    ``DatabaseThread(name, run_batch)`` does nothing until the first
    submission starts the thread (a daemon, so that a store nobody closed
    never holds the process open). ``run_batch(items)`` runs in the thread
    and returns one :data:`Outcome` per item, in order. A bare
    ``SimpleQueue`` plus ``call_soon_threadsafe`` costs half of a
    ``run_in_executor`` round trip on the machines measured.

    Submissions, the thread's start and :meth:`close` are ordered by one
    lock, so event loops in several threads may share one thread. After
    :meth:`close`, a submission raises ``StorageBackendError("store is
    closed")``; the work queued before it still runs.
    """

    def __init__(self, name: str, run_batch: Callable[[list[W]], Sequence[Outcome]]) -> None:
        self._name = name
        self._run_batch = run_batch
        self._inbox: queue.SimpleQueue[_Job[W] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stopped = threading.Event()  # set once the thread has run its last batch

    @property
    def closed(self) -> bool:
        return self._closed

    # Submitting (event loop) --------------------------------------------------------

    def call(self, work: W, callback: _Callback) -> None:
        """Queue ``work``; ``callback((ok, value))`` later runs on the calling loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed:
                raise StorageBackendError("store is closed")
            if self._thread is None:
                self._start()
            self._inbox.put((work, callback, loop))

    def submit(self, work: W) -> asyncio.Future[Any]:
        """Queue ``work``; the returned future resolves on the calling loop.

        The work runs even if the caller stops waiting (its outcome is then
        dropped).
        """
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.call(work, functools.partial(resolve_outcome, future))
        return future

    def close(self, last: W | None = None) -> asyncio.Future[Any] | None:
        """Refuse further work; the thread ends after what is queued (and ``last``).

        Returns the future of ``last`` when this call closed a running
        thread and ``last`` was given; otherwise None (already closed, or the
        thread never started and there is nothing to run). Idempotent.
        """
        loop = asyncio.get_running_loop() if last is not None else None
        with self._lock:
            if self._closed:
                return None
            self._closed = True
            if self._thread is None:
                self._stopped.set()
                return None
            future: asyncio.Future[Any] | None = None
            if last is not None and loop is not None:
                future = loop.create_future()
                self._inbox.put((last, functools.partial(resolve_outcome, future), loop))
            self._inbox.put(None)
            return future

    async def wait_closed(self, timeout: float = 30.0) -> None:
        """Return once the thread has run its last batch (at once if it never started)."""
        if not self._stopped.is_set():
            # Without blocking this loop (close may have run on another one).
            await asyncio.to_thread(self._stopped.wait, timeout)

    def _start(self) -> None:
        """Start the thread on the first submission (``_lock`` held)."""
        thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: fail this call, retry the next
            raise StorageBackendError("cannot start the database thread") from exc
        self._thread = thread

    # The thread ---------------------------------------------------------------------

    def _serve(self) -> None:
        inbox = self._inbox
        while True:
            jobs: list[_Job[W]] = []
            stop = False
            item = inbox.get()
            while True:
                if item is None:
                    stop = True  # close() queues nothing after the stop mark
                    break
                jobs.append(item)
                if inbox.empty():
                    break
                item = inbox.get()
            if jobs:
                self._run(jobs)
            if stop:
                self._stopped.set()
                return

    def _run(self, jobs: list[_Job[W]]) -> None:
        try:
            outcomes = self._run_batch([work for work, _, _ in jobs])
            if len(outcomes) != len(jobs):
                raise RuntimeError("run_batch returned the wrong number of outcomes")
        except BaseException as exc:  # a defect must not strand every later caller
            outcomes = [(False, exc)] * len(jobs)
        if len(jobs) == 1:
            _, callback, loop = jobs[0]
            try:
                loop.call_soon_threadsafe(callback, outcomes[0])
            except RuntimeError:  # the loop is gone: nobody waits any more
                pass
            return
        _deliver(jobs, outcomes)


def _deliver(jobs: Sequence[_Job[Any]], outcomes: Sequence[Outcome]) -> None:
    """Hand the outcomes of several jobs to their loops: one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Callback, Outcome]]] = {}
    shared: set[int] = set()
    for (_, callback, loop), (ok, value) in zip(jobs, outcomes, strict=True):
        delivered = value
        if not ok and isinstance(value, OctoError):
            # One instance per caller, so tracebacks do not mix.
            if id(value) in shared:
                delivered = copy_error(value)
            shared.add(id(value))
        by_loop.setdefault(loop, []).append((callback, (ok, delivered)))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            if len(items) == 1:
                callback, outcome = items[0]
                loop.call_soon_threadsafe(callback, outcome)
            else:
                loop.call_soon_threadsafe(_call_each, loop, items)


def _call_each(loop: asyncio.AbstractEventLoop, items: list[tuple[_Callback, Outcome]]) -> None:
    for callback, outcome in items:
        try:
            callback(outcome)
        except Exception as exc:  # one caller's defect must not keep the others waiting
            loop.call_exception_handler(
                {"message": "database thread callback failed", "exception": exc}
            )


# Schema migration -----------------------------------------------------------------------


MigrationStep = str | Callable[[sqlite3.Connection], None]
"""One step of a migration: an SQL statement, or a function run on the connection
inside the migration's transaction (to build what SQL alone cannot)."""


def migrate_schema(
    connection: sqlite3.Connection, migrations: Sequence[Sequence[MigrationStep]]
) -> int:
    """Bring the schema to version ``len(migrations)`` in one ``BEGIN IMMEDIATE``;
    return the version the database had before (0 for a new one).

    ``migrations[i]`` holds the steps that move version ``i`` to ``i + 1``.
    The version lives in ``schema_version`` (one row). A newer version than
    this code knows, or a malformed version table, raises
    ``StorageBackendError``; any failure rolls the whole migration back.
    """
    target = len(migrations)
    connection.execute("BEGIN IMMEDIATE")
    try:
        connection.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        rows = connection.execute("SELECT version FROM schema_version").fetchall()
        if len(rows) > 1 or (rows and type(rows[0][0]) is not int):
            raise StorageBackendError("open: malformed schema_version table")
        version: int = rows[0][0] if rows else 0
        if version > target:
            raise StorageBackendError(f"open: schema version {version} is newer than supported")
        for steps in migrations[version:]:
            for step in steps:
                if isinstance(step, str):
                    connection.execute(step)
                else:
                    step(connection)
        if not rows:
            connection.execute("INSERT INTO schema_version (version) VALUES (?)", (target,))
        elif version != target:
            connection.execute("UPDATE schema_version SET version = ?", (target,))
        connection.execute("COMMIT")
    except BaseException:
        roll_back(connection)
        raise
    return version


def roll_back(connection: sqlite3.Connection) -> None:
    """Undo an open transaction after a failure (the failure is what gets reported)."""
    if connection.in_transaction:
        with contextlib.suppress(sqlite3.Error):
            connection.execute("ROLLBACK")


# Database files ------------------------------------------------------------------------

_NO_LINK: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def prepare_database_files(database: Path) -> int | None:
    """Create and secure a database's files before this process's connection opens them.

    The directory is created (with its parents) when absent and forced to
    ``0o700``. The database file is created when absent (``O_CREAT | O_EXCL
    | O_NOFOLLOW``, then ``fchmod`` ``0o600``, whatever the umask). The
    database and any ``-wal`` / ``-shm`` beside it must be regular files
    (a link planted at any of these paths is refused with
    ``StorageBackendError``, never followed); one with another mode is
    forced to ``0o600`` by ``fchmod`` on a descriptor opened without
    following a link. SQLite then creates its side files with the
    database's mode. Returns the mode of an existing directory that gives
    group or others any access (the caller warns), else None. ``OSError``
    for what the system refuses.

    A descriptor is opened only to create or repair a file: closing a
    descriptor of a database file drops every POSIX lock this process holds
    on it, SQLite's included, so a database another connection of this
    process has open is left alone when its files are already right.
    """
    directory = database.parent
    loose: int | None = None
    if not os.path.lexists(directory):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _force_mode(directory, 0o700, directory=True)
    else:
        mode = stat.S_IMODE(directory.stat().st_mode)
        if mode & 0o077:
            loose = mode
    try:
        fd = os.open(database, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_LINK, 0o600)
    except FileExistsError:
        pass
    else:
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        try:
            _force_mode(path, 0o600, directory=False)
        except FileNotFoundError:
            if path == database:
                raise
    return loose


def check_database_files(database: Path) -> None:
    """Once a connection is open: the database and its side files are regular files
    of mode ``0o600`` (``StorageBackendError`` otherwise). Never opens a descriptor."""
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise StorageBackendError("database path is not a regular file")
        if stat.S_IMODE(info.st_mode) != 0o600:
            raise StorageBackendError("database file permissions are not 0600")


def _force_mode(path: Path, mode: int, *, directory: bool) -> None:
    """``path`` must be a directory / regular file (never a link); give it ``mode``
    through a descriptor that did not follow a link, only when it has another."""
    what = "database directory" if directory else "database path"
    info = os.lstat(path)  # FileNotFoundError: the caller decides
    if stat.S_ISLNK(info.st_mode):
        raise StorageBackendError(f"{what} is a symbolic link")
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        raise StorageBackendError(f"{what} is not a {'directory' if directory else 'regular file'}")
    if stat.S_IMODE(info.st_mode) == mode:
        return
    flags = (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY
    try:
        fd = os.open(path, flags | _NO_LINK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # replaced since the lstat
            raise StorageBackendError(f"{what} changed while it was secured") from None
        raise
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            raise StorageBackendError(f"{what} changed while it was secured")
        os.fchmod(fd, mode)
        if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
            raise StorageBackendError(f"{what} permissions could not be set")
    finally:
        os.close(fd)
