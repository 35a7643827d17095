"""Every rule that depends on a worker session's status, as tables (W§10.5, W§10.9, W§12.2).

A session is ``open``, ``closed`` or ``poisoned``. Everything its status
decides lives here, as pure functions over small tables:

* :func:`route_known` and :func:`route_unknown`: what the daemon does with
  a delivery once the inbound gate (``octo_common.inbound``) has named a
  session held in memory, or a session id it does not hold (W§12.2 step 3);
* :func:`answer`: what a session answers to each authenticated frame type,
  new or duplicate, by status (W§10.5 step 4, W§10.7, W§10.9), once
  ``open()`` accepted it; a ``closed`` session opens nothing
  (:data:`CLOSED_REASON`, W§10.11 rule 9);
* :func:`after_handling`: what the daemon does once a delivery of a session
  is handled: reload the scope after a failed commit, let a closed session
  go (W§10.9 steps 3–5, W§11.4).

Everything that affects these decisions is here and nowhere else; the
session and the daemon only carry them out. No I/O, no state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from octo_common.errors import InvalidAuthenticationTag, InvalidFrameHeaders, SessionReplay
from octo_worker.session.request_kinds import KEYED_KINDS
from octo_worker.storage.documents import SessionStatus

__all__ = [
    "CLOSED_REASON",
    "HOST_REQUESTS",
    "KEYED_REQUESTS",
    "WORKER_MESSAGES",
    "AfterHandling",
    "Answer",
    "Route",
    "after_handling",
    "answer",
    "route_known",
    "route_unknown",
]

OPEN: Final[SessionStatus] = "open"
CLOSED: Final[SessionStatus] = "closed"
POISONED: Final[SessionStatus] = "poisoned"

# Requests a host sends that are answered (W§10.6, D9): refused, not dropped,
# in a poisoned session. Keyed ones (a row of the kind table each) name an
# operation key and a duplicate of one is answered from the journal (D5).
KEYED_REQUESTS: Final = frozenset(KEYED_KINDS)
HOST_REQUESTS: Final = KEYED_REQUESTS | {"invoke", "cancel"}
# What only a worker sends: a host never may (UnexpectedMessage).
WORKER_MESSAGES: Final = frozenset(
    {
        "result",
        "operation_result",
        "compensation_result",
        "reconciled_operation",
        "reconciled_compensation",
        "cancellation_result",
        "request_rejected",
    }
)

CLOSED_REASON: Final = "session_closed"


# The daemon's routing (W§12.2 step 3) --------------------------------------------------


class Route(enum.Enum):
    """What the daemon does with a delivery after the inbound gate."""

    HANDLE = "handle"  # session.handle (which opens the frame)
    OPEN = "open"  # WorkerSession.open from this open_session
    LOOK_UP = "look_up"  # ask the store whether the session is closed or unknown
    SESSION_REPLAY = SessionReplay.code
    SESSION_CLOSED = CLOSED_REASON
    INVALID_TAG = InvalidAuthenticationTag.code
    INVALID_HEADERS = InvalidFrameHeaders.code

    @property
    def dead_letter(self) -> bool:
        """Whether this route dead-letters with ``value`` as the reason."""
        return self not in _ACTING


_ACTING: Final = frozenset({Route.HANDLE, Route.OPEN, Route.LOOK_UP})


def route_known(status: SessionStatus, opening: bool, nonce_matches: bool) -> Route:
    """A delivery for a session held in memory.

    An ``open_session`` is handled only by an open or poisoned session with
    its own nonce (a redelivered opening is then a duplicate; an authentic
    new one is ``SessionReplay``); any other is a replay. A closed session
    dead-letters the frame itself once its close is durable (W§10.11 rule 9),
    whatever the nonce. Another nonce cannot authenticate.
    """
    if opening:
        return Route.HANDLE if status != CLOSED and nonce_matches else Route.SESSION_REPLAY
    if status == CLOSED:
        return Route.HANDLE
    return Route.HANDLE if nonce_matches else Route.INVALID_TAG


def route_unknown(opening: bool, closed: bool, reply_queue: bool) -> Route:
    """A delivery for a session id not held in memory.

    ``closed``: the id is remembered as closed. ``reply_queue``: the
    delivery's ``reply_to`` is a host reply queue (checked only for an
    opening: every reply of the session goes there, W§12.1).
    """
    if closed:
        return Route.SESSION_REPLAY if opening else Route.SESSION_CLOSED
    if not opening:
        return Route.LOOK_UP
    return Route.OPEN if reply_queue else Route.INVALID_HEADERS


# What a session answers (W§10.5 step 4, W§10.7, W§10.9) ---------------------------------


class Answer(enum.Enum):
    """What a session does with an authenticated frame."""

    REQUEST = "request"  # its W§10.6 handler (invoke and the keyed kinds)
    FROM_JOURNAL = "from_journal"  # a duplicate keyed request: the stored state (D5)
    CLOSE = "close"  # status closed, commit, ack
    DROP = "drop"  # ack; no reply, no commit
    REFUSE_POISONED = "refuse_poisoned"  # session_poisoned, best effort, no commit
    REFUSE_UNSUPPORTED = "refuse_unsupported"  # cancel (D9)
    REPLAY = "replay"  # commit the window, dead-letter session_replay
    UNEXPECTED = "unexpected"  # commit the window, dead-letter unexpected_message


_OPEN_NEW: Final[Mapping[str, Answer]] = {
    **{kind: Answer.REQUEST for kind in KEYED_REQUESTS | {"invoke"}},
    "close_session": Answer.CLOSE,
    "cancel": Answer.REFUSE_UNSUPPORTED,
    "open_session": Answer.REPLAY,
    **{kind: Answer.UNEXPECTED for kind in WORKER_MESSAGES},
}


def answer(status: SessionStatus, kind: str, duplicate: bool) -> Answer:
    """What a session whose ``open()`` accepted a frame of type ``kind`` does with it.

    Poisoned: every host request, duplicate or not, is refused best-effort,
    ``close_session`` closes, anything else is dropped. Open: a duplicate is
    answered from the journal when keyed, else dropped; a new frame goes to
    its handler, ``cancel`` is unsupported, ``open_session`` is a replay and
    a worker's own message type is unexpected. A message type not known
    here is unexpected. (A closed session never gets here.)
    """
    if status == POISONED:
        if kind == "close_session":
            return Answer.CLOSE
        return Answer.REFUSE_POISONED if kind in HOST_REQUESTS else Answer.DROP
    if duplicate:
        return Answer.FROM_JOURNAL if kind in KEYED_REQUESTS else Answer.DROP
    return _OPEN_NEW.get(kind, Answer.UNEXPECTED)


# After a delivery (W§10.9 steps 3-5, W§11.4) ----------------------------------------------


class AfterHandling(enum.Enum):
    """What the daemon does once a delivery of a session is handled."""

    NOTHING = "nothing"
    RELOAD = "reload"  # a commit failed: pause, drain, fence, reload the scope
    LET_GO = "let_go"  # closed, last handler: release its outbox rows, hold it by id


def after_handling(status: SessionStatus, commit_failed: bool, last_handler: bool) -> AfterHandling:
    """``commit_failed``: a commit of this session failed since it was loaded
    (a session restored as ``poisoned`` has none). ``last_handler``: no other
    delivery of the session is being handled."""
    if status == CLOSED:
        return AfterHandling.LET_GO if last_handler else AfterHandling.NOTHING
    if status == POISONED and commit_failed:
        return AfterHandling.RELOAD
    return AfterHandling.NOTHING
