"""The storage backend contract and the rules every backend shares.

This module owns :class:`RecordBackend` (per record key: a record, a revision
floor and a fence), the argument checks every backend applies before any
I/O, the compare-and-swap and fence decisions as pure
functions, :class:`SwapBackend` (the compare-and-swap entry points of a
backend with one write path), and :class:`Head`, one record's head and item as a backend reads
them. The backends (:mod:`~octo_host.storage.memory`,
:mod:`~octo_host.storage.sqlite`, :mod:`~octo_host.storage.postgres`) decide
every write with these functions, so they agree by construction.

It must never do I/O, authenticate or interpret a payload (that is
:class:`~octo_host.storage.authenticated.AuthenticatedStore`), or log.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from octo_common.errors import (
    FencingTokenExhausted,
    FencingTokenRejected,
    InvalidFencingToken,
    InvalidReplacementRevision,
    RevisionExhausted,
    StorageBackendError,
)
from octo_common.records import Conflict, StorageRecordKey, StorageSnapshot, Stored, StoredRecord

__all__ = [
    "Head",
    "ManyWrite",
    "Opener",
    "RecordBackend",
    "SwapBackend",
    "cas_decision",
    "check_expected",
    "check_key",
    "check_many",
    "check_replacement",
    "check_token",
    "establish_decision",
    "fenced_check",
    "head_from_row",
]


class RecordBackend(Protocol):
    """Per record key: a record, a revision floor and a fence."""

    async def load(self, key: StorageRecordKey) -> StorageSnapshot:
        """The record (or None) and its floor, from one atomic snapshot."""
        ...

    async def compare_and_swap(
        self, key: StorageRecordKey, expected_revision: int | None, replacement: StoredRecord
    ) -> Stored | Conflict:
        """Unfenced CAS; ``FencingRequired`` once the key's fence is nonzero."""
        ...

    async def compare_and_swap_fenced(
        self,
        key: StorageRecordKey,
        expected_revision: int | None,
        replacement: StoredRecord,
        token: int,
    ) -> Stored | Conflict:
        """CAS whose token must equal the current fence, checked atomically."""
        ...

    async def current_fence(self, key: StorageRecordKey) -> int:
        """The current fence (inspection only)."""
        ...

    async def reserve_fence(self, key: StorageRecordKey) -> int:
        """Atomically store and return current fence + 1."""
        ...

    async def establish_fence(self, key: StorageRecordKey, token: int) -> None:
        """Raise the fence to ``token`` (equal: no-op; lower: rejected)."""
        ...

    async def close(self) -> None:
        """Release resources; idempotent."""
        ...


def check_key(key: object) -> StorageRecordKey:
    if not isinstance(key, StorageRecordKey):
        raise TypeError("record key must be a StorageRecordKey")
    return key


def check_expected(expected: object) -> int | None:
    if expected is not None and type(expected) is not int:
        raise TypeError("expected revision must be an int or None")
    return expected


def check_token(token: object) -> int:
    if type(token) is not int:
        raise TypeError("fencing token must be an int")
    return token


def check_replacement(replacement: object) -> StoredRecord:
    if not isinstance(replacement, StoredRecord) or type(replacement.revision) is not int:
        raise TypeError("replacement must be a StoredRecord with an int revision")
    return replacement


def cas_decision(
    actual: int | None,
    floor: int,
    expected: int | None,
    replacement: StoredRecord,
    ceiling: int,
) -> Conflict | None:
    """The unfenced CAS rule; None means "write it"."""
    if actual != expected or (actual or 0) != floor:
        return Conflict(actual, floor)
    new_revision = (expected or 0) + 1
    if new_revision > ceiling:
        raise RevisionExhausted()
    if replacement.revision != new_revision:
        raise InvalidReplacementRevision(new_revision, replacement.revision)
    return None


def establish_decision(current: int, token: int, ceiling: int) -> bool:
    """The ``establish_fence`` rule; True when the fence must be raised."""
    if token == 0:
        raise InvalidFencingToken()
    if token > ceiling:
        raise FencingTokenExhausted()
    if token < current:
        raise FencingTokenRejected(current, token)
    return token > current


def fenced_check(current: int, token: int) -> None:
    if token == 0:
        raise InvalidFencingToken()
    if token != current:
        raise FencingTokenRejected(current, token)


Opener = Callable[[StorageSnapshot], None]
"""Opens a record's current snapshot inside the write's transaction; raises to refuse."""

ManyWrite = tuple[StorageRecordKey, int | None, StoredRecord, Opener]
"""One write of ``compare_and_swap_many_opened``: key, expected revision, replacement, opener."""


def check_many(writes: object) -> list[ManyWrite]:
    if not isinstance(writes, Sequence):
        raise TypeError("writes must be a sequence of (key, expected, replacement, opener)")
    checked: list[ManyWrite] = []
    for write in writes:
        if not isinstance(write, tuple) or len(write) != 4 or not callable(write[3]):
            raise TypeError("each write must be (key, expected, replacement, opener)")
        key, expected, replacement, opener = write
        checked.append(
            (check_key(key), check_expected(expected), check_replacement(replacement), opener)
        )
    if len({key for key, _, _, _ in checked}) != len(checked):
        raise ValueError("each record key may be written once per call")
    return checked


class SwapBackend(ABC):
    """The three compare-and-swap entry points of a backend that decides every write in
    one :meth:`_swap`; their arguments are checked here, before any I/O."""

    @abstractmethod
    async def _swap(
        self,
        operation: str,
        key: StorageRecordKey,
        expected: int | None,
        replacement: StoredRecord,
        token: int | None,
        opener: Opener | None,
    ) -> Stored | Conflict:
        """Decide and write one replacement: fenced with ``token``, opened first with
        ``opener`` (both optional), named ``operation`` in errors."""

    async def compare_and_swap(
        self, key: StorageRecordKey, expected_revision: int | None, replacement: StoredRecord
    ) -> Stored | Conflict:
        """Unfenced CAS; ``FencingRequired`` once the key's fence is nonzero."""
        return await self._swap(
            "compare_and_swap",
            check_key(key),
            check_expected(expected_revision),
            check_replacement(replacement),
            None,
            None,
        )

    async def compare_and_swap_fenced(
        self,
        key: StorageRecordKey,
        expected_revision: int | None,
        replacement: StoredRecord,
        token: int,
    ) -> Stored | Conflict:
        """CAS whose token must equal the current fence, checked atomically."""
        return await self._swap(
            "compare_and_swap_fenced",
            check_key(key),
            check_expected(expected_revision),
            check_replacement(replacement),
            check_token(token),
            None,
        )

    async def compare_and_swap_opened(
        self,
        key: StorageRecordKey,
        expected_revision: int | None,
        replacement: StoredRecord,
        opener: Opener,
    ) -> Stored | Conflict:
        """The unfenced CAS with ``opener(snapshot)`` run first, in the same transaction.

        ``AuthenticatedStore`` passes its snapshot opening (open the current
        record, compare the expectation), so the read, the check and the swap
        are one atomic step and one hand-off to the backend. ``opener`` raises to refuse.
        """
        return await self._swap(
            "compare_and_swap",
            check_key(key),
            check_expected(expected_revision),
            check_replacement(replacement),
            None,
            opener,
        )


class Head:
    """One record's head (revision floor, fence) and item as a backend reads them
    inside a transaction or snapshot."""

    __slots__ = ("fence", "floor", "record")

    def __init__(self, floor: int, fence: int, record: StoredRecord | None) -> None:
        self.floor = floor
        self.fence = fence
        self.record = record


def head_from_row(row: Any) -> Head:
    """A head read as (floor, fence, item revision, envelope), each None when absent;
    a malformed value is ``StorageBackendError``."""
    floor, fence, item_revision, envelope = row
    # No head row: floor and fence are 0 (what an absent record is).
    floor = 0 if floor is None else floor
    fence = 0 if fence is None else fence
    if type(floor) is not int or type(fence) is not int:
        raise StorageBackendError("malformed head row")
    if item_revision is None and envelope is None:
        return Head(floor, fence, None)
    if type(item_revision) is not int:
        raise StorageBackendError("malformed item row")
    if isinstance(envelope, str):
        # A row rewritten as TEXT is still judged by the envelope rules.
        envelope = envelope.encode("utf-8", "surrogateescape")
    if not isinstance(envelope, bytes):
        raise StorageBackendError("malformed item row")
    return Head(floor, fence, StoredRecord(item_revision, envelope))
