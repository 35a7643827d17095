"""The host's TOML configuration, ``host.toml`` (validated with msgspec).

Like the worker's, a host configuration names files, never secrets. Every
problem is an :class:`InvalidConfiguration` naming the bad key
(``grants[1].max_compensations``) and what is wrong with it, in one line.
This module reads files; it never logs or returns key bytes except through
the redacted key objects of :mod:`octo_common`. It does not import
:mod:`octo_worker`.

Keys (relative paths are relative to the file's directory;
``${CREDENTIALS_DIRECTORY}`` and ``~`` are expanded)::

    [host]
    host_id = "host-1"            # token; replies arrive on octo.v5.reply.<host_id>

    [broker]
    url = "amqp://octo-host@127.0.0.1:5672/"   # no password here ...
    password_file = "keys/broker.password"      # ... but in this 0600 file (optional)
    connect_timeout_seconds = 10.0   # TCP + AMQP handshake
    publish_timeout_seconds = 10.0   # one publisher confirm
    reply_timeout_seconds = 10.0     # one worker reply, before reconciling instead
    max_attempts = 6                 # requests per verb (dispatch, reconcile, compensate)
    backoff_initial_seconds = 0.1    # between attempts, doubling ...
    backoff_max_seconds = 2.0        # ... up to this

    [ledger]
    database = "ledger.sqlite3"      # SQLite, WAL, 0600 (created on first write)
    anchor = "ledger.anchor"         # optional rollback anchor (octo-host ledger init-anchor)
    key = { id = "h1", key_file = "keys/ledger-h1.key" }   # seals every record
    read_keys = [{ id = "h0", key_file = "keys/ledger-h0.key" }]  # rotation: verify only

    [storage]                        # optional: the ledger in PostgreSQL instead
    url = "postgresql://octo-host@db.example:5432/octo"   # no password here ...
    password_file = "keys/ledger-db.password"            # ... but in this 0600 file
    schema = "octo_ledger"           # the tables' schema; hosts sharing one ledger use one

    [[scopes]]                       # one per tenant scope this host opens sessions for
    name = "tenant-release"
    key_file = "keys/tenant-release.key"   # the same 32-byte key as the worker's

    [[grants]]                       # the CURRENT policy, one per (scope, tool)
    scope = "tenant-release"
    tool = "files.publish"
    format = "json"                  # "json" or "text": also the format of --payload
    max_calls = 64                   # limits default to the protocol's defaults
    max_input_bytes = 16384
    max_output_bytes = 65536
    max_compensations = 1            # 0: this tool is never compensated
    resources = [{ kind = "file_root", id = "published" }]

    [[actions]]                      # which inverse payloads are allowed, per tool
    tool = "files.publish"
    inverse = { undo = "publish" }   # fields the inverse carries with these exact values
    match = ["name"]                 # fields copied from the original operation's input

    [[plans]]                        # named plans, so a run's plan is rebuilt after a restart
    name = "release"
    steps = [{ id = "publish", source = "publish the release notes",
               retry = { attempts = 3 } }]   # optional: see docs/retries.md

A step's ``retry`` table is its retry policy (``attempts``, 2 to 16;
``backoff_seconds``, 0.5; ``backoff_max_seconds``, 30; ``retry_on``,
``["not_happened"]``, ``"failed"`` allowed too); it is part of the plan's
fingerprint, so adding or changing one makes a new plan.

The manifest of a session for scope ``S`` is exactly the ``[[grants]]`` of
``S``. The two compensation verifiers are built from the same file:

* :class:`ConfiguredGrantVerifier` accepts a grant only when it equals the
  configured grant of that tenant scope and tool (any drift of limits,
  format or resources, or a removed grant, refuses);
* :class:`ConfiguredActionVerifier` accepts exactly one inverse payload per
  compensation: the JSON object ``inverse`` plus, for each field named in
  ``match``, the value of that field in the original operation's input, and
  nothing else. It receives the canonical inverse bytes and only the
  original's input *fingerprint*, so the caller hands it the original
  input, which it first binds to the recorded fingerprint (a different
  original is refused). Tools without an ``[[actions]]`` entry, and text
  tools, are never compensated.

Key files (scope and ledger keys, password file): regular files with no
permissions for group or others (``chmod 600`` or ``400``); keys hold 32 raw
bytes or 64 lowercase hex characters (one trailing newline allowed).
"""

from __future__ import annotations

import hmac
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from octo_common.digest import ledger_input_fingerprint
from octo_common.errors import (
    CompensationActionDenied,
    CompensationGrantDenied,
    InvalidConfiguration,
    InvalidRetryPolicy,
    OctoError,
)
from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest, ResourceKind, ResourceSelector
from octo_common.ids import is_token
from octo_common.limits import (
    DEFAULT_MAX_CALLS,
    DEFAULT_MAX_COMPENSATIONS,
    DEFAULT_MAX_INPUT_BYTES,
    DEFAULT_MAX_OUTPUT_BYTES,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyId, StorageKeyring
from octo_common.runtime.configfile import (
    BrokerConnectionConfig,
    ConfigFile,
    StorageKeyConfig,
    check_broker_password,
    convert_config,
    read_toml,
    redacted_broker_url,
    resolve_path,
)
from octo_common.runtime.keyfiles import (
    KeyRoles,
    load_key_file,
    load_scope_key,
    load_storage_key,
)
from octo_host.compensation import WorkflowCompensationAction
from octo_host.plan import RetryOutcome, RetryPolicy, WorkflowStep
from octo_host.storage.postgres import PostgresLedgerStore
from octo_host.storage.sqlite import SqliteLedgerStore

__all__ = [
    "DEFAULT_CONFIG",
    "ActionConfig",
    "BrokerConfig",
    "ConfiguredActionVerifier",
    "ConfiguredGrantVerifier",
    "GrantConfig",
    "HostConfig",
    "InvalidConfiguration",
    "LedgerConfig",
    "PlanConfig",
    "ScopeConfig",
    "StorageConfig",
    "load_config",
    "load_key_file",
    "load_scope_key",
    "load_storage_key",
    "parse_config",
    "resolve_path",
]

DEFAULT_CONFIG = "/etc/octo/host.toml"


class HostSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    host_id: str
    # Every frame of a new session after open_session travels encrypted.
    payload_codec: bool = True


class BrokerConfig(BrokerConnectionConfig, forbid_unknown_fields=True, frozen=True):
    """Where RabbitMQ is, and how long the host waits. The password goes in a file."""

    reply_timeout_seconds: float = 10.0
    max_attempts: int = 6
    backoff_initial_seconds: float = 0.1
    backoff_max_seconds: float = 2.0


class LedgerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The ledger database (which also holds the audit records) and its keys."""

    key: StorageKeyConfig
    database: str = "ledger.sqlite3"
    anchor: str | None = None
    read_keys: tuple[StorageKeyConfig, ...] = ()


class StorageConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The ledger in PostgreSQL (``url``) instead of ``ledger.database``; SQLite by default.

    Several hosts may share one such ledger (compare-and-swap on each run
    decides between them). It has no rollback anchor: ``ledger.anchor`` is
    refused beside ``url`` (see ``octo_host.storage.postgres``).
    """

    url: str | None = None
    password_file: str | None = None
    schema: str = "octo_ledger"


class ScopeConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    key_file: str


class ResourceConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    kind: Literal["file_root", "executable", "network_origin", "secret"]
    id: str


class GrantConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The current grant of one tool for one tenant scope."""

    scope: str
    tool: str
    format: Literal["text", "json"]
    # Defaults are the protocol's (CapabilityGrant's) defaults.
    max_calls: int = DEFAULT_MAX_CALLS
    max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    max_compensations: int = DEFAULT_MAX_COMPENSATIONS
    resources: tuple[ResourceConfig, ...] = ()

    def grant(self) -> CapabilityGrant:
        return CapabilityGrant(
            self.tool,
            self.format,
            self.max_calls,
            self.max_input_bytes,
            self.max_output_bytes,
            self.max_compensations,
            tuple(ResourceSelector(ResourceKind(r.kind), r.id) for r in self.resources),
        )


class ActionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The one inverse payload shape allowed for a tool's compensation (JSON tools)."""

    tool: str
    inverse: dict[str, Any] = msgspec.field(default_factory=dict)
    match: tuple[str, ...] = ()


class RetryConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A step's ``retry`` table: its retry policy (``octo_host.plan.RetryPolicy``)."""

    attempts: int
    backoff_seconds: float = 0.5
    backoff_max_seconds: float = 30.0
    retry_on: tuple[str, ...] = ("not_happened",)

    def policy(self, step_id: str) -> RetryPolicy:
        """The policy, checked (``InvalidRetryPolicy`` names what is out of bounds)."""
        outcomes: set[RetryOutcome] = set()
        for value in self.retry_on:
            try:
                outcomes.add(RetryOutcome(value))
            except ValueError:
                raise InvalidRetryPolicy(
                    step_id, "retry_on names not_happened or failed only"
                ) from None
        policy = RetryPolicy(
            self.attempts, self.backoff_seconds, self.backoff_max_seconds, frozenset(outcomes)
        )
        policy.check(step_id)
        return policy


class StepConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    id: str
    source: str
    retry: RetryConfig | None = None

    def step(self) -> WorkflowStep:
        """The plan step this entry describes (its retry policy, if any, included)."""
        retry = None if self.retry is None else self.retry.policy(self.id)
        return WorkflowStep(self.id, self.source, retry)


class PlanConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    steps: tuple[StepConfig, ...]


class HostConfig(ConfigFile, forbid_unknown_fields=True, frozen=True):
    """The whole ``host.toml``. Paths are relative to the file's directory."""

    host: HostSection
    ledger: LedgerConfig
    broker: BrokerConfig = msgspec.field(default_factory=BrokerConfig)
    storage: StorageConfig = msgspec.field(default_factory=StorageConfig)
    scopes: tuple[ScopeConfig, ...] = ()
    grants: tuple[GrantConfig, ...] = ()
    actions: tuple[ActionConfig, ...] = ()
    plans: tuple[PlanConfig, ...] = ()

    # -- resolved values (paths: ConfigFile.path) ------------------------------

    @property
    def database_path(self) -> Path:
        return self.path(self.ledger.database, "ledger.database")

    @property
    def anchor_path(self) -> Path | None:
        anchor = self.ledger.anchor
        return None if anchor is None else self.path(anchor, "ledger.anchor")

    @property
    def storage_password_path(self) -> Path | None:
        """``storage.password_file``, resolved (read by the store at each connection)."""
        file = self.storage.password_file
        return None if file is None else self.path(file, "storage.password_file")

    def broker_url(self) -> str:
        """The AMQP URL with the password from ``broker.password_file`` (never logged)."""
        return self.url_with_password(self.broker)

    def redacted_broker_url(self) -> str:
        return redacted_broker_url(self.broker.url)

    def scope_key(self, scope: str) -> ScopeKey:
        """The key of a configured scope (read now, checked for permissions)."""
        for index, entry in enumerate(self.scopes):
            if entry.name == scope:
                return load_scope_key(
                    self.path(entry.key_file, f"scopes[{index}].key_file"),
                    f"scopes[{index}].key_file",
                )
        raise InvalidConfiguration(f"scopes: scope {scope!r} is not configured")

    def check_key_roles(self) -> None:
        """Every configured key file read once, each key serving one role only
        (each scope's key, the ledger keys): ``KeySharedBetweenRoles`` otherwise."""
        roles = KeyRoles()
        for index, scope in enumerate(self.scopes):
            where = f"scopes[{index}].key_file"
            roles.add(f"scope {scope.name}", where, self.path(scope.key_file, where))
        ledger = self.ledger
        roles.add("ledger", "ledger.key.key_file", self.path(ledger.key.key_file, "ledger.key"))
        for index, extra in enumerate(ledger.read_keys):
            where = f"ledger.read_keys[{index}].key_file"
            roles.add("ledger", where, self.path(extra.key_file, where))

    def storage_keyring(self) -> StorageKeyring:
        """The ledger keyring: ``ledger.key`` active, ``ledger.read_keys`` for verification."""
        ledger = self.ledger
        try:
            ring = StorageKeyring(
                StorageKeyId(ledger.key.id),
                load_storage_key(
                    self.path(ledger.key.key_file, "ledger.key.key_file"), "ledger.key.key_file"
                ),
            )
            for index, extra in enumerate(ledger.read_keys):
                ring.add_read_key(
                    StorageKeyId(extra.id),
                    load_storage_key(
                        self.path(extra.key_file, f"ledger.read_keys[{index}].key_file"),
                        f"ledger.read_keys[{index}].key_file",
                    ),
                )
        except InvalidConfiguration:
            raise
        except OctoError as exc:
            raise InvalidConfiguration(f"ledger: {exc.code}") from None
        return ring

    def ledger_store(self) -> SqliteLedgerStore | PostgresLedgerStore:
        """The configured ledger store, not yet opened: PostgreSQL with ``[storage] url``,
        else SQLite at ``ledger.database`` (with ``ledger.anchor``)."""
        keyring = self.storage_keyring()  # configuration problems first
        if self.storage.url is not None:
            return PostgresLedgerStore(
                self.storage.url,
                keyring,
                password_file=self.storage_password_path,
                schema=self.storage.schema,
            )
        return SqliteLedgerStore(self.database_path, keyring, anchor_path=self.anchor_path)

    def grants_of(self, scope: str) -> tuple[CapabilityGrant, ...]:
        return tuple(entry.grant() for entry in self.grants if entry.scope == scope)

    def grant(self, scope: str, tool: str) -> CapabilityGrant | None:
        """The configured (current) grant of ``tool`` for tenant ``scope``, or None."""
        for entry in self.grants:
            if entry.scope == scope and entry.tool == tool:
                return entry.grant()
        return None

    def manifest(self, scope: str) -> CapabilityManifest:
        """The manifest sessions for ``scope`` open with (the session id is replaced)."""
        grants = self.grants_of(scope)
        if not grants:
            raise InvalidConfiguration(f"grants: no [[grants]] entry for scope {scope!r}")
        return CapabilityManifest("manifest", grants)

    def action(self, tool: str) -> ActionConfig | None:
        for entry in self.actions:
            if entry.tool == tool:
                return entry
        return None

    def plan(self, name: str) -> PlanConfig | None:
        for entry in self.plans:
            if entry.name == name:
                return entry
        return None


# Compensation verifiers built from the configuration ---------------------------------


class ConfiguredGrantVerifier:
    """``CompensationGrantVerifier``: the grant must equal the configured one."""

    def __init__(self, config: HostConfig) -> None:
        self._config = config

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        configured = self._config.grant(tenant_scope, grant.tool)
        if configured is None or configured != grant or configured.max_compensations == 0:
            raise CompensationGrantDenied(grant.tool, tenant_scope)

    def __repr__(self) -> str:
        return "ConfiguredGrantVerifier()"


class ConfiguredActionVerifier:
    """``CompensationActionVerifier``: exactly ``inverse`` + the ``match`` fields of
    the original input, which must be the input the ledger recorded."""

    def __init__(self, config: HostConfig, original: ToolPayload | None) -> None:
        self._config = config
        self._original = original

    def expected_inverse(self, tool: str) -> ToolPayload | None:
        """The one inverse this verifier allows for ``tool`` (None: none is)."""
        rule = self._config.action(tool)
        if rule is None:
            return None
        fields: dict[str, Any] = dict(rule.inverse)
        if rule.match:
            original = self._original
            if original is None or original.format != "json":
                return None
            value = original.value
            if not isinstance(value, dict) or any(name not in value for name in rule.match):
                return None
            for name in rule.match:
                fields[name] = value[name]
        return ToolPayload.json(fields)

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        def deny() -> OctoError:
            return CompensationActionDenied(action.operation_key, action.tool, action.tenant_scope)

        if action.grant.format != "json":
            raise deny()
        rule = self._config.action(action.tool)
        if rule is None:
            raise deny()
        if rule.match:
            original = self._original
            if original is None:
                raise deny()
            # Bind the original the caller handed in to the one the ledger recorded.
            data = canonical_operation_input_bytes(original)
            if ledger_input_fingerprint(data) != action.original_input_fingerprint:
                raise deny()
        expected = self.expected_inverse(action.tool)
        if expected is None:
            raise deny()
        if not hmac.compare_digest(
            canonical_operation_input_bytes(expected), action.compensation_input
        ):
            raise deny()

    def __repr__(self) -> str:
        return "ConfiguredActionVerifier()"


# Validation -----------------------------------------------------------------------------


def parse_config(data: Mapping[str, Any], *, base_dir: Path) -> HostConfig:
    """Validate a decoded TOML mapping; see :func:`load_config`."""
    config = convert_config(data, HostConfig, base_dir)
    _check(config)
    return config


def _token_error(where: str, value: object) -> InvalidConfiguration:
    return InvalidConfiguration(f"{where}: {value!r} is not a token ([a-z0-9._-], 1..128)")


def _positive(where: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise InvalidConfiguration(f"{where}: must be a positive number of seconds")


def _check(config: HostConfig) -> None:
    if not is_token(config.host.host_id):
        raise _token_error("host.host_id", config.host.host_id)
    _check_broker(config.broker)
    _check_ledger(config.ledger)
    _check_storage(config)
    if not config.scopes:
        raise InvalidConfiguration("scopes: at least one [[scopes]] entry is required")
    scopes: set[str] = set()
    for index, scope in enumerate(config.scopes):
        if not is_token(scope.name):
            raise _token_error(f"scopes[{index}].name", scope.name)
        if scope.name in scopes:
            raise InvalidConfiguration(f"scopes[{index}].name: {scope.name!r} is listed twice")
        scopes.add(scope.name)
    _check_grants(config, scopes)
    _check_actions(config)
    _check_plans(config)


def _check_broker(broker: BrokerConfig) -> None:
    if not broker.url.startswith(("amqp://", "amqps://")):
        raise InvalidConfiguration("broker.url: must start with amqp:// or amqps://")
    check_broker_password(broker)
    for name in (
        "connect_timeout_seconds",
        "publish_timeout_seconds",
        "reply_timeout_seconds",
        "backoff_initial_seconds",
        "backoff_max_seconds",
    ):
        _positive(f"broker.{name}", getattr(broker, name))
    if not 1 <= broker.max_attempts <= 100:
        raise InvalidConfiguration("broker.max_attempts: must be in 1..100")


def _check_ledger(ledger: LedgerConfig) -> None:
    ids = [ledger.key.id, *(extra.id for extra in ledger.read_keys)]
    for index, key_id in enumerate(ids):
        where = "ledger.key.id" if index == 0 else f"ledger.read_keys[{index - 1}].id"
        if not is_token(key_id):
            raise _token_error(where, key_id)
        if key_id in ids[:index]:
            raise InvalidConfiguration(f"{where}: key id {key_id!r} is listed twice")
    if not ledger.database:
        raise InvalidConfiguration("ledger.database: must name a file")


_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def _check_storage(config: HostConfig) -> None:
    storage = config.storage
    if storage.url is None:
        if storage.password_file is not None:
            raise InvalidConfiguration("storage.password_file: only with storage.url")
        return
    try:
        parts = urllib.parse.urlsplit(storage.url)
        password = parts.password
        query = urllib.parse.parse_qs(parts.query)
    except ValueError:
        raise InvalidConfiguration("storage.url: not a valid URL") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise InvalidConfiguration("storage.url: must start with postgresql://")
    if password is not None or "password" in query:
        # Never echo the URL: it holds a secret.
        raise InvalidConfiguration(
            "storage.url: must not contain a password (put it in storage.password_file)"
        )
    if not _SCHEMA_NAME.fullmatch(storage.schema) or storage.schema.startswith("pg_"):
        raise InvalidConfiguration(
            f"storage.schema: {storage.schema!r} is not a schema name ([a-z_][a-z0-9_]*)"
        )
    if config.ledger.anchor is not None:
        raise InvalidConfiguration(
            "ledger.anchor: a PostgreSQL ledger has no rollback anchor (other hosts commit"
            " to it too); its rollback protection is the database's own"
        )


def _check_grants(config: HostConfig, scopes: set[str]) -> None:
    seen: set[tuple[str, str]] = set()
    for index, entry in enumerate(config.grants):
        where = f"grants[{index}]"
        if entry.scope not in scopes:
            raise InvalidConfiguration(
                f"{where}.scope: {entry.scope!r} is not a configured [[scopes]] name"
            )
        if not is_token(entry.tool):
            raise _token_error(f"{where}.tool", entry.tool)
        if (entry.scope, entry.tool) in seen:
            raise InvalidConfiguration(
                f"{where}: a second grant of {entry.tool!r} for scope {entry.scope!r}"
            )
        seen.add((entry.scope, entry.tool))
        for name in ("max_calls", "max_input_bytes", "max_output_bytes"):
            if not 1 <= getattr(entry, name) <= 0xFFFFFFFF:
                raise InvalidConfiguration(f"{where}.{name}: must be in 1..4294967295")
        if not 0 <= entry.max_compensations <= 0xFFFFFFFF:
            raise InvalidConfiguration(f"{where}.max_compensations: must be in 0..4294967295")
        for position, resource in enumerate(entry.resources):
            if not is_token(resource.id):
                raise _token_error(f"{where}.resources[{position}].id", resource.id)
        try:
            entry.grant().validate()
        except OctoError as exc:
            raise InvalidConfiguration(f"{where}: {exc.code}: {exc}") from None


def _check_actions(config: HostConfig) -> None:
    seen: set[str] = set()
    for index, entry in enumerate(config.actions):
        where = f"actions[{index}]"
        if not is_token(entry.tool):
            raise _token_error(f"{where}.tool", entry.tool)
        if entry.tool in seen:
            raise InvalidConfiguration(f"{where}.tool: {entry.tool!r} is listed twice")
        seen.add(entry.tool)
        if not entry.inverse and not entry.match:
            raise InvalidConfiguration(f"{where}: give inverse fields, match fields, or both")
        for position, field in enumerate(entry.match):
            if not field:
                raise InvalidConfiguration(f"{where}.match[{position}]: must not be empty")
            if field in entry.inverse:
                raise InvalidConfiguration(
                    f"{where}.match[{position}]: {field!r} is also a fixed inverse field"
                )
        if len(set(entry.match)) != len(entry.match):
            raise InvalidConfiguration(f"{where}.match: a field is listed twice")
        try:
            # TOML dates and times are not JSON; the payload rules refuse them.
            ToolPayload.json(entry.inverse).validate_for("json")
        except (OctoError, TypeError, ValueError):
            raise InvalidConfiguration(
                f"{where}.inverse: must be a JSON-compatible table (no dates or times)"
            ) from None


def _check_plans(config: HostConfig) -> None:
    names: set[str] = set()
    for index, entry in enumerate(config.plans):
        where = f"plans[{index}]"
        if not is_token(entry.name):
            raise _token_error(f"{where}.name", entry.name)
        if entry.name in names:
            raise InvalidConfiguration(f"{where}.name: {entry.name!r} is listed twice")
        names.add(entry.name)
        if not entry.steps:
            raise InvalidConfiguration(f"{where}.steps: a plan needs at least one step")
        steps: set[str] = set()
        for position, step in enumerate(entry.steps):
            if not is_token(step.id):
                raise _token_error(f"{where}.steps[{position}].id", step.id)
            if step.id in steps:
                raise InvalidConfiguration(
                    f"{where}.steps[{position}].id: {step.id!r} is listed twice"
                )
            steps.add(step.id)
            if step.retry is not None:
                try:
                    step.retry.policy(step.id)
                except InvalidRetryPolicy as refused:
                    raise InvalidConfiguration(
                        f"{where}.steps[{position}].retry: {refused.detail}"
                    ) from None


def load_config(path: str | os.PathLike[str]) -> HostConfig:
    """Read and validate ``host.toml``; raise ``InvalidConfiguration`` naming the bad key."""
    file = Path(path)
    data = read_toml(file)
    return parse_config(data, base_dir=file.resolve().parent)
