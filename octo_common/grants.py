"""Capability grants, manifests and attenuation.

A grant names one tool, its payload format and its limits; a manifest is the
set of grants of one session. Attenuation can lower a limit (the
compensation budget included, down to zero) or drop resources and tools, and
never raise or add anything. The grant fingerprint covers the whole grant,
so any change of policy stops a stored compensation intent.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Annotated, Any, Literal

import msgspec

from octo_common._struct import ProtocolStruct, ShapedStruct, constructor_default, leading_keyword
from octo_common.codec import encode_struct
from octo_common.digest import grant_fingerprint_of_encoding
from octo_common.errors import (
    AttenuationExpandsResources,
    AttenuationWidensLimits,
    DuplicateGrant,
    InvalidGrant,
    SerializationError,
    TooManyGrants,
    TooManyResources,
    UnknownTool,
    UnsupportedVersion,
)
from octo_common.ids import validate_token
from octo_common.limits import (
    DEFAULT_MAX_CALLS,
    DEFAULT_MAX_COMPENSATIONS,
    DEFAULT_MAX_INPUT_BYTES,
    DEFAULT_MAX_OUTPUT_BYTES,
    MAX_CAPABILITY_GRANTS_PER_MANIFEST,
    MAX_RESOURCES_PER_GRANT,
    MAX_U32,
    PROTOCOL_VERSION,
)

__all__ = [
    "CapabilityGrant",
    "CapabilityManifest",
    "GrantAttenuation",
    "ManifestAttenuation",
    "ResourceKind",
    "ResourceSelector",
]

U16 = Annotated[int, msgspec.Meta(ge=0, le=65535)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=MAX_U32)]
Format = Literal["text", "json"]


class ResourceKind(enum.StrEnum):
    """Kinds of resource selectors, in their sort order."""

    FILE_ROOT = "file_root"
    EXECUTABLE = "executable"
    NETWORK_ORIGIN = "network_origin"
    SECRET = "secret"


_KIND_ORDER = {kind: index for index, kind in enumerate(ResourceKind)}


class ResourceSelector(ProtocolStruct, frozen=True):
    """One member of a grant's resource set; ``id`` is validated at construction.

    A ``kind`` given as its wire spelling becomes the ``ResourceKind`` (an
    unknown spelling is a ``ValueError``).
    """

    kind: ResourceKind
    id: str

    def __post_init__(self) -> None:
        kind: Any = self.kind
        if type(kind) is not ResourceKind:
            msgspec.structs.force_setattr(self, "kind", ResourceKind(kind))

    def validate(self) -> None:
        validate_token("resource selector", self.id)

    def sort_key(self) -> tuple[int, bytes]:
        return (_KIND_ORDER[self.kind], self.id.encode("utf-8"))


def _normalise_resources(resources: Iterable[ResourceSelector]) -> tuple[ResourceSelector, ...]:
    unique = set(resources)
    return tuple(sorted(unique, key=ResourceSelector.sort_key))


class CapabilityGrant(ShapedStruct, frozen=True):
    """A grant for one tool. Immutable; validated by ``validate()``.

    Decoding requires ``tool``, ``format``, ``max_calls``, ``max_input_bytes``
    and ``max_output_bytes`` (the wire has no default for them; a grant
    without one is a ``SerializationError``); only ``max_compensations`` (0)
    and ``resources`` (empty) may be absent. The constructor keeps the
    defaults for all five limits. ``resources`` is kept as a tuple, sorted and
    without repeats.
    """

    tool: str
    format: Format
    max_calls: U32 = constructor_default(default=DEFAULT_MAX_CALLS)
    max_input_bytes: U32 = constructor_default(default=DEFAULT_MAX_INPUT_BYTES)
    max_output_bytes: U32 = constructor_default(default=DEFAULT_MAX_OUTPUT_BYTES)
    max_compensations: U32 = DEFAULT_MAX_COMPENSATIONS
    resources: tuple[ResourceSelector, ...] = ()

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise SerializationError("grant format must be text or json")
        resources = self.resources
        if not isinstance(resources, tuple) or len(resources) > 1:
            msgspec.structs.force_setattr(self, "resources", _normalise_resources(resources))

    @classmethod
    def text(cls, tool: str) -> CapabilityGrant:
        return cls(tool, "text")

    @classmethod
    def json(cls, tool: str) -> CapabilityGrant:
        return cls(tool, "json")

    def with_compensation_limit(self, limit: int) -> CapabilityGrant:
        """A copy with ``max_compensations = limit``."""
        return msgspec.structs.replace(self, max_compensations=limit)

    def validate(self) -> None:
        validate_token("tool", self.tool)
        for limit in (
            self.max_calls,
            self.max_input_bytes,
            self.max_output_bytes,
            self.max_compensations,
        ):
            if type(limit) is not int or not 0 <= limit <= MAX_U32:
                raise InvalidGrant("limits must be integers in 0..4294967295")
        if self.max_calls == 0:
            raise InvalidGrant("max_calls must be greater than zero")
        if self.max_input_bytes == 0 or self.max_output_bytes == 0:
            raise InvalidGrant("byte limits must be greater than zero")
        if len(self.resources) > MAX_RESOURCES_PER_GRANT:
            raise TooManyResources(MAX_RESOURCES_PER_GRANT)
        for resource in self.resources:
            if not isinstance(resource, ResourceSelector):
                raise InvalidGrant("resources must be ResourceSelector values")
            validate_token("resource selector", resource.id)

    def compensation_fingerprint(self) -> str:
        """BLAKE3 over the compact encoding of the whole grant."""
        self.validate()
        return grant_fingerprint_of_encoding(encode_struct(self))

    def attenuate(self, attenuation: GrantAttenuation) -> CapabilityGrant:
        """Lower limits or drop resources; never raise or add."""
        self.validate()
        a = attenuation
        calls = self.max_calls if a.max_calls is None else a.max_calls
        input_bytes = self.max_input_bytes if a.max_input_bytes is None else a.max_input_bytes
        output_bytes = self.max_output_bytes if a.max_output_bytes is None else a.max_output_bytes
        compensations = (
            self.max_compensations if a.max_compensations is None else a.max_compensations
        )
        if calls == 0 or input_bytes == 0 or output_bytes == 0:
            raise InvalidGrant("attenuated limits must be greater than zero")
        if (
            calls > self.max_calls
            or input_bytes > self.max_input_bytes
            or output_bytes > self.max_output_bytes
            or compensations > self.max_compensations
        ):
            raise AttenuationWidensLimits()
        if a.resources is None:
            resources = self.resources
        else:
            resources = _normalise_resources(a.resources)
            if not set(resources) <= set(self.resources):
                raise AttenuationExpandsResources()
        grant = CapabilityGrant(
            self.tool,
            self.format,
            calls,
            input_bytes,
            output_bytes,
            compensations,
            resources,
        )
        grant.validate()
        return grant

    def __repr__(self) -> str:
        return (
            f"CapabilityGrant(tool={self.tool!r}, format={self.format!r}, "
            f"max_calls={self.max_calls}, max_input_bytes={self.max_input_bytes}, "
            f"max_output_bytes={self.max_output_bytes}, "
            f"max_compensations={self.max_compensations}, resources={list(self.resources)!r})"
        )


class GrantAttenuation(msgspec.Struct, frozen=True, omit_defaults=True):
    """Optional new limits and resources for one grant (None keeps the parent's).

    ``resources`` is kept as a frozenset.
    """

    max_calls: U32 | None = None
    max_input_bytes: U32 | None = None
    max_output_bytes: U32 | None = None
    max_compensations: U32 | None = None
    resources: AbstractSet[ResourceSelector] | None = None

    def __post_init__(self) -> None:
        resources: Any = self.resources
        if resources is not None and not isinstance(resources, frozenset):
            msgspec.structs.force_setattr(self, "resources", frozenset(resources))


class CapabilityManifest(ProtocolStruct, frozen=True):
    """The grants of one session; version 5, validated at construction.

    ``grants`` is kept as a tuple.
    """

    protocol_version: U16 = leading_keyword(default=PROTOCOL_VERSION, kw_only=True)
    session_id: str
    grants: tuple[CapabilityGrant, ...]

    def __post_init__(self) -> None:
        grants: Any = self.grants
        if not isinstance(grants, tuple):
            msgspec.structs.force_setattr(self, "grants", tuple(grants))

    def validate(self) -> None:
        if self.protocol_version != PROTOCOL_VERSION:
            raise UnsupportedVersion(self.protocol_version)
        if len(self.grants) > MAX_CAPABILITY_GRANTS_PER_MANIFEST:
            raise TooManyGrants(MAX_CAPABILITY_GRANTS_PER_MANIFEST)
        validate_token("session id", self.session_id)
        seen: set[str] = set()
        for grant in self.grants:
            grant.validate()
            if grant.tool in seen:
                raise DuplicateGrant(grant.tool)
            seen.add(grant.tool)

    def grant(self, tool: str) -> CapabilityGrant | None:
        """The grant for ``tool``, or None."""
        for grant in self.grants:
            if grant.tool == tool:
                return grant
        return None

    def tools(self) -> list[str]:
        return [grant.tool for grant in self.grants]

    def attenuate(self, attenuation: ManifestAttenuation) -> CapabilityManifest:
        """Drop tools, lower limits; never add or widen."""
        self.validate()
        tools = {grant.tool for grant in self.grants}
        for tool in attenuation.grants:
            if tool not in tools:
                raise UnknownTool(tool)
        allowed = attenuation.allowed_tools
        if allowed is not None:
            for tool in sorted(allowed):
                validate_token("tool", tool)
                if tool not in tools:
                    raise UnknownTool(tool)
        kept: list[CapabilityGrant] = []
        for grant in self.grants:
            if allowed is not None and grant.tool not in allowed:
                continue
            restriction = attenuation.grants.get(grant.tool)
            kept.append(grant if restriction is None else grant.attenuate(restriction))
        return CapabilityManifest(self.session_id, tuple(kept))


class ManifestAttenuation(msgspec.Struct, frozen=True, omit_defaults=True):
    """Tools to keep (None keeps all) and per-tool grant attenuations.

    ``allowed_tools`` is kept as a frozenset and ``grants`` as a dict.
    """

    allowed_tools: AbstractSet[str] | None = None
    grants: Mapping[str, GrantAttenuation] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        allowed: Any = self.allowed_tools
        if allowed is not None and not isinstance(allowed, frozenset):
            msgspec.structs.force_setattr(self, "allowed_tools", frozenset(allowed))
        grants: Any = self.grants
        if not isinstance(grants, dict):
            msgspec.structs.force_setattr(self, "grants", dict(grants or {}))
