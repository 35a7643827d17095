"""No file of the repository sends a reader to an internal label or a document outside it.

Code, comments, docstrings, messages, tests, benchmarks, deployment files,
the model, the examples, the Makefile and pyproject.toml say the rule they
mean in their own words or name a page of ``docs/``; a section sign or a
decision number of a design document, an issue number, a design document's
name or a path beside the repository fails this test, named by file and line.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tests.internal_labels import INTERNAL, REPO, repository_files, text_of

# (file, stripped line) for a match that is not a label; none today. An entry
# must still match its line, so the list never keeps an exception nobody needs.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def label_lines(files: list[Path]) -> list[tuple[str, int, str]]:
    found = []
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        name = path.relative_to(REPO).as_posix()
        for number, line in enumerate(text.splitlines(), 1):
            if INTERNAL.search(line):
                found.append((name, number, line.strip()))
    return found


@functools.cache
def repository_labels() -> tuple[tuple[str, int, str], ...]:
    return tuple(label_lines(repository_files()))


def test_the_scan_reads_every_part_of_the_repository() -> None:
    names = {path.relative_to(REPO).as_posix() for path in repository_files()}
    for expected in (
        "Makefile",
        "pyproject.toml",
        "octo_common/codec.py",
        "octo_worker/session/session.py",
        "octo_host/engine.py",
        "tests/unit/test_docs.py",
        "bench/e2e.py",
        "deploy/worker.toml.example",
        "model/Octo.tla",
    ):
        assert expected in names, expected
    assert any(name.startswith("examples/") for name in names)


# The labels are spelled in pieces here, so that this file holds none of them.
SECTION = "\N{SECTION SIGN}"
LABELS = (
    "# the order of W" + SECTION + "8.4",
    "(H" + SECTION + "17.10, " + "issue" + " 21)",
    "see PROTOCOL" + ".md " + SECTION + "2.4",
    "a lookup (D" + "11)",
    "ARCHITECTURE " + "decision" + " 5",
    'print(f"\\n' + "issue" + ' 21: host commit cost")',
    "Issue" + " 3's acceptance",
    "the seed" + "-worker-compensation.md sequence",
    "PROTOCOL" + "-WORKER.md",
    "../" + "shared" + "/vectors/public.json",
    'HERE.parents[2] / "shared"' + ' / "vectors"',
)
NOT_LABELS = (
    "PROTOCOL_VERSION = 5",
    "ssl.PROTOCOL_TLS_CLIENT",
    "D100 = 1",
    "tissue 3",
    "design 1",
    "a shared journal",
    "ids[0] = 3",
)


def test_the_patterns_catch_each_kind_of_label() -> None:
    for line in LABELS:
        assert INTERNAL.search(line), line
    for line in NOT_LABELS:
        assert INTERNAL.search(line) is None, line


def test_no_file_names_an_internal_label() -> None:
    found = repository_labels()
    unexpected = [
        f"{name}:{number}: {line[:120]}"
        for name, number, line in found
        if (name, line) not in ALLOWED
    ]
    assert unexpected == [], "say the rule in words or name a page of docs/:\n" + "\n".join(
        unexpected
    )
    # An allowed line that no longer matches is dropped from ALLOWED.
    assert sorted(ALLOWED - {(name, line) for name, _, line in found}) == []
