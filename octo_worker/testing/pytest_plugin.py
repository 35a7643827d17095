"""The pytest plugin of the adapter test kit: the ``adapter_kit`` fixture.

Loaded by pytest through the ``pytest11`` entry point ``octo_worker`` when
Octo is installed (or with ``-p octo_worker.testing.pytest_plugin``).
``adapter_kit(adapter)`` or ``adapter_kit("tool.name", **options)`` (the
plug-in loaded through its ``octo.adapters`` entry point, as the daemon
loads it) returns an unstarted :class:`~octo_worker.testing.AdapterKit`
whose journal lives in the test's ``tmp_path``; use it as
``async with adapter_kit(...) as kit:``. Each kit gets a directory of its own.

It must never start anything by itself or touch anything outside ``tmp_path``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from octo_worker.adapters.contract import WorkerAdapter
from octo_worker.testing.kit import AdapterKit

__all__ = ["adapter_kit"]

KitFactory = Callable[..., AdapterKit]


@pytest.fixture
def adapter_kit(tmp_path: Path) -> KitFactory:
    """Make :class:`AdapterKit` objects in this test's temporary directory."""
    made = 0

    def make(adapter: WorkerAdapter | str, /, **options: Any) -> AdapterKit:
        nonlocal made
        made += 1
        directory = tmp_path / f"adapter-kit-{made}"
        if isinstance(adapter, str):
            return AdapterKit.load(adapter, directory, **options)
        return AdapterKit(adapter, directory, **options)

    return make
