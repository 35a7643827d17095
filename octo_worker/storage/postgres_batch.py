"""The PostgreSQL journal's batch writes: a whole group commit in one statement (its fast path).

Also the statements both write paths share: the heads locked and shown to
the decisions (:func:`see_locked_heads`), the rows written
(:func:`write_rows`) and the heads advanced (:func:`advance_heads`), and a
reservation's head lock (:func:`lock_head`), which ends a replaced owner's
stuck transaction rather than wait for it.

The per-change-set path of :class:`~octo_worker.storage.postgres.PostgresJournalStore`
runs one compare-and-swap statement per change set inside the batch's one
transaction; on a loaded server each is a round trip of a millisecond or
more, one after the other. :func:`write_batch` does the same work with one
statement for the batch, for the batches where that is exactly equivalent:
every change set of one scope succeeds. It decides twice, with the same
:class:`~octo_worker.storage.changes.CommitBatch` rules: first on a copy
(``dry``: each change set's writes and revision, as if every earlier one
committed), then, once the statement ran, on the transaction's own record
(``decisions``), with the outbox rows the statement deleted.

Each row the batch writes is written once, at its last write (its last
revision and sealed envelope; writes before it in the batch are overwritten
within the same transaction anyway), and checked against its FIRST write's
base. Anything the per-change-set path would decide differently raises
:class:`SlowPath` before the transaction commits: a refusal of any kind (a
fence, a conflict, a broken chain, the revision ceiling), a digest that
cannot move, a session closed (its opening row is marked by the other
path), an outbox row both written and deleted, several scopes, or a count
that is not the expected one. The caller then rolls back and runs the
batch again on the per-change-set path, so every outcome stays the one the
rules give.

It must never commit a batch in which any change set would have been
refused, write a row at a revision its change set did not get, or decide a
digest it did not move through ``CommitBatch``.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from octo_common.errors import OctoError, RollbackDetected
from octo_common.records import StorageKeyring
from octo_worker.storage.changes import CommitBatch, PendingCommit, RowWrite, closed_sessions
from octo_worker.storage.documents import NS_JOURNAL, NS_OUTBOX
from octo_worker.storage.scope_head import DigestChanges, ScopeHead
from octo_worker.storage.sealing import RowSealer, written_tag

__all__ = [
    "SlowPath",
    "advance_heads",
    "lock_head",
    "see_locked_heads",
    "write_batch",
    "write_rows",
]


async def lock_head(
    connection: Any, pool: Any, sql: dict[str, str], scope: str, seconds: float
) -> Any:
    """A reservation's head row, locked (None: no head), waiting at most ``seconds``.

    False when the wait ran out: the sessions holding a write lock on the
    heads for longer than that (a replaced owner's stuck transaction, see
    ``postgres_sql``'s ``end_stale_holders``) were ended, and the caller's
    transaction (aborted by the timeout) must run again.
    """
    await connection.execute(f"SET LOCAL lock_timeout = {int(seconds * 1000)}")
    try:
        return await connection.fetchrow(sql["lock_head"], scope)
    except asyncpg.exceptions.LockNotAvailableError:
        async with pool.acquire() as other:
            await other.fetchval(sql["end_stale_holders"], seconds)
        return False


async def see_locked_heads(
    connection: Any, statement: str, scopes: list[str], *records: CommitBatch | None
) -> None:
    """Lock the heads of ``scopes`` (``lock_heads``) and show each to every record."""
    for row in await connection.fetch(statement, scopes):
        name = str(row[0])
        for record in records:
            if record is not None:
                record.see_head(name, ScopeHead.from_row(name, tuple(row)[1:]))
    for scope in scopes:
        for record in records:
            if record is not None and record.needs_head(scope):
                record.see_head(scope, None)


async def advance_heads(
    connection: Any, statement: str, decisions: CommitBatch, sealer: RowSealer
) -> bool:
    """The heads the batch moved, resealed (``advance_heads``); False when the
    statement's fence and revision guard refused one of them."""
    heads = [sealer.seal_head(head).row() for head in decisions.advanced_heads()]
    if not heads:
        return True
    moved = await connection.fetch(
        statement,
        [head.scope for head in decisions.advanced_heads()],
        *(list(column) for column in zip(*heads, strict=True)),
    )
    return len(moved) == len(heads)


async def write_rows(
    connection: Any,
    statement: str,
    scope: str,
    now: float,
    rows: list[tuple[RowWrite, int | None, int, bytes]],
    closes: list[str],
    deletes: list[str],
    keyring: StorageKeyring,
) -> tuple[Any, ...]:
    """``write_change_set`` for ``rows`` (each: the write, the base it is checked
    against, its revision, its sealed envelope); the statement's result row. Each
    journal row carries the seal of its ``written_at`` (``now``) at its revision."""
    tags = {
        revision: written_tag(keyring, scope, revision, now)
        for write, _, revision, _ in rows
        if write.namespace == NS_JOURNAL
    }
    found = await connection.fetchrow(
        statement,
        scope,
        now,
        [write.namespace for write, _, _, _ in rows],
        [write.item for write, _, _, _ in rows],
        [base for _, base, _, _ in rows],
        [revision for _, _, revision, _ in rows],
        [envelope for _, _, _, envelope in rows],
        [write.closed for write, _, _, _ in rows],
        [write.session for write, _, _, _ in rows],
        closes,
        deletes,
        [
            tags.get(revision) if write.namespace == NS_JOURNAL else None
            for write, _, revision, _ in rows
        ],
    )
    assert found is not None
    return tuple(found)


class SlowPath(Exception):
    """This batch needs the per-change-set path (nothing it wrote may stay)."""


_Plan = tuple[PendingCommit, tuple[RowWrite, ...], int]


def _decide(
    decisions: CommitBatch, plans: list[_Plan] | None, deleted: dict[str, int]
) -> list[_Plan]:
    """Steps 1-4 for every change set on ``decisions``, as if each commits; the
    outbox rows in ``deleted`` (item -> revision) move the digest of the first
    change set that names them. ``plans``: what the first pass decided (the
    second must decide the same)."""
    decided: list[_Plan] = []
    for index, pending in enumerate(decisions.batch):
        try:
            writes, revision = decisions.check(pending)
        except OctoError:
            raise SlowPath() from None
        if revision is None or any(write.after is not None for write in writes):
            raise SlowPath()
        if plans is not None and (plans[index][1], plans[index][2]) != (writes, revision):
            raise SlowPath()
        moves = DigestChanges()
        for write in writes:
            moves.wrote(write.namespace, write.item, write.base_revision, revision)
        for item in pending.outbox_delete:
            old = deleted.pop(item, None)
            if old is not None:
                moves.wrote(NS_OUTBOX, item, old, None)
        try:
            if plans is not None:  # the statement confirmed every base
                decisions.check_live(pending, moves)
            digest = decisions.moved_digest(pending, moves)
        except RollbackDetected:
            raise SlowPath() from None
        decisions.committed_one(pending, revision, digest)
        decided.append((pending, writes, revision))
    return decided


async def write_batch(
    connection: Any,
    statement: str,  # postgres_sql's write_change_set
    decisions: CommitBatch,
    dry: CommitBatch,
    sealer: RowSealer,
    now: float,
) -> None:
    """Every change set of ``decisions.batch`` committed by one statement, or
    :class:`SlowPath` (see the module docstring). ``dry`` has seen the same heads."""
    scopes = {pending.scope for pending in decisions.batch}
    if len(scopes) != 1:
        raise SlowPath()
    (scope,) = scopes
    plans = _decide(dry, None, {})
    # Each row: its first base, then its last write and that write's revision.
    rows: dict[tuple[str, str], tuple[int | None, RowWrite, int]] = {}
    deletes: dict[str, None] = {}
    for pending, writes, revision in plans:
        if closed_sessions(writes):
            raise SlowPath()
        for write in writes:
            key = (write.namespace, write.item)
            if key in rows:
                if write.base_revision != rows[key][2]:
                    # Not built on what an earlier change set of this batch wrote
                    # (a second insert of one key, say): the per-change-set
                    # path refuses it by its own compare-and-swap.
                    raise SlowPath()
                first = rows[key][0]
            else:
                first = write.base_revision
            rows[key] = (first, write, revision)
        deletes.update(dict.fromkeys(pending.outbox_delete))
    if any((NS_OUTBOX, item) in rows for item in deletes):
        raise SlowPath()
    found = await write_rows(
        connection,
        statement,
        scope,
        now,
        [
            (write, first, revision, sealer.seal(scope, write, revision))
            for first, write, revision in rows.values()
        ],
        [],  # no session closes (refused above)
        list(deletes),
        sealer.keyring,
    )
    refused_at, _, written, _, deleted_items, deleted_revisions = found
    if refused_at is not None or written != len(rows):
        raise SlowPath()
    deleted = {
        str(item): int(old)
        for item, old in zip(deleted_items or (), deleted_revisions or (), strict=True)
    }
    _decide(decisions, plans, deleted)
