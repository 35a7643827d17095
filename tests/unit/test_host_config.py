"""``host.toml``: a good file, every bad key named, key file permissions, and the
compensation verifiers built from it."""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from octo_common.digest import ledger_input_fingerprint
from octo_common.errors import CompensationActionDenied, CompensationGrantDenied
from octo_common.grants import CapabilityGrant, ResourceKind, ResourceSelector
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_host.compensation import WorkflowCompensationAction
from octo_host.config import (
    ConfiguredActionVerifier,
    ConfiguredGrantVerifier,
    HostConfig,
    InvalidConfiguration,
    load_config,
    parse_config,
)
from octo_host.plan import RetryOutcome, RetryPolicy

GOOD = """
[host]
host_id = "host-1"

[broker]
url = "amqp://octo-host@127.0.0.1:5672/octo"
password_file = "keys/broker.password"
reply_timeout_seconds = 7.5
max_attempts = 3

[ledger]
database = "state/ledger.sqlite3"
anchor = "state/ledger.anchor"
key = { id = "h2", key_file = "keys/ledger-h2.key" }
read_keys = [{ id = "h1", key_file = "keys/ledger-h1.key" }]

[[scopes]]
name = "tenant-release"
key_file = "keys/tenant-release.key"

[[scopes]]
name = "tenant-billing"
key_file = "/abs/billing.key"

[[grants]]
scope = "tenant-release"
tool = "files.publish"
format = "json"
max_calls = 16
max_compensations = 1
resources = [{ kind = "file_root", id = "published" }]

[[grants]]
scope = "tenant-release"
tool = "octo.noop"
format = "text"

[[actions]]
tool = "files.publish"
inverse = { undo = "publish" }
match = ["name"]

[[plans]]
name = "release"
steps = [
  { id = "publish", source = "publish the release notes" },
  { id = "announce", source = "tell the channel" },
]
"""


def good() -> dict[str, Any]:
    return tomllib.loads(GOOD)


def parse(data: dict[str, Any], base: Path = Path("/etc/octo")) -> HostConfig:
    return parse_config(data, base_dir=base)


def write_private(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


# A good file ----------------------------------------------------------------------------


def test_a_good_file_parses_with_paths_relative_to_it() -> None:
    config = parse(good())

    assert config.host.host_id == "host-1"
    assert config.broker.reply_timeout_seconds == 7.5
    assert config.broker.publish_timeout_seconds == 10.0  # default
    assert config.database_path == Path("/etc/octo/state/ledger.sqlite3")
    assert config.anchor_path == Path("/etc/octo/state/ledger.anchor")
    assert config.path("/abs/billing.key") == Path("/abs/billing.key")
    assert config.redacted_broker_url() == "amqp://127.0.0.1:5672/octo"


def test_grants_build_the_manifest_of_their_scope_only() -> None:
    config = parse(good())

    grant = config.grant("tenant-release", "files.publish")
    assert grant == CapabilityGrant(
        "files.publish",
        "json",
        max_calls=16,
        max_compensations=1,
        resources=[ResourceSelector(ResourceKind.FILE_ROOT, "published")],
    )
    assert config.grant("tenant-billing", "files.publish") is None
    manifest = config.manifest("tenant-release")
    assert manifest.tools() == ["files.publish", "octo.noop"]
    assert manifest.grant("octo.noop") == CapabilityGrant("octo.noop", "text")
    with pytest.raises(InvalidConfiguration, match="no \\[\\[grants\\]\\] entry for scope"):
        config.manifest("tenant-billing")


def test_plans_and_actions_are_found_by_name() -> None:
    config = parse(good())
    plan = config.plan("release")
    assert plan is not None and [s.id for s in plan.steps] == ["publish", "announce"]
    assert config.plan("other") is None
    action = config.action("files.publish")
    assert action is not None and action.match == ("name",)
    assert config.action("octo.noop") is None


def test_a_step_s_retry_table_is_its_retry_policy() -> None:
    data = copy.deepcopy(good())
    data["plans"][0]["steps"][0]["retry"] = {"attempts": 3, "retry_on": ["not_happened", "failed"]}
    plan = parse(data).plan("release")
    assert plan is not None
    first, second = (step.step() for step in plan.steps)
    assert first.retry == RetryPolicy(
        attempts=3, retry_on=frozenset({RetryOutcome.NOT_HAPPENED, RetryOutcome.FAILED})
    )
    assert second.retry is None


def test_the_loader_reads_the_file_and_names_syntax_errors(tmp_path: Path) -> None:
    path = tmp_path / "host.toml"
    path.write_text(GOOD)
    assert load_config(path).base_dir == str(tmp_path.resolve())
    path.write_text("[host\n")
    with pytest.raises(InvalidConfiguration, match="TOML syntax error"):
        load_config(path)
    with pytest.raises(InvalidConfiguration, match="does not exist"):
        load_config(tmp_path / "missing.toml")


# Every bad key named ------------------------------------------------------------------------


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = data
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        elif last.isdigit():
            node[int(last)] = value
        else:
            node[last] = value

    return change


_DELETE = object()


def _append(section: str, entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data[section].append(entry)

    return change


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing host", _set("host", _DELETE), "host"),
    ("host id", _set("host.host_id", "Host One"), "host.host_id"),
    ("unknown top-level key", _set("hosts", {}), "hosts"),
    ("base_dir is not a key", _set("base_dir", "/elsewhere"), "base_dir"),
    ("unknown broker key", _set("broker.reply_timeout", 3), "broker"),
    ("broker scheme", _set("broker.url", "http://127.0.0.1/"), "broker.url"),
    (
        "password twice",
        _set("broker.url", "amqp://u:p@127.0.0.1:5672/"),
        "broker.url: give the password in password_file only",
    ),
    ("reply timeout", _set("broker.reply_timeout_seconds", 0), "broker.reply_timeout_seconds"),
    ("timeout type", _set("broker.connect_timeout_seconds", "10"), "broker.connect_timeout"),
    ("attempts", _set("broker.max_attempts", 0), "broker.max_attempts"),
    ("missing ledger key", _set("ledger.key", _DELETE), "ledger"),
    ("ledger key id", _set("ledger.key.id", "H 1"), "ledger.key.id"),
    ("read key id twice", _set("ledger.read_keys.0.id", "h2"), "ledger.read_keys[0].id"),
    ("no scopes", _set("scopes", []), "scopes"),
    ("scope name", _set("scopes.0.name", "Tenant"), "scopes[0].name"),
    ("scope twice", _set("scopes.1.name", "tenant-release"), "scopes[1].name"),
    ("scope key file missing", _set("scopes.0.key_file", _DELETE), "scopes[0]"),
    ("grant of an unknown scope", _set("grants.0.scope", "nobody"), "grants[0].scope"),
    ("grant tool", _set("grants.0.tool", "Files Publish"), "grants[0].tool"),
    ("grant format", _set("grants.0.format", "xml"), "grants[0].format"),
    ("grant calls", _set("grants.0.max_calls", 0), "grants[0].max_calls"),
    (
        "grant compensations",
        _set("grants.0.max_compensations", -1),
        "grants[0].max_compensations",
    ),
    ("grant limit u32", _set("grants.1.max_input_bytes", 2**32), "grants[1].max_input_bytes"),
    ("resource kind", _set("grants.0.resources.0.kind", "disk"), "grants[0].resources[0].kind"),
    ("resource id", _set("grants.0.resources.0.id", "a b"), "grants[0].resources[0].id"),
    ("unknown grant key", _set("grants.0.compensations", 1), "grants[0]"),
    (
        "grant twice",
        _append("grants", {"scope": "tenant-release", "tool": "octo.noop", "format": "json"}),
        "grants[2]: a second grant",
    ),
    ("action tool", _set("actions.0.tool", "Files"), "actions[0].tool"),
    ("empty action", _append("actions", {"tool": "octo.noop"}), "actions[1]"),
    ("match of a fixed field", _set("actions.0.match", ["undo"]), "actions[0].match[0]"),
    ("empty match field", _set("actions.0.match", [""]), "actions[0].match[0]"),
    ("match twice", _set("actions.0.match", ["name", "name"]), "actions[0].match"),
    (
        "inverse with a date",
        _set("actions.0.inverse", {"undo": tomllib.loads("d = 2024-01-01")["d"]}),
        "actions[0].inverse",
    ),
    ("plan name", _set("plans.0.name", "Release"), "plans[0].name"),
    ("plan without steps", _set("plans.0.steps", []), "plans[0].steps"),
    ("step id", _set("plans.0.steps.1.id", "Announce!"), "plans[0].steps[1].id"),
    ("step twice", _set("plans.0.steps.1.id", "publish"), "plans[0].steps[1].id"),
    ("step source missing", _set("plans.0.steps.0.source", _DELETE), "plans[0].steps[0]"),
    ("retry attempts", _set("plans.0.steps.0.retry", {"attempts": 1}), "plans[0].steps[0].retry"),
    (
        "retry outcome",
        _set("plans.0.steps.0.retry", {"attempts": 3, "retry_on": ["running"]}),
        "plans[0].steps[0].retry",
    ),
    (
        "retry backoff",
        _set("plans.0.steps.0.retry", {"attempts": 3, "backoff_seconds": -1.0}),
        "plans[0].steps[0].retry",
    ),
]


@pytest.mark.parametrize(("change", "named"), [(c, n) for _, c, n in BAD], ids=[b[0] for b in BAD])
def test_each_bad_key_is_named(change: Callable[[dict[str, Any]], None], named: str) -> None:
    data = copy.deepcopy(good())
    change(data)
    with pytest.raises(InvalidConfiguration) as raised:
        parse(data)
    text = str(raised.value)
    assert text.startswith("invalid configuration: ")
    assert named in text
    assert "\n" not in text


# Key files ------------------------------------------------------------------------------------


@pytest.fixture
def keyed(tmp_path: Path) -> HostConfig:
    keys = tmp_path / "keys"
    write_private(keys / "tenant-release.key", os.urandom(32))
    write_private(keys / "ledger-h2.key", os.urandom(32).hex().encode() + b"\n")
    write_private(keys / "ledger-h1.key", os.urandom(32).hex().encode())
    write_private(keys / "broker.password", b"s3cret pass\n")
    return parse(good(), tmp_path)


def test_private_key_files_load(keyed: HostConfig) -> None:
    assert keyed.scope_key("tenant-release") is not None
    ring = keyed.storage_keyring()
    assert ring.active_id == "h2" and set(ring.key_ids) == {"h1", "h2"}
    url = keyed.broker_url()
    assert url == "amqp://octo-host:s3cret%20pass@127.0.0.1:5672/octo"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_key_file_open_to_group_or_others_is_named(keyed: HostConfig, mode: int) -> None:
    path = keyed.path("keys/ledger-h1.key")
    os.chmod(path, mode)
    with pytest.raises(InvalidConfiguration) as raised:
        keyed.storage_keyring()
    text = str(raised.value)
    assert "ledger.read_keys[0].key_file" in text and str(path) in text
    assert f"mode {mode:o}" in text and "chmod 600" in text
    assert path.read_text() not in text


def test_a_scope_key_open_to_others_is_named(keyed: HostConfig) -> None:
    path = keyed.path("keys/tenant-release.key")
    os.chmod(path, 0o604)
    with pytest.raises(InvalidConfiguration, match=r"scopes\[0\]\.key_file: .*chmod 600"):
        keyed.scope_key("tenant-release")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"short", "must hold 32 raw bytes or 64 lowercase hex"),
        (b"A" * 64, "must hold 32 raw bytes or 64 lowercase hex"),  # uppercase hex
        (b"ab" * 32 + b"\n\n", "must hold 32 raw bytes or 64 lowercase hex"),
        (bytes(32), "weak_key: .*all zero"),
    ],
)
def test_a_malformed_scope_key_is_refused(keyed: HostConfig, content: bytes, problem: str) -> None:
    write_private(keyed.path("keys/tenant-release.key"), content)
    with pytest.raises(InvalidConfiguration, match=problem):
        keyed.scope_key("tenant-release")


def test_missing_unconfigured_and_symlinked_keys(keyed: HostConfig, tmp_path: Path) -> None:
    with pytest.raises(InvalidConfiguration, match=r"/abs/billing\.key does not exist"):
        keyed.scope_key("tenant-billing")
    with pytest.raises(InvalidConfiguration, match="'nobody' is not configured"):
        keyed.scope_key("nobody")
    link = keyed.path("keys/ledger-h2.key")
    target = tmp_path / "elsewhere.key"
    write_private(target, os.urandom(32))
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(InvalidConfiguration, match=r"ledger\.key\.key_file: cannot open"):
        keyed.storage_keyring()


def test_a_broker_password_file_open_to_others_is_refused(keyed: HostConfig) -> None:
    os.chmod(keyed.path("keys/broker.password"), 0o644)
    with pytest.raises(InvalidConfiguration, match=r"broker\.password_file"):
        keyed.broker_url()


# Verifiers built from the configuration -----------------------------------------------------

PUBLISH = ToolPayload.json({"name": "notes.txt", "content": "hello"})


def action_for(
    config: HostConfig, inverse: ToolPayload, original: ToolPayload = PUBLISH, tool: str = ""
) -> WorkflowCompensationAction:
    tool = tool or "files.publish"
    grant = config.grant("tenant-release", tool)
    assert grant is not None
    return WorkflowCompensationAction(
        "f" * 64,
        "op-1",
        "publish",
        tool,
        ledger_input_fingerprint(canonical_operation_input_bytes(original)),
        "tenant-release",
        grant,
        canonical_operation_input_bytes(inverse),
    )


def test_the_grant_verifier_accepts_only_the_configured_grant() -> None:
    config = parse(good())
    verifier = ConfiguredGrantVerifier(config)
    grant = config.grant("tenant-release", "files.publish")
    assert grant is not None
    verifier.verify_compensation_grant("tenant-release", grant)
    for drifted, tenant in [
        (grant.with_compensation_limit(2), "tenant-release"),
        (
            CapabilityGrant("files.publish", "json", max_calls=16, max_compensations=1),
            "tenant-release",
        ),
        (grant, "tenant-billing"),
    ]:
        with pytest.raises(CompensationGrantDenied):
            verifier.verify_compensation_grant(tenant, drifted)


def test_the_action_verifier_allows_exactly_one_inverse() -> None:
    config = parse(good())
    verifier = ConfiguredActionVerifier(config, PUBLISH)
    verifier.verify_compensation_action(
        action_for(config, ToolPayload.json({"undo": "publish", "name": "notes.txt"}))
    )
    refused = [
        ToolPayload.json({"undo": "publish", "name": "other.txt"}),
        ToolPayload.json({"undo": "publish", "name": "notes.txt", "also": 1}),
        ToolPayload.json({"undo": "delete", "name": "notes.txt"}),
        ToolPayload.json({"name": "notes.txt"}),
        ToolPayload.text("undo notes.txt"),
    ]
    for inverse in refused:
        with pytest.raises(CompensationActionDenied):
            verifier.verify_compensation_action(action_for(config, inverse))


def test_the_action_verifier_binds_the_original_to_the_recorded_fingerprint() -> None:
    config = parse(good())
    inverse = ToolPayload.json({"undo": "publish", "name": "other.txt"})
    forged = ToolPayload.json({"name": "other.txt", "content": "hello"})
    # The caller claims another original; the ledger recorded PUBLISH.
    with pytest.raises(CompensationActionDenied):
        ConfiguredActionVerifier(config, forged).verify_compensation_action(
            action_for(config, inverse, original=PUBLISH)
        )
    with pytest.raises(CompensationActionDenied):
        ConfiguredActionVerifier(config, None).verify_compensation_action(
            action_for(config, ToolPayload.json({"undo": "publish", "name": "notes.txt"}))
        )


def test_tools_without_a_rule_and_text_tools_are_never_compensated() -> None:
    config = parse(good())
    verifier = ConfiguredActionVerifier(config, PUBLISH)
    with pytest.raises(CompensationActionDenied):
        verifier.verify_compensation_action(
            action_for(config, ToolPayload.text("x"), tool="octo.noop")
        )


def test_an_unset_credentials_directory_names_the_config_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    data = good()
    data["scopes"][0]["key_file"] = "${CREDENTIALS_DIRECTORY}/tenant-release.key"
    data["ledger"]["key"]["key_file"] = "${CREDENTIALS_DIRECTORY}/ledger.key"
    data["ledger"]["database"] = "${CREDENTIALS_DIRECTORY}/ledger.sqlite3"
    config = parse(data)
    unset = r"CREDENTIALS_DIRECTORY.*not set"
    with pytest.raises(
        InvalidConfiguration, match=rf"^invalid configuration: scopes\[0\]\.key_file: .*{unset}"
    ):
        config.scope_key("tenant-release")
    with pytest.raises(
        InvalidConfiguration, match=rf"^invalid configuration: ledger\.key\.key_file: .*{unset}"
    ):
        config.storage_keyring()
    with pytest.raises(
        InvalidConfiguration, match=rf"^invalid configuration: ledger\.database: .*{unset}"
    ):
        _ = config.database_path


# [storage]: the ledger in PostgreSQL ----------------------------------------------------

POSTGRES_URL = "postgresql://octo-host@db.example:5432/octo"


def with_storage(anchor: bool = False, **storage: Any) -> dict[str, Any]:
    data = copy.deepcopy(good())
    if not anchor:
        del data["ledger"]["anchor"]
    data["storage"] = storage
    return data


def test_sqlite_stays_the_default() -> None:
    config = parse(good())
    assert config.storage.url is None
    assert config.storage_password_path is None
    assert config.database_path == Path("/etc/octo/state/ledger.sqlite3")


def test_a_postgresql_url_selects_it_with_its_password_file() -> None:
    config = parse(with_storage(url=POSTGRES_URL, password_file="keys/ledger-db.password"))
    assert config.storage.url == POSTGRES_URL
    assert config.storage.schema == "octo_ledger"
    assert config.storage_password_path == Path("/etc/octo/keys/ledger-db.password")
    shared = parse(with_storage(url="postgres://octo@db/octo", schema="ledger_eu"))
    assert shared.storage.schema == "ledger_eu" and shared.storage_password_path is None


BAD_STORAGE: list[tuple[str, dict[str, Any], bool, str]] = [
    (
        "password in the url",
        {"url": "postgresql://octo:hunter2secret@db/octo"},
        False,
        "storage.url: must not contain a password",
    ),
    (
        "password in the query",
        {"url": "postgresql://octo@db/octo?password=hunter2secret"},
        False,
        "storage.url: must not contain a password",
    ),
    ("another scheme", {"url": "mysql://octo@db/octo"}, False, "storage.url"),
    ("schema name", {"url": POSTGRES_URL, "schema": "Octo-Ledger"}, False, "storage.schema"),
    ("reserved schema", {"url": POSTGRES_URL, "schema": "pg_octo"}, False, "storage.schema"),
    ("anchor beside the url", {"url": POSTGRES_URL}, True, "ledger.anchor: a PostgreSQL ledger"),
    ("password file alone", {"password_file": "keys/p"}, False, "storage.password_file"),
    ("unknown storage key", {"url": POSTGRES_URL, "password": "x"}, False, "storage"),
]


@pytest.mark.parametrize(
    ("storage", "anchor", "named"),
    [(s, a, n) for _, s, a, n in BAD_STORAGE],
    ids=[b[0] for b in BAD_STORAGE],
)
def test_each_bad_storage_key_is_named_and_no_password_is_echoed(
    storage: dict[str, Any], anchor: bool, named: str
) -> None:
    with pytest.raises(InvalidConfiguration) as raised:
        parse(with_storage(anchor=anchor, **storage))
    text = str(raised.value) + repr(raised.value)
    assert named in text
    assert "hunter2secret" not in text
