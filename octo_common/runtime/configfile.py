"""Reading a worker or host TOML configuration, the same way on both sides.

Owns what the two configuration modules share: reading the TOML file
(:func:`read_toml`), turning a msgspec validation error into an
``InvalidConfiguration`` that names the bad key (:func:`validation_error`),
resolving a configured path (:func:`resolve_path`: ``${CREDENTIALS_DIRECTORY}``,
``~``, relative to the file), and the broker URL with the password read
from its private file (:func:`broker_url_with_password`) or without any
credential (:func:`redacted_broker_url`); and the parts both configurations
are made of: :class:`ConfigFile` (the file's directory and the paths and
broker URL resolved against it), :class:`BrokerConnectionConfig` (how a
``[broker]`` section reaches RabbitMQ), :class:`StorageKeyConfig` (one
storage key file) and :func:`convert_config` (a decoded mapping into a
configuration).

It must never decide what a configuration may contain (each side's
``config`` module does) and never put a password into an error, a log or
a URL other than the one :func:`broker_url_with_password` returns.
"""

from __future__ import annotations

import os
import re
import tomllib
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import msgspec

from octo_common.errors import BrokerPasswordInline, InvalidConfiguration
from octo_common.runtime.keyfiles import read_secret_text
from octo_common.runtime.tls import TlsConfig, TlsSettings

__all__ = [
    "BrokerConnectionConfig",
    "ConfigFile",
    "StorageKeyConfig",
    "broker_url_with_password",
    "check_broker_password",
    "convert_config",
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


class BrokerConnectionConfig(msgspec.Struct, frozen=True):
    """How a ``[broker]`` section reaches RabbitMQ; each side adds its own fields.

    The password is never here: ``password_file`` names the 0600 file that
    holds it (a systemd credential: ``${CREDENTIALS_DIRECTORY}/...``). A
    password inside ``url`` is refused unless ``allow_inline_password`` is
    set (a throwaway broker: a test, a laptop). Without a user and password
    the client logs in as RabbitMQ's ``guest``, which the broker accepts
    from loopback only.
    """

    url: str = "amqp://127.0.0.1:5672/"
    password_file: str | None = None
    allow_inline_password: bool = False
    connect_timeout_seconds: float = 10.0
    publish_timeout_seconds: float = 10.0
    # [broker.tls]: the CA that signed the broker's certificate, this side's
    # client certificate and key, the name the broker's certificate carries.
    tls: TlsConfig | None = None


def check_broker_password(broker: BrokerConnectionConfig) -> None:
    """Where the broker password may come from: ``password_file``, or ``url`` with
    the flag; and ``[broker.tls]`` only with an ``amqps://`` URL."""
    if broker.tls is not None and not broker.url.startswith("amqps://"):
        raise InvalidConfiguration("broker.tls: needs an amqps:// broker.url")
    if not urllib.parse.urlsplit(broker.url).password:
        return
    if broker.password_file:
        raise InvalidConfiguration("broker.url: give the password in password_file only")
    if not broker.allow_inline_password:
        raise BrokerPasswordInline(
            "broker.url holds a password: put it in broker.password_file (or a systemd"
            " credential), or set broker.allow_inline_password = true for a throwaway broker"
        )


class StorageKeyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One storage key: its id and the file that holds it."""

    id: str
    key_file: str


class ConfigFile(msgspec.Struct, frozen=True, kw_only=True):
    """What every configuration has besides its sections: the directory of its file.

    ``base_dir`` is set by :func:`convert_config` from where the file is,
    never from the file itself.
    """

    base_dir: str = "."

    def path(self, value: str, where: str = "") -> Path:
        """A configured path: ``$CREDENTIALS_DIRECTORY``-aware, relative to the file.

        ``where`` (the config key) prefixes an error about the path.
        """
        return resolve_path(value, Path(self.base_dir), where)

    def broker_tls(self, broker: BrokerConnectionConfig) -> TlsSettings | None:
        """``[broker.tls]`` with its files resolved (None: no TLS settings)."""
        return TlsSettings.from_config(broker.tls, self.path, "broker.tls")

    def url_with_password(self, broker: BrokerConnectionConfig) -> str:
        """``broker.url`` with the password from ``broker.password_file`` (never logged)."""
        password_file = broker.password_file
        return broker_url_with_password(
            broker.url,
            None if password_file is None else self.path(password_file, "broker.password_file"),
            "broker.password_file",
        )


ConfigT = TypeVar("ConfigT", bound=ConfigFile)


def convert_config(data: Mapping[str, Any], cls: type[ConfigT], base_dir: Path) -> ConfigT:
    """``data`` (a decoded TOML file) validated as ``cls``, its ``base_dir`` set to ``base_dir``.

    A ``base_dir`` key in the file is refused like any unknown key; a
    validation error is an ``InvalidConfiguration`` naming the bad key.
    """
    if "base_dir" in data:
        # set from the file's location below, never from the file itself
        raise InvalidConfiguration("Object contains unknown field `base_dir`")
    try:
        config = msgspec.convert(dict(data), cls)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    return msgspec.structs.replace(config, base_dir=str(base_dir))
