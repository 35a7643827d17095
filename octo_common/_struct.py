"""Construction rules shared by the protocol structs.

A protocol struct built by user code sets ``protocol_version = 5`` itself and
is validated before it is returned; a struct produced by the decoder is not
validated at construction, so that decoding can validate in the exact order
the protocol prescribes. msgspec builds decoded structs without
calling the class, so putting both rules in the metaclass's ``__call__``
separates the two cases cleanly; the same hook gives constructor-only
defaults to structs that are not validated at construction.

A field declared ``= leading_keyword(default=..., kw_only=True)`` is one the
wire always carries (decoding requires it) that a constructor call passes by
keyword or leaves out: the protocol version, first on the wire but never
positional. The metaclass removes the marker before msgspec sees the class,
so decoding still requires the field, and a type checker reads the same
declaration as a keyword-only parameter with a default.
"""

from __future__ import annotations

import weakref
from typing import Any, dataclass_transform

import msgspec

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


class _LeadingKeyword:
    """The marker ``leading_keyword()`` leaves in a class body."""

    __slots__ = ("default",)

    def __init__(self, default: Any) -> None:
        self.default = default


def leading_keyword(*, default: Any, kw_only: bool) -> Any:
    """Declare a leading wire field that constructors take by keyword only.

    Decoding requires the field; a constructor call that leaves it out gets
    ``default``. ``kw_only`` must be True: it is what a type checker reads.
    """
    if kw_only is not True:
        raise TypeError("a leading keyword field is keyword-only")
    return _LeadingKeyword(default)


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
    """Metaclass: leading keyword fields, then ``validate()`` on construction."""

    def __new__(
        mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **options: Any
    ) -> Any:
        marked = [key for key, value in namespace.items() if isinstance(value, _LeadingKeyword)]
        if len(marked) > 1:
            raise TypeError(f"{name}: one leading keyword field at most")
        if marked:
            namespace["__leading_keyword__"] = (marked[0], namespace.pop(marked[0]).default)
        cls = super().__new__(mcls, name, bases, namespace, **options)
        leading = getattr(cls, "__leading_keyword__", None)
        if leading is not None and cls.__struct_fields__[0] != leading[0]:
            raise TypeError(f"{name}: a leading keyword field must come first on the wire")
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        build = getattr(cls, "_build_arguments", None)
        if build is not None:
            args, kwargs = build(args, kwargs)
        leading = getattr(cls, "__leading_keyword__", None)
        if leading is not None:
            args = (kwargs.pop(leading[0], leading[1]), *args)
        obj = super().__call__(*args, **kwargs)
        obj.validate()
        mark_validated(obj)
        return obj


@dataclass_transform(field_specifiers=(msgspec.field, leading_keyword))
class ProtocolStruct(msgspec.Struct, frozen=True, weakref=True, metaclass=ProtocolStructMeta):
    """Base of the validating protocol structs."""

    def validate(self) -> None:
        """Check every protocol rule of this value; subclasses override."""
