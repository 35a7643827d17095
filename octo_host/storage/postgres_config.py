"""How the PostgreSQL ledger backend is reached: its URL, schema name and password file.

This module owns the checks of the ``[storage]`` values a backend is built
from: a ``postgresql://`` URL that never carries a password, a schema name
safe to quote into SQL, and the password read from a private file (the one
private-file rule of :mod:`octo_common.keyfile`), plus the URL as it may be
shown.

It must never log, return or raise a password or a file's content, and
never accept a URL with a password in it.
"""

from __future__ import annotations

import os
import re
import urllib.parse

from octo_common.errors import StorageBackendError
from octo_common.keyfile import KeyFileRefused, read_private_file

__all__ = ["DEFAULT_SCHEMA", "check_schema", "check_url", "read_password_file", "redacted_url"]

DEFAULT_SCHEMA = "octo_ledger"
_PASSWORD_READ_LIMIT = 4097  # one byte more than the longest password accepted
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_url(url: object) -> str:
    if not isinstance(url, str):
        raise TypeError("url must be a str")
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
        query = urllib.parse.parse_qs(parts.query)
    except ValueError:
        raise StorageBackendError("url: not a valid postgresql:// URL") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise StorageBackendError("url: must start with postgresql://")
    if password is not None or "password" in query:
        raise StorageBackendError("url: must not contain a password (give password_file)")
    return url


def redacted_url(url: str) -> str:
    """``scheme://user@host:port/database``: no query, never a password."""
    parts = urllib.parse.urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{host}{port}{parts.path}"


def check_schema(schema: object) -> str:
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise StorageBackendError("schema: must match [a-z_][a-z0-9_]{0,62}")
    if schema.startswith("pg_"):
        raise StorageBackendError("schema: names starting with pg_ are reserved")
    return schema


_PASSWORD_REFUSALS: dict[str, str] = {
    "missing": "does not exist",
    "unopenable": "cannot be opened (a link, or no permission)",
    "not_regular": "is not a regular file",
    "permissions": "is open to group or others (chmod 600)",
    "unreadable": "cannot be read",
    "format": "must hold one line",
}


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password in ``path``, under the one private-file rule (``octo_common.keyfile``).

    One line of UTF-8; a trailing newline is not part of it. Failures are
    ``StorageBackendError`` naming the problem, never the content.
    """
    try:
        content = read_private_file(path, _PASSWORD_READ_LIMIT)
    except KeyFileRefused as refused:
        raise StorageBackendError(f"password_file: {_PASSWORD_REFUSALS[refused.reason]}") from None
    try:
        text = content.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise StorageBackendError("password_file: not UTF-8 text") from None
    if len(content) >= _PASSWORD_READ_LIMIT or not text or "\n" in text:
        raise StorageBackendError("password_file: must hold one line")
    return text
