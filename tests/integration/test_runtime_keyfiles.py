"""Every key-file loader obeys one rule, on real files.

The loaders: ``ScopeKey.from_file`` (public API), the configuration loaders
of ``octo_common.runtime.keyfiles`` that the worker and host configurations
use, and ``read_storage_key`` behind ``octo_host.store.load_storage_key``.
Each refuses a symbolic link, a directory, a device, a file open to group or
others, a wrong length and uppercase hex, and never shows key bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import InvalidConfiguration, InvalidScopeKey, InvalidStorageKey
from octo_common.frames import ScopeKey
from octo_common.records import StorageKey
from octo_common.runtime.keyfiles import (
    load_key_file,
    load_scope_key,
    load_storage_key,
    read_secret_text,
    read_storage_key,
)
from octo_host import store as host_store
from octo_worker.config import load_config

# Fixed random bytes (a pattern such as bytes(range(32)) is refused as a weak key).
KEY = bytes.fromhex("5b1e0c9a7f3d62e8a4c17b09d2f68e35c0a9174be26d38f15a7c04e9b82d6f13")
HEX = KEY.hex().encode()

# name -> (loader, the error it raises, how the error names the problem)
LOADERS: dict[str, tuple[Callable[[Path], Any], type[Exception]]] = {
    "ScopeKey.from_file": (ScopeKey.from_file, InvalidScopeKey),
    "load_key_file": (lambda path: load_key_file(path, "scopes[0].key_file"), InvalidConfiguration),
    "load_scope_key": (
        lambda path: load_scope_key(path, "scopes[0].key_file"),
        InvalidConfiguration,
    ),
    "load_storage_key": (
        lambda path: load_storage_key(path, "storage.key.key_file"),
        InvalidConfiguration,
    ),
    "read_storage_key": (read_storage_key, InvalidStorageKey),
}


def key_bytes(value: Any) -> bytes:
    if isinstance(value, ScopeKey):
        return value.expose()
    if isinstance(value, StorageKey):
        return value.reveal()
    assert isinstance(value, bytes)
    return value


def private(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


def shown(error: BaseException) -> str:
    return str(error) + repr(error) + "".join(getattr(error, "__notes__", []))


@pytest.mark.parametrize("name", sorted(LOADERS))
@pytest.mark.parametrize("content", [KEY, HEX, HEX + b"\n"], ids=["raw", "hex", "hex-nl"])
def test_every_loader_reads_the_three_forms(tmp_path: Path, name: str, content: bytes) -> None:
    loader, _ = LOADERS[name]
    assert key_bytes(loader(private(tmp_path / "k.key", content))) == KEY
    assert key_bytes(loader(private(tmp_path / "r.key", content, 0o400))) == KEY


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_every_loader_refuses_a_symbolic_link_to_a_good_key(tmp_path: Path, name: str) -> None:
    loader, error = LOADERS[name]
    link = tmp_path / "link.key"
    link.symlink_to(private(tmp_path / "real.key", HEX))
    with pytest.raises(error):
        loader(link)


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_every_loader_refuses_a_directory_and_a_device(tmp_path: Path, name: str) -> None:
    loader, error = LOADERS[name]
    directory = tmp_path / "keys.d"
    directory.mkdir(mode=0o700)
    with pytest.raises(error):
        loader(directory)
    with pytest.raises(error):
        loader(Path("/dev/null"))
    with pytest.raises(error):
        loader(tmp_path / "absent.key")


@pytest.mark.parametrize("name", sorted(LOADERS))
@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o644])
def test_every_loader_refuses_any_group_or_other_bit_without_showing_the_key(
    tmp_path: Path, name: str, mode: int
) -> None:
    loader, error = LOADERS[name]
    with pytest.raises(error) as caught:
        loader(private(tmp_path / "k.key", HEX, mode))
    assert HEX.decode() not in shown(caught.value)


@pytest.mark.parametrize("name", sorted(LOADERS))
@pytest.mark.parametrize(
    "content",
    [KEY[:31], KEY + b"x", HEX[:63], HEX + b"\n\n", HEX + b"0", HEX.upper(), HEX.upper() + b"\n"],
    ids=["31", "33", "hex63", "two-newlines", "hex65", "upper", "upper-nl"],
)
def test_every_loader_refuses_a_wrong_length_or_uppercase_hex_without_showing_it(
    tmp_path: Path, name: str, content: bytes
) -> None:
    loader, error = LOADERS[name]
    with pytest.raises(error) as caught:
        loader(private(tmp_path / "k.key", content))
    text = shown(caught.value)
    assert HEX.decode()[:16] not in text.lower()


def test_scope_and_storage_errors_keep_their_reasons(tmp_path: Path) -> None:
    link = tmp_path / "link.key"
    link.symlink_to(private(tmp_path / "real.key", HEX))
    loose = private(tmp_path / "loose.key", HEX, 0o640)
    upper = private(tmp_path / "upper.key", HEX.upper())
    reasons = []
    for path in (link, tmp_path / "absent.key", tmp_path, loose, upper):
        with pytest.raises(InvalidScopeKey) as scope_error:
            ScopeKey.from_file(path)
        with pytest.raises(InvalidStorageKey) as storage_error:
            host_store.load_storage_key(path)
        reasons.append((scope_error.value.reason, storage_error.value.__notes__))
    assert reasons == [
        ("unreadable", ["storage key file: unreadable"]),
        ("unreadable", ["storage key file: unreadable"]),
        ("permissions", ["storage key file: permissions"]),
        ("permissions", ["storage key file: permissions"]),
        ("format", ["storage key file: format"]),
    ]


def test_configuration_errors_name_the_key_and_the_problem(tmp_path: Path) -> None:
    where = "scopes[0].key_file"
    cases = {
        tmp_path / "absent.key": f"{where}: {tmp_path / 'absent.key'} does not exist",
        private(tmp_path / "loose.key", HEX, 0o644): (
            f"{where}: {tmp_path / 'loose.key'} grants permissions to group or others "
            f"(mode 644); run chmod 600 {tmp_path / 'loose.key'}"
        ),
        private(tmp_path / "short.key", KEY[:31]): (
            f"{where}: {tmp_path / 'short.key'} must hold 32 raw bytes or 64 lowercase hex"
            " characters"
        ),
    }
    for path, expected in cases.items():
        with pytest.raises(InvalidConfiguration) as caught:
            load_key_file(path, where)
        assert caught.value.detail == expected
    with pytest.raises(
        InvalidConfiguration, match=r"weak_key: scopes\[0\]\.key_file: .* guessable key"
    ):
        load_scope_key(private(tmp_path / "zero.key", bytes(32)), where)


# Key files inside a symlinked directory ---------------------------------


@pytest.fixture
def linked_dir(tmp_path: Path) -> tuple[Path, Path]:
    """(the real key directory, a symbolic link to it elsewhere)."""
    real = tmp_path / "store" / "credentials"
    real.mkdir(parents=True, mode=0o700)
    link = tmp_path / "etc-octo"
    link.symlink_to(real, target_is_directory=True)
    return real, link


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_key_inside_a_symlinked_directory_is_judged_where_it_really_is(
    linked_dir: tuple[Path, Path], name: str
) -> None:
    loader, error = LOADERS[name]
    real, link = linked_dir
    private(real / "good.key", HEX)
    assert key_bytes(loader(link / "good.key")) == KEY
    # Nested links in the directory part resolve too.
    (link / "sub").symlink_to(real, target_is_directory=True)
    assert key_bytes(loader(link / "sub" / "good.key")) == KEY
    # The resolved file is what is judged: its own mode counts ...
    private(real / "loose.key", HEX, 0o640)
    with pytest.raises(error):
        loader(link / "loose.key")
    # ... and the file itself must still not be a link, in a linked directory too.
    (real / "alias.key").symlink_to(real / "good.key")
    with pytest.raises(error):
        loader(link / "alias.key")


def test_a_worker_configuration_in_a_symlinked_directory_loads_its_keys(
    linked_dir: tuple[Path, Path],
) -> None:
    real, link = linked_dir
    private(real / "scope.key", HEX)
    private(real / "storage.key", bytes(reversed(KEY)).hex().encode() + b"\n")
    private(real / "broker.password", b"s3cret\n")
    (real / "alias.key").symlink_to(real / "scope.key")
    text = (
        '[broker]\npassword_file = "broker.password"\n'
        'url = "amqp://octo@127.0.0.1:5672/"\n'
        '[storage]\nkey = { id = "s1", key_file = "storage.key" }\n'
        '[[scopes]]\nname = "tenant-a"\nkey_file = "scope.key"\n'
        '[[scopes]]\nname = "tenant-b"\nkey_file = "alias.key"\n'
    )
    (real / "worker.toml").write_text(text)
    config = load_config(link / "worker.toml")
    assert config.storage_keyring().active_id == "s1"
    assert "s3cret" in config.broker_url()
    with pytest.raises(
        InvalidConfiguration, match=r"^invalid configuration: scopes\[1\]\.key_file: "
    ):
        config.scope_keys()
    os.unlink(real / "alias.key")
    os.symlink("scope.key", real / "alias.key")  # a relative link: refused all the same
    with pytest.raises(InvalidConfiguration, match=r"scopes\[1\]\.key_file: cannot open"):
        config.scope_keys()


def test_a_password_file_follows_the_same_rule(tmp_path: Path) -> None:
    assert read_secret_text(private(tmp_path / "pw", b"hunter2\n"), "broker.password_file") == (
        "hunter2"
    )
    with pytest.raises(InvalidConfiguration, match=r"broker\.password_file: .*grants permissions"):
        read_secret_text(private(tmp_path / "loose", b"hunter2", 0o604), "broker.password_file")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "pw")
    with pytest.raises(InvalidConfiguration, match=r"broker\.password_file: cannot open"):
        read_secret_text(link, "broker.password_file")
    with pytest.raises(InvalidConfiguration, match="not UTF-8"):
        read_secret_text(private(tmp_path / "bin", b"\xff\xfe"), "broker.password_file")
