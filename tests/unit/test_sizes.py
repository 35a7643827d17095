"""Rooms a newcomer can hold in their head: no module over 800 lines, no class over 600.

Past either limit a module or class is split by concept (docs/architecture.md
maps where each concept lives).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("octo_common", "octo_worker", "octo_host")
MAX_MODULE_LINES = 800
MAX_CLASS_LINES = 600


def _modules() -> list[Path]:
    found = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
    assert len(found) > 50, "the packages were not found: this test would check nothing"
    return found


def test_no_module_is_over_800_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text("utf-8").splitlines()) for p in _modules()}
    assert {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES} == {}


def test_no_class_is_over_600_lines() -> None:
    too_big: dict[str, int] = {}
    classes = 0
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.ClassDef):
                classes += 1
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    too_big[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert classes > 100, "no classes found: this test would check nothing"
    assert too_big == {}
