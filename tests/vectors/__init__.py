"""Where the independent conformance vectors are found.

In order: the path in ``OCTO_VECTORS`` when it is set; ``shared/vectors/
public.json`` beside the repository (the workplace's copy; a larger set with
the same schema may be placed there); else ``public.json`` here, a verbatim
copy of the public set, so that a clone anywhere still runs them. Every
expected value in them comes from an independent implementation.
"""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
BESIDE_THE_REPOSITORY = HERE.parents[2] / "shared" / "vectors" / "public.json"
COPY = HERE / "public.json"


def vectors_path() -> Path:
    chosen = os.environ.get("OCTO_VECTORS")
    if chosen:
        return Path(chosen)
    return BESIDE_THE_REPOSITORY if BESIDE_THE_REPOSITORY.is_file() else COPY
