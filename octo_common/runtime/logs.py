"""The logger of a library part: the host client and its stores, embedded in an application.

When the application configured structlog, its configuration applies as it
is. Otherwise events go to the standard library logger of the same name,
rendered as ``event key=value ...``: Python's default (no handler
configured) shows WARNING and above only, so a call that went well prints
nothing, and ``logging.basicConfig(level=logging.INFO)`` (or any handler
the application sets up) shows the rest. The level is read once, when the
logger is made, so an event below it costs one no-op call.

It must never configure logging for the application or render exception
text.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog

from octo_common.runtime.output import drop_exception_text

__all__ = ["library_logger"]


def _render(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> str:
    """``event key=value ...``, the event's name first."""
    name = event.pop("event", "")
    return " ".join([str(name), *(f"{key}={value}" for key, value in event.items())])


def library_logger(name: str) -> Any:
    """A structlog bound logger for ``name`` (``"octo.host.client"``...), as above."""
    if structlog.is_configured():
        return structlog.get_logger(name)
    stdlib = logging.getLogger(name)
    return structlog.wrap_logger(
        stdlib,
        wrapper_class=structlog.make_filtering_bound_logger(stdlib.getEffectiveLevel()),
        processors=[
            drop_exception_text,
            _render,
        ],
        cache_logger_on_first_use=True,
    )
