"""The console's pure parts: bind rules, token comparison, shown commands, metric folding."""

from __future__ import annotations

import secrets
import shlex

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from octo_common.errors import ConsoleTlsRequired
from octo_worker.config import InvalidConfiguration
from octo_worker.console import security
from octo_worker.console.app import _age, _utc
from octo_worker.console.data import FILE, RUN, command
from octo_worker.console.live import LiveSnapshot, _fold, scrape_url
from octo_worker.console.security import (
    MIN_TOKEN_BITS,
    AccessToken,
    BindAddress,
    ConsoleSessions,
    check_bind,
    generate_token,
    host_of,
    is_loopback_host,
    parse_listen,
    token_bits,
)

TOKEN = "t" * 40


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:9465", "127.0.0.1", 9465),
        ("[::1]:80", "::1", 80),
        ("localhost:0", "localhost", 0),
    ],
)
def test_listen_addresses_parse(text: str, host: str, port: int) -> None:
    assert parse_listen(text, "--listen") == BindAddress(host, port)


@pytest.mark.parametrize("text", ["9465", ":9465", "127.0.0.1:", "127.0.0.1:http", "h:70000"])
def test_bad_listen_addresses_are_refused_naming_the_option(text: str) -> None:
    with pytest.raises(InvalidConfiguration, match="--listen: expected HOST:PORT"):
        parse_listen(text, "--listen")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.9.9", "::1", "localhost", "LOCALHOST"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "example.com", "localhost.evil", ""])
def test_other_hosts_are_not_loopback(host: str) -> None:
    assert not is_loopback_host(host)


def test_a_loopback_bind_needs_nothing() -> None:
    check_bind(BindAddress("127.0.0.1", 1), allow_remote=False, token_configured=False)


def test_a_remote_bind_needs_the_flag_and_a_token() -> None:
    remote = BindAddress("0.0.0.0", 9465)
    with pytest.raises(InvalidConfiguration, match="not a loopback address"):
        check_bind(remote, allow_remote=False, token_configured=True)
    with pytest.raises(InvalidConfiguration, match="needs an access token"):
        check_bind(remote, allow_remote=True, token_configured=False)
    with pytest.raises(ConsoleTlsRequired, match="needs TLS"):
        check_bind(remote, allow_remote=True, token_configured=True)
    check_bind(remote, allow_remote=True, token_configured=True, tls=True)
    check_bind(remote, allow_remote=True, token_configured=True, behind_proxy=True)


@pytest.mark.parametrize(
    "token",
    ["A" * 32, "AB" * 20, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefgh", "0" * 64, "0123" * 10],
)
def test_a_token_with_a_pattern_carries_under_128_bits(token: str) -> None:
    assert token_bits(token) < MIN_TOKEN_BITS


def test_generated_and_random_tokens_carry_128_bits_or_more() -> None:
    for _ in range(500):
        assert token_bits(generate_token()) >= MIN_TOKEN_BITS
        assert token_bits(secrets.token_hex(32)) >= MIN_TOKEN_BITS
    assert len({generate_token() for _ in range(100)}) == 100


def test_sessions_are_random_expire_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(security.time, "monotonic", lambda: clock[0])
    sessions = ConsoleSessions(60.0)
    first, second = sessions.issue(), sessions.issue()
    assert first != second and len(first) >= 43
    assert sessions.valid(first) and not sessions.valid("made-up") and not sessions.valid(None)
    clock[0] += 61.0
    assert not sessions.valid(first) and not sessions.valid(second)
    held = [sessions.issue() for _ in range(1100)]
    assert not sessions.valid(held[0]) and sessions.valid(held[-1])
    assert "1024" in repr(sessions) and held[-1] not in repr(sessions)


def test_the_token_compares_exactly() -> None:
    token = AccessToken(TOKEN)
    assert token.matches(TOKEN)
    assert not token.matches(TOKEN[:-1])
    assert not token.matches(TOKEN + "t")
    assert not token.matches(None)
    assert not token.matches("é" * 40)
    assert TOKEN not in repr(token)


@pytest.mark.parametrize(
    ("header", "host"),
    [
        ("localhost:8080", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:9465", "::1"),
        ("evil.example", "evil.example"),
        ("", None),
        (None, None),
    ],
)
def test_the_host_of_a_host_header(header: str | None, host: str | None) -> None:
    assert host_of(header) == host


def test_shown_commands_quote_every_value_for_the_shell_but_the_slots() -> None:
    hostile = "<script>alert(1)</script>; rm -rf ~ $(id)"
    line = command("octo-worker", "dlq", "drop", "--message-id", hostile, RUN, FILE)
    assert shlex.split(line) == [
        "octo-worker",
        "dlq",
        "drop",
        "--message-id",
        hostile,
        "RUN",
        "FILE",
    ]
    assert line.endswith(" RUN FILE")


def test_ages_and_times_read_as_an_operator_expects() -> None:
    assert _age(None) == "-"
    assert _age(9.7) == "9s"
    assert _age(125) == "2m 05s"
    assert _age(3 * 3600 + 60) == "3h 01m"
    assert _age(2 * 86400 + 7200) == "2d 02h"
    assert _utc(0) == "1970-01-01 00:00:00 UTC"
    assert _utc(None) == "-"


def test_metrics_fold_into_deliveries_by_scope_and_outcome() -> None:
    registry = CollectorRegistry()
    deliveries = Counter("octo_deliveries", "d", ["scope", "outcome"], registry=registry)
    rejected = Counter("octo_frames_rejected", "r", ["scope", "reason"], registry=registry)
    deliveries.labels("a", "acked").inc(3)
    deliveries.labels("a", "dead_lettered").inc()
    rejected.labels("a", "x" * 300).inc()
    folded = _fold(registry.collect(), LiveSnapshot("test", True))
    assert folded.deliveries == {"a": {"acked": 3.0, "dead_lettered": 1.0}}
    assert folded.rejected == {"a": {"x" * 128 + "...": 1.0}}  # a label is bounded
    # The text exposition (a scrape) folds the same way.
    text = "\n".join(
        [
            "# TYPE octo_deliveries counter",
            'octo_deliveries_total{scope="b",outcome="acked"} 7.0',
            "# TYPE octo_consumers_active gauge",
            "octo_consumers_active 2.0",
            "# TYPE octo_queue_messages gauge",
            'octo_queue_messages{queue="octo.v5.dead"} 3.0',
            "# TYPE octo_queue_consumers gauge",
            'octo_queue_consumers{queue="octo.v5.dead"} 0.0',
            'octo_queue_consumers{queue="octo.v5.worker.b"} 1.0',
        ]
    )
    scraped = _fold(text_string_to_metric_families(text), LiveSnapshot("scrape", True))
    assert scraped.deliveries == {"b": {"acked": 7.0}}
    assert scraped.consumers_active == 2.0
    # A queue that does not exist has a consumer count and no depth.
    assert scraped.queues == {
        "octo.v5.dead": {"messages": 3.0, "consumers": 0.0},
        "octo.v5.worker.b": {"consumers": 1.0},
    }


@pytest.mark.parametrize(
    ("listen", "url"),
    [
        ("127.0.0.1:9464", "http://127.0.0.1:9464/metrics"),
        ("0.0.0.0:9464", "http://127.0.0.1:9464/metrics"),
        ("[::]:9464", "http://[::1]:9464/metrics"),
        ("[::1]:9464", "http://[::1]:9464/metrics"),
    ],
)
def test_a_wildcard_metrics_address_is_scraped_on_loopback(listen: str, url: str) -> None:
    assert scrape_url(listen) == url
