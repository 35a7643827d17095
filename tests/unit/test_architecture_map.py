"""docs/architecture.md stays true: one line for every module, and no line for a module gone.

A module's line is a list item that starts with its path in backticks.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "docs" / "architecture.md"
MAPPED_PACKAGES = ["octo_host", "octo_worker", "octo_common"]
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


def _steps(title: str) -> list[str]:
    text = MAP.read_text(encoding="utf-8")
    section = text.split(f"### {title}", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. (.*)$", section, re.MULTILINE)


def test_the_worker_dispatch_path_has_at_most_twelve_steps_naming_real_files() -> None:
    steps = _steps("The worker's side of one dispatch")
    assert 1 <= len(steps) <= 12, len(steps)
    files = {name for step in steps for name in re.findall(r"\(`([\w/]+\.py)`", step)}
    assert files, "no file named in the steps: this test would check nothing"
    missing = [
        name
        for name in files
        if not (ROOT / name).is_file() and not (ROOT / "octo_worker" / name).is_file()
    ]
    assert missing == []
