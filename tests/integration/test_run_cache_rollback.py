"""A run whose watermark the client forgot is still covered by the store.

The host client keeps a run's watermark while the run is cached and for the
last ``max_cached_runs`` runs it dropped (tests/unit/test_host_run_cache.py).
Beyond that, a reload relies on the SQLite ledger's own rollback protection:
these tests drop a run's watermark, roll its record back behind the store's
back on the real database file, and check the reload is refused.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog

from octo_common.errors import RollbackDetected
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.settings import ClientSettings
from octo_host.engine import WorkflowEngine
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore, initialise_anchor, ledger_record_key

from .test_ledger_anchor import Files

STEPS = [WorkflowStep("publish", "publish the release notes")]
NAME = "release-42"
QUIET = structlog.wrap_logger(
    structlog.ReturnLogger(), wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR)
)


def cache_over(store: SqliteLedgerStore, engine: WorkflowEngine, bound: int) -> RunCache:
    settings = ClientSettings(
        reply_timeout=1.0,
        publish_timeout=1.0,
        max_attempts=1,
        backoff_initial=0.1,
        backoff_max=0.1,
        max_cached_runs=bound,
    )
    return RunCache(store, engine, settings, QUIET)


async def record(cache: RunCache, engine: WorkflowEngine, run: HostRun, nonce: bytes) -> None:
    async with run._lock:
        candidate = run.ledger
        data = canonical_operation_input_bytes(ToolPayload.json({"n": nonce.hex()}))
        engine.record_derived_operation(
            run.plan, candidate, "publish", "files.publish", data, nonce
        )
        await cache.persist_locked(run, candidate)


async def forget(cache: RunCache, bound: int) -> None:
    """Load enough other runs that ``NAME``'s watermark is forgotten."""
    engine_plan = cache.loaded[NAME].plan
    for number in range(2 * bound + 1):
        await cache.load(f"other-{number}", engine_plan)
    assert NAME not in cache.loaded and cache.watermark(NAME) == 0


async def test_a_record_rolled_back_alone_after_its_watermark_is_forgotten_is_refused(
    tmp_path: Path,
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    store = files.store()
    engine = WorkflowEngine()
    cache = cache_over(store, engine, bound=2)
    key = ledger_record_key(NAME)
    try:
        run = await cache.load(NAME, engine.plan(STEPS))
        await record(cache, engine, run, b"a" * 16)
        revision, older = files.item(key)
        await record(cache, engine, run, b"b" * 16)
        await forget(cache, bound=2)
        # The record alone goes back to its older sealed version (authentic).
        files.put_back(key, revision, older)
        with pytest.raises(RollbackDetected) as caught:
            await cache.load(NAME, engine.plan(STEPS))
        assert caught.value.record_revision == revision
    finally:
        await store.close()


@pytest.mark.parametrize("anchor", [True, False], ids=["anchor", "no-anchor"])
async def test_a_database_restored_whole_after_the_watermark_is_forgotten_is_refused(
    tmp_path: Path, anchor: bool
) -> None:
    files = Files(tmp_path)
    initialise_anchor(files.anchor)
    store = files.store(anchor=anchor)
    engine = WorkflowEngine()
    cache = cache_over(store, engine, bound=2)
    key = ledger_record_key(NAME)
    try:
        run = await cache.load(NAME, engine.plan(STEPS))
        await record(cache, engine, run, b"a" * 16)
        revision, older = files.item(key)
        older_head = files.head_row()
        await record(cache, engine, run, b"b" * 16)
        await forget(cache, bound=2)
        # Record and store head go back together, as a restored copy would.
        files.put_back(key, revision, older)
        files.set_head_row(older_head)
        with pytest.raises(RollbackDetected):
            await cache.load(NAME, engine.plan(STEPS))
    finally:
        await store.close()
