"""The rollback anchor (H§17.10): the operator's explicit initialisation and the rule.

The anchor is a small file holding the last committed revision of each
record; a database older than it was rolled back. This module owns the empty
anchor a database without records starts from and the comparison a backend
makes with it. The file format and its fsynced writer are
:mod:`octo_common.runtime.anchorfile`.

It must never overwrite an anchor without being told to, or accept a
database below its anchor.
"""

from __future__ import annotations

import os
from pathlib import Path

from octo_common.errors import RollbackDetected, StorageBackendError
from octo_common.runtime.anchorfile import write_anchor_file

__all__ = ["EMPTY_ANCHOR", "compare_with_anchor", "initialise_anchor"]

EMPTY_ANCHOR = b'{"format_version":1,"records":[]}'


def initialise_anchor(path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
    """Write the explicit empty anchor ``{"format_version":1,"records":[]}`` (0o600).

    This is the operator's explicit initialisation (H§18A.5): a configured
    anchor must exist before the first open. A database that already holds
    records is accepted on open and the anchor rises to it. An existing
    anchor file is only replaced with ``overwrite=True``.
    """
    target = Path(os.fspath(path))
    if os.path.lexists(target) and not overwrite:
        raise StorageBackendError("rollback anchor file already exists")
    try:
        write_anchor_file(target, EMPTY_ANCHOR)
    except OSError as exc:
        raise StorageBackendError(f"rollback anchor write failed: {exc.strerror}") from exc


def compare_with_anchor(anchored: int, floor: int, record_revision: int | None) -> None:
    """H§17.10 check: a database below its anchor was rolled back."""
    if anchored == 0:
        return
    if record_revision is None:
        raise RollbackDetected(None, anchored)
    if floor < anchored or record_revision < anchored:
        raise RollbackDetected(record_revision, anchored)
