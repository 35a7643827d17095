"""Keys, sealed frames and the replay window.

Tags for hand-made frames are computed here from the tag-input layout with the
``blake3`` package, so these tests do not trust the sealer they check.
"""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path

import blake3
import msgspec
import pytest

from octo_common.codec import decode_struct
from octo_common.errors import (
    DuplicateFrame,
    InvalidAuthenticationTag,
    InvalidAuthenticatorState,
    InvalidKeyNonce,
    InvalidScopeKey,
    InvalidSequence,
    InvalidSessionKeyLength,
    InvalidToken,
    OctoError,
    SequenceExhausted,
    SerializationError,
    StaleFrame,
    TooManyGrants,
    UnknownSession,
    UnsupportedVersion,
    WeakSessionKey,
    WireFrameTooLarge,
)
from octo_common.frames import (
    AuthenticatorState,
    ScopeKey,
    SessionAuthenticator,
    SessionKey,
    SessionRole,
)
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    CloseSession,
    DispatchOperation,
    Invoke,
    OpenSession,
    OperationDispatchRequest,
    ToolInvocation,
    encode_message,
)
from octo_common.payload import ToolPayload

KEY_BYTES = bytes([7]) * 32
OTHER_KEY_BYTES = bytes(range(32))
SESSION = "session-1"
MAX = 2**64 - 1
MIB = 1_048_576


def _key(data: bytes = KEY_BYTES) -> SessionKey:
    return SessionKey.from_bytes(data)


def _pair(key: SessionKey | None = None) -> tuple[SessionAuthenticator, SessionAuthenticator]:
    key = key or _key()
    return (
        SessionAuthenticator(SESSION, key, SessionRole.HOST),
        SessionAuthenticator(SESSION, key, SessionRole.WORKER),
    )


def _invoke(request_id: str = "r-1", text: str = "hello") -> Invoke:
    return Invoke(ToolInvocation(SESSION, request_id, "text.echo", ToolPayload.text(text)))


def _manual_frame(
    message_json: bytes,
    sequence: int,
    *,
    key: bytes = KEY_BYTES,
    sender: str = "host",
    session_id: str = SESSION,
) -> bytes:
    """A frame built and tagged from the tag-input layout, independently of the sealer."""
    tagged = (
        b'{"domain":"octo-worker-auth-v5","protocol_version":5,"sender":"'
        + sender.encode()
        + b'","sequence":'
        + str(sequence).encode()
        + b',"session_id":"'
        + session_id.encode()
        + b'","message":'
        + message_json
        + b"}"
    )
    tag = blake3.blake3(tagged, key=key).hexdigest()
    return (
        b'{"sequence":'
        + str(sequence).encode()
        + b',"message":'
        + message_json
        + b',"auth_tag":"'
        + tag.encode()
        + b'"}'
    )


CLOSE_JSON = b'{"type":"close_session","protocol_version":5,"session_id":"session-1"}'


def _seal_at(sequence: int, message: object | None = None) -> bytes:
    host = SessionAuthenticator.restore(
        SESSION, _key(), SessionRole.HOST, AuthenticatorState(sequence, 0, 0)
    )
    return host.seal(message or CloseSession(SESSION))  # type: ignore[arg-type]


# ScopeKey -------------------------------------------------------------------


def _key_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / "scope.key"
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_scope_key_length(size: int) -> None:
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_bytes(b"\x01" * size)
    assert raised.value.reason == "length"


def test_scope_key_all_zero_is_weak() -> None:
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_bytes(bytes(32))
    assert raised.value.reason == "weak"
    ScopeKey.from_bytes(bytes(31) + b"\x01")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602, 0o620])
def test_scope_key_file_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = _key_file(tmp_path, OTHER_KEY_BYTES, mode)
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_file(path)
    assert raised.value.reason == "permissions"


def test_scope_key_file_that_is_not_regular_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "dir"
    directory.mkdir(mode=0o700)
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_file(directory)
    assert raised.value.reason == "permissions"


def test_scope_key_file_raw_and_hex_forms(tmp_path: Path) -> None:
    expected = ScopeKey.from_bytes(OTHER_KEY_BYTES)
    assert ScopeKey.from_file(_key_file(tmp_path, OTHER_KEY_BYTES)) == expected
    assert ScopeKey.from_file(_key_file(tmp_path, OTHER_KEY_BYTES.hex().encode())) == expected
    assert (
        ScopeKey.from_file(_key_file(tmp_path, OTHER_KEY_BYTES.hex().encode() + b"\n")) == expected
    )
    assert ScopeKey.from_file(_key_file(tmp_path, OTHER_KEY_BYTES, 0o400)) == expected


@pytest.mark.parametrize(
    "content",
    [
        OTHER_KEY_BYTES.hex().encode() + b"\n\n",
        OTHER_KEY_BYTES.hex().encode() + b"\r\n",
        OTHER_KEY_BYTES.hex().encode() + b" ",
        b" " + OTHER_KEY_BYTES.hex().encode(),
        OTHER_KEY_BYTES.hex().upper().encode(),
        OTHER_KEY_BYTES.hex().encode()[:63],
        OTHER_KEY_BYTES.hex().encode()[:63] + b"g",
        OTHER_KEY_BYTES + b"\n",
        OTHER_KEY_BYTES[:31],
        b"",
        OTHER_KEY_BYTES.hex().encode() * 2,
    ],
)
def test_scope_key_file_other_formats_are_refused(tmp_path: Path, content: bytes) -> None:
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_file(_key_file(tmp_path, content))
    assert raised.value.reason == "format"


def test_scope_key_file_of_zeros_is_weak(tmp_path: Path) -> None:
    with pytest.raises(InvalidScopeKey) as raised:
        ScopeKey.from_file(_key_file(tmp_path, ("00" * 32).encode() + b"\n"))
    assert raised.value.reason == "weak"


def test_scope_key_is_never_shown_pickled_or_copied() -> None:
    key = ScopeKey.from_bytes(OTHER_KEY_BYTES)
    assert repr(key) == "ScopeKey([redacted])"
    assert OTHER_KEY_BYTES.hex() not in str(key)
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError):
            attempt(key)


# SessionKey -----------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 31, 33])
def test_session_key_length(size: int) -> None:
    with pytest.raises(InvalidSessionKeyLength) as raised:
        SessionKey.from_bytes(b"\x05" * size)
    assert (raised.value.actual, raised.value.expected) == (size, 32)


def test_session_key_all_zero_is_weak() -> None:
    with pytest.raises(WeakSessionKey):
        SessionKey.from_bytes(bytes(32))


def test_generated_keys_are_random() -> None:
    assert SessionKey.generate() != SessionKey.generate()


def test_session_key_is_never_shown_pickled_or_copied() -> None:
    key = _key()
    assert repr(key) == "SessionKey([redacted])"
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
        with pytest.raises(TypeError):
            attempt(key)
    host, _ = _pair(key)
    assert KEY_BYTES.hex() not in repr(host)
    with pytest.raises(TypeError):
        pickle.dumps(host)


def test_derive_follows_the_d3_layout() -> None:
    scope_bytes = OTHER_KEY_BYTES
    nonce = bytes(range(100, 132))
    material = (
        scope_bytes
        + (14).to_bytes(8, "big")
        + b"tenant-release"
        + (9).to_bytes(8, "big")
        + b"session-1"
        + nonce
    )
    expected = blake3.blake3(
        material, derive_key_context="octo 2026-12 worker session key v1"
    ).digest()
    derived = SessionKey.derive(
        ScopeKey.from_bytes(scope_bytes), "tenant-release", "session-1", nonce
    )
    assert derived == SessionKey.from_bytes(expected)


def test_derive_checks_tokens_and_nonce() -> None:
    scope = ScopeKey.from_bytes(OTHER_KEY_BYTES)
    with pytest.raises(InvalidToken) as raised:
        SessionKey.derive(scope, "Tenant", SESSION, bytes(32))
    assert raised.value.field == "tenant scope"
    with pytest.raises(InvalidToken) as raised:
        SessionKey.derive(scope, "tenant", "S", bytes(32))
    assert raised.value.field == "session id"
    for nonce in (b"", bytes(31), bytes(33), bytes(64)):
        with pytest.raises(InvalidKeyNonce):
            SessionKey.derive(scope, "tenant", SESSION, nonce)


def test_a_wrong_nonce_fails_the_tag_end_to_end() -> None:
    scope = ScopeKey.from_bytes(OTHER_KEY_BYTES)
    host_key = SessionKey.derive(scope, "tenant", SESSION, b"\x01" * 32)
    worker_key = SessionKey.derive(scope, "tenant", SESSION, b"\x02" * 32)
    right_key = SessionKey.derive(scope, "tenant", SESSION, b"\x01" * 32)
    frame = SessionAuthenticator(SESSION, host_key, SessionRole.HOST).seal(_invoke())
    with pytest.raises(InvalidAuthenticationTag):
        SessionAuthenticator(SESSION, worker_key, SessionRole.WORKER).open(frame)
    assert SessionAuthenticator(SESSION, right_key, SessionRole.WORKER).open(frame) == _invoke()


def test_keys_of_other_tenants_or_sessions_differ() -> None:
    scope = ScopeKey.from_bytes(OTHER_KEY_BYTES)
    nonce = b"\x09" * 32
    base = SessionKey.derive(scope, "tenant", SESSION, nonce)
    assert base != SessionKey.derive(scope, "tenant-2", SESSION, nonce)
    assert base != SessionKey.derive(scope, "tenant", "session-2", nonce)
    # LP framing: moving a byte between tenant and session changes the key.
    assert SessionKey.derive(scope, "ab", "c", nonce) != SessionKey.derive(scope, "a", "bc", nonce)


# Sealing and opening ------------------------------------------------------


def test_seal_numbers_frames_and_the_peer_opens_them() -> None:
    host, worker = _pair()
    frames = [host.seal(_invoke(f"r-{i}")) for i in range(1, 4)]
    assert [f.startswith(b'{"sequence":%d,' % i) for i, f in enumerate(frames, 1)] == [True] * 3
    assert [worker.open(f) for f in frames] == [_invoke(f"r-{i}") for i in range(1, 4)]
    assert host.export_state() == AuthenticatorState(4, 0, 0)
    assert worker.export_state() == AuthenticatorState(1, 3, 0b111)


def test_sealed_frame_matches_the_w74_tag_layout() -> None:
    host, _ = _pair()
    assert host.seal(CloseSession(SESSION)) == _manual_frame(CLOSE_JSON, 1)
    worker = SessionAuthenticator(SESSION, _key(), SessionRole.WORKER)
    assert worker.seal(CloseSession(SESSION)) == _manual_frame(CLOSE_JSON, 1, sender="worker")


def test_seal_refuses_a_message_of_another_session() -> None:
    host, _ = _pair()
    with pytest.raises(UnknownSession) as raised:
        host.seal(CloseSession("session-2"))
    assert raised.value.session_id == "session-2"
    assert host.export_state().next_outgoing == 1


def test_seal_refuses_a_frame_over_one_mib_and_keeps_its_counter() -> None:
    host, _ = _pair()
    message = _invoke(text="x" * (MIB - 200))
    with pytest.raises(WireFrameTooLarge):
        host.seal(message)
    assert host.export_state().next_outgoing == 1


def test_open_refuses_a_frame_over_one_mib_first() -> None:
    _, worker = _pair()
    with pytest.raises(WireFrameTooLarge):
        worker.open(b" " * (MIB + 1))


def test_sequence_zero_wins_over_a_bad_message_and_a_bad_tag() -> None:
    _, worker = _pair()
    frame = (
        b'{"sequence":0,"message":{"type":"close_session","protocol_version":6,'
        b'"session_id":"S"},"auth_tag":"zz"}'
    )
    with pytest.raises(InvalidSequence):
        worker.open(frame)


def test_a_bad_version_with_a_bad_tag_is_unsupported_version() -> None:
    _, worker = _pair()
    frame = (
        b'{"sequence":1,"message":{"type":"close_session","protocol_version":6,'
        b'"session_id":"session-1"},"auth_tag":"not-hex"}'
    )
    with pytest.raises(UnsupportedVersion):
        worker.open(frame)


@pytest.mark.parametrize("sequence", [b"-1", b"18446744073709551616", b"1.0", b"true", b'"1"'])
def test_sequences_outside_u64_are_serialization_errors(sequence: bytes) -> None:
    _, worker = _pair()
    frame = _manual_frame(CLOSE_JSON, 1).replace(b'"sequence":1', b'"sequence":' + sequence)
    with pytest.raises(SerializationError):
        worker.open(frame)


def test_an_extra_top_level_key_is_ignored() -> None:
    _, worker = _pair()
    frame = _manual_frame(CLOSE_JSON, 1)
    with_extra = frame[:-1] + b',"relay":{"hop":1}}'
    assert worker.open(with_extra) == CloseSession(SESSION)


@pytest.mark.parametrize("tag", ["A" * 64, "a" * 63, "a" * 65, "", "g" * 64])
def test_bad_tag_syntax(tag: str) -> None:
    _, worker = _pair()
    frame = _manual_frame(CLOSE_JSON, 1)
    bad = frame[: frame.index(b'"auth_tag":"')] + b'"auth_tag":"' + tag.encode() + b'"}'
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(bad)


def test_duplicate_frame_keys_are_rejected() -> None:
    _, worker = _pair()
    frame = _manual_frame(CLOSE_JSON, 1)
    with pytest.raises(SerializationError):
        worker.open(b'{"sequence":1,' + frame[1:])


def test_the_tag_covers_the_model_not_the_bytes() -> None:
    _, worker = _pair()
    message_json = (
        b'{"type":"dispatch_operation","request":{"protocol_version":5,"session_id":"session-1",'
        b'"request_id":"d-1","tool":"t","operation_key":"k","payload":{"format":"json",'
        b'"value":{"b":1.0,"a":[1e2]}}}}'
    )
    canonical = message_json.replace(b'{"b":1.0,"a":[1e2]}', b'{"a":[100.0],"b":1.0}')
    # Tag computed over the canonical re-encoding: the raw, non-canonical frame opens.
    tagged_canonically = _manual_frame(canonical, 1)
    raw = tagged_canonically.replace(canonical, message_json)
    opened = worker.open(raw)
    assert isinstance(opened, DispatchOperation)
    assert opened.request.payload == ToolPayload.json({"a": [100.0], "b": 1.0})
    # Tag computed over the raw bytes: refused.
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(_manual_frame(message_json, 2))


def test_a_valid_tag_for_another_session_is_unknown_session() -> None:
    _, worker = _pair()
    foreign = CLOSE_JSON.replace(b"session-1", b"session-2")
    with pytest.raises(UnknownSession) as raised:
        worker.open(_manual_frame(foreign, 1))
    assert raised.value.session_id == "session-2"
    assert worker.export_state() == AuthenticatorState(1, 0, 0)


def test_a_frame_from_an_authenticator_of_another_session_fails_the_tag() -> None:
    other_host = SessionAuthenticator("session-2", _key(), SessionRole.HOST)
    frame = other_host.seal(CloseSession("session-2"))
    _, worker = _pair()
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(frame)


def test_open_validates_the_manifest_before_the_tag() -> None:
    # 129 grants fail at frame decoding, before any tag check.
    body = b",".join(
        b'{"tool":"t%d","format":"text","max_calls":1,"max_input_bytes":1,"max_output_bytes":1}' % i
        for i in range(129)
    )
    message_json = (
        b'{"type":"open_session","manifest":{"protocol_version":5,"session_id":"session-1",'
        b'"grants":[' + body + b"]}}"
    )
    frame = b'{"sequence":1,"message":' + message_json + b',"auth_tag":"' + b"0" * 64 + b'"}'
    _, worker = _pair()
    with pytest.raises(TooManyGrants):
        worker.open(frame)
    # Decoding a struct does not validate it, so seal meets the oversized manifest itself.
    unchecked = decode_struct(message_json, OpenSession)
    host, _ = _pair()
    with pytest.raises(TooManyGrants):
        host.seal(unchecked)
    assert host.export_state().next_outgoing == 1


# A tag binds its message, role and key; a second opening is a duplicate -----------------


def test_example_12() -> None:
    host, worker = _pair()
    opening = host.seal(
        OpenSession(CapabilityManifest(SESSION, [CapabilityGrant.text("text.echo")]))
    )
    tag = opening[opening.index(b'"auth_tag":"') :]
    swapped = b'{"sequence":1,"message":' + CLOSE_JSON + b"," + tag
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(swapped)
    with pytest.raises(InvalidAuthenticationTag):
        host.open(opening)
    stranger = SessionAuthenticator(SESSION, _key(OTHER_KEY_BYTES), SessionRole.WORKER)
    with pytest.raises(InvalidAuthenticationTag):
        stranger.open(opening)
    assert stranger.export_state() == AuthenticatorState(1, 0, 0)
    assert worker.export_state() == AuthenticatorState(1, 0, 0)
    assert isinstance(worker.open(opening), OpenSession)
    with pytest.raises(DuplicateFrame) as raised:
        worker.open(opening)
    assert raised.value.sequence == 1
    assert isinstance(raised.value.message, OpenSession)


# The replay window after many frames -------------------------------------------------


def test_example_13_after_1100_frames() -> None:
    host, worker = _pair()
    frames = [host.seal(CloseSession(SESSION)) for _ in range(1100)]
    for frame in frames:
        worker.open(frame)
    state = worker.export_state()
    assert state.inbound_highest == 1100
    with pytest.raises(StaleFrame) as stale:
        worker.open(frames[75])  # sequence 76
    assert (stale.value.sequence, stale.value.highest) == (76, 1100)
    assert worker.export_state() == state
    with pytest.raises(DuplicateFrame) as duplicate:
        worker.open(frames[76])  # sequence 77
    assert duplicate.value.sequence == 77
    assert worker.export_state() == state


def test_example_13_fresh_window() -> None:
    _, worker = _pair()
    at = {n: _seal_at(n) for n in (5000, 4000, 3977, 3976)}
    worker.open(at[5000])
    worker.open(at[4000])
    state = worker.export_state()
    with pytest.raises(DuplicateFrame) as duplicate:
        worker.open(at[4000])
    assert duplicate.value.sequence == 4000
    assert worker.export_state() == state
    worker.open(at[3977])
    state = worker.export_state()
    with pytest.raises(StaleFrame) as stale:
        worker.open(at[3976])
    assert (stale.value.sequence, stale.value.highest) == (3976, 5000)
    assert worker.export_state() == state
    assert state.inbound_highest == 5000


def test_a_jump_of_the_window_size_clears_it() -> None:
    _, worker = _pair()
    worker.open(_seal_at(1))
    worker.open(_seal_at(1025))
    assert worker.export_state().inbound_seen == 1
    with pytest.raises(StaleFrame):
        worker.open(_seal_at(1))


def test_the_directions_are_independent() -> None:
    host, worker = _pair()
    worker.open(host.seal(CloseSession(SESSION)))
    reply = worker.seal(CloseSession(SESSION))
    assert reply.startswith(b'{"sequence":1,')
    assert host.open(reply) == CloseSession(SESSION)


# SequenceExhausted -----------------------------------------------------------


def test_seal_exhausts_after_the_last_usable_sequence() -> None:
    host = SessionAuthenticator.restore(
        SESSION, _key(), SessionRole.HOST, AuthenticatorState(MAX - 1, 0, 0)
    )
    frame = host.seal(CloseSession(SESSION))
    assert frame.startswith(b'{"sequence":18446744073709551614,')
    with pytest.raises(SequenceExhausted):
        host.seal(CloseSession(SESSION))
    assert host.export_state().next_outgoing == MAX
    _, worker = _pair()
    assert worker.open(frame) == CloseSession(SESSION)


def test_open_refuses_an_authentic_frame_at_the_maximum_sequence() -> None:
    _, worker = _pair()
    with pytest.raises(SequenceExhausted):
        worker.open(_manual_frame(CLOSE_JSON, MAX))
    assert worker.export_state() == AuthenticatorState(1, 0, 0)
    assert worker.open(_manual_frame(CLOSE_JSON, MAX - 1)) == CloseSession(SESSION)


# Export and restore ------------------------------------------------------------


def test_restore_rebuilds_an_equal_authenticator() -> None:
    host, worker = _pair()
    frames = [host.seal(CloseSession(SESSION)) for _ in range(5)]
    for index in (0, 2, 4):
        worker.open(frames[index])
    state = worker.export_state()
    assert state == AuthenticatorState(1, 5, 0b10101)
    restored = SessionAuthenticator.restore(SESSION, _key(), SessionRole.WORKER, state)
    assert restored.export_state() == state
    assert (restored.session_id, restored.role) == (SESSION, SessionRole.WORKER)
    with pytest.raises(DuplicateFrame):
        restored.open(frames[2])
    assert restored.open(frames[1]) == CloseSession(SESSION)


@pytest.mark.parametrize(
    "state",
    [
        AuthenticatorState(0, 0, 0),  # next_outgoing 0
        AuthenticatorState(1, 5000, 1 << 1024 | 1),  # seen >= 2^1024
        AuthenticatorState(1, 3, 0b1001),  # bit 3 >= highest 3
        AuthenticatorState(1, 0, 1),  # bit 0 with highest 0
        AuthenticatorState(1, 5, 0b10),  # highest > 0, bit 0 clear
        AuthenticatorState(1, 1, 0),  # highest > 0, bit 0 clear
        AuthenticatorState(-1, 0, 0),
        AuthenticatorState(1, -1, 0),
        AuthenticatorState(1, 5, -1),
    ],
)
def test_impossible_states_are_refused(state: AuthenticatorState) -> None:
    with pytest.raises(InvalidAuthenticatorState):
        SessionAuthenticator.restore(SESSION, _key(), SessionRole.WORKER, state)


@pytest.mark.parametrize(
    "state",
    [
        AuthenticatorState(1, 0, 0),
        AuthenticatorState(7, 3, 0b111),
        AuthenticatorState(1, 5000, (1 << 1024) - 1),
        AuthenticatorState(MAX, 1024, (1 << 1024) - 1),
    ],
)
def test_possible_states_are_accepted(state: AuthenticatorState) -> None:
    restored = SessionAuthenticator.restore(SESSION, _key(), SessionRole.HOST, state)
    assert restored.export_state() == state


# DuplicateFrame ----------------------------------------------------------------------


def test_duplicate_frame_carries_the_message_but_never_shows_it() -> None:
    host, worker = _pair()
    secret = "hunter2-payload-secret"
    message = DispatchOperation(
        OperationDispatchRequest(SESSION, "d-1", "text.echo", "op-1", ToolPayload.text(secret))
    )
    frame = host.seal(message)
    worker.open(frame)
    with pytest.raises(DuplicateFrame) as raised:
        worker.open(frame)
    assert raised.value.message == message
    assert raised.value.code == "duplicate_frame"
    for text in (str(raised.value), repr(raised.value), str(raised.value.args)):
        assert secret not in text
        assert "op-1" not in text


# The tag input bound ---------------------------------------------

LONG_SESSION = "s" * 128


def _invoke_filling_a_frame() -> Invoke:
    """An invoke whose sealed frame is exactly 1 MiB while its tag input is larger."""
    empty = Invoke(ToolInvocation(LONG_SESSION, "r", "t", ToolPayload.text("")))
    frame_overhead = len(b'{"sequence":1,"message":,"auth_tag":""}') + 64
    room = MIB - frame_overhead - len(encode_message(empty))
    return Invoke(ToolInvocation(LONG_SESSION, "r", "t", ToolPayload.text("x" * room)))


def test_seal_refuses_a_tag_input_over_one_mib() -> None:
    message = _invoke_filling_a_frame()
    host = SessionAuthenticator(LONG_SESSION, _key(), SessionRole.HOST)
    with pytest.raises(WireFrameTooLarge) as raised:
        host.seal(message)
    assert raised.value.actual > MIB
    assert host.export_state().next_outgoing == 1


def test_open_refuses_a_tag_input_over_one_mib_before_comparing() -> None:
    message_json = encode_message(_invoke_filling_a_frame())
    frame = b'{"sequence":1,"message":' + message_json + b',"auth_tag":"' + b"0" * 64 + b'"}'
    assert len(frame) == MIB
    worker = SessionAuthenticator(LONG_SESSION, _key(), SessionRole.WORKER)
    with pytest.raises(WireFrameTooLarge):
        worker.open(frame)
    assert worker.export_state() == AuthenticatorState(1, 0, 0)


def test_window_bitmap_boundaries_on_restore() -> None:
    full = (1 << 1024) - 1
    with pytest.raises(InvalidAuthenticatorState):  # bit 1023 would stand for sequence 0
        SessionAuthenticator.restore(
            SESSION, _key(), SessionRole.WORKER, AuthenticatorState(1, 1023, full)
        )
    state = AuthenticatorState(1, 1023, full >> 1)
    restored = SessionAuthenticator.restore(SESSION, _key(), SessionRole.WORKER, state)
    with pytest.raises(DuplicateFrame):
        restored.open(_seal_at(1))
    assert restored.open(_seal_at(1024)) == CloseSession(SESSION)


# The tag covers the model: spelling differences on the wire do not matter -----

INVOKE_JSON = (
    b'{"type":"invoke","invocation":{"protocol_version":5,"session_id":"session-1",'
    b'"request_id":"r-1","tool":"text.echo","payload":{"format":"text","value":"hello"}}}'
)


def test_reordered_whitespaced_frames_with_ignored_keys_open() -> None:
    tag = _manual_frame(INVOKE_JSON, 1)[-66:-2].decode()
    spelled = (
        '{ "auth_tag" : "' + tag + '" ,\n "message" : {"invocation": {"payload": {"value": "hello",'
        ' "format": "text", "note": [1]}, "tool": "text.echo", "request_id": "r-1",'
        ' "session_id": "session-1", "protocol_version": 5, "trace": {"x": 1}},'
        ' "type": "invoke", "hint": null},\n "sequence" : 1 }\n'
    ).encode()
    _, worker = _pair()
    assert worker.open(spelled) == _invoke()


def test_an_ignored_key_is_not_covered_by_the_tag() -> None:
    # Tagging the bytes with the unknown key inside (instead of the model) fails.
    with_key = INVOKE_JSON.replace(b'"tool":"text.echo"', b'"tool":"text.echo","trace":1')
    _, worker = _pair()
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(_manual_frame(with_key, 1))
    assert worker.open(_manual_frame(INVOKE_JSON, 1)) == _invoke()


def test_exported_state_is_msgspec_encodable() -> None:
    state = AuthenticatorState(7, 5000, (1 << 1024) - 1)
    encoded = msgspec.json.encode(state)
    assert msgspec.json.decode(encoded, type=AuthenticatorState) == state
    restored = SessionAuthenticator.restore(
        SESSION, _key(), SessionRole.WORKER, msgspec.json.decode(encoded, type=AuthenticatorState)
    )
    assert restored.export_state() == state


def test_open_checks_tag_then_session_then_exhaustion_then_window() -> None:
    _, worker = _pair()
    foreign = CLOSE_JSON.replace(b"session-1", b"session-2")
    # Bad tag beats everything after it.
    bad_tag = _manual_frame(foreign, MAX, key=OTHER_KEY_BYTES)
    with pytest.raises(InvalidAuthenticationTag):
        worker.open(bad_tag)
    # Session mismatch (valid tag) beats the exhausted sequence.
    with pytest.raises(UnknownSession):
        worker.open(_manual_frame(foreign, MAX))
    # Session mismatch beats the replay window.
    worker.open(_manual_frame(CLOSE_JSON, 5))
    with pytest.raises(UnknownSession):
        worker.open(_manual_frame(foreign, 5))
    assert worker.export_state() == AuthenticatorState(1, 5, 1)


# Tampering ---------------------------------------------------------------------------


def test_every_single_byte_change_of_a_frame_is_refused() -> None:
    message = Invoke(ToolInvocation(SESSION, "r-1", "text.echo", ToolPayload.json({"a": [1, 2.5]})))
    frame = SessionAuthenticator(SESSION, _key(), SessionRole.HOST).seal(message)
    worker = SessionAuthenticator(SESSION, _key(), SessionRole.WORKER)
    accepted = []
    for index in range(len(frame)):
        for value in range(256):
            if value == frame[index]:
                continue
            try:
                worker.open(frame[:index] + bytes([value]) + frame[index + 1 :])
            except OctoError:
                continue
            accepted.append((index, value))
    assert accepted == []
    assert worker.export_state() == AuthenticatorState(1, 0, 0)


def test_a_change_that_keeps_the_model_verifies_as_the_same_message() -> None:
    # The tag covers the model. Renaming an empty `resources` key makes it an
    # ignored unknown key, and the grant's `resources` defaults to []: same model.
    message = OpenSession(CapabilityManifest(SESSION, [CapabilityGrant.text("text.echo")]))
    frame = SessionAuthenticator(SESSION, _key(), SessionRole.HOST).seal(message)
    renamed = frame.replace(b'"resources":[]', b'"resourcez":[]')
    assert renamed != frame
    _, worker = _pair()
    assert worker.open(renamed) == message
