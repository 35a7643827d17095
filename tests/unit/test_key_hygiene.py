"""Key hygiene: each refusal of a configured key or broker secret has its own code.

Real files in tmp_path with real owners and modes. The owner cases need to
run as root (to give a file to another user); they are skipped otherwise.
"""

from __future__ import annotations

import os
import pwd
import secrets
from pathlib import Path

import pytest

from octo_common.errors import (
    BrokerPasswordInline,
    InvalidConfiguration,
    KeyDirectoryWritable,
    KeyFileNotOwned,
    KeySharedBetweenRoles,
    WeakKey,
)
from octo_common.runtime.keyfiles import key_weakness, load_key_file
from octo_worker.config import WorkerConfig, load_config

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def private(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def worker_toml(
    tree: Path,
    *,
    scope: str = "keys/scope.key",
    storage: str = "keys/storage.key",
    data: str | None = None,
    broker: str = 'url = "amqp://127.0.0.1:5672/"',
) -> WorkerConfig:
    data_line = "" if data is None else f'data_key = {{ id = "d1", key_file = "{data}" }}'
    (tree / "worker.toml").write_text(
        f"""
[broker]
{broker}

[storage]
key = {{ id = "k1", key_file = "{storage}" }}
{data_line}

[[scopes]]
name = "tenant-a"
key_file = "{scope}"
"""
    )
    return load_config(tree / "worker.toml")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    private(keys / "scope.key", secrets.token_bytes(32))
    private(keys / "storage.key", secrets.token_bytes(32))
    private(keys / "data.key", secrets.token_bytes(32))
    return tmp_path


def test_well_kept_keys_of_three_roles_are_accepted(tree: Path) -> None:
    config = worker_toml(tree, data="keys/data.key")
    config.check_key_roles()
    assert config.scope_keys()["tenant-a"] is not None
    assert config.data_keyring() is not None


@needs_root
def test_a_key_file_owned_by_another_user_is_refused(tree: Path) -> None:
    os.chown(tree / "keys" / "scope.key", _nobody(), -1)
    config = worker_toml(tree)
    with pytest.raises(KeyFileNotOwned) as refused:
        config.scope_keys()
    assert refused.value.code == "key_file_not_owned"
    assert "scopes[0].key_file" in str(refused.value)
    with pytest.raises(KeyFileNotOwned):
        config.check_key_roles()


@needs_root
def test_a_key_in_a_directory_another_user_owns_is_refused(tree: Path) -> None:
    os.chown(tree / "keys", _nobody(), -1)
    with pytest.raises(KeyDirectoryWritable) as refused:
        worker_toml(tree).scope_keys()
    assert refused.value.code == "key_directory_writable"


def test_a_key_in_a_directory_others_can_write_is_refused(tree: Path) -> None:
    (tree / "keys").chmod(0o777)
    with pytest.raises(KeyDirectoryWritable) as refused:
        worker_toml(tree).storage_keyring()
    assert "chmod go-w" in str(refused.value)
    (tree / "keys").chmod(0o770)  # group-writable is someone else too
    with pytest.raises(KeyDirectoryWritable):
        load_key_file(tree / "keys" / "storage.key", "storage.key.key_file")


def test_a_writable_directory_higher_up_is_refused_unless_sticky(tree: Path) -> None:
    outer = tree / "outer"
    inner = outer / "inner"
    inner.mkdir(parents=True, mode=0o700)
    key = private(inner / "k.key", secrets.token_bytes(32))
    outer.chmod(0o777)
    with pytest.raises(KeyDirectoryWritable, match="outer"):
        load_key_file(key, "k")
    outer.chmod(0o1777)  # like /tmp: others cannot rename what they do not own
    assert len(load_key_file(key, "k")) == 32


@pytest.mark.parametrize(
    ("data", "scope"),
    [
        ("keys/scope.key", "keys/scope.key"),  # one file as data and scope key
        ("keys/copy.key", "keys/scope.key"),  # another file with the same bytes
    ],
)
def test_one_key_for_two_roles_is_refused(tree: Path, data: str, scope: str) -> None:
    private(tree / "keys" / "copy.key", (tree / "keys" / "scope.key").read_bytes())
    config = worker_toml(tree, data=data, scope=scope)
    with pytest.raises(KeySharedBetweenRoles) as refused:
        config.check_key_roles()
    assert refused.value.code == "key_shared_between_roles"
    assert "scope tenant-a" in str(refused.value)


def test_the_storage_key_as_scope_key_is_refused(tree: Path) -> None:
    config = worker_toml(tree, scope="keys/storage.key")
    with pytest.raises(KeySharedBetweenRoles):
        config.check_key_roles()


@pytest.mark.parametrize(
    "key",
    [
        bytes(32),
        b"\xff" * 32,
        bytes(range(32)),
        bytes(range(0, 64, 2)),
        b"\x01\x02\x03\x04" * 8,
        (b"\x00" * 16) + bytes.fromhex("7ac8aa2e2e280453") + (b"\x00" * 8),
    ],
    ids=["zero", "ones", "run", "even-run", "period-4", "mostly-zero"],
)
def test_a_weak_data_key_is_refused(tree: Path, key: bytes) -> None:
    private(tree / "keys" / "data.key", key)
    config = worker_toml(tree, data="keys/data.key")
    with pytest.raises(WeakKey) as refused:
        config.data_keyring()
    assert refused.value.code == "weak_key"
    assert key.hex() not in str(refused.value)


def test_random_keys_are_not_called_weak() -> None:
    assert all(key_weakness(secrets.token_bytes(32)) is None for _ in range(2000))


def test_a_password_inline_in_the_broker_url_needs_the_flag(tree: Path) -> None:
    with pytest.raises(BrokerPasswordInline) as refused:
        worker_toml(tree, broker='url = "amqp://octo:hunter2@127.0.0.1:5672/"')
    assert refused.value.code == "broker_password_inline"
    assert "hunter2" not in str(refused.value)
    config = worker_toml(
        tree,
        broker='url = "amqp://octo:hunter2@127.0.0.1:5672/"\nallow_inline_password = true',
    )
    assert config.broker_url() == "amqp://octo:hunter2@127.0.0.1:5672/"


def test_the_broker_password_from_a_file_or_a_systemd_credential(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    credentials = tree / "credentials"
    credentials.mkdir(mode=0o700)
    (credentials / "broker.password").write_text("s3cret\n")
    (credentials / "broker.password").chmod(0o400)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    config = worker_toml(
        tree,
        broker='url = "amqp://octo@127.0.0.1:5672/"\n'
        'password_file = "${CREDENTIALS_DIRECTORY}/broker.password"',
    )
    assert config.broker_url() == "amqp://octo:s3cret@127.0.0.1:5672/"


def test_every_case_has_its_own_code() -> None:
    codes = {
        cls.code
        for cls in (
            KeyFileNotOwned,
            KeyDirectoryWritable,
            KeySharedBetweenRoles,
            WeakKey,
            BrokerPasswordInline,
        )
    }
    assert len(codes) == 5 and InvalidConfiguration.code not in codes
