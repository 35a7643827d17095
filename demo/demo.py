#!/usr/bin/env python3
"""``make demo``: Octo's main job end to end, on the real broker, with a real daemon.

What this script owns: one demo run. It provisions a private directory
(``tempfile.mkdtemp``, mode 0700) with three fresh key files (scope key,
worker storage key, host ledger key; 0600) and a ``worker.toml`` serving a
unique tenant scope with the ``files.publish`` adapter; declares the broker
topology with ``octo-worker topology declare``; starts ``octo-worker run``
as a child process and waits for its ``READY=1`` on a real sd_notify
datagram socket; then drives a host (``HostClient`` + ``SqliteLedgerStore``
+ ``WorkflowEngine``) through publish, duplicate delivery, compensation and
a refused second compensation, and stops the daemon with SIGTERM. Each step
prints one line with what was sent and what the worker journal (read with
a separate ``SqliteJournalStore``), the host ledger (read with a separate
``SqliteLedgerStore``), the published directory and the adapter's effect
log say. Exit status 0 only when every step matched its expectation;
otherwise ``FAILED: <step>: expected X, got Y`` and exit status 1 (a daemon
that dies during the host steps fails the current step at once, with the
tail of its log). Ctrl-C or SIGTERM: cleanup, then exit status 128 + signal.

What it must never do: print a key, a nonce, a frame or a payload (keys are
shown shortened, payloads as sizes), leave the daemon running (it is stopped
on every path, Ctrl-C included), or reuse another run's scope, host id,
queues or files. This run's queues are deleted at the end; the directory
too, unless ``--keep`` asks to keep it for a look afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Final, NoReturn

import structlog

from octo_common.digest import compensation_key_for
from octo_common.errors import (
    CompensationActionDenied,
    CompensationAlreadyRecorded,
    CompensationGrantDenied,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CompensateOperation,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationResult,
    RequestRejected,
    WorkerMessage,
    message_type,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKeyring
from octo_common.states import StateKind, Succeeded
from octo_common.transport import reply_queue, worker_queue
from octo_host.amqp import connect
from octo_host.client import HostClient, HostRun, HostSession
from octo_host.compensation import (
    WorkflowCompensationAction,
    WorkflowCompensationDispatch,
    WorkflowCompensationPolicy,
    WorkflowCompensationTarget,
)
from octo_host.engine import OutboundFrame
from octo_host.ledger import WorkflowOperation, WorkflowOperationLedger
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore, ledger_record_key, load_storage_key
from octo_worker.adapters.files import read_effect_log
from octo_worker.config import load_config, load_scope_key
from octo_worker.journal import WorkerOperationRecord
from octo_worker.store import SqliteJournalStore

BROKER_PASSWORD: Final = "guest"
# The worker's configuration names the user; the password comes from its file.
CONFIG_URL: Final = "amqp://guest@127.0.0.1:5672/"
URL: Final = f"amqp://guest:{BROKER_PASSWORD}@127.0.0.1:5672/"
TOOL: Final = "files.publish"
RELEASE: Final = "release-42.txt"
RELEASE_TEXT: Final = "Octo release 42: durable, compensable side effects.\n"
RUN: Final = "release-42"
TOTAL: Final = 6
# One dispatch, its repeated delivery and the forged frames fit in these budgets;
# one compensation per session is the point of step 5.
GRANT: Final = CapabilityGrant(TOOL, "json", max_calls=4, max_compensations=1)
INVERSE: Final = {"undo": "publish", "name": RELEASE}
READY_TIMEOUT: Final = 20.0
STOP_TIMEOUT: Final = 15.0
REPLY_TIMEOUT: Final = 5.0
TAIL_LINES: Final = 12

STEP_NAMES: Final = (
    "worker up",
    "publish",
    "same frame again",
    "compensate",
    "second compensation",
    "stop",
)


class StepFailed(Exception):
    """A step did not match its expectation."""

    def __init__(self, step: str, expected: str, got: str) -> None:
        super().__init__(f"{step}: expected {expected}, got {got}")
        self.step, self.expected, self.got = step, expected, got


def expect(step: str, ok: bool, expected: str, got: object) -> None:
    if not ok:
        raise StepFailed(step, expected, str(got))


def short(key: str | None) -> str:
    """``op-1a2b3c4d…``: enough to tell keys apart, never the whole key."""
    if key is None:
        return "-"
    prefix, _, rest = key.partition("-")
    return f"{prefix}-{rest[:8]}…" if rest else key[:12]


def effects_text(effects: list[dict[str, Any]]) -> str:
    kinds = [str(entry.get("effect")) for entry in effects]
    if not kinds:
        return "no effect"
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())


def effect_kinds(effects: list[dict[str, Any]]) -> list[str]:
    return [str(entry.get("effect")) for entry in effects]


def write_private(path: Path, data: bytes) -> None:
    """Create ``path`` 0600 (never group or other readable, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def one_line(text: str) -> str:
    return " ".join(text.split())


# The demo directory ---------------------------------------------------------------------


class DemoDir:
    """Paths, ids and the daemon process of one demo run."""

    def __init__(self, root: Path) -> None:
        suffix = uuid.uuid4().hex[:12]
        self.root = root
        self.scope = f"demo-{suffix}"
        self.host_id = f"demo-host-{suffix}"
        self.keys = root / "keys"
        self.scope_key = self.keys / "scope.key"
        self.storage_key = self.keys / "worker-storage.key"
        self.ledger_key = self.keys / "host-ledger.key"
        self.config = root / "worker.toml"
        self.state = root / "worker"
        self.published = self.state / "published"
        self.effect_log = self.state / "effects.log"
        self.journal = self.state / "journal.sqlite3"
        self.ledger = root / "host" / "ledger.sqlite3"
        self.notify_socket = root / "notify.sock"
        self.daemon_log = root / "daemon.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.notify: socket.socket | None = None
        self.policy = "not declared"

    def provision(self) -> None:
        """Keys (0600) in a 0700 directory, and a worker.toml naming them."""
        for directory in (self.keys, self.state, self.ledger.parent):
            directory.mkdir(mode=0o700)
        for path in (self.scope_key, self.storage_key, self.ledger_key):
            write_private(path, os.urandom(32).hex().encode("ascii") + b"\n")
            if path.stat().st_mode & 0o077:
                raise StepFailed(step_name(1), f"{path.name} mode 0600", oct(path.stat().st_mode))
        # The configuration names the broker password's file; it never holds it.
        write_private(self.keys.parent / "broker.password", BROKER_PASSWORD.encode("ascii") + b"\n")
        self.config.write_text(
            f"""# Written by demo/demo.py for one demo run; names files, holds no secret.
[worker]
state_dir = "worker"
shutdown_grace_seconds = 5.0
log_level = "warning"
log_format = "json"

[broker]
url = "{CONFIG_URL}"
password_file = "broker.password"
connect_timeout_seconds = 5.0
publish_timeout_seconds = 5.0

[storage]
journal = "journal.sqlite3"
key = {{ id = "demo-worker-k1", key_file = "keys/worker-storage.key" }}

[[scopes]]
name = "{self.scope}"
key_file = "keys/scope.key"

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
""",
            encoding="utf-8",
        )
        load_config(self.config)  # the daemon's own validation, before anything starts

    def octo_worker(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "octo_worker", *args, "--config", str(self.config)]

    def daemon_tail(self) -> str:
        try:
            lines = self.daemon_log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "  (no daemon log)"
        if not lines:
            return "  (the daemon wrote nothing)"
        return "\n".join(f"  | {line}" for line in lines[-TAIL_LINES:])


# Step 1: keys, topology, daemon ------------------------------------------------------------


def declare_topology(demo: DemoDir, step: str) -> str:
    """``octo-worker topology declare``; a policy the broker refuses is a warning only."""
    done = subprocess.run(  # noqa: S603 (our own interpreter and module)
        demo.octo_worker("topology", "declare", "--json"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode == 0:
        policy = json.loads(done.stdout).get("policy") or {}
        return (
            f"policy {policy.get('name')} delivery-limit={policy.get('delivery_limit')} "
            f"via {policy.get('applied_via')}"
        )
    reason = one_line(done.stderr) or f"exit status {done.returncode}"
    expect(
        step,
        "policy" in reason,
        "octo-worker topology declare to succeed",
        f"exit status {done.returncode}: {reason}",
    )
    print(f"warning: the worker queue policy was not applied ({reason}); continuing without it")
    again = subprocess.run(  # noqa: S603
        demo.octo_worker("topology", "declare", "--skip-policy"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    expect(
        step,
        again.returncode == 0,
        "octo-worker topology declare to succeed",
        f"exit status {again.returncode}: {one_line(again.stderr)}",
    )
    return "queues only, the policy was not applied (see the warning)"


def start_daemon(demo: DemoDir, step: str) -> float:
    """Start ``octo-worker run`` and wait for READY=1 on a real notify socket."""
    started = time.monotonic()
    # The sd_notify socket systemd would give a Type=notify service: a real one.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    demo.notify = notify
    notify.bind(str(demo.notify_socket))
    notify.settimeout(0.2)
    env = {k: v for k, v in os.environ.items() if k not in ("OCTO_FAULT", "WATCHDOG_USEC")}
    env["NOTIFY_SOCKET"] = str(demo.notify_socket)
    env["PYTHONUNBUFFERED"] = "1"
    with open(demo.daemon_log, "wb") as log:
        # Its own session: Ctrl-C reaches only this script, which stops the
        # daemon with SIGTERM (and waits) on every path.
        demo.process = subprocess.Popen(  # noqa: S603
            demo.octo_worker("run"),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = started + READY_TIMEOUT
    while True:
        if "READY=1" in notifications(notify):
            return time.monotonic() - started
        status = demo.process.poll()
        if status is not None:
            raise StepFailed(
                step,
                "the worker daemon to report READY=1",
                f"it exited with status {status}; its last lines:\n{demo.daemon_tail()}",
            )
        if time.monotonic() > deadline:
            raise StepFailed(
                step,
                f"the worker daemon to report READY=1 within {READY_TIMEOUT:.0f} s",
                f"no READY=1; its last lines:\n{demo.daemon_tail()}",
            )


def notifications(notify: socket.socket) -> list[str]:
    """The ``KEY=VALUE`` lines of one datagram (none after the socket's timeout)."""
    try:
        datagram = notify.recv(4096)
    except (TimeoutError, BlockingIOError):
        return []
    return datagram.decode("utf-8", "replace").split("\n")


def stop_daemon(demo: DemoDir) -> tuple[int | None, float, bool]:
    """SIGTERM, wait (SIGKILL only if it does not stop in time).

    Returns (exit status or None when killed, seconds, whether STOPPING=1 arrived).
    """
    process = demo.process
    if process is None:
        return None, 0.0, False
    started = time.monotonic()
    seen: list[str] = []
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        deadline = started + STOP_TIMEOUT
        while process.poll() is None and time.monotonic() < deadline:
            if demo.notify is None:
                time.sleep(0.05)
            else:
                seen += notifications(demo.notify)
        if process.poll() is None:
            process.kill()
            process.wait()
    took = time.monotonic() - started
    if demo.notify is not None:  # what it sent just before exiting is still queued
        demo.notify.setblocking(False)
        while lines := notifications(demo.notify):
            seen += lines
    demo.process = None
    status = process.returncode
    return (None if status < 0 else status), took, "STOPPING=1" in seen


def close_notify(demo: DemoDir) -> None:
    if demo.notify is not None:
        demo.notify.close()
        demo.notify = None
        with contextlib.suppress(OSError):
            demo.notify_socket.unlink()


def describe(error: BaseException) -> str:
    """An unexpected error in one line: its class and code, never its arguments."""
    code = getattr(error, "code", None)
    return type(error).__name__ + (f" ({code})" if isinstance(code, str) else "")


# The host side ----------------------------------------------------------------------------


class CurrentGrant:
    """Host policy: compensation is allowed under exactly this tenant's current grant."""

    def __init__(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.tenant_scope, self.grant, self.calls = tenant_scope, grant, 0

    def verify_compensation_grant(self, tenant_scope: str, grant: CapabilityGrant) -> None:
        self.calls += 1
        if tenant_scope != self.tenant_scope or grant != self.grant:
            raise CompensationGrantDenied(grant.tool, tenant_scope)


class UndoThisPublish:
    """Host policy: the only inverse action allowed is removing the published release file."""

    def __init__(self, tenant_scope: str) -> None:
        self.tenant_scope, self.calls = tenant_scope, 0
        # The verifier sees the exact canonical inverse bytes (format, length, JSON).
        self.allowed = canonical_operation_input_bytes(ToolPayload.json(INVERSE))

    def verify_compensation_action(self, action: WorkflowCompensationAction) -> None:
        self.calls += 1
        if (
            action.tool != TOOL
            or action.tenant_scope != self.tenant_scope
            or action.compensation_input != self.allowed
        ):
            raise CompensationActionDenied(action.operation_key, action.tool, action.tenant_scope)


class Observer:
    """Reads what the worker journal, the host ledger and the files say (separate objects)."""

    def __init__(self, demo: DemoDir) -> None:
        self.demo = demo
        self.journal = SqliteJournalStore(demo.journal, load_config(demo.config).storage_keyring())
        ledger_keyring = StorageKeyring("demo-host-k1", load_storage_key(demo.ledger_key))
        self.ledger_store = SqliteLedgerStore(demo.ledger, ledger_keyring)

    async def worker_record(self, key: str) -> tuple[WorkerOperationRecord, int] | None:
        found = await self.journal.load_records(self.demo.scope, [key])
        return found.get(key)

    async def host_ledger(self) -> WorkflowOperationLedger | None:
        record = await self.ledger_store.load(ledger_record_key(RUN))
        return None if record is None else WorkflowOperationLedger.from_json(record.payload)

    async def host_operation(self, key: str) -> tuple[WorkflowOperation | None, int]:
        ledger = await self.host_ledger()
        if ledger is None:
            return None, 0
        return ledger.operation(key), ledger.revision

    def effects(self) -> list[dict[str, Any]]:
        return read_effect_log(self.demo.effect_log)

    def release(self) -> Path:
        # files.publish keeps each tenant scope's files in a directory of its own.
        return self.demo.published / self.demo.scope / RELEASE

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.journal.close()
        with contextlib.suppress(Exception):
            await self.ledger_store.close()


def state_of(value: Any) -> str:
    kind = getattr(value, "kind", value)
    return str(getattr(kind, "value", kind))


def reply_text(message: WorkerMessage) -> str:
    if isinstance(message, RequestRejected):
        return f"request_rejected {message.code}"
    if isinstance(message, OperationResult):
        return f"{message_type(message)} {state_of(message.result.status)}"
    return message_type(message)


class HostDemo:
    """Steps 2-5: one host process driving the worker through the broker."""

    def __init__(self, demo: DemoDir, observer: Observer) -> None:
        self.demo = demo
        self.observe = observer
        self.store = SqliteLedgerStore(
            demo.ledger, StorageKeyring("demo-host-k1", load_storage_key(demo.ledger_key))
        )
        self.client = HostClient(
            URL,
            host_id=demo.host_id,
            scope_keys={demo.scope: load_scope_key(demo.scope_key, "demo scope key")},
            store=self.store,
            reply_timeout=REPLY_TIMEOUT,
            publish_timeout=REPLY_TIMEOUT,
            max_attempts=2,
        )
        self.payload = ToolPayload.json({"name": RELEASE, "content": RELEASE_TEXT})
        self.inverse = ToolPayload.json(INVERSE)
        self.grant_verifier = CurrentGrant(demo.scope, GRANT)
        self.action_verifier = UndoThisPublish(demo.scope)
        self.sessions: list[HostSession] = []

    def manifest(self) -> CapabilityManifest:
        return CapabilityManifest("demo", [GRANT])

    async def start(self) -> None:
        await self.client.start()

    async def close(self) -> None:
        for session in self.sessions:
            with contextlib.suppress(Exception):
                await self.client.close_session(session)
        with contextlib.suppress(Exception):
            await self.client.close()
        with contextlib.suppress(Exception):
            await self.store.close()

    async def open_session(self) -> HostSession:
        session = await self.client.open_session(self.demo.scope, self.manifest())
        self.sessions.append(session)
        return session

    # [2/6] -------------------------------------------------------------------------------

    async def publish(self, step: str) -> tuple[HostRun, HostSession, str, Succeeded]:
        client = self.client
        plan = client.engine.plan([WorkflowStep("publish", f"publish {RELEASE}")])
        run = await client.load_run(RUN, plan)
        nonce = f"{RUN}:{self.demo.scope}".encode()
        key = await client.record_operation(
            run, "publish", TOOL, self.payload, nonce, scope=self.demo.scope
        )
        session = await self.open_session()
        state = await client.dispatch(session, run, key, self.payload)
        expect(
            step, isinstance(state, Succeeded), "the worker to answer succeeded", state_of(state)
        )
        assert isinstance(state, Succeeded)

        found = await self.observe.worker_record(key)
        expect(step, found is not None, "a worker journal row for the key", "no row")
        assert found is not None
        record, row_revision = found
        expect(
            step,
            record.state == state,
            "worker journal state succeeded (the same answer)",
            state_of(record.state),
        )
        operation, ledger_revision = await self.observe.host_operation(key)
        expect(
            step,
            operation is not None and operation.state == StateKind.SUCCEEDED,
            "host ledger state succeeded",
            None if operation is None else state_of(operation.state),
        )
        release = self.observe.release()
        expect(step, release.is_file(), f"{RELEASE} published", "no file")
        expect(
            step,
            release.read_text(encoding="utf-8") == RELEASE_TEXT,
            f"{RELEASE} to hold the published content",
            "other content",
        )
        effects = self.observe.effects()
        expect(
            step,
            effect_kinds(effects) == ["publish"],
            "effect log: 1 publish",
            effects_text(effects),
        )
        print(
            f"[2/{TOTAL}] publish {RELEASE}: dispatch_operation {short(key)} -> {state_of(state)}"
            f" | worker journal: {state_of(record.state)} (row rev {row_revision})"
            f" | host ledger: {state_of(operation.state if operation else None)}"
            f" (rev {ledger_revision}) | file present ({release.stat().st_size} B)"
            f" | effect log: {effects_text(effects)}",
            flush=True,
        )
        return run, session, key, state

    # [3/6] -------------------------------------------------------------------------------

    async def same_frame_again(
        self, step: str, run: HostRun, session: HostSession, key: str, first: Succeeded
    ) -> None:
        client = self.client
        before = await self.observe.worker_record(key)
        assert before is not None
        _, row_revision = before
        ledger_before = await self.observe.host_ledger()
        assert ledger_before is not None
        # The ledger revision behind this dispatch is the durable one: nothing to
        # persist first, and the frame is sealed against exactly that ledger.
        expect(
            step,
            ledger_before.revision == run.revision,
            f"the durable ledger at revision {run.revision} before sealing",
            ledger_before.revision,
        )
        outbound = client.engine.prepare_authenticated_operation_dispatch(
            run.plan,
            run.ledger,
            key,
            self.payload,
            f"d-demo-again-{uuid.uuid4().hex[:8]}",
            session.authenticator,
        )
        replies: list[WorkerMessage] = []
        for _ in range(2):  # the identical bytes, twice
            replies.append(await client.send(session, outbound))
        for copy, reply in enumerate(replies, start=1):
            expect(
                step,
                isinstance(reply, OperationResult) and reply.result.status == first,
                f"copy {copy}: the same succeeded answer from the journal",
                reply_text(reply),
            )
        after = await self.observe.worker_record(key)
        assert after is not None
        expect(
            step,
            after[1] == row_revision and after[0].state == first,
            f"worker journal row unchanged (rev {row_revision}, succeeded)",
            f"rev {after[1]}, {state_of(after[0].state)}",
        )
        ledger_after = await self.observe.host_ledger()
        assert ledger_after is not None
        expect(
            step,
            ledger_after.revision == ledger_before.revision,
            f"host ledger unchanged (rev {ledger_before.revision})",
            f"rev {ledger_after.revision}",
        )
        effects = self.observe.effects()
        expect(
            step,
            effect_kinds(effects) == ["publish"],
            "effect log still: 1 publish",
            effects_text(effects),
        )
        print(
            f"[3/{TOTAL}] same frame again: one dispatch_operation frame for {short(key)}"
            f" ({len(outbound.frame)} B) published twice -> copy 1: {state_of(first)} from the"
            f" journal (key already admitted), copy 2 (identical bytes): the same answer"
            f" | worker journal: row rev {row_revision} unchanged (no admission, no adapter call)"
            f" | host ledger: rev {ledger_after.revision} unchanged"
            f" | effect log: {effects_text(effects)}",
            flush=True,
        )

    # [4/6] -------------------------------------------------------------------------------

    def target(self, key: str) -> WorkflowCompensationTarget:
        policy = WorkflowCompensationPolicy(self.demo.scope, GRANT)
        return WorkflowCompensationTarget(
            key, policy, GRANT, self.grant_verifier, self.action_verifier
        )

    async def compensate(
        self, step: str, run: HostRun, session: HostSession, key: str
    ) -> tuple[WorkflowCompensationTarget, str]:
        client = self.client
        target = self.target(key)
        cmp_key = await client.record_compensation(run, target, self.inverse, b"undo:release-42")
        recorded = run.revision
        state = await client.compensate(
            session,
            run,
            target,
            WorkflowCompensationDispatch(f"c-demo-{uuid.uuid4().hex[:8]}", self.inverse),
        )
        expect(step, isinstance(state, Succeeded), "the compensation to succeed", state_of(state))
        found = await self.observe.worker_record(key)
        assert found is not None
        record, row_revision = found
        compensation = record.compensation
        expect(
            step,
            compensation is not None
            and compensation.compensation_key == cmp_key
            and compensation.state == state,
            f"worker journal: compensation {short(cmp_key)} succeeded",
            "none" if compensation is None else state_of(compensation.state),
        )
        operation, ledger_revision = await self.observe.host_operation(key)
        host_compensation = None if operation is None else operation.compensation
        expect(
            step,
            host_compensation is not None
            and host_compensation.compensation_key == cmp_key
            and host_compensation.state == StateKind.SUCCEEDED,
            "host ledger: compensation succeeded",
            "none" if host_compensation is None else state_of(host_compensation.state),
        )
        expect(step, not self.observe.release().exists(), f"{RELEASE} removed", "still there")
        effects = self.observe.effects()
        expect(
            step,
            effect_kinds(effects) == ["publish", "remove"],
            "effect log: 1 publish + 1 remove",
            effects_text(effects),
        )
        print(
            f"[4/{TOTAL}] compensate: {short(cmp_key)} recorded (ledger rev {recorded}),"
            f" approved once, compensate_operation sent -> {state_of(state)}"
            f" (grant verifier ran {self.grant_verifier.calls}x, action verifier"
            f" {self.action_verifier.calls}x)"
            f" | worker journal: original {state_of(record.state)}, compensation"
            f" {state_of(compensation.state if compensation else None)} (row rev {row_revision})"
            f" | host ledger: compensation succeeded (rev {ledger_revision})"
            f" | file gone | effect log: {effects_text(effects)}",
            flush=True,
        )
        return target, cmp_key

    # [5/6] -------------------------------------------------------------------------------

    async def second_compensation(
        self,
        step: str,
        run: HostRun,
        session: HostSession,
        key: str,
        target: WorkflowCompensationTarget,
        cmp_key: str,
    ) -> None:
        client = self.client
        # 1. The host ledger holds one compensation intent per original.
        revision = run.revision
        try:
            await client.record_compensation(run, target, self.inverse, b"undo:release-42:again")
        except CompensationAlreadyRecorded as refused:
            ledger_code = refused.code
        else:
            raise StepFailed(
                step, "the host ledger to refuse a second intent", "a second intent recorded"
            )
        ledger = await self.observe.host_ledger()
        expect(
            step,
            ledger is not None and ledger.revision == revision == run.revision,
            f"host ledger unchanged at rev {revision}",
            None if ledger is None else f"rev {ledger.revision}",
        )

        # 2. Defence in depth: a second cmp- key sealed directly with a session
        # authenticator (no ledger, no approval) must be refused by the worker:
        # in the session that spent its compensation budget, and in a fresh one.
        inverse_bytes = canonical_operation_input_bytes(self.inverse)
        forged_key = compensation_key_for(
            run.plan.fingerprint,
            key,
            TOOL,
            self.demo.scope,
            GRANT.compensation_fingerprint(),
            inverse_bytes,
            b"forged:" + uuid.uuid4().bytes,
        )
        expect(step, forged_key != cmp_key, "a different cmp- key", "the same key")
        fresh = await self.open_session()
        codes: list[str] = []
        for current in (session, fresh):
            binding = OperationCompensationBinding(
                TOOL, key, forged_key, self.demo.scope, GRANT.compensation_fingerprint()
            )
            request = OperationCompensationRequest(
                current.session_id, f"c-forged-{uuid.uuid4().hex[:8]}", binding, self.inverse
            )
            frame = current.authenticator.seal(CompensateOperation(request))
            reply = await client.send(current, OutboundFrame(request, frame))
            expect(
                step,
                isinstance(reply, RequestRejected)
                and reply.code
                in ("compensation_budget_exhausted", "compensation_identity_mismatch"),
                "the worker to answer request_rejected"
                " (compensation_budget_exhausted or compensation_identity_mismatch)",
                reply_text(reply),
            )
            assert isinstance(reply, RequestRejected)
            codes.append(reply.code)

        found = await self.observe.worker_record(key)
        assert found is not None
        record, row_revision = found
        compensation = record.compensation
        expect(
            step,
            compensation is not None and compensation.compensation_key == cmp_key,
            f"worker journal still bound to {short(cmp_key)}",
            "none" if compensation is None else short(compensation.compensation_key),
        )
        expect(step, not self.observe.release().exists(), f"{RELEASE} still absent", "present")
        effects = self.observe.effects()
        expect(
            step,
            effect_kinds(effects) == ["publish", "remove"],
            "effect log still: 1 publish + 1 remove",
            effects_text(effects),
        )
        print(
            f"[5/{TOTAL}] second compensation: host ledger refuses a second intent"
            f" ({ledger_code}, rev {revision} unchanged); forged compensate_operation"
            f" {short(forged_key)} sealed past the ledger -> worker request_rejected"
            f" {codes[0]} (same session), {codes[1]} (fresh session)"
            f" | worker journal: still {short(cmp_key)} (row rev {row_revision})"
            f" | effect log: {effects_text(effects)}",
            flush=True,
        )


def step_name(number: int) -> str:
    return f"[{number}/{TOTAL}] {STEP_NAMES[number - 1]}"


async def host_steps(host: HostDemo, current: list[str]) -> None:
    """Steps 2-5 in order; ``current[0]`` names the step under way."""
    current[0] = step_name(2)
    await host.start()
    run, session, key, first = await host.publish(current[0])
    current[0] = step_name(3)
    await host.same_frame_again(current[0], run, session, key, first)
    current[0] = step_name(4)
    target, cmp_key = await host.compensate(current[0], run, session, key)
    current[0] = step_name(5)
    await host.second_compensation(current[0], run, session, key, target, cmp_key)


async def daemon_exit(process: subprocess.Popen[bytes]) -> int:
    while (status := process.poll()) is None:
        await asyncio.sleep(0.1)
    return status


async def drive_host(demo: DemoDir) -> None:
    """Steps 2-5; a daemon that dies meanwhile fails the step at once (no reply timeouts)."""
    assert demo.process is not None
    observer = Observer(demo)
    host = HostDemo(demo, observer)
    current = [step_name(2)]
    steps = asyncio.ensure_future(host_steps(host, current))
    watcher = asyncio.ensure_future(daemon_exit(demo.process))
    try:
        await asyncio.wait({steps, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not steps.done():
            steps.cancel()
            with contextlib.suppress(BaseException):
                await steps
            raise StepFailed(
                current[0],
                "the worker daemon to keep running",
                f"it exited with status {watcher.result()}; its last lines:\n{demo.daemon_tail()}",
            )
        steps.result()
    except StepFailed:
        raise
    except Exception as error:
        raise StepFailed(current[0], "the step to complete", describe(error)) from None
    finally:
        for task in (steps, watcher):
            task.cancel()
        await asyncio.gather(steps, watcher, return_exceptions=True)
        await host.close()
        await observer.close()


async def delete_queues(demo: DemoDir) -> None:
    """Remove this run's worker and reply queues (unique names; nobody else uses them)."""
    connection = await connect(URL, timeout=5.0, name="octo-demo-cleanup")
    try:
        for name in (worker_queue(demo.scope), reply_queue(demo.host_id)):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(name)
            with contextlib.suppress(Exception):
                await channel.close()
    finally:
        await connection.close()


# Main ---------------------------------------------------------------------------------------


def quiet_host_logs() -> None:
    """Host library logs: warnings and errors only, on stderr (stdout is the demo's)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def _terminate(signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def private_directory(keep: bool) -> Iterator[Path]:
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = Path(
        tempfile.mkdtemp(prefix="octo-demo-", dir=base if base and os.path.isdir(base) else None)
    )
    os.chmod(root, 0o700)
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def run_demo(demo: DemoDir) -> None:
    step = step_name(1)
    try:
        demo.provision()
        demo.policy = declare_topology(demo, step)
        ready = start_daemon(demo, step)
    except StepFailed:
        raise
    except Exception as error:
        raise StepFailed(step, "the step to complete", describe(error)) from None
    assert demo.process is not None
    pid = demo.process.pid
    print(
        f"[1/{TOTAL}] worker up: 3 keys (0600) + worker.toml in a 0700 dir"
        f" | topology declared: {demo.policy}"
        f" | octo-worker run pid {pid} consuming {worker_queue(demo.scope)}"
        f" (READY=1 after {ready:.1f} s)",
        flush=True,
    )

    asyncio.run(drive_host(demo))

    step = step_name(6)
    status, took, stopping = stop_daemon(demo)
    expect(
        step,
        status == 0,
        "the daemon to exit 0 after SIGTERM",
        "no exit (killed)" if status is None else f"exit status {status}\n{demo.daemon_tail()}",
    )
    expect(step, stopping, "STOPPING=1 on the notify socket", "no STOPPING=1")
    print(
        f"[{TOTAL}/{TOTAL}] stop: SIGTERM to pid {pid} -> STOPPING=1, exited 0 after {took:.1f} s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Octo end to end: make demo")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the private directory (keys, journal, ledger, effect log, daemon log)",
    )
    args = parser.parse_args(argv)
    quiet_host_logs()
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    status = 1
    with private_directory(args.keep) as root:
        demo = DemoDir(root)
        print(
            "Octo: at-most-once, compensable side effects; the host ledger and the worker"
            " journal record every intent before anything runs, and talk only in sealed"
            " frames over RabbitMQ."
        )
        print(f"  scope {demo.scope} | host {demo.host_id} | private dir {root} (0700)", flush=True)
        try:
            run_demo(demo)
            status = 0
        except StepFailed as failed:
            print(f"FAILED: {failed.step}: expected {failed.expected}, got {failed.got}")
        except KeyboardInterrupt as interrupt:
            # SIGINT (Ctrl-C) or SIGTERM (see _terminate): clean up, then 128 + signal.
            terminated = bool(interrupt.args) and interrupt.args[0] == "SIGTERM"
            print("interrupted: stopping the daemon and cleaning up", flush=True)
            status = 128 + (signal.SIGTERM if terminated else signal.SIGINT)
        finally:
            stop_daemon(demo)  # already stopped after step 6; here for every other path
            close_notify(demo)
            # The queues go in any case (the daemon declares them again when run).
            with contextlib.suppress(Exception):
                asyncio.run(delete_queues(demo))
        elapsed = time.monotonic() - started
        if status == 0:
            kept = f"kept in {root}" if args.keep else "keys, files and queues removed"
            print(f"OK: all {TOTAL} steps matched their expectations in {elapsed:.1f} s ({kept})")
            if args.keep:
                print(
                    f"  look: {sys.executable} -m octo_worker journal list --config {demo.config}"
                )
        else:
            what = "interrupted" if status > 128 else "failed"
            kept = f"; files kept in {root}" if args.keep else ""
            print(f"demo {what} after {elapsed:.1f} s{kept}")
    return status


if __name__ == "__main__":
    sys.exit(main())
