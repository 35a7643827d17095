"""``files.publish`` on a directory two worker processes share (failover).

The owner of a scope and the standby that takes it over use one
``target_dir`` and one effect log. These tests hold an operation's lock from
a real second process (a Python child that ``flock``s the lock file, or is
SIGKILLed holding it) and use a second adapter instance on the same files as
the superseded worker woken up after its standby's lookup, or as the owner
and its standby appending to the effect log at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import octo_worker.adapters.files as files_module
from octo_common.errors import AdapterIndeterminate
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.adapters.files_disk import append_line, fill_line, reserve_line

from . import test_files_adapter as single
from .test_files_adapter import (
    KEY,
    NOT_HAPPENED,
    OTHER_KEY,
    Crash,
    args_for,
    crash_between_link_and_log_line,
    crash_on,
    dispatch,
    expected_success,
    operation_idempotency_key,
    publish_payload,
    reconcile,
    record_path,
    record_state,
    shelf,
)

_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


# The owner's files and adapter, as the single-process tests have them.
target = single.target
log_path = single.log_path
adapter = single.adapter


@pytest.fixture
def standby(target: Path, log_path: Path) -> Iterator[FilesPublishAdapter]:
    instance = FilesPublishAdapter(target, log_path)
    yield instance
    instance.close()


def lock_file(target: Path) -> Path:
    return target / ".octo-publish" / f"lock.{operation_idempotency_key(KEY)}"


@pytest.fixture
def holder(target: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of KEY's operation until it ends."""
    path = lock_file(target)
    path.parent.mkdir(parents=True, mode=0o700)
    process = subprocess.Popen(  # fixed argv, no shell
        [sys.executable, "-c", _HOLDER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "held"
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(5.0)


async def test_a_lookup_of_an_operation_never_published_settles_it_for_every_process(
    adapter: FilesPublishAdapter, standby: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    owner = adapter
    # The standby looks up an operation the superseded owner admitted but had
    # not run; the owner, woken up, then reaches its adapter call.
    assert await standby.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED
    late = await owner.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    assert late == NOT_HAPPENED
    assert not (shelf(target) / "notes.txt").exists()
    assert read_effect_log(log_path) == []
    assert record_state(target, KEY) == "refused"
    assert await owner.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED


async def test_while_another_process_holds_an_operation_both_calls_are_indeterminate(
    standby: FilesPublishAdapter, target: Path, log_path: Path, holder: subprocess.Popen[str]
) -> None:
    with pytest.raises(AdapterIndeterminate):
        await standby.reconcile_operation(*args_for(reconcile(KEY)))
    with pytest.raises(AdapterIndeterminate):
        await standby.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    assert not (target / ".octo-publish" / f"pub.{operation_idempotency_key(KEY)}.json").exists()
    assert read_effect_log(log_path) == []

    assert holder.stdin is not None
    holder.stdin.close()  # the holder finishes and lets go
    holder.wait(5.0)
    published = await standby.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("notes.txt")))
    )
    assert published == expected_success("notes.txt")
    assert len(read_effect_log(log_path)) == 1


async def test_a_holder_killed_by_sigkill_leaves_no_lock_behind(
    standby: FilesPublishAdapter, target: Path, holder: subprocess.Popen[str]
) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    assert holder.wait(5.0) == -signal.SIGKILL

    assert await standby.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED
    assert lock_file(target).exists()


async def test_a_line_another_process_appended_meanwhile_never_doubles_an_effect_line(
    adapter: FilesPublishAdapter,
    standby: FilesPublishAdapter,
    target: Path,
    log_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    owner = adapter
    # The owner records its publication's intent, then pauses before writing
    # the file; meanwhile the standby publishes another operation, so the
    # log grows while the owner is inside its publication.
    paused, resume = threading.Event(), threading.Event()
    real_write = files_module.write_new_file

    def write_new_file(path: Path, data: bytes, mode: int) -> None:
        if data == b"the owner's notes":
            paused.set()
            assert resume.wait(5.0)
        real_write(path, data, mode)

    monkeypatch.setattr(files_module, "write_new_file", write_new_file)
    # The owner is cut after its effect line, before its `published` record.
    owner_key = operation_idempotency_key(KEY).encode()
    crash_on(
        monkeypatch,
        "replace_file",
        when=lambda path, data: b'"published"' in data and owner_key in data,
    )
    publishing = asyncio.ensure_future(
        owner.dispatch_operation(
            *args_for(dispatch(KEY, publish_payload("notes.txt", "the owner's notes")))
        )
    )
    assert await asyncio.to_thread(paused.wait, 5.0)
    published = await standby.dispatch_operation(
        *args_for(dispatch(OTHER_KEY, publish_payload("other.txt")))
    )
    assert published == expected_success("other.txt")
    resume.set()
    with pytest.raises(Crash):
        await publishing
    monkeypatch.undo()
    assert record_state(target, KEY) == "publishing"

    # The standby's lookup settles the owner's publication: its one line stands.
    settled = await standby.reconcile_operation(*args_for(reconcile(KEY)))
    assert settled == expected_success("notes.txt", "the owner's notes")
    assert record_state(target, KEY) == "published"
    counts = Counter((e["effect"], e["operation_key"]) for e in read_effect_log(log_path))
    assert counts == {("publish", KEY): 1, ("publish", OTHER_KEY): 1}
    assert sorted(os.listdir(shelf(target))) == ["notes.txt", "other.txt"]


def test_a_line_is_written_over_its_reservation_once_or_appended_if_it_was_lost(
    log_path: Path,
) -> None:
    line, placeholder = b'{"effect":"publish","idempotency_key":"k1"}\n', b"#publish k1"
    placeholder += b" " * (len(line) - len(placeholder) - 1) + b"\n"
    append_line(log_path, b'{"effect":"publish","idempotency_key":"k0"}\n')
    at = reserve_line(log_path, placeholder)
    append_line(log_path, b'{"effect":"publish","idempotency_key":"k2"}\n')  # another process
    assert [e["idempotency_key"] for e in read_effect_log(log_path)] == ["k0", "k2"]
    for _ in range(2):
        fill_line(log_path, at, line, placeholder)
        assert [e["idempotency_key"] for e in read_effect_log(log_path)] == ["k0", "k1", "k2"]

    # A reservation a power cut lost: another line took its place; the line is appended.
    lost = log_path.parent / "lost.log"
    append_line(lost, b'{"effect":"publish","idempotency_key":"k3"}\n')
    fill_line(lost, 0, line, placeholder)
    assert [e["idempotency_key"] for e in read_effect_log(lost)] == ["k3", "k1"]


async def test_a_cut_publication_recorded_before_reservations_is_logged_once(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await crash_between_link_and_log_line(target, log_path, monkeypatch)
    # The record as the adapter wrote it before reservations: the log's length.
    path = record_path(target, KEY)
    document = json.loads(path.read_bytes())
    del document["log_reserved"]
    document["log_offset"] = log_path.stat().st_size
    path.write_bytes(json.dumps(document).encode())

    recovered = FilesPublishAdapter(target, log_path)
    try:
        for _ in range(2):
            status = await recovered.reconcile_operation(*args_for(reconcile(KEY)))
            assert status == expected_success("notes.txt")
    finally:
        recovered.close()
    assert [e["operation_key"] for e in read_effect_log(log_path)] == [KEY]
