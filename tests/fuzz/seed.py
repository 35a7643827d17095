"""Write the seed inputs of each fuzz target into ``tests/fuzz/corpus/<target>/``.

    python -m tests.fuzz.seed

Seeds are valid inputs made by Octo's own writers (sealed frames, record
envelopes, journal rows, ledgers, the anchor, key files, the example
configurations), so the fuzzer starts past the first refusal. Running it
again writes the same files (names are their content's digest).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Final

from tests.fuzz.targets import KEY, SCOPE, SESSION

HERE: Final = Path(__file__).resolve().parent
CORPUS: Final = HERE / "corpus"
ROOT: Final = HERE.parents[1]


def _messages() -> list[object]:
    from octo_common.messages import CloseSession, RequestRejected

    return [
        CloseSession(SESSION),
        RequestRejected(SESSION, "d-1", "pending_operation"),
        RequestRejected(SESSION, "c-1", "session_poisoned", None, None),
    ]


def seeds() -> dict[str, list[bytes]]:
    from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
    from octo_common.grants import CapabilityGrant, CapabilityManifest
    from octo_common.messages import OpenSession, encode_message
    from octo_common.payload import ToolPayload
    from octo_common.records import (
        StorageKeyring,
        StorageRecordKey,
        encode_anchor,
        seal_record,
    )
    from octo_common.states import Pending, Succeeded
    from octo_host.engine import WorkflowEngine
    from octo_host.ledger import WorkflowOperationLedger
    from octo_host.plan import WorkflowStep
    from octo_worker.journal import WorkerOperationRecord

    messages = [
        *_messages(),
        OpenSession(CapabilityManifest("m", [CapabilityGrant("files.publish", "json", 4, 1)])),
    ]
    worker = SessionAuthenticator(SESSION, SessionKey.from_bytes(KEY), SessionRole.WORKER)
    frames = []
    for message in messages:
        try:
            frames.append(worker.seal(message))  # type: ignore[arg-type]
        except Exception:
            continue  # a message the worker does not send: no seed
    encoded = [encode_message(m) for m in messages]  # type: ignore[arg-type]
    keyring = StorageKeyring("k1", KEY)
    engine = WorkflowEngine()
    plan = engine.plan([WorkflowStep("publish", "publish the notes")])
    empty = WorkflowOperationLedger(plan.fingerprint)
    recorded = empty.copy()
    engine.record_derived_operation(plan, recorded, "publish", "files.publish", b'{"a":1}', b"n")
    ledgers = [empty.to_json().encode(), recorded.to_json().encode()]
    fingerprint = "ab" * 32
    rows = [
        WorkerOperationRecord("files.publish", "op-1", fingerprint, Pending()).to_row_json(SCOPE),
        WorkerOperationRecord(
            "files.publish", "op-1", fingerprint, Succeeded(ToolPayload.json({"ok": 1}))
        ).to_row_json(SCOPE),
    ]
    json_docs = [b'{"b":[1,2.5,-0.0,1e3],"a":"\\u00e9"}', b"[]", b'"text"', b"12345678901234567890"]
    return {
        "frame_open": frames,
        "frame_sealed": encoded,
        "message_decode": encoded,
        "peek": frames,
        "canonical_json": json_docs,
        "payload": json_docs,
        "record_envelope": [
            seal_record(keyring, StorageRecordKey("workflow-ledger", "run"), 1, ledger)
            for ledger in ledgers
        ],
        "journal_row": rows,
        "ledger": ledgers,
        "anchor": [encode_anchor({StorageRecordKey("workflow-ledger", "run"): 3})],
        "inbound_headers": [
            b'{"octo-session":"s-fuzz","octo-scope":"fuzz","octo-key-nonce":"00"}',
            b"{}",
        ],
        "key_file": [KEY, KEY.hex().encode() + b"\n"],
        "worker_config": [(ROOT / "deploy" / "worker.toml.example").read_bytes()],
        "host_config": [(ROOT / "deploy" / "host.toml.example").read_bytes()],
    }


def main() -> None:
    for target, inputs in seeds().items():
        directory = CORPUS / target
        directory.mkdir(parents=True, exist_ok=True)
        for data in inputs:
            (directory / f"seed-{hashlib.sha256(data).hexdigest()[:16]}").write_bytes(data)
        print(f"{target}: {len(inputs)} seeds")


if __name__ == "__main__":
    main()
