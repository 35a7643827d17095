"""What ``octo-worker run`` refuses before it reaches the broker, for ``run`` and ``check`` alike.

``run`` applies these rules (the daemon's start creates the state
directories through :func:`create_state_directories`; ``run`` binds its
listen addresses); ``check`` asks the same functions without creating or
binding anything for good, so that what ``check`` reports is what ``run``
would do:

* the state directory: ``worker.state_dir`` is created when it is missing
  and its parent exists; when its parent is missing too the path is taken
  for a mistake and refused (``InvalidConfiguration`` naming the key), rather
  than starting an empty journal somewhere unexpected. The same holds for
  the journal's directory when ``storage.journal`` points outside the state
  directory (:func:`state_directories`);
* whether the directories can be created by this user (:func:`creatable`);
* a listen address (``[metrics] listen``, ``[console] listen``) another
  socket already holds (:func:`bind_refusal`), and whether the holder is a
  running octo-worker serving these scopes (:func:`served_by_octo_worker`),
  which a restart frees.

It must never create a file, keep a socket bound, or print.
"""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from octo_common.runtime.output import EXIT_STORAGE, CliError
from octo_worker.config import InvalidConfiguration, WorkerConfig

__all__ = [
    "bind_refusal",
    "creatable",
    "create_state_directories",
    "listen_address",
    "served_by_octo_worker",
    "state_directories",
]

_SCRAPE_TIMEOUT_SECONDS: Final = 2.0
_SCRAPE_LIMIT_BYTES: Final = 4 << 20


def state_directories(config: WorkerConfig) -> list[Path]:
    """The directories ``run`` creates before it opens the journal, in order (often none).

    ``InvalidConfiguration`` naming ``worker.state_dir`` (or
    ``storage.journal``) when a missing directory's parent is missing too.
    """
    state = config.path(config.worker.state_dir, "worker.state_dir")
    missing: list[Path] = []
    if not os.path.lexists(state):
        if not os.path.lexists(state.parent):
            raise InvalidConfiguration(
                f"worker.state_dir: {state} does not exist, nor does its parent {state.parent}; "
                "refusing to start an empty journal at a path that may be mistyped "
                "(create the directory first)"
            )
        missing.append(state)
    directory = config.journal_path.parent
    if directory != state and not os.path.lexists(directory):
        inside = directory == state or state in directory.parents
        if not inside and not os.path.lexists(directory.parent):
            raise InvalidConfiguration(
                f"storage.journal: {directory} does not exist, nor does its parent "
                f"{directory.parent}; refusing to start an empty journal at a path that may be "
                "mistyped (create the directory first)"
            )
        missing.append(directory)
    return missing


def create_state_directories(config: WorkerConfig) -> None:
    """Create what :func:`state_directories` names (``0o700``); ``OSError`` when refused."""
    for directory in state_directories(config):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)


def creatable(directory: Path) -> str:
    """Whether this user can create the journal in ``directory`` (``CliError``, exit 4, if not)."""
    ancestor = directory
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CliError(
            EXIT_STORAGE,
            f"cannot create {directory}: {ancestor} is not a directory",
            "storage_backend_error",
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise CliError(
            EXIT_STORAGE,
            f"cannot create the journal in {directory}: {ancestor} is not writable by this user",
            "storage_backend_error",
        )
    return "run creates it" if ancestor == directory else f"run creates it and {directory}"


def listen_address(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port); the config has checked it."""
    host, _, port = listen.rpartition(":")
    return host.strip().strip("[]"), int(port)


def bind_refusal(host: str, port: int) -> OSError | None:
    """Why a server could not bind ``host:port`` now (None: it could), without keeping it.

    The probe binds the way both servers do (``SO_REUSEADDR``, the first
    address ``host`` resolves to), then closes at once.
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, protocol, _, address = infos[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:
        return error
    return None


def served_by_octo_worker(url: str, scopes: Iterable[str]) -> bool:
    """Whether ``url`` answers as the metrics endpoint of an octo-worker serving every one
    of ``scopes`` (its per-scope gauges name them): the running daemon of this configuration."""
    wanted = set(scopes)
    try:
        with urllib.request.urlopen(url, timeout=_SCRAPE_TIMEOUT_SECONDS) as response:  # noqa: S310 (http only)
            body = response.read(_SCRAPE_LIMIT_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError):
        return False
    if len(body) > _SCRAPE_LIMIT_BYTES:
        return False
    served: set[str] = set()
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            if family.name.startswith("octo_"):
                served.update(
                    sample.labels["scope"] for sample in family.samples if "scope" in sample.labels
                )
    except ValueError:
        return False
    return bool(wanted) and wanted <= served
