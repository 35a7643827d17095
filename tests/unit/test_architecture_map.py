"""docs/architecture.md stays true: one line for every module, and no line for a module gone.

A module's line is a list item that starts with its path in backticks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "architecture.md"
MAPPED_PACKAGES = ["octo_host"]
_LINE = re.compile(r"^- `((?:octo_common|octo_worker|octo_host)/[\w/]+\.py)`", re.MULTILINE)


def mapped() -> list[str]:
    return _LINE.findall(MAP.read_text(encoding="utf-8"))


def modules(package: str) -> set[str]:
    return {str(path.relative_to(ROOT)) for path in (ROOT / package).rglob("*.py")}


@pytest.mark.parametrize("package", MAPPED_PACKAGES)
def test_every_module_has_one_line(package: str) -> None:
    lines = [path for path in mapped() if path.startswith(package + "/")]
    assert sorted(modules(package) - set(lines)) == []
    assert len(lines) == len(set(lines)), "a module has two lines"


def test_every_line_names_a_module_that_exists() -> None:
    paths = mapped()
    assert paths, "no module lines found: this test would check nothing"
    assert [path for path in paths if not (ROOT / path).is_file()] == []
