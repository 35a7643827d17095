"""The fuzz targets in make test: the corpus replayed, then a short atheris run of each.

``make fuzz`` runs each target for longer (``tests/fuzz/run.py``); this keeps
every target working and every kept input (seeds, inputs that reached new
code, and the inputs of defects found, named ``regression-*``) answered with
a stable error or a value, never another exception.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from . import run
from .targets import TARGETS

pytestmark = pytest.mark.slow

# Every target in one atheris process (the first byte picks the target): what
# the smoke checks is that each runs and holds on what the fuzzer reaches in
# this time; the long runs, target by target over the corpus, are make fuzz.
SMOKE_SECONDS = 6


def corpus(target: str) -> list[Path]:
    return sorted((run.CORPUS / target).glob("*"))


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_kept_input_of_a_target_is_answered(target: str) -> None:
    inputs = corpus(target)
    assert inputs, f"{target} has no corpus"
    for path in inputs:
        TARGETS[target](path.read_bytes())


def test_every_target_holds_under_a_short_atheris_run() -> None:
    (result,) = run.fuzz([run.ALL], SMOKE_SECONDS, scratch=True)
    assert result.ok, result.output[-3000:]
    assert result.execs > 0, result.output[-3000:]
    print(f"{result.execs} execs over {len(TARGETS)} targets")
