"""The configuration pieces both sides share (octo_common.runtime.configfile)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from octo_common.errors import InvalidConfiguration
from octo_common.runtime.configfile import ConfigFile, StorageKeyConfig, convert_config


class _Broker(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    url: str = "amqp://guest:guest@127.0.0.1:5672/"
    password_file: str | None = None


class _Config(ConfigFile, forbid_unknown_fields=True, frozen=True):
    key: StorageKeyConfig
    broker: _Broker = msgspec.field(default_factory=_Broker)


def test_convert_config_sets_the_directory_of_the_file() -> None:
    config = convert_config({"key": {"id": "k1", "key_file": "k1.key"}}, _Config, Path("/etc/x"))
    assert config.base_dir == "/etc/x"
    assert config.key == StorageKeyConfig("k1", "k1.key")
    assert config.path("keys/k1.key") == Path("/etc/x/keys/k1.key")
    assert config.path("/abs/k1.key") == Path("/abs/k1.key")


def test_the_directory_never_comes_from_the_file() -> None:
    with pytest.raises(InvalidConfiguration, match="unknown field `base_dir`"):
        convert_config(
            {"key": {"id": "k", "key_file": "f"}, "base_dir": "/tmp"}, _Config, Path(".")
        )


def test_a_bad_value_names_its_key() -> None:
    with pytest.raises(InvalidConfiguration, match=r"key\.id: Expected `str`, got `int`"):
        convert_config({"key": {"id": 3, "key_file": "f"}}, _Config, Path("."))
    with pytest.raises(InvalidConfiguration, match="unknown field `extra`"):
        convert_config({"key": {"id": "k", "key_file": "f"}, "extra": 1}, _Config, Path("."))


def test_the_broker_url_without_a_password_file_is_the_configured_one() -> None:
    config = convert_config({"key": {"id": "k", "key_file": "f"}}, _Config, Path("/etc/x"))
    assert config.url_with_password(config.broker) == "amqp://guest:guest@127.0.0.1:5672/"
