"""Construction rules shared by the protocol structs.

A protocol struct built by user code sets ``protocol_version = 5`` itself and
is validated before it is returned; a struct produced by the decoder is not
validated at construction, so that decoding can validate in the exact order
the protocol prescribes. msgspec builds decoded structs without
calling the class, so putting both rules in the metaclass's ``__call__``
separates the two cases cleanly; the same hook gives constructor-only
defaults to structs that are not validated at construction.
"""

from __future__ import annotations

import weakref
from typing import Any

import msgspec

from octo_common.limits import PROTOCOL_VERSION

# Structs validated since they were built. They are immutable, so a validated
# struct stays valid: sealing it again need not repeat the work. Keyed by
# identity (hashing a struct would walk it); entries vanish with the struct.
_VALIDATED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def mark_validated(obj: Any) -> None:
    """Remember that ``obj`` passed ``validate()``."""
    _VALIDATED[id(obj)] = obj


def is_validated(obj: Any) -> bool:
    """True when ``obj`` itself passed ``validate()`` since it was built."""
    return _VALIDATED.get(id(obj)) is obj


class BuildArgumentsMeta(msgspec.StructMeta):
    """Metaclass: a class's ``_build_arguments(args, kwargs)`` shapes constructor calls.

    It runs only when user code calls the class, never when the decoder builds
    a struct: constructor defaults set there are never decoding
    defaults, so a field the wire must carry stays required.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        build = getattr(cls, "_build_arguments", None)
        if build is not None:
            args, kwargs = build(args, kwargs)
        return super().__call__(*args, **kwargs)


class ProtocolStructMeta(msgspec.StructMeta):
    """Metaclass: optional version injection, then ``validate()`` on construction."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        build = getattr(cls, "_build_arguments", None)
        if build is not None:
            args, kwargs = build(args, kwargs)
        if getattr(cls, "__versioned__", False):
            # The version is the first field on the wire but never positional.
            args = (kwargs.pop("protocol_version", PROTOCOL_VERSION), *args)
        obj = super().__call__(*args, **kwargs)
        obj.validate()
        mark_validated(obj)
        return obj


class ProtocolStruct(msgspec.Struct, frozen=True, weakref=True, metaclass=ProtocolStructMeta):
    """Base of the validating protocol structs."""

    def validate(self) -> None:
        """Check every protocol rule of this value; subclasses override."""
