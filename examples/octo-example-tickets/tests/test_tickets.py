"""``tickets.open`` through the Octo adapter kit: a real WorkerSession and SQLite
journal, the plug-in loaded through its entry point as the worker loads it.

The ``adapter_kit`` fixture comes with Octo (its pytest plugin); no broker is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from octo_example_tickets import HelpDesk

from octo_common.payload import ToolPayload
from octo_common.states import Failed, StateKind, Succeeded
from octo_worker.testing import KILL_POINTS, AdapterKit, counts

TICKET = ToolPayload.json({"title": "printer on fire", "priority": "high"})
CLOSE = ToolPayload.json({"close": "ticket"})


@pytest.fixture
def desk(tmp_path: Path) -> HelpDesk:
    return HelpDesk(tmp_path / "desk")


@pytest.fixture
def kit(adapter_kit: Callable[..., AdapterKit], desk: HelpDesk) -> AdapterKit:
    return adapter_kit("tickets.open", desk_dir=str(desk.directory))


async def test_a_ticket_is_opened_once_and_a_duplicate_opens_nothing(
    kit: AdapterKit, desk: HelpDesk
) -> None:
    async with kit:
        key = kit.new_key()
        opened = await kit.dispatch(TICKET, key)
        assert isinstance(opened, Succeeded)
        assert opened.payload.value["title"] == "printer on fire"
        assert await kit.dispatch(TICKET, key) == opened
        assert counts(kit.calls) == {"dispatch_operation": 1}
        assert len(desk.tickets()) == 1


async def test_a_ticket_that_does_not_fit_the_type_is_refused_before_the_desk(
    kit: AdapterKit, desk: HelpDesk
) -> None:
    async with kit:
        refused = await kit.dispatch(ToolPayload.json({"title": "x", "priority": "urgent"}))
        # Refused before any effect: the key ends failed, definitely, with its code.
        assert isinstance(refused, Failed) and refused.code == "input_refused"
        assert "priority" in getattr(kit.last_error, "detail", "")
        assert desk.tickets() == []


async def test_the_compensation_closes_exactly_that_ticket_once(
    kit: AdapterKit, desk: HelpDesk
) -> None:
    async with kit:
        keep, undo = kit.new_key(), kit.new_key()
        await kit.dispatch(TICKET, keep)
        await kit.dispatch(ToolPayload.json({"title": "wrong ticket"}), undo)
        assert (await kit.compensate(undo, CLOSE)).kind == StateKind.SUCCEEDED
        assert (await kit.compensate(undo, CLOSE)).kind == StateKind.SUCCEEDED  # journal
        assert kit.calls["compensate_operation"] == 1
        closed = [name for name in desk.tickets() if desk.closed_by(name)]
        assert len(closed) == 1 and len(desk.tickets()) == 2
        refused = await kit.compensate(keep, ToolPayload.json({"close": "everything"}))
        assert isinstance(refused, Failed) and refused.code == "input_refused"
        assert desk.closed_by(next(n for n in desk.tickets() if not desk.closed_by(n))) is None
        assert len([name for name in desk.tickets() if desk.closed_by(name)]) == 1


@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_crash_at_each_kill_point_leaves_one_ticket_at_most(
    kit: AdapterKit, desk: HelpDesk, point: str
) -> None:
    async with kit:
        report = await kit.dispatch_crashing(TICKET, at=point)
        assert report.reached
        state = await kit.reconcile(report.key)
        opened = point not in ("worker.after_admission_commit", "worker.after_ack")
        assert len(desk.tickets()) == int(opened)
        assert kit.calls["dispatch_operation"] == int(opened)
        # Opened: the desk's answer. Never opened: not found, which proves nothing.
        assert state.kind == (StateKind.SUCCEEDED if opened else StateKind.RUNNING)


@pytest.mark.parametrize("point", KILL_POINTS)
async def test_a_close_cut_by_a_crash_is_looked_up_not_done_twice(
    kit: AdapterKit, desk: HelpDesk, point: str
) -> None:
    async with kit:
        key = kit.new_key()
        await kit.dispatch(TICKET, key)
        report = await kit.compensate_crashing(key, CLOSE, at=point)
        assert report.reached
        state = await kit.reconcile_compensation(key)
        closed = point not in ("worker.after_admission_commit", "worker.after_ack")
        assert kit.calls["compensate_operation"] == int(closed)
        assert state.kind == (StateKind.SUCCEEDED if closed else StateKind.RUNNING)
