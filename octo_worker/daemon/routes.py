"""What the daemon does by a session's status, as tables.

* :func:`route_unknown`: what the daemon does with a delivery once the
  inbound gate (``octo_common.inbound``) has named a session id it does not
  hold (a session held in memory takes or refuses the delivery itself:
  ``octo_worker.session.rules.refused_delivery``);
* :func:`after_handling`: what the daemon does once a delivery of a session
  is handled (over what ``WorkerSession.handle`` returned): reload the
  scope after a failed commit, let a closed session go.

Everything that affects these decisions is here and nowhere else; the
delivery path only carries them out. No I/O, no state.
"""

from __future__ import annotations

import enum
from typing import Final

from octo_common.errors import InvalidAuthenticationTag, InvalidFrameHeaders, SessionReplay
from octo_worker.session.rules import CLOSED, CLOSED_REASON, POISONED
from octo_worker.storage.documents import SessionStatus

__all__ = ["AfterHandling", "Route", "after_handling", "route_unknown"]


# The daemon's routing --------------------------------------------------


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


def route_unknown(opening: bool, closed: bool, reply_queue: bool) -> Route:
    """A delivery for a session id not held in memory.

    ``closed``: the id is remembered as closed. ``reply_queue``: the
    delivery's ``reply_to`` is a host reply queue (checked only for an
    opening: every reply of the session goes there).
    """
    if closed:
        return Route.SESSION_REPLAY if opening else Route.SESSION_CLOSED
    if not opening:
        return Route.LOOK_UP
    return Route.OPEN if reply_queue else Route.INVALID_HEADERS


# After a delivery (a poisoned session: reload the scope) ----------------------------


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
