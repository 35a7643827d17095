"""The operator console in a real browser, against a real daemon with real state.

Playwright drives Debian's Chromium (``/usr/bin/chromium``, installed by
``make test`` through ``deploy/ensure-chromium.sh``; Playwright never
downloads a browser here). The module builds its state with real processes,
the real broker (its own virtual host) and the real SQLite journal:

* a **pending key**: ``octo-worker run`` with ``OCTO_FAULT=worker.after_ack``
  admits a dispatch, acks it and dies by SIGKILL before its adapter runs;
* a **poisoned session**: the restarted daemon's admission commit meets a
  journal another process holds locked past SQLite's busy timeout, fails,
  and the daemon records the session as poisoned;
* **dead letters with hostile header values**: a frame with a
  ``<img onerror>`` scope header and a ``<script>`` message id, which the
  daemon dead-letters (``scope_mismatch``), and a frame published straight to
  the dead-letter exchange with a ``<script>`` reason;
* one succeeded dispatch, so that the live view has deliveries to count.

The standalone console (``octo-worker console --listen 127.0.0.1:0``) and
the daemon's own console (``[console] listen``) serve the pages. Every test
saves a screenshot of its page into its ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import sqlite3
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    DispatchOperation,
    OpenSession,
    OperationDispatchRequest,
    RequestRejected,
)
from octo_common.payload import ToolPayload
from octo_common.transport import DEAD_EXCHANGE, EXCHANGE, HEADER_REASON, reply_queue
from octo_worker.config import load_config
from octo_worker.store import SqliteJournalStore
from tests.integration.test_metrics import free_port
from tests.integration.test_worker_cli import (
    PUBLISH,
    PYTHON,
    REPO,
    HostPeer,
    RunningWorker,
    WorkerFiles,
    private_vhost,
    succeeded,
    wait_until,
)

pytestmark = pytest.mark.rabbitmq

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCOPE = "tenant-console"
SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(2)>"
SECRET_CONTENT = "console-secret-content"


@dataclass
class World:
    files: WorkerFiles
    daemon: RunningWorker
    console: subprocess.Popen[str]
    console_url: str
    daemon_console_url: str
    pending_key: str
    succeeded_key: str
    poisoned_session: str
    hostile_message_id: str
    head_revision: int
    fence: int


# Building the state ------------------------------------------------------------------------


async def _session_status(files: WorkerFiles, session_id: str) -> str | None:
    config = load_config(files.config)
    store = SqliteJournalStore(files.journal, config.storage_keyring(), read_only=True)
    try:
        return await store.session_status(SCOPE, session_id)
    finally:
        await store.close()


def _wait_status(files: WorkerFiles, session_id: str, status: str) -> None:
    reached = wait_until(
        lambda: asyncio.run(_session_status(files, session_id)) == status, timeout=15.0
    )
    assert reached, f"session never reached {status!r} in the journal"


def _commit_failures(files: WorkerFiles) -> float:
    """``octo_journal_commit_failures_total`` summed over codes, from the daemon's endpoint."""
    assert files.metrics_listen is not None
    with urllib.request.urlopen(f"http://{files.metrics_listen}/metrics", timeout=5) as page:
        text = page.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("octo_journal_commit_failures_total{")
    )


async def _poison(url: str, files: WorkerFiles) -> str:
    """Open a session, then dispatch while another process holds the journal locked.

    The daemon's admission commit waits out SQLite's busy timeout and fails.
    The lock is released once the daemon's metrics count that failure: the
    refusal, committed before it is published, then lands,
    and the host gets ``journal_persistence_failed``; the daemon reloads the
    scope and the session stays recorded as poisoned.
    """
    peer = HostPeer(url, SCOPE, files.scope_key)
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel(publisher_confirms=True)
        replies = await channel.declare_queue(
            reply_queue(peer.host_id), durable=True, arguments={"x-queue-type": "quorum"}
        )
        exchange = await channel.get_exchange(EXCHANGE, ensure=False)
        await replies.bind(exchange, routing_key=reply_queue(peer.host_id))
        grant = CapabilityGrant(PUBLISH, "json", max_calls=4)
        opening = OpenSession(
            CapabilityManifest(peer.session_id, [grant]), reply_to=reply_queue(peer.host_id)
        )
        await peer.publish(channel, peer.host.seal(opening), None)
        await asyncio.to_thread(_wait_status, files, peer.session_id, "open")
        # Waits for a commit of the daemon in flight, then keeps every other writer out.
        lock = sqlite3.connect(files.journal, timeout=10, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        try:
            payload = ToolPayload.json({"name": "never.txt", "content": SECRET_CONTENT})
            request = OperationDispatchRequest(
                peer.session_id, "poison-1", PUBLISH, f"op-{uuid.uuid4().hex}", payload
            )
            await peer.publish(channel, peer.host.seal(DispatchOperation(request)), "poison-1")
            failed = await asyncio.to_thread(wait_until, lambda: _commit_failures(files), 20.0)
            assert failed, "the daemon's commit never failed"
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        async with asyncio.timeout(20), replies.iterator() as messages:
            async for message in messages:
                await message.ack()
                answer = peer.host.open(message.body)
                break
        assert isinstance(answer, RequestRejected), answer
        assert answer.code == "journal_persistence_failed", answer.code
    finally:
        await connection.close()
    await asyncio.to_thread(_wait_status, files, peer.session_id, "poisoned")
    return peer.session_id


async def _hostile_dead_letters(url: str) -> str:
    """Two dead letters whose header values are markup; returns the hostile message id."""
    message_id = f"{SCRIPT}-{uuid.uuid4().hex[:6]}"
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(EXCHANGE, ensure=False)
        # The daemon dead-letters it (scope header of another scope) and keeps its headers.
        await exchange.publish(
            aio_pika.Message(b"not a frame", headers={"octo-scope": IMG}, message_id=message_id),
            f"octo.v5.worker.{SCOPE}",
            mandatory=True,
        )
        # A dead letter whose reason itself is markup (a foreign publisher's).
        dead = await channel.get_exchange(DEAD_EXCHANGE, ensure=False)
        await dead.publish(
            aio_pika.Message(
                b"x", headers={HEADER_REASON: SCRIPT, "octo-session": IMG}, message_id="plain-id"
            ),
            "",
        )
    finally:
        await connection.close()
    return message_id


async def _count_dead_letters(url: str) -> int:
    # A passive declare counts the messages without touching them.
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue("octo.v5.dead", passive=True)
        return int(queue.declaration_result.message_count or 0)
    finally:
        await connection.close()


def _dead_letter_total(files: WorkerFiles) -> int:
    """The dead-letter queue's length, in a thread (the browser's loop runs in this one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _count_dead_letters(files.broker_url)).result(timeout=30)


async def _head(files: WorkerFiles) -> tuple[int, int]:
    config = load_config(files.config)
    store = SqliteJournalStore(files.journal, config.storage_keyring(), read_only=True)
    try:
        metadata = await store.scope_metadata(SCOPE)
        return await store.head_revision(SCOPE), metadata.fence
    finally:
        await store.close()


def _start_console(files: WorkerFiles) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [
            *(PYTHON, "-m", "octo_worker", "console"),
            *("--config", str(files.config), "--listen", "127.0.0.1:0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
    if match is None:
        process.kill()
        pytest.fail(f"octo-worker console did not start: {line!r} {process.stderr.read()!r}")
    return process, match.group(1)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make test runs deploy/ensure-chromium.sh)")
    with private_vhost("octo-console") as broker:
        console_port = free_port()
        files = WorkerFiles(
            tmp_path_factory.mktemp("console"),
            broker.url,
            SCOPE,
            metrics_listen=f"127.0.0.1:{free_port()}",
            # The first line still belongs to [metrics]: queue gauges refreshed often.
            extra=f'queue_refresh_seconds = 0.5\n[console]\nlisten = "127.0.0.1:{console_port}"\n',
        )
        # 1. A pending key: admitted and acked, then SIGKILL before the adapter runs.
        crashing = RunningWorker.start(files, env={**os.environ, "OCTO_FAULT": "worker.after_ack"})
        try:
            peer = HostPeer(broker.url, SCOPE, files.scope_key)
            pending_key = asyncio.run(
                peer.dispatch_without_waiting(
                    PUBLISH, ToolPayload.json({"name": "a.txt", "content": SECRET_CONTENT})
                )
            )
            assert crashing.process.wait(timeout=20) == -9, crashing.log()[-2000:]
        finally:
            crashing.kill()
        daemon = RunningWorker.start(files)
        console: subprocess.Popen[str] | None = None
        try:
            # 2. A succeeded dispatch, then 3. a poisoned session, 4. hostile dead letters.
            answers = asyncio.run(
                HostPeer(broker.url, SCOPE, files.scope_key).dispatch(
                    PUBLISH, [ToolPayload.json({"name": "b.txt", "content": SECRET_CONTENT})]
                )
            )
            assert succeeded(answers[0][1]), answers
            poisoned = asyncio.run(_poison(broker.url, files))
            hostile_id = asyncio.run(_hostile_dead_letters(broker.url))
            assert wait_until(lambda: _dead_letter_total(files) == 2, timeout=10.0)
            revision, fence = asyncio.run(_head(files))
            console, url = _start_console(files)
            yield World(
                files,
                daemon,
                console,
                url,
                f"http://127.0.0.1:{console_port}/",
                pending_key,
                answers[0][0],
                poisoned,
                hostile_id,
                revision,
                fence,
            )
        finally:
            if console is not None:
                console.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    console.wait(timeout=10)
                console.kill()
            daemon.stop()
            daemon.kill()


# The browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser(world: World) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, timeout=30_000
        )
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Watched:
    page: Any
    dialogs: list[str]
    console_errors: list[str]


@pytest.fixture
def page(browser: Any) -> Iterator[Watched]:
    """A fresh page that records every dialog (an executed script would open one)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(10_000)
    watched = Watched(tab, [], [])

    def on_dialog(dialog: Any) -> None:
        watched.dialogs.append(dialog.message)
        dialog.dismiss()

    tab.on("dialog", on_dialog)
    tab.on(
        "console", lambda m: watched.console_errors.append(m.text) if m.type == "error" else None
    )
    yield watched
    context.close()


def _scope_section(page: Any) -> Any:
    return page.locator(f'section.scope[data-scope="{SCOPE}"]')


# The pages ----------------------------------------------------------------------------------


def test_scope_page_shows_the_pending_key_the_poisoned_session_and_the_dead_letters(
    world: World, page: Watched, tmp_path: Path
) -> None:
    tab = page.page
    response = tab.goto(world.console_url)
    assert response is not None and response.status == 200
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    section = _scope_section(tab)
    states = section.locator("table.states")
    assert states.locator("tr.state-pending td").first.inner_text() == "1"
    assert states.locator("tr.state-succeeded td").first.inner_text() == "1"
    sessions = section.locator("table.sessions")
    assert sessions.locator("td.poisoned").inner_text() == "1"
    # Open: the session of the crashed dispatch and the succeeded one; then the poisoned one.
    assert sessions.locator("td.open").inner_text() == "2"
    assert sessions.locator("td.closed").inner_text() == "0"
    # Fences: the crashed daemon's start, the restart, the reload after the poisoning.
    assert world.fence == 3
    assert section.locator("td.fence").inner_text() == "3"
    assert section.locator("td.revision").inner_text() == str(world.head_revision)
    assert section.locator("td.outbox").inner_text() == "0"
    assert tab.locator("#dead-letter-count").inner_text() == "2 frame(s)"
    stuck = section.locator("table.stuck")
    assert stuck.locator("a").all_inner_texts() == [world.pending_key]
    oldest = section.locator("td.oldest a")
    assert oldest.get_attribute("href") == f"/key/{world.pending_key}?scope={SCOPE}"
    assert re.fullmatch(r"\d+s|\d+m \d\ds", oldest.inner_text())
    assert section.locator("ul.poisoned-ids").inner_text() == world.poisoned_session
    commands = section.locator("ol.commands").inner_text()
    assert f"octo-host recover RUN --scope {SCOPE} --inputs FILE" in commands
    assert SECRET_CONTENT not in tab.content()
    tab.screenshot(path=str(tmp_path / "scopes.png"), full_page=True)
    assert page.dialogs == [] and page.console_errors == []


def test_key_page_shows_what_the_journal_records_and_the_resolving_commands(
    world: World, page: Watched, tmp_path: Path
) -> None:
    tab = page.page
    tab.goto(world.console_url)
    _scope_section(tab).locator("table.stuck a").first.click()
    tab.wait_for_url(f"**/key/{world.pending_key}?scope={SCOPE}")
    detail = tab.locator("table.detail")
    assert detail.locator("td.state").first.inner_text().strip() == "pending"
    assert re.search(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", detail.locator("td.written").inner_text()
    )
    assert "latest" in tab.locator("p.note").inner_text()  # no history: it says so
    commands = tab.locator("ol.commands").inner_text()
    config = str(world.files.config)
    assert f"octo-worker journal show {world.pending_key} --scope {SCOPE} --config {config}" in (
        commands
    )
    # The host finds the run itself; a lookup needs no input.
    assert f"octo-host find {world.pending_key}" in commands
    assert f"octo-host reconcile {world.pending_key} --scope {SCOPE}" in commands
    assert (
        f"octo-host resolve {world.pending_key} --scope {SCOPE} --state "
        "succeeded|failed|cancelled --reason TEXT" in commands
    )
    tab.screenshot(path=str(tmp_path / "key-pending.png"), full_page=True)

    # A settled key: its payload is a format and a size, never its content.
    tab.fill("#key-search", world.succeeded_key)
    tab.press("#key-search", "Enter")
    tab.wait_for_url(re.compile(r"/key\?key="))
    state = tab.locator("table.detail td.state").first.inner_text()
    assert state.startswith("succeeded (payload: json,") and state.endswith("bytes)")
    assert "Nothing to resolve" in tab.locator("main").inner_text()
    assert SECRET_CONTENT not in tab.content()
    tab.screenshot(path=str(tmp_path / "key-succeeded.png"), full_page=True)
    assert page.dialogs == [] and page.console_errors == []


def test_dead_letter_page_renders_hostile_header_values_as_text(
    world: World, page: Watched, tmp_path: Path
) -> None:
    tab = page.page
    response = tab.goto(world.console_url + "dlq?scopes=all")
    assert response is not None and response.status == 200
    assert tab.locator("#dead-total").inner_text() == "2"
    reasons = tab.locator("table.reasons td.reason").all_inner_texts()
    assert sorted(reasons) == sorted(["scope_mismatch", SCRIPT])
    frames = tab.locator("table.frames")
    # The markup is on the page as text ...
    assert SCRIPT in frames.locator("td.reason").all_inner_texts()
    assert any(IMG in text for text in frames.locator("td.scope").all_inner_texts())
    assert IMG in frames.locator("td.session").all_inner_texts()
    assert world.hostile_message_id in frames.locator("td.message-id").all_inner_texts()
    # ... and never as elements: no script or image came out of a header value.
    assert tab.locator("main script").count() == 0
    assert tab.locator("main img").count() == 0
    assert tab.evaluate("document.scripts.length") == 0
    # The commands quote the hostile id for the shell.
    commands = frames.locator("td.commands").all_inner_texts()
    quoted = "'" + world.hostile_message_id + "'"
    assert any(f"octo-worker dlq drop --message-id {quoted}" in text for text in commands)
    plain = frames.locator("tr.frame", has=tab.locator("td.message-id", has_text="plain-id"))
    letter = plain.locator("td.letter-id").inner_text()
    assert f"octo-worker dlq show {letter} --message-id plain-id" in plain.inner_text()
    assert "not a frame" not in tab.content()  # bodies are never shown
    tab.screenshot(path=str(tmp_path / "dlq.png"), full_page=True)
    assert page.dialogs == [], page.dialogs

    # By default, this worker's scopes only: the letter its own queue dead-lettered.
    tab.goto(world.console_url + "dlq")
    assert tab.locator("#dead-total").inner_text() == "1"
    assert frames.locator("td.reason").all_inner_texts() == ["scope_mismatch"]
    # The same letters under the same ids, view after view.
    tab.goto(world.console_url + "dlq?scopes=all")
    assert frames.locator("td.letter-id").all_inner_texts() == sorted(
        frames.locator("td.letter-id").all_inner_texts(), key=int
    )
    assert plain.locator("td.letter-id").inner_text() == letter

    # Readable rows: the commands column keeps its room, so a row is a few lines
    # tall, not a column of broken words.
    for row in frames.locator("tr.frame").all():
        box = row.bounding_box()
        assert box is not None and box["height"] <= 160, box
        cell = row.locator("td.commands").bounding_box()
        assert cell is not None and cell["width"] >= 400, cell
    tab.screenshot(path=str(tmp_path / "dlq-rows.png"), full_page=True)

    # Looking changed nothing on the broker: both letters still wait in the
    # queue, and neither was ever delivered (three views above).
    counts = _delivery_counts(world.files)
    assert len(counts) == 2 and all(count in (None, 0) for count in counts), counts


async def _peek_delivery_counts(url: str) -> list[int | None]:
    """Each waiting letter's x-delivery-count, taken once and put back (the check's
    own delivery, after every view)."""
    connection = await aio_pika.connect(url, timeout=5)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue("octo.v5.dead", passive=True)
        held = []
        while (message := await queue.get(no_ack=False, fail=False, timeout=5)) is not None:
            held.append(message)
        counts = [(m.headers or {}).get("x-delivery-count") for m in held]
        for message in held:
            await message.reject(requeue=True)
        return [count if isinstance(count, int) else None for count in counts]
    finally:
        await connection.close()


def _delivery_counts(files: WorkerFiles) -> list[int | None]:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _peek_delivery_counts(files.broker_url)).result(timeout=30)


def _live_rows(tab: Any, table: str) -> dict[tuple[str, str], int]:
    rows: dict[tuple[str, str], int] = {}
    for row in tab.locator(f"#{table} tbody tr").all():
        scope, label, count, _delta = row.locator("td").all_inner_texts()
        rows[(scope, label)] = int(count)
    return rows


_DELIVERIES = re.compile(r"^octo_deliveries_total\{([^}]*)\} ([0-9.e+]+)$", re.MULTILINE)


def _daemon_deliveries(files: WorkerFiles) -> dict[tuple[str, str], int]:
    """The daemon's ``octo_deliveries_total`` samples by (scope, outcome), non-zero ones."""
    assert files.metrics_listen is not None
    with urllib.request.urlopen(f"http://{files.metrics_listen}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found: dict[tuple[str, str], int] = {}
    for labels, value in _DELIVERIES.findall(text):
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value):
            found[(pairs["scope"], pairs["outcome"])] = int(float(value))
    assert found, "no octo_deliveries_total sample: this comparison would check nothing"
    return found


def test_live_view_served_by_the_daemon_counts_deliveries_by_outcome(
    world: World, page: Watched, tmp_path: Path
) -> None:
    tab = page.page
    tab.goto(world.daemon_console_url + "live")
    assert "in process" in tab.locator("#live-source").inner_text()
    # The script replaces the server-rendered rows with its first reading.
    # A locator wait: the page's CSP (script-src 'self') refuses the eval a
    # string predicate of wait_for_function needs.
    tab.locator("#live-status", has_text="every").wait_for(timeout=10_000)
    deliveries = _live_rows(tab, "live-deliveries")
    # Since the restart: at least two opens and two dispatches (one succeeded,
    # one refused by the failed commit) acked (a host's publish retried under
    # load adds a duplicate), and the garbage frame dead-lettered. The view
    # shows exactly what the daemon's own metrics count.
    assert deliveries[(SCOPE, "acked")] >= 4
    assert deliveries == _daemon_deliveries(world.files)
    assert deliveries[(SCOPE, "dead_lettered")] == 1
    assert _live_rows(tab, "live-rejected") == {(SCOPE, "scope_mismatch"): 1}
    queues = {
        row.locator("td").first.inner_text(): row.locator("td").all_inner_texts()[1:]
        for row in tab.locator("#live-queues tbody tr").all()
    }
    assert queues["octo.v5.dead"] == ["2", "0"]  # two dead letters, nobody consuming them
    assert queues[f"octo.v5.worker.{SCOPE}"] == ["0", "1"]  # this daemon consumes its scope
    assert tab.locator("#live-consumers").inner_text() == "1"
    tab.screenshot(path=str(tmp_path / "live-daemon.png"), full_page=True)
    # The footer says which console this is.
    assert "served by the running daemon" in tab.locator("footer").inner_text()
    # Its other pages read the journal and the broker off the daemon's loop.
    tab.goto(world.daemon_console_url)
    states = _scope_section(tab).locator("table.states")
    assert states.locator("tr.state-pending td").first.inner_text() == "1"
    assert tab.locator("#dead-letter-count").inner_text() == "2 frame(s)"
    tab.goto(world.daemon_console_url + "dlq?scopes=all")
    assert tab.locator("#dead-total").inner_text() == "2"
    tab.screenshot(path=str(tmp_path / "dlq-daemon.png"), full_page=True)
    assert page.dialogs == [] and page.console_errors == []


def test_live_view_of_the_standalone_console_polls_the_metrics_endpoint(
    world: World, page: Watched, tmp_path: Path
) -> None:
    tab = page.page
    tab.goto(world.console_url + "live")
    assert "metrics endpoint" in tab.locator("#live-source").inner_text()
    # A locator wait: the page's CSP (script-src 'self') refuses the eval a
    # string predicate of wait_for_function needs.
    tab.locator("#live-status", has_text="every").wait_for(timeout=10_000)
    deliveries = _live_rows(tab, "live-deliveries")
    assert deliveries[(SCOPE, "dead_lettered")] == 1
    tab.screenshot(path=str(tmp_path / "live-standalone.png"), full_page=True)
    assert page.dialogs == [] and page.console_errors == []


def test_the_console_refuses_every_method_but_get_and_head(world: World, page: Watched) -> None:
    request = page.page.context.request
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        answer = request.fetch(world.console_url + "dlq", method=method)
        assert answer.status == 405, method
        assert answer.headers["allow"] == "GET, HEAD"
    assert request.head(world.console_url).status == 200
    assert request.head(world.console_url + "dlq").status == 200  # without reading the queue
    # Nothing was dropped by any of it.
    assert _dead_letter_total(world.files) == 2
