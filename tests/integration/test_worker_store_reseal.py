"""The journal store's ``reseal`` on both backends (`octo-worker journal reseal`).

Rows a running worker never writes again (closed sessions above all) keep
the key that sealed them; reseal moves every row of a scope onto the active
storage and data keys at its own revision, so an old key can be retired.
"""

from __future__ import annotations

from typing import Any

import pytest

from octo_common.errors import OctoError, UnknownKeyId
from octo_common.messages import CloseSession
from octo_common.records import StorageKey, StorageKeyring
from octo_worker.storage.base import JournalStoreBase

from .journal_backends import JournalDatabase
from .test_session_concurrency import (
    SCOPE,
    CountingAdapter,
    Delivery,
    dispatch,
    open_session,
    registry,
)

K1, K2 = StorageKey(bytes([1]) * 32), StorageKey(bytes([2]) * 32)
DK1, DK2 = StorageKey(bytes([3]) * 32), StorageKey(bytes([4]) * 32)


def keyring(active: tuple[str, StorageKey], *old: tuple[str, StorageKey]) -> StorageKeyring:
    ring = StorageKeyring(active[0], active[1].reveal())
    for key_id, key in old:
        ring.add_read_key(key_id, key.reveal())
    return ring


async def everything(store: JournalStoreBase) -> tuple[int, int, int]:
    """Open every row of the scope (journal, sessions, outbox): counts."""
    return (
        len(await store.list_records(SCOPE)),
        len(await store.load_sessions(SCOPE)),
        len(await store.load_outbox(SCOPE)),
    )


async def written_under_old_keys(journal_db: JournalDatabase) -> int:
    """A session that served two requests and closed, and one still open."""
    store = journal_db.store(keyring(("k1", K1)), data_keyring=keyring(("d1", DK1)))
    try:
        lease = await store.reserve_fence(SCOPE)
        closed, host = await open_session(store, lease, registry(CountingAdapter()), 10, 1)
        answers: list[Any] = []
        for n in (1, 2):
            await closed.handle(dispatch(host, n), store, Delivery(host, answers))
        await closed.handle(host.seal(CloseSession(host.session_id)), store, Delivery(host, []))
        live, other = await open_session(store, lease, registry(CountingAdapter()), 10, 2)
        await live.handle(dispatch(other, 3), store, Delivery(other, answers))
        return await store.head_revision(SCOPE)
    finally:
        await store.close()


async def test_reseal_moves_every_row_onto_the_active_keys(journal_db: JournalDatabase) -> None:
    head = await written_under_old_keys(journal_db)

    rotated = journal_db.store(
        keyring(("k2", K2), ("k1", K1)), data_keyring=keyring(("d2", DK2), ("d1", DK1))
    )
    try:
        counts = await everything(rotated)
        requests = sum(len(s.requests) for s in (await rotated.load_sessions(SCOPE)).values())
        assert requests == 3  # one row per retained request id
        rows = counts[0] + 2 * counts[1] + counts[2] + requests  # a session is two rows
        report = await rotated.reseal(SCOPE)
        # The journal rows were sealed again when the store opened: their items
        # (keyed hashes) moved onto the active key then.
        assert (report.resealed, report.current) == (rows - counts[0], counts[0])
        assert await rotated.head_revision(SCOPE) == head  # nothing else moved
        again = await rotated.reseal(SCOPE)
        assert (again.resealed, again.current) == (0, rows)
    finally:
        await rotated.close()

    # The old keys can go: every row opens without them.
    retired = journal_db.store(keyring(("k2", K2)), data_keyring=keyring(("d2", DK2)))
    try:
        assert await everything(retired) == counts
    finally:
        await retired.close()


async def test_without_reseal_closed_sessions_still_need_the_old_key(
    journal_db: JournalDatabase,
) -> None:
    await written_under_old_keys(journal_db)
    retired = journal_db.store(keyring(("k2", K2)), data_keyring=keyring(("d2", DK2)))
    try:
        with pytest.raises(UnknownKeyId):
            await retired.load_sessions(SCOPE)
    finally:
        await retired.close()


async def test_reseal_stops_at_a_tampered_row_and_leaves_a_row_written_meanwhile(
    journal_db: JournalDatabase,
) -> None:
    await written_under_old_keys(journal_db)
    before = await journal_db.sql("SELECT id, envelope FROM items ORDER BY id")
    row_id = before[-1][0]
    # Another row's envelope in its place: it no longer authenticates there.
    await journal_db.sql("UPDATE items SET envelope = ? WHERE id = ?", before[0][1], row_id)
    store = journal_db.store(  # as ``journal reseal`` opens it, beside a running daemon
        keyring(("k2", K2), ("k1", K1)),
        data_keyring=keyring(("d2", DK2), ("d1", DK1)),
        maintenance=True,
    )
    try:
        with pytest.raises(OctoError):
            await store.reseal(SCOPE)
        # A row whose envelope changed since it was read is not overwritten.
        first_id = before[0][0]
        replaced = await store._replace_envelopes(
            SCOPE, [(first_id, 1, b"not what is stored", b"x")]
        )
        assert replaced == 0
    finally:
        await store.close()
    stored = dict(await journal_db.sql("SELECT id, envelope FROM items"))
    # Nothing was written: the batch failed before its transaction.
    assert all(stored[i] == e for i, e in before[:-1])
