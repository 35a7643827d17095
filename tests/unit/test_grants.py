"""Capability grants, manifests and attenuation.

Fixtures: ``G`` is the ``math.add`` JSON grant with
max_calls=2, 128-byte limits and the ``network_origin`` ``math-api``
resource; ``GC = G.with_compensation_limit(1)``.
"""

# These tests call the API in the spec's own forms (`resources=[...]`,
# `ManifestAttenuation(allowed_tools=set())`); grants.py annotates
# those parameters as tuple/frozenset only, so mypy's arg-type check is off here.
# mypy: disable-error-code="arg-type"

from __future__ import annotations

import msgspec
import pytest

from octo_common.authorizer import SessionAuthorizer
from octo_common.codec import decode_struct, encode_struct
from octo_common.errors import (
    AttenuationExpandsResources,
    AttenuationWidensLimits,
    DuplicateGrant,
    InvalidGrant,
    InvalidToken,
    OctoError,
    SerializationError,
    TooManyGrants,
    TooManyResources,
    UnknownTool,
    UnsupportedVersion,
)
from octo_common.grants import (
    CapabilityGrant,
    CapabilityManifest,
    GrantAttenuation,
    ManifestAttenuation,
    ResourceKind,
    ResourceSelector,
)
from octo_common.messages import OpenSession, encode_message

API = ResourceSelector(ResourceKind.NETWORK_ORIGIN, "math-api")
SECRET = ResourceSelector(ResourceKind.SECRET, "api-key")
G = CapabilityGrant("math.add", "json", 2, 128, 128, 0, (API,))
GC = G.with_compensation_limit(1)


def _grant_json(**fields: object) -> str:
    base: dict[str, object] = {
        "tool": "math.add",
        "format": "json",
        "max_calls": 1,
        "max_input_bytes": 1,
        "max_output_bytes": 1,
    }
    base.update(fields)
    return msgspec.json.encode(base).decode()


def _texts(count: int) -> list[CapabilityGrant]:
    return [CapabilityGrant.text(f"tool-{index}") for index in range(count)]


# Construction and defaults ---------------------------------------


def test_text_and_json_builders_use_the_defaults() -> None:
    for grant, fmt in (
        (CapabilityGrant.text("text.echo"), "text"),
        (CapabilityGrant.json("t"), "json"),
    ):
        assert grant.format == fmt
        assert (grant.max_calls, grant.max_input_bytes, grant.max_output_bytes) == (1, 16384, 65536)
        assert grant.max_compensations == 0
        assert tuple(grant.resources) == ()


def test_with_compensation_limit_returns_a_changed_copy() -> None:
    assert GC.max_compensations == 1
    assert G.max_compensations == 0
    assert (GC.tool, GC.max_calls, tuple(GC.resources)) == (G.tool, G.max_calls, tuple(G.resources))


def test_grants_are_immutable_values() -> None:
    with pytest.raises(AttributeError):
        G.max_calls = 5  # type: ignore[misc]
    assert CapabilityGrant("math.add", "json", 2, 128, 128, 0, [API]) == G
    assert hash(CapabilityGrant("math.add", "json", 2, 128, 128, 0, [API])) == hash(G)


def test_resource_kind_is_a_str_enum() -> None:
    assert ResourceKind("secret") is ResourceKind.SECRET
    assert isinstance(ResourceKind.FILE_ROOT, str)
    assert str(ResourceKind.FILE_ROOT) == "file_root"
    assert [kind.value for kind in ResourceKind] == [
        "file_root",
        "executable",
        "network_origin",
        "secret",
    ]
    assert ResourceSelector("secret", "api-key") == SECRET


def test_resource_selector_validates_its_id_at_construction() -> None:
    with pytest.raises(InvalidToken) as raised:
        ResourceSelector(ResourceKind.SECRET, "API-KEY")
    assert (raised.value.field, raised.value.value) == ("resource selector", "API-KEY")


def test_resources_are_a_sorted_deduplicated_set() -> None:
    resources = [
        ResourceSelector("secret", "release-token"),
        ResourceSelector("network_origin", "release-api"),
        ResourceSelector("file_root", "b"),
        ResourceSelector("file_root", "a"),
        ResourceSelector("executable", "z"),
        ResourceSelector("file_root", "b"),
    ]
    grant = CapabilityGrant("release.publish", "json", resources=resources)
    assert [(r.kind.value, r.id) for r in grant.resources] == [
        ("file_root", "a"),
        ("file_root", "b"),
        ("executable", "z"),
        ("network_origin", "release-api"),
        ("secret", "release-token"),
    ]
    assert grant == CapabilityGrant("release.publish", "json", resources=reversed(resources))


def test_resource_ids_sort_by_bytes() -> None:
    grant = CapabilityGrant(
        "t",
        "json",
        resources=[
            ResourceSelector("secret", "b"),
            ResourceSelector("secret", "a-"),
            ResourceSelector("secret", "a"),
            ResourceSelector("secret", "b0"),
        ],
    )
    assert [r.id for r in grant.resources] == ["a", "a-", "b", "b0"]


# validate, in order --------------------------------------------------------


def test_tool_token_is_checked_first() -> None:
    with pytest.raises(InvalidToken) as raised:
        CapabilityGrant("Math.Add", "json", max_calls=0, max_input_bytes=0).validate()
    assert (raised.value.field, raised.value.value) == ("tool", "Math.Add")


def test_zero_max_calls_before_zero_byte_limits() -> None:
    with pytest.raises(InvalidGrant) as raised:
        CapabilityGrant("t", "json", max_calls=0, max_input_bytes=0).validate()
    assert raised.value.reason == "max_calls must be greater than zero"


@pytest.mark.parametrize("field", ["max_input_bytes", "max_output_bytes"])
def test_zero_byte_limits(field: str) -> None:
    grant = CapabilityGrant("t", "json", **{field: 0})
    with pytest.raises(InvalidGrant) as raised:
        grant.validate()
    assert raised.value.reason == "byte limits must be greater than zero"


def test_byte_limits_before_resource_count() -> None:
    grant = decode_struct(
        _grant_json(
            max_output_bytes=0, resources=[{"kind": "secret", "id": f"s{i}"} for i in range(65)]
        ),
        CapabilityGrant,
    )
    with pytest.raises(InvalidGrant):
        grant.validate()


def test_more_than_64_resources() -> None:
    resources = [ResourceSelector("secret", f"s{i:02}") for i in range(65)]
    with pytest.raises(TooManyResources) as raised:
        CapabilityGrant("t", "json", resources=resources).validate()
    assert raised.value.maximum == 64
    CapabilityGrant("t", "json", resources=resources[:64]).validate()


def test_resource_count_before_resource_ids() -> None:
    selectors = [{"kind": "secret", "id": f"s{i}"} for i in range(64)] + [
        {"kind": "secret", "id": "BAD"}
    ]
    grant = decode_struct(_grant_json(resources=selectors), CapabilityGrant)
    with pytest.raises(TooManyResources):
        grant.validate()


def test_resource_ids_are_checked_last() -> None:
    grant = decode_struct(
        _grant_json(resources=[{"kind": "secret", "id": "Bad Id"}]), CapabilityGrant
    )
    with pytest.raises(InvalidToken) as raised:
        grant.validate()
    assert (raised.value.field, raised.value.value) == ("resource selector", "Bad Id")


def test_zero_compensations_are_valid() -> None:
    G.validate()
    GC.validate()


# Decoding -----------------------------------------------------------------


def test_decoding_fills_defaults_and_ignores_unknown_keys() -> None:
    grant = decode_struct(
        _grant_json(future="x", resources=[{"kind": "secret", "id": "k", "x": 1}]), CapabilityGrant
    )
    assert grant.max_compensations == 0
    assert tuple(grant.resources) == (ResourceSelector("secret", "k"),)
    assert decode_struct(_grant_json(), CapabilityGrant).resources == ()


@pytest.mark.parametrize(
    "fields",
    [
        {"format": "xml"},
        {"max_calls": 4294967296},
        {"max_calls": -1},
        {"max_calls": True},
        {"max_calls": 1.0},
        {"max_compensations": "1"},
        {"resources": [{"kind": "socket", "id": "a"}]},
        {"resources": {"kind": "secret", "id": "a"}},
        {"tool": 7},
    ],
)
def test_decoding_rejects_bad_types_ranges_and_spellings(fields: dict[str, object]) -> None:
    with pytest.raises(SerializationError):
        decode_struct(_grant_json(**fields), CapabilityGrant)


def test_decoding_rejects_duplicate_keys() -> None:
    with pytest.raises(SerializationError):
        decode_struct(_grant_json()[:-1] + ',"max_calls":2}', CapabilityGrant)


def test_encoding_writes_all_seven_fields_in_order() -> None:
    grant = decode_struct(_grant_json(), CapabilityGrant)
    assert encode_struct(grant) == (
        b'{"tool":"math.add","format":"json","max_calls":1,"max_input_bytes":1,'
        b'"max_output_bytes":1,"max_compensations":0,"resources":[]}'
    )
    assert encode_struct(G).endswith(b'"resources":[{"kind":"network_origin","id":"math-api"}]}')


# Fingerprint -----------------------------------------------------------------


@pytest.mark.parametrize(
    "changed",
    [
        CapabilityGrant("math.sub", "json", 2, 128, 128, 0, (API,)),
        CapabilityGrant("math.add", "text", 2, 128, 128, 0, (API,)),
        CapabilityGrant("math.add", "json", 1, 128, 128, 0, (API,)),
        CapabilityGrant("math.add", "json", 2, 127, 128, 0, (API,)),
        CapabilityGrant("math.add", "json", 2, 128, 129, 0, (API,)),
        CapabilityGrant("math.add", "json", 2, 128, 128, 1, (API,)),
        CapabilityGrant("math.add", "json", 2, 128, 128, 0, ()),
        CapabilityGrant("math.add", "json", 2, 128, 128, 0, (API, SECRET)),
        CapabilityGrant(
            "math.add", "json", 2, 128, 128, 0, (ResourceSelector("secret", "math-api"),)
        ),
        CapabilityGrant(
            "math.add", "json", 2, 128, 128, 0, (ResourceSelector("network_origin", "math-ap"),)
        ),
    ],
)
def test_fingerprint_changes_with_any_field(changed: CapabilityGrant) -> None:
    assert changed.compensation_fingerprint() != G.compensation_fingerprint()


def test_fingerprint_ignores_the_session_and_resource_order() -> None:
    one = CapabilityManifest("session-1", [G]).grant("math.add")
    two = CapabilityManifest("session-2", [G]).grant("math.add")
    assert one is not None and two is not None
    assert one.compensation_fingerprint() == two.compensation_fingerprint()
    a = CapabilityGrant("t", "json", resources=[API, SECRET])
    b = CapabilityGrant("t", "json", resources=[SECRET, API, SECRET])
    assert a.compensation_fingerprint() == b.compensation_fingerprint()


def test_fingerprint_validates_first() -> None:
    with pytest.raises(InvalidGrant):
        CapabilityGrant("t", "json", max_calls=0).compensation_fingerprint()


def test_fingerprint_is_64_lowercase_hex() -> None:
    fingerprint = G.compensation_fingerprint()
    assert len(fingerprint) == 64
    assert set(fingerprint) <= set("0123456789abcdef")


# Manifests --------------------------------------------------------------------


def test_duplicate_grant_example_1() -> None:
    with pytest.raises(DuplicateGrant) as raised:
        CapabilityManifest("session-1", [G, G])
    assert raised.value.tool == "math.add"


def test_129_grants_raise_at_construction_and_128_pass() -> None:
    with pytest.raises(TooManyGrants) as raised:
        CapabilityManifest("session-1", _texts(129))
    assert raised.value.maximum == 128
    manifest = CapabilityManifest("session-1", _texts(128))
    assert len(manifest.grants) == 128


def test_example_1_oversized_manifest_everywhere_it_is_validated() -> None:
    body = ",".join(
        f'{{"tool":"t{i}","format":"text","max_calls":1,"max_input_bytes":1,"max_output_bytes":1}}'
        for i in range(129)
    )
    manifest_json = '{"protocol_version":5,"session_id":"session-1","grants":[' + body + "]}"
    unchecked = decode_struct(manifest_json, CapabilityManifest)  # decoding alone does not validate
    with pytest.raises(TooManyGrants):
        unchecked.validate()
    with pytest.raises(TooManyGrants):
        SessionAuthorizer(unchecked)
    # Frame decoding and seal are covered in test_frames.


def test_manifest_check_order() -> None:
    # Version before count.
    text = (
        '{"protocol_version":6,"session_id":"S","grants":['
        + ",".join(
            ['{"tool":"a","format":"text","max_calls":1,"max_input_bytes":1,"max_output_bytes":1}']
            * 129
        )
        + "]}"
    )
    manifest = decode_struct(text, CapabilityManifest)
    with pytest.raises(UnsupportedVersion) as version:
        manifest.validate()
    assert version.value.actual == 6
    # Count before the session id token.
    with pytest.raises(TooManyGrants):
        CapabilityManifest("Bad Session", _texts(129))
    # Session id before any grant.
    with pytest.raises(InvalidToken) as token:
        CapabilityManifest("S", [CapabilityGrant("t", "json", max_calls=0)])
    assert (token.value.field, token.value.value) == ("session id", "S")
    # Grants in order: validity of a grant before the duplicate check of a later one.
    with pytest.raises(InvalidGrant):
        CapabilityManifest("s", [G, CapabilityGrant("x", "json", max_calls=0), G])
    with pytest.raises(DuplicateGrant):
        CapabilityManifest("s", [G, G, CapabilityGrant("x", "json", max_calls=0)])


def test_a_zero_grant_manifest_is_valid() -> None:
    manifest = CapabilityManifest("session-1", [])
    assert manifest.protocol_version == 5
    assert manifest.grants == ()
    assert manifest.grant("math.add") is None


def test_grant_lookup() -> None:
    manifest = CapabilityManifest("session-1", [G, CapabilityGrant.text("text.echo")])
    assert manifest.grant("math.add") == G
    assert manifest.grant("text.echo") == CapabilityGrant.text("text.echo")
    assert manifest.grant("math.sub") is None


def test_manifest_decoding_ignores_unknown_keys() -> None:
    manifest = decode_struct(
        '{"protocol_version":5,"session_id":"s","grants":[],"x":[1]}', CapabilityManifest
    )
    assert manifest == CapabilityManifest("s", [])
    assert encode_struct(manifest) == b'{"protocol_version":5,"session_id":"s","grants":[]}'


def test_manifest_version_out_of_u16_is_a_serialization_error() -> None:
    with pytest.raises(SerializationError):
        decode_struct('{"protocol_version":70000,"session_id":"s","grants":[]}', CapabilityManifest)


# Grant attenuation ---------------------------------------------------------------


def test_attenuation_lowers_each_limit() -> None:
    lowered = GC.attenuate(
        GrantAttenuation(
            max_calls=1,
            max_input_bytes=64,
            max_output_bytes=32,
            max_compensations=0,
            resources=set(),
        )
    )
    assert (lowered.max_calls, lowered.max_input_bytes, lowered.max_output_bytes) == (1, 64, 32)
    assert lowered.max_compensations == 0
    assert tuple(lowered.resources) == ()
    assert (lowered.tool, lowered.format) == ("math.add", "json")


def test_an_empty_attenuation_keeps_the_grant() -> None:
    assert GC.attenuate(GrantAttenuation()) == GC


def test_attenuation_validates_the_parent_first() -> None:
    bad = CapabilityGrant("t", "json", max_calls=0)
    with pytest.raises(InvalidGrant) as raised:
        bad.attenuate(GrantAttenuation(max_calls=5))
    assert raised.value.reason == "max_calls must be greater than zero"


@pytest.mark.parametrize("field", ["max_calls", "max_input_bytes", "max_output_bytes"])
def test_zero_attenuated_limits_are_invalid(field: str) -> None:
    with pytest.raises(InvalidGrant) as raised:
        G.attenuate(GrantAttenuation(**{field: 0}))
    assert raised.value.reason == "attenuated limits must be greater than zero"


def test_the_zero_check_precedes_the_widening_check() -> None:
    with pytest.raises(InvalidGrant):
        G.attenuate(GrantAttenuation(max_calls=0, max_input_bytes=10_000))


@pytest.mark.parametrize(
    "attenuation",
    [
        GrantAttenuation(max_calls=3),
        GrantAttenuation(max_input_bytes=129),
        GrantAttenuation(max_output_bytes=129),
        GrantAttenuation(max_compensations=2),
        GrantAttenuation(max_calls=1, max_compensations=2),
    ],
)
def test_widening_any_limit_is_refused(attenuation: GrantAttenuation) -> None:
    with pytest.raises(AttenuationWidensLimits):
        GC.attenuate(attenuation)


def test_example_2_compensations_only_go_down() -> None:
    with pytest.raises(AttenuationWidensLimits):
        G.with_compensation_limit(2).attenuate(GrantAttenuation(max_compensations=3))
    assert (
        G.with_compensation_limit(2)
        .attenuate(GrantAttenuation(max_compensations=0))
        .max_compensations
        == 0
    )
    assert (
        G.with_compensation_limit(2)
        .attenuate(GrantAttenuation(max_compensations=2))
        .max_compensations
        == 2
    )
    with pytest.raises(AttenuationWidensLimits):
        G.attenuate(GrantAttenuation(max_compensations=1))


def test_example_2_added_resources_are_refused() -> None:
    with pytest.raises(AttenuationExpandsResources):
        G.attenuate(GrantAttenuation(resources={API, SECRET}))
    with pytest.raises(AttenuationExpandsResources):
        G.attenuate(GrantAttenuation(resources={SECRET}))


def test_widening_is_checked_before_resources() -> None:
    with pytest.raises(AttenuationWidensLimits):
        G.attenuate(GrantAttenuation(max_calls=3, resources={SECRET}))


def test_resources_may_shrink_to_a_subset() -> None:
    parent = CapabilityGrant("t", "json", resources=[API, SECRET])
    assert tuple(parent.attenuate(GrantAttenuation(resources=[SECRET, SECRET])).resources) == (
        SECRET,
    )
    assert tuple(parent.attenuate(GrantAttenuation(resources=frozenset())).resources) == ()
    assert parent.attenuate(GrantAttenuation()).resources == parent.resources


# Manifest attenuation ---------------------------------------------------------------


ECHO = CapabilityGrant.text("text.echo")
MANIFEST = CapabilityManifest("session-1", [GC, ECHO])


def test_example_3_empty_allowed_tools_gives_a_zero_grant_manifest() -> None:
    result = MANIFEST.attenuate(ManifestAttenuation(allowed_tools=set()))
    assert result.grants == ()
    assert result.session_id == "session-1"
    result.validate()


def test_allowed_tools_none_keeps_every_grant_in_order() -> None:
    assert MANIFEST.attenuate(ManifestAttenuation()).grants == (GC, ECHO)


def test_allowed_tools_filters_but_keeps_original_order() -> None:
    manifest = CapabilityManifest("s", [ECHO, GC, CapabilityGrant.text("z.last")])
    result = manifest.attenuate(ManifestAttenuation(allowed_tools={"z.last", "text.echo"}))
    assert [g.tool for g in result.grants] == ["text.echo", "z.last"]


def test_per_tool_restrictions_apply_to_kept_grants() -> None:
    result = MANIFEST.attenuate(
        ManifestAttenuation(grants={"math.add": GrantAttenuation(max_compensations=0)})
    )
    grant = result.grant("math.add")
    assert grant is not None and grant.max_compensations == 0
    assert result.grant("text.echo") == ECHO


def test_restrictions_of_dropped_tools_are_only_existence_checked() -> None:
    result = MANIFEST.attenuate(
        ManifestAttenuation(
            allowed_tools={"text.echo"}, grants={"math.add": GrantAttenuation(max_calls=99)}
        )
    )
    assert result.grants == (ECHO,)


def test_unknown_tools_are_refused() -> None:
    with pytest.raises(UnknownTool) as raised:
        MANIFEST.attenuate(ManifestAttenuation(grants={"math.sub": GrantAttenuation()}))
    assert raised.value.tool == "math.sub"
    with pytest.raises(UnknownTool) as raised:
        MANIFEST.attenuate(ManifestAttenuation(allowed_tools={"math.sub"}))
    assert raised.value.tool == "math.sub"


def test_allowed_tools_must_be_tokens() -> None:
    with pytest.raises(InvalidToken) as raised:
        MANIFEST.attenuate(ManifestAttenuation(allowed_tools={"Math.Add"}))
    assert (raised.value.field, raised.value.value) == ("tool", "Math.Add")


def test_grant_keys_are_checked_before_allowed_tools() -> None:
    with pytest.raises(UnknownTool) as raised:
        MANIFEST.attenuate(
            ManifestAttenuation(
                allowed_tools={"also.unknown"}, grants={"first.unknown": GrantAttenuation()}
            )
        )
    assert raised.value.tool == "first.unknown"


def test_manifest_attenuation_cannot_widen_a_kept_grant() -> None:
    with pytest.raises(AttenuationWidensLimits):
        MANIFEST.attenuate(
            ManifestAttenuation(grants={"math.add": GrantAttenuation(max_compensations=2)})
        )


def test_attenuation_encodings_omit_none_fields() -> None:
    assert encode_struct(GrantAttenuation(max_calls=1)) == b'{"max_calls":1}'
    assert encode_struct(GrantAttenuation()) == b"{}"
    decoded = decode_struct('{"max_calls":1,"unknown":2}', GrantAttenuation)
    assert decoded == GrantAttenuation(max_calls=1)
    manifest_attenuation = decode_struct('{"allowed_tools":["a"],"x":1}', ManifestAttenuation)
    assert manifest_attenuation.allowed_tools == frozenset({"a"})
    assert dict(manifest_attenuation.grants) == {}


# Integer widths --------------------------------------------------------------


@pytest.mark.parametrize("value", [2**32, -1, True])
def test_limits_outside_u32_are_refused_before_encoding(value: int) -> None:
    with pytest.raises(OctoError):
        grant = CapabilityGrant("t", "json", max_calls=value)
        grant.validate()
        encode_message(OpenSession(CapabilityManifest("s", [grant])))


@pytest.mark.parametrize(
    "attenuation", [GrantAttenuation(max_calls=-1), GrantAttenuation(max_compensations=-5)]
)
def test_negative_attenuated_limits_are_refused(attenuation: GrantAttenuation) -> None:
    with pytest.raises(OctoError):
        GC.attenuate(attenuation)
