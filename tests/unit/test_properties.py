"""Property tests for the protocol core.

Each property states a rule of the spec over generated inputs: canonical
bytes ignore key order, the compact encoding round-trips, numbers follow the
canonical writing rules (checked against a small reference written here), sealed
frames round-trip and any single-byte change is refused, decoders raise only
Octo errors, and attenuation never widens a grant.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octo_common.codec import compact_json, parse_json
from octo_common.errors import OctoError
from octo_common.frames import SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import (
    CapabilityGrant,
    CapabilityManifest,
    GrantAttenuation,
    ManifestAttenuation,
    ResourceSelector,
)
from octo_common.messages import (
    CloseSession,
    CompensateOperation,
    CompensationResult,
    DispatchOperation,
    Invoke,
    OpenSession,
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationCompensationResult,
    OperationDispatchRequest,
    OperationReconcileRequest,
    OperationReconcileResult,
    OperationResult,
    ReconciledOperation,
    ReconcileOperation,
    RequestRejected,
    Result,
    ToolInvocation,
    ToolResult,
    decode_message,
    encode_message,
)
from octo_common.payload import ToolPayload, canonical_operation_input_bytes
from octo_common.states import Cancelled, Failed, Running, Succeeded
from tests.number_reference import reference_double

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SESSION = "session-1"
KEY = SessionKey.from_bytes(bytes(range(1, 33)))

# Strategies ---------------------------------------------------------------------------

TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
EXACT_INTS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.none() | st.booleans() | EXACT_INTS | FINITE | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
CONTAINERS = st.lists(JSON_VALUES, max_size=4) | st.dictionaries(TEXT, JSON_VALUES, max_size=4)
TOKENS = st.from_regex(r"[a-z0-9._-]{1,16}", fullmatch=True)
PAYLOADS = st.builds(ToolPayload.text, TEXT) | st.builds(ToolPayload.json, CONTAINERS)
STATUSES = st.one_of(
    st.just(Running()),
    st.just(Cancelled()),
    st.builds(Succeeded, PAYLOADS),
    st.builds(Failed, st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)),
)
FINGERPRINTS = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)
CODES = st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True)
BINDINGS = st.builds(
    OperationCompensationBinding,
    TOKENS,
    TOKENS,
    TOKENS.map(lambda t: ("cmp-" + t)[:128]),
    TOKENS,
    FINGERPRINTS,
)
GRANTS = st.builds(
    CapabilityGrant,
    TOKENS,
    st.sampled_from(["text", "json"]),
    st.integers(1, 2**32 - 1),
    st.integers(1, 2**32 - 1),
    st.integers(1, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.lists(
        st.builds(ResourceSelector, st.sampled_from(["file_root", "secret"]), TOKENS), max_size=3
    ),
)
MANIFESTS = st.lists(GRANTS, max_size=3, unique_by=lambda g: g.tool).map(
    lambda grants: CapabilityManifest(SESSION, grants)
)

MESSAGES = st.one_of(
    st.builds(OpenSession, MANIFESTS),
    st.builds(lambda r, t, p: Invoke(ToolInvocation(SESSION, r, t, p)), TOKENS, TOKENS, PAYLOADS),
    st.builds(lambda r, p: Result(ToolResult(SESSION, r, p)), TOKENS, PAYLOADS),
    st.builds(
        lambda r, t, k, p: DispatchOperation(OperationDispatchRequest(SESSION, r, t, k, p)),
        TOKENS,
        TOKENS,
        TOKENS,
        PAYLOADS,
    ),
    st.builds(
        lambda r, t, k, s: OperationResult(OperationReconcileResult(SESSION, r, t, k, s)),
        TOKENS,
        TOKENS,
        TOKENS,
        STATUSES,
    ),
    st.builds(
        lambda r, t, k: ReconcileOperation(OperationReconcileRequest(SESSION, r, t, k)),
        TOKENS,
        TOKENS,
        TOKENS,
    ),
    st.builds(
        lambda r, t, k, s: ReconciledOperation(OperationReconcileResult(SESSION, r, t, k, s)),
        TOKENS,
        TOKENS,
        TOKENS,
        STATUSES,
    ),
    st.builds(
        lambda r, b, p: CompensateOperation(OperationCompensationRequest(SESSION, r, b, p)),
        TOKENS,
        BINDINGS,
        PAYLOADS,
    ),
    st.builds(
        lambda r, b, s: CompensationResult(OperationCompensationResult(SESSION, r, b, s)),
        TOKENS,
        BINDINGS,
        STATUSES,
    ),
    st.just(CloseSession(SESSION)),
    st.builds(
        lambda r, c, k: RequestRejected(SESSION, r, c, k),
        TOKENS,
        CODES,
        st.none() | TOKENS,
    ),
)


def _shuffled(value: Any, rng: random.Random) -> Any:
    """The same value with every object's keys inserted in another order."""
    if isinstance(value, dict):
        items = [(k, _shuffled(v, rng)) for k, v in value.items()]
        rng.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [_shuffled(v, rng) for v in value]
    return value


# Canonical JSON -------------------------------------------------------------------------


@FAST
@given(CONTAINERS, st.randoms(use_true_random=False))
def test_canonical_bytes_ignore_object_key_order(value: Any, rng: random.Random) -> None:
    other = _shuffled(value, rng)
    assert compact_json(other) == compact_json(value)
    first, second = ToolPayload.json(value), ToolPayload.json(other)
    assert first == second
    assert hash(first) == hash(second)
    assert canonical_operation_input_bytes(first) == canonical_operation_input_bytes(second)


@FAST
@given(JSON_VALUES)
def test_compact_json_round_trips_through_parse_json(value: Any) -> None:
    encoded = compact_json(value)
    parsed = parse_json(encoded)
    # Byte equality also proves types survive: 1 and 1.0 are written differently.
    assert compact_json(parsed) == encoded
    assert parse_json(encoded.decode("utf-8")) == parsed


@FAST
@given(CONTAINERS)
def test_payload_values_keep_their_canonical_form(value: Any) -> None:
    payload = ToolPayload.json(value)
    # The value read back keeps ints, doubles (-0.0 included) and big integers apart.
    assert compact_json(payload.value) == compact_json(value)
    assert ToolPayload.json(payload.value) == payload


@FAST
@given(JSON_VALUES)
def test_whitespace_and_key_order_on_input_do_not_change_the_canonical_form(value: Any) -> None:
    pretty = json.dumps(value, indent=2, ensure_ascii=True, sort_keys=False)
    if "NaN" in pretty or "Infinity" in pretty:
        return
    assert compact_json(parse_json(pretty)) == compact_json(value)


@FAST
@given(FINITE)
def test_doubles_are_written_by_the_w55_rules(x: float) -> None:
    written = compact_json(x).decode()
    assert written == reference_double(x)
    parsed = parse_json(written)
    assert isinstance(parsed, float)
    assert parsed == x
    assert math.copysign(1.0, parsed) == math.copysign(1.0, x)


@FAST
@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_integers_are_exact_only_in_the_d1_range(n: int) -> None:
    written = compact_json(parse_json(str(n))).decode()
    if -(2**63) <= n <= 2**64 - 1:
        assert written == str(n)
    else:
        assert written == reference_double(float(n))


# Frames ---------------------------------------------------------------------------------


@FAST
@given(st.lists(MESSAGES, min_size=1, max_size=3))
def test_seal_open_round_trips(messages: list[Any]) -> None:
    host = SessionAuthenticator(SESSION, KEY, SessionRole.HOST)
    worker = SessionAuthenticator(SESSION, KEY, SessionRole.WORKER)
    for message in messages:
        opened = worker.open(host.seal(message))
        assert opened == message
        assert encode_message(opened) == encode_message(message)
        assert decode_message(encode_message(message)) == message


@FAST
@given(MESSAGES, st.data())
def test_no_single_byte_change_opens_as_another_message(message: Any, data: st.DataObject) -> None:
    frame = SessionAuthenticator(SESSION, KEY, SessionRole.HOST).seal(message)
    index = data.draw(st.integers(0, len(frame) - 1), label="index")
    replacement = data.draw(st.integers(0, 255).filter(lambda b: b != frame[index]), label="byte")
    tampered = frame[:index] + bytes([replacement]) + frame[index + 1 :]
    worker = SessionAuthenticator(SESSION, KEY, SessionRole.WORKER)
    before = worker.export_state()
    try:
        opened = worker.open(tampered)
    except OctoError:
        assert worker.export_state() == before
    else:
        # The tag covers the model, not the bytes. A change that leaves the model
        # intact may verify: e.g. renaming an empty `"resources":[]` key of a grant makes it
        # an ignored unknown key and `resources` takes its default `[]`. What must
        # never happen is accepting a different message.
        assert opened == message, f"a frame changed at byte {index} opened as another message"
        assert encode_message(opened) == encode_message(message)


@FAST
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_octo_errors(data: bytes) -> None:
    worker = SessionAuthenticator(SESSION, KEY, SessionRole.WORKER)
    for decode in (decode_message, worker.open):
        with contextlib.suppress(OctoError):  # any other error fails
            decode(data)


PROTOCOL_KEYS = st.sampled_from(
    [
        "type",
        "sequence",
        "message",
        "auth_tag",
        "request",
        "result",
        "manifest",
        "invocation",
        "protocol_version",
        "session_id",
        "request_id",
        "tool",
        "operation_key",
        "payload",
        "format",
        "value",
        "status",
        "state",
        "grants",
        "code",
        "compensation_key",
    ]
)
PROTOCOL_WORDS = st.sampled_from(
    [
        "dispatch_operation",
        "open_session",
        "close_session",
        "invoke",
        "request_rejected",
        "json",
        "text",
        "succeeded",
        "failed",
        "pending",
        "session-1",
        "0" * 64,
    ]
)
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | FINITE | TEXT | PROTOCOL_WORDS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(PROTOCOL_KEYS | TEXT, inner, max_size=5)
    ),
    max_leaves=15,
)


@FAST
@given(JSONISH)
def test_arbitrary_json_raises_only_octo_errors(value: Any) -> None:
    text = json.dumps(value)
    worker = SessionAuthenticator(SESSION, KEY, SessionRole.WORKER)
    for data in (
        text.encode(),
        json.dumps({"sequence": 1, "message": value, "auth_tag": "0" * 64}).encode(),
    ):
        for decode in (decode_message, worker.open):
            with contextlib.suppress(OctoError):  # any other error fails
                decode(data)


# Attenuation -------------------------------------------------------------------------------

POOL = [
    ResourceSelector(kind, name) for kind in ("file_root", "secret") for name in ("a", "b", "c")
]
SMALL = st.integers(0, 8)


@FAST
@given(
    st.builds(
        CapabilityGrant,
        TOKENS,
        st.sampled_from(["text", "json"]),
        SMALL,
        SMALL,
        SMALL,
        SMALL,
        st.lists(st.sampled_from(POOL), max_size=4),
    ),
    st.builds(
        GrantAttenuation,
        st.none() | SMALL,
        st.none() | SMALL,
        st.none() | SMALL,
        st.none() | SMALL,
        st.none() | st.lists(st.sampled_from(POOL), max_size=4).map(frozenset),
    ),
)
def test_attenuation_never_widens(parent: CapabilityGrant, attenuation: GrantAttenuation) -> None:
    try:
        child = parent.attenuate(attenuation)
    except OctoError:
        return
    child.validate()
    assert (child.tool, child.format) == (parent.tool, parent.format)
    assert 0 < child.max_calls <= parent.max_calls
    assert 0 < child.max_input_bytes <= parent.max_input_bytes
    assert 0 < child.max_output_bytes <= parent.max_output_bytes
    assert 0 <= child.max_compensations <= parent.max_compensations
    assert set(child.resources) <= set(parent.resources)


@FAST
@given(
    st.lists(GRANTS, max_size=4, unique_by=lambda g: g.tool),
    st.none() | st.lists(TOKENS, max_size=3).map(frozenset),
    st.dictionaries(TOKENS, st.builds(GrantAttenuation, st.none() | SMALL), max_size=2),
)
def test_manifest_attenuation_never_adds_or_widens(
    grants: list[CapabilityGrant],
    allowed: frozenset[str] | None,
    restrictions: dict[str, GrantAttenuation],
) -> None:
    manifest = CapabilityManifest(SESSION, grants)
    try:
        result = manifest.attenuate(ManifestAttenuation(allowed_tools=allowed, grants=restrictions))
    except OctoError:
        return
    result.validate()
    assert result.session_id == SESSION
    parents = {g.tool: g for g in grants}
    assert [g.tool for g in result.grants] == [
        g.tool for g in grants if g.tool in {r.tool for r in result.grants}
    ]
    for grant in result.grants:
        parent = parents[grant.tool]
        assert grant.max_calls <= parent.max_calls
        assert grant.max_compensations <= parent.max_compensations
        assert set(grant.resources) <= set(parent.resources)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            found.extend(_paths(child, (*prefix, key)))
    elif isinstance(node, list):
        for index, child in enumerate(node):
            found.extend(_paths(child, (*prefix, index)))
    return found


@FAST
@given(MESSAGES, st.data())
def test_structurally_mutated_messages_raise_only_octo_errors(
    message: Any, data: st.DataObject
) -> None:
    document = json.loads(encode_message(message))
    path = data.draw(st.sampled_from(_paths(document)[1:]), label="path")
    replacement = data.draw(JSONISH, label="replacement")
    parent = document
    for step in path[:-1]:
        parent = parent[step]
    if data.draw(st.booleans(), label="delete") and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    text = json.dumps(document).encode()
    worker = SessionAuthenticator(SESSION, KEY, SessionRole.WORKER)
    frame = b'{"sequence":1,"message":' + text + b',"auth_tag":"' + b"0" * 64 + b'"}'
    for decode, blob in ((decode_message, text), (worker.open, frame)):
        with contextlib.suppress(OctoError):  # any other error fails
            decode(blob)
