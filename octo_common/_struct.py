"""Construction rules shared by the protocol structs (W§4.4).

A protocol struct built by user code sets ``protocol_version = 5`` itself and
is validated before it is returned; a struct produced by the decoder is not
validated at construction, so that decoding can validate in the exact order
the protocol prescribes (W§7.3). msgspec builds decoded structs without
calling the class, so putting both rules in the metaclass's ``__call__``
separates the two cases cleanly.
"""

from __future__ import annotations

from typing import Any

import msgspec

from octo_common.limits import PROTOCOL_VERSION


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
        return obj


class ProtocolStruct(msgspec.Struct, frozen=True, metaclass=ProtocolStructMeta):
    """Base of the validating protocol structs."""

    def validate(self) -> None:
        """Check every protocol rule of this value; subclasses override."""
