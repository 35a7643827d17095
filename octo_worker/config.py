"""The worker daemon's TOML configuration (validated with msgspec).

A configuration names files, never secrets: tenant scope keys and storage
keys live in key files (or systemd credentials) that must not be readable by
group or others. Every problem is reported as ``InvalidConfiguration`` with
the path of the bad key (``scopes[0].key_file``) and what is wrong with it,
in one line. This module reads files; it never logs or returns key bytes
except through the key objects of ``octo_common`` (whose reprs are redacted).
"""

from __future__ import annotations

import math
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from octo_common.errors import InvalidConfiguration, OctoError, StorageBackendError
from octo_common.frames import ScopeKey
from octo_common.ids import is_token
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.records import StorageKeyId, StorageKeyring
from octo_common.runtime.configfile import (
    BrokerConnectionConfig,
    broker_url_with_password,
    check_broker_password,
    read_toml,
    redacted_broker_url,
    resolve_path,
    validation_error,
)
from octo_common.runtime.keyfiles import (
    KeyRoles,
    load_key_file,
    load_scope_key,
    load_storage_key,
)
from octo_common.runtime.postgres import check_schema, check_url, redacted_url
from octo_common.runtime.tls import TlsConfig, TlsSettings
from octo_common.transport import (
    DEFAULT_DEAD_MAX_BYTES,
    DEFAULT_DEAD_MAX_LENGTH,
    host_id_of_reply_queue,
)

__all__ = [
    "BrokerConfig",
    "ConsoleConfig",
    "InvalidConfiguration",
    "ScopeConfig",
    "WorkerConfig",
    "load_config",
    "load_key_file",
    "load_scope_key",
    "load_storage_key",
    "resolve_path",
]


class BrokerConfig(BrokerConnectionConfig, forbid_unknown_fields=True, frozen=True):
    """Where RabbitMQ is. Put the password in ``password_file``, not in ``url``."""

    reconnect_initial_seconds: float = 0.5
    reconnect_max_seconds: float = 15.0
    prefetch: int = 64
    # The AMQP heartbeat the worker proposes (seconds): how long a paused or
    # partitioned worker keeps its queues before the broker hands them to a
    # standby.
    heartbeat_seconds: int = 60
    delivery_limit: int = 5
    # The dead-letter queue's bound (policy octo-v5-dead, set by `topology declare`).
    dead_letter_max_length: int = DEFAULT_DEAD_MAX_LENGTH
    dead_letter_max_bytes: int = DEFAULT_DEAD_MAX_BYTES


class StorageKeyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: str
    key_file: str


class StorageConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The journal database and the keys its rows are sealed with.

    SQLite (``journal``, a file in ``worker.state_dir``) by default; with
    ``url``, the journal in PostgreSQL instead, so that several
    workers can serve a scope in turn. ``url`` never holds the password
    (``password_file``); ``anchor`` beside ``url`` is the shared journal's
    rollback anchor file, on storage every worker of the journal mounts
    (``octo_worker.storage.store_anchor``).
    """

    journal: str = "journal.sqlite3"
    anchor: str | None = None
    url: str | None = None
    password_file: str | None = None
    schema: str = "octo_journal"
    key: StorageKeyConfig | None = None
    read_keys: tuple[StorageKeyConfig, ...] = ()
    data_key: StorageKeyConfig | None = None
    data_read_keys: tuple[StorageKeyConfig, ...] = ()


class ScopeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One tenant scope this worker serves, with its pre-shared key file."""

    name: str
    key_file: str
    max_concurrency: int = 32
    # Reply queues a session of this scope may use without having sealed its
    # reply queue into its open_session (a host of the protocol's base form).
    # A session that sealed one replies there only.
    reply_queues: tuple[str, ...] = ()


class AdaptersConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Only adapters named in ``enabled`` are loaded (entry-point group ``octo.adapters``)."""

    enabled: tuple[str, ...] = ()
    deadline_seconds: float = 30.0
    options: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    reconciliations_per_tool: int = 16
    reconciliations_per_session: int = 64


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    listen: str | None = None  # "127.0.0.1:9464"
    # How often the broker queue gauges (octo_queue_*) are refreshed.
    queue_refresh_seconds: float = 15.0


class ConsoleConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The read-only web console (``octo-worker console``; the daemon serves it
    beside its metrics when ``listen`` is set). Loopback only unless
    ``allow_remote`` is true, ``token_file`` names an access-token file, and
    either ``tls`` (cert_file, key_file) makes it serve HTTPS or
    ``behind_proxy`` says a reverse proxy on the way serves it over HTTPS."""

    listen: str | None = None  # "127.0.0.1:9465"
    allow_remote: bool = False
    token_file: str | None = None
    tls: TlsConfig | None = None
    behind_proxy: bool = False
    session_minutes: int = 480
    # Show a failed key's failure text on its page (off by default): only where
    # the journal's data key is configured, each page that shows it audited in
    # failure-text-reveals.jsonl of the state directory.
    reveal_failures: bool = False


class WorkerSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    state_dir: str = "."
    shutdown_grace_seconds: float = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": human-readable lines on a terminal, JSON lines otherwise (journald, files).
    log_format: Literal["auto", "json", "console"] = "auto"
    watchdog_stall_seconds: float = 60.0
    # "auto": uvloop when it is installed (it is a dependency on Linux), else asyncio.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The whole ``worker.toml``. Paths are relative to the file's directory."""

    worker: WorkerSection = msgspec.field(default_factory=WorkerSection)
    broker: BrokerConfig = msgspec.field(default_factory=BrokerConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)
    scopes: tuple[ScopeConfig, ...] = ()
    adapters: AdaptersConfig = msgspec.field(default_factory=AdaptersConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    console: ConsoleConfig = msgspec.field(default_factory=ConsoleConfig)
    base_dir: str = "."

    # -- resolved values -----------------------------------------------------

    def path(self, value: str, where: str = "") -> Path:
        """A configured path: ``$CREDENTIALS_DIRECTORY``-aware, relative to the file.

        ``where`` (the config key) prefixes an error about the path.
        """
        return resolve_path(value, Path(self.base_dir), where)

    def state_path(self, value: str, where: str = "") -> Path:
        """A state path: relative to ``worker.state_dir``."""
        return resolve_path(value, self.path(self.worker.state_dir, "worker.state_dir"), where)

    @property
    def journal_path(self) -> Path:
        return self.state_path(self.storage.journal, "storage.journal")

    @property
    def anchor_path(self) -> Path | None:
        anchor = self.storage.anchor
        return None if anchor is None else self.state_path(anchor, "storage.anchor")

    @property
    def shared_journal(self) -> bool:
        """Whether the journal is in PostgreSQL (``[storage] url``), shared by workers."""
        return self.storage.url is not None

    @property
    def storage_password_path(self) -> Path | None:
        """``storage.password_file``, resolved (read by the store at each connection)."""
        file = self.storage.password_file
        return None if file is None else self.path(file, "storage.password_file")

    def journal_location(self) -> str:
        """Where the journal is, as it may be shown: the file, or the URL without secrets."""
        if self.storage.url is not None:
            return f"{redacted_url(self.storage.url)} schema {self.storage.schema}"
        return str(self.journal_path)

    def broker_url(self) -> str:
        """The AMQP URL with the password from ``password_file`` (never logged)."""
        password_file = self.broker.password_file
        return broker_url_with_password(
            self.broker.url,
            None if password_file is None else self.path(password_file, "broker.password_file"),
            "broker.password_file",
        )

    def redacted_broker_url(self) -> str:
        return redacted_broker_url(self.broker.url)

    def broker_tls_context(self) -> ssl.SSLContext | None:
        """The TLS context of ``[broker.tls]`` (None: the default one, or plain TCP)."""
        tls = self.tls_settings(self.broker.tls, "broker.tls")
        return None if tls is None else tls.client_context()

    def scope_keys(self) -> dict[str, ScopeKey]:
        keys: dict[str, ScopeKey] = {}
        for index, scope in enumerate(self.scopes):
            keys[scope.name] = load_scope_key(
                self.path(scope.key_file, f"scopes[{index}].key_file"), f"scopes[{index}].key_file"
            )
        return keys

    def tls_settings(self, table: TlsConfig | None, where: str) -> TlsSettings | None:
        """A ``tls`` table's files resolved against this file's directory (None: no TLS)."""
        return TlsSettings.from_config(table, self.path, where)

    def check_key_roles(self) -> None:
        """Every configured key file read once, each key serving one role only.

        Roles: each scope's key, the storage keys (active and read), the data
        keys. ``KeySharedBetweenRoles`` when one file or one key's bytes is
        configured for two; every other key-file refusal as when it is loaded.
        """
        roles = KeyRoles()
        for index, scope in enumerate(self.scopes):
            where = f"scopes[{index}].key_file"
            roles.add(f"scope {scope.name}", where, self.path(scope.key_file, where))
        storage = self.storage
        for role, entries in (
            ("storage", ((storage.key, "storage.key"),)),
            ("data", ((storage.data_key, "storage.data_key"),)),
            ("storage", ((k, f"storage.read_keys[{i}]") for i, k in enumerate(storage.read_keys))),
            (
                "data",
                ((k, f"storage.data_read_keys[{i}]") for i, k in enumerate(storage.data_read_keys)),
            ),
        ):
            for entry, name in entries:
                if entry is not None:
                    where = f"{name}.key_file"
                    roles.add(role, where, self.path(entry.key_file, where))

    def storage_keyring(self) -> StorageKeyring:
        storage = self.storage
        if storage.key is None:
            raise InvalidConfiguration("storage.key: a storage key (id and key_file) is required")
        return _keyring(self, storage.key, storage.read_keys, "storage", "key", "read_keys")

    def data_keyring(self) -> StorageKeyring | None:
        storage = self.storage
        if storage.data_key is None:
            if storage.data_read_keys:
                raise InvalidConfiguration("storage.data_read_keys needs storage.data_key")
            return None
        return _keyring(
            self, storage.data_key, storage.data_read_keys, "storage", "data_key", "data_read_keys"
        )


def _keyring(
    config: WorkerConfig,
    active: StorageKeyConfig,
    read: tuple[StorageKeyConfig, ...],
    table: str,
    active_name: str,
    read_name: str,
) -> StorageKeyring:
    """The keyring of ``[table]``: errors name the exact key (``storage.key.key_file``)."""
    where = f"{table}.{active_name}"
    try:
        ring = StorageKeyring(
            StorageKeyId(active.id),
            load_storage_key(
                config.path(active.key_file, f"{where}.key_file"), f"{where}.key_file"
            ),
        )
        for index, extra in enumerate(read):
            where = f"{table}.{read_name}[{index}]"  # errors from here on name this entry
            ring.add_read_key(
                StorageKeyId(extra.id),
                load_storage_key(
                    config.path(extra.key_file, f"{where}.key_file"), f"{where}.key_file"
                ),
            )
    except InvalidConfiguration:
        raise
    except OctoError as exc:
        raise InvalidConfiguration(f"{where}: {exc.code}") from None
    return ring


def parse_config(data: Mapping[str, Any], *, base_dir: Path) -> WorkerConfig:
    """Validate a decoded TOML mapping; see :func:`load_config`."""
    if "base_dir" in data:
        # set from the file's location below, never from the file itself
        raise InvalidConfiguration("Object contains unknown field `base_dir`")
    try:
        config = msgspec.convert(dict(data), WorkerConfig)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None
    config = msgspec.structs.replace(config, base_dir=str(base_dir))
    _check(config)
    return config


def _check(config: WorkerConfig) -> None:
    if not config.scopes:
        raise InvalidConfiguration("scopes: at least one [[scopes]] entry is required")
    seen: set[str] = set()
    for index, scope in enumerate(config.scopes):
        if not is_token(scope.name):
            raise InvalidConfiguration(
                f"scopes[{index}].name: {scope.name!r} is not a token ([a-z0-9._-], 1..128)"
            )
        if scope.name in seen:
            raise InvalidConfiguration(f"scopes[{index}].name: {scope.name!r} is listed twice")
        seen.add(scope.name)
        if scope.max_concurrency < 1:
            raise InvalidConfiguration(f"scopes[{index}].max_concurrency: must be at least 1")
        for queue in scope.reply_queues:
            if host_id_of_reply_queue(queue) is None:
                raise InvalidConfiguration(
                    f"scopes[{index}].reply_queues: {queue!r} is not a host reply queue"
                    " (octo.v5.reply.<host-id>)"
                )
    broker = config.broker
    if not 1 <= broker.prefetch <= 65535:
        raise InvalidConfiguration("broker.prefetch: must be in 1..65535")
    if not 1 <= broker.heartbeat_seconds <= 3600:
        raise InvalidConfiguration("broker.heartbeat_seconds: must be in 1..3600")
    if not 1 <= broker.delivery_limit <= 1000:
        raise InvalidConfiguration("broker.delivery_limit: must be in 1..1000")
    if not 1 <= broker.dead_letter_max_length <= 2**63 - 1:
        raise InvalidConfiguration("broker.dead_letter_max_length: must be at least 1")
    # The largest frame must fit, or it would be dropped on arrival.
    if not MAX_WIRE_FRAME_BYTES <= broker.dead_letter_max_bytes <= 2**63 - 1:
        raise InvalidConfiguration(
            f"broker.dead_letter_max_bytes: must be at least {MAX_WIRE_FRAME_BYTES}"
        )
    for name in ("connect_timeout_seconds", "publish_timeout_seconds"):
        value = getattr(broker, name)
        if not (math.isfinite(value) and 0 < value <= 3600):
            raise InvalidConfiguration(f"broker.{name}: must be a positive number of seconds")
    initial, ceiling = broker.reconnect_initial_seconds, broker.reconnect_max_seconds
    if not (math.isfinite(initial) and 0 < initial <= 3600):
        raise InvalidConfiguration("broker.reconnect_initial_seconds: must be positive")
    if not (math.isfinite(ceiling) and initial <= ceiling <= 3600):
        raise InvalidConfiguration(
            "broker.reconnect_max_seconds: must be at least reconnect_initial_seconds"
        )
    if not broker.url.startswith(("amqp://", "amqps://")):
        raise InvalidConfiguration("broker.url: must start with amqp:// or amqps://")
    check_broker_password(broker)
    for name in config.adapters.enabled:
        if not is_token(name):
            raise InvalidConfiguration(f"adapters.enabled: {name!r} is not a tool name")
    for name in config.adapters.options:
        if name not in config.adapters.enabled:
            raise InvalidConfiguration(f"adapters.options.{name}: adapter is not enabled")
    if not (
        math.isfinite(config.adapters.deadline_seconds) and config.adapters.deadline_seconds > 0
    ):
        raise InvalidConfiguration("adapters.deadline_seconds: must be positive")
    if config.limits.reconciliations_per_tool < 1:
        raise InvalidConfiguration("limits.reconciliations_per_tool: must be at least 1")
    if config.limits.reconciliations_per_session < 1:
        raise InvalidConfiguration("limits.reconciliations_per_session: must be at least 1")
    grace = config.worker.shutdown_grace_seconds
    if not (math.isfinite(grace) and grace >= 0):
        raise InvalidConfiguration("worker.shutdown_grace_seconds: must not be negative")
    stall = config.worker.watchdog_stall_seconds
    if not (math.isfinite(stall) and stall > 0):
        raise InvalidConfiguration("worker.watchdog_stall_seconds: must be positive")
    listen = config.metrics.listen
    if listen is not None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidConfiguration("metrics.listen: expected HOST:PORT")
    refresh = config.metrics.queue_refresh_seconds
    if not (math.isfinite(refresh) and 0 < refresh <= 3600):
        raise InvalidConfiguration("metrics.queue_refresh_seconds: must be in (0, 3600]")
    _check_storage(config.storage)
    console = config.console.listen
    if console is not None:
        host, _, port = console.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidConfiguration("console.listen: expected HOST:PORT")
    if not 1 <= config.console.session_minutes <= 7 * 24 * 60:
        raise InvalidConfiguration("console.session_minutes: must be in 1..10080")


def _check_storage(storage: StorageConfig) -> None:
    if storage.url is None:
        if storage.password_file is not None:
            raise InvalidConfiguration("storage.password_file: only with storage.url")
        return
    try:  # never echo the URL: it may hold a secret
        check_url(storage.url)
        check_schema(storage.schema)
    except StorageBackendError as exc:
        raise InvalidConfiguration(f"storage.{exc.detail}") from None


def load_config(path: str | os.PathLike[str]) -> WorkerConfig:
    """Read and validate ``worker.toml``; raise ``InvalidConfiguration`` naming the bad key."""
    file = Path(path)
    data = read_toml(file)
    return parse_config(data, base_dir=file.resolve().parent)
