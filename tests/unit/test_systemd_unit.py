"""deploy/octo-worker@.service: the directives the worker relies on, and systemd's own parser.

The unit is parsed as systemd reads it (sections, repeated keys, comments)
and checked against the worker's configuration and packaging: the console
script it starts, the credentials the example configuration names, a stop
timeout above the shutdown grace. When ``systemd-analyze`` is installed, its
``verify`` runs on the file too.

``systemd-analyze verify`` also inspects the machine it runs on: it reports
that ``/opt/octo/.venv/bin/octo-worker`` is not executable, that the
``octo-worker`` user does not exist, or that a credential file is missing,
when the host is not a provisioned worker. Those lines name the unit
(``octo-worker@i.service: ...``). Syntax and value errors are reported as
``<file>:<line>: ...`` (unknown key or section, unparsable value); only those
fail the test.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "octo-worker@.service"
EXAMPLE = REPO / "deploy" / "worker.toml.example"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """Sections -> key -> every value, in order (systemd keys may repeat)."""
    sections: Unit = {}
    current: dict[str, list[str]] | None = None
    logical: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            logical.append(line[:-1].strip())
            continue
        line = " ".join([*logical, line])
        logical = []
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], defaultdict(list))
            continue
        assert current is not None, f"directive outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a KEY=VALUE line: {line!r}"
        current[key.strip()].append(value.strip())
    return sections


@pytest.fixture(scope="module")
def unit() -> Unit:
    return parse_unit(UNIT.read_text())


def one(unit: Unit, section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}= appears {len(values)} times"
    return values[0]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value)
    assert match, value
    number = float(match.group(1))
    return number * 60 if match.group(2) in ("min", "m") else number


def test_service_type_watchdog_and_start_command(unit: Unit) -> None:
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert seconds(one(unit, "Service", "WatchdogSec")) == 30
    assert one(unit, "Service", "ExecStart") == (
        "/opt/octo/.venv/bin/octo-worker run --config /etc/octo/%i.toml"
    )
    assert one(unit, "Service", "Restart") == "on-failure"
    # exit 2 = configuration error (octo_common.runtime.output.EXIT_USAGE): a restart cannot fix it
    assert one(unit, "Service", "RestartPreventExitStatus") == "2"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_exec_start_names_the_packaged_console_script() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["octo-worker"] == "octo_worker.cli:main"


def test_stop_timeout_exceeds_the_shutdown_grace(unit: Unit) -> None:
    example = tomllib.loads(EXAMPLE.read_text())
    grace = example["worker"]["shutdown_grace_seconds"]
    assert seconds(one(unit, "Service", "TimeoutStopSec")) > grace
    # The watchdog must not fire during a normal drain either: systemd stops
    # expecting pings once the stop begins (STOPPING=1), and the stall bound
    # is longer than the watchdog period.
    assert example["worker"]["watchdog_stall_seconds"] >= seconds(
        one(unit, "Service", "WatchdogSec")
    )


def test_dedicated_user_state_directory_and_umask(unit: Unit) -> None:
    assert one(unit, "Service", "User") == "octo-worker"
    assert one(unit, "Service", "DynamicUser") == "no"
    assert one(unit, "Service", "StateDirectory") == "octo-worker/%i"
    assert one(unit, "Service", "UMask") == "0077"
    example = tomllib.loads(EXAMPLE.read_text())
    assert example["worker"]["state_dir"].startswith("/var/lib/octo-worker/")


def test_credentials_match_what_the_example_config_names(unit: Unit) -> None:
    loaded = {}
    for value in unit["Service"]["LoadCredential"]:
        name, _, source = value.partition(":")
        assert source.startswith("/etc/octo/keys/%i/"), value
        loaded[name] = source
    # Every credential the active example lines use is loaded (commented
    # examples, like a rotated read key, need a line added with them).
    active = {
        name
        for line in EXAMPLE.read_text().splitlines()
        if not line.lstrip().startswith("#")
        for name in re.findall(r"\$\{CREDENTIALS_DIRECTORY\}/([A-Za-z0-9._-]+)", line)
    }
    assert active <= set(loaded), active - set(loaded)
    assert {"tenant-release.key", "storage-k1.key", "broker.password"} <= set(loaded)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("ProtectKernelTunables", "yes"),
        ("ProtectKernelModules", "yes"),
        ("ProtectControlGroups", "yes"),
        ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"),
        ("RestrictNamespaces", "yes"),
        ("LockPersonality", "yes"),
        ("MemoryDenyWriteExecute", "yes"),
        ("SystemCallFilter", "@system-service"),
    ],
)
def test_hardening_directive(unit: Unit, key: str, expected: str) -> None:
    assert one(unit, "Service", key) == expected


def test_memory_deny_write_execute_is_exercised_elsewhere() -> None:
    # MemoryDenyWriteExecute=yes is only safe if nothing in the process maps
    # writable+executable memory; tests/integration/test_worker_cli.py runs
    # the real daemon under prctl(PR_SET_MDWE), the kernel's equivalent.
    source = (REPO / "tests" / "integration" / "test_worker_cli.py").read_text()
    assert "def test_run_serves_under_memory_deny_write_execute" in source


_SYNTAX_ERROR = re.compile(r"^(?P<file>/\S+):(?P<line>\d+): (?P<what>.*)$")


def test_systemd_analyze_verify_finds_no_syntax_error(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text())
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = (done.stdout + done.stderr).splitlines()
    syntax = [line for line in output if _SYNTAX_ERROR.match(line)]
    assert syntax == [], "\n".join(syntax)
    # Anything else must be about this machine, not about the file.
    for line in output:
        assert line.startswith("octo-worker@"), line


def test_the_syntax_check_would_catch_a_broken_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    broken = tmp_path / "octo-broken@.service"
    broken.write_text(
        UNIT.read_text().replace("WatchdogSec=30", "WatchdogSec=thirty\nRestrat=always")
    )
    done = subprocess.run(
        [analyze, "verify", "--man=no", str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    syntax = [
        line for line in (done.stdout + done.stderr).splitlines() if _SYNTAX_ERROR.match(line)
    ]
    assert len(syntax) == 2, syntax
    assert any("Restrat" in line for line in syntax)


def test_provision_keys_creates_private_keys_the_worker_accepts(tmp_path: Path) -> None:
    from octo_worker.config import load_key_file, load_scope_key

    script = REPO / "deploy" / "provision-keys.sh"
    keys = tmp_path / "keys"
    done = subprocess.run(
        ["sh", str(script), "--dir", str(keys), "worker", "tenant-release", "tenant-b"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.splitlines() == [
        f"LoadCredential={name}:{keys}/{name}"
        for name in ("tenant-release.key", "tenant-b.key", "storage-k1.key")
    ]
    assert keys.stat().st_mode & 0o777 == 0o700
    contents = set()
    for name in ("tenant-release.key", "tenant-b.key", "storage-k1.key"):
        path = keys / name
        assert path.stat().st_mode & 0o777 == 0o600
        contents.add(load_key_file(path, name))
        assert path.read_bytes().hex() not in done.stdout + done.stderr
    assert len(contents) == 3  # independent random keys
    load_scope_key(keys / "tenant-release.key", "scope")

    before = (keys / "tenant-release.key").read_bytes()
    again = subprocess.run(
        ["sh", str(script), "--dir", str(keys), "worker", "tenant-release"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "exists; kept" in again.stderr
    assert (keys / "tenant-release.key").read_bytes() == before

    refused = subprocess.run(
        ["sh", str(script), "--dir", str(keys), "worker", "Not A Token"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2
    assert "not a token" in refused.stderr
