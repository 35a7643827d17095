"""Key files that are FIFOs are refused at once, never waited on (every loader)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from octo_common.errors import InvalidScopeKey, InvalidStorageKey
from octo_common.frames import ScopeKey
from octo_host import config as host_config
from octo_host.store import load_storage_key
from octo_worker import config as worker_config
from octo_worker.config import InvalidConfiguration

LOADERS: dict[str, tuple[Callable[[Path], Any], type[Exception]]] = {
    "ScopeKey.from_file": (ScopeKey.from_file, InvalidScopeKey),
    "host store key": (load_storage_key, InvalidStorageKey),
    "host config scope key": (
        lambda path: host_config.load_scope_key(path, "scope key"),
        host_config.InvalidConfiguration,
    ),
    "worker config key": (
        lambda path: worker_config.load_key_file(path, "scopes.t.key_file"),
        InvalidConfiguration,
    ),
}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_fifo_as_key_file_is_refused_without_waiting_for_a_writer(
    tmp_path: Path, name: str
) -> None:
    loader, error = LOADERS[name]
    fifo = tmp_path / "key"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            loader(fifo)
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(5.0)
    if thread.is_alive():
        # Unblock the loader so the thread ends, then fail: it waited for a writer.
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5.0)
        pytest.fail(f"{name} blocked opening a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], error), outcome
