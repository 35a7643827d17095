"""What a worker session answers, by its status, as tables.

A session is ``open``, ``closed`` or ``poisoned``. :func:`refused_delivery`
says whether a session takes a delivery the inbound gate routed to it at
all (its own nonce; an ``open_session`` only as a duplicate).
:func:`answer` says what a session answers to each authenticated frame
type, new or duplicate, by status, once ``open()`` accepted it; a
``closed`` session opens nothing (:data:`CLOSED_REASON`). What the daemon
does for a session it does not hold, and what follows a handling, is
:mod:`octo_worker.daemon.routes`.

Everything that affects these answers is here and nowhere else; the
session only carries them out. No I/O, no state.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from octo_common.errors import InvalidAuthenticationTag, SessionReplay
from octo_worker.session.request_kinds import KEYED_KINDS
from octo_worker.storage.documents import SessionStatus

__all__ = [
    "CLOSED_REASON",
    "HOST_REQUESTS",
    "KEYED_REQUESTS",
    "WORKER_MESSAGES",
    "Answer",
    "answer",
    "refused_delivery",
]

OPEN: Final[SessionStatus] = "open"
CLOSED: Final[SessionStatus] = "closed"
POISONED: Final[SessionStatus] = "poisoned"

# Requests a host sends that are answered: refused, not dropped,
# in a poisoned session. Keyed ones (a row of the kind table each) name an
# operation key and a duplicate of one is answered from the journal.
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


# Whether a session takes a delivery at all ---------------------------------------------


def refused_delivery(status: SessionStatus, opening: bool, nonce_matches: bool) -> str | None:
    """Why a session held in memory refuses a delivery before opening its frame (the
    dead-letter reason), or None: it handles it.

    An ``open_session`` is handled only by an open or poisoned session with
    its own nonce (a redelivered opening is then a duplicate; an authentic
    new one is ``session_replay``); any other is a replay. A closed session
    dead-letters the frame itself once its close is durable, whatever the
    nonce. Another nonce cannot authenticate.
    """
    if opening:
        return None if status != CLOSED and nonce_matches else SessionReplay.code
    if status == CLOSED or nonce_matches:
        return None
    return InvalidAuthenticationTag.code


# What a session answers ------------------------------------------------------------------


class Answer(enum.Enum):
    """What a session does with an authenticated frame."""

    REQUEST = "request"  # its decisions (invoke and the keyed kinds)
    FROM_JOURNAL = "from_journal"  # a duplicate keyed request: the stored state
    CLOSE = "close"  # status closed, commit, ack
    DROP = "drop"  # ack; no reply, no commit
    REFUSE_POISONED = "refuse_poisoned"  # session_poisoned, best effort, no commit
    REFUSE_UNSUPPORTED = "refuse_unsupported"  # cancel
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
