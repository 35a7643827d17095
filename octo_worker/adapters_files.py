"""The reference adapter ``files.publish``: publish one file into a directory,
durably, at most once per operation key, with an explicit inverse.

Layout of ``target_dir``:

* ``<name>``: a published file. Names match ``[A-Za-z0-9._-]{1,128}`` and
  never start with a dot, so nothing the adapter keeps for itself (all
  dot-names) can collide with a published file.
* ``.octo-publish/op.<operation key>.json``: one record per operation key
  (name, sha256, size, state: ``publishing``, ``published``, ``refused``,
  ``removing``, ``removed``). It is the adapter's memory: reconciliation
  answers from it, and a repeated dispatch or compensation never repeats an
  effect that it records.
* ``.octo-publish/name.<name>``: the claim on a name, created with
  ``O_EXCL`` and holding the owning operation key.
* ``.octo-tmp.*``: a file being written; a publish removes its own, but
  one cut by a crash stays behind (never published: safe to delete).

Every real effect (a publish, a removal) is appended to ``effect_log`` as one
JSON line with ``O_APPEND`` and fsync before the adapter reports success, so
tests and operators can count effects. Files, records and the log are
written crash-safely: temp file, fsync, link or rename, fsync the directory.

All file work runs on one private thread, one call at a time and in
submission order, so a reconciliation submitted after a dispatch (even one
whose deadline expired) always sees that dispatch's finished outcome.

This adapter must never log or store payload content outside the published
file, never write into ``target_dir`` outside the names above, and never
perform an effect from ``reconcile_operation``. Reconciliation may finish the
bookkeeping of a publication a crash interrupted (the missing effect line and
record of a file that is already there, or the refusal of one that never
appeared), exactly as a repeated dispatch does, so the effect log holds one
line per published key whichever of the two comes first.

One process owns ``target_dir``: the single file thread is what orders a
reconciliation after a dispatch, so two daemons must not share a directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

import msgspec

from octo_common.errors import AdapterFailed, AdapterIndeterminate, AdapterInvalidJsonInput
from octo_common.payload import ToolPayload
from octo_common.states import Failed, OperationStatus, Succeeded
from octo_worker.adapters import AdapterContext, BaseWorkerAdapter, DurableOperationContract

if TYPE_CHECKING:
    from octo_common.grants import CapabilityGrant
    from octo_common.messages import (
        OperationCompensationRequest,
        OperationDispatchRequest,
        OperationReconcileRequest,
    )

__all__ = [
    "FAILED_KEY_REUSED",
    "FAILED_NOT_PUBLISHED",
    "FAILED_TARGET_CHANGED",
    "FAILED_TARGET_EXISTS",
    "FilesPublishAdapter",
    "read_effect_log",
]

TOOL: Final = "files.publish"
FAILED_TARGET_EXISTS: Final = "target exists"
FAILED_NOT_PUBLISHED: Final = "not published"
FAILED_KEY_REUSED: Final = "operation key already used for another publication"
FAILED_TARGET_CHANGED: Final = "published file was modified"

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_META_DIR: Final = ".octo-publish"
_TMP_PREFIX: Final = ".octo-tmp."
_RECORD_FORMAT: Final = 1

T = TypeVar("T")

_RecordState = Literal["publishing", "published", "refused", "removing", "removed"]


class _PublishInput(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    content: str


class _UndoInput(msgspec.Struct, forbid_unknown_fields=True):
    undo: str
    name: str


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the adapter remembers about one operation key."""

    format_version: int
    operation_key: str
    name: str
    sha256: str
    size: int
    state: _RecordState
    reason: str | None = None
    compensation_key: str | None = None
    removed_file: bool | None = None


_RECORD_DECODER = msgspec.json.Decoder(_Record)
_RECORD_ENCODER = msgspec.json.Encoder()


def _valid_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None and not name.startswith(".")


def _json_object(payload: ToolPayload, what: str) -> dict[str, Any]:
    if payload.format != "json" or not isinstance(payload.value, dict):
        raise AdapterInvalidJsonInput(f"{what} must be a JSON object")
    return payload.value


def _parse_publish(payload: ToolPayload, grant: CapabilityGrant) -> tuple[str, bytes]:
    """The publish contract: ``{"name": <safe name>, "content": <string>}``."""
    value = _json_object(payload, "publish input")
    try:
        parsed = msgspec.convert(value, _PublishInput, strict=True)
    except msgspec.ValidationError:
        raise AdapterInvalidJsonInput("publish input does not match its contract") from None
    if not _valid_name(parsed.name):
        raise AdapterInvalidJsonInput("unsafe file name")
    try:
        data = parsed.content.encode("utf-8")
    except UnicodeEncodeError:
        raise AdapterInvalidJsonInput("content is not valid text") from None
    if len(data) > grant.max_input_bytes:
        raise AdapterInvalidJsonInput("content exceeds the grant's input limit")
    return parsed.name, data


def _parse_undo(payload: ToolPayload) -> str:
    """The inverse contract: ``{"undo": "publish", "name": <safe name>}``."""
    value = _json_object(payload, "inverse input")
    try:
        parsed = msgspec.convert(value, _UndoInput, strict=True)
    except msgspec.ValidationError:
        raise AdapterInvalidJsonInput("inverse input does not match its contract") from None
    if parsed.undo != "publish":
        raise AdapterInvalidJsonInput("inverse input names another action")
    if not _valid_name(parsed.name):
        raise AdapterInvalidJsonInput("unsafe file name")
    return parsed.name


def _publish_payload(record: _Record) -> ToolPayload:
    return ToolPayload.json({"name": record.name, "sha256": record.sha256, "bytes": record.size})


def _undo_payload(record: _Record) -> ToolPayload:
    return ToolPayload.json({"name": record.name, "removed": bool(record.removed_file)})


# Crash-safe file primitives --------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_new_file(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_file(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (temp, fsync, rename, fsync dir)."""
    tmp = path.parent / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
    try:
        _write_new_file(tmp, data, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _sha256_of(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except FileNotFoundError:
        return None


def _append_line(path: Path, line: bytes) -> None:
    """Append one line with ``O_APPEND`` and fsync (the directory too when created)."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        _fsync_dir(path.parent)


def read_effect_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every effect line of an effect log, oldest first (a missing log is empty).

    A last line without its newline is a torn write of an effect that was
    never reported as done, and is skipped.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    complete = lines[:-1]  # the part after the last newline is empty or torn
    return [json.loads(line) for line in complete if line]


# The adapter -----------------------------------------------------------------


class FilesPublishAdapter(BaseWorkerAdapter):
    """``files.publish``: publish ``{"name", "content"}`` as a file, undo with
    ``{"undo": "publish", "name"}``, reconcile by operation key.

    Declares ``RECONCILIATION`` and no invocation safety (``invoke`` is
    refused: publishing is an effect that needs the journal).
    """

    tool = TOOL

    def __init__(
        self,
        target_dir: str | os.PathLike[str],
        effect_log: str | os.PathLike[str],
        *,
        deadline_seconds: float = 10.0,
    ) -> None:
        if isinstance(deadline_seconds, bool) or not isinstance(deadline_seconds, int | float):
            raise TypeError("deadline_seconds must be a number")
        if not math.isfinite(deadline_seconds) or deadline_seconds <= 0:
            raise ValueError("deadline_seconds must be positive and finite")
        self._dir = Path(target_dir)
        self._meta = self._dir / _META_DIR
        self._log = Path(effect_log)
        self.deadline_seconds = float(deadline_seconds)
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"FilesPublishAdapter(tool={TOOL!r})"

    @property
    def target_dir(self) -> Path:
        return self._dir

    @property
    def effect_log(self) -> Path:
        return self._log

    def close(self) -> None:
        """Wait for running file work to finish and stop the private thread."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # Declarations ---------------------------------------------------------

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return DurableOperationContract.RECONCILIATION

    # Hooks -------------------------------------------------------------------

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Publish the file for ``request.operation_key`` at most once.

        The input is checked before anything is touched
        (``AdapterInvalidJsonInput``). A name already published by this key
        (a repeated dispatch) answers the same success without writing; a
        name held by anything else answers ``Failed("target exists")``. An
        I/O error part-way is ``AdapterIndeterminate``: reconciliation tells.
        """
        name, data = _parse_publish(request.payload, grant)
        return await self._run(self._publish, request.operation_key, name, data)

    async def compensate_operation(
        self,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        """Remove exactly the file the original operation published.

        The inverse payload must be ``{"undo": "publish", "name": <name>}``
        and name the file recorded for ``request.operation_key``, else
        ``AdapterInvalidJsonInput`` and nothing is touched. A file already
        gone is a success (the record notes that nothing was removed).
        """
        name = _parse_undo(request.payload)
        return await self._run(self._remove, request.operation_key, request.compensation_key, name)

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Look up what happened to ``request.operation_key``; never publishes.

        Published (even if compensated since) → the dispatch's own success
        payload. Refused → the same ``Failed`` the dispatch answered. No
        record, or a publication interrupted before its file appeared →
        ``Failed("not published")``. That answer is final, not a guess:
        dispatch runs once per key and synchronously on this adapter's
        single file thread, so a reconciliation queued behind it sees its
        outcome; after a crash nothing resumes an interrupted publication
        (a repeated dispatch of such a key also answers "not published"),
        so an effect that is not in the directory now never will be.

        An interrupted publication is settled here as a repeated dispatch
        settles it (its effect line written once, its record finished), so
        the effect log never misses a publication reconciliation reports.
        """
        return await self._run(self._lookup, request.operation_key)

    # Thread plumbing ---------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="octo-files-publish"
            )
        loop = asyncio.get_running_loop()
        # A call cancelled before its turn never runs; one already running
        # finishes on the thread, and later calls queue behind it.
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    # Sync effects (on the file thread) -----------------------------------

    def _publish(self, key: str, name: str, data: bytes) -> OperationStatus:
        with self._lock:
            try:
                return self._publish_locked(key, name, data)
            except OSError:
                raise AdapterIndeterminate("file system error during publish") from None

    def _publish_locked(self, key: str, name: str, data: bytes) -> OperationStatus:
        self._ensure_dirs()
        digest = hashlib.sha256(data).hexdigest()
        record = self._read_record(key)
        if record is not None:
            if record.name != name or record.sha256 != digest:
                return Failed(FAILED_KEY_REUSED)
            return self._settle(record)
        target = self._dir / name
        claim = self._claim_path(name)
        fresh = _Record(_RECORD_FORMAT, key, name, digest, len(data), "publishing")
        if target.exists() or claim.exists():
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        # Intent first: after a crash the record says what may have begun.
        self._write_record(fresh)
        try:
            _write_new_file(claim, key.encode("ascii"), 0o600)
        except FileExistsError:
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        _fsync_dir(self._meta)
        tmp = self._dir / f"{_TMP_PREFIX}{secrets.token_hex(8)}"
        linked = False
        try:
            _write_new_file(tmp, data, 0o644)
            # link (unlike rename) never replaces a file that appeared meanwhile.
            os.link(tmp, target)
            linked = True
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(self._dir)
        if not linked:
            self._release_claim(name, key)
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        self._append_effect("publish", key, None, name)
        published = msgspec.structs.replace(fresh, state="published")
        self._write_record(published)
        return Succeeded(_publish_payload(published))

    def _settle(self, record: _Record) -> OperationStatus:
        """A repeated dispatch of a recorded key: answer, finishing bookkeeping only."""
        if record.state == "refused":
            return Failed(record.reason or FAILED_NOT_PUBLISHED)
        if record.state == "publishing":
            record = self._resolve_publishing(record)
            if record.state == "refused":
                return Failed(record.reason or FAILED_NOT_PUBLISHED)
        return Succeeded(_publish_payload(record))

    def _resolve_publishing(self, record: _Record) -> _Record:
        """Finish a publication a crash interrupted: its file either appeared or never will."""
        if self._is_published(record):
            if not self._logged("publish", record.operation_key):
                self._append_effect("publish", record.operation_key, None, record.name)
            settled = msgspec.structs.replace(record, state="published")
            self._write_record(settled)
            return settled
        self._release_claim(record.name, record.operation_key)
        refused = msgspec.structs.replace(record, state="refused", reason=FAILED_NOT_PUBLISHED)
        self._write_record(refused)
        return refused

    def _remove(self, key: str, compensation_key: str, name: str) -> OperationStatus:
        with self._lock:
            try:
                return self._remove_locked(key, compensation_key, name)
            except OSError:
                raise AdapterIndeterminate("file system error during removal") from None

    def _remove_locked(self, key: str, compensation_key: str, name: str) -> OperationStatus:
        self._ensure_dirs()
        record = self._read_record(key)
        if record is None or record.state == "refused":
            return Failed(FAILED_NOT_PUBLISHED)
        if record.name != name:
            raise AdapterInvalidJsonInput("inverse input names another file")
        if record.state == "publishing":
            record = self._resolve_publishing(record)
            if record.state == "refused":
                return Failed(FAILED_NOT_PUBLISHED)
        if record.state == "removed":
            return Succeeded(_undo_payload(record))
        target = self._dir / name
        owned = self._claim_owner(name) == key
        found = _sha256_of(target) if owned else None
        present = found is not None
        if present and found != record.sha256:
            return Failed(FAILED_TARGET_CHANGED)
        if record.state == "published":
            record = msgspec.structs.replace(
                record,
                state="removing",
                compensation_key=compensation_key,
                removed_file=present,
            )
            self._write_record(record)
        if present:
            os.unlink(target)
            _fsync_dir(self._dir)
        if owned:
            self._release_claim(name, key)
        # A crash between unlink and the log line leaves `removing` with the
        # file gone: the removal happened, so it is logged on the way out.
        if record.removed_file and (present or not self._logged("remove", key)):
            self._append_effect("remove", key, record.compensation_key, name)
        removed = msgspec.structs.replace(record, state="removed")
        self._write_record(removed)
        return Succeeded(_undo_payload(removed))

    def _lookup(self, key: str) -> OperationStatus:
        with self._lock:
            try:
                record = self._read_record(key)
                if record is None:
                    return Failed(FAILED_NOT_PUBLISHED)
                if record.state == "publishing":
                    # A crash cut this publication short. Finish its bookkeeping
                    # exactly as a repeated dispatch would: a file that appeared
                    # gets its one effect line and the `published` record; one
                    # that did not never will, and the key is refused for good.
                    # Neither writes the published file itself.
                    record = self._resolve_publishing(record)
                if record.state == "refused":
                    return Failed(record.reason or FAILED_NOT_PUBLISHED)
                return Succeeded(_publish_payload(record))
            except OSError:
                raise AdapterFailed("file system error during lookup") from None

    # Records, claims, log -------------------------------------------------

    def _ensure_dirs(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        if not self._meta.exists():
            self._meta.mkdir(mode=0o700, exist_ok=True)
            _fsync_dir(self._dir)

    def _record_path(self, key: str) -> Path:
        return self._meta / f"op.{key}.json"

    def _claim_path(self, name: str) -> Path:
        return self._meta / f"name.{name}"

    def _read_record(self, key: str) -> _Record | None:
        try:
            data = self._record_path(key).read_bytes()
        except FileNotFoundError:
            return None
        try:
            record = _RECORD_DECODER.decode(data)
        except msgspec.DecodeError:
            raise AdapterIndeterminate("unreadable operation record") from None
        if record.format_version != _RECORD_FORMAT or record.operation_key != key:
            raise AdapterIndeterminate("unreadable operation record")
        return record

    def _write_record(self, record: _Record) -> None:
        _replace_file(self._record_path(record.operation_key), _RECORD_ENCODER.encode(record))

    def _refuse(self, record: _Record, reason: str) -> Failed:
        """Record that ``record``'s key will never publish, and answer so."""
        self._write_record(msgspec.structs.replace(record, state="refused", reason=reason))
        return Failed(reason)

    def _claim_owner(self, name: str) -> str | None:
        try:
            return self._claim_path(name).read_text("ascii")
        except FileNotFoundError:
            return None

    def _release_claim(self, name: str, key: str) -> None:
        if self._claim_owner(name) != key:
            return
        os.unlink(self._claim_path(name))
        _fsync_dir(self._meta)

    def _is_published(self, record: _Record) -> bool:
        return (
            self._claim_owner(record.name) == record.operation_key
            and _sha256_of(self._dir / record.name) == record.sha256
        )

    def _append_effect(
        self, effect: str, key: str, compensation_key: str | None, name: str
    ) -> None:
        line = json.dumps(
            {
                "effect": effect,
                "operation_key": key,
                "compensation_key": compensation_key,
                "name": name,
            },
            separators=(",", ":"),
        )
        _append_line(self._log, line.encode("utf-8") + b"\n")

    def _logged(self, effect: str, key: str) -> bool:
        return any(
            entry.get("effect") == effect and entry.get("operation_key") == key
            for entry in read_effect_log(self._log)
        )
