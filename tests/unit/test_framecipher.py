"""The payload codec (octo_common.framecipher) and the authenticator's codec mode."""

from __future__ import annotations

import pytest

from octo_common.errors import DuplicateFrame, FrameDecryptionFailed, InvalidAuthenticationTag
from octo_common.framecipher import ENVELOPE_OVERHEAD, MAGIC, FrameCipher, is_envelope
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityManifest
from octo_common.limits import PAYLOAD_CODEC
from octo_common.messages import DispatchOperation, OpenSession
from octo_common.payload import ToolPayload
from octo_common.requests import OperationDispatchRequest

SECRET = "the-input-nobody-else-reads"


def _pair(codec: bool) -> tuple[SessionAuthenticator, SessionAuthenticator]:
    key = SessionKey.generate()
    host = SessionAuthenticator("s-1", key, SessionRole.HOST)
    worker = SessionAuthenticator("s-1", key, SessionRole.WORKER)
    if codec:
        host.use_payload_codec()
        worker.use_payload_codec()
    return host, worker


def _dispatch() -> DispatchOperation:
    return DispatchOperation(
        OperationDispatchRequest(
            "s-1", "d-1", "files.publish", "op-1", ToolPayload.json({"content": SECRET})
        )
    )


def test_an_envelope_holds_the_frame_of_the_plain_mode_byte_for_byte() -> None:
    host, worker = _pair(codec=True)
    worker_key = worker._key  # the same key as host's
    plain_host = SessionAuthenticator("s-1", worker_key, SessionRole.HOST)
    frame = plain_host.seal(_dispatch())
    envelope = host.seal(_dispatch())
    assert is_envelope(envelope) and envelope.startswith(MAGIC)
    assert SECRET.encode() not in envelope and b"op-1" not in envelope
    assert len(envelope) == len(frame) + ENVELOPE_OVERHEAD
    assert worker.unwrap(envelope) == frame  # tag and fingerprints over the same plaintext
    assert worker.open_frame(frame) == _dispatch()


def test_a_tampered_reflected_or_clear_frame_is_refused_and_changes_nothing() -> None:
    host, worker = _pair(codec=True)
    envelope = host.seal(_dispatch())
    tampered = bytearray(envelope)
    tampered[-1] ^= 1
    reflected = worker.seal(_dispatch())  # a worker's own envelope: the other direction
    before = worker.export_state()
    for bad in (bytes(tampered), envelope[:20], b"{}"):
        with pytest.raises(FrameDecryptionFailed):
            worker.open(bad)
    with pytest.raises(FrameDecryptionFailed):
        worker.open(reflected)
    # A frame in the clear under the right key is refused too (no downgrade).
    clear = SessionAuthenticator("s-1", host._key, SessionRole.HOST).seal(_dispatch())
    with pytest.raises(FrameDecryptionFailed):
        worker.open(clear)
    assert worker.export_state() == before
    assert worker.open(envelope) == _dispatch()


def test_another_sessions_key_or_id_does_not_open_it() -> None:
    key = SessionKey.generate()
    envelope = FrameCipher(key.expose(), "s-1").seal("host", b'{"x":1}')
    with pytest.raises(FrameDecryptionFailed):
        FrameCipher(key.expose(), "s-2").open("host", envelope)
    with pytest.raises(FrameDecryptionFailed):
        FrameCipher(SessionKey.generate().expose(), "s-1").open("host", envelope)
    assert FrameCipher(key.expose(), "s-1").open("host", envelope) == b'{"x":1}'
    assert "redacted" in repr(FrameCipher(key.expose(), "s-1"))


def test_without_the_codec_frames_are_the_protocols_base_form() -> None:
    host, worker = _pair(codec=False)
    frame = host.seal(_dispatch())
    assert frame.startswith(b'{"sequence":1,') and SECRET.encode() in frame
    assert worker.unwrap(frame) == frame
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(frame.replace(b"d-1", b"d-2"))


def test_the_open_session_frame_alone_passes_in_the_clear() -> None:
    host, worker = _pair(codec=False)
    manifest = CapabilityManifest("s-1", [])
    opening = host.seal(OpenSession(manifest, payload_codec=PAYLOAD_CODEC))
    host.use_payload_codec()
    assert worker.open(opening) == OpenSession(manifest, payload_codec=PAYLOAD_CODEC)
    worker.use_payload_codec()
    # A redelivered copy passes the envelope check and is the duplicate it is.
    assert worker.unwrap(opening) == opening
    with pytest.raises(DuplicateFrame):
        worker.open(opening)
    assert worker.open(host.seal(_dispatch())) == _dispatch()
