"""The payload codec: a session's frames encrypted between host and worker.

A session whose ``open_session`` names the codec (``payload_codec =
"chacha20-poly1305"``) sends every later frame, both ways, as an envelope::

    MAGIC (4 bytes) ‖ nonce (12 random bytes) ‖ ChaCha20-Poly1305(frame)

under a key derived from the session key for this purpose alone (BLAKE3
``derive_key`` with its own context), with associated data naming the
domain, the session and the sender's role. The frame inside is the sealed
frame of the protocol, byte for byte: its tag, the fingerprints and the
operation keys stay defined over the canonical plaintext, and the broker,
its quorum-queue logs and the dead-letter queue hold only ciphertext (the
routing headers stay readable). The ``open_session`` frame itself is never
enveloped: it carries the grants, not an input or output.

Pure: no I/O besides the nonce's randomness. It must never return or show
a key, and never accept an envelope whose tag fails, a plaintext frame in
place of an envelope, or an envelope of the other direction.
"""

from __future__ import annotations

import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from octo_common.digest import FRAME_CIPHER_DOMAIN, FRAME_CIPHER_KEY_CONTEXT, derive_key, lp
from octo_common.errors import FrameDecryptionFailed, WireFrameTooLarge
from octo_common.limits import MAX_WIRE_FRAME_BYTES

__all__ = ["ENVELOPE_OVERHEAD", "MAGIC", "FrameCipher", "is_envelope"]

# Never the first bytes of a JSON frame (which starts with "{").
MAGIC: Final = b"\x00OC1"
_NONCE_BYTES: Final = 12
_TAG_BYTES: Final = 16
ENVELOPE_OVERHEAD: Final = len(MAGIC) + _NONCE_BYTES + _TAG_BYTES


def is_envelope(body: bytes) -> bool:
    """Whether ``body`` is shaped like an envelope (says nothing of its tag)."""
    return body[: len(MAGIC)] == MAGIC


class FrameCipher:
    """Encrypts and decrypts the frames of one session; never copied or shown."""

    __slots__ = ("_aead", "_session")

    def __init__(self, session_key: bytes, session_id: str) -> None:
        key = derive_key(FRAME_CIPHER_KEY_CONTEXT, bytes(session_key))
        self._aead = ChaCha20Poly1305(key)
        self._session = lp(session_id.encode("utf-8"))

    def __repr__(self) -> str:
        return "FrameCipher([redacted])"

    def __reduce__(self) -> str:
        raise TypeError("FrameCipher cannot be pickled")

    def _aad(self, sender: str) -> bytes:
        return FRAME_CIPHER_DOMAIN + self._session + lp(sender.encode("ascii"))

    def seal(self, sender: str, frame: bytes) -> bytes:
        """The envelope of ``frame`` sent by ``sender`` ("host" or "worker")."""
        size = len(frame) + ENVELOPE_OVERHEAD
        if size > MAX_WIRE_FRAME_BYTES:
            raise WireFrameTooLarge(size, MAX_WIRE_FRAME_BYTES)
        nonce = os.urandom(_NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, frame, self._aad(sender))

    def open(self, sender: str, body: bytes) -> bytes:
        """The frame inside an envelope sent by ``sender``; ``FrameDecryptionFailed`` otherwise."""
        data = bytes(body)
        if not is_envelope(data) or len(data) < ENVELOPE_OVERHEAD:
            raise FrameDecryptionFailed()
        nonce = data[len(MAGIC) : len(MAGIC) + _NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, data[len(MAGIC) + _NONCE_BYTES :], self._aad(sender))
        except InvalidTag:
            raise FrameDecryptionFailed() from None
