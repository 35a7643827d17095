"""Logging defaults a newcomer meets: the worker's lines are for a person on a
terminal and JSON otherwise; the host library, embedded, is quiet below WARNING
unless the application configures logging.

Each case runs in a fresh interpreter (logging configuration is per process).
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import textwrap

WORKER = """
import structlog
from octo_worker.cli.run import configure_logging
configure_logging("info", "auto")
structlog.get_logger("octo.worker.test").info("worker_consuming", scopes=1)
"""


def run(code: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        **kwargs,  # type: ignore[call-overload]
    )


def test_worker_logs_json_when_stderr_is_not_a_terminal() -> None:
    line = run(WORKER).stderr.strip()
    document = json.loads(line)
    assert document["event"] == "worker_consuming" and document["level"] == "info"


def test_worker_logs_for_a_person_on_a_terminal() -> None:
    primary, secondary = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=secondary,
            timeout=120,
            check=True,
        )
        assert done.returncode == 0
        os.close(secondary)
        secondary = -1
        written = b""
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            written += chunk
    finally:
        os.close(primary)
        if secondary != -1:
            os.close(secondary)
    text = written.decode()
    assert "worker_consuming" in text and "scopes=1" in text
    assert not text.lstrip().startswith("{")


HOST = """
import logging
{setup}
from octo_common.runtime.logs import library_logger
log = library_logger("octo.host.client").bind(host="h-1")
log.debug("frame_published", request_id="r-1")
log.info("session_opened", scope="s")
log.warning("reply_late", request_id="r-2")
"""


def test_the_host_library_is_quiet_below_warning_by_default() -> None:
    stderr = run(HOST.format(setup="")).stderr
    assert stderr.splitlines() == ["reply_late host=h-1 request_id=r-2"]


def test_the_host_library_follows_the_applications_logging() -> None:
    stderr = run(HOST.format(setup="logging.basicConfig(level=logging.INFO)")).stderr
    assert stderr.splitlines() == [
        "INFO:octo.host.client:session_opened host=h-1 scope=s",
        "WARNING:octo.host.client:reply_late host=h-1 request_id=r-2",
    ]
