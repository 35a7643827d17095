"""``tickets.open``: an Octo adapter that opens help-desk tickets (an example plug-in).

The help desk is a directory, ``desk_dir``: a ticket is the file
``<idempotency key>.json``, created exclusively (a second attempt with the
same key finds it and creates nothing), and closing it writes
``<ticket's key>.closed`` holding the compensation's key, exclusively too.
Both files are written whole and fsynced before the function returns, so
the lookups, which only read, always see what was done.

The contract, declared explicitly: the desk deduplicates by the key it is
handed and can be asked about it afterwards
(``PROVIDER_IDEMPOTENCY_AND_RECONCILIATION``). Inputs are typed: a
``Ticket`` to open, exactly ``{"close": "ticket"}`` to undo, ``desk_dir``
as the only option. Every function is a plain one: the worker runs it in a
thread, so file I/O never blocks the daemon.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from octo_worker.adapter_functions import AdapterCall, FunctionAdapter
from octo_worker.adapters import DurableOperationContract

__all__ = ["CloseTicket", "DeskOptions", "HelpDesk", "Ticket", "tickets"]


class Ticket(msgspec.Struct, forbid_unknown_fields=True):
    title: str
    priority: Literal["low", "normal", "high"] = "normal"


class CloseTicket(msgspec.Struct, forbid_unknown_fields=True):
    close: Literal["ticket"]


class DeskOptions(msgspec.Struct, forbid_unknown_fields=True):
    desk_dir: str


class HelpDesk:
    """The desk: one file per ticket, named by the key it was opened with."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def open(self, key: str, ticket: Ticket) -> dict[str, Any]:
        record = {"ticket": key[:16], "title": ticket.title, "priority": ticket.priority}
        self._create(self.directory / f"{key}.json", json.dumps(record).encode())
        return self.find(key) or record

    def find(self, key: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads((self.directory / f"{key}.json").read_bytes())
        except FileNotFoundError:
            return None
        return found

    def close(self, key: str, closing_key: str) -> None:
        self._create(self.directory / f"{key}.closed", closing_key.encode())

    def closed_by(self, key: str) -> str | None:
        try:
            return (self.directory / f"{key}.closed").read_text()
        except FileNotFoundError:
            return None

    def tickets(self) -> list[str]:
        return sorted(path.stem for path in self.directory.glob("*.json"))

    def _create(self, path: Path, data: bytes) -> None:
        """Write ``path`` once, whole: an existing one is left as it is."""
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        with open(temporary, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)  # fails if it exists: never a second ticket
        except FileExistsError:
            pass
        finally:
            temporary.unlink()
        directory = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


tickets: FunctionAdapter[DeskOptions] = FunctionAdapter(
    "tickets.open",
    contract=DurableOperationContract.PROVIDER_IDEMPOTENCY_AND_RECONCILIATION,
    input=Ticket,
    inverse=CloseTicket,
    options=DeskOptions,
    deadline_seconds=10.0,
)


def _desk(call: AdapterCall[DeskOptions]) -> HelpDesk:
    return HelpDesk(call.options.desk_dir)


@tickets.dispatch
def open_ticket(ticket: Ticket, call: AdapterCall[DeskOptions]) -> dict[str, Any]:
    return _desk(call).open(call.idempotency_key, ticket)


@tickets.lookup
def find_ticket(call: AdapterCall[DeskOptions]) -> dict[str, Any] | None:
    # Not found proves nothing (a late request may still land): None stays unresolved.
    return _desk(call).find(call.idempotency_key)


@tickets.compensate
def close_ticket(inverse: CloseTicket, call: AdapterCall[DeskOptions]) -> dict[str, Any]:
    _desk(call).close(call.original_idempotency_key, call.idempotency_key)
    return {}


@tickets.lookup_compensation
def find_closing(call: AdapterCall[DeskOptions]) -> dict[str, Any] | None:
    closed_by = _desk(call).closed_by(call.original_idempotency_key)
    return {} if closed_by == call.idempotency_key else None
