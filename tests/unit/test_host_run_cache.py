"""The host client's run cache: bounded, O(1) per miss, watermarks bounded with it.

``RunCache`` over the in-memory backend (no I/O), and the waiter tables that
pin runs. Costs are counted (runs examined by an eviction, watermark
entries held), never timed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import structlog

from octo_common.errors import StaleRevision
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.records import StorageKey, StorageKeyring
from octo_host.client.runs import HostRun, RunCache
from octo_host.client.sessions import Waiter, WaiterTable
from octo_host.client.settings import ClientSettings
from octo_host.engine import WorkflowEngine
from octo_host.kinds import RequestKind
from octo_host.plan import WorkflowPlan, WorkflowStep
from octo_host.store import AuthenticatedStore, VolatileMemoryStore, ledger_record_key

STEPS = [WorkflowStep("publish", "publish the release notes")]
TOOL = "files.publish"
QUIET = structlog.wrap_logger(
    structlog.ReturnLogger(), wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR)
)


def settings(max_cached_runs: int) -> ClientSettings:
    return ClientSettings(
        reply_timeout=1.0,
        publish_timeout=1.0,
        max_attempts=1,
        backoff_initial=0.1,
        backoff_max=0.1,
        max_cached_runs=max_cached_runs,
    )


class World:
    def __init__(self, max_cached_runs: int) -> None:
        self.backend = VolatileMemoryStore()
        self.store = AuthenticatedStore(
            self.backend, StorageKeyring("k1", StorageKey(bytes([3]) * 32))
        )
        self.engine = WorkflowEngine()
        self.plan: WorkflowPlan = self.engine.plan(STEPS)
        self.cache = RunCache(self.store, self.engine, settings(max_cached_runs), QUIET)

    async def load(self, name: str, **kwargs: Any) -> HostRun:
        return await self.cache.load(name, self.plan, **kwargs)

    async def record(self, run: HostRun, nonce: bytes) -> str:
        """One more operation recorded and persisted (the ledger revision + 1)."""
        async with run._lock:
            candidate = run.ledger
            key = self.engine.record_derived_operation(
                self.plan,
                candidate,
                "publish",
                TOOL,
                canonical_operation_input_bytes(ToolPayload.json({"n": nonce.hex()})),
                nonce,
            )
            await self.cache.persist_locked(run, candidate)
        return key


def awaited_waiter(table: WaiterTable, request_id: str, run: HostRun) -> Waiter:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waiter = Waiter(RequestKind.DISPATCH, None, run, future)
    table[request_id] = waiter
    return waiter


# Eviction: O(1) per miss -----------------------------------------------------------------


@pytest.mark.parametrize("bound", [16, 256])
async def test_a_miss_over_the_bound_looks_at_one_run_whatever_the_cache_size(bound: int) -> None:
    world = World(bound)
    for number in range(bound):
        await world.load(f"run-{number}")
    assert world.cache.examined == 0  # under the bound: nothing to drop
    misses = 200
    for number in range(bound, bound + misses):
        await world.load(f"run-{number}")
    # Each miss dropped the least recently used run and looked at nothing else.
    assert world.cache.examined == misses
    assert len(world.cache.loaded) == bound
    assert list(world.cache.loaded) == [f"run-{n}" for n in range(misses, bound + misses)]


async def test_a_cache_hit_makes_the_run_the_most_recently_used() -> None:
    world = World(3)
    first = await world.load("run-a")
    await world.load("run-b")
    await world.load("run-c")
    assert await world.load("run-a") is first
    await world.load("run-d")  # drops run-b, the least recently used
    assert set(world.cache.loaded) == {"run-a", "run-c", "run-d"}
    assert not first._detached


async def test_runs_in_use_are_set_aside_once_kept_and_dropped_after_their_pins_go() -> None:
    world = World(4)
    unsent = await world.load("run-unsent")
    await world.record(unsent, b"u" * 16)
    unsent._unsent.add("op-never-sent")  # as record_operation leaves it (under the lock)
    awaited = await world.load("run-awaited")
    table = WaiterTable()
    awaited_waiter(table, "d-1", awaited)
    locked = await world.load("run-locked")
    await locked._lock.acquire()
    given_up = await world.load("run-given-up")
    awaited_waiter(table, "d-2", given_up).abandoned = True  # its caller timed out

    misses = 50
    for number in range(misses):
        await world.load(f"other-{number}")
    cache = world.cache
    # The three runs in use were never dropped; the one given up on was.
    for run in (unsent, awaited, locked):
        assert cache.loaded[run.name] is run and not run._detached
    assert given_up._detached and "run-given-up" not in cache.loaded
    # Each run in use was looked at once (then set aside), every other run once.
    assert cache.examined == misses + 3
    assert len(cache.loaded) == 4  # the runs in use count toward the bound

    # Their pins go: each goes back to the order, and is dropped like any other.
    table.pop("d-1")
    assert awaited._awaited == 0
    locked._lock.release()
    async with unsent._lock:
        unsent._unsent.clear()  # as a dispatch does, under the lock
    before = cache.examined
    for number in range(misses, misses + 7):
        await world.load(f"other-{number}")
    assert cache.examined - before == 7
    for run in (unsent, awaited, locked):
        assert run._detached and run.name not in cache.loaded
    assert len(cache.loaded) == 4


async def test_the_run_just_loaded_is_kept_when_every_other_run_is_in_use() -> None:
    world = World(1)
    busy = await world.load("run-busy")
    await busy._lock.acquire()
    held = await world.load("run-held")
    assert set(world.cache.loaded) == {"run-busy", "run-held"}
    assert not held._detached and not busy._detached
    busy._lock.release()
    await world.load("run-next")  # both may go now: the bound is 1
    assert list(world.cache.loaded) == ["run-next"]
    assert busy._detached and held._detached


async def test_a_waiter_pins_its_run_until_answered_given_up_or_removed() -> None:
    world = World(4)
    run = await world.load("run-a")
    table = WaiterTable()
    answered = awaited_waiter(table, "d-1", run)
    timed_out = awaited_waiter(table, "d-2", run)
    awaited_waiter(table, "d-3", run)
    assert run._awaited == 3 and table.awaited == 3
    table.pop("d-1")
    answered.resolve(None)
    timed_out.abandoned = True
    assert run._awaited == 1 and table.awaited == 1 and len(table) == 2
    assert table.first_given_up() == "d-2"
    timed_out.abandoned = True  # once only
    assert run._awaited == 1
    with pytest.raises(ValueError):
        timed_out.abandoned = False
    del table["d-3"]
    table.pop("d-2")
    assert run._awaited == 0 and table.awaited == 0 and not table
    assert not run._in_use()


# Watermarks: bounded with the cache ------------------------------------------------------


async def test_watermarks_stay_bounded_however_many_runs_are_loaded() -> None:
    bound = 8
    world = World(bound)
    runs = 300
    for number in range(runs):
        run = await world.load(f"run-{number}")
        await world.record(run, number.to_bytes(16, "big"))
    cache = world.cache
    held = len(cache._watermarks) + len(cache._dropped_watermarks)
    assert held <= 2 * bound
    # The runs loaded and the last ones dropped keep theirs; older ones are forgotten.
    assert cache.watermark(f"run-{runs - 1}") == 1
    assert cache.watermark(f"run-{runs - bound - 1}") == 1
    assert cache.watermark("run-0") == 0


async def test_a_run_dropped_lately_still_refuses_a_rolled_back_ledger() -> None:
    world = World(2)
    run = await world.load("run-a")
    key = ledger_record_key("run-a")
    await world.record(run, b"a" * 16)
    older = world.backend.records[key]
    await world.record(run, b"b" * 16)
    assert run.revision == 2
    await world.load("run-b")
    await world.load("run-c")
    assert run._detached and world.cache.watermark("run-a") == 2
    # Behind the client's back the store goes back one write (record and floor).
    world.backend.records[key] = older
    world.backend.floors[key] = older.revision
    with pytest.raises(StaleRevision):
        await world.load("run-a")


# A request is sealed only from a durable ledger -----------------------------------------


class _Broker:
    """The broker side of HostVerbs._send_prepared: connected, publishing nothing."""

    def __init__(self) -> None:
        self.published: list[str] = []

    async def wait_connected(self) -> None:
        return None

    async def publish(self, session: Any, frame: bytes, request_id: str, *, kind: str) -> None:
        self.published.append(request_id)


class _Session:
    closed = False
    authenticator = None
    session_id = "s-1"


async def test_nothing_is_sealed_from_a_ledger_that_is_not_durable() -> None:
    from octo_host.client.sessions import SessionRegistry
    from octo_host.client.verbs import HostVerbs

    world = World(4)
    run = await world.load("run-a")
    await world.record(run, b"n1")
    RunCache.require_durable(run)  # persisted: durable
    # A change the run adopted without persisting it (what no verb does).
    changed = run.ledger
    world.engine.record_derived_operation(
        world.plan,
        changed,
        "publish",
        TOOL,
        canonical_operation_input_bytes(ToolPayload.json({"n": "n2"})),
        b"n2",
    )
    run._ledger = changed
    broker = _Broker()
    built: list[Any] = []
    verbs = HostVerbs(
        world.engine,
        SessionRegistry({}, broker, settings(4), QUIET),  # type: ignore[arg-type]
        world.cache,
        broker,  # type: ignore[arg-type]
        settings(4),
        QUIET,
    )
    with pytest.raises(RuntimeError, match="nothing is sealed"):
        await verbs._send_prepared(_Session(), run, RequestKind.DISPATCH, built.append)  # type: ignore[arg-type]
    assert built == [] and broker.published == []
