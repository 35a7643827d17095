"""A poisoned session's refusals and the restart that may follow them at once.

A refusal a poisoned session publishes carries an outbound sequence number.
If the process dies right after that publish (a SIGKILL, before any reload
ran), the session restored from the store must never seal another frame
with that number: the host would drop it as a duplicate and wait for its
timeout. So the sequence is durable before the refusal is published.

The parts of ``test_session.py``: a real ``WorkerSession``, the real
``SqliteJournalStore`` on a tmp_path file, the real ``files.publish``; a
"restart" reopens the file under a fresh fence and restores the session,
with nothing in between, as a process killed at that moment would.
The SIGKILL itself is in ``tests/faults/test_poisoned_refusal.py``.
"""

from __future__ import annotations

from octo_common.messages import CloseSession, RequestRejected
from octo_common.payload import ToolPayload

from .test_session import SESSION, World, publish_payload, rejection_code
from .test_session_store import restart, world  # noqa: F401 (the fixture)


async def test_a_restart_right_after_a_poisoning_refusal_never_reuses_its_sequence(
    world: World,  # noqa: F811
) -> None:
    world.store.fail_commits = {len(world.store.commits) + 1}
    refused = await world.send(world.dispatch("op-p", publish_payload("p.txt")))
    assert rejection_code(world.answer(refused)) == "journal_persistence_failed"

    await restart(world)  # killed right after that publish: no reload ran
    later = await world.send(world.dispatch("op-q", publish_payload("q.txt")))

    # The host opens it: a reused sequence would raise DuplicateFrame here.
    answer = world.answer(later)
    assert rejection_code(answer) == "session_poisoned"
    assert world.session.status == "poisoned"
    assert world.effects() == []


async def test_a_restart_right_after_a_stored_poisoned_refusal_never_reuses_its_sequence(
    world: World,  # noqa: F811
) -> None:
    # Poisoned without any refusal (a close has none to send), then reloaded:
    # stored as poisoned, as the daemon's reload leaves it.
    world.store.fail_commits = {len(world.store.commits) + 1}
    closing = await world.send(CloseSession(SESSION))
    assert closing.kinds == ["requeue"]
    await restart(world)
    await world.session.persist_poisoned(world.real_store)

    first = await world.send(world.invoke(ToolPayload.json({"a": 1})))
    assert rejection_code(world.answer(first)) == "session_poisoned"
    await restart(world)  # killed right after that publish
    second = await world.send(world.invoke(ToolPayload.json({"a": 2})))

    answer = world.answer(second)
    assert isinstance(answer, RequestRejected) and answer.code == "session_poisoned"
    assert answer.request_id == "invoke-2"
    assert world.scripted.calls == []  # a poisoned session runs no adapter
