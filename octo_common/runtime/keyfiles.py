"""Key and secret files named by a worker or host configuration.

Owns the translation of the one file rule (:mod:`octo_common.keyfile`) into
configuration errors that name the configuration key
(``scopes[0].key_file: keys/a.key does not exist``), the reading of a
short secret (a broker password file), and the storage-key reader of the
host's ledger store.

It must never put key bytes or a password into an error, a log or a
return value other than the key object itself (whose repr is redacted).
"""

from __future__ import annotations

import itertools
import os
import secrets
from pathlib import Path
from typing import Final

import blake3

from octo_common.errors import (
    InvalidConfiguration,
    InvalidScopeKey,
    InvalidStorageKey,
    KeyDirectoryWritable,
    KeyFileNotOwned,
    KeySharedBetweenRoles,
    WeakKey,
)
from octo_common.frames import ScopeKey
from octo_common.keyfile import KeyFileRefused, read_key_file, read_private_file
from octo_common.records import StorageKey

__all__ = [
    "KeyRoles",
    "key_weakness",
    "load_key_file",
    "load_scope_key",
    "load_storage_key",
    "read_secret_text",
    "read_storage_key",
    "refused_file",
]

_SECRET_TEXT_LIMIT: Final = 4096
# Fewer distinct byte values than this in 32 bytes is a pattern, not chance:
# 32 random bytes show about 30 (fewer than 16 has odds below 2**-40).
_MIN_DISTINCT_BYTES: Final = 16


def refused_file(refused: KeyFileRefused, where: str) -> InvalidConfiguration:
    """The configuration error of a refused file, with the code of its reason."""
    detail = f"{where}: {refused}"
    if refused.reason == "owner":
        return KeyFileNotOwned(detail)
    if refused.reason == "directory":
        return KeyDirectoryWritable(detail)
    return InvalidConfiguration(detail)


def key_weakness(key: bytes) -> str | None:
    """What makes ``key`` guessable (all zero, one repeated byte, too few
    distinct bytes, an arithmetic run such as 00 01 02 ...), or None."""
    if key == bytes(len(key)):
        return "all zero"
    if len(set(key)) == 1:
        return "one repeated byte"
    steps = {(b - a) % 256 for a, b in itertools.pairwise(key)}
    if len(steps) == 1:
        return "a run of evenly spaced bytes"
    if len(set(key)) < _MIN_DISTINCT_BYTES:
        return f"fewer than {_MIN_DISTINCT_BYTES} distinct byte values"
    return None


def load_key_file(path: Path, where: str) -> bytes:
    """32 raw bytes or 64 lowercase hex (+ optional newline) from a private file.

    Every refusal is ``InvalidConfiguration`` starting with ``where`` (a
    file not owned by this user ``KeyFileNotOwned``, one in a directory
    others may write ``KeyDirectoryWritable``, a guessable key ``WeakKey``).
    """
    try:
        key = read_key_file(path)
    except KeyFileRefused as refused:
        raise refused_file(refused, where) from None
    weakness = key_weakness(key)
    if weakness is not None:
        raise WeakKey(f"{where}: {path} holds a guessable key ({weakness}); generate a random one")
    return key


def load_scope_key(path: Path, where: str) -> ScopeKey:
    """A tenant scope key from a key file; a weak key is refused too."""
    data = load_key_file(path, where)
    try:
        return ScopeKey.from_bytes(data)
    except InvalidScopeKey as exc:
        raise InvalidConfiguration(f"{where}: {path}: scope key is {exc.reason}") from None


def load_storage_key(path: Path, where: str) -> StorageKey:
    """A storage (journal, ledger or data) key from a key file."""
    return StorageKey(load_key_file(path, where))


class KeyRoles:
    """One key per role: a key file, or a key's bytes, serves one role only.

    A role is what a key is for (``scope tenant-a``, ``storage``, ``data``):
    a key that both authenticates frames and encrypts rows, or two tenants'
    scopes, would let one use stand for the other. Keys are compared by a
    keyed digest under a key of this object's own, never kept.
    """

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        self._by_digest: dict[bytes, tuple[str, str]] = {}
        self._by_file: dict[tuple[int, int], tuple[str, str]] = {}

    def add(self, role: str, where: str, path: Path) -> None:
        """Read the key at ``path`` (``where`` in errors) for ``role``; refuse a second role."""
        key = load_key_file(path, where)
        digest = blake3.blake3(key, key=self._secret).digest()
        try:
            info = os.stat(path)
        except OSError:  # read a moment ago; gone now: the next read says so
            identity = None
        else:
            identity = (info.st_dev, info.st_ino)
        for seen in (
            self._by_digest.get(digest),
            None if identity is None else self._by_file.get(identity),
        ):
            if seen is not None and seen[0] != role:
                raise KeySharedBetweenRoles(
                    f"{where}: {path} is the key of {seen[1]} too ({seen[0]});"
                    f" each role needs a key of its own"
                )
        self._by_digest.setdefault(digest, (role, where))
        if identity is not None:
            self._by_file.setdefault(identity, (role, where))


def read_secret_text(path: Path, where: str) -> str:
    """A short UTF-8 secret (a broker password) from a private file, stripped."""
    try:
        content = read_private_file(path, _SECRET_TEXT_LIMIT)
    except KeyFileRefused as refused:
        raise refused_file(refused, where) from None
    try:
        return content.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidConfiguration(f"{where}: {path} is not UTF-8 text") from None


# KeyFileRefused.reason -> the note of InvalidStorageKey.
_STORAGE_KEY_NOTES: Final[dict[str, str]] = {
    "missing": "unreadable",
    "unopenable": "unreadable",
    "unreadable": "unreadable",
    "not_regular": "permissions",
    "permissions": "permissions",
    "owner": "permissions",
    "directory": "permissions",
    "format": "format",
}


def read_storage_key(path: str | os.PathLike[str]) -> StorageKey:
    """A 32-byte storage key from a key file, for callers without a configuration.

    Every refusal is ``InvalidStorageKey`` with the note ``storage key file:
    unreadable`` (absent, a link, not readable), ``permissions`` (not a
    regular file, or open to group or others) or ``format``; never the
    content.
    """
    try:
        return StorageKey(read_key_file(path))
    except KeyFileRefused as refused:
        error = InvalidStorageKey()
        error.add_note(f"storage key file: {_STORAGE_KEY_NOTES[refused.reason]}")
        raise error from None
