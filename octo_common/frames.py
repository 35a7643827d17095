"""Keys, sealed frames and the replay window.

A frame is ``{"sequence":N,"message":{...},"auth_tag":"<64 hex>"}``; its tag
is keyed BLAKE3 over the compact tag-input object, built from the parsed
message model (never from the received bytes). ``SessionAuthenticator``
seals with a counter and opens through a sliding anti-replay window; nothing
changes on any error. Keys are never printed, pickled, copied or serialised.
"""

from __future__ import annotations

import enum
import hmac
import os
import secrets
from typing import Annotated, Any, Final, NoReturn

import blake3
import msgspec

from octo_common._struct import is_validated, mark_validated
from octo_common.codec import convert_tree, decode_fast, encode_struct, parse_tree
from octo_common.digest import FRAME_AUTH_DOMAIN, SESSION_KEY_CONTEXT, derive_key, keyed_blake3, lp
from octo_common.errors import (
    DuplicateFrame,
    FrameDecryptionFailed,
    InvalidAuthenticationTag,
    InvalidAuthenticatorState,
    InvalidKeyNonce,
    InvalidScopeKey,
    InvalidSequence,
    InvalidSessionKeyLength,
    OctoError,
    SequenceExhausted,
    SerializationError,
    StaleFrame,
    UnknownSession,
    WeakSessionKey,
    WireFrameTooLarge,
)
from octo_common.framecipher import FrameCipher, is_envelope
from octo_common.ids import is_fingerprint, validate_token
from octo_common.keyfile import KeyFileRefused, read_key_file
from octo_common.limits import (
    KEY_NONCE_BYTES,
    MAX_SEQUENCE,
    MAX_WIRE_FRAME_BYTES,
    REPLAY_WINDOW_SIZE,
    SCOPE_KEY_BYTES,
    SESSION_KEY_BYTES,
)
from octo_common.messages import OpenSession, WorkerMessage, session_id_of, validate_message

__all__ = [
    "AuthenticatorState",
    "ScopeKey",
    "SessionAuthenticator",
    "SessionKey",
    "SessionRole",
    "decode_frame",
    "encode_frame",
]

_ZERO_KEY: Final = bytes(32)
_WINDOW_MASK: Final = (1 << REPLAY_WINDOW_SIZE) - 1
# KeyFileRefused.reason -> InvalidScopeKey.reason (which has three reasons).
_SCOPE_KEY_REASONS: Final[dict[str, str]] = {
    "missing": "unreadable",
    "unopenable": "unreadable",
    "unreadable": "unreadable",
    "not_regular": "permissions",
    "permissions": "permissions",
    "owner": "permissions",
    "directory": "permissions",
    "format": "format",
}


def _refuse_copy(self: Any, *args: Any) -> NoReturn:
    raise TypeError(f"{type(self).__name__} cannot be copied, pickled or serialised")


class _SecretBytes:
    """32 secret bytes owned by one object; never shown, pickled or copied."""

    __slots__ = ("_key",)
    _key: bytes

    def __init__(self, key: bytes) -> None:
        object.__setattr__(self, "_key", bytes(key))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"{type(self).__name__}([redacted])"

    __str__ = __repr__
    __reduce__ = _refuse_copy
    __reduce_ex__ = _refuse_copy
    __copy__ = _refuse_copy
    __deepcopy__ = _refuse_copy
    __getstate__ = _refuse_copy

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return hmac.compare_digest(self._key, other._key)

    def __hash__(self) -> int:
        return hash((type(self).__name__, keyed_blake3(self._key, b"hash")))

    def expose(self) -> bytes:
        """The raw key, for the cryptographic call that needs it. Never log it."""
        return self._key


class ScopeKey(_SecretBytes):
    """A tenant scope's 32-byte pre-shared key."""

    __slots__ = ()

    @classmethod
    def from_bytes(cls, data: bytes) -> ScopeKey:
        if not isinstance(data, bytes | bytearray) or len(data) != SCOPE_KEY_BYTES:
            raise InvalidScopeKey("length")
        if bytes(data) == _ZERO_KEY:
            raise InvalidScopeKey("weak")
        return cls(bytes(data))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ScopeKey:
        """A regular file (not a link) with no permissions for group or others.

        Content: exactly 32 raw bytes, or 64 lowercase hex characters and one
        optional newline (the rule of :mod:`octo_common.keyfile`). The key
        never appears in an error.
        """
        try:
            data = read_key_file(path)
        except KeyFileRefused as refused:
            raise InvalidScopeKey(_SCOPE_KEY_REASONS[refused.reason]) from None
        return cls.from_bytes(data)


class SessionKey(_SecretBytes):
    """A session's 32-byte frame key."""

    __slots__ = ()

    @classmethod
    def from_bytes(cls, data: bytes) -> SessionKey:
        if not isinstance(data, bytes | bytearray) or len(data) != SESSION_KEY_BYTES:
            raise InvalidSessionKeyLength(
                len(data) if isinstance(data, bytes | bytearray) else -1, SESSION_KEY_BYTES
            )
        if bytes(data) == _ZERO_KEY:
            raise WeakSessionKey()
        return cls(bytes(data))

    @classmethod
    def generate(cls) -> SessionKey:
        """A random key, for tests and tools; deployed sessions use ``derive``."""
        while True:
            data = secrets.token_bytes(SESSION_KEY_BYTES)
            if data != _ZERO_KEY:
                return cls(data)

    @classmethod
    def derive(
        cls, scope_key: ScopeKey, tenant_scope: str, session_id: str, key_nonce: bytes
    ) -> SessionKey:
        """BLAKE3 derive_key over scope key ‖ LP(scope) ‖ LP(session) ‖ nonce."""
        validate_token("tenant scope", tenant_scope)
        validate_token("session id", session_id)
        if not isinstance(key_nonce, bytes | bytearray) or len(key_nonce) != KEY_NONCE_BYTES:
            raise InvalidKeyNonce()
        if not isinstance(scope_key, ScopeKey):
            raise InvalidScopeKey("type")
        material = (
            scope_key.expose()
            + lp(tenant_scope.encode("utf-8"))
            + lp(session_id.encode("utf-8"))
            + bytes(key_nonce)
        )
        return cls.from_bytes(derive_key(SESSION_KEY_CONTEXT, material))


class SessionRole(enum.StrEnum):
    """Who seals a frame: the sender's role is inside every tag."""

    HOST = "host"
    WORKER = "worker"

    def peer(self) -> SessionRole:
        return SessionRole.WORKER if self is SessionRole.HOST else SessionRole.HOST


class AuthenticatorState(msgspec.Struct, frozen=True):
    """Exported authenticator state: ``inbound_seen`` is the window bitmap."""

    next_outgoing: int
    inbound_highest: int
    inbound_seen: int


# Frame encoding --------------------------------------------------------------


class _Frame(msgspec.Struct, frozen=True):
    sequence: Annotated[int, msgspec.Meta(ge=0)]
    message: WorkerMessage
    auth_tag: str


_TAG_DOMAIN_HEAD = (
    b'{"domain":"' + FRAME_AUTH_DOMAIN.encode() + b'","protocol_version":5,"sender":"'
)


def _tag_head(sender: str, sequence: int, session_id: str) -> bytes:
    """The tag input up to the message (session ids are tokens: no escaping)."""
    return b"".join(
        (
            _TAG_DOMAIN_HEAD,
            sender.encode(),
            b'","sequence":',
            str(sequence).encode(),
            b',"session_id":"',
            session_id.encode(),
            b'","message":',
        )
    )


def _tag_input(sender: str, sequence: int, session_id: str, message_bytes: bytes) -> bytes:
    """The whole tag input P."""
    return _tag_head(sender, sequence, session_id) + message_bytes + b"}"


_FRAME_HEAD = len(b'{"sequence":') + len(b',"message":')
_FRAME_TAIL = len(b',"auth_tag":"') + 64 + len(b'"}')


def _frame_bytes(sequence: int, message_bytes: bytes, tag_hex: str) -> bytes:
    return b"".join(
        (
            b'{"sequence":',
            str(sequence).encode(),
            b',"message":',
            message_bytes,
            b',"auth_tag":"',
            tag_hex.encode(),
            b'"}',
        )
    )


def _validate_syntax(frame: _Frame) -> None:
    """Sequence 0, then the message, then the tag syntax."""
    if frame.sequence == 0:
        raise InvalidSequence()
    if frame.sequence > MAX_SEQUENCE:
        raise SerializationError("sequence out of range")
    validate_message(frame.message)
    if not is_fingerprint(frame.auth_tag):
        raise InvalidAuthenticationTag()


def decode_frame(data: bytes) -> tuple[int, WorkerMessage, str, bytes]:
    """Decode and syntax-check a frame: ``(sequence, message, tag, message bytes)``.

    Decoding proves nothing; only ``SessionAuthenticator.open`` authenticates.
    The message bytes are the compact re-encoding the tag covers.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SerializationError("frame must be bytes")
    raw = bytes(data)
    if len(raw) > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(len(raw), MAX_WIRE_FRAME_BYTES)
    frame = decode_fast(raw, _Frame)
    if frame is not None:
        # Canonical input: the message bytes are exactly the middle of the frame.
        message_bytes = raw[_FRAME_HEAD + len(str(frame.sequence)) : -_FRAME_TAIL]
    else:
        tree = parse_tree(raw)
        frame = convert_tree(tree, _Frame)
        if frame.sequence > MAX_SEQUENCE:
            raise SerializationError("sequence out of range")
        message_bytes = b""
    _validate_syntax(frame)
    if not message_bytes:
        message_bytes = encode_struct(frame.message)
    return frame.sequence, frame.message, frame.auth_tag, message_bytes


def encode_frame(sequence: int, message: WorkerMessage, auth_tag: str) -> bytes:
    """Validate the syntax, encode compactly, bound the length."""
    frame = _Frame(sequence, message, auth_tag)
    _validate_syntax(frame)
    data = _frame_bytes(sequence, encode_struct(message), auth_tag)
    if len(data) > MAX_WIRE_FRAME_BYTES:
        raise WireFrameTooLarge(len(data), MAX_WIRE_FRAME_BYTES)
    return data


# The authenticator --------------------------------------------------------------


class SessionAuthenticator:
    """Seals and opens the frames of one session for one role."""

    __slots__ = (
        "_cipher",
        "_highest",
        "_key",
        "_next_outgoing",
        "_role",
        "_seen",
        "_session_id",
    )

    def __init__(self, session_id: str, key: SessionKey, role: SessionRole) -> None:
        validate_token("session id", session_id)
        if not isinstance(key, SessionKey):
            raise InvalidSessionKeyLength(-1, SESSION_KEY_BYTES)
        self._session_id = session_id
        self._key = key
        self._role = SessionRole(role)
        self._next_outgoing = 1
        self._highest = 0
        self._seen = 0
        self._cipher: FrameCipher | None = None

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def payload_codec(self) -> bool:
        """Whether frames travel encrypted (see :mod:`octo_common.framecipher`)."""
        return self._cipher is not None

    def use_payload_codec(self) -> None:
        """From now on every frame sealed is enveloped and every frame opened must be.

        Called once the session's ``open_session`` (never enveloped) named the
        codec: by the host after sealing it, by the worker after opening it.
        There is no way back for this authenticator.
        """
        if self._cipher is None:
            self._cipher = FrameCipher(self._key.expose(), self._session_id)

    def unwrap(self, body: bytes) -> bytes:
        """The frame inside ``body`` (``body`` itself without the codec).

        ``FrameDecryptionFailed`` for anything but an envelope of the peer's
        that decrypts, or the session's ``open_session`` (never enveloped; a
        redelivered copy is then opened as the duplicate it is); nothing
        changes. Only :meth:`open` authenticates what this returns.
        """
        if self._cipher is None:
            return body
        if not is_envelope(body):
            try:
                _, message, _, _ = decode_frame(body)
            except OctoError:
                raise FrameDecryptionFailed() from None
            if isinstance(message, OpenSession):
                return body
            raise FrameDecryptionFailed()
        return self._cipher.open(self._role.peer().value, body)

    @property
    def role(self) -> SessionRole:
        return self._role

    def __repr__(self) -> str:
        return (
            f"SessionAuthenticator(session_id={self._session_id!r}, role={self._role.value!r}, "
            f"next_outgoing={self._next_outgoing}, inbound_highest={self._highest})"
        )

    __reduce__ = _refuse_copy
    __reduce_ex__ = _refuse_copy
    __copy__ = _refuse_copy
    __deepcopy__ = _refuse_copy

    def _tag(self, sender: SessionRole, sequence: int, message_bytes: bytes) -> bytes:
        head = _tag_head(sender.value, sequence, self._session_id)
        size = len(head) + len(message_bytes) + 1
        if size > MAX_WIRE_FRAME_BYTES:
            raise WireFrameTooLarge(size, MAX_WIRE_FRAME_BYTES)
        # The tag input P, hashed in three parts rather than built in memory.
        hasher = blake3.blake3(head, key=self._key.expose())
        hasher.update(message_bytes)
        hasher.update(b"}")
        return bytes(hasher.digest())

    def seal(self, message: WorkerMessage) -> bytes:
        """Number, tag and encode a message; the counter moves only on success."""
        if not is_validated(message):
            validate_message(message)
            mark_validated(message)
        actual = session_id_of(message)
        if actual != self._session_id:
            raise UnknownSession(actual)
        sequence = self._next_outgoing
        if sequence >= MAX_SEQUENCE:
            raise SequenceExhausted()
        message_bytes = encode_struct(message)
        tag = self._tag(self._role, sequence, message_bytes).hex()
        data = _frame_bytes(sequence, message_bytes, tag)
        if len(data) > MAX_WIRE_FRAME_BYTES:
            raise WireFrameTooLarge(len(data), MAX_WIRE_FRAME_BYTES)
        if self._cipher is not None:
            data = self._cipher.seal(self._role.value, data)
        self._next_outgoing = sequence + 1
        return data

    def open(self, frame: bytes) -> WorkerMessage:
        """Authenticate a frame and pass it through the replay window.

        Raises ``DuplicateFrame`` (carrying the authenticated message) for a
        sequence already accepted, ``StaleFrame`` below the window. No state
        changes on any error. With the payload codec, ``frame`` is the
        envelope (:meth:`unwrap`, then :meth:`open_frame`).
        """
        return self.open_frame(self.unwrap(frame))

    def open_frame(self, frame: bytes) -> WorkerMessage:
        """:meth:`open` of a frame already out of its envelope (or without the codec)."""
        sequence, message, tag_hex, message_bytes = decode_frame(frame)
        expected = self._tag(self._role.peer(), sequence, message_bytes)
        if not hmac.compare_digest(expected, bytes.fromhex(tag_hex)):
            raise InvalidAuthenticationTag()
        actual = session_id_of(message)
        if actual != self._session_id:
            raise UnknownSession(actual)
        if sequence == MAX_SEQUENCE:
            raise SequenceExhausted()
        highest = self._highest
        if sequence > highest:
            shift = sequence - highest
            seen = 0 if shift >= REPLAY_WINDOW_SIZE else (self._seen << shift) & _WINDOW_MASK
            self._seen = seen | 1
            self._highest = sequence
            return message
        offset = highest - sequence
        if offset >= REPLAY_WINDOW_SIZE:
            raise StaleFrame(sequence, highest)
        bit = 1 << offset
        if self._seen & bit:
            raise DuplicateFrame(sequence, message)
        self._seen |= bit
        return message

    def export_state(self) -> AuthenticatorState:
        return AuthenticatorState(self._next_outgoing, self._highest, self._seen)

    @classmethod
    def restore(
        cls, session_id: str, key: SessionKey, role: SessionRole, state: AuthenticatorState
    ) -> SessionAuthenticator:
        """Rebuild an authenticator equal to the one that exported ``state``."""
        next_outgoing = state.next_outgoing
        highest = state.inbound_highest
        seen = state.inbound_seen
        for value in (next_outgoing, highest, seen):
            if type(value) is not int or value < 0:
                raise InvalidAuthenticatorState()
        if next_outgoing == 0 or next_outgoing > MAX_SEQUENCE or highest > MAX_SEQUENCE:
            raise InvalidAuthenticatorState()
        if seen >> REPLAY_WINDOW_SIZE:
            raise InvalidAuthenticatorState()
        if highest < REPLAY_WINDOW_SIZE and seen >> highest:
            raise InvalidAuthenticatorState()  # a bit i >= highest stands for sequence <= 0
        if highest > 0 and not seen & 1:
            raise InvalidAuthenticatorState()
        auth = cls(session_id, key, role)
        auth._next_outgoing = next_outgoing
        auth._highest = highest
        auth._seen = seen
        return auth

    def reserve_outgoing(self, minimum_next: int) -> None:
        """Move the outbound counter forward to at least ``minimum_next``."""
        self._next_outgoing = max(self._next_outgoing, minimum_next)
