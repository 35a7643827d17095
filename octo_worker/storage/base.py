"""The public API every journal backend shares: ``JournalStoreBase``.

Owns what a journal store does on the event loop whatever the database:
the argument checks of every entry point, a commit prepared before any I/O
and queued for group commit (``octo_common.runtime.groupcommit``), every loaded
row opened (authenticated, decrypted, its document's location checked:
``sealing.RowSealer``) and turned into what the caller asked for (journal
records, sessions with both their rows, outbox entries), and the operator
work built on loads (prune candidates chosen, rows resealed), and each
scope checked against its sealed head whenever it is loaded (every fence
reservation) or verified (``scope_head.check_snapshot``). The read-only
and maintenance modes refuse what they must not do before any I/O.

A backend (``sqlite.SqliteJournalStore``, ``postgres.PostgresJournalStore``)
supplies the primitives below: open, reserve a fence (the head verified and
resealed), run one batch of change sets as one transaction (deciding nothing
itself: ``changes.CommitBatch`` does, the scope digests included), read rows
beside their head in one snapshot (the floor rule, ``sealing.checked_rows``),
read a whole scope's head and row digest in one snapshot, and the
maintenance writes (each keeping the digest right).

It must never decide an outcome in a backend's place, log or raise with
keys, documents or frames, or let a caller's cancellation leave a
submitted commit's outcome unknown.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec
import structlog

from octo_common.errors import (
    InvalidJournalLease,
    OctoError,
    OperationPruned,
    RecordLocationMismatch,
    RollbackDetected,
    StorageBackendError,
)
from octo_common.ids import validate_token
from octo_common.records import StorageKeyring
from octo_common.runtime.groupcommit import GroupCommit
from octo_common.states import TERMINAL_KINDS
from octo_worker.journal import WorkerOperationRecord
from octo_worker.storage.changesets import (
    Outcomes,
    PendingCommit,
    Row,
    RowWrite,
    check_scope,
    prepare,
)
from octo_worker.storage.documents import (
    NS_JOURNAL,
    NS_OUTBOX,
    NS_SESSION,
    NS_SESSION_OPEN,
    NS_SESSION_REQUEST,
    journal_row_key,
    pruned_document,
    read_outbox,
    read_session,
    request_location,
    session_header,
    state_status,
)
from octo_worker.storage.interface import (
    LoadedScope,
    OutboxEntry,
    PersistedSession,
    PruneReport,
    ResealReport,
    ScopeCheck,
    ScopeMetadata,
    WorkerCommit,
    WorkerJournalLease,
    issue_lease,
)
from octo_worker.storage.journal_items import ItemLookups
from octo_worker.storage.row_index import RowIndex
from octo_worker.storage.scope_head import ScopeSnapshot, check_snapshot
from octo_worker.storage.sealing import RowSealer, check_written, check_written_times

__all__ = ["JournalStoreBase", "StoreStats"]


class StoreStats(msgspec.Struct, frozen=True):
    """Counters for observability: a snapshot, not a live view."""

    transactions: int
    change_sets: int
    committed_change_sets: int
    failed_change_sets: int
    largest_batch: int
    rows_opened: int = 0
    """Rows loaded, authenticated and decrypted (every load of every namespace)."""


_log = structlog.get_logger("octo_worker.store")

Resealed = tuple[int, int, bytes, bytes]
"""(row id, revision, envelope read, envelope sealed again) of one row ``reseal`` rewrites."""

Pruned = tuple[str, int, bytes, bytes]
"""(journal item, revision, envelope read, the pruned document sealed at that revision)."""


class JournalStoreBase(abc.ABC):
    """Rows, CAS revisions, fences, group commit and the outbox; see the module docstring.

    ``read_only=True`` (the operator's inspection verbs, beside a running
    daemon): every write call raises ``StorageBackendError`` before any
    I/O. ``maintenance=True`` (``prune`` and ``reseal`` beside a running
    daemon) may rewrite or delete rows but never moves a head: ``commit``
    and ``reserve_fence`` raise ``StorageBackendError``. With
    ``group_commit=False`` every change set gets its own transaction (for
    benchmarks); ``on_batch`` is told the size of every transaction.
    """

    # Takes chained session commits (SessionDocuments.link/after). A wrapper
    # that forwards this must hand change sets on in call order, without an
    # await before it does (a chained one arriving first fails closed).
    chains_session_commits: Final = True

    def __init__(
        self,
        keyring: StorageKeyring,
        data_keyring: StorageKeyring | None,
        *,
        group_commit: bool,
        on_batch: Callable[[int], None] | None,
        read_only: bool,
        maintenance: bool,
    ) -> None:
        self._sealer = RowSealer(keyring, data_keyring)
        # How an operation key is named at rest (``journal_items``): a keyed hash.
        self._lookups = ItemLookups(keyring)
        self._items = self._lookups.items
        self._keyring = keyring
        self._data_keyring = data_keyring
        self._read_only = read_only
        self._maintenance = maintenance
        # Concurrent commits share transactions; each caller gets its own outcome.
        self._commits: GroupCommit[PendingCommit, int | OctoError] = GroupCommit(
            self._run_batch, group=group_commit, on_batch=on_batch
        )
        self._committed = 0
        self._failed = 0
        # The live index of each scope this instance loaded under a fence
        # (``row_index``): every row a decision reads is checked against it,
        # and every commit against and into it (through ``CommitBatch``).
        self._live: dict[str, RowIndex] = {}
        # The first read that met rows not the loaded scope's (the daemon then
        # stops: a journal edited beside it is never served on).
        self.tampered: RollbackDetected | None = None
        self._opened = False
        self._closed = False

    # What a backend supplies ----------------------------------------------------------

    @abc.abstractmethod
    async def _ensure_open(self) -> None:
        """Open the database on first use (``StorageBackendError`` once closed)."""

    @abc.abstractmethod
    async def _reserve(self, scope: str) -> int:
        """Reserve a fence in one transaction: the head created (fence 1) or verified, its fence
        raised and the head resealed; the head revision read becomes the commit baseline."""

    @abc.abstractmethod
    async def _scope_snapshot(self, scope: str) -> ScopeSnapshot:
        """The scope's head and the digest recomputed over all its rows, in one read
        snapshot, with the anchored revision (O(rows of the scope), off the event loop)."""

    @abc.abstractmethod
    async def _store_check(self) -> int:
        """The store head against every scope head in one snapshot (``store_head``):
        how many scope heads it holds."""

    @abc.abstractmethod
    async def _reseal_head(self, scope: str) -> bool:
        """Reseal the scope's head with the active key if another sealed it; whether it did."""

    @abc.abstractmethod
    def _run_batch(self, batch: list[PendingCommit], done: Callable[[Outcomes], None]) -> None:
        """Start one transaction for ``batch``; ``done`` gets one outcome per change set."""

    @abc.abstractmethod
    async def _rows(self, scope: str, namespace: str, items: Sequence[str] | None) -> list[Row]:
        """Rows of ``items`` (None: every row, oldest revision first), floor-checked."""

    @abc.abstractmethod
    async def _outbox_rows(self, scope: str, session: str) -> tuple[list[Row], bool]:
        """One session's outbox rows, oldest revision first, and whether they were
        chosen by their session column (False: every outbox row of the scope, for
        the caller to choose from)."""

    @abc.abstractmethod
    async def _session_rows(
        self, scope: str, keep: Sequence[str] | None
    ) -> tuple[list[Row], list[Row], list[Row]]:
        """(state rows, opening rows, request rows of those sessions), in one snapshot;
        with ``keep``, live sessions and those named."""

    @abc.abstractmethod
    async def _prunable_rows(self, scope: str, cutoff: float) -> list[tuple[Row, Any, Any]]:
        """Journal rows written before ``cutoff``, floor-checked, with (written_at, seal)."""

    @abc.abstractmethod
    async def _row_batch(self, scope: str, after: int) -> list[tuple[int, str, Row]]:
        """The next rows of every namespace after row id ``after``, as (id, namespace, row)."""

    @abc.abstractmethod
    async def _head(self, scope: str) -> int:
        """The scope's committed revision (0 without a head)."""

    @abc.abstractmethod
    async def _scope_names(self, *, stored: bool = False) -> list[str]:
        """Every scope with a head; ``stored``: every scope with a head or a row."""

    @abc.abstractmethod
    async def _metadata(self, scope: str) -> ScopeMetadata: ...

    @abc.abstractmethod
    async def _integrity(self) -> list[str]: ...

    @abc.abstractmethod
    async def _prune_rows(self, scope: str, victims: Sequence[Pruned]) -> int:
        """Swap the envelopes of journal rows still at the revision and envelope read
        for their pruned ones (no head or digest moves); how many."""

    @abc.abstractmethod
    async def _replace_envelopes(self, scope: str, changes: Sequence[Resealed]) -> int:
        """Swap envelopes of rows still at the revision and envelope read; how many."""

    @abc.abstractmethod
    async def _mark_closed_rows(self, scope: str, ids: Sequence[str]) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish queued commits, release the database. Idempotent."""

    # The public API -------------------------------------------------------------------------

    @property
    def stats(self) -> StoreStats:
        """How many transactions ran, the change sets they carried, the rows opened."""
        commits = self._commits
        return StoreStats(
            commits.transactions,
            commits.submitted,
            self._committed,
            self._failed,
            commits.largest_batch,
            rows_opened=self._sealer.opened,
        )

    async def reserve_fence(self, scope: str) -> WorkerJournalLease:
        """Create the head if absent, add 1 to its fence, return it.

        The head must authenticate; the head revision read in the same
        transaction becomes this store instance's commit baseline for the
        scope. Then the whole scope is checked against its head
        (:meth:`verify_scope`): no lease for a scope whose rows are not the
        head's (``RollbackDetected``).
        """
        check_scope(scope)
        self._check_committing()
        self._live.pop(scope, None)
        token = await self._reserve(scope)
        snapshot = await self._checked_snapshot(scope)
        if snapshot.live is not None:
            self._live[scope] = snapshot.live
        return issue_lease(scope, token)

    async def verify_scope(self, scope: str) -> ScopeCheck:
        """Check every row of ``scope`` against its sealed head, in one read snapshot.

        The head must authenticate and not be below the anchor, and the
        digest recomputed over the scope's rows (journal, session and outbox
        rows) must be the head's: a row deleted, put back to an older sealed
        version or copied in is ``RollbackDetected``. O(rows of the scope);
        rows are not opened here (``journal verify`` opens each one besides).
        """
        check_scope(scope)
        snapshot = await self._checked_snapshot(scope)
        return ScopeCheck(snapshot.revision, snapshot.rows, snapshot.computed is not None)

    async def verify_store(self) -> int:
        """Every scope head against the sealed store head, in one read snapshot
        (O(scopes)): a scope deleted whole, or put back whole to an earlier copy, is
        ``RollbackDetected`` whatever the other scopes hold. Returns how many scope
        heads the store holds. Every scope load makes the same check."""
        await self._ensure_open()
        return await self._store_check()

    async def _checked_snapshot(self, scope: str) -> ScopeSnapshot:
        snapshot = await self._scope_snapshot(scope)
        check_snapshot(snapshot, self._keyring)
        await asyncio.to_thread(check_written_times, self._keyring, scope, snapshot.written or ())
        if snapshot.live is not None:
            self._lookups.check_key_ids(snapshot.live.journal_key_ids)
        return snapshot

    async def _check_keys_once(self, scope: str) -> None:
        """Before a lookup: every journal row's item is under a key the keyring still
        holds, so that a lookup that misses means no row (a row hashed under a key
        this keyring lacks would look absent). A scope this instance loaded has its
        key ids in its live index; another one (an operator's read) is read once,
        its head authenticated (other key material under the same id fails here)."""
        index = self._live.get(scope)
        if index is not None:
            self._lookups.check_key_ids(index.journal_key_ids)
            return
        key_ids = self._lookups.checked.get(scope)
        if key_ids is None:
            snapshot = await self._scope_snapshot(scope)
            if snapshot.head is not None:
                self._sealer.verify_head(snapshot.head)
            key_ids = self._lookups.remember(
                scope, snapshot.live.journal_key_ids if snapshot.live else ()
            )
        self._lookups.check_key_ids(key_ids)

    def journal_items(self, scope: str, key: str) -> tuple[str, ...]:
        """Every journal item ``key``'s row may be stored under in ``scope`` (the items
        ``ScopeMetadata.written_at`` is keyed by)."""
        check_scope(scope)
        validate_token("operation key", key)
        return self._items.candidates(scope, key)

    def _live_revision(self, scope: str) -> int | None:
        """The live index's revision, taken before a read that ``_check_live`` checks."""
        index = self._live.get(scope)
        return None if index is None else index.revision

    def _check_live(
        self,
        scope: str,
        namespace: str,
        items: Sequence[str] | None,
        rows: Sequence[Row],
        started: int | None,
    ) -> None:
        """Rows a decision reads against the scope's live index, when this instance
        loaded the scope: ``RollbackDetected`` when they are not the head's rows.
        ``started``: the index's revision before the read (its commits may overlap it)."""
        index = self._live.get(scope)
        if index is not None:
            try:
                index.check_rows(
                    namespace, items, rows, deletable=namespace == NS_OUTBOX, started=started
                )
            except RollbackDetected as error:
                if self.tampered is None:
                    self.tampered = error
                raise

    async def commit(self, scope: str, lease: WorkerJournalLease, changes: WorkerCommit) -> int:
        """Commit one change set; returns the new scope revision.

        Concurrent calls share transactions (group commit); each caller gets
        the outcome it would have had alone. Once submitted, the commit is
        shielded from the caller's cancellation: it completes or fails.
        """
        check_scope(scope)
        if not isinstance(lease, WorkerJournalLease) or not lease.is_for(scope):
            raise InvalidJournalLease()
        if not isinstance(changes, WorkerCommit):
            raise TypeError("changes must be a WorkerCommit")
        writes, new_sessions = prepare(scope, changes)
        if changes.journal is not None:
            writes = self._lookups.stored_writes(scope, writes)
        self._check_committing()
        await self._ensure_open()
        if self._closed:
            raise StorageBackendError("store is closed")
        # The change set now belongs to the queue: cancelling this caller cancels
        # only its window on the outcome, never the commit.
        outcome: int | OctoError = await self._commits.submit(
            PendingCommit(scope, lease.token, writes, new_sessions, tuple(changes.outbox_delete))
        )
        if isinstance(outcome, OctoError):
            self._failed += 1
            raise outcome
        self._committed += 1
        return outcome

    async def load_records(
        self, scope: str, keys: Iterable[str]
    ) -> dict[str, tuple[WorkerOperationRecord, int] | None]:
        """The rows of ``keys`` (None for a key without a row), the journal view's ``records``,
        each looked up under its items at rest (``journal_items``); two rows for one key
        are ``RollbackDetected``."""
        check_scope(scope)
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            validate_token("operation key", key)
        await self._check_keys_once(scope)  # opens the store: its items' form is known
        owners = self._lookups.asked(scope, wanted)
        items = list(owners)
        started = self._live_revision(scope)
        rows = await self._rows(scope, NS_JOURNAL, items)
        result: dict[str, tuple[WorkerOperationRecord, int] | None] = dict.fromkeys(wanted)
        for row in rows:
            key = owners[row.item]
            if result[key] is not None:
                raise RollbackDetected(None, row.revision)
            result[key] = (self._record(scope, row, key), row.revision)
            self._lookups.found(scope, key, row.item)
        self._check_live(scope, NS_JOURNAL, items, rows, started)
        return result

    async def list_records(self, scope: str) -> list[tuple[WorkerOperationRecord, int]]:
        """Every journal row of ``scope``, oldest revision first, pruned rows left out
        (operator helper; every row is authenticated)."""
        check_scope(scope)
        rows = await self._rows(scope, NS_JOURNAL, None)
        kept = [(self._kept_record(scope, row), row.revision) for row in rows]
        return [(record, revision) for record, revision in kept if record is not None]

    def _record(self, scope: str, row: Row, key: str) -> WorkerOperationRecord:
        """The row of ``key``'s record; a pruned row is ``OperationPruned`` (a stable
        refusal: the key never runs again)."""
        record = self._kept_record(scope, row, key)
        if record is None:
            raise OperationPruned(key)
        return record

    def _kept_record(
        self, scope: str, row: Row, key: str | None = None
    ) -> WorkerOperationRecord | None:
        """The row's record, None for a row ``prune`` left (authenticated either way).

        ``key``: the operation key the row was looked up by (its item is that key's);
        None: the key its document names, which must be the one its item hashes.
        """
        document = self._sealer.open(scope, NS_JOURNAL, row)
        if key is None:
            key = journal_row_key(document)
            if not self._items.names(scope, row.item, key):
                raise RecordLocationMismatch("(journal item)", key)
        if document == pruned_document(scope, key):
            return None
        return WorkerOperationRecord.from_row_json(document, scope, key)

    async def prune(self, scope: str, older_than_seconds: float) -> PruneReport:
        """Forget the outcome of terminal journal rows not written for ``older_than_seconds``.

        Only an operation in a terminal state whose compensation is absent or
        terminal is pruned; ``pending`` and ``running`` rows are never touched.
        Every candidate is authenticated before it is chosen, and a row written
        again since (another revision or envelope) is kept. A pruned row is
        not deleted: its document is replaced by :func:`pruned_document`,
        sealed at the row's own revision, so the scope's digest, head and live
        index do not move and a later request for the key is refused with
        ``OperationPruned``; a row whose ``written_at`` seal does not hold stops the
        call before anything is pruned. Prune saves the outcome's size, not the key.
        """
        check_scope(scope)
        if not older_than_seconds >= 0:
            raise ValueError("older_than_seconds must be a non-negative number")
        self._check_writable()
        cutoff = time.time() - older_than_seconds
        rows = await self._prunable_rows(scope, cutoff)
        victims: list[Pruned] = []
        kept = 0
        for row, written_at, tag in rows:
            check_written(self._keyring, scope, row.revision, written_at, tag)
            record = self._kept_record(scope, row)
            if record is None:
                continue  # pruned before
            compensation = record.compensation
            if record.state.kind in TERMINAL_KINDS and (
                compensation is None or compensation.state.kind in TERMINAL_KINDS
            ):
                left = RowWrite(
                    NS_JOURNAL, row.item, pruned_document(scope, record.operation_key), None
                )
                sealed = self._sealer.seal(scope, left, row.revision)
                victims.append((row.item, row.revision, row.envelope, sealed))
            else:
                kept += 1
        removed = await self._prune_rows(scope, victims) if victims else 0
        if removed:
            _log.info("journal_pruned", scope=scope, removed=removed, kept=kept)
        return PruneReport(removed=removed, kept=kept)

    async def reseal(self, scope: str) -> ResealReport:
        """Re-seal every row of ``scope`` that an old key sealed, at its own revision.

        A row is re-sealed when the storage key that sealed it is not the
        keyring's active key or, with a data keyring, when its payload is
        encrypted under another data key than the active one. Every row is
        authenticated (and decrypted) first; a row that fails stops the
        call with that error. Revisions, the head's revision and fence and
        its digest do not move, so this is safe while the daemon runs: a row
        the daemon writes meanwhile (sealed with the active key) is left as
        it is. Batches of 1,000 rows, one short transaction each; then the
        head itself is resealed with the active key. Rows a running daemon
        never writes again (closed sessions, above all) need this before an
        old key can be retired.
        """
        check_scope(scope)
        self._check_writable()
        resealed = current = 0
        after = 0
        while True:
            rows = await self._row_batch(scope, after)
            if not rows:
                break
            changes: list[Resealed] = []
            for row_id, namespace, row in rows:
                after = row_id
                envelope = self._sealer.reseal(scope, namespace, row)
                if envelope is None:
                    current += 1
                else:
                    changes.append((row_id, row.revision, row.envelope, envelope))
            if changes:
                resealed += await self._replace_envelopes(scope, changes)
        # The head too, so that the key that sealed it can be retired.
        head_resealed = await self._reseal_head(scope)
        if resealed or head_resealed:
            _log.info(
                "journal_resealed",
                scope=scope,
                resealed=resealed,
                current=current,
                head=head_resealed,
            )
        return ResealReport(resealed=resealed, current=current)

    async def load_sessions(
        self, scope: str, *, skip_closed_except: Iterable[str] | None = None
    ) -> dict[str, PersistedSession]:
        """Every session of ``scope`` (every status), keyed by session id.

        With ``skip_closed_except``, closed sessions are left out (neither
        read nor authenticated), except those it names: a start then costs
        what the live sessions cost, not every session ever closed. "Closed"
        is the store's own mark, set by the commit that closed the session;
        one closed before that mark existed (SQLite schema 3) is still returned.
        """
        check_scope(scope)
        keep = None if skip_closed_except is None else sorted(set(skip_closed_except))
        for session_id in keep or ():
            validate_token("session id", session_id)
        started = self._live_revision(scope)
        states, openings, request_rows = await self._session_rows(scope, keep)
        opened: dict[str, tuple[bytes, int]] = {}
        for row in openings:
            document = self._sealer.open(scope, NS_SESSION_OPEN, row)
            session_header(document, scope, row.item)
            opened[row.item] = (document, row.revision)
        requests: dict[str, list[bytes]] = {}
        request_floor = 0
        for row in request_rows:
            document = self._sealer.open(scope, NS_SESSION_REQUEST, row)
            requests.setdefault(request_location(document, scope, row.item), []).append(document)
            request_floor = max(request_floor, row.revision)
        sessions: dict[str, PersistedSession] = {}
        for row in states:
            document = self._sealer.open(scope, NS_SESSION, row)
            status = state_status(document, scope, row.item)
            opening = opened.pop(row.item, None)
            if opening is None:
                # Both rows are written by the session's first commit: a
                # missing half was deleted.
                raise RollbackDetected(None, row.revision)
            sessions[row.item] = PersistedSession(
                row.item,
                status,
                opening[0],
                document,
                row.revision,
                tuple(requests.pop(row.item, ())),
            )
        if opened:  # an opening document whose state row is gone
            raise RollbackDetected(None, next(iter(opened.values()))[1])
        if keep is not None:
            # A load's read (no commit of the scope runs beside it); an
            # operator's read of every session may overlap the daemon's commits.
            for namespace, found in (
                (NS_SESSION, states),
                (NS_SESSION_OPEN, openings),
                (NS_SESSION_REQUEST, request_rows),
            ):
                self._check_live(scope, namespace, [row.item for row in found], found, started)
        if requests:  # request rows of a session whose state row was not read
            raise RollbackDetected(None, request_floor)
        return sessions

    async def mark_closed(self, scope: str, session_ids: Iterable[str]) -> None:
        """Mark sessions the caller read, authenticated and found closed, so that
        ``skip_closed_except`` leaves them out from now on.

        For sessions closed before the mark existed (a commit that closes a
        session marks it itself). Metadata only: no revision, envelope or head moves.
        """
        check_scope(scope)
        ids = sorted(set(session_ids))
        for session_id in ids:
            validate_token("session id", session_id)
        if ids:
            self._check_writable()
            await self._mark_closed_rows(scope, ids)

    async def session_status(self, scope: str, session_id: str) -> str | None:
        """The status in ``session_id``'s state row (read and authenticated), None without one."""
        check_scope(scope)
        validate_token("session id", session_id)
        started = self._live_revision(scope)
        rows = await self._rows(scope, NS_SESSION, [session_id])
        if not rows:
            self._check_live(scope, NS_SESSION, [session_id], rows, started)
            return None
        document = self._sealer.open(scope, NS_SESSION, rows[0])
        status = state_status(document, scope, rows[0].item)
        self._check_live(scope, NS_SESSION, [session_id], rows, started)
        return status

    async def load_outbox(self, scope: str, *, session_id: str | None = None) -> list[OutboxEntry]:
        """Every outbox row of ``scope``, oldest revision first.

        With ``session_id``, the rows of that session alone, found through the
        rows' session column and its index: the cost is that session's rows,
        not the scope's outbox. Each row is authenticated, and one whose
        document names another session than its column raises
        ``RecordLocationMismatch`` (the column is unauthenticated metadata).
        """
        check_scope(scope)
        started = self._live_revision(scope)
        if session_id is None:
            rows = await self._rows(scope, NS_OUTBOX, None)
            chosen = False
        else:
            validate_token("session id", session_id)
            rows, chosen = await self._outbox_rows(scope, session_id)
        entries: list[OutboxEntry] = []
        for row in rows:
            document = self._sealer.open(scope, NS_OUTBOX, row)
            entry = read_outbox(document, scope, row.item, row.revision)
            if session_id is not None and entry.session_id != session_id:
                if chosen:
                    raise RecordLocationMismatch(session_id, entry.session_id)
                continue
            entries.append(entry)
        self._check_live(scope, NS_OUTBOX, None, rows, started)
        return entries

    async def head_revision(self, scope: str) -> int:
        """The scope's committed revision (0 without a head)."""
        check_scope(scope)
        return await self._head(scope)

    async def scopes(self) -> list[str]:
        """Every scope with a head, sorted (operator helper)."""
        return await self._scope_names()

    async def stored_scopes(self) -> list[str]:
        """Every scope the store holds a head or a row of, sorted (O(rows): ``journal
        verify``, which must see a scope whose head row was deleted)."""
        return await self._scope_names(stored=True)

    async def load_scope(self, scope: str, *, every_session: bool = False) -> LoadedScope:
        """What loading ``scope`` reads after its rows were checked against its sealed
        head: the outbox, then every session not closed (and those with replies in
        the outbox), each read back as a restore reads it (``read_session``).

        The daemon's load (after ``reserve_fence``), ``check`` and ``journal
        verify`` (after ``verify_scope``) run this one path, so a scope they
        pass is one the daemon loads; ``every_session`` (verify) then reads
        every session, closed ones too, the same way (and returns those).
        """
        check_scope(scope)
        outbox = await self.load_outbox(scope)
        in_outbox = {entry.session_id for entry in outbox}
        persisted = await self.load_sessions(scope, skip_closed_except=in_outbox)
        for record in persisted.values():
            read_session(record, scope)
        if every_session:
            persisted = await self.load_sessions(scope)
            for record in persisted.values():
                read_session(record, scope)
        return LoadedScope(outbox, in_outbox, persisted)

    async def scope_metadata(self, scope: str) -> ScopeMetadata:
        """The scope's fence and row metadata (operator helper; reads no envelope)."""
        check_scope(scope)
        return await self._metadata(scope)

    async def integrity_check(self) -> list[str]:
        """``["ok"]`` when the database reports itself healthy, else its findings."""
        return await self._integrity()

    # Modes -----------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._read_only:
            raise StorageBackendError("the store was opened read-only")

    def _check_committing(self) -> None:
        """Moving a head (commit, fence) is for neither a read-only nor a maintenance store."""
        self._check_writable()
        if self._maintenance:
            raise StorageBackendError("a maintenance store neither commits nor reserves fences")
