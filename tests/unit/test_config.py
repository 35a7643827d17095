"""worker.toml validation (octo_worker.config): every bad key is named in one line.

Real files in tmp_path: the configuration, key files with real permissions,
symlinks, and systemd's ``$CREDENTIALS_DIRECTORY``. No broker, no database.
"""

from __future__ import annotations

import asyncio
import os
import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from octo_common.frames import ScopeKey
from octo_common.records import StorageKeyring
from octo_worker.cli import run_event_loop
from octo_worker.config import BrokerConfig, InvalidConfiguration, WorkerConfig, load_config

# Random keys (a configured key with a pattern is refused as weak).
SCOPE_KEY = bytes.fromhex("dc53e5cd3b3c6b06a3b03a7fd6f1e99ff7f124152fbe80d3c43eb4f8c3baf3c7")
STORAGE_KEY = bytes.fromhex("86f604a1a68a400937cd95ab7fb9c715c9982cb6e0130c24bad4349b7d6714a9")
OLD_STORAGE_KEY = bytes.fromhex("fc492733d159e27092b9ba7d19a177bd69dc22afb3da68619b0f645237ae0bce")
DATA_KEY = bytes.fromhex("7e1af515da4143aff594e99cde2c1acc884ac383bc24544d4eb07e25311da5a4")
OLD_DATA_KEY = bytes.fromhex("0222a72ce4f78f50e728865ac7c9f6a493bafe3b1d9ce66dd1cf6d102b1eb78e")
CREDENTIAL_KEY = bytes.fromhex("7f2bff7ec5307aac475c03b67889cc6f7efcc7d2ca6f6f0532b5bd112d6325d3")

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "worker.toml.example"

GOOD = """
[worker]
state_dir = "state"
log_level = "warning"
shutdown_grace_seconds = 12

[broker]
url = "amqp://octo@broker.internal:5672/octo"
password_file = "broker.password"

[storage]
journal = "journal.sqlite3"
key = { id = "k2", key_file = "storage.key" }
read_keys = [{ id = "k1", key_file = "storage-old.key" }]

[[scopes]]
name = "tenant-release"
key_file = "scope.key"
max_concurrency = 8

[adapters]
enabled = ["files.publish"]

[adapters.options."files.publish"]
target_dir = "./published"
effect_log = "./effects.log"

[metrics]
listen = "127.0.0.1:9464"
"""


def private(path: Path, data: bytes | str, mode: int = 0o600) -> Path:
    if isinstance(data, str):
        path.write_text(data)
    else:
        path.write_bytes(data)
    path.chmod(mode)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    private(tmp_path / "scope.key", SCOPE_KEY)
    private(tmp_path / "storage.key", STORAGE_KEY.hex() + "\n")  # hex form
    private(tmp_path / "storage-old.key", OLD_STORAGE_KEY)
    private(tmp_path / "broker.password", "s3cret-pass\n")
    (tmp_path / "worker.toml").write_text(GOOD)
    return tmp_path


def load(tree: Path, text: str) -> WorkerConfig:
    (tree / "worker.toml").write_text(text)
    return load_config(tree / "worker.toml")


def refused(tree: Path, text: str) -> str:
    with pytest.raises(InvalidConfiguration) as caught:
        load(tree, text)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_good_config_resolves_paths_keys_and_the_broker_password(tree: Path) -> None:
    config = load_config(tree / "worker.toml")
    assert config.journal_path == tree / "state" / "journal.sqlite3"
    assert config.worker.log_level == "warning"
    assert config.worker.shutdown_grace_seconds == 12
    assert config.scopes[0].name == "tenant-release"
    assert config.scopes[0].max_concurrency == 8
    assert config.metrics.listen == "127.0.0.1:9464"
    assert config.broker.delivery_limit == 5  # default
    assert config.broker.dead_letter_max_length == 10_000  # default bound
    assert config.broker.dead_letter_max_bytes == 256 * 1024 * 1024
    keys = config.scope_keys()
    assert isinstance(keys["tenant-release"], ScopeKey)
    assert isinstance(config.storage_keyring(), StorageKeyring)
    assert config.data_keyring() is None
    url = config.broker_url()
    assert url == "amqp://octo:s3cret-pass@broker.internal:5672/octo"
    assert "s3cret" not in config.redacted_broker_url()
    assert "s3cret" not in repr(config)


def test_defaults_need_only_a_scope(tree: Path) -> None:
    config = load(tree, '[[scopes]]\nname = "a"\nkey_file = "scope.key"\n')
    assert config.broker.url == "amqp://127.0.0.1:5672/"  # RabbitMQ's guest, from loopback
    assert config.worker.log_format == "auto"  # human-readable on a terminal, else JSON
    assert config.worker.event_loop == "auto"
    assert config.metrics.listen is None
    with pytest.raises(InvalidConfiguration, match=r"storage\.key: a storage key"):
        config.storage_keyring()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("[worker]\n", '[worker]\ncolour = "blue"\n'),
            r"^invalid configuration: worker: .*`colour`",
        ),
        (("[metrics]\n", "[metric]\n"), r"unknown field `metric`"),
        (("[worker]\n", 'base_dir = "/elsewhere"\n[worker]\n'), r"unknown field `base_dir`"),
        (("max_concurrency = 8", 'max_concurrency = 8\nkey = "x"'), r"scopes\[0\]: .*`key`"),
    ],
)
def test_unknown_key_is_named(tree: Path, change: tuple[str, str], expected: str) -> None:
    message = refused(tree, GOOD.replace(*change, 1))
    assert re.search(expected, message), message


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (("max_concurrency = 8", 'max_concurrency = "eight"'), "scopes[0].max_concurrency"),
        (
            ("shutdown_grace_seconds = 12", "shutdown_grace_seconds = true"),
            "worker.shutdown_grace_seconds",
        ),
        (('log_level = "warning"', 'log_level = "loud"'), "worker.log_level"),
        (('log_level = "warning"', 'event_loop = "trio"'), "worker.event_loop"),
        (('enabled = ["files.publish"]', 'enabled = "files.publish"'), "adapters.enabled"),
        (('listen = "127.0.0.1:9464"', "listen = 9464"), "metrics.listen"),
    ],
)
def test_wrong_type_is_named(tree: Path, change: tuple[str, str], where: str) -> None:
    message = refused(tree, GOOD.replace(*change, 1))
    assert where in message, message


def test_scopes_are_required_and_checked(tree: Path) -> None:
    without = GOOD.split("[[scopes]]", maxsplit=1)[0] + GOOD.split("max_concurrency = 8\n")[1]
    assert "scopes: at least one [[scopes]] entry is required" in refused(tree, without)

    bad = refused(tree, GOOD.replace('name = "tenant-release"', 'name = "Tenant Release"'))
    assert "scopes[0].name" in bad and "not a token" in bad

    twice = GOOD + '\n[[scopes]]\nname = "tenant-release"\nkey_file = "scope.key"\n'
    message = refused(tree, twice)
    assert "scopes[1].name" in message and "listed twice" in message

    zero = refused(tree, GOOD.replace("max_concurrency = 8", "max_concurrency = 0"))
    assert "scopes[0].max_concurrency" in zero


def test_world_readable_key_file_gets_a_chmod_hint(tree: Path) -> None:
    (tree / "scope.key").chmod(0o644)
    config = load_config(tree / "worker.toml")
    with pytest.raises(InvalidConfiguration) as caught:
        config.scope_keys()
    message = str(caught.value)
    assert "scopes[0].key_file" in message
    assert f"chmod 600 {tree / 'scope.key'}" in message
    assert "644" in message

    (tree / "scope.key").chmod(0o600)
    (tree / "storage-old.key").chmod(0o640)
    with pytest.raises(
        InvalidConfiguration, match=r"storage\.read_keys\[0\]\.key_file: .*chmod 600"
    ):
        config.storage_keyring()


def test_a_bad_read_key_id_names_that_read_key(tree: Path) -> None:
    config = load(tree, GOOD.replace('read_keys = [{ id = "k1"', 'read_keys = [{ id = "k2"'))
    with pytest.raises(
        InvalidConfiguration,
        match=r"^invalid configuration: storage\.read_keys\[0\]: duplicate_key_id$",
    ):
        config.storage_keyring()


def test_missing_and_malformed_key_files(tree: Path) -> None:
    config = load(tree, GOOD.replace('key_file = "scope.key"', 'key_file = "absent.key"'))
    with pytest.raises(
        InvalidConfiguration, match=r"scopes\[0\]\.key_file: .*absent\.key does not exist"
    ):
        config.scope_keys()

    for content in (b"short", bytes(33), b"AB" * 32, (b"ab" * 32) + b"\n\n"):
        private(tree / "scope.key", content)
        with pytest.raises(InvalidConfiguration, match="32 raw bytes or 64 lowercase hex"):
            load(tree, GOOD).scope_keys()

    private(tree / "scope.key", bytes(32))  # the all-zero key
    with pytest.raises(InvalidConfiguration, match=r"weak_key: scopes\[0\]\.key_file: .*all zero"):
        load(tree, GOOD).scope_keys()

    private(tree / "storage.key", b"\x01" * 31)
    with pytest.raises(InvalidConfiguration, match=r"configuration: storage\.key\.key_file: "):
        load(tree, GOOD).storage_keyring()


def test_data_key_errors_name_the_exact_key(tree: Path) -> None:
    data = GOOD.replace(
        'read_keys = [{ id = "k1", key_file = "storage-old.key" }]',
        'read_keys = [{ id = "k1", key_file = "storage-old.key" }]\n'
        'data_key = { id = "d2", key_file = "data.key" }\n'
        'data_read_keys = [{ id = "d1", key_file = "data-old.key" }]',
    )
    config = load(tree, data)
    with pytest.raises(
        InvalidConfiguration, match=r"configuration: storage\.data_key\.key_file: .*does not exist"
    ):
        config.data_keyring()
    private(tree / "data.key", DATA_KEY)
    with pytest.raises(
        InvalidConfiguration,
        match=r"configuration: storage\.data_read_keys\[0\]\.key_file: .*does not exist",
    ):
        config.data_keyring()
    private(tree / "data-old.key", OLD_DATA_KEY)
    assert isinstance(config.data_keyring(), StorageKeyring)


def test_key_file_symlink_and_directory_are_refused(tree: Path) -> None:
    (tree / "link.key").symlink_to(tree / "scope.key")
    config = load(tree, GOOD.replace('key_file = "scope.key"', 'key_file = "link.key"'))
    with pytest.raises(InvalidConfiguration, match=r"scopes\[0\]\.key_file: cannot open"):
        config.scope_keys()

    (tree / "keys.d").mkdir(mode=0o700)
    config = load(tree, GOOD.replace('key_file = "scope.key"', 'key_file = "keys.d"'))
    with pytest.raises(InvalidConfiguration, match="scopes"):
        config.scope_keys()


def test_password_in_url_and_password_file_is_refused(tree: Path) -> None:
    message = refused(tree, GOOD.replace("amqp://octo@", "amqp://octo:inline@"))
    assert message.startswith("invalid configuration: broker.url: give the password in")
    assert "inline" not in message

    scheme = refused(tree, GOOD.replace("amqp://octo@", "http://octo@"))
    assert "broker.url" in scheme

    (tree / "broker.password").chmod(0o644)
    config = load(tree, GOOD)
    with pytest.raises(InvalidConfiguration, match=r"broker\.password_file: .*chmod 600"):
        config.broker_url()


@pytest.mark.parametrize(
    "listen", ["localhost", "127.0.0.1:0", "127.0.0.1:65536", ":9464", "127.0.0.1:http"]
)
def test_bad_metrics_listen(tree: Path, listen: str) -> None:
    message = refused(tree, GOOD.replace('listen = "127.0.0.1:9464"', f'listen = "{listen}"'))
    assert message == "invalid configuration: metrics.listen: expected HOST:PORT"


def test_options_for_an_adapter_that_is_not_enabled(tree: Path) -> None:
    message = refused(tree, GOOD.replace('enabled = ["files.publish"]', "enabled = []"))
    assert "adapters.options.files.publish: adapter is not enabled" in message


def test_toml_syntax_error_and_missing_file(tree: Path) -> None:
    assert "TOML syntax error" in refused(tree, "[worker\n")
    with pytest.raises(InvalidConfiguration, match="does not exist"):
        load_config(tree / "absent.toml")


def test_credentials_directory_expansion(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    credentials = tree / "credentials"
    credentials.mkdir(mode=0o700)
    private(credentials / "tenant-release.key", OLD_DATA_KEY[::-1])
    private(credentials / "storage.key", CREDENTIAL_KEY)
    text = GOOD.replace(
        'key_file = "scope.key"', 'key_file = "${CREDENTIALS_DIRECTORY}/tenant-release.key"'
    ).replace('key_file = "storage.key"', 'key_file = "${CREDENTIALS_DIRECTORY}/storage.key"')
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    config = load(tree, text)
    assert config.path(config.scopes[0].key_file) == credentials / "tenant-release.key"
    key = config.scope_keys()["tenant-release"]
    assert key == ScopeKey.from_bytes(OLD_DATA_KEY[::-1])
    config.storage_keyring()

    monkeypatch.delenv("CREDENTIALS_DIRECTORY")
    with pytest.raises(
        InvalidConfiguration,
        match=r"^invalid configuration: scopes\[0\]\.key_file: .*CREDENTIALS_DIRECTORY.*not set",
    ):
        config.scope_keys()
    with pytest.raises(
        InvalidConfiguration, match=r"^invalid configuration: storage\.key\.key_file: "
    ):
        config.storage_keyring()


def test_relative_paths_are_relative_to_the_config_file(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tree / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(os.path.relpath(tree / "worker.toml", elsewhere))
    assert config.path("scope.key") == tree / "scope.key"
    assert config.state_path("x") == tree / "state" / "x"
    config.scope_keys()


def _keys(struct: type[msgspec.Struct]) -> set[str]:
    names: set[str] = set()
    for info in msgspec.structs.fields(struct):
        names.add(info.name)
        for inner in (info.type, *getattr(info.type, "__args__", ())):
            if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                names |= _keys(inner)
    return names


def test_the_example_config_is_valid_and_documents_every_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", "/run/credentials/octo-worker@worker.service")
    config = load_config(EXAMPLE)
    assert config.scopes[0].name == "tenant-release"
    assert config.path(config.scopes[0].key_file) == Path(
        "/run/credentials/octo-worker@worker.service/tenant-release.key"
    )
    assert config.journal_path == Path("/var/lib/octo-worker/worker/journal.sqlite3")
    text = EXAMPLE.read_text()
    undocumented = {
        key
        for key in _keys(WorkerConfig) - {"base_dir"}
        if not re.search(rf"^\s*(# )?{key} =|\b{key} = ", text, re.MULTILINE)
        and not re.search(rf"^\[+[\w.]*\b{key}\b", text, re.MULTILINE)  # a table header
    }
    assert undocumented == set()


def test_the_failover_example_is_one_shared_journal_with_a_short_heartbeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # deploy/failover/: the same file on two machines.
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", "/run/credentials/octo-worker@release.service")
    config = load_config(EXAMPLE.parent / "failover" / "worker.toml")
    assert config.shared_journal
    assert config.storage.anchor is None
    assert config.broker.heartbeat_seconds < BrokerConfig().heartbeat_seconds
    drop_in = (EXAMPLE.parent / "failover" / "octo-worker-failover.conf").read_text()
    # Exit 5 (superseded) is restarted; only a configuration error (2) is not.
    assert "Restart=on-failure" in drop_in
    assert re.search(r"^RestartPreventExitStatus=2$", drop_in, re.MULTILINE)
    assert "journal-db.password" in drop_in


@pytest.mark.parametrize(
    ("section", "setting", "where"),
    [
        pytest.param("broker", "delivery_limit = 0", "broker.delivery_limit"),
        pytest.param("broker", "heartbeat_seconds = 0", "broker.heartbeat_seconds"),
        pytest.param("broker", "heartbeat_seconds = 3601", "broker.heartbeat_seconds"),
        pytest.param("broker", "dead_letter_max_length = 0", "broker.dead_letter_max_length"),
        # The bytes bound must hold at least one largest frame (1 MiB).
        pytest.param("broker", "dead_letter_max_bytes = 1048575", "broker.dead_letter_max_bytes"),
        pytest.param(
            "broker",
            "reconnect_initial_seconds = 0.0",
            "broker.reconnect_initial",
        ),
        pytest.param(
            "broker",
            "reconnect_initial_seconds = 5.0\nreconnect_max_seconds = 1.0",
            "broker.reconnect_max_seconds",
        ),
        pytest.param("broker", "publish_timeout_seconds = -1.0", "broker.publish_timeout"),
        pytest.param("broker", "connect_timeout_seconds = 0.0", "broker.connect_timeout"),
        pytest.param("broker", "prefetch = 70000", "broker.prefetch"),
        pytest.param("worker", "shutdown_grace_seconds = nan", "worker.shutdown_grace"),
        pytest.param("broker", "prefetch = 0", "broker.prefetch"),
        pytest.param("worker", "shutdown_grace_seconds = -1.0", "worker.shutdown_grace_seconds"),
        pytest.param("adapters", "deadline_seconds = 0.0", "adapters.deadline_seconds"),
        pytest.param("metrics", "queue_refresh_seconds = 0.0", "metrics.queue_refresh_seconds"),
        pytest.param("metrics", "queue_refresh_seconds = inf", "metrics.queue_refresh_seconds"),
        pytest.param("limits", "reconciliations_per_tool = 0", "limits.reconciliations_per_tool"),
    ],
)
def test_out_of_range_values_are_refused(
    tree: Path, section: str, setting: str, where: str
) -> None:
    text = f'[[scopes]]\nname = "a"\nkey_file = "scope.key"\n\n[{section}]\n{setting}\n'
    message = refused(tree, text)
    assert where in message, message


def test_the_host_example_config_loads_with_the_host_configuration() -> None:
    # deploy/host.toml.example documents octo_host.config; it must stay valid for it.
    from octo_host.config import load_config as load_host_config

    host = load_host_config(EXAMPLE.with_name("host.toml.example"))
    assert host.host.host_id == "host-1"
    assert [scope.name for scope in host.scopes] == ["tenant-release"]
    assert [(grant.scope, grant.tool) for grant in host.grants] == [
        ("tenant-release", "files.publish")
    ]
    example = tomllib.loads(EXAMPLE.read_text())
    # The host and the worker serve the same example scope.
    assert {s["name"] for s in example["scopes"]} == {s.name for s in host.scopes}


@pytest.mark.parametrize(
    ("choice", "module"), [("auto", "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")]
)
def test_the_configured_event_loop_runs_the_daemon(choice: str, module: str) -> None:
    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert run_event_loop(which(), choice) == module


SCOPE_ONLY = '[[scopes]]\nname = "a"\nkey_file = "scope.key"\n\n'


def test_a_storage_url_puts_the_journal_in_postgresql(tree: Path) -> None:
    config = load(
        tree,
        SCOPE_ONLY + '[storage]\nurl = "postgresql://octo@db.example:5432/octo"\n'
        'password_file = "db.password"\nschema = "journal_a"\n',
    )
    assert config.shared_journal
    assert config.storage_password_path == tree / "db.password"
    assert config.journal_location() == "postgresql://octo@db.example:5432/octo schema journal_a"
    assert not load(tree, SCOPE_ONLY).shared_journal


@pytest.mark.parametrize(
    ("storage", "where"),
    [
        pytest.param('url = "postgresql://octo:s3cret@db/octo"', "storage.url", id="password"),
        pytest.param(
            'url = "postgresql://octo@db/octo?password=s3cret"', "storage.url", id="query"
        ),
        pytest.param('url = "mysql://octo@db/octo"', "storage.url", id="scheme"),
        pytest.param(
            'url = "postgresql://db/octo"\nschema = "Bad-Name"', "storage.schema", id="schema"
        ),
        pytest.param('password_file = "db.password"', "storage.password_file", id="no-url"),
    ],
)
def test_a_storage_url_is_refused_naming_the_key_and_never_the_secret(
    tree: Path, storage: str, where: str
) -> None:
    message = refused(tree, SCOPE_ONLY + f"[storage]\n{storage}\n")
    assert f": {where}: " in message, message
    assert "s3cret" not in message


def test_a_shared_journal_takes_an_anchor_file(tree: Path) -> None:
    text = SCOPE_ONLY + '[storage]\nurl = "postgresql://db/octo"\nanchor = "/shared/j.anchor"\n'
    config = load(tree, text)
    assert config.shared_journal
    assert config.anchor_path == Path("/shared/j.anchor")
