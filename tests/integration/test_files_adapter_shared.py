"""``files.publish`` on a directory two worker processes share (D13 failover).

The owner of a scope and the standby that takes it over use one
``target_dir`` and one effect log. These tests hold an operation's lock from
a real second process (a Python child that ``flock``s the lock file, or is
SIGKILLed holding it) and use a second adapter instance on the same files as
the superseded worker woken up after its standby's lookup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from octo_common.errors import AdapterIndeterminate
from octo_common.states import Failed
from octo_worker.adapters_files import FilesPublishAdapter, read_effect_log

from . import test_files_adapter as single
from .test_files_adapter import (
    KEY,
    args_for,
    dispatch,
    expected_success,
    operation_idempotency_key,
    publish_payload,
    reconcile,
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
    assert await standby.reconcile_operation(*args_for(reconcile(KEY))) == Failed("not published")
    late = await owner.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    assert late == Failed("not published")
    assert not (shelf(target) / "notes.txt").exists()
    assert read_effect_log(log_path) == []
    assert record_state(target, KEY) == "refused"
    assert await owner.reconcile_operation(*args_for(reconcile(KEY))) == Failed("not published")


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

    assert await standby.reconcile_operation(*args_for(reconcile(KEY))) == Failed("not published")
    assert lock_file(target).exists()
