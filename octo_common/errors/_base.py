"""The Octo error hierarchy.

Every error derives from :class:`OctoError` and carries a stable snake_case
``code`` derived from its class name (``SerializationError`` is
``serialization``). Fields are positional, in the order the protocol lists
them, and kept exactly on the instance for programs. ``str()`` escapes every
untrusted string and never shows keys, payloads or adapter text: an
error that carries such material (``DuplicateFrame.message``,
``WorkerRequestRejected.rejection``) keeps it out of its text.

This package must never import anything else from Octo but its limits.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from octo_common.limits import MAX_ERROR_PREVIEW_BYTES

_CAMEL = re.compile(r"(?<!^)(?=[A-Z])")


def _code_for(name: str) -> str:
    if name == "SerializationError":
        return "serialization"
    return _CAMEL.sub("_", name).lower()


def escape_untrusted(value: object) -> str:
    """Render an untrusted value for an error text.

    Strings are wrapped in backticks, cut to their first 96 UTF-8 bytes, with
    backslash and backtick escaped and every byte outside printable ASCII
    written as ``\\xNN``. Other values are shown with ``repr``.
    """
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
    else:
        return repr(value)
    preview = data[:MAX_ERROR_PREVIEW_BYTES]
    out: list[str] = []
    for byte in preview:
        if byte == 0x5C:
            out.append("\\\\")
        elif byte == 0x60:
            out.append("\\`")
        elif 0x20 <= byte <= 0x7E:
            out.append(chr(byte))
        else:
            out.append(f"\\x{byte:02x}")
    text = "`" + "".join(out) + "`"
    if len(data) > MAX_ERROR_PREVIEW_BYTES:
        text += f" ({len(data)} bytes; preview truncated)"
    return text


class OctoError(Exception):
    """Base of every Octo error. ``code`` is stable API."""

    code: ClassVar[str] = "octo_error"
    _fields: ClassVar[tuple[str, ...]] = ()
    _defaults: ClassVar[dict[str, Any]] = {}
    _text: ClassVar[str] = ""
    _hidden: ClassVar[frozenset[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = _code_for(cls.__name__)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = self._fields
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes at most {len(fields)} fields")
        values: dict[str, Any] = dict(zip(fields, args, strict=False))
        for name, value in kwargs.items():
            if name not in fields:
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__} got {name!r} twice")
            values[name] = value
        for name in fields:
            if name not in values:
                if name in self._defaults:
                    values[name] = self._defaults[name]
                else:
                    raise TypeError(f"{type(self).__name__} is missing field {name!r}")
            object.__setattr__(self, name, values[name])
        super().__init__(*(values[name] for name in fields if name not in self._hidden))

    def _field_text(self) -> str:
        parts = [
            f"{name}={escape_untrusted(getattr(self, name))}"
            for name in self._fields
            if name not in self._hidden
        ]
        return ", ".join(parts)

    def __str__(self) -> str:
        text = self._text or self.code.replace("_", " ")
        fields = self._field_text()
        return f"{text} ({fields})" if fields else text

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._field_text()})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), {n: getattr(self, n) for n in self._fields}))


def _rebuild_error(cls: type[OctoError], values: dict[str, Any]) -> OctoError:
    return cls(**values)


# Groups ---------------------------------------------------------------------


class ProtocolError(OctoError):
    """Wire protocol, payload, grant, frame and authorizer errors."""


class JournalError(OctoError):
    """Worker journal errors."""


class WorkerError(OctoError):
    """Worker runtime errors."""


class WorkerAdapterError(OctoError):
    """Errors an adapter reports."""


class LedgerError(OctoError):
    """Host ledger errors."""


class WorkflowError(OctoError):
    """Host workflow errors."""


class StorageError(OctoError):
    """Authenticated storage errors."""
