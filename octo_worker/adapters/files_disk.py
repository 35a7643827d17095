"""The files of ``files.publish`` on disk: crash-safe writes, effect-log lines, operation locks.

Owns the primitives :mod:`octo_worker.adapters.files` builds on: a new file
written and fsynced (:func:`write_new_file`), an atomic replacement
(:func:`replace_file`), one fsynced ``O_APPEND`` line of the effect log
(:func:`append_line`), an effect line's place reserved at the end of the log
(:func:`reserve_line`) and the line written over its reservation
(:func:`fill_line`), the reading of one line at an offset (:func:`line_at`)
or of the whole log for tests and operators (:func:`read_effect_log`), and
the cross-process lock of one operation (:func:`operation_lock`).

Two worker processes may share the adapter's ``target_dir`` (the owner
of a scope and the standby that takes it over, and for a while the
superseded owner too, paused and then woken up). :func:`operation_lock`
makes each operation's record (its publication, its removal and both
lookups) the work of one process at a time: an ``flock`` on
``.octo-publish/lock.<idempotency key>``, taken without waiting. A lock held
elsewhere means another live process is in the middle of this very
operation: the call answers ``AdapterIndeterminate`` (nothing done; the host
reconciles later), never a guess about what that process will do. The
kernel drops the lock of a process that dies, so a SIGKILL leaves none.

It must never wait for a lock (a paused holder would stall the adapter's
single file thread), delete a lock file (a waiter could then lock a file
nobody else sees) or read the whole log on an adapter path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from octo_common.errors import AdapterIndeterminate

__all__ = [
    "MAX_LINE",
    "TMP_PREFIX",
    "append_line",
    "fill_line",
    "fsync_dir",
    "line_at",
    "operation_lock",
    "read_effect_log",
    "replace_file",
    "reserve_line",
    "sha256_of",
    "write_new_file",
]

TMP_PREFIX: Final = ".octo-tmp."
# One effect line is well under this (names and keys are at most 128 bytes).
MAX_LINE: Final = 4096
_LOCK_PREFIX: Final = "lock."


@contextlib.contextmanager
def operation_lock(meta_dir: Path, idempotency_key: str) -> Iterator[None]:
    """Hold the lock of one operation (by its 64-hex idempotency key) for the block."""
    fd = os.open(
        meta_dir / f"{_LOCK_PREFIX}{idempotency_key}",
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AdapterIndeterminate(
                "another process is working on this operation's publication"
            ) from None
        yield
    finally:
        os.close(fd)  # releases the lock


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (temp, fsync, rename, fsync dir)."""
    tmp = path.parent / f"{TMP_PREFIX}{secrets.token_hex(8)}"
    try:
        write_new_file(tmp, data, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def sha256_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def append_line(path: Path, line: bytes) -> None:
    """Append one line with ``O_APPEND`` and fsync (the directory too when created)."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)


def reserve_line(path: Path, placeholder: bytes) -> int:
    """Append ``placeholder`` (one line, not JSON) with ``O_APPEND``; return its offset.

    The place of an effect's line, taken before the effect: whoever appends
    meanwhile (another process sharing the log) appends after it, and the
    line is later written over it (:func:`fill_line`). Not fsynced: a
    reservation a power cut loses is found missing by :func:`fill_line`.
    """
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        written = os.write(fd, placeholder)
        end = os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
    if written != len(placeholder):
        raise OSError(errno.EIO, "short write to the effect log")
    if created:
        fsync_dir(path.parent)
    return end - written


def fill_line(path: Path, offset: int, line: bytes, placeholder: bytes) -> None:
    """Make ``line`` (as long as ``placeholder``) stand once in the log, at ``offset``.

    Already there: nothing is written. Its reservation ``placeholder`` there
    (it names one effect only): the line is written over it and fsynced.
    Anything else there (a power cut lost the reservation, and the log grew
    again over its place): the line is appended, since it was written
    nowhere else.
    """
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        append_line(path, line)
        return
    try:
        found = os.pread(fd, len(line), offset)
        if found == line:
            return
        if found == placeholder:
            if os.pwrite(fd, line, offset) != len(line):
                raise OSError(errno.EIO, "short write to the effect log")
            os.fsync(fd)
            return
    finally:
        os.close(fd)
    append_line(path, line)


def line_at(path: Path, offset: int) -> dict[str, Any] | None:
    """The complete JSON line starting at ``offset`` of the log, or None."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read(MAX_LINE)
    except FileNotFoundError:
        return None
    line, newline, _ = chunk.partition(b"\n")
    if not newline:
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def read_effect_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every effect line of an effect log, oldest first (a missing log is empty).

    A line that is not a complete JSON object is skipped: the reservation of
    an effect's line (``#<effect> <key>`` and spaces) not written yet, or
    never (the effect did not happen), or a torn write of an effect that was
    never reported as done (a power cut inside a write); the adapter writes
    the line when it meets the effect's record.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    entries = []
    for line in data.split(b"\n")[:-1]:  # the part after the last newline is empty or torn
        try:
            entry = json.loads(line) if line else None
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries
