"""The ``octo-host`` command as a user runs it: a subprocess against the real broker.

Each test writes its own ``host.toml`` (the worker's scope key file, a
ledger key made by ``octo-host keys generate``, a files.publish grant, an
action rule and a plan), runs ``python -m octo_host ...`` and looks at the
exit status, stdout, stderr, the published directory and the worker's
effect log. The worker is the in-process daemon of ``conftest.py``, started
in the test's event loop, so the subprocesses are awaited asynchronously.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from octo_worker.adapters.files import read_effect_log

from .conftest import TOOL, Names, WorkerEnv, WorkerRunner, write_private

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

PYTHON = sys.executable
RUN = "release-7"
PUBLISH = json.dumps({"name": "notes.txt", "content": "secret-release-body"})
UNDO = json.dumps({"undo": "publish", "name": "notes.txt"})
REASON = "provider support confirmed nothing was published (ticket 4711)"


@dataclass
class Result:
    status: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


class HostCli:
    """One host configuration in ``tmp_path/host`` and a runner for the command."""

    def __init__(self, root: Path, names: Names, worker: WorkerEnv) -> None:
        self.root = root
        self.names = names
        self.worker = worker
        self.host_id = names.host()
        self.config = root / "host.toml"
        self.keys = root / "keys"
        self.scope_key = self.keys / f"{names.scope}.key"
        self.ledger_key = self.keys / "storage-h1.key"

    def write_config(
        self, *, url: str = "amqp://127.0.0.1:5672/", extra: str = "", extra_broker: str = ""
    ) -> None:
        self.config.write_text(
            f"""
[host]
host_id = "{self.host_id}"

[broker]
url = "{url}"
connect_timeout_seconds = 3.0
publish_timeout_seconds = 5.0
reply_timeout_seconds = 5.0
max_attempts = 4
backoff_initial_seconds = 0.05
{extra_broker}

[ledger]
database = "state/ledger.sqlite3"
key = {{ id = "h1", key_file = "keys/storage-h1.key" }}

[[scopes]]
name = "{self.names.scope}"
key_file = "keys/{self.names.scope}.key"

[[grants]]
scope = "{self.names.scope}"
tool = "{TOOL}"
format = "json"
max_calls = 8
max_compensations = 1

[[actions]]
tool = "{TOOL}"
inverse = {{ undo = "publish" }}
match = ["name"]

[[plans]]
name = "release"
steps = [{{ id = "publish", source = "publish the release notes" }}]
{extra}
""",
            encoding="utf-8",
        )

    async def run(
        self, *args: str, config: bool = True, env: dict[str, str] | None = None
    ) -> Result:
        argv = [PYTHON, "-m", "octo_host", *args]
        if config:
            argv += ["--config", str(self.config)]
        environment = {k: v for k, v in os.environ.items() if k != "OCTO_FAULT"}
        environment.update(env or {})
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60.0)
        assert process.returncode is not None
        return Result(process.returncode, stdout.decode(), stderr.decode())

    async def provision(self) -> None:
        """Ledger key from ``keys generate``; the worker's scope key copied in (0600)."""
        generated = await self.run("keys", "generate", "--storage", "h1", "--out", str(self.keys))
        assert generated.status == 0, generated.stderr
        key_file = self.worker.root / "worker" / "keys" / "scope.key"
        write_private(self.scope_key, key_file.read_bytes())
        self.write_config()

    async def dispatch(self, *extra: str) -> Result:
        return await self.run(
            "dispatch", RUN, "--plan", "release", "--step", "publish", "--tool", TOOL,
            "--scope", self.names.scope, "--payload", PUBLISH, "--json", *extra,
        )  # fmt: skip


def assert_one_line_error(result: Result, *fragments: str) -> None:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("octo-host: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
async def cli(tmp_path: Path, names: Names, worker_env: WorkerEnv) -> HostCli:
    host = HostCli(tmp_path / "host", names, worker_env)
    await host.provision()
    return host


# keys ------------------------------------------------------------------------------------


async def test_keys_generate_writes_a_private_key_once(tmp_path: Path, cli: HostCli) -> None:
    out = tmp_path / "new-keys"
    made = await cli.run("keys", "generate", "--scope", "tenant-a", "--out", str(out), "--json")

    assert made.status == 0, made.stderr
    path = out / "tenant-a.key"
    assert made.json() == {"ok": True, "kind": "scope", "path": str(path)}
    content = path.read_bytes()
    assert len(content) == 65 and content.endswith(b"\n")
    bytes.fromhex(content[:64].decode())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert content[:64].decode() not in made.stdout + made.stderr

    again = await cli.run("keys", "generate", "--scope", "tenant-a", "--out", str(out))
    assert again.status == 1
    assert_one_line_error(again, str(path), "refusing to overwrite")
    assert path.read_bytes() == content

    storage = await cli.run("keys", "generate", "--storage", "k2", "--out", str(out))
    assert storage.status == 0 and storage.stdout.strip() == str(out / "storage-k2.key")
    assert stat.S_IMODE((out / "storage-k2.key").stat().st_mode) == 0o600


# the main path ----------------------------------------------------------------------------


async def test_dispatch_show_compensate_and_a_refused_second_compensation(
    daemon: object, cli: HostCli, worker_env: WorkerEnv
) -> None:
    dispatched = await cli.dispatch()
    assert dispatched.status == 0, dispatched.stderr
    result = dispatched.json()
    key = result["operation_key"]
    assert result["ok"] is True and result["newly_recorded"] is True
    assert result["observed"]["state"] == "succeeded"
    assert result["ledger_state"] == "succeeded" and result["revision"] == 2
    assert (worker_env.shelf / "notes.txt").read_text() == "secret-release-body"
    assert "secret-release-body" not in dispatched.stdout + dispatched.stderr

    # The same command again: the same derived key, answered, no second effect.
    repeated = await cli.dispatch()
    assert repeated.status == 0, repeated.stderr
    assert repeated.json()["operation_key"] == key
    assert repeated.json()["newly_recorded"] is False
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]

    reconciled = await cli.run(
        "reconcile", RUN, key, "--scope", cli.names.scope, "--payload", PUBLISH, "--json"
    )
    assert reconciled.status == 0, reconciled.stderr
    assert reconciled.json()["observed"]["state"] == "succeeded"
    wrong = await cli.run(
        "reconcile", RUN, key, "--scope", cli.names.scope, "--payload", UNDO, "--json"
    )
    assert wrong.status == 1
    assert_one_line_error(wrong, "input_fingerprint_mismatch")
    assert "undo" not in wrong.stderr  # the payload is never echoed

    shown = await cli.run("ledger", "show", RUN, "--json")
    assert shown.status == 0, shown.stderr
    ledger = shown.json()
    assert ledger["plan"] == "release" and ledger["format_version"] == 2
    [operation] = ledger["operations"]
    assert operation["operation_key"] == key and operation["state"] == "succeeded"
    assert operation["step"] == "publish" and operation["compensation"] is None
    assert "secret-release-body" not in shown.stdout
    human = await cli.run("ledger", "show", RUN)
    assert key in human.stdout and "succeeded" in human.stdout

    compensated = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", UNDO,
        "--nonce", "undo-1", "--original", PUBLISH, "--json",
    )  # fmt: skip
    assert compensated.status == 0, compensated.stderr
    document = compensated.json()
    assert document["compensation_key"].startswith("cmp-")
    assert document["compensation_state"] == "succeeded"
    assert not (worker_env.shelf / "notes.txt").exists()
    assert len(read_effect_log(worker_env.effect_log)) == 2

    second = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", UNDO,
        "--nonce", "undo-2", "--original", PUBLISH,
    )  # fmt: skip
    assert second.status == 1
    assert_one_line_error(second, "compensation_already_recorded")
    assert len(read_effect_log(worker_env.effect_log)) == 2

    # A compensated operation is never an operator's to resolve.
    resolve = await cli.run(
        "resolve", RUN, key, "--state", "failed", "--reason", "test", "--operator", "alice"
    )
    assert resolve.status == 1
    assert_one_line_error(resolve, "has a compensation")

    after = (await cli.run("ledger", "show", RUN, "--json")).json()
    compensation = after["operations"][0]["compensation"]
    assert compensation["compensation_key"] == document["compensation_key"]
    assert compensation["state"] == "succeeded"


async def test_the_action_rule_refuses_another_inverse_before_anything_is_recorded(
    daemon: object, cli: HostCli, worker_env: WorkerEnv
) -> None:
    key = (await cli.dispatch()).json()["operation_key"]
    other_file = json.dumps({"undo": "publish", "name": "other.txt"})
    refused = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", other_file,
        "--nonce", "undo-1", "--original", PUBLISH,
    )  # fmt: skip
    assert refused.status == 1
    assert_one_line_error(refused, "compensation_action_denied")
    without = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", UNDO, "--nonce", "u"
    )
    assert without.status == 2
    assert_one_line_error(without, "--original: required for files.publish", "name")
    # A different "original" than the one recorded is refused the same way.
    forged = json.dumps({"name": "other.txt", "content": "x"})
    refused = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", other_file,
        "--nonce", "undo-1", "--original", forged,
    )  # fmt: skip
    assert_one_line_error(refused, "compensation_action_denied")
    ledger = (await cli.run("ledger", "show", RUN, "--json")).json()
    assert ledger["operations"][0]["compensation"] is None
    assert (worker_env.shelf / "notes.txt").exists()


# recovery and operator decisions ---------------------------------------------------------


async def test_recover_dispatches_a_key_the_worker_never_saw(
    workers: WorkerRunner, cli: HostCli, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    # No worker yet: the operation is recorded, then the publish finds no queue.
    first = await cli.dispatch()
    assert first.status == 3
    assert_one_line_error(first, "no worker queue")
    ledger = (await cli.run("ledger", "show", RUN, "--json")).json()
    [operation] = ledger["operations"]
    key = operation["operation_key"]
    assert operation["state"] == "pending"

    await workers.start()
    never = await cli.run("reconcile", RUN, key, "--scope", cli.names.scope, "--payload", PUBLISH)
    assert never.status == 1
    assert_one_line_error(never, "never admitted", key)
    # One [[scopes]] entry: --scope may be left out.
    blind = await cli.run("recover", RUN, "--json")
    assert blind.status == 1
    assert blind.json()["unresolved"] == [key]
    assert_one_line_error(blind, "unresolved", key)
    human = await cli.run("recover", RUN)
    assert human.status == 1
    assert f"unresolved: {key}: no input given" in human.stdout
    assert "no operations" not in human.stdout

    # A wrong input is refused by its recorded fingerprint, named with its code.
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"operations": {key: {"name": "x.txt", "content": "no"}}}))
    refused = await cli.run("recover", RUN, "--inputs", str(wrong), "--json")
    assert refused.status == 1
    assert refused.json()["unresolved"] == [key]
    assert refused.json()["errors"] == {key: "input_fingerprint_mismatch"}
    assert read_effect_log(worker_env.effect_log) == []

    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"operations": {key: json.loads(PUBLISH)}}))
    # The tool's grant removed from the configuration: refused with the code the
    # worker would answer, and the hint does not ask for inputs already given.
    configured = cli.config.read_text()
    granted = f'scope = "{cli.names.scope}"\ntool = "{TOOL}"'
    assert granted in configured
    cli.config.write_text(configured.replace(granted, f'scope = "{cli.names.scope}"\ntool = "x.y"'))
    revoked = await cli.run("recover", RUN, "--inputs", str(inputs), "--json")
    assert revoked.status == 1
    assert revoked.json()["errors"] == {key: "unknown_tool"}
    assert_one_line_error(revoked, "see the reasons above")
    cli.config.write_text(configured)

    recovered = await cli.run(
        "recover", RUN, "--scope", cli.names.scope, "--inputs", str(inputs), "--json"
    )
    assert recovered.status == 0, recovered.stderr
    summary = recovered.json()
    assert summary["operations"] == {key: "succeeded"}
    assert summary["reconciled"] == [key] and summary["unresolved"] == []
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]


async def test_resolve_records_an_audited_decision_without_sending_anything(
    workers: WorkerRunner, cli: HostCli, worker_env: WorkerEnv
) -> None:
    assert (await cli.dispatch()).status == 3  # recorded, never delivered
    key = (await cli.run("ledger", "show", RUN, "--json")).json()["operations"][0]["operation_key"]

    resolved = await cli.run(
        "resolve", RUN, key, "--state", "failed", "--reason", REASON, "--operator", "alice",
        "--json", "--verbose", "--host-only",
    )  # fmt: skip
    assert resolved.status == 0, resolved.stderr
    assert "operation_resolved_by_operator" in resolved.stderr  # logged, without the reason
    decision = resolved.json()
    assert decision["from"] == "pending" and decision["to"] == "failed"
    assert decision["operator"] == "alice" and decision["ledger_revision"] == 2
    assert REASON not in resolved.stdout + resolved.stderr

    ledger = (await cli.run("ledger", "show", RUN, "--json")).json()
    assert ledger["operations"][0]["state"] == "failed" and ledger["revision"] == 2

    audit = await cli.run("audit", "show", RUN, "--json")
    assert audit.status == 0, audit.stderr
    [entry] = audit.json()["entries"]
    assert entry["operation_key"] == key and entry["operator"] == "alice"
    assert entry["from"] == "pending" and entry["to"] == "failed"
    assert entry["reason"] == REASON and entry["ledger_agrees"] is True
    assert entry["ledger_revision"] == 2 and entry["time"].endswith("Z")

    # Terminal now: a second decision is refused and nothing is appended.
    again = await cli.run(
        "resolve", RUN, key, "--state", "succeeded", "--reason", "changed my mind",
        env={"USER": "bob"},
    )  # fmt: skip
    assert again.status == 1
    assert_one_line_error(again, "terminal")
    assert len((await cli.run("audit", "show", RUN, "--json")).json()["entries"]) == 1
    # Nothing reached a worker: none ran, and no effect was logged.
    assert read_effect_log(worker_env.effect_log) == []


async def test_a_tampered_audit_record_or_ledger_is_refused_as_storage(
    workers: WorkerRunner, cli: HostCli
) -> None:
    assert (await cli.dispatch()).status == 3  # recorded, never delivered
    key = (await cli.run("ledger", "show", RUN, "--json")).json()["operations"][0]["operation_key"]
    resolved = await cli.run(
        "resolve", RUN, key, "--state", "cancelled", "--reason", REASON, "--operator", "carol",
        "--host-only",
    )  # fmt: skip
    assert resolved.status == 0, resolved.stderr

    database = cli.root / "state" / "ledger.sqlite3"
    for namespace, verb in [("workflow-audit", "audit"), ("workflow-ledger", "ledger")]:
        with sqlite3.connect(database) as connection:
            (envelope,) = connection.execute(
                "SELECT envelope FROM items WHERE namespace = ? AND name = ?", (namespace, RUN)
            ).fetchone()
            # The last hex digit of the tag (the envelope ends with `..."auth_tag":"<hex>"}`).
            tampered = bytearray(envelope)
            tampered[-3] = ord("0") if tampered[-3] != ord("0") else ord("1")
            connection.execute(
                "UPDATE items SET envelope = ? WHERE namespace = ? AND name = ?",
                (bytes(tampered), namespace, RUN),
            )
        refused = await cli.run(verb, "show", RUN)
        assert refused.status == 4, refused.stderr
        assert_one_line_error(refused, "ledger storage", "invalid_record_authentication_tag")
        assert REASON not in refused.stderr


CRASH = {"OCTO_FAULT": "host.after_ledger_commit"}


async def test_a_dispatch_killed_before_publishing_is_finished_by_the_same_command(
    daemon: object, cli: HostCli, worker_env: WorkerEnv
) -> None:
    killed = await cli.run(
        "dispatch", RUN, "--plan", "release", "--step", "publish", "--tool", TOOL,
        "--scope", cli.names.scope, "--payload", PUBLISH, env=CRASH,
    )  # fmt: skip
    assert killed.status == -9  # SIGKILL after the ledger commit, before the publish
    [pending] = (await cli.run("ledger", "show", RUN, "--json")).json()["operations"]
    assert pending["state"] == "pending"
    assert read_effect_log(worker_env.effect_log) == []

    again = await cli.dispatch()
    assert again.status == 0, again.stderr
    assert again.json()["operation_key"] == pending["operation_key"]
    assert again.json()["newly_recorded"] is False
    assert len(read_effect_log(worker_env.effect_log)) == 1


async def _compensation_killed_before_it_was_sent(
    cli: HostCli, worker_env: WorkerEnv
) -> tuple[str, dict[str, Any]]:
    """A succeeded dispatch, then `compensate` SIGKILLed after its ledger commit.

    Returns the operation key and the ledger's compensation (``pending``)."""
    key = (await cli.dispatch()).json()["operation_key"]
    killed = await cli.run(
        "compensate", RUN, key, "--scope", cli.names.scope, "--payload", UNDO,
        "--nonce", "undo-1", "--original", PUBLISH, env=CRASH,
    )  # fmt: skip
    assert killed.status == -9
    [operation] = (await cli.run("ledger", "show", RUN, "--json")).json()["operations"]
    compensation: dict[str, Any] = operation["compensation"]
    assert operation["state"] == "succeeded" and compensation["state"] == "pending"
    assert (worker_env.shelf / "notes.txt").exists()
    return key, compensation


async def test_recover_finishes_a_compensation_killed_before_it_was_sent(
    daemon: object, cli: HostCli, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    key, compensation = await _compensation_killed_before_it_was_sent(cli, worker_env)

    inputs = tmp_path / "inputs.json"
    inputs.write_text(
        json.dumps(
            {"compensations": {key: {"inverse": json.loads(UNDO), "original": json.loads(PUBLISH)}}}
        )
    )
    recovered = await cli.run(
        "recover", RUN, "--scope", cli.names.scope, "--inputs", str(inputs), "--json"
    )
    assert recovered.status == 0, recovered.stderr
    summary = recovered.json()
    assert summary["compensations"] == {key: "succeeded"}
    assert summary["reconciled"] == [compensation["compensation_key"]]
    assert not (worker_env.shelf / "notes.txt").exists()
    assert len(read_effect_log(worker_env.effect_log)) == 2


async def test_resolve_decides_a_stuck_compensation_by_its_cmp_key(
    daemon: object, cli: HostCli, worker_env: WorkerEnv
) -> None:
    key, compensation = await _compensation_killed_before_it_was_sent(cli, worker_env)
    cmp_key = compensation["compensation_key"]

    # The original is not the operator's to decide; the refusal names the compensation.
    refused = await cli.run(
        "resolve", RUN, key, "--state", "failed", "--reason", REASON, "--operator", "alice"
    )
    assert refused.status == 1
    assert_one_line_error(refused, "has a compensation", cmp_key)

    resolved = await cli.run(
        "resolve", RUN, cmp_key, "--state", "cancelled", "--reason", REASON,
        "--operator", "alice", "--json", "--verbose",
    )  # fmt: skip
    assert resolved.status == 0, resolved.stderr
    assert "compensation_resolved_by_operator" in resolved.stderr
    assert REASON not in resolved.stdout + resolved.stderr
    decision = resolved.json()
    assert decision["operation_key"] == cmp_key
    assert decision["from"] == "pending" and decision["to"] == "cancelled"

    ledger = (await cli.run("ledger", "show", RUN, "--json")).json()
    [after] = ledger["operations"]
    assert after["state"] == "succeeded" and after["compensation"]["state"] == "cancelled"
    assert ledger["revision"] == decision["ledger_revision"]
    [entry] = (await cli.run("audit", "show", RUN, "--json")).json()["entries"]
    assert entry["operation_key"] == cmp_key and entry["ledger_agrees"] is True
    assert entry["from"] == "pending" and entry["to"] == "cancelled"

    # Terminal now: refused, nothing appended; and no inverse ever ran.
    again = await cli.run(
        "resolve", RUN, cmp_key, "--state", "succeeded", "--reason", "no", "--operator", "bob"
    )
    assert again.status == 1
    assert_one_line_error(again, "compensation is already cancelled")
    assert len((await cli.run("audit", "show", RUN, "--json")).json()["entries"]) == 1
    assert [e["operation_key"] for e in read_effect_log(worker_env.effect_log)] == [key]
    assert (worker_env.shelf / "notes.txt").exists()


async def test_recover_goes_on_past_a_compensation_whose_grant_was_revoked(
    daemon: object, cli: HostCli, worker_env: WorkerEnv, tmp_path: Path
) -> None:
    key, compensation = await _compensation_killed_before_it_was_sent(cli, worker_env)
    second = PUBLISH.replace("notes.txt", "more.txt")
    killed = await cli.run(
        "dispatch", RUN, "--plan", "release", "--step", "publish", "--tool", TOOL,
        "--scope", cli.names.scope, "--payload", second, "--nonce", "second", env=CRASH,
    )  # fmt: skip
    assert killed.status == -9
    pending = [
        op["operation_key"]
        for op in (await cli.run("ledger", "show", RUN, "--json")).json()["operations"]
        if op["state"] == "pending"
    ]
    assert len(pending) == 1
    # The operator revokes compensation for the tool.
    text = cli.config.read_text()
    cli.config.write_text(text.replace("max_compensations = 1", "max_compensations = 0"))

    inputs = tmp_path / "inputs.json"
    inputs.write_text(
        json.dumps(
            {
                "operations": {pending[0]: json.loads(second)},
                "compensations": {
                    key: {"inverse": json.loads(UNDO), "original": json.loads(PUBLISH)}
                },
            }
        )
    )
    recovered = await cli.run("recover", RUN, "--inputs", str(inputs), "--json")
    assert recovered.status == 1, recovered.stderr
    summary = recovered.json()
    cmp_key = compensation["compensation_key"]
    assert summary["errors"] == {cmp_key: "compensation_not_granted"}
    assert summary["unresolved"] == [cmp_key]
    assert summary["operations"][pending[0]] == "succeeded"  # the other key went on
    assert summary["compensations"] == {key: "pending"}
    assert (worker_env.shelf / "notes.txt").exists()  # no inverse ran
    assert (worker_env.shelf / "more.txt").exists()


async def test_a_configured_anchor_must_exist_and_init_anchor_creates_it(
    daemon: object, cli: HostCli
) -> None:
    assert (await cli.dispatch()).status == 0
    cli.write_config(extra="")
    text = cli.config.read_text()
    cli.config.write_text(
        text.replace('database = "state/ledger.sqlite3"', 'database = "state/ledger.sqlite3"\n'
                     'anchor = "state/ledger.anchor"')
    )  # fmt: skip
    blocked = await cli.run("ledger", "show", RUN)
    assert blocked.status == 4
    assert_one_line_error(blocked, "rollback_anchor_missing", "octo-host ledger init-anchor")

    created = await cli.run("ledger", "init-anchor")
    assert created.status == 0, created.stderr
    assert stat.S_IMODE((cli.root / "state" / "ledger.anchor").stat().st_mode) == 0o600
    assert (await cli.run("ledger", "show", RUN)).status == 0
    refused = await cli.run("ledger", "init-anchor")
    assert refused.status == 1
    assert_one_line_error(refused, "already exists")


# failures: configuration, keys, broker -------------------------------------------------


async def test_a_wrong_configuration_exits_2_naming_the_key(cli: HostCli) -> None:
    cli.write_config(extra="\n[[grants]]\nscope = 'nope'\ntool = 'x'\nformat = 'json'\n")
    bad = await cli.run("ledger", "show", RUN)
    assert bad.status == 2
    assert_one_line_error(bad, "grants[1].scope")

    cli.config.write_text(cli.config.read_text().replace("host_id", "hostid"))
    bad = await cli.run("ledger", "show", RUN, "--json")
    assert bad.status == 2
    assert bad.json()["ok"] is False
    assert_one_line_error(bad, "hostid")

    missing = await cli.run(
        "ledger", "show", RUN, "--config", "/nonexistent/host.toml", config=False
    )
    assert missing.status == 2
    assert_one_line_error(missing, "does not exist")


@pytest.mark.parametrize("which", ["scope", "ledger"])
async def test_a_world_readable_key_exits_2_naming_the_file(cli: HostCli, which: str) -> None:
    key_file = cli.scope_key if which == "scope" else cli.ledger_key
    key_file.chmod(0o644)
    result = await cli.dispatch()
    assert result.status == 2
    assert_one_line_error(result, str(key_file), "chmod 600")
    content = key_file.read_bytes()
    secret = content.hex() if len(content) == 32 else content[:64].decode()
    assert secret not in result.stderr


async def test_an_unreachable_broker_exits_3(cli: HostCli) -> None:
    cli.write_config(
        url="amqp://guest:guest@127.0.0.1:1/", extra_broker="allow_inline_password = true"
    )
    result = await cli.dispatch()
    assert result.status == 3
    assert_one_line_error(result, "unreachable", "127.0.0.1:1")
    assert "guest:guest" not in result.stderr


async def test_a_password_inline_in_the_broker_url_is_refused_without_the_flag(
    cli: HostCli,
) -> None:
    cli.write_config(url="amqp://guest:guest@127.0.0.1:1/")
    result = await cli.dispatch()
    assert result.status == 2
    assert_one_line_error(result, "broker_password_inline", "password_file")
    assert "guest:guest" not in result.stderr


async def test_a_head_digest_set_to_null_hides_no_deleted_record(
    daemon: object, cli: HostCli, worker_env: WorkerEnv
) -> None:
    """Without an anchor: the store head's digest set to NULL (as if the migration had
    left it to be built) with a record deleted beside it. Only the migration's sealed
    record may say "to be built"; this is refused, and nothing is dispatched again."""
    dispatched = await cli.dispatch()
    assert dispatched.status == 0, dispatched.stderr
    database = cli.root / "state" / "ledger.sqlite3"
    with sqlite3.connect(database) as connection:
        # The run's record deleted whole (its row and its head row), as if never written.
        for table in ("items", "heads"):
            deleted = connection.execute(
                f"DELETE FROM {table} WHERE namespace = 'workflow-ledger' AND name = ? "
                "RETURNING name",
                (RUN,),
            ).fetchall()
            assert deleted
        connection.execute("UPDATE store_head SET digest = NULL WHERE id = 1")
    shown = await cli.run("ledger", "show", RUN)
    assert shown.status == 4, shown.stderr
    assert_one_line_error(shown, "cannot open", "rollback_detected")
    again = await cli.dispatch()
    assert again.status == 4, again.stderr
    assert_one_line_error(again, "rollback_detected")
    assert len(read_effect_log(worker_env.effect_log)) == 1
