"""The daemon's Prometheus endpoint, scraped over HTTP while it serves real frames.

``octo-worker run`` runs as a subprocess with ``[metrics] listen`` on a free
local port, in its own RabbitMQ virtual host. A host peer (HOST-role
``SessionAuthenticator`` + aio-pika) opens a session and dispatches
``files.publish`` through the broker; a garbage frame is dead-lettered. Each
assertion compares a scrape taken after the traffic with what the traffic
must have moved.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_worker_cli import (
    PUBLISH,
    Broker,
    HostPeer,
    RunningWorker,
    WorkerFiles,
    octo_worker,
    private_vhost,
    run_error,
    succeeded,
    wait_until,
)

pytestmark = pytest.mark.rabbitmq

SCOPE = "tenant-metrics"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the text exposition: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, line
        labels = frozenset(_LABEL.findall(match.group(2) or ""))
        samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


@pytest.fixture(scope="module")
def metrics_worker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[RunningWorker, int, Broker]]:
    with private_vhost("octo-metrics") as own:
        port = free_port()
        files = WorkerFiles(
            tmp_path_factory.mktemp("metrics"), own.url, SCOPE, metrics_listen=f"127.0.0.1:{port}"
        )
        running = RunningWorker.start(files)
        try:
            yield running, port, own
        finally:
            running.stop()
            running.kill()


def test_a_real_dispatch_moves_deliveries_admissions_adapter_and_commit_metrics(
    metrics_worker: tuple[RunningWorker, int, Broker],
) -> None:
    worker, port, own = metrics_worker
    before = scrape(port)
    assert value(before, "octo_consumers_active") == 1

    peer = HostPeer(own.url, SCOPE, worker.files.scope_key)
    answers = asyncio.run(peer.dispatch_files(["metrics-1.txt", "metrics-2.txt"]))
    assert all(succeeded(answer) for _, answer in answers), answers

    # The reply is published before the delivery's bookkeeping finishes.
    def settled() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        samples = scrape(port)
        delta = value(samples, "octo_deliveries_total", scope=SCOPE, outcome="acked") - value(
            before, "octo_deliveries_total", scope=SCOPE, outcome="acked"
        )
        return samples if delta >= 3 else None  # open_session + two dispatches

    after = wait_until(settled, timeout=10)
    assert after, worker.log()[-2000:]

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("octo_admissions_total", scope=SCOPE, kind="operation", result="dispatch") == 2
    assert (
        moved(
            "octo_adapter_outcomes_total", tool=PUBLISH, method="dispatch_operation", outcome="ok"
        )
        == 2
    )
    assert moved("octo_adapter_duration_seconds_count", tool=PUBLISH) == 2
    # open + (admission, observation) per dispatch; group commit may merge none of them here.
    assert moved("octo_journal_commit_seconds_count") >= 5
    assert moved("octo_replies_total", scope=SCOPE, outcome="confirmed") == 2
    assert value(after, "octo_last_progress_timestamp_seconds") > 0
    assert value(after, "octo_oldest_unresolved_pending_seconds", scope=SCOPE) == 0


def test_a_garbage_frame_moves_frames_rejected_by_reason(
    metrics_worker: tuple[RunningWorker, int, Broker],
) -> None:
    worker, port, own = metrics_worker
    before = scrape(port)
    peer = HostPeer(own.url, SCOPE, worker.files.scope_key)
    asyncio.run(peer.publish_garbage({"octo-scope": "tenant-elsewhere"}, b"\x00garbage"))
    asyncio.run(
        peer.publish_garbage(
            {"octo-scope": SCOPE, "octo-session": "Not A Token", "octo-key-nonce": "00" * 32},
            b"{}",
        )
    )

    def rejected(reason: str) -> float:
        return value(scrape(port), "octo_frames_rejected_total", scope=SCOPE, reason=reason)

    base_scope = value(before, "octo_frames_rejected_total", scope=SCOPE, reason="scope_mismatch")
    base_headers = value(
        before, "octo_frames_rejected_total", scope=SCOPE, reason="invalid_frame_headers"
    )
    assert wait_until(lambda: rejected("scope_mismatch") == base_scope + 1)
    assert wait_until(lambda: rejected("invalid_frame_headers") == base_headers + 1)
    # A delivery's outcome is counted once its dead-letter copy is confirmed and
    # it is acked: after the rejection counter.
    base_dead = value(before, "octo_deliveries_total", scope=SCOPE, outcome="dead_lettered")
    assert wait_until(
        lambda: (
            value(scrape(port), "octo_deliveries_total", scope=SCOPE, outcome="dead_lettered")
            == base_dead + 2
        )
    )
    after = scrape(port)
    assert (
        value(after, "octo_deliveries_total", scope=SCOPE, outcome="dead_lettered") == base_dead + 2
    )
    text = "\n".join(f"{name}{sorted(labels)}" for name, labels in after)
    assert "garbage" not in text and "Not A Token" not in text  # labels carry codes only


def test_metrics_endpoint_serves_the_text_format(
    metrics_worker: tuple[RunningWorker, int, Broker],
) -> None:
    _, port, _ = metrics_worker
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        body = response.read().decode()
    for family in (
        "octo_deliveries_total",
        "octo_admissions_total",
        "octo_adapter_outcomes_total",
        "octo_journal_commit_seconds",
        "octo_frames_rejected_total",
        "octo_consumers_active",
        "octo_outbox_pending",
    ):
        assert f"# TYPE {family.removesuffix('_total')}" in body, family


def test_group_commit_batch_sizes_are_observed(
    metrics_worker: tuple[RunningWorker, int, Broker],
) -> None:
    worker, port, own = metrics_worker
    before = value(scrape(port), "octo_journal_commit_batch_size_count")
    peer = HostPeer(own.url, SCOPE, worker.files.scope_key)
    answers = asyncio.run(peer.dispatch_files(["batch-1.txt"]))
    assert all(succeeded(answer) for _, answer in answers)
    assert wait_until(
        lambda: value(scrape(port), "octo_journal_commit_batch_size_count") > before, timeout=1
    )


def test_a_metrics_port_in_use_is_a_configuration_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        files = WorkerFiles(
            tmp_path, "amqp://127.0.0.1:1/", SCOPE, metrics_listen=f"127.0.0.1:{port}"
        )
        run = octo_worker("run", config=files.config)
    assert run.returncode == 2
    line = run_error(run.stderr)
    assert f"metrics.listen: cannot listen on 127.0.0.1:{port}" in line, line


def test_check_beside_the_running_daemon_finds_its_metrics_port_held_by_it(
    metrics_worker: tuple[RunningWorker, int, Broker],
) -> None:
    worker, port, _ = metrics_worker
    check = octo_worker("check", "--json", config=worker.files.config)
    assert check.returncode == 0, check.stdout
    (line,) = [c for c in json.loads(check.stdout)["checks"] if c["name"] == "metrics"]
    assert line["ok"]
    assert f"127.0.0.1:{port} held by the running octo-worker" in line["detail"]
    # Another configuration's scopes on the same port: run would be refused.
    other = WorkerFiles(
        worker.files.root / "other",
        worker.files.broker_url,
        "tenant-elsewhere",
        metrics_listen=f"127.0.0.1:{port}",
    )
    refused = octo_worker("check", "--json", config=other.config)
    (line,) = [c for c in json.loads(refused.stdout)["checks"] if c["name"] == "metrics"]
    assert not line["ok"] and f"metrics.listen: cannot listen on 127.0.0.1:{port}" in line["detail"]
