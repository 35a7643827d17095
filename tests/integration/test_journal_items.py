"""Operation keys at rest: the journal names each key by a keyed hash, on both backends.

A journal written by the release before keyed items (commit ``b2fe212``,
exported into a temporary directory and run there in a process of its own,
so nothing here says what its bytes are) holds its operation keys in clear.
Opened by this code it migrates: the keys are gone from the database's
bytes, a duplicate dispatch of a key it holds still answers the stored
outcome without a second effect, and its compensation is still admitted.
A migration killed halfway (SIGKILL at the kill point
``worker.during_journal_rekey``) leaves the old format, and the next open
does it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from octo_common.frames import SessionAuthenticator, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.messages import (
    CompensateOperation,
    CompensationResult,
    DispatchOperation,
    OpenSession,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationResult,
)
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.states import Succeeded
from octo_worker.adapters.contract import WorkerAdapterRegistry
from octo_worker.adapters.files import FilesPublishAdapter, read_effect_log
from octo_worker.session import WorkerSession, WorkerSessionLimits

from .journal_backends import JournalDatabase
from .test_session import (
    PUBLISH,
    REPLY_TO,
    SCOPE,
    STORAGE_KEY,
    RecordingDelivery,
    publish_grant,
    publish_payload,
    session_key,
)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
BEFORE_KEYED_ITEMS = "b2fe212"
DATA_KEY = bytes(range(40, 72))
KEYS = ("op-migrated-alpha", "op-migrated-beta", "op-migrated-gamma")

# Run by the old release: one session dispatches KEYS through files.publish.
OLD_WRITER = """
import asyncio, sys
from pathlib import Path
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from tests.integration.journal_backends import JournalDatabase
from tests.integration.test_session import open_world, publish_grant, publish_payload
from tests.postgres import PostgresSchema

class Keyed(JournalDatabase):
    def store(self, keyring=None, **options):
        data = StorageKeyring("d1", bytes(range(40, 72)))
        return super().store(keyring, data_keyring=data, **options)

async def main(kind, root, journal, url, password_file, schema, *keys):
    place = None if kind == "sqlite" else PostgresSchema(url, Path(password_file), schema)
    database = Keyed(kind, Path(journal), place)
    world = await open_world(Path(root), [publish_grant(max_compensations=3)], database=database)
    try:
        for key in keys:
            await world.send(world.dispatch(key, publish_payload(key + ".txt")))
        assert len(world.effects()) == len(keys)
    finally:
        await world.real_store.close()

asyncio.run(main(*sys.argv[1:]))
"""

# Run by this release: open the store as a start does (the migration runs).
NEW_OPENER = """
import asyncio, sys
from pathlib import Path
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from tests.integration.journal_backends import JournalDatabase
from tests.postgres import PostgresSchema

async def main(kind, journal, url, password_file, schema):
    place = None if kind == "sqlite" else PostgresSchema(url, Path(password_file), schema)
    data = StorageKeyring("d1", bytes(range(40, 72)))
    store = JournalDatabase(kind, Path(journal), place).store(
        StorageKeyring("k1", bytes([7]) * 32), data_keyring=data
    )
    try:
        await store.scopes()
    finally:
        await store.close()

asyncio.run(main(*sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The code of the release before keyed items, exported from the repository."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{BEFORE_KEYED_ITEMS}^{{commit}}"],
        check=False,
        capture_output=True,
    )
    if found.returncode != 0:
        pytest.skip(f"commit {BEFORE_KEYED_ITEMS} is not in this checkout's history")
    tree = tmp_path_factory.mktemp("old-release")
    archive = tree / "old.tar"
    paths = ("octo_common", "octo_worker", "tests")
    git = ("git", "-C", str(REPO), "archive", "--output", str(archive), BEFORE_KEYED_ITEMS)
    subprocess.run([*git, *paths], check=True)
    with tarfile.open(archive) as bundle:
        bundle.extractall(tree, filter="data")
    return tree


def _place(journal_db: JournalDatabase) -> list[str]:
    place = journal_db.place
    if place is None:
        return ["", "", ""]
    return [place.url, str(place.password_file), place.schema]


def _run(code: str, tree: Path, args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "OCTO_FAULT"}
    environment.update(PYTHONPATH=str(tree), **env)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tree,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def write_old_journal(old_release: Path, journal_db: JournalDatabase, root: Path) -> None:
    journal_db.path.parent.mkdir(parents=True, exist_ok=True)
    args = [journal_db.kind, str(root), str(journal_db.path), *_place(journal_db), *KEYS]
    done = _run(OLD_WRITER, old_release, args)
    assert done.returncode == 0, done.stderr


def keyrings() -> dict[str, StorageKeyring]:
    return {"data_keyring": StorageKeyring("d1", DATA_KEY)}


async def assert_keys_in_clear(journal_db: JournalDatabase, expected: bool) -> None:
    raw = await journal_db.raw_bytes()
    for key in KEYS:
        assert (key.encode() in raw) is expected, key


async def test_a_journal_written_before_keyed_items_migrates_and_still_answers(
    journal_db: JournalDatabase, old_release: Path, tmp_path: Path
) -> None:
    write_old_journal(old_release, journal_db, tmp_path)
    await assert_keys_in_clear(journal_db, True)  # the old format: items in clear

    store = journal_db.store(StorageKeyring("k1", STORAGE_KEY), **keyrings())
    try:
        lease = await store.reserve_fence(SCOPE)  # opened: migrated
        await assert_keys_in_clear(journal_db, False)
        assert await journal_db.schema_version() == (5 if journal_db.postgres else 9)
        files = FilesPublishAdapter(tmp_path / "published", tmp_path / "effects.log")
        adapters = WorkerAdapterRegistry()
        adapters.register(PUBLISH, files)
        grant = publish_grant(max_compensations=3)
        session_id, nonce = "session-after", bytes(range(1, 33))
        key = session_key(session_id, nonce)
        host = SessionAuthenticator(session_id, key, SessionRole.HOST)
        worker = SessionAuthenticator(session_id, key, SessionRole.WORKER)
        opening = host.seal(OpenSession(CapabilityManifest(session_id, [grant]), reply_to=REPLY_TO))
        session = await WorkerSession.open(
            worker,
            opening,
            scope=SCOPE,
            key_nonce=nonce,
            reply_to=REPLY_TO,
            store=store,
            lease=lease,
            adapters=adapters,
            limits=WorkerSessionLimits(),
        )

        async def send(message: Any) -> Any:
            delivery = RecordingDelivery()
            await session.handle(host.seal(message), store, delivery)
            (frame,) = delivery.frames
            return host.open(frame)

        alpha = KEYS[0]
        # A duplicate delivery of a key the old journal holds: its stored outcome.
        again = await send(
            DispatchOperation(
                OperationDispatchRequest(
                    session_id, "d-again", PUBLISH, alpha, publish_payload(alpha + ".txt")
                )
            )
        )
        assert isinstance(again, OperationResult) and isinstance(again.result.status, Succeeded)
        assert len(read_effect_log(files.effect_log)) == len(KEYS)  # no second effect
        # Its compensation is admitted and runs once.
        binding = OperationCompensationBinding(
            PUBLISH, alpha, "cmp-migrated-alpha", SCOPE, grant.compensation_fingerprint()
        )
        undo = ToolPayload.json({"undo": "publish", "name": alpha + ".txt"})
        undone = await send(
            CompensateOperation(OperationCompensationRequest(session_id, "c-1", binding, undo))
        )
        assert isinstance(undone, CompensationResult), undone
        assert isinstance(undone.result.status, Succeeded)
        assert [e["effect"] for e in read_effect_log(files.effect_log)][-1] == "remove"
        # Every key still reads back, from its document; none is in the bytes.
        records = await store.list_records(SCOPE)
        assert sorted(record.operation_key for record, _ in records) == sorted(KEYS)
        assert (await store.verify_scope(SCOPE)).rows >= len(KEYS)
    finally:
        await store.close()
    await assert_keys_in_clear(journal_db, False)


async def test_a_migration_killed_halfway_leaves_the_old_format_and_runs_again(
    journal_db: JournalDatabase, old_release: Path, tmp_path: Path
) -> None:
    write_old_journal(old_release, journal_db, tmp_path)
    old_version = await journal_db.schema_version()
    args = [journal_db.kind, str(journal_db.path), *_place(journal_db)]
    killed = _run(NEW_OPENER, REPO, args, OCTO_FAULT="worker.during_journal_rekey@2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "SIGKILL at worker.during_journal_rekey" in killed.stderr
    # Nothing of the migration is left: the old format, whole.
    assert await journal_db.schema_version() == old_version
    await assert_keys_in_clear(journal_db, True)

    again = _run(NEW_OPENER, REPO, args)
    assert again.returncode == 0, again.stderr
    await assert_keys_in_clear(journal_db, False)
    store = journal_db.store(StorageKeyring("k1", STORAGE_KEY), **keyrings())
    try:
        await store.reserve_fence(SCOPE)
        found = await store.load_records(SCOPE, list(KEYS))
        assert all(entry is not None for entry in found.values())
        assert {entry[0].operation_key for entry in found.values() if entry} == set(KEYS)
    finally:
        await store.close()


async def test_an_inspection_reads_a_journal_not_migrated_yet_as_it_is(
    old_release: Path, tmp_path: Path
) -> None:
    """The operator's read-only verbs beside a daemon not restarted after an upgrade:
    the rows are found by their keys in clear, and nothing is rewritten."""
    journal_db = JournalDatabase("sqlite", tmp_path / "journal" / "worker.db", None)
    write_old_journal(old_release, journal_db, tmp_path)
    before = journal_db.path.read_bytes()
    version = await journal_db.schema_version()
    reader = journal_db.store(StorageKeyring("k1", STORAGE_KEY), read_only=True, **keyrings())
    try:
        found = await reader.load_records(SCOPE, [KEYS[1], "op-absent"])
        entry = found[KEYS[1]]
        assert entry is not None and entry[0].operation_key == KEYS[1]
        assert found["op-absent"] is None
        records = await reader.list_records(SCOPE)
        assert sorted(record.operation_key for record, _ in records) == sorted(KEYS)
    finally:
        await reader.close()
    assert await journal_db.schema_version() == version
    assert journal_db.path.read_bytes() == before


async def test_a_new_journal_holds_no_operation_key_in_clear(
    journal_db: JournalDatabase, tmp_path: Path
) -> None:
    from .test_session import open_world

    root = tmp_path / "world"
    root.mkdir()
    keyed = journal_db.store  # every store of the world gets the data keyring

    def store(keyring: StorageKeyring | None = None, **options: Any) -> Any:
        return keyed(keyring, **keyrings(), **options)

    journal_db.store = store  # type: ignore[method-assign]
    world = await open_world(root, [publish_grant()], database=journal_db)
    try:
        for key in KEYS:
            await world.send(world.dispatch(key, publish_payload(key + ".txt")))
        again = await world.send(world.dispatch(KEYS[0], publish_payload(KEYS[0] + ".txt")))
        assert isinstance(world.answer(again), OperationResult)
        assert len(world.effects()) == len(KEYS)
    finally:
        await world.real_store.close()
    await assert_keys_in_clear(journal_db, False)
