"""The inbound gate: what a delivery's size and headers say, before any frame is opened.

Owns :func:`gate`, shared by the worker's delivery path (its first three checks)
and the host's reply path. From the body length, the AMQP headers
and a lookup of the receiver's sessions by id it returns exactly one of:

* :class:`Refused`: dead-letter the delivery with ``reason`` (an error
  code); nothing else happens to it;
* :class:`Unrouted`: the headers are well-formed but no session of that id
  is known to the caller (the worker may be looking at an ``open_session``,
  a closed session or an unknown one; the host at a retired or unknown one);
* :class:`Routed`: the session the delivery names, its scope checked, with
  the delivery's key nonce; :attr:`Routed.nonce_matches` says whether that
  nonce is the session's own.

Two receivers, two orders (both fixed here, both fail closed):

* ``scope`` given (a worker queue serves one scope): size, ``octo-scope``
  present (else ``invalid_frame_headers``) and equal to ``scope``,
  ``octo-session`` a token, ``octo-key-nonce`` 64 lowercase hex, then the
  lookup;
* ``scope`` None (a host reply queue serves every scope): size,
  ``octo-session`` a token, the lookup (an unknown session stops here,
  without a nonce), then ``octo-scope`` equal to the routed session's scope
  and the nonce.

The gate never opens, decodes or authenticates a frame, never changes
state, never logs and never decides what a known session answers (a nonce
mismatch, a closed or an opening session are the caller's own status
rules). It does no I/O. The common outcomes allocate nothing beyond one
:class:`Routed` (refusals are shared constants).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

from octo_common.errors import InvalidFrameHeaders, ScopeMismatch, WireFrameTooLarge
from octo_common.limits import MAX_WIRE_FRAME_BYTES
from octo_common.peek import header_text
from octo_common.transport import HEADER_SCOPE, delivery_key_nonce, delivery_session_id

__all__ = [
    "FRAME_TOO_LARGE",
    "HEADERS_INVALID",
    "SCOPE_MISMATCH",
    "InboundSession",
    "Refused",
    "Routed",
    "Unrouted",
    "gate",
]


class InboundSession(Protocol):
    """What the gate reads of a receiver's session: its scope and key nonce."""

    @property
    def scope(self) -> str: ...

    @property
    def key_nonce(self) -> bytes: ...


SessionT = TypeVar("SessionT", bound=InboundSession)


@dataclass(frozen=True, slots=True)
class Refused:
    """Dead-letter the delivery; ``reason`` is the refusing error's code."""

    reason: str


@dataclass(frozen=True, slots=True)
class Unrouted:
    """Well-formed headers naming a session the caller does not hold.

    ``key_nonce`` is the checked header when the gate had a ``scope`` (the
    worker may open a session with it), None otherwise (the host checks a
    nonce only against a session it holds).
    """

    session_id: str
    key_nonce: bytes | None


@dataclass(frozen=True, slots=True)
class Routed(Generic[SessionT]):
    """The delivery belongs to ``session`` (scope checked); ``key_nonce`` is its header."""

    session: SessionT
    key_nonce: bytes

    @property
    def nonce_matches(self) -> bool:
        """Whether the delivery carries the session's own key nonce (else it cannot
        authenticate: the key derived from another nonce is another key)."""
        return self.key_nonce == self.session.key_nonce


FRAME_TOO_LARGE: Final = Refused(WireFrameTooLarge.code)
SCOPE_MISMATCH: Final = Refused(ScopeMismatch.code)
HEADERS_INVALID: Final = Refused(InvalidFrameHeaders.code)

_NO_HEADERS: Final[Mapping[str, object]] = {}


def gate(
    body_len: int,
    headers: Mapping[str, object] | None,
    lookup: Callable[[str], SessionT | None],
    *,
    scope: str | None = None,
) -> Routed[SessionT] | Unrouted | Refused:
    """Route one delivery, or refuse it (see the module docstring for the order).

    ``lookup`` maps a session id to the caller's session, or None; it is
    called at most once, only with a token. Header values may be ``str`` or
    ``bytes`` (as pamqp decodes them); any other type is malformed.
    """
    if body_len > MAX_WIRE_FRAME_BYTES:
        return FRAME_TOO_LARGE
    found = headers or _NO_HEADERS
    if scope is not None:
        named = header_text(found.get(HEADER_SCOPE))
        if named is None:
            return HEADERS_INVALID  # no scope header at all (or not text): not another scope's
        if named != scope:
            return SCOPE_MISMATCH
        session_id = delivery_session_id(found)
        if session_id is None:
            return HEADERS_INVALID
        key_nonce = delivery_key_nonce(found)
        if key_nonce is None:
            return HEADERS_INVALID
        session = lookup(session_id)
        if session is None:
            return Unrouted(session_id, key_nonce)
        return Routed(session, key_nonce)
    session_id = delivery_session_id(found)
    if session_id is None:
        return HEADERS_INVALID
    session = lookup(session_id)
    if session is None:
        return Unrouted(session_id, None)
    if header_text(found.get(HEADER_SCOPE)) != session.scope:
        return SCOPE_MISMATCH
    key_nonce = delivery_key_nonce(found)
    if key_nonce is None:
        return HEADERS_INVALID
    return Routed(session, key_nonce)
