"""Where the independent conformance vectors are found.

The path in ``OCTO_VECTORS`` when it is set (a larger set with the same
schema); else ``public.json`` here, a verbatim copy of the public set, so
that a clone anywhere runs them. Every expected value in them comes from an
independent implementation, never from Octo's code.
"""

from __future__ import annotations

import os
from pathlib import Path

COPY = Path(__file__).resolve().parent / "public.json"


def vectors_path() -> Path:
    chosen = os.environ.get("OCTO_VECTORS")
    if chosen:
        return Path(chosen)
    return COPY
