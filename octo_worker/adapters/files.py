"""The reference adapter ``files.publish``: publish one file into a tenant's
directory, durably, at most once per operation, with an explicit inverse.

Layout of ``target_dir`` (one adapter serves every tenant scope, and
operation keys are unique only within a scope):

* ``<scope>/<name>``: a file published in tenant scope ``<scope>`` (the scope
  whose journal admitted the operation, ``context.scope``). Two scopes never
  share a file, whatever names their payloads give. Names match
  ``[A-Za-z0-9._-]{1,128}`` and never start with a dot; a scope that starts
  with a dot has no directory (its publications are refused), so nothing
  the adapter keeps for itself (all dot-names) can collide with a file.
* ``.octo-publish/pub.<idempotency key>.json``: one record per operation,
  named by the operation's ``context.idempotency_key`` (never the bare
  operation key): name, sha256, size, state (``publishing``, ``published``,
  ``refused``, ``removing``, ``removed``), the compensation that removed it,
  and where the line of the effect in progress stands in the log. It is the
  adapter's memory: both lookups answer from it, and a repeated dispatch or
  compensation never repeats an effect it records.
* ``.octo-publish/claim.<sha256 of scope and name>``: the claim on one
  scope's name, created with ``O_EXCL``, holding the owner's idempotency key.
* ``.octo-publish/lock.<idempotency key>``: the operation's cross-process
  lock (:func:`octo_worker.adapters.files_disk.operation_lock`).
* ``<scope>/.octo-tmp.*``: a file being written; a publish removes its own,
  but one cut by a crash stays behind (never published: safe to delete).

Every real effect (a publish, a removal) is appended to ``effect_log`` as
one JSON line (``effect``, ``scope``, ``idempotency_key``: the operation's
for a publish, the compensation's for a removal, ``operation_key``,
``compensation_key``, ``name``) with ``O_APPEND`` and fsync before the
adapter reports success, so tests and operators can count effects. Files,
records and the log are written crash-safely: temp file, fsync, link or
rename, fsync the directory.

A crash between an effect (the link, the unlink) and its log line is
repaired, never left as a gap: before the record of the effect is written,
the line's place is reserved at the end of the log (a line of the same
length that is not JSON and names this effect alone; readers skip it), and
the record notes its offset. The effect's line is then written over that
reservation, wherever other processes appended meanwhile, so whoever meets
the interrupted record next (a repeated call or a lookup) reads that one
place, and writes the line there if it is still the reservation. No path
reads the whole log; a publication that never happens (refused after its
intent, cut before its effect) leaves its reservation, a skipped line.

All file work runs on one private thread, one call at a time and in
submission order, so a lookup submitted after a dispatch or a compensation
(even one whose deadline expired) always sees that call's finished outcome.

This adapter must never log or store payload content outside the published
file, never write into ``target_dir`` outside the names above, and never
perform an effect from a lookup (``reconcile_operation``,
``reconcile_compensation``): a lookup may finish the bookkeeping of an
effect a crash interrupted (the missing log line and record of a file that
is already there or already gone), or settle for good one that never
happened, exactly as a repeated call does.

Within one process the single file thread orders a lookup after the call
it reports on. Several processes may share ``target_dir`` and ``effect_log``
(workers that fail over): each operation is worked on under its own
lock, a lookup held off by another process's lock answers indeterminate,
and a lookup that finds no record leaves a refused record behind, so a
dispatch that reaches the adapter later (a superseded worker woken up)
never publishes what the lookup reported as never published. Effect lines
never wait for one another: each has its reserved place in the log.
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

from octo_common.digest import adapter_idempotency_key
from octo_common.errors import AdapterFailed, AdapterIndeterminate, AdapterInvalidJsonInput
from octo_common.payload import ToolPayload
from octo_common.states import Failed, FailureCode, OperationStatus, Succeeded
from octo_worker.adapters.contract import (
    AdapterContext,
    BaseWorkerAdapter,
    DurableOperationContract,
    validation_text,
)
from octo_worker.adapters.files_disk import (
    TMP_PREFIX,
    append_line,
    fill_line,
    fsync_dir,
    line_at,
    operation_lock,
    read_effect_log,
    replace_file,
    reserve_line,
    sha256_of,
    write_new_file,
)

if TYPE_CHECKING:
    from octo_common.grants import CapabilityGrant
    from octo_common.messages import (
        CompensationReconcileRequest,
        OperationCompensationRequest,
        OperationDispatchRequest,
        OperationReconcileRequest,
    )

__all__ = [
    "FAILED_KEY_REUSED",
    "FAILED_NOT_PUBLISHED",
    "FAILED_NOT_REMOVED",
    "FAILED_TARGET_CHANGED",
    "FAILED_TARGET_EXISTS",
    "FAILED_UNSAFE_SCOPE",
    "FilesPublishAdapter",
    "read_effect_log",
]

TOOL: Final = "files.publish"
FAILED_TARGET_EXISTS: Final = "target exists"
FAILED_NOT_PUBLISHED: Final = "not published"
FAILED_NOT_REMOVED: Final = "not removed"
FAILED_KEY_REUSED: Final = "operation key already used for another publication"
FAILED_TARGET_CHANGED: Final = "published file was modified"
FAILED_UNSAFE_SCOPE: Final = "scope has no directory"

_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")
_META_DIR: Final = ".octo-publish"
_RECORD_FORMAT: Final = 2

T = TypeVar("T")

_RecordState = Literal["publishing", "published", "refused", "removing", "removed"]


class _PublishInput(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    content: str


class _UndoInput(msgspec.Struct, forbid_unknown_fields=True):
    undo: str
    name: str


class _Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the adapter remembers about one operation (named by its idempotency key)."""

    format_version: int
    idempotency_key: str
    scope: str
    operation_key: str
    name: str
    sha256: str
    size: int
    state: _RecordState
    # Where the line of the effect in progress (publish, then removal)
    # stands: its reservation (log_reserved), or, in a record written before
    # reservations, the log's length when the effect began.
    log_offset: int
    reason: str | None = None
    compensation_key: str | None = None
    compensation_idempotency_key: str | None = None
    removed_file: bool | None = None
    # A compensation found never to have removed anything; it never will.
    refused_compensation: str | None = None
    log_reserved: bool = False


_RECORD_DECODER = msgspec.json.Decoder(_Record)
_RECORD_ENCODER = msgspec.json.Encoder()


def _never_published(scope: str, key: str, operation_key: str) -> _Record:
    """What a lookup leaves for an operation it found no record of (no name)."""
    return _Record(
        _RECORD_FORMAT, key, scope, operation_key, "", "", 0, "refused", 0, FAILED_NOT_PUBLISHED
    )


def _refused(reason: str) -> Failed:
    """The answer of a refused publication: "not published" (a lookup miss, or a
    publication cut before its file appeared, settled for good) is proven not
    to have happened under this key, which the refused record fences; any other
    reason is the publication's own failure."""
    if reason == FAILED_NOT_PUBLISHED:
        return Failed(reason, FailureCode.NOT_HAPPENED)
    return Failed(reason)


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
    except msgspec.ValidationError as exc:
        raise AdapterInvalidJsonInput(f"publish input: {validation_text(exc)}") from None
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
    except msgspec.ValidationError as exc:
        raise AdapterInvalidJsonInput(f"inverse input: {validation_text(exc)}") from None
    if parsed.undo != "publish":
        raise AdapterInvalidJsonInput("inverse input names another action")
    if not _valid_name(parsed.name):
        raise AdapterInvalidJsonInput("unsafe file name")
    return parsed.name


def _publish_payload(record: _Record) -> ToolPayload:
    return ToolPayload.json({"name": record.name, "sha256": record.sha256, "bytes": record.size})


def _undo_payload(record: _Record) -> ToolPayload:
    return ToolPayload.json({"name": record.name, "removed": bool(record.removed_file)})


# The adapter -----------------------------------------------------------------


class FilesPublishAdapter(BaseWorkerAdapter):
    """``files.publish``: publish ``{"name", "content"}`` as a file of the tenant's
    directory, undo with ``{"undo": "publish", "name"}``, look both up by their
    idempotency keys.

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
        self._log_checked = False

    def __repr__(self) -> str:
        return f"FilesPublishAdapter(tool={TOOL!r})"

    @property
    def target_dir(self) -> Path:
        return self._dir

    @property
    def effect_log(self) -> Path:
        return self._log

    def published_path(self, scope: str, name: str) -> Path:
        """Where a file ``name`` published in tenant scope ``scope`` lives."""
        return self._dir / scope / name

    def close(self) -> None:
        """Wait for running file work to finish and stop the private thread."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    # Declarations ---------------------------------------------------------

    def durable_operation_contract(self) -> DurableOperationContract | None:
        return DurableOperationContract.RECONCILIATION

    def lookup_miss_fences_key(self) -> bool:
        """True: a lookup miss leaves a refused record, which a later dispatch
        under the key finds and answers from (it never publishes)."""
        return True

    # Hooks -------------------------------------------------------------------

    async def dispatch_operation(
        self, request: OperationDispatchRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Publish the file of this operation at most once, in ``context.scope``'s directory.

        The input is checked before anything is touched
        (``AdapterInvalidJsonInput``). A name already published by this
        operation (a repeated dispatch) answers the same success without
        writing; a name of the scope held by anything else answers
        ``Failed("target exists")``. An I/O error part-way is
        ``AdapterIndeterminate``: reconciliation tells.
        """
        name, data = _parse_publish(request.payload, grant)
        operation = (context.scope, context.idempotency_key, request.operation_key)
        return await self._run(self._publish, operation, name, data)

    async def compensate_operation(
        self,
        request: OperationCompensationRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        """Remove exactly the file the original operation published.

        The inverse payload must be ``{"undo": "publish", "name": <name>}``
        and name the file recorded for the operation, else
        ``AdapterInvalidJsonInput`` and nothing is touched. A file already
        gone is a success (the record notes that nothing was removed). The
        removal is named by ``context.idempotency_key`` (the compensation's).
        """
        name = _parse_undo(request.payload)
        operation = _operation_of(context, request.operation_key)
        removal = (context.idempotency_key, request.compensation_key)
        return await self._run(self._remove, operation, removal, name)

    async def reconcile_operation(
        self, request: OperationReconcileRequest, grant: CapabilityGrant, context: AdapterContext
    ) -> OperationStatus:
        """Look up what happened to this operation (by ``context.idempotency_key``);
        never publishes.

        Published (even if compensated since) → the dispatch's own success
        payload. Refused → the same ``Failed`` the dispatch answered. No
        record, or a publication interrupted before its file appeared →
        ``Failed("not published", code=FailureCode.NOT_HAPPENED)``. That
        answer is final, not a guess:
        dispatch runs once per operation and synchronously on this adapter's
        single file thread, so a lookup queued behind it sees its outcome;
        after a crash nothing resumes an interrupted publication (a repeated
        dispatch of it also answers "not published"), so an effect that is
        not in the directory now never will be.

        An interrupted publication is settled here as a repeated dispatch
        settles it (its effect line written once, its record finished), so
        the effect log never misses a publication a lookup reports.
        """
        operation = (context.scope, context.idempotency_key, request.operation_key)
        return await self._run(self._lookup, operation)

    async def reconcile_compensation(
        self,
        request: CompensationReconcileRequest,
        grant: CapabilityGrant,
        context: AdapterContext,
    ) -> OperationStatus:
        """Look up the removal of this compensation (by ``context.idempotency_key``,
        the compensation's); never removes anything.

        Removed → the compensation's own success payload. A removal cut by a
        crash after its file was gone is finished (its line written once);
        one cut before the file went, or a compensation that never reached
        the removal, never will remove it: ``Failed("not removed")``, and a
        later compensation under this key answers the same. An original
        that was never published → ``Failed("not published")``, as the
        compensation itself answers.
        """
        operation = _operation_of(context, request.operation_key)
        return await self._run(self._lookup_removal, operation, context.idempotency_key)

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

    def _locked(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            try:
                self._ensure_dirs()
                with operation_lock(self._meta, args[0][1]):
                    return fn(*args)
            except OSError:
                raise AdapterIndeterminate(f"file system error during {what}") from None

    # Sync effects (on the file thread) -----------------------------------

    def _publish(self, operation: tuple[str, str, str], name: str, data: bytes) -> OperationStatus:
        return self._locked("publish", self._publish_locked, operation, name, data)

    def _publish_locked(
        self, operation: tuple[str, str, str], name: str, data: bytes
    ) -> OperationStatus:
        scope, key, operation_key = operation
        self._ensure_dirs()
        digest = hashlib.sha256(data).hexdigest()
        record = self._read_record(key, operation_key)
        if record is not None:
            if record.state == "refused" and not record.name:
                return _refused(record.reason or FAILED_NOT_PUBLISHED)  # a lookup's answer
            if record.name != name or record.sha256 != digest:
                return Failed(FAILED_KEY_REUSED)
            return self._settle(record)
        fresh = _Record(
            _RECORD_FORMAT,
            key,
            scope,
            operation_key,
            name,
            digest,
            len(data),
            "publishing",
            0,
        )
        if not _valid_name(scope):
            return self._refuse(fresh, FAILED_UNSAFE_SCOPE)
        directory = self._scope_dir(scope)
        target = directory / name
        claim = self._claim_path(scope, name)
        if target.exists() or claim.exists():
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        fresh = self._reserve_effect("publish", fresh, key, None)
        # Intent first: after a crash the record says what may have begun.
        self._write_record(fresh)
        try:
            write_new_file(claim, key.encode("ascii"), 0o600)
        except FileExistsError:
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        fsync_dir(self._meta)
        tmp = directory / f"{TMP_PREFIX}{secrets.token_hex(8)}"
        linked = False
        try:
            write_new_file(tmp, data, 0o644)
            # link (unlike rename) never replaces a file that appeared meanwhile.
            os.link(tmp, target)
            linked = True
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(directory)
        if not linked:
            self._release_claim(fresh)
            return self._refuse(fresh, FAILED_TARGET_EXISTS)
        self._write_effect("publish", fresh, key, None)
        published = msgspec.structs.replace(fresh, state="published")
        self._write_record(published)
        return Succeeded(_publish_payload(published))

    def _settle(self, record: _Record) -> OperationStatus:
        """A repeated dispatch of a recorded operation: answer, finishing bookkeeping only."""
        if record.state == "publishing":
            record = self._resolve_publishing(record)
        if record.state == "refused":
            return _refused(record.reason or FAILED_NOT_PUBLISHED)
        return Succeeded(_publish_payload(record))

    def _resolve_publishing(self, record: _Record) -> _Record:
        """Finish a publication a crash interrupted: its file either appeared or never will."""
        if self._is_published(record):
            self._write_effect("publish", record, record.idempotency_key, None)
            settled = msgspec.structs.replace(record, state="published")
            self._write_record(settled)
            return settled
        self._release_claim(record)
        refused = msgspec.structs.replace(record, state="refused", reason=FAILED_NOT_PUBLISHED)
        self._write_record(refused)
        return refused

    def _remove(
        self, operation: tuple[str, str, str], removal: tuple[str, str], name: str
    ) -> OperationStatus:
        return self._locked("removal", self._remove_locked, operation, removal, name)

    def _remove_locked(
        self, operation: tuple[str, str, str], removal: tuple[str, str], name: str
    ) -> OperationStatus:
        _, key, operation_key = operation
        removal_key, compensation_key = removal
        self._ensure_dirs()
        record = self._published_record(key, operation_key)
        if record is None:
            return Failed(FAILED_NOT_PUBLISHED)
        if record.name != name:
            raise AdapterInvalidJsonInput("inverse input names another file")
        if record.refused_compensation == removal_key:
            return Failed(FAILED_NOT_REMOVED)
        if record.state == "removed":
            return Succeeded(_undo_payload(record))
        owned, present = self._file_of(record)
        if present is None:
            return Failed(FAILED_TARGET_CHANGED)
        if record.state == "published":
            record = msgspec.structs.replace(
                record,
                state="removing",
                compensation_key=compensation_key,
                compensation_idempotency_key=removal_key,
                removed_file=present,
            )
            if present:
                record = self._reserve_effect("remove", record, removal_key, compensation_key)
            self._write_record(record)
        if present:
            directory = self._scope_dir(record.scope)
            os.unlink(directory / record.name)
            fsync_dir(directory)
        return Succeeded(_undo_payload(self._finish_removal(record, owned, bool(present))))

    def _finish_removal(self, record: _Record, owned: bool, unlinked: bool) -> _Record:
        """The bookkeeping after a removal's unlink (``unlinked``: by this call), or
        after the file was found gone."""
        if owned:
            self._release_claim(record)
        removal_key = record.compensation_idempotency_key
        # A crash between the unlink and the log line leaves `removing` with
        # the file gone: the removal happened, so it is logged on the way out.
        if record.removed_file:
            self._write_effect("remove", record, removal_key, record.compensation_key)
        removed = msgspec.structs.replace(record, state="removed")
        self._write_record(removed)
        return removed

    def _lookup(self, operation: tuple[str, str, str]) -> OperationStatus:
        with self._lock:
            try:
                scope, key, operation_key = operation
                self._ensure_dirs()
                with operation_lock(self._meta, key):
                    record = self._read_record(key, operation_key)
                    if record is None:
                        # Never published, and now never will be: a dispatch that
                        # reaches an adapter later (a superseded worker's) finds this.
                        return self._refuse(_never_published(scope, key, operation_key), "")
                    # A crash cut a publication short: finish its bookkeeping exactly
                    # as a repeated dispatch would. Neither writes the published file.
                    return self._settle(record)
            except OSError:
                raise AdapterFailed("file system error during lookup") from None

    def _lookup_removal(self, operation: tuple[str, str, str], removal_key: str) -> OperationStatus:
        with self._lock:
            try:
                self._ensure_dirs()
                with operation_lock(self._meta, operation[1]):
                    return self._lookup_removal_locked(operation, removal_key)
            except OSError:
                raise AdapterFailed("file system error during lookup") from None

    def _lookup_removal_locked(
        self, operation: tuple[str, str, str], removal_key: str
    ) -> OperationStatus:
        _, key, operation_key = operation
        record = self._published_record(key, operation_key)
        if record is None:
            return Failed(FAILED_NOT_PUBLISHED)
        if record.state == "removed":
            return Succeeded(_undo_payload(record))
        if record.state == "removing" and record.compensation_idempotency_key == removal_key:
            owned, present = self._file_of(record)
            if present is None:
                # Another file under the name: whether this removal ran is unknown.
                raise AdapterIndeterminate("published file was modified")
            if not (present and record.removed_file):
                # The file went (or was already gone when the removal began):
                # the removal happened; only its bookkeeping is finished here.
                return Succeeded(_undo_payload(self._finish_removal(record, owned, False)))
            # Cut before the unlink: nothing resumes it, so it never happens.
            record = msgspec.structs.replace(
                record,
                state="published",
                compensation_key=None,
                compensation_idempotency_key=None,
                removed_file=None,
            )
        if record.state == "published" and record.refused_compensation != removal_key:
            self._write_record(msgspec.structs.replace(record, refused_compensation=removal_key))
        return Failed(FAILED_NOT_REMOVED)

    # Records, claims, log -------------------------------------------------

    def _ensure_dirs(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        if not self._meta.exists():
            self._meta.mkdir(mode=0o700, exist_ok=True)
            fsync_dir(self._dir)
        if not self._log_checked:
            self._end_torn_line()
            self._log_checked = True

    def _end_torn_line(self) -> None:
        """End a line a power cut tore, once per process, before the first append.

        Every append is one complete line, so only a crash inside a write can
        leave the log without its final newline; the torn part then stays a
        line of its own (``read_effect_log`` skips it) instead of swallowing
        the next effect's line.
        """
        try:
            with open(self._log, "rb") as handle:
                handle.seek(-1, os.SEEK_END)
                last = handle.read(1)
        except (FileNotFoundError, OSError):
            return
        if last != b"\n":
            append_line(self._log, b"\n")

    def _scope_dir(self, scope: str) -> Path:
        directory = self._dir / scope
        if not directory.is_dir():
            directory.mkdir(exist_ok=True)
            fsync_dir(self._dir)
        return directory

    def _record_path(self, key: str) -> Path:
        return self._meta / f"pub.{key}.json"

    def _claim_path(self, scope: str, name: str) -> Path:
        # Neither a scope nor a name holds "/": the pair is unambiguous.
        return self._meta / f"claim.{hashlib.sha256(f'{scope}/{name}'.encode()).hexdigest()}"

    def _read_record(self, key: str, operation_key: str) -> _Record | None:
        try:
            data = self._record_path(key).read_bytes()
        except FileNotFoundError:
            if (self._meta / f"op.{operation_key}.json").exists():
                # Recorded by the older layout, by the bare operation key with
                # no scope: never guess what happened.
                raise AdapterIndeterminate("operation recorded in the old layout") from None
            return None
        try:
            record = _RECORD_DECODER.decode(data)
        except msgspec.DecodeError:
            raise AdapterIndeterminate("unreadable operation record") from None
        if record.format_version != _RECORD_FORMAT or record.idempotency_key != key:
            raise AdapterIndeterminate("unreadable operation record")
        return record

    def _published_record(self, key: str, operation_key: str) -> _Record | None:
        """The record of a publication that happened (interrupted ones settled), or None."""
        record = self._read_record(key, operation_key)
        if record is not None and record.state == "publishing":
            record = self._resolve_publishing(record)
        if record is None or record.state == "refused":
            return None
        return record

    def _write_record(self, record: _Record) -> None:
        replace_file(self._record_path(record.idempotency_key), _RECORD_ENCODER.encode(record))

    def _refuse(self, record: _Record, reason: str) -> Failed:
        """Record that ``record``'s operation will never publish, and answer so
        (``reason`` empty: the record's own)."""
        reason = reason or record.reason or FAILED_NOT_PUBLISHED
        self._write_record(msgspec.structs.replace(record, state="refused", reason=reason))
        return _refused(reason)

    def _claim_owner(self, record: _Record) -> str | None:
        try:
            return self._claim_path(record.scope, record.name).read_text("ascii")
        except FileNotFoundError:
            return None

    def _release_claim(self, record: _Record) -> None:
        if self._claim_owner(record) != record.idempotency_key:
            return
        os.unlink(self._claim_path(record.scope, record.name))
        fsync_dir(self._meta)

    def _is_published(self, record: _Record) -> bool:
        owned, present = self._file_of(record)
        return owned and bool(present)

    def _file_of(self, record: _Record) -> tuple[bool, bool | None]:
        """(this operation holds the name's claim, its file is there): the second is
        None when a file is there that is not the one published."""
        if self._claim_owner(record) != record.idempotency_key:
            return False, False
        found = sha256_of(self._dir / record.scope / record.name)
        if found is None:
            return True, False
        return True, (True if found == record.sha256 else None)

    def _effect_line(
        self, effect: str, record: _Record, key: str | None, compensation_key: str | None
    ) -> tuple[bytes, bytes]:
        """The log line of ``record``'s effect and its reservation (as long, not JSON)."""
        line = json.dumps(
            {
                "effect": effect,
                "scope": record.scope,
                "idempotency_key": key,
                "operation_key": record.operation_key,
                "compensation_key": compensation_key,
                "name": record.name,
            },
            separators=(",", ":"),
        ).encode("utf-8")
        mark = f"#{effect} {key}".encode("ascii")
        placeholder = mark + b" " * (len(line) - len(mark)) + b"\n"
        return line + b"\n", placeholder

    def _reserve_effect(
        self, effect: str, record: _Record, key: str | None, compensation_key: str | None
    ) -> _Record:
        """``record`` with the place of its effect's line reserved in the log."""
        if not self._log_checked:
            self._end_torn_line()
            self._log_checked = True
        _, placeholder = self._effect_line(effect, record, key, compensation_key)
        offset = reserve_line(self._log, placeholder)
        return msgspec.structs.replace(record, log_offset=offset, log_reserved=True)

    def _write_effect(
        self, effect: str, record: _Record, key: str | None, compensation_key: str | None
    ) -> None:
        """Make the line of ``record``'s effect stand in the log exactly once."""
        line, placeholder = self._effect_line(effect, record, key, compensation_key)
        if record.log_reserved:
            fill_line(self._log, record.log_offset, line, placeholder)
            return
        # A record written before reservations: its line, if written, starts
        # at its offset (one process appended at a time then).
        entry = line_at(self._log, record.log_offset)
        if entry is None or entry.get("effect") != effect or entry.get("idempotency_key") != key:
            append_line(self._log, line)


def _operation_of(context: AdapterContext, operation_key: str) -> tuple[str, str, str]:
    """(scope, the operation's idempotency key, operation key) for a compensation's
    context: the original's record is named by the operation's key, not this call's."""
    key = adapter_idempotency_key(context.scope, "operation", operation_key)
    return context.scope, key, operation_key
