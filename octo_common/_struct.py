"""Construction rules shared by the protocol structs.

A protocol struct built by user code sets ``protocol_version = 5`` itself and
is validated before it is returned; a struct produced by the decoder is not
validated at construction, so that decoding can validate in the exact order
the protocol prescribes. msgspec builds decoded structs without
calling the class, so putting both rules in the metaclass's ``__call__``
separates the two cases cleanly.

Field specifiers shape a constructor without changing what decoding
requires. The metaclass removes each one from the class body before msgspec
sees the class, and a type checker reads the same declarations (through
``dataclass_transform``), so the constructor's signature is never written
twice:

* ``= leading_keyword(default=..., kw_only=True)``: a field the wire always
  carries first that a constructor call passes by keyword or leaves out
  (the protocol version).
* ``= constructor_default(default=...)``: a field the wire always carries
  whose constructor parameter has a default (a grant's limits).
* ``= laid_flat()``: a constructor parameter that is not a field, a part
  whose fields the struct carries flat on the wire; each of those is
  declared ``= part_field(init=False)`` and the constructor takes it from
  the part's attribute of the same name (a compensation's binding). Passed
  by keyword, the flat fields themselves are accepted too.
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


class _Marker:
    """What a field specifier leaves in a class body, until the metaclass reads it."""

    __slots__ = ("default",)

    def __init__(self, default: Any = None) -> None:
        self.default = default


class _LeadingKeyword(_Marker):
    __slots__ = ()


class _ConstructorDefault(_Marker):
    __slots__ = ()


class _PartField(_Marker):
    __slots__ = ()


class _LaidFlat(_Marker):
    __slots__ = ()


def leading_keyword(*, default: Any, kw_only: bool) -> Any:
    """Declare a leading wire field that constructors take by keyword only.

    Decoding requires the field; a constructor call that leaves it out gets
    ``default``. ``kw_only`` must be True: it is what a type checker reads.
    """
    if kw_only is not True:
        raise TypeError("a leading keyword field is keyword-only")
    return _LeadingKeyword(default)


def constructor_default(*, default: Any) -> Any:
    """Declare a wire field whose constructor parameter defaults to ``default``.

    Decoding still requires the field.
    """
    return _ConstructorDefault(default)


def part_field(*, init: bool) -> Any:
    """Declare a wire field the constructor takes from the ``laid_flat()`` part.

    ``init`` must be False: it is what a type checker reads.
    """
    if init is not False:
        raise TypeError("a part field is filled from its part: init=False")
    return _PartField()


def laid_flat() -> Any:
    """Declare a constructor parameter that fills the ``part_field()`` fields."""
    return _LaidFlat()


class _Constructor:
    """How a shaped constructor call's arguments become the struct's fields."""

    __slots__ = ("defaults", "filled", "name", "params", "part")

    def __init__(
        self,
        name: str,
        params: tuple[str, ...],
        defaults: tuple[tuple[str, Any], ...],
        part: str | None,
        filled: tuple[str, ...],
    ) -> None:
        self.name = name
        self.params = params
        self.defaults = defaults
        self.part = part
        self.filled = filled

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        params = self.params
        if len(args) > len(params):
            raise TypeError(
                f"{self.name}() takes {len(params)} positional arguments but {len(args)} were given"
            )
        values = dict(zip(params, args, strict=False))
        for key, value in kwargs.items():
            if key in values:
                raise TypeError(f"{self.name}() got multiple values for argument {key!r}")
            values[key] = value
        for key, default in self.defaults:
            values.setdefault(key, default)
        part = self.part
        if part is not None and part in values:
            whole = values.pop(part)
            for key in self.filled:
                try:
                    values[key] = getattr(whole, key)
                except AttributeError:
                    raise TypeError(f"{self.name}(): {part} has no {key!r}") from None
        return values

    def extended(self, cls: Any, leading: str | None) -> _Constructor:
        """This constructor for a subclass: the fields it adds come last."""
        taken = {*self.params, *self.filled, leading}
        added = tuple(key for key in cls.__struct_fields__ if key not in taken)
        return _Constructor(
            cls.__name__, self.params + added, self.defaults, self.part, self.filled
        )


def _shape(
    cls: Any, declared: list[str], markers: dict[str, _Marker], leading: str | None
) -> _Constructor:
    """The constructor of ``cls``: its fields in wire order less the leading
    keyword and the part fields, with the part where the class body declares it
    (before the first field declared after it)."""
    name = cls.__name__
    parts = [key for key in declared if isinstance(markers.get(key), _LaidFlat)]
    filled = tuple(key for key, m in markers.items() if isinstance(m, _PartField))
    if len(parts) > 1:
        raise TypeError(f"{name}: one laid-flat part at most")
    if bool(parts) != bool(filled):
        raise TypeError(f"{name}: a laid-flat part and its part fields come together")
    params = [key for key in cls.__struct_fields__ if key != leading and key not in filled]
    part = parts[0] if parts else None
    if part is not None:
        after = declared[declared.index(part) + 1 :]
        following = [key for key in params if key in after]
        params.insert(params.index(following[0]) if following else len(params), part)
    defaults = tuple(
        (key, m.default) for key, m in markers.items() if isinstance(m, _ConstructorDefault)
    )
    return _Constructor(name, tuple(params), defaults, part, filled)


class ShapedStructMeta(msgspec.StructMeta):
    """Metaclass: the field specifiers above shape the constructor (see the module
    docstring). It runs only when user code calls the class, never when the
    decoder builds a struct: constructor defaults are never decoding defaults."""

    # Set on a class whose body declares them; read through the class.
    __leading_keyword__: tuple[str, Any] | None = None
    __constructor__: _Constructor | None = None

    def __new__(
        mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **options: Any
    ) -> Any:
        declared = list(namespace.get("__annotations__", {}))
        markers = {
            key: namespace.pop(key)
            for key, value in list(namespace.items())
            if isinstance(value, _Marker)
        }
        if markers and any(getattr(base, "__constructor__", None) for base in bases):
            raise TypeError(f"{name}: a subclass of a shaped struct adds plain fields only")
        leading = [key for key, m in markers.items() if isinstance(m, _LeadingKeyword)]
        if len(leading) > 1:
            raise TypeError(f"{name}: one leading keyword field at most")
        if leading:
            namespace["__leading_keyword__"] = (leading[0], markers.pop(leading[0]).default)
        parts = {key for key, m in markers.items() if isinstance(m, _LaidFlat)}
        if parts:
            annotations = namespace["__annotations__"]
            namespace["__annotations__"] = {
                key: value for key, value in annotations.items() if key not in parts
            }
        cls = super().__new__(mcls, name, bases, namespace, **options)
        first = cls.__leading_keyword__
        if first is not None and cls.__struct_fields__[0] != first[0]:
            raise TypeError(f"{name}: a leading keyword field must come first on the wire")
        inherited = cls.__constructor__
        leading_name = None if first is None else first[0]
        if markers:
            cls.__constructor__ = _shape(cls, declared, markers, leading_name)
        elif inherited is not None:
            cls.__constructor__ = inherited.extended(cls, leading_name)
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        shape = cls.__constructor__
        if shape is not None:
            kwargs = shape.bind(args, kwargs)
            args = ()
        leading = cls.__leading_keyword__
        if leading is not None:
            args = (kwargs.pop(leading[0], leading[1]), *args)
        return super().__call__(*args, **kwargs)


class ProtocolStructMeta(ShapedStructMeta):
    """Metaclass: a shaped constructor, then ``validate()`` on construction."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        obj.validate()
        mark_validated(obj)
        return obj


@dataclass_transform(
    field_specifiers=(msgspec.field, leading_keyword, constructor_default, part_field, laid_flat)
)
class ShapedStruct(msgspec.Struct, frozen=True, metaclass=ShapedStructMeta):
    """Base of the structs with a shaped constructor that are not validated at
    construction."""


@dataclass_transform(
    field_specifiers=(msgspec.field, leading_keyword, constructor_default, part_field, laid_flat)
)
class ProtocolStruct(msgspec.Struct, frozen=True, weakref=True, metaclass=ProtocolStructMeta):
    """Base of the validating protocol structs."""

    def validate(self) -> None:
        """Check every protocol rule of this value; subclasses override."""
