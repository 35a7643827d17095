"""The fuzz targets: every reader of bytes an attacker may control.

Each target takes one input (bytes) and feeds it to one reader the way Octo
feeds it: a frame a worker or host opens (and, with a valid tag, the message
inside it), a delivery's headers at the inbound gate, strict and canonical
JSON, a stored record envelope, a journal row, a host ledger, the rollback
anchor, a key file, a worker or host configuration. A reader may refuse the
input only with Octo's stable errors (:class:`OctoError`, each with a
``code``; a key file's :class:`KeyFileRefused`); any other exception, or a
property broken (canonical bytes not stable, a frame opened that does not
re-seal to the same bytes), is a defect the fuzzer reports.

The targets import Octo at call time through :func:`load`, so ``run.py`` can
instrument the imports for coverage first.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from octo_common.errors import OctoError

SESSION: Final = "s-fuzz"
SCOPE: Final = "fuzz"
KEY: Final = bytes(range(32))

Target = Callable[[bytes], None]


def _stable(call: Callable[[], object]) -> object | None:
    """The call's value, or None when it refused the input with a stable error."""
    try:
        return call()
    except OctoError as exc:
        if not isinstance(exc.code, str) or not exc.code:
            raise AssertionError(f"{type(exc).__name__} without a stable code") from exc
        return None


def frame_open(data: bytes) -> None:
    """A host opens whatever arrives on its reply queue."""
    from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole

    host = SessionAuthenticator(SESSION, SessionKey.from_bytes(KEY), SessionRole.HOST)
    _stable(lambda: host.open(data))


def frame_sealed(data: bytes) -> None:
    """A frame with a valid tag over arbitrary message bytes: what a peer holding the
    session key (or a defect of its encoder) may send; once opened, the message
    seals and opens again to itself."""
    from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole, _frame_bytes

    key = SessionKey.from_bytes(KEY)
    worker = SessionAuthenticator(SESSION, key, SessionRole.WORKER)
    tag = _stable(lambda: worker._tag(SessionRole.WORKER, 1, data))
    if not isinstance(tag, bytes):
        return
    host = SessionAuthenticator(SESSION, key, SessionRole.HOST)
    opened = _stable(lambda: host.open(_frame_bytes(1, data, tag.hex())))
    if opened is not None:
        resealed = worker.seal(opened)  # type: ignore[arg-type]
        again = SessionAuthenticator(SESSION, key, SessionRole.HOST).open(resealed)
        assert again == opened, "an opened message does not survive sealing again"


def message_decode(data: bytes) -> None:
    from octo_common.messages import decode_message, encode_message

    message = _stable(lambda: decode_message(data))
    if message is not None:
        assert decode_message(encode_message(message)) == message  # type: ignore[arg-type]


def canonical_json(data: bytes) -> None:
    """Strict JSON, then its canonical form: stable under a second pass."""
    from octo_common.codec import canonical_value, compact_json, parse_json

    value = _stable(lambda: parse_json(data))
    if value is None:
        return
    canonical = _stable(lambda: canonical_value(value))
    if canonical is None:
        return
    first = _stable(lambda: compact_json(canonical))
    if first is None:
        return
    assert isinstance(first, bytes)
    second = compact_json(canonical_value(parse_json(first)))
    assert first == second, "canonical JSON is not stable"


def payload(data: bytes) -> None:
    """A tool payload's canonical operation input bytes (what fingerprints cover)."""
    from octo_common.codec import parse_json
    from octo_common.payload import ToolPayload, canonical_operation_input_bytes

    value = _stable(lambda: parse_json(data))
    if value is None:
        return
    built = _stable(lambda: ToolPayload.json(value))
    if built is None:
        return
    _stable(lambda: canonical_operation_input_bytes(built))  # type: ignore[arg-type]


def record_envelope(data: bytes) -> None:
    """A stored record (ledger, routes, audit, journal rows) opened under a keyring."""
    from octo_common.records import StorageKeyring, StorageRecordKey, open_record

    keyring = StorageKeyring("k1", KEY)
    key = StorageRecordKey("workflow-ledger", "run")
    _stable(lambda: open_record(keyring, key, data, 1))


def journal_row(data: bytes) -> None:
    from octo_worker.journal import WorkerOperationRecord

    _stable(lambda: WorkerOperationRecord.from_row_json(data, SCOPE, "op-1"))


def ledger(data: bytes) -> None:
    from octo_host.ledger import WorkflowOperationLedger

    found = _stable(lambda: WorkflowOperationLedger.from_json(data))
    if isinstance(found, WorkflowOperationLedger):
        assert WorkflowOperationLedger.from_json(found.to_json()) == found


def anchor(data: bytes) -> None:
    from octo_common.records import decode_anchor

    _stable(lambda: decode_anchor(data))


def inbound_headers(data: bytes) -> None:
    """A delivery's headers at the inbound gate (never raises: routed or refused)."""
    from octo_common.codec import parse_json
    from octo_common.inbound import gate

    value = _stable(lambda: parse_json(data))
    headers: Any = value if isinstance(value, dict) else {"octo-session": data}
    gate(len(data), headers, lambda session_id: None)
    gate(len(data), headers, lambda session_id: _Session(), scope=SCOPE)


class _Session:
    scope = SCOPE
    key_nonce = bytes(16)


def peek(data: bytes) -> None:
    """One field of an unopened frame (never raises)."""
    from octo_common.peek import header_text, peek_operation_key

    peek_operation_key(data)
    header_text(data)


_FILES: dict[str, Path] = {}


def _scratch(name: str) -> Path:
    """A private scratch directory of this process (one per target)."""
    if name not in _FILES:
        _FILES[name] = Path(tempfile.mkdtemp(prefix=f"octo-fuzz-{name}-"))
    return _FILES[name]


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def key_file(data: bytes) -> None:
    """A key file's content read as the daemon reads it."""
    from octo_common.keyfile import KeyFileRefused, parse_key_content, read_key_file

    parse_key_content(data)
    path = _scratch("key") / "scope.key"
    _write(path, data)
    try:
        key = read_key_file(path)
    except KeyFileRefused:
        return
    assert len(key) == 32


def worker_config(data: bytes) -> None:
    from octo_worker.config import load_config

    path = _scratch("worker") / "worker.toml"
    _write(path, data)
    _stable(lambda: load_config(path))


def host_config(data: bytes) -> None:
    from octo_host.config import load_config

    path = _scratch("host") / "host.toml"
    _write(path, data)
    _stable(lambda: load_config(path))


TARGETS: Final[dict[str, Target]] = {
    "frame_open": frame_open,
    "frame_sealed": frame_sealed,
    "message_decode": message_decode,
    "canonical_json": canonical_json,
    "payload": payload,
    "record_envelope": record_envelope,
    "journal_row": journal_row,
    "ledger": ledger,
    "anchor": anchor,
    "inbound_headers": inbound_headers,
    "peek": peek,
    "key_file": key_file,
    "worker_config": worker_config,
    "host_config": host_config,
}


_ORDER: Final = sorted(TARGETS)


def every_target(data: bytes) -> None:
    """Every target in one: the first byte picks it, the rest is its input."""
    if data:
        TARGETS[_ORDER[data[0] % len(_ORDER)]](data[1:])
