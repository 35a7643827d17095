"""TLC on the model (``model/Octo.tla``): its configurations as built hold every
invariant, each broken variant yields a counterexample, and every kill point of
the crash matrix is an action of the model that TLC takes (docs/model.md)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from octo_common.runtime.faults import FAULT_POINTS

from . import tlc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_ROW = re.compile(r"^\| `([a-z_.]+)` \| `(\w+)` \|", re.M)
_PARSED = re.compile(r"^Parsing file (.+\.tla)$", re.M)


def kill_point_table() -> dict[str, str]:
    """docs/model.md's table: kill point -> the model action that stands for it."""
    text = (ROOT / "docs" / "model.md").read_text("utf-8")
    section = text.split("## Kill points", 1)[1]
    return {point: action for point, action in _ROW.findall(section)}


@pytest.fixture(scope="module")
def checked() -> list[tlc.TlcRun]:
    # The bounded configurations (tlc.BOUNDED); `make model` checks them as built.
    return tlc.check_configs(coverage=True, overrides=tlc.BOUNDED)


@pytest.fixture(scope="module")
def broken() -> dict[str, tlc.TlcRun]:
    return tlc.check_all_broken(overrides=tlc.BOUNDED)


def test_the_table_names_every_kill_point_and_an_action_of_the_model() -> None:
    table = kill_point_table()
    assert set(table) == set(FAULT_POINTS)
    module = (tlc.MODEL / "Octo.tla").read_text("utf-8")
    nxt = module.split("\nNext ==", 1)[1].split("\nSpec ==", 1)[0]
    for point, action in table.items():
        assert re.search(rf"^{action}\b.*==", module, re.M), (point, action)
        assert re.search(rf"\b{action}\b", nxt), (point, action, "not in Next")


def test_every_configuration_holds_every_invariant(checked: list[tlc.TlcRun]) -> None:
    for run in checked:
        assert run.clean, (run.name, run.violated, run.output[-3000:])
        assert run.distinct > 1000, (run.name, run.distinct)
        print(f"{run.name}: {run.distinct} distinct states in {run.seconds:.1f} s")


def test_each_tlc_run_reads_the_standard_modules_from_its_own_directory(
    checked: list[tlc.TlcRun],
) -> None:
    # TLC writes Naturals.tla and the others out to its temporary directory before
    # parsing them: a directory shared with TLC runs of other processes lets one
    # run parse another's half-written copy.
    for run in checked:
        parsed = [Path(line) for line in _PARSED.findall(run.output)]
        assert any(path.name == "Naturals.tla" for path in parsed), (run.name, parsed)
        for path in parsed:
            assert path.parent.name.startswith("octo-tlc-"), (run.name, str(path))


def test_tlc_takes_the_action_of_every_kill_point(checked: list[tlc.TlcRun]) -> None:
    taken: dict[str, int] = {}
    for run in checked:
        for action, count in run.taken.items():
            taken[action] = taken.get(action, 0) + count
    assert taken, "TLC reported no coverage"
    for point, action in kill_point_table().items():
        assert taken.get(action, 0) > 0, (point, action, "never taken")


@pytest.mark.parametrize("variant", tlc.BROKEN, ids=lambda v: v.bug)
def test_a_broken_variant_produces_a_counterexample(
    variant: tlc.Broken, broken: dict[str, tlc.TlcRun]
) -> None:
    run = broken[variant.bug]
    assert run.violated == variant.invariant, (variant.bug, run.violated, run.output[-3000:])
    assert "The behavior up to this point is" in run.output
