"""Key and secret files named by a worker or host configuration (W§7.1, H§17.1).

Owns the translation of the one file rule (:mod:`octo_common.keyfile`) into
configuration errors that name the configuration key
(``scopes[0].key_file: keys/a.key does not exist``), the reading of a
short secret (a broker password file), and the storage-key reader of the
host's ledger store.

It must never put key bytes or a password into an error, a log or a
return value other than the key object itself (whose repr is redacted).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from octo_common.errors import InvalidConfiguration, InvalidScopeKey, InvalidStorageKey
from octo_common.frames import ScopeKey
from octo_common.keyfile import KeyFileRefused, read_key_file, read_private_file
from octo_common.records import StorageKey

__all__ = [
    "load_key_file",
    "load_scope_key",
    "load_storage_key",
    "read_secret_text",
    "read_storage_key",
]

_SECRET_TEXT_LIMIT: Final = 4096


def load_key_file(path: Path, where: str) -> bytes:
    """32 raw bytes or 64 lowercase hex (+ optional newline) from a private file.

    Every refusal is ``InvalidConfiguration`` starting with ``where``.
    """
    try:
        return read_key_file(path)
    except KeyFileRefused as refused:
        raise InvalidConfiguration(f"{where}: {refused}") from None


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


def read_secret_text(path: Path, where: str) -> str:
    """A short UTF-8 secret (a broker password) from a private file, stripped."""
    try:
        content = read_private_file(path, _SECRET_TEXT_LIMIT)
    except KeyFileRefused as refused:
        raise InvalidConfiguration(f"{where}: {refused}") from None
    try:
        return content.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise InvalidConfiguration(f"{where}: {path} is not UTF-8 text") from None


# KeyFileRefused.reason -> the note of InvalidStorageKey (H§17.1).
_STORAGE_KEY_NOTES: Final[dict[str, str]] = {
    "missing": "unreadable",
    "unopenable": "unreadable",
    "unreadable": "unreadable",
    "not_regular": "permissions",
    "permissions": "permissions",
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
