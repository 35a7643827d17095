"""The session-status rules (octo_worker.session.rules, octo_worker.daemon.routes), row by row."""

from __future__ import annotations

import pytest

from octo_common.messages import _MESSAGE_TYPES
from octo_worker.daemon.routes import (
    AfterHandling,
    Route,
    after_handling,
    route_unknown,
)
from octo_worker.session.request_kinds import KEYED_KINDS, KEYED_MESSAGES
from octo_worker.session.rules import (
    CLOSED_REASON,
    HOST_REQUESTS,
    KEYED_REQUESTS,
    WORKER_MESSAGES,
    Answer,
    answer,
    refused_delivery,
)

ALL_TYPES = sorted(str(cls.__struct_config__.tag) for cls in _MESSAGE_TYPES)


# The routing: a known session's (session rules), an unknown one's (daemon routes) --------


@pytest.mark.parametrize(
    ("status", "opening", "nonce_matches", "route"),
    [
        ("open", False, True, Route.HANDLE),
        ("open", False, False, Route.INVALID_TAG),
        ("poisoned", False, True, Route.HANDLE),
        ("poisoned", False, False, Route.INVALID_TAG),
        # A closed session dead-letters the frame itself, once its close is durable.
        ("closed", False, True, Route.HANDLE),
        ("closed", False, False, Route.HANDLE),
        # An open_session: a duplicate (or an authentic replay) for the session itself.
        ("open", True, True, Route.HANDLE),
        ("poisoned", True, True, Route.HANDLE),
        ("open", True, False, Route.SESSION_REPLAY),
        ("poisoned", True, False, Route.SESSION_REPLAY),
        ("closed", True, True, Route.SESSION_REPLAY),
        ("closed", True, False, Route.SESSION_REPLAY),
    ],
)
def test_a_known_session_takes_or_refuses_a_delivery(
    status: str, opening: bool, nonce_matches: bool, route: Route
) -> None:
    reason = refused_delivery(status, opening, nonce_matches)  # type: ignore[arg-type]
    assert reason == (None if route is Route.HANDLE else route.value)


@pytest.mark.parametrize(
    ("opening", "closed", "reply_queue", "route"),
    [
        (True, False, True, Route.OPEN),
        (True, False, False, Route.INVALID_HEADERS),
        (True, True, True, Route.SESSION_REPLAY),
        (True, True, False, Route.SESSION_REPLAY),
        (False, False, True, Route.LOOK_UP),
        (False, False, False, Route.LOOK_UP),
        (False, True, True, Route.SESSION_CLOSED),
        (False, True, False, Route.SESSION_CLOSED),
    ],
)
def test_route_unknown(opening: bool, closed: bool, reply_queue: bool, route: Route) -> None:
    assert route_unknown(opening, closed, reply_queue) is route


def test_dead_letter_routes_carry_their_reason_code() -> None:
    reasons = {route.value for route in Route if route.dead_letter}
    assert reasons == {
        "session_replay",
        CLOSED_REASON,
        "invalid_authentication_tag",
        "invalid_frame_headers",
    }
    assert not any(route.dead_letter for route in (Route.HANDLE, Route.OPEN, Route.LOOK_UP))


# What a session answers ---------------------------------


OPEN_NEW = {
    "invoke": Answer.REQUEST,
    "dispatch_operation": Answer.REQUEST,
    "compensate_operation": Answer.REQUEST,
    "reconcile_operation": Answer.REQUEST,
    "reconcile_compensation": Answer.REQUEST,
    "close_session": Answer.CLOSE,
    "cancel": Answer.REFUSE_UNSUPPORTED,
    "open_session": Answer.REPLAY,
    "result": Answer.UNEXPECTED,
    "operation_result": Answer.UNEXPECTED,
    "compensation_result": Answer.UNEXPECTED,
    "reconciled_operation": Answer.UNEXPECTED,
    "reconciled_compensation": Answer.UNEXPECTED,
    "cancellation_result": Answer.UNEXPECTED,
    "request_rejected": Answer.UNEXPECTED,
}

OPEN_DUPLICATE = {
    "dispatch_operation": Answer.FROM_JOURNAL,
    "compensate_operation": Answer.FROM_JOURNAL,
    "reconcile_operation": Answer.FROM_JOURNAL,
    "reconcile_compensation": Answer.FROM_JOURNAL,
}

POISONED = {
    "invoke": Answer.REFUSE_POISONED,
    "dispatch_operation": Answer.REFUSE_POISONED,
    "compensate_operation": Answer.REFUSE_POISONED,
    "reconcile_operation": Answer.REFUSE_POISONED,
    "reconcile_compensation": Answer.REFUSE_POISONED,
    "cancel": Answer.REFUSE_POISONED,
    "close_session": Answer.CLOSE,
}


def test_the_tables_cover_every_message_type() -> None:
    assert set(OPEN_NEW) == set(ALL_TYPES)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_open_session_new_frame(kind: str) -> None:
    assert answer("open", kind, duplicate=False) is OPEN_NEW[kind]


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_open_session_duplicate_frame(kind: str) -> None:
    assert answer("open", kind, duplicate=True) is OPEN_DUPLICATE.get(kind, Answer.DROP)


@pytest.mark.parametrize("duplicate", [False, True])
@pytest.mark.parametrize("kind", ALL_TYPES)
def test_poisoned_session(kind: str, duplicate: bool) -> None:
    assert answer("poisoned", kind, duplicate) is POISONED.get(kind, Answer.DROP)


def test_an_unknown_type_is_unexpected_in_an_open_session() -> None:
    assert answer("open", "no_such_type", duplicate=False) is Answer.UNEXPECTED
    assert answer("open", "no_such_type", duplicate=True) is Answer.DROP
    assert answer("poisoned", "no_such_type", duplicate=False) is Answer.DROP


def test_keyed_requests_are_the_rows_of_the_kind_table() -> None:
    assert frozenset(KEYED_KINDS) == KEYED_REQUESTS
    assert {message_type_of(cls) for cls in KEYED_MESSAGES} == set(KEYED_REQUESTS)
    assert all(KEYED_MESSAGES[cls] is KEYED_KINDS[message_type_of(cls)] for cls in KEYED_MESSAGES)
    assert KEYED_REQUESTS < HOST_REQUESTS
    assert not HOST_REQUESTS & WORKER_MESSAGES


def message_type_of(cls: type) -> str:
    return str(cls.__struct_config__.tag)  # type: ignore[attr-defined]


# After a delivery (poisoning, reload) ----------------------------------------------


@pytest.mark.parametrize(
    ("status", "commit_failed", "last_handler", "after"),
    [
        ("open", False, True, AfterHandling.NOTHING),
        ("open", False, False, AfterHandling.NOTHING),
        # A commit of the session failed: the scope is reloaded.
        ("poisoned", True, True, AfterHandling.RELOAD),
        ("poisoned", True, False, AfterHandling.RELOAD),
        # Restored as poisoned, no commit failed since: its refusals are committed
        # like any, nothing is left to persist afterwards.
        ("poisoned", False, True, AfterHandling.NOTHING),
        ("poisoned", False, False, AfterHandling.NOTHING),
        ("closed", False, True, AfterHandling.LET_GO),
        ("closed", False, False, AfterHandling.NOTHING),
        # Closed after a failed commit: nothing of it commits any more.
        ("closed", True, True, AfterHandling.LET_GO),
        ("closed", True, False, AfterHandling.NOTHING),
    ],
)
def test_after_handling(
    status: str, commit_failed: bool, last_handler: bool, after: AfterHandling
) -> None:
    assert after_handling(status, commit_failed, last_handler) is after  # type: ignore[arg-type]


def test_the_daemon_does_three_things_after_a_handling() -> None:
    assert {rule.value for rule in AfterHandling} == {"nothing", "reload", "let_go"}
