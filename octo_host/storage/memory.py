"""``VolatileMemoryStore``: the reference backend, in memory (tests and development).

It must never be used for a ledger that must survive the process, and never
decide a write otherwise than :mod:`octo_host.storage.contract` does.
"""

from __future__ import annotations

from collections.abc import Sequence

from octo_common.errors import FencingRequired, FencingTokenExhausted
from octo_common.limits import MAX_U64
from octo_common.records import Conflict, StorageRecordKey, StorageSnapshot, Stored, StoredRecord
from octo_host.storage.contract import (
    ManyWrite,
    cas_decision,
    check_expected,
    check_key,
    check_many,
    check_replacement,
    check_token,
    establish_decision,
    fenced_check,
)

__all__ = ["VolatileMemoryStore"]


class VolatileMemoryStore:
    """In-memory backend: the semantics every backend has, and nothing else.

    Its three maps (``records``, ``floors``, ``fences``) are public so tests
    can simulate tampering, deletion and rollback; nothing survives the
    process. Revisions and fences stop at 2^64 - 1.
    """

    ceiling = MAX_U64

    def __init__(self) -> None:
        self.records: dict[StorageRecordKey, StoredRecord] = {}
        self.floors: dict[StorageRecordKey, int] = {}
        self.fences: dict[StorageRecordKey, int] = {}

    async def load(self, key: StorageRecordKey) -> StorageSnapshot:
        key = check_key(key)
        return StorageSnapshot(self.records.get(key), self.floors.get(key, 0))

    async def record_names(self, namespace: str) -> list[str]:
        """The names of the records of ``namespace`` that hold a value, sorted."""
        return sorted({key.name for key in self.records if key.namespace == namespace})

    def _unfenced(
        self, key: StorageRecordKey, expected: int | None, replacement: StoredRecord
    ) -> Stored | Conflict:
        record = self.records.get(key)
        actual = None if record is None else record.revision
        conflict = cas_decision(
            actual, self.floors.get(key, 0), expected, replacement, self.ceiling
        )
        if conflict is not None:
            return conflict
        self.records[key] = replacement
        self.floors[key] = replacement.revision
        return Stored(replacement.revision)

    async def compare_and_swap(
        self, key: StorageRecordKey, expected_revision: int | None, replacement: StoredRecord
    ) -> Stored | Conflict:
        key = check_key(key)
        expected = check_expected(expected_revision)
        checked = check_replacement(replacement)
        fence = self.fences.get(key, 0)
        if fence != 0:
            raise FencingRequired(fence)
        return self._unfenced(key, expected, checked)

    async def compare_and_swap_fenced(
        self,
        key: StorageRecordKey,
        expected_revision: int | None,
        replacement: StoredRecord,
        token: int,
    ) -> Stored | Conflict:
        key = check_key(key)
        expected = check_expected(expected_revision)
        checked = check_replacement(replacement)
        fenced_check(self.fences.get(key, 0), check_token(token))
        return self._unfenced(key, expected, checked)

    async def compare_and_swap_many_opened(
        self, writes: Sequence[ManyWrite]
    ) -> list[Stored | Conflict | None]:
        """Several unfenced CAS, all or none: see ``SqliteRecordBackend``'s."""
        checked = check_many(writes)
        decisions: list[Conflict | None] = []
        for key, expected, replacement, opener in checked:
            snapshot = StorageSnapshot(self.records.get(key), self.floors.get(key, 0))
            opener(snapshot)
            fence = self.fences.get(key, 0)
            if fence != 0:
                raise FencingRequired(fence)
            actual = None if snapshot.record is None else snapshot.record.revision
            decisions.append(
                cas_decision(actual, snapshot.revision_floor, expected, replacement, self.ceiling)
            )
        if any(decision is not None for decision in decisions):
            return list(decisions)
        for key, _, replacement, _ in checked:
            self.records[key] = replacement
            self.floors[key] = replacement.revision
        return [Stored(replacement.revision) for _, _, replacement, _ in checked]

    async def current_fence(self, key: StorageRecordKey) -> int:
        return self.fences.get(check_key(key), 0)

    async def reserve_fence(self, key: StorageRecordKey) -> int:
        key = check_key(key)
        current = self.fences.get(key, 0)
        if current >= self.ceiling:
            raise FencingTokenExhausted()
        self.fences[key] = current + 1
        return current + 1

    async def establish_fence(self, key: StorageRecordKey, token: int) -> None:
        key = check_key(key)
        if establish_decision(self.fences.get(key, 0), check_token(token), self.ceiling):
            self.fences[key] = token

    async def close(self) -> None:
        """Nothing to release; present so every backend can be closed alike."""
