"""The shared journal's anchor file: raised, never lowered, one writer at a time."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from octo_common.errors import RollbackAnchorMissing, RollbackDetected
from octo_worker.storage.store_anchor import StoreAnchor


def test_the_anchor_is_raised_never_lowered_and_kept_per_schema(tmp_path: Path) -> None:
    path = tmp_path / "journal.anchor"
    anchor, other = StoreAnchor(path, "journal_a"), StoreAnchor(path, "journal_b")
    with pytest.raises(RollbackAnchorMissing):
        anchor.read()
    with pytest.raises(RollbackAnchorMissing):
        anchor.advance(3)  # never recreated by a commit
    anchor.initialize(2)
    assert anchor.read() == 2
    assert other.read() == 0  # one file may anchor several schemas
    anchor.advance(5)
    anchor.advance(4)
    assert anchor.read() == 5
    other.advance(1)
    assert (anchor.read(), other.read()) == (5, 1)
    anchor.initialize(1)  # the operator's explicit re-anchoring
    assert anchor.read() == 1
    anchor.check(1, 1)
    with pytest.raises(RollbackDetected):
        anchor.check(0, 1)
    assert path.stat().st_mode & 0o777 == 0o600


def test_concurrent_advances_in_one_process_keep_the_highest(tmp_path: Path) -> None:
    path = tmp_path / "journal.anchor"
    anchor = StoreAnchor(path, "journal")
    anchor.initialize(0)
    revisions = list(range(1, 201))

    def advance(chunk: list[int]) -> None:
        for revision in chunk:
            anchor.advance(revision)

    threads = [threading.Thread(target=advance, args=(revisions[i::8],)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert anchor.read() == 200
