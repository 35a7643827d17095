"""The reference adapter ``files.publish`` against a real directory (tmp_path).

Scenarios: publish, repeated dispatch of the same key, conflicts, compensation,
reconciliation, effect counting, inverse-contract validation, and crashes at
the points that matter (simulated by an exception that escapes the adapter
like a process death, then a fresh adapter on the same directory).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import octo_worker.adapters.files as files_module
from octo_common.digest import adapter_idempotency_key
from octo_common.errors import AdapterIndeterminate, AdapterInvalidJsonInput
from octo_common.grants import CapabilityGrant
from octo_common.messages import (
    CompensationReconcileRequest,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileRequest,
)
from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, OperationStatus, Succeeded
from octo_worker.adapters.contract import (
    AdapterContext,
    DurableOperationContract,
    call_adapter_with_deadline,
    load_adapters,
)
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log

SESSION = "session-1"
TOOL = "files.publish"
TENANT = "tenant-release"
GRANT = CapabilityGrant(TOOL, "json", max_input_bytes=256).with_compensation_limit(1)
# A lookup miss, settled for good: proven not to have happened, the key fenced.
NOT_HAPPENED = Failed("not published", FailureCode.NOT_HAPPENED)
KEY = "op-release-42"
OTHER_KEY = "op-release-43"
# Event-loop time the adapter may bound its work by; these calls never wait for it.
FAR_DEADLINE = 1e12

AdapterRequest = (
    OperationDispatchRequest
    | OperationCompensationRequest
    | OperationReconcileRequest
    | CompensationReconcileRequest
)


class Crash(BaseException):
    """Stands in for the process dying at a chosen point."""


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "published"


@pytest.fixture
def log_path(tmp_path: Path) -> Path:
    return tmp_path / "effects.jsonl"


@pytest.fixture
def adapter(target: Path, log_path: Path) -> Iterator[FilesPublishAdapter]:
    instance = FilesPublishAdapter(target, log_path)
    yield instance
    instance.close()


def restart(target: Path, log_path: Path) -> FilesPublishAdapter:
    return FilesPublishAdapter(target, log_path)


def publish_payload(name: str, content: str = "release notes v42\n") -> ToolPayload:
    return ToolPayload.json({"name": name, "content": content})


def dispatch(key: str, payload: ToolPayload) -> OperationDispatchRequest:
    return OperationDispatchRequest(SESSION, f"dispatch-{key}", TOOL, key, payload)


def undo(
    key: str, name: str, *, cmp_key: str = "cmp-undo-1", **extra: Any
) -> OperationCompensationRequest:
    binding = OperationCompensationBinding(
        TOOL, key, cmp_key, TENANT, GRANT.compensation_fingerprint()
    )
    value: dict[str, Any] = {"undo": "publish", "name": name, **extra}
    return OperationCompensationRequest(SESSION, f"undo-{key}", binding, ToolPayload.json(value))


def reconcile(key: str) -> OperationReconcileRequest:
    return OperationReconcileRequest(SESSION, f"reconcile-{key}", TOOL, key)


def context_for(
    request: AdapterRequest, deadline: float = FAR_DEADLINE, *, scope: str = TENANT
) -> AdapterContext:
    """The context the worker passes with ``request`` in ``scope``: a compensation
    and its lookup are named by the compensation key, the others by the operation key."""
    if isinstance(request, OperationCompensationRequest | CompensationReconcileRequest):
        return AdapterContext.for_compensation(scope, SESSION, request.compensation_key, deadline)
    return AdapterContext.for_operation(scope, SESSION, request.operation_key, deadline)


def args_for(request: Any, *, scope: str = TENANT) -> tuple[Any, CapabilityGrant, AdapterContext]:
    """The three arguments of an adapter call for ``request``: request, grant, context."""
    return request, GRANT, context_for(request, scope=scope)


def expected_success(name: str, content: str = "release notes v42\n") -> Succeeded:
    data = content.encode()
    return Succeeded(
        ToolPayload.json(
            {"name": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        )
    )


def shelf(target: Path, scope: str = TENANT) -> Path:
    """Where the adapter publishes the files of ``scope`` (one directory per scope)."""
    return target / scope


def visible_files(directory: Path) -> list[str]:
    if not directory.exists():
        return []
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def leftovers(directory: Path) -> list[str]:
    """Temp files anywhere under the directory (there must never be any at rest)."""
    return sorted(p.name for p in directory.rglob(".octo-tmp.*"))


def effects(log_path: Path) -> list[tuple[str, str]]:
    return [(e["effect"], e["operation_key"]) for e in read_effect_log(log_path)]


# Declarations ------------------------------------------------------------------------


def test_declarations_and_entry_point(tmp_path: Path) -> None:
    options = {TOOL: {"target_dir": str(tmp_path / "a"), "effect_log": str(tmp_path / "l")}}
    adapter = load_adapters([TOOL], options=options).get(TOOL)

    assert isinstance(adapter, FilesPublishAdapter)
    assert adapter.tool == TOOL
    assert adapter.durable_operation_contract() is DurableOperationContract.RECONCILIATION
    assert adapter.invocation_safety() is None
    assert adapter.deadline_seconds == 10.0
    with pytest.raises(ValueError):
        FilesPublishAdapter(tmp_path, tmp_path / "l", deadline_seconds=0)


# Publish -------------------------------------------------------------------------------


async def test_publish_writes_the_file_and_logs_one_effect(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    status = await adapter.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("notes.txt")))
    )

    assert status == expected_success("notes.txt")
    assert (shelf(target) / "notes.txt").read_text() == "release notes v42\n"
    assert visible_files(shelf(target)) == ["notes.txt"]
    assert leftovers(target) == []
    assert read_effect_log(log_path) == [
        {
            "effect": "publish",
            "scope": TENANT,
            "idempotency_key": operation_idempotency_key(KEY),
            "operation_key": KEY,
            "compensation_key": None,
            "name": "notes.txt",
        }
    ]
    assert stat.S_IMODE(log_path.stat().st_mode) == 0o600
    assert b"release notes" not in log_path.read_bytes()  # never the content


async def test_a_repeated_dispatch_of_the_same_key_does_not_write_again(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    request = dispatch(KEY, publish_payload("notes.txt"))
    first = await adapter.dispatch_operation(*args_for(request))
    inode = (shelf(target) / "notes.txt").stat().st_ino

    second = await adapter.dispatch_operation(*args_for(request))
    after_restart = await restart(target, log_path).dispatch_operation(*args_for(request))

    assert first == second == after_restart == expected_success("notes.txt")
    assert (shelf(target) / "notes.txt").stat().st_ino == inode
    assert effects(log_path) == [("publish", KEY)]


async def test_the_same_key_with_other_input_is_refused(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    status = await adapter.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("notes.txt", "other content")))
    )

    assert isinstance(status, Failed)
    assert (shelf(target) / "notes.txt").read_text() == "release notes v42\n"
    assert effects(log_path) == [("publish", KEY)]


async def test_a_name_published_by_another_key_is_a_conflict(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    conflict = await adapter.dispatch_operation(
        *args_for(dispatch(OTHER_KEY, publish_payload("notes.txt", "hijack")))
    )

    assert conflict == Failed("target exists")
    assert (shelf(target) / "notes.txt").read_text() == "release notes v42\n"
    assert effects(log_path) == [("publish", KEY)]
    # The refusal is remembered: reconciliation answers exactly what dispatch answered.
    assert await adapter.reconcile_operation(*args_for(reconcile(OTHER_KEY))) == conflict
    again = await adapter.dispatch_operation(
        *args_for(dispatch(OTHER_KEY, publish_payload("notes.txt", "hijack")))
    )
    assert again == conflict


async def test_a_file_placed_by_someone_else_is_never_overwritten(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    shelf(target).mkdir(parents=True)
    (shelf(target) / "notes.txt").write_text("operator's file")

    status = await adapter.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("notes.txt")))
    )

    assert status == Failed("target exists")
    assert (shelf(target) / "notes.txt").read_text() == "operator's file"
    assert effects(log_path) == []


@pytest.mark.parametrize(
    "value",
    [
        {"name": ".hidden", "content": "x"},
        {"name": "../escape", "content": "x"},
        {"name": "a/b", "content": "x"},
        {"name": "", "content": "x"},
        {"name": "x" * 129, "content": "x"},
        {"name": "späße.txt", "content": "x"},
        {"name": "notes.txt"},
        {"name": "notes.txt", "content": 42},
        {"name": "notes.txt", "content": "x", "mode": "0777"},
        {"name": "notes.txt", "content": "x" * 257},
        ["notes.txt", "x"],
    ],
)
async def test_invalid_publish_input_is_refused_before_anything_is_touched(
    adapter: FilesPublishAdapter, target: Path, log_path: Path, value: Any
) -> None:
    with pytest.raises(AdapterInvalidJsonInput):
        await adapter.dispatch_operation(*args_for(dispatch(KEY, ToolPayload.json(value))))

    assert not target.exists()
    assert effects(log_path) == []
    assert await adapter.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED


async def test_a_text_payload_is_refused(adapter: FilesPublishAdapter, target: Path) -> None:
    with pytest.raises(AdapterInvalidJsonInput):
        await adapter.dispatch_operation(*args_for(dispatch(KEY, ToolPayload.text("notes.txt"))))
    assert not target.exists()


# Compensation ---------------------------------------------------------------------------


async def test_compensation_removes_exactly_the_published_file(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    await adapter.dispatch_operation(*args_for(dispatch(OTHER_KEY, publish_payload("keep.txt"))))

    status = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    assert status == Succeeded(ToolPayload.json({"name": "notes.txt", "removed": True}))
    assert visible_files(shelf(target)) == ["keep.txt"]
    assert leftovers(target) == []
    assert read_effect_log(log_path)[-1] == {
        "effect": "remove",
        "scope": TENANT,
        "idempotency_key": adapter_idempotency_key(TENANT, "compensation", "cmp-undo-1"),
        "operation_key": KEY,
        "compensation_key": "cmp-undo-1",
        "name": "notes.txt",
    }
    # Repeating it (same or restarted adapter) removes nothing more.
    assert await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt"))) == status
    assert (
        await restart(target, log_path).compensate_operation(*args_for(undo(KEY, "notes.txt")))
        == status
    )
    assert effects(log_path) == [("publish", KEY), ("publish", OTHER_KEY), ("remove", KEY)]


async def test_a_compensated_name_can_be_published_again_and_is_not_removed_twice(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    republished = await adapter.dispatch_operation(
        *args_for(dispatch(OTHER_KEY, publish_payload("notes.txt", "v43")))
    )
    await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    assert republished == expected_success("notes.txt", "v43")
    assert (shelf(target) / "notes.txt").read_text() == "v43"
    assert effects(log_path) == [("publish", KEY), ("remove", KEY), ("publish", OTHER_KEY)]


async def test_a_file_already_gone_is_compensated_idempotently(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    (shelf(target) / "notes.txt").unlink()  # removed by an operator

    status = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    assert status == Succeeded(ToolPayload.json({"name": "notes.txt", "removed": False}))
    assert effects(log_path) == [("publish", KEY)]  # no removal happened here
    assert await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt"))) == status


async def test_a_modified_published_file_is_not_removed(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    (shelf(target) / "notes.txt").write_text("edited by hand")

    status = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    assert status == Failed("published file was modified")
    assert (shelf(target) / "notes.txt").read_text() == "edited by hand"
    assert effects(log_path) == [("publish", KEY)]


@pytest.mark.parametrize(
    "request_factory",
    [
        lambda: undo(KEY, "keep.txt"),  # another key's file
        lambda: undo(KEY, "notes.txt", force=True),  # unknown field
        lambda: undo(KEY, "../notes.txt"),
        lambda: undo(KEY, ".octo-publish"),
        lambda: OperationCompensationRequest(
            SESSION,
            "undo-x",
            OperationCompensationBinding(
                TOOL, KEY, "cmp-undo-1", TENANT, GRANT.compensation_fingerprint()
            ),
            ToolPayload.json({"undo": "delete-everything", "name": "notes.txt"}),
        ),
        lambda: OperationCompensationRequest(
            SESSION,
            "undo-x",
            OperationCompensationBinding(
                TOOL, KEY, "cmp-undo-1", TENANT, GRANT.compensation_fingerprint()
            ),
            ToolPayload.text("notes.txt"),
        ),
    ],
)
async def test_the_inverse_payload_must_match_its_own_contract(
    adapter: FilesPublishAdapter, target: Path, log_path: Path, request_factory: Any
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    await adapter.dispatch_operation(*args_for(dispatch(OTHER_KEY, publish_payload("keep.txt"))))

    with pytest.raises(AdapterInvalidJsonInput):
        await adapter.compensate_operation(*args_for(request_factory()))

    assert visible_files(shelf(target)) == ["keep.txt", "notes.txt"]
    assert effects(log_path) == [("publish", KEY), ("publish", OTHER_KEY)]


async def test_compensating_something_never_published(adapter: FilesPublishAdapter) -> None:
    status = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    assert status == Failed("not published")  # a compensation's: no code
    assert status.code is None


# Reconciliation ---------------------------------------------------------------------------


async def test_reconciliation_reports_by_key_and_never_publishes(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    published = await adapter.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("notes.txt")))
    )

    assert await adapter.reconcile_operation(*args_for(reconcile(KEY))) == published
    assert (
        await restart(target, log_path).reconcile_operation(*args_for(reconcile(KEY))) == published
    )
    await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))
    # The original did succeed; its compensation is a separate fact.
    assert await adapter.reconcile_operation(*args_for(reconcile(KEY))) == published
    assert effects(log_path) == [("publish", KEY), ("remove", KEY)]


async def test_a_reconciliation_after_an_expired_deadline_sees_the_finished_publish(
    adapter: FilesPublishAdapter,
    target: Path,
    log_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_write = files_module.write_new_file

    def slow_write(path: Path, data: bytes, mode: int) -> None:
        time.sleep(0.1)
        real_write(path, data, mode)

    monkeypatch.setattr(files_module, "write_new_file", slow_write)
    request = dispatch(KEY, publish_payload("notes.txt"))

    with pytest.raises(AdapterIndeterminate):
        await call_adapter_with_deadline(
            lambda deadline: adapter.dispatch_operation(
                request, GRANT, context_for(request, deadline)
            ),
            deadline_seconds=0.05,
        )
    status = await adapter.reconcile_operation(*args_for(reconcile(KEY)))

    assert status == expected_success("notes.txt")
    assert effects(log_path) == [("publish", KEY)]


async def test_concurrent_dispatches_for_one_name_publish_once(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    keys = [f"op-race-{i}" for i in range(8)]

    statuses = await asyncio.gather(
        *(
            adapter.dispatch_operation(*args_for(dispatch(key, publish_payload("race.txt", key))))
            for key in keys
        )
    )

    winners = [s for s in statuses if isinstance(s, Succeeded)]
    assert len(winners) == 1
    assert statuses.count(Failed("target exists")) == len(keys) - 1
    assert len(effects(log_path)) == 1
    assert (shelf(target) / "race.txt").read_text() == effects(log_path)[0][1]


# Crashes ------------------------------------------------------------------------------------


def crash_on(monkeypatch: pytest.MonkeyPatch, module_attr: str, when: Any = None) -> None:
    original = getattr(files_module, module_attr) if hasattr(files_module, module_attr) else None

    def crashing(*args: Any, **kwargs: Any) -> Any:
        if when is None or when(*args):
            raise Crash()
        assert original is not None
        return original(*args, **kwargs)

    monkeypatch.setattr(files_module, module_attr, crashing)


async def test_a_crash_before_the_file_appears_is_final_not_published(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()

    recovered = restart(target, log_path)
    try:
        assert leftovers(target) == []
        assert visible_files(shelf(target)) == []
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED
        # Nothing resumes an interrupted publication, so the answer stays true.
        again = await recovered.dispatch_operation(
            *args_for(dispatch(KEY, publish_payload("notes.txt")))
        )
        assert again == NOT_HAPPENED
        assert visible_files(shelf(target)) == []
        # The name is free again for another key.
        other = await recovered.dispatch_operation(
            *args_for(dispatch(OTHER_KEY, publish_payload("notes.txt")))
        )
        assert other == expected_success("notes.txt")
        assert effects(log_path) == [("publish", OTHER_KEY)]
    finally:
        recovered.close()


async def test_a_crash_after_the_file_appeared_is_recovered_as_published(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    crash_on(monkeypatch, "fill_line")
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()

    recovered = restart(target, log_path)
    try:
        assert visible_files(shelf(target)) == ["notes.txt"]
        assert leftovers(target) == []
        assert effects(log_path) == []  # the crash hit before the log line
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == expected_success(
            "notes.txt"
        )
        again = await recovered.dispatch_operation(
            *args_for(dispatch(KEY, publish_payload("notes.txt")))
        )
        assert again == expected_success("notes.txt")
        await recovered.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
        assert effects(log_path) == [("publish", KEY)]  # logged exactly once
    finally:
        recovered.close()


def operation_idempotency_key(key: str, scope: str = TENANT) -> str:
    return adapter_idempotency_key(scope, "operation", key)


def record_path(target: Path, key: str, scope: str = TENANT) -> Path:
    """The adapter's record of an operation: named by its idempotency key."""
    return target / ".octo-publish" / f"pub.{operation_idempotency_key(key, scope)}.json"


def record_state(target: Path, key: str) -> str:
    document = json.loads(record_path(target, key).read_bytes())
    return str(document["state"])


def claim_path(target: Path, name: str, scope: str = TENANT) -> Path:
    digest = hashlib.sha256(f"{scope}/{name}".encode()).hexdigest()
    return target / ".octo-publish" / f"claim.{digest}"


async def crash_between_link_and_log_line(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SIGKILL cut: the file is linked, its effect line and record are not written."""
    doomed = restart(target, log_path)
    crash_on(monkeypatch, "fill_line")
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()
    assert visible_files(shelf(target)) == ["notes.txt"]
    assert record_state(target, KEY) == "publishing"
    assert effects(log_path) == []


async def test_reconciliation_after_a_cut_between_link_and_log_line_writes_the_line_once(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await crash_between_link_and_log_line(target, log_path, monkeypatch)

    recovered = restart(target, log_path)
    try:
        status = await recovered.reconcile_operation(*args_for(reconcile(KEY)))
        assert status == expected_success("notes.txt")
        # Reconciliation reports the publish, so the log holds its one line.
        assert effects(log_path) == [("publish", KEY)]
        assert record_state(target, KEY) == "published"
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == status
    finally:
        recovered.close()
    again = restart(target, log_path)
    try:
        assert await again.reconcile_operation(*args_for(reconcile(KEY))) == status
        repeated = await again.dispatch_operation(
            *args_for(dispatch(KEY, publish_payload("notes.txt")))
        )
        assert repeated == status
        assert effects(log_path) == [("publish", KEY)]
        assert visible_files(shelf(target)) == ["notes.txt"]
        assert leftovers(target) == []
    finally:
        again.close()


async def test_reconciliation_after_a_cut_before_the_record_does_not_log_twice(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The effect line is durable, the `published` record is not.
    doomed = restart(target, log_path)
    crash_on(monkeypatch, "replace_file", when=lambda path, data: b'"published"' in data)
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()
    assert record_state(target, KEY) == "publishing"
    assert effects(log_path) == [("publish", KEY)]

    recovered = restart(target, log_path)
    try:
        for _ in range(2):
            status = await recovered.reconcile_operation(*args_for(reconcile(KEY)))
            assert status == expected_success("notes.txt")
        assert effects(log_path) == [("publish", KEY)]
        assert record_state(target, KEY) == "published"
    finally:
        recovered.close()


async def test_reconciliation_after_a_cut_then_compensation_logs_each_effect_once(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await crash_between_link_and_log_line(target, log_path, monkeypatch)

    recovered = restart(target, log_path)
    try:
        published = await recovered.reconcile_operation(*args_for(reconcile(KEY)))
        assert published == expected_success("notes.txt")
        removed = await recovered.compensate_operation(*args_for(undo(KEY, "notes.txt")))
        assert removed == Succeeded(ToolPayload.json({"name": "notes.txt", "removed": True}))
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == published
        assert effects(log_path) == [("publish", KEY), ("remove", KEY)]
        assert visible_files(shelf(target)) == []
    finally:
        recovered.close()


async def test_reconciliation_after_a_cut_before_the_link_refuses_the_key_for_good(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    monkeypatch.setattr(os, "link", lambda *a, **k: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()
    assert record_state(target, KEY) == "publishing"

    recovered = restart(target, log_path)
    try:
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED
        # Settled on disk: the record is final and the name's claim is released.
        assert record_state(target, KEY) == "refused"
        assert not claim_path(target, "notes.txt").exists()
        assert await recovered.reconcile_operation(*args_for(reconcile(KEY))) == NOT_HAPPENED
        again = await recovered.dispatch_operation(
            *args_for(dispatch(KEY, publish_payload("notes.txt")))
        )
        assert again == NOT_HAPPENED
        assert effects(log_path) == []
        assert visible_files(shelf(target)) == []
    finally:
        recovered.close()


async def test_a_crash_during_removal_is_finished_by_the_repeated_compensation(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    crash_on(monkeypatch, "fill_line", when=lambda path, at, line, _: b'"remove"' in line)
    with pytest.raises(Crash):
        await doomed.compensate_operation(*args_for(undo(KEY, "notes.txt")))
    doomed.close()
    monkeypatch.undo()

    recovered = restart(target, log_path)
    try:
        assert visible_files(shelf(target)) == []
        assert effects(log_path) == [("publish", KEY)]
        status = await recovered.compensate_operation(*args_for(undo(KEY, "notes.txt")))
        assert status == Succeeded(ToolPayload.json({"name": "notes.txt", "removed": True}))
        await recovered.compensate_operation(*args_for(undo(KEY, "notes.txt")))
        assert effects(log_path) == [("publish", KEY), ("remove", KEY)]
    finally:
        recovered.close()


# Effect log ------------------------------------------------------------------------------------


async def test_the_effect_log_counts_every_effect(
    adapter: FilesPublishAdapter, log_path: Path
) -> None:
    statuses: list[OperationStatus] = []
    for index in range(3):
        request = dispatch(f"op-{index}", publish_payload(f"file-{index}.txt"))
        statuses.append(await adapter.dispatch_operation(*args_for(request)))
        statuses.append(await adapter.dispatch_operation(*args_for(request)))
    await adapter.compensate_operation(*args_for(undo("op-1", "file-1.txt")))

    assert all(isinstance(s, Succeeded) for s in statuses)
    assert effects(log_path) == [
        ("publish", "op-0"),
        ("publish", "op-1"),
        ("publish", "op-2"),
        ("remove", "op-1"),
    ]


def test_reading_a_missing_or_torn_effect_log(tmp_path: Path) -> None:
    log = tmp_path / "effects.jsonl"
    assert read_effect_log(log) == []

    log.write_bytes(
        b'{"effect":"publish","operation_key":"a","compensation_key":null,"name":"n"}\n{"eff'
    )

    assert read_effect_log(log) == [
        {"effect": "publish", "operation_key": "a", "compensation_key": None, "name": "n"}
    ]


async def test_a_dispatch_after_a_lookup_found_nothing_answers_what_the_lookup_did(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    # The lookup of a key the adapter never saw settles it as not performed; a
    # dispatch that reaches the adapter later (a superseded worker woken up)
    # performs nothing and answers exactly what the lookup answered, so the
    # journal's transition table takes either answer.
    looked_up = await adapter.reconcile_operation(*args_for(reconcile(KEY)))
    assert looked_up == NOT_HAPPENED
    late = await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("late.txt"))))
    assert late == looked_up
    assert effects(log_path) == []
    assert visible_files(shelf(target)) == []
