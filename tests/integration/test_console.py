"""``octo-worker console`` as a process: who it serves, and what it refuses.

Real processes and real files; no daemon and no broker are needed here (the
configured broker is a closed local port, the journal does not exist yet),
so every page answers fast. The browser tests against a running daemon are
``test_console_browser.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from octo_common.payload import ToolPayload
from octo_common.states import Failed, Pending, Succeeded
from octo_worker.config import load_config
from octo_worker.console import data
from octo_worker.console.app import _environment
from octo_worker.console.data import DeadLetter, DeadLetterView, KeyRow, KeyView
from octo_worker.journal import WorkerCompensationRecord
from octo_worker.storage.journal_items import JournalItems
from octo_worker.store import SqliteJournalStore
from tests.integration.test_worker_cli import (
    PYTHON,
    REPO,
    WorkerFiles,
    octo_worker_each,
    one_line,
    run_error,
)
from tests.integration.test_worker_store_prune import FP, _write
from tests.integration.test_worker_store_prune import SCOPE as SCOPE_P
from tests.integration.test_worker_store_prune import _record as prune_record
from tests.tlsfiles import make_tls_files

SECRET = "payload-and-failure-text-never-shown"
TOKEN = "ESUK5XZa4koC3cbtCkXUD62B1MY_GYIPGUesxMsp4g4"  # as octo-worker console-token writes
HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)">'


@pytest.fixture
def files(tmp_path: Path) -> WorkerFiles:
    # Port 1 on loopback: the broker "is unreachable" at once, without a timeout.
    return WorkerFiles(tmp_path / "worker", "amqp://127.0.0.1:1/", "tenant-c")


def _token_file(directory: Path, text: str = TOKEN, mode: int = 0o600) -> Path:
    path = directory / "console.token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


class Console:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process, self.url = process, url

    def get(
        self, path: str, headers: dict[str, str] | None = None, method: str = "GET"
    ) -> tuple[int, dict[str, str], str]:
        request = urllib.request.Request(self.url + path, headers=headers or {}, method=method)
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(request, timeout=10) as response:
                return response.status, dict(response.headers), response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read().decode()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


@contextlib.contextmanager
def _serve(files: WorkerFiles, *extra: str) -> Iterator[Console]:
    process = subprocess.Popen(
        [
            *(PYTHON, "-m", "octo_worker", "console", "--config", str(files.config)),
            *("--listen", "127.0.0.1:0", *extra),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None and process.stderr is not None
    line = process.stdout.readline()
    match = re.search(r"https?://127\.0\.0\.1:\d+/", line)
    try:
        assert match is not None, (line, process.stderr.read())
        yield Console(process, match.group(0).rstrip("/"))
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0  # SIGTERM stops it cleanly
        assert "Traceback" not in process.stderr.read()


@pytest.fixture
def console(files: WorkerFiles) -> Iterator[Console]:
    with _serve(files) as served:
        yield served


def test_a_non_loopback_address_is_refused_without_the_flag_and_a_private_token(
    files: WorkerFiles, tmp_path: Path
) -> None:
    loose = _token_file(tmp_path, mode=0o644)
    short_dir = tmp_path / "short"
    short_dir.mkdir()
    short = _token_file(short_dir, text="short")
    link = tmp_path / "link.token"
    link.symlink_to(_token_file(tmp_path / "worker"))
    weak_dir = tmp_path / "weak"
    weak_dir.mkdir()
    weak = _token_file(weak_dir, text="A" * 32)
    good_dir = tmp_path / "good"
    good_dir.mkdir()
    good = _token_file(good_dir)
    base = ["console", "--listen", "0.0.0.0:0"]
    results = octo_worker_each(
        base,
        [*base, "--allow-remote"],
        [*base, "--allow-remote", "--token-file", str(loose)],
        [*base, "--allow-remote", "--token-file", str(short)],
        [*base, "--allow-remote", "--token-file", str(link)],
        [*base, "--allow-remote", "--token-file", str(weak)],
        [*base, "--allow-remote", "--token-file", str(good)],
        config=files.config,
    )
    assert [result.returncode for result in results] == [2] * 7
    lines = [one_line(result.stderr) for result in results]
    assert "not a loopback address" in lines[0]
    assert "needs an access token" in lines[1]
    assert "grants permissions to group or others" in lines[2] and "chmod 600" in lines[2]
    assert "at least 32 printable ASCII characters" in lines[3]
    assert "cannot open" in lines[4]  # a symlink is not followed
    assert "weak_access_token" in lines[5]
    # A good token, but the traffic would be plain HTTP: no TLS, no proxy.
    assert "console_tls_required" in lines[6] and "--behind-proxy" in lines[6]
    assert all(TOKEN not in line for line in lines)


def test_console_token_writes_a_random_private_token_once(
    files: WorkerFiles, tmp_path: Path
) -> None:
    first, second = tmp_path / "a.token", tmp_path / "b.token"
    results = octo_worker_each(
        ["console-token", str(first)], ["console-token", str(second)], config=files.config
    )
    results += octo_worker_each(["console-token", str(first)], config=files.config)
    assert [result.returncode for result in results] == [0, 0, 2]
    assert "never replaced" in one_line(results[2].stderr)
    tokens = [path.read_text().strip() for path in (first, second)]
    assert tokens[0] != tokens[1] and all(len(token) >= 43 for token in tokens)
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in (first, second))
    assert all(token not in result.stdout for token in tokens for result in results)


def test_a_remote_console_serves_https_with_its_certificate(
    files: WorkerFiles, tmp_path: Path
) -> None:
    tls = make_tls_files(tmp_path / "tls")
    token_file = _token_file(tmp_path)
    with _serve(
        files,
        *("--token-file", str(token_file)),
        *("--tls-cert", str(tls.server_cert), "--tls-key", str(tls.server_key)),
    ) as console:
        assert console.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(tls.ca))
        request = urllib.request.Request(
            console.url + "/live", headers={"Authorization": "Bearer " + TOKEN}
        )
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            assert response.status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP
            urllib.request.urlopen(console.url.replace("https://", "http://") + "/live", timeout=10)


def test_the_daemon_refuses_a_non_loopback_console_at_start(files: WorkerFiles) -> None:
    files.extra = '[console]\nlisten = "0.0.0.0:9465"\n'
    files.write()
    result = subprocess.run(
        [PYTHON, "-m", "octo_worker", "run", "--config", str(files.config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 2
    assert "not a loopback address" in run_error(result.stderr)


def test_a_port_in_use_is_one_line_naming_the_address(console: Console, files: WorkerFiles) -> None:
    taken = console.url.rsplit(":", 1)[1]
    result = subprocess.run(
        [
            *(PYTHON, "-m", "octo_worker", "console", "--config", str(files.config)),
            *("--listen", f"127.0.0.1:{taken}"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert f"cannot listen on 127.0.0.1:{taken}" in line and "[console] listen" in line


def test_without_a_token_only_loopback_host_names_are_served(console: Console) -> None:
    assert console.get("/live")[0] == 200
    assert console.get("/live", {"Host": "localhost:8080"})[0] == 200  # an SSH tunnel
    status, _, body = console.get("/live", {"Host": "console.attacker.example"})
    assert status == 421 and "loopback host name" in body


def test_every_response_is_no_store_under_a_strict_policy(console: Console) -> None:
    expected = {
        "/": 503,  # no journal yet, no broker
        "/dlq": 503,
        "/live": 200,  # says that no live source is configured
        "/live.json": 200,
        "/key/op-x": 503,
        "/key/BAD": 400,
        "/nope": 404,
        "/static/console.js": 200,
    }
    for path, wanted in expected.items():
        status, headers, body = console.get(path)
        assert status == wanted, (path, status)
        policy = headers["Content-Security-Policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy, path
        assert "'unsafe-inline'" not in policy
        assert headers["Cache-Control"] == "no-store"
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert "Traceback" not in body
    status, _, body = console.get("/")
    # No journal yet and no broker: the page says so, in a line, with status 503.
    assert status == 503 and "does not exist (the daemon creates it when it starts)" in body
    assert "octo.v5.dead" in body and "unreachable" in body
    status, _, body = console.get("/live")
    assert "no live source" in body and "[metrics] listen is not configured" in body
    status, _, body = console.get("/dlq", method="DELETE")
    assert status == 405


def test_with_a_token_every_request_must_present_it(files: WorkerFiles, tmp_path: Path) -> None:
    token_file = _token_file(tmp_path)
    with _serve(files, "--token-file", str(token_file)) as console:
        status, headers, _ = console.get("/live")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert console.get("/live", {"Authorization": "Bearer " + TOKEN[:-1] + "x"})[0] == 401
        assert console.get("/live", {"Authorization": "Bearer " + TOKEN})[0] == 200
        # A token in the URL is traded for a cookie (HttpOnly, SameSite=Strict) and dropped.
        status, headers, _ = console.get("/dlq?token=" + TOKEN + "&x=1")
        assert status == 303 and headers["Location"] == "/dlq?x=1"
        cookie = headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        assert "Secure" in cookie and "Max-Age=28800" in cookie  # 8 hours by default
        value = cookie.split(";", 1)[0]
        # Each visit gets a random session of its own; a made-up one is refused.
        again = console.get("/live?token=" + TOKEN)[1]["Set-Cookie"].split(";", 1)[0]
        assert again != value and console.get("/live", {"Cookie": again})[0] == 200
        assert console.get("/live", {"Cookie": "octo_console=" + "x" * 43})[0] == 401
        # The redirect never leaves the console ("//host/" would).
        status, headers, _ = console.get("//elsewhere.example/x?token=" + TOKEN)
        assert status == 303 and headers["Location"] == "/elsewhere.example/x"
        assert console.get("/live", {"Cookie": value})[0] == 200
        assert console.get("/live?token=wrong")[0] == 401
        # The token, not the Host header, decides then.
        assert console.get("/live", {"Host": "ops.example", "Cookie": value})[0] == 200


def test_every_template_escapes_what_it_shows() -> None:
    environment = _environment()
    entry = {
        "id": 1,
        "reason": HOSTILE,
        "queue_scope": HOSTILE,
        "scope": HOSTILE + "-header",
        "session": HOSTILE,
        "message_id": HOSTILE,
        "size": 3,
    }
    view = DeadLetterView("octo.v5.dead.log", (HOSTILE,), 7, 8, [(HOSTILE, 1)])
    view.entries.append(DeadLetter(entry, [HOSTILE], True))
    page = environment.get_template("dlq.html").render(
        page="dlq",
        served_by_daemon=False,
        now=0.0,
        view=view,
        bad_after=False,
        every_scope=False,
        dead_queue=HOSTILE,
    )
    key = KeyView(
        HOSTILE,
        [
            KeyRow(
                {
                    "scope": HOSTILE,
                    "operation_key": HOSTILE,
                    "tool": HOSTILE,
                    "input_fingerprint": HOSTILE,
                    "revision": 1,
                    "state": HOSTILE,
                    "failure_code": HOSTILE,
                    "failure_text": HOSTILE,
                    "message_bytes": 3,
                    "compensation": None,
                },
                None,
                [(HOSTILE, HOSTILE)],
            )
        ],
        HOSTILE,
    )
    page += environment.get_template("key.html").render(
        page="key", served_by_daemon=False, now=0.0, view=key, key=HOSTILE
    )
    assert "<script>" not in page and "<img" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 10


async def test_the_scope_and_key_views_of_a_journal_with_a_compensation_under_way(
    tmp_path: Path,
) -> None:
    files = WorkerFiles(tmp_path / "w", "amqp://127.0.0.1:1/", SCOPE_P)
    config = load_config(files.config)
    files.journal.parent.mkdir(parents=True)
    store = SqliteJournalStore(files.journal, config.storage_keyring())
    done = Succeeded(ToolPayload.json({"secret": SECRET}))
    undoing = WorkerCompensationRecord("cmp-undo", FP, FP, Pending())
    await _write(
        store,
        [
            prune_record("op-waiting", Pending()),
            prune_record("op-undoing", done, undoing),
            prune_record("op-failed", Failed(SECRET)),
            prune_record("op-done", done),
        ],
    )
    await store.close()
    undoing_item = JournalItems(config.storage_keyring()).item(SCOPE_P, "op-undoing")
    with sqlite3.connect(files.journal) as connection:  # op-undoing is the oldest
        connection.execute(
            "UPDATE items SET written_at = written_at - 600 WHERE item = ?", (undoing_item,)
        )

    view = await data.overview(config, "/etc/octo/w.toml")
    (scope,) = view.scopes
    assert scope.states == {"pending": 1, "running": 0, "succeeded": 2, "failed": 1, "cancelled": 0}
    assert scope.compensations["pending"] == 1
    assert [row.operation_key for row in scope.stuck] == ["op-undoing", "op-waiting"]
    assert scope.oldest_pending_key == "op-undoing"
    assert scope.oldest_pending_seconds is not None and scope.oldest_pending_seconds >= 600

    found = await data.key_view(config, "/etc/octo/w.toml", "cmp-undo")
    (row,) = found.rows
    assert row.detail["operation_key"] == "op-undoing"
    commands = [line for _, line in row.commands]
    # Complete commands: the host finds the run that holds the key.
    assert commands[1:] == [
        "octo-host find cmp-undo",
        f"octo-host reconcile cmp-undo --scope {SCOPE_P}",
        f"octo-host resolve cmp-undo --scope {SCOPE_P} --state succeeded|failed|cancelled "
        "--reason TEXT",
    ]
    failed = await data.key_view(config, "/etc/octo/w.toml", "op-failed", SCOPE_P)
    (row,) = failed.rows
    assert row.detail["message_bytes"] == len(SECRET)  # a size, never the text
    assert [what for what, _ in row.commands] == ["show the row (payloads as format and size)"]
    assert SECRET not in repr(found) + repr(failed) + repr(view)
    missing = await data.key_view(config, "/etc/octo/w.toml", "op-none")
    assert missing.rows == [] and missing.error is None


async def test_a_failures_text_is_on_the_key_page_only_when_the_setting_and_the_data_key_allow(
    tmp_path: Path,
) -> None:
    files = WorkerFiles(tmp_path / "w", "amqp://127.0.0.1:1/", SCOPE_P)
    (files.root / "data.key").write_bytes(os.urandom(32))
    (files.root / "data.key").chmod(0o600)
    base = files.config.read_text().replace(
        'key = { id = "k1", key_file = "storage.key" }',
        'key = { id = "k1", key_file = "storage.key" }\n'
        'data_key = { id = "d1", key_file = "data.key" }',
    )
    files.write(base)
    config = load_config(files.config)
    files.journal.parent.mkdir(parents=True)
    store = SqliteJournalStore(
        files.journal, config.storage_keyring(), data_keyring=config.data_keyring()
    )
    await _write(store, [prune_record("op-refused", Failed(SECRET, "input_refused"))])
    await store.close()
    audit = files.root / "state" / "failure-text-reveals.jsonl"

    default = await data.key_view(config, "/etc/octo/w.toml", "op-refused")
    (row,) = default.rows
    assert row.detail["failure_code"] == "input_refused"
    assert "failure_text" not in row.detail and SECRET not in repr(default)
    assert not audit.exists()

    files.write(base + "\n[console]\nreveal_failures = true\n")
    revealing = load_config(files.config)
    shown = await data.key_view(revealing, "/etc/octo/w.toml", "op-refused", viewer="console:x")
    (row,) = shown.rows
    assert row.detail["failure_text"] == SECRET
    [entry] = [json.loads(line) for line in audit.read_text().splitlines()]
    assert entry["via"] == "console" and entry["operator"] == "console:x"
    assert entry["key"] == "op-refused"
    html = (
        _environment()
        .get_template("key.html")
        .render(page="key", view=shown, key="op-refused", now=0.0, served_by_daemon=False)
    )
    assert SECRET in html and "input_refused" in html
