"""The live index of a loaded scope (``octo_worker.storage.row_index``): pure, no I/O."""

from __future__ import annotations

import random

import pytest

from octo_common.errors import RollbackDetected
from octo_worker.storage.row_index import RowIndex

J = "worker-journal"
OUTBOX = "worker-outbox"


def built(rows: list[tuple[str, str, int]]) -> RowIndex:
    index, passing = RowIndex.building(rows, len(rows))
    assert list(passing) == rows
    return index


def row(item: str, revision: int) -> tuple[str, int, bytes]:
    return (item, revision, b"")


def test_the_index_matches_a_model_through_inserts_rewrites_and_deletes() -> None:
    rng = random.Random(7)
    model: dict[tuple[str, str], int] = {}
    index = RowIndex()
    for step in range(30_000):
        namespace = rng.choice((J, OUTBOX, "worker-session"))
        item = f"k-{rng.randrange(2_000)}"
        revision = rng.choice((None, None, rng.randrange(1, 2**62)))
        index.apply([(namespace, item, revision)], step)
        if revision is None:
            model.pop((namespace, item), None)
        else:
            model[(namespace, item)] = revision
    assert len(index) == len(model)
    for namespace in (J, OUTBOX, "worker-session"):
        assert index.count(namespace) == sum(1 for n, _ in model if n == namespace)
        for number in range(2_000):
            assert index.get(namespace, f"k-{number}") == model.get((namespace, f"k-{number}"))


def test_a_row_read_must_be_at_the_indexed_revision() -> None:
    index = built([(J, "op-1", 3), (J, "op-2", 5)])
    index.revision = 5
    index.check_rows(J, ["op-1", "op-2"], [row("op-1", 3), row("op-2", 5)])
    with pytest.raises(RollbackDetected):  # put back to an older copy
        index.check_rows(J, ["op-1"], [row("op-1", 2)])
    with pytest.raises(RollbackDetected):  # deleted
        index.check_rows(J, ["op-1"], [])
    with pytest.raises(RollbackDetected):  # copied in
        index.check_rows(J, ["op-3"], [row("op-3", 4)])
    index.check_rows(J, ["op-3"], [])  # never there


def test_a_row_newer_than_the_index_is_a_commit_not_yet_applied() -> None:
    index = built([(J, "op-1", 3)])
    index.revision = 5
    index.check_rows(J, ["op-1"], [row("op-1", 6)])
    index.check_rows(J, ["op-9"], [row("op-9", 6)])
    with pytest.raises(RollbackDetected):
        index.check_rows(J, ["op-9"], [row("op-9", 5)])


def test_a_whole_namespace_read_holds_every_row() -> None:
    index = built([(J, "op-1", 1), (J, "op-2", 2)])
    index.revision = 2
    index.check_rows(J, None, [row("op-1", 1), row("op-2", 2)])
    with pytest.raises(RollbackDetected):
        index.check_rows(J, None, [row("op-1", 1)])


def test_outbox_rows_may_be_gone_by_a_commit_the_read_overlapped() -> None:
    index = built([(OUTBOX, "m-1", 2)])
    index.revision = 4
    index.check_rows(OUTBOX, None, [], deletable=True)
    index.check_rows(OUTBOX, None, [row("m-2", 3)], deletable=True)
    with pytest.raises(RollbackDetected):  # an outbox row is never rewritten
        index.check_rows(OUTBOX, None, [row("m-1", 1)], deletable=True)


def test_expect_and_the_size_per_row() -> None:
    rows = [(J, f"op-{n}", n + 1) for n in range(100_000)]
    index = built(rows)
    assert index.expect(J, "op-7", 8)
    assert not index.expect(J, "op-7", 7)
    assert index.expect(J, "op-none", None)
    assert index.nbytes() / len(rows) <= 32


def test_a_read_that_a_commit_of_this_instance_overlapped_is_not_tampering() -> None:
    # The read's snapshot was taken at revision 5; a commit moved op-1 to 6 and
    # wrote the session s-2 at 6 before the read was checked.
    index = built([(J, "op-1", 3), ("worker-session", "s-1", 5)])
    index.revision = 5
    index.apply([(J, "op-1", 6), ("worker-session", "s-2", 6)], 6)
    index.check_rows(J, ["op-1"], [row("op-1", 3)], started=5)
    index.check_rows("worker-session", ["s-2"], [], started=5)
    index.check_rows("worker-session", None, [row("s-1", 5)], started=5)
    # Without the overlap the same reads are what they look like: not the head's rows.
    with pytest.raises(RollbackDetected):
        index.check_rows(J, ["op-1"], [row("op-1", 3)], started=6)
    with pytest.raises(RollbackDetected):
        index.check_rows("worker-session", ["s-2"], [], started=6)
    with pytest.raises(RollbackDetected):
        index.check_rows("worker-session", None, [row("s-1", 5)], started=6)


def test_an_overlapping_commit_excuses_only_the_rows_it_moved() -> None:
    index = built([(J, "op-1", 3), (J, "op-2", 4)])
    index.revision = 5
    index.apply([(J, "op-1", 6)], 6)
    with pytest.raises(RollbackDetected):  # op-2 was not moved: put back to an older copy
        index.check_rows(J, ["op-2"], [row("op-2", 2)], started=5)
    with pytest.raises(RollbackDetected):  # op-2 deleted beside the daemon
        index.check_rows(J, ["op-2"], [], started=5)
