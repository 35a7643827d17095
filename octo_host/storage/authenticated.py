"""``AuthenticatedStore``: keyed, revisioned, fenced records over a backend.

This module owns the read and write steps (open every snapshot fully
before returning or overwriting it, seal writes with the keyring's active
key) and the record key of a run's ledger. The envelope, tag and keyring are
pure and live in :mod:`octo_common.records`.

It must never return, log or raise key material or payload bytes, write a
record it has not opened first, or interpret a payload.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from octo_common.errors import (
    OctoError,
    PayloadTooLarge,
    RevisionExhausted,
    RevisionFloorMismatch,
    StorageBackendError,
    WriteConflict,
)
from octo_common.limits import MAX_AUTHENTICATED_PAYLOAD_BYTES, MAX_U64
from octo_common.records import (
    AuthenticatedRecord,
    Conflict,
    StorageKeyring,
    StorageRecordKey,
    StorageSnapshot,
    Stored,
    StoredRecord,
    open_record,
    seal_record,
    validate_revision_pair,
)
from octo_host.storage.contract import Opener, RecordBackend, check_expected, check_key, check_token

__all__ = ["LEDGER_NAMESPACE", "AuthenticatedStore", "ledger_record_key"]

LEDGER_NAMESPACE = "workflow-ledger"


def ledger_record_key(run: str) -> StorageRecordKey:
    """The record key of a workflow run's ledger: ``("workflow-ledger", run)``."""
    return StorageRecordKey(LEDGER_NAMESPACE, run)


class AuthenticatedStore:
    """Keyed, revisioned, fenced records over a backend.

    Every load and every write first opens the backend's current snapshot
    fully (floor rule, envelope, key id, tag): a tampered, moved, rolled
    back or retired-key record blocks both. Writes are sealed with the
    keyring's active key.
    """

    def __init__(self, backend: RecordBackend, keyring: StorageKeyring) -> None:
        if not isinstance(keyring, StorageKeyring):
            raise TypeError("keyring must be a StorageKeyring")
        self._backend = backend
        self._keyring = keyring
        # A backend that keeps a sealed store head (SQLite) seals it with this keyring.
        bind = getattr(backend, "bind_keyring", None)
        if bind is not None:
            bind(keyring)

    @property
    def backend(self) -> RecordBackend:
        """The backend this store writes through."""
        return self._backend

    @property
    def keyring(self) -> StorageKeyring:
        """The keyring (rotate and retire in place)."""
        return self._keyring

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self._backend!r}, keyring={self._keyring!r})"

    def _open_snapshot(
        self, key: StorageRecordKey, snapshot: StorageSnapshot
    ) -> AuthenticatedRecord | None:
        record = snapshot.record
        validate_revision_pair(None if record is None else record.revision, snapshot.revision_floor)
        if record is None:
            return None
        return open_record(self._keyring, key, record.data, record.revision)

    async def load(self, key: StorageRecordKey) -> AuthenticatedRecord | None:
        """The authenticated record at ``key``, or None if it never existed."""
        key = check_key(key)
        return self._open_snapshot(key, await self._backend.load(key))

    async def names(self, namespace: str) -> list[str]:
        """The names of ``namespace``'s records, sorted, for a search (each record is
        still authenticated when loaded). ``StorageBackendError`` for a backend that
        cannot list its records."""
        listing = getattr(self._backend, "record_names", None)
        if listing is None:
            raise StorageBackendError("names: this backend does not list its records")
        names: list[str] = await listing(namespace)
        return names

    async def create(self, key: StorageRecordKey, payload: bytes) -> AuthenticatedRecord:
        """Write revision 1; the record must be absent."""
        return await self.compare_and_swap(key, None, payload)

    async def replace(
        self, key: StorageRecordKey, expected: int, payload: bytes
    ) -> AuthenticatedRecord:
        """Write revision ``expected + 1`` over the record at ``expected``."""
        return await self.compare_and_swap(key, expected, payload)

    async def compare_and_swap(
        self, key: StorageRecordKey, expected: int | None, payload: bytes
    ) -> AuthenticatedRecord:
        """The unfenced write (``FencingRequired`` on a fenced key)."""
        key = check_key(key)
        expected = check_expected(expected)
        data = _payload_bytes(payload)
        backend = self._backend
        opened: Callable[..., Awaitable[Stored | Conflict]] | None = getattr(
            backend, "compare_and_swap_opened", None
        )
        if opened is not None and len(data) <= MAX_AUTHENTICATED_PAYLOAD_BYTES:
            # One hand-off (any backend with compare_and_swap_opened): seal
            # first (it depends only on the expectation), then open the
            # current record, compare and swap in one transaction. A seal
            # failure takes the step-by-step path below, which reports the
            # errors in the order of the checks.
            sealed = self._seal_quietly(key, expected, data)
            if sealed is not None:
                replacement, key_id = sealed
                outcome = await opened(
                    key,
                    expected,
                    replacement,
                    lambda snapshot: self._check_current(key, expected, snapshot),
                )
                return self._finish(expected, replacement, key_id, data, outcome)
        replacement, key_id = await self._prepare(key, expected, data)
        outcome = await backend.compare_and_swap(key, expected, replacement)
        return self._finish(expected, replacement, key_id, data, outcome)

    async def compare_and_swap_many(
        self, writes: Sequence[tuple[StorageRecordKey, int | None, bytes]]
    ) -> list[AuthenticatedRecord]:
        """Unfenced writes of distinct keys in one transaction: all or none.

        Each ``(key, expected, payload)`` is checked as :meth:`compare_and_swap`
        checks it; the first refusal or conflict is raised and then
        nothing is written. Needs a backend with ``compare_and_swap_many_opened``
        (both of this module's have it); any other raises ``StorageBackendError``
        before anything is written.
        """
        if not isinstance(writes, Sequence):
            raise TypeError("writes must be a sequence of (key, expected, payload)")
        checked: list[tuple[StorageRecordKey, int | None, bytes]] = []
        for write in writes:
            if not isinstance(write, tuple) or len(write) != 3:
                raise TypeError("each write must be (key, expected, payload)")
            checked.append(
                (check_key(write[0]), check_expected(write[1]), _payload_bytes(write[2]))
            )
        many = getattr(self._backend, "compare_and_swap_many_opened", None)
        if many is None:
            raise StorageBackendError(
                "compare_and_swap_many: the backend cannot write several records at once"
            )
        sealed: list[tuple[StoredRecord, str]] = []
        for key, expected, data in checked:
            if len(data) > MAX_AUTHENTICATED_PAYLOAD_BYTES:
                raise PayloadTooLarge(len(data), MAX_AUTHENTICATED_PAYLOAD_BYTES)
            sealed.append(self._seal(key, expected, data))
        outcomes: list[Stored | Conflict | None] = await many(
            [
                (key, expected, replacement, self._opener(key, expected))
                for (key, expected, _), (replacement, _) in zip(checked, sealed, strict=True)
            ]
        )
        if len(outcomes) != len(checked):
            raise StorageBackendError("compare_and_swap_many: the backend lost a write")
        for (_, expected, _), outcome in zip(checked, outcomes, strict=True):
            if isinstance(outcome, Conflict):
                validate_revision_pair(outcome.actual_revision, outcome.revision_floor)
                raise WriteConflict(expected, outcome.actual_revision, outcome.revision_floor)
        records: list[AuthenticatedRecord] = []
        for (_, expected, data), (replacement, key_id), outcome in zip(
            checked, sealed, outcomes, strict=True
        ):
            if not isinstance(outcome, Stored):
                raise StorageBackendError("compare_and_swap_many: the backend lost a write")
            records.append(self._finish(expected, replacement, key_id, data, outcome))
        return records

    def _opener(self, key: StorageRecordKey, expected: int | None) -> Opener:
        return lambda snapshot: self._check_current(key, expected, snapshot)

    async def compare_and_swap_fenced(
        self, key: StorageRecordKey, expected: int | None, payload: bytes, token: int
    ) -> AuthenticatedRecord:
        """The fenced write: establish ``token`` first, then CAS under it."""
        key = check_key(key)
        expected = check_expected(expected)
        # Establishing first means a later refusal (even PayloadTooLarge)
        # still leaves the higher token in place.
        await self._backend.establish_fence(key, check_token(token))
        data = _payload_bytes(payload)
        replacement, key_id = await self._prepare(key, expected, data)
        outcome = await self._backend.compare_and_swap_fenced(key, expected, replacement, token)
        return self._finish(expected, replacement, key_id, data, outcome)

    async def current_fence(self, key: StorageRecordKey) -> int:
        """The key's current fence; inspection only, never a token source."""
        return await self._backend.current_fence(check_key(key))

    async def reserve_fence(self, key: StorageRecordKey) -> int:
        """Atomically raise the fence by one and return it."""
        return await self._backend.reserve_fence(check_key(key))

    async def establish_fence(self, key: StorageRecordKey, token: int) -> None:
        """Raise the fence to ``token``."""
        await self._backend.establish_fence(check_key(key), check_token(token))

    async def close(self) -> None:
        """Close the backend; idempotent."""
        await self._backend.close()

    async def _prepare(
        self, key: StorageRecordKey, expected: int | None, payload: bytes
    ) -> tuple[StoredRecord, str]:
        if len(payload) > MAX_AUTHENTICATED_PAYLOAD_BYTES:
            raise PayloadTooLarge(len(payload), MAX_AUTHENTICATED_PAYLOAD_BYTES)
        self._check_current(key, expected, await self._backend.load(key))
        return self._seal(key, expected, payload)

    def _check_current(
        self, key: StorageRecordKey, expected: int | None, snapshot: StorageSnapshot
    ) -> None:
        """Open the current record fully, then compare the expectation."""
        current = self._open_snapshot(key, snapshot)
        if current is None:
            if expected is not None:
                raise WriteConflict(expected, None, 0)
        elif expected != current.revision:
            raise WriteConflict(expected, current.revision, current.revision)

    def _seal(
        self, key: StorageRecordKey, expected: int | None, payload: bytes
    ) -> tuple[StoredRecord, str]:
        """The new revision, sealed with the active key."""
        new_revision = (expected or 0) + 1
        if new_revision > MAX_U64:
            raise RevisionExhausted()
        # Read the id with the seal: both come from the same active key.
        key_id = self._keyring.active_id
        envelope = seal_record(self._keyring, key, new_revision, payload)
        return StoredRecord(new_revision, envelope), key_id

    def _seal_quietly(
        self, key: StorageRecordKey, expected: int | None, payload: bytes
    ) -> tuple[StoredRecord, str] | None:
        try:
            return self._seal(key, expected, payload)
        except OctoError:
            return None

    def _finish(
        self,
        expected: int | None,
        replacement: StoredRecord,
        key_id: str,
        payload: bytes,
        outcome: Stored | Conflict,
    ) -> AuthenticatedRecord:
        if isinstance(outcome, Stored):
            if outcome.revision_floor != replacement.revision:
                raise RevisionFloorMismatch(replacement.revision, outcome.revision_floor)
            return AuthenticatedRecord(replacement.revision, key_id, payload)
        validate_revision_pair(outcome.actual_revision, outcome.revision_floor)
        raise WriteConflict(expected, outcome.actual_revision, outcome.revision_floor)


def _payload_bytes(payload: object) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise TypeError("payload must be bytes")
