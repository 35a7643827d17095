"""The user-facing documentation: in the repository, in Octo's own words, true to the code.

* No file a user reads names a document a clone does not have, or an
  internal label (a decision number, a section sign of a design document, an
  issue number).
* ``docs/protocol.md`` names every error code Octo can raise.
"""

from __future__ import annotations

import inspect
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import octo_common.errors as errors
from octo_host.cli import main as host_main
from octo_host.client import DispatchScopeMismatch, ReplyCut, ReplyTimedOut
from octo_host.client.shortcuts import OperationScopeUnbound
from octo_worker.cli import main as worker_main
from tests.internal_labels import INTERNAL

REPO = Path(__file__).resolve().parents[2]


def user_facing() -> list[Path]:
    files = [REPO / "README.md", REPO / "CHANGELOG.md"]
    files += sorted((REPO / "docs").glob("*.md"))
    files += sorted(path for path in (REPO / "deploy").rglob("*") if path.is_file())
    files += sorted((REPO / "examples").rglob("*.md"))
    files += sorted((REPO / "octo_worker" / "console" / "templates").glob("*"))
    return files


@pytest.mark.parametrize("path", user_facing(), ids=lambda path: str(path.relative_to(REPO)))
def test_no_internal_label_or_outside_file(path: Path) -> None:
    text = path.read_text(encoding="utf-8", errors="replace")
    found = [
        f"{number}: {line.strip()[:100]}"
        for number, line in enumerate(text.splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert found == []


def help_texts(main: object, verbs: list[list[str]]) -> str:
    assert callable(main)
    out = io.StringIO()
    with redirect_stdout(out):
        for argv in verbs:
            main([*argv, "--help"])
    return out.getvalue()


def test_the_commands_help_has_no_internal_label() -> None:
    worker = help_texts(
        worker_main,
        [[], ["dev"], ["run"], ["check"], ["topology", "declare"], ["journal", "prune"],
         ["dlq", "list"], ["console"]],
    )  # fmt: skip
    host = help_texts(
        host_main, [[], ["dispatch"], ["reconcile"], ["compensate"], ["recover"], ["resolve"]]
    )
    assert "Exit status" in worker and "Exit status" in host
    assert INTERNAL.search(worker + host) is None


def test_the_protocol_reference_names_every_error_code() -> None:
    text = (REPO / "docs" / "protocol.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([a-z_]+)`", text))
    codes = {
        cls.code
        for cls in vars(errors).values()
        if inspect.isclass(cls)
        and issubclass(cls, errors.OctoError)
        and cls.__bases__[0] is not errors.OctoError
        and cls is not errors.OctoError
    }
    codes |= {
        cls.code for cls in (ReplyTimedOut, ReplyCut, DispatchScopeMismatch, OperationScopeUnbound)
    }
    assert len(codes) > 100
    assert sorted(codes - named) == [], "name each new code in docs/protocol.md, 'All codes'"
