"""``files.publish`` against a real directory: tenant isolation, the lookup of a
compensation by its key, and an effect log without gaps.

Same parts and crash simulation as ``test_files_adapter.py``: a real
directory under tmp_path, an exception that escapes the adapter like a
process death at a chosen point, then a fresh adapter on the same files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import octo_worker.adapters.files as files_module
from octo_common.errors import AdapterIndeterminate
from octo_common.messages import (
    CompensationReconcileRequest,
    OperationCompensationBinding,
    OperationCompensationRequest,
)
from octo_common.payload import ToolPayload
from octo_common.states import Failed, Succeeded
from octo_worker.adapters.contract import call_adapter_with_deadline
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log

from .test_files_adapter import (
    GRANT,
    KEY,
    OTHER_KEY,
    SESSION,
    TENANT,
    TOOL,
    Crash,
    args_for,
    context_for,
    crash_on,
    dispatch,
    effects,
    expected_success,
    publish_payload,
    reconcile,
    record_path,
    record_state,
    restart,
    shelf,
    undo,
    visible_files,
)

OTHER_TENANT = "tenant-billing"


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


REMOVED = Succeeded(ToolPayload.json({"name": "notes.txt", "removed": True}))


def lookup(key: str, cmp_key: str = "cmp-undo-1", scope: str = TENANT) -> Any:
    return CompensationReconcileRequest(
        SESSION, f"lookup-{key}", TOOL, key, cmp_key, scope, GRANT.compensation_fingerprint()
    )


def undo_in(scope: str, key: str, name: str, cmp_key: str = "cmp-undo-1") -> Any:
    binding = OperationCompensationBinding(
        TOOL, key, cmp_key, scope, GRANT.compensation_fingerprint()
    )
    payload = ToolPayload.json({"undo": "publish", "name": name})
    return OperationCompensationRequest(SESSION, f"undo-{key}", binding, payload)


# Tenant isolation ------------------------------------------------------------------


async def test_two_tenants_with_one_key_and_one_name_get_two_files_and_two_effects(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    # The same plan and nonce in two scopes: the same operation key, the same payload.
    request = dispatch(KEY, publish_payload("notes.txt"))
    first = await adapter.dispatch_operation(*args_for(request, scope=TENANT))
    second = await adapter.dispatch_operation(*args_for(request, scope=OTHER_TENANT))

    assert first == second == expected_success("notes.txt")
    assert visible_files(shelf(target)) == visible_files(shelf(target, OTHER_TENANT))
    assert visible_files(shelf(target)) == ["notes.txt"]
    published = read_effect_log(log_path)
    assert [(e["effect"], e["scope"]) for e in published] == [
        ("publish", TENANT),
        ("publish", OTHER_TENANT),
    ]
    assert published[0]["idempotency_key"] != published[1]["idempotency_key"]
    assert [e["idempotency_key"] for e in published] == [
        context_for(request, scope=TENANT).idempotency_key,
        context_for(request, scope=OTHER_TENANT).idempotency_key,
    ]

    # Each compensation removes only its own tenant's file.
    removed = await adapter.compensate_operation(
        *args_for(undo_in(TENANT, KEY, "notes.txt"), scope=TENANT)
    )
    assert removed == REMOVED
    assert visible_files(shelf(target)) == []
    assert visible_files(shelf(target, OTHER_TENANT)) == ["notes.txt"]
    assert await adapter.reconcile_operation(*args_for(reconcile(KEY), scope=OTHER_TENANT)) == (
        expected_success("notes.txt")
    )
    removed_too = await adapter.compensate_operation(
        *args_for(undo_in(OTHER_TENANT, KEY, "notes.txt"), scope=OTHER_TENANT)
    )
    assert removed_too == REMOVED
    assert visible_files(shelf(target, OTHER_TENANT)) == []
    assert [(e["effect"], e["scope"]) for e in read_effect_log(log_path)] == [
        ("publish", TENANT),
        ("publish", OTHER_TENANT),
        ("remove", TENANT),
        ("remove", OTHER_TENANT),
    ]


async def test_nothing_the_adapter_keeps_is_named_by_a_bare_key(
    adapter: FilesPublishAdapter, target: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    kept = sorted(p.name for p in (target / ".octo-publish").iterdir())
    idempotency_key = record_path(target, KEY).name.removeprefix("pub.").removesuffix(".json")
    assert kept == [f"lock.{idempotency_key}", record_path(target, KEY).name]
    assert all(KEY not in name and "cmp-undo-1" not in name for name in kept)


async def test_a_scope_that_cannot_be_a_directory_is_refused_for_good(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    request = dispatch(KEY, publish_payload("notes.txt"))
    for scope in (".", "..", ".hidden"):
        status = await adapter.dispatch_operation(*args_for(request, scope=scope))
        assert status == Failed("scope has no directory")
        again = await adapter.reconcile_operation(*args_for(reconcile(KEY), scope=scope))
        assert again == status
    assert [p.name for p in target.iterdir()] == [".octo-publish"]
    assert effects(log_path) == []


async def test_a_record_of_the_layout_before_d12_is_never_guessed_at(
    adapter: FilesPublishAdapter, target: Path
) -> None:
    # An operation key this adapter recorded by its bare key: its scope is unknown.
    meta = target / ".octo-publish"
    meta.mkdir(parents=True)
    (meta / f"op.{KEY}.json").write_text("{}")

    with pytest.raises(AdapterIndeterminate):
        await adapter.reconcile_operation(*args_for(reconcile(KEY)))
    with pytest.raises(AdapterIndeterminate):
        await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    assert visible_files(shelf(target)) == []


# The lookup of a compensation by its key -------------------------------------------


async def test_a_finished_removal_is_found_by_its_compensation_key(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    removed = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))

    found = await adapter.reconcile_compensation(*args_for(lookup(KEY)))
    after_restart = await restart(target, log_path).reconcile_compensation(*args_for(lookup(KEY)))

    assert found == after_restart == removed == REMOVED
    assert effects(log_path) == [("publish", KEY), ("remove", KEY)]


async def test_a_compensation_that_never_reached_the_removal_never_will(
    adapter: FilesPublishAdapter, target: Path, log_path: Path
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    status = await adapter.reconcile_compensation(*args_for(lookup(KEY)))

    assert status == Failed("not removed")
    assert visible_files(shelf(target)) == ["notes.txt"]  # a lookup never removes
    # The answer stays true: a late compensation under this key removes nothing ...
    late = await adapter.compensate_operation(*args_for(undo(KEY, "notes.txt")))
    assert late == Failed("not removed")
    assert await adapter.reconcile_compensation(*args_for(lookup(KEY))) == status
    assert visible_files(shelf(target)) == ["notes.txt"]
    # ... while the original stays published and another key may still undo it.
    other = undo(KEY, "notes.txt", cmp_key="cmp-undo-2")
    assert await adapter.compensate_operation(*args_for(other)) == REMOVED
    assert effects(log_path) == [("publish", KEY), ("remove", KEY)]


async def test_the_lookup_of_something_never_published_says_so(
    adapter: FilesPublishAdapter, log_path: Path
) -> None:
    assert await adapter.reconcile_compensation(*args_for(lookup(KEY))) == Failed("not published")
    await adapter.dispatch_operation(*args_for(dispatch(OTHER_KEY, publish_payload("n.txt"))))
    refused = await adapter.dispatch_operation(
        *args_for(dispatch(KEY, publish_payload("n.txt", "other")))
    )
    assert refused == Failed("target exists")
    assert await adapter.reconcile_compensation(*args_for(lookup(KEY))) == Failed("not published")
    assert effects(log_path) == [("publish", OTHER_KEY)]


async def test_a_removal_cut_between_unlink_and_log_line_is_finished_by_the_lookup(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    crash_on(monkeypatch, "fill_line", when=lambda path, at, line, _: b'"remove"' in line)
    with pytest.raises(Crash):
        await doomed.compensate_operation(*args_for(undo(KEY, "notes.txt")))
    doomed.close()
    monkeypatch.undo()
    assert visible_files(shelf(target)) == []
    assert record_state(target, KEY) == "removing"
    assert effects(log_path) == [("publish", KEY)]

    recovered = restart(target, log_path)
    try:
        # Another effect lands at the end of the log before the lookup comes.
        await recovered.dispatch_operation(
            *args_for(dispatch(OTHER_KEY, publish_payload("keep.txt")))
        )
        for _ in range(2):
            assert await recovered.reconcile_compensation(*args_for(lookup(KEY))) == REMOVED
        assert record_state(target, KEY) == "removed"
        # The removal's line stands where it was reserved, before the later effect.
        assert effects(log_path) == [("publish", KEY), ("remove", KEY), ("publish", OTHER_KEY)]
        assert await recovered.compensate_operation(*args_for(undo(KEY, "notes.txt"))) == REMOVED
        assert len(effects(log_path)) == 3
    finally:
        recovered.close()


async def test_a_removal_cut_before_the_unlink_is_not_removed_and_never_will_be(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    monkeypatch.setattr(files_module.os, "unlink", _crash_on_published_unlink(target))
    with pytest.raises(Crash):
        await doomed.compensate_operation(*args_for(undo(KEY, "notes.txt")))
    doomed.close()
    monkeypatch.undo()
    assert record_state(target, KEY) == "removing"
    assert visible_files(shelf(target)) == ["notes.txt"]

    recovered = restart(target, log_path)
    try:
        status = await recovered.reconcile_compensation(*args_for(lookup(KEY)))
        assert status == Failed("not removed")
        assert record_state(target, KEY) == "published"
        assert visible_files(shelf(target)) == ["notes.txt"]
        assert await recovered.compensate_operation(*args_for(undo(KEY, "notes.txt"))) == status
        assert await recovered.reconcile_compensation(*args_for(lookup(KEY))) == status
        assert effects(log_path) == [("publish", KEY)]
    finally:
        recovered.close()


def _crash_on_published_unlink(published: Path) -> Any:
    real_unlink = files_module.os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path) == shelf(published) / "notes.txt":
            raise Crash()
        real_unlink(path, *args, **kwargs)

    return unlink


async def test_a_lookup_after_an_expired_deadline_sees_the_finished_removal(
    adapter: FilesPublishAdapter,
    target: Path,
    log_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    real_replace = files_module.replace_file

    def slow_replace(path: Path, data: bytes) -> None:
        time.sleep(0.1)
        real_replace(path, data)

    monkeypatch.setattr(files_module, "replace_file", slow_replace)
    request = undo(KEY, "notes.txt")
    with pytest.raises(AdapterIndeterminate):
        await call_adapter_with_deadline(
            lambda deadline: adapter.compensate_operation(
                request, GRANT, context_for(request, deadline)
            ),
            deadline_seconds=0.05,
        )

    assert await adapter.reconcile_compensation(*args_for(lookup(KEY))) == REMOVED
    assert effects(log_path) == [("publish", KEY), ("remove", KEY)]


async def test_the_lookup_answers_for_its_own_tenant_only(
    adapter: FilesPublishAdapter, target: Path
) -> None:
    request = dispatch(KEY, publish_payload("notes.txt"))
    await adapter.dispatch_operation(*args_for(request, scope=TENANT))
    await adapter.dispatch_operation(*args_for(request, scope=OTHER_TENANT))
    await adapter.compensate_operation(*args_for(undo_in(TENANT, KEY, "notes.txt")))

    mine = await adapter.reconcile_compensation(*args_for(lookup(KEY)))
    theirs = await adapter.reconcile_compensation(
        *args_for(lookup(KEY, scope=OTHER_TENANT), scope=OTHER_TENANT)
    )

    assert mine == REMOVED
    assert theirs == Failed("not removed")
    assert visible_files(shelf(target, OTHER_TENANT)) == ["notes.txt"]


# An effect log without gaps --------------------------------------------------------------


async def test_the_repair_of_a_cut_publish_reads_one_line_not_the_log(
    target: Path, log_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doomed = restart(target, log_path)
    for index in range(20):
        await doomed.dispatch_operation(
            *args_for(dispatch(f"op-before-{index}", publish_payload(f"f-{index}.txt")))
        )
    crash_on(monkeypatch, "fill_line")
    with pytest.raises(Crash):
        await doomed.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))
    doomed.close()
    monkeypatch.undo()

    recovered = restart(target, log_path)
    try:
        reads: list[int] = []
        real_read_bytes = Path.read_bytes

        def counting(path: Path) -> bytes:
            if path == log_path:
                reads.append(1)
            return real_read_bytes(path)

        monkeypatch.setattr(Path, "read_bytes", counting)
        status = await recovered.reconcile_operation(*args_for(reconcile(KEY)))
        monkeypatch.undo()
        assert status == expected_success("notes.txt")
        assert reads == []  # the whole log is never read on the way
        assert [e for e in effects(log_path) if e[1] == KEY] == [("publish", KEY)]
        assert len(effects(log_path)) == 21
    finally:
        recovered.close()


async def test_a_torn_last_line_never_swallows_the_next_effect(
    adapter: FilesPublishAdapter, log_path: Path
) -> None:
    log_path.write_bytes(b'{"effect":"publish","operation_key":"a"}\n{"effect":"pub')

    await adapter.dispatch_operation(*args_for(dispatch(KEY, publish_payload("notes.txt"))))

    assert effects(log_path) == [("publish", "a"), ("publish", KEY)]
    lines = log_path.read_bytes().split(b"\n")
    assert lines[1] == b'{"effect":"pub'  # ended as a line of its own, then skipped
    assert json.loads(lines[2])["operation_key"] == KEY
