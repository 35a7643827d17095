"""Reading a worker or host TOML configuration, the same way on both sides.

Owns what the two configuration modules share: reading the TOML file
(:func:`read_toml`), turning a msgspec validation error into an
``InvalidConfiguration`` that names the bad key (:func:`validation_error`),
resolving a configured path (:func:`resolve_path`: ``${CREDENTIALS_DIRECTORY}``,
``~``, relative to the file), and the broker URL with the password read
from its private file (:func:`broker_url_with_password`) or without any
credential (:func:`redacted_broker_url`).

It must never decide what a configuration may contain (each side's
``config`` module does) and never put a password into an error, a log or
a URL other than the one :func:`broker_url_with_password` returns.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from pathlib import Path
from typing import Any, Final

import msgspec

from octo_common.errors import InvalidConfiguration
from octo_common.runtime.keyfiles import read_secret_text

__all__ = [
    "broker_url_with_password",
    "read_toml",
    "redacted_broker_url",
    "resolve_path",
    "validation_error",
]


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The decoded TOML file at ``path``; ``InvalidConfiguration`` names what is wrong."""
    file = Path(path)
    try:
        return tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidConfiguration(f"{file} does not exist") from None
    except IsADirectoryError:
        raise InvalidConfiguration(f"{file} is a directory") from None
    except OSError as exc:
        raise InvalidConfiguration(f"cannot read {file} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise InvalidConfiguration(f"{file} is not UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfiguration(f"{file}: TOML syntax error: {exc}") from None


_AT_PATH: Final = re.compile(r"`\$\.?([^`]*)`")


def validation_error(exc: msgspec.ValidationError) -> InvalidConfiguration:
    """``Expected `int`, got `str` - at `$.broker.prefetch``` as ``broker.prefetch: ...``."""
    text = str(exc)
    match = _AT_PATH.search(text)
    where = match.group(1) if match else ""
    what = text.split(" - at ", 1)[0]
    return InvalidConfiguration(f"{where}: {what}" if where else what)


def resolve_path(value: str, base: Path, where: str = "") -> Path:
    """Expand ``${CREDENTIALS_DIRECTORY}`` and ``~``; relative paths join ``base``.

    ``where`` (the config key) prefixes an error.
    """
    credentials = os.environ.get("CREDENTIALS_DIRECTORY")
    if "${CREDENTIALS_DIRECTORY}" in value:
        if not credentials:
            prefix = f"{where}: " if where else ""
            raise InvalidConfiguration(
                f"{prefix}{value!r} names $CREDENTIALS_DIRECTORY, which is not set"
                " (systemd LoadCredential)"
            )
        value = value.replace("${CREDENTIALS_DIRECTORY}", credentials)
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def broker_url_with_password(url: str, password_file: Path | None, where: str) -> str:
    """``url`` with the password read from ``password_file`` (unchanged without one).

    The file obeys the private-file rule; ``where`` names it in errors.
    """
    if password_file is None:
        return url
    password = read_secret_text(password_file, where)
    parts = urllib.parse.urlsplit(url)
    user = urllib.parse.unquote(parts.username or "guest")
    host = parts.hostname or "127.0.0.1"
    netloc = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(password, safe='')}"
    netloc += f"@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def redacted_broker_url(url: str) -> str:
    """``scheme://host:port/vhost``: no user, no password, no query."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
