"""The rollback anchor file, written and read the same way by both stores.

Owns the file handling of an anchor: an atomic replace (``<path>.tmp``
opened without following links, created ``0o600`` and forced to it with
``fchmod``, written whole, fsynced, renamed over ``<path>``, then the
directory fsynced) and a read that refuses a link or anything but a
regular file. The content is built and judged by the stores: the
per-record format of :func:`octo_common.records.encode_anchor` /
``decode_anchor`` (the worker journal), the host ledger's fixed-size head
format in ``octo_host.storage.anchor``.

It must never decide what the anchor holds or when it is written (the
stores do), write anywhere but ``<path>`` and ``<path>.tmp``, or widen a
permission bit.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from octo_common.errors import RollbackAnchorInvalid, RollbackAnchorMissing
from octo_common.records import StorageRecordKey, decode_anchor, encode_anchor

__all__ = [
    "read_anchor",
    "read_anchor_file",
    "write_anchor",
    "write_anchor_file",
]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_anchor_file(path: str | os.PathLike[str], content: bytes) -> None:
    """Replace the file at ``path`` with ``content`` atomically and durably.

    Raises ``OSError`` (a link planted at ``<path>.tmp`` is one: the write
    never follows it); ``<path>`` then still holds its previous content.
    """
    target = Path(os.fspath(path))
    temporary = target.with_name(target.name + ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing .tmp keeps its mode through O_CREAT; never widen
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, target)
    _fsync_directory(target.parent)


def read_anchor_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the anchor file at ``path``.

    ``RollbackAnchorMissing`` when nothing is there; ``RollbackAnchorInvalid``
    when it is a link, not a regular file, or cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise RollbackAnchorMissing() from None
    except OSError as exc:
        raise RollbackAnchorInvalid(f"unreadable: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RollbackAnchorInvalid("not a regular file")
        chunks: list[bytes] = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError as exc:
        raise RollbackAnchorInvalid(f"unreadable: {exc.strerror}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_anchor(path: str | os.PathLike[str]) -> dict[StorageRecordKey, int]:
    """The revisions the anchor file at ``path`` holds (strictly decoded)."""
    return decode_anchor(read_anchor_file(path))


def write_anchor(path: str | os.PathLike[str], revisions: Mapping[StorageRecordKey, int]) -> None:
    """:func:`write_anchor_file` of ``encode_anchor(revisions)``."""
    write_anchor_file(path, encode_anchor(revisions))
