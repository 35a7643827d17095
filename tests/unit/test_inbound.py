"""The inbound gate (octo_common.inbound): one row per outcome, in both receivers' orders."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from octo_common.inbound import (
    FRAME_TOO_LARGE,
    HEADERS_INVALID,
    SCOPE_MISMATCH,
    Refused,
    Routed,
    Unrouted,
    gate,
)
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.transport import HEADER_KEY_NONCE, HEADER_SCOPE, HEADER_SESSION

SCOPE = "tenant-a"
NONCE = bytes(range(32))
OTHER_NONCE = bytes(range(1, 33))


@dataclass(frozen=True)
class FakeSession:
    scope: str
    key_nonce: bytes


def headers(**overrides: object) -> dict[str, object]:
    found: dict[str, object] = {
        HEADER_SCOPE: SCOPE,
        HEADER_SESSION: "sess-1",
        HEADER_KEY_NONCE: NONCE.hex(),
    }
    for name, value in overrides.items():
        key = {"scope": HEADER_SCOPE, "session": HEADER_SESSION, "nonce": HEADER_KEY_NONCE}[name]
        if value is None:
            del found[key]
        else:
            found[key] = value
    return found


class Lookup:
    """A session table that records every id it was asked for."""

    def __init__(self, sessions: dict[str, FakeSession]) -> None:
        self.sessions = sessions
        self.asked: list[str] = []

    def __call__(self, session_id: str) -> FakeSession | None:
        self.asked.append(session_id)
        return self.sessions.get(session_id)


KNOWN = FakeSession(SCOPE, NONCE)


# The worker's order: a queue serves one scope --------------------------------------


def test_worker_routes_a_known_session_with_its_nonce() -> None:
    lookup = Lookup({"sess-1": KNOWN})
    routed = gate(10, headers(), lookup, scope=SCOPE)
    assert routed == Routed(KNOWN, NONCE)
    assert isinstance(routed, Routed) and routed.nonce_matches
    assert lookup.asked == ["sess-1"]


def test_worker_routes_another_nonce_and_says_it_does_not_match() -> None:
    routed = gate(10, headers(nonce=OTHER_NONCE.hex()), Lookup({"sess-1": KNOWN}), scope=SCOPE)
    assert isinstance(routed, Routed)
    assert routed.key_nonce == OTHER_NONCE
    assert not routed.nonce_matches


def test_worker_unknown_session_is_unrouted_with_its_checked_nonce() -> None:
    lookup = Lookup({})
    assert gate(10, headers(), lookup, scope=SCOPE) == Unrouted("sess-1", NONCE)
    assert lookup.asked == ["sess-1"]


@pytest.mark.parametrize(
    ("size", "found", "refusal"),
    [
        (MAX_WIRE_FRAME_BYTES + 1, None, FRAME_TOO_LARGE),
        (MAX_WIRE_FRAME_BYTES + 1, headers(), FRAME_TOO_LARGE),
        # No headers, or no scope header: malformed, not another scope's frame.
        (10, None, HEADERS_INVALID),
        (10, {}, HEADERS_INVALID),
        (10, headers(scope=None), HEADERS_INVALID),
        (10, headers(scope=7), HEADERS_INVALID),
        (10, headers(scope="tenant-b"), SCOPE_MISMATCH),
        # The scope is checked before a malformed session and nonce.
        (10, headers(scope="tenant-b", session="NOT A TOKEN", nonce="zz"), SCOPE_MISMATCH),
        (10, headers(session=None), HEADERS_INVALID),
        (10, headers(session="Sess"), HEADERS_INVALID),
        (10, headers(session=b"\xff"), HEADERS_INVALID),
        (10, headers(nonce=None), HEADERS_INVALID),
        (10, headers(nonce=NONCE.hex().upper()), HEADERS_INVALID),
        (10, headers(nonce=NONCE), HEADERS_INVALID),
    ],
)
def test_worker_refusals_come_before_any_lookup(
    size: int, found: dict[str, object] | None, refusal: Refused
) -> None:
    lookup = Lookup({"sess-1": KNOWN})
    assert gate(size, found, lookup, scope=SCOPE) is refusal
    assert lookup.asked == []


def test_refusal_reasons_are_the_error_codes() -> None:
    assert FRAME_TOO_LARGE.reason == "wire_frame_too_large"
    assert SCOPE_MISMATCH.reason == "scope_mismatch"
    assert HEADERS_INVALID.reason == "invalid_frame_headers"


def test_a_body_of_exactly_the_bound_passes() -> None:
    assert isinstance(
        gate(MAX_WIRE_FRAME_BYTES, headers(), Lookup({"sess-1": KNOWN}), scope=SCOPE), Routed
    )


def test_header_values_may_be_bytes() -> None:
    found = headers(scope=SCOPE.encode(), session=b"sess-1", nonce=NONCE.hex().encode())
    assert gate(10, found, Lookup({"sess-1": KNOWN}), scope=SCOPE) == Routed(KNOWN, NONCE)


# The host's order: one reply queue serves every scope ------------------------------


def test_host_routes_a_known_session_after_checking_its_scope() -> None:
    lookup = Lookup({"sess-1": KNOWN})
    assert gate(10, headers(), lookup) == Routed(KNOWN, NONCE)
    assert lookup.asked == ["sess-1"]


def test_host_unknown_session_stops_before_scope_and_nonce() -> None:
    lookup = Lookup({})
    found = headers(scope="tenant-b", nonce="zz")
    assert gate(10, found, lookup) == Unrouted("sess-1", None)
    assert lookup.asked == ["sess-1"]


def test_host_checks_the_scope_of_the_session_it_found() -> None:
    other = FakeSession("tenant-b", NONCE)
    assert gate(10, headers(), Lookup({"sess-1": other})) is SCOPE_MISMATCH
    assert gate(10, headers(scope="tenant-b"), Lookup({"sess-1": other})) == Routed(other, NONCE)


@pytest.mark.parametrize(
    ("size", "found", "refusal", "asked"),
    [
        (MAX_WIRE_FRAME_BYTES + 1, headers(), FRAME_TOO_LARGE, []),
        (10, headers(session=None), HEADERS_INVALID, []),
        (10, headers(session="s s"), HEADERS_INVALID, []),
        (10, None, HEADERS_INVALID, []),
        (10, headers(scope=None), SCOPE_MISMATCH, ["sess-1"]),
        (10, headers(nonce="g" * 64), HEADERS_INVALID, ["sess-1"]),
        (10, headers(nonce=None), HEADERS_INVALID, ["sess-1"]),
    ],
)
def test_host_refusals_in_order(
    size: int, found: dict[str, object] | None, refusal: Refused, asked: list[str]
) -> None:
    lookup = Lookup({"sess-1": KNOWN})
    assert gate(size, found, lookup) is refusal
    assert lookup.asked == asked


def test_host_a_mismatched_nonce_is_routed_for_the_caller_to_refuse() -> None:
    routed = gate(10, headers(nonce=OTHER_NONCE.hex()), Lookup({"sess-1": KNOWN}))
    assert isinstance(routed, Routed)
    assert not routed.nonce_matches
