"""What counts as an internal label, and which files of the repository are read for one.

A reader of the repository gets Octo's own words and ``docs/``: never a
section sign or a decision number of a document the developers keep for
themselves, an issue number, the name of such a document, or a path to a
folder beside the repository. The patterns below are written so that none
of them matches its own source text.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INTERNAL = re.compile(
    "|".join(
        (
            r"[WH]§|§\s?\d",  # a section of a design document
            r"\bD(?:[1-9]|1[0-3])\b",  # a decision label, D and 1 to 13
            r"(?:(?<![A-Za-z])|(?<=\\n))[Ii]ssues?[\s#-]{0,2}\d",  # an issue number
            r"\b[Dd]ecisions?\s+\d",  # a numbered decision
            r"PROTOCOL(?:-WORKER|-HOST)?\.md|ARCHITECTURE\.md|STYLE\.md|seed-work(?:er)",
            r"\.\./shared|shared/(?:docs|vectors)|/work/(?:shared)",  # beside the repository
            r"[\"']shared[\"']\s*/\s*[\"'](?:docs|vectors)",  # the same, as a path join
        )
    )
)

# Tracked files and the files git would add (not ignored), NUL-separated.
_LS_FILES = ("ls-files", "-z", "--cached", "--others", "--exclude-standard")
# Directories that are never part of the repository's text, for a copy without git.
_NOT_SOURCE = {
    ".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
    ".hypothesis", "build", "dist", "node_modules",
}  # fmt: skip


def repository_files() -> list[Path]:
    """Every file git tracks or would add; without git (an unpacked copy), every file but caches."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), *_LS_FILES],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(
            path
            for path in REPO.rglob("*")
            if path.is_file()
            and not _NOT_SOURCE.intersection(path.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") for part in path.parts)
        )
    names = [name for name in listed.decode("utf-8").split("\0") if name]
    return sorted(REPO / name for name in names if (REPO / name).is_file())


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte in its first 8 KiB)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")
