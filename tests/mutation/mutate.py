"""A repeatable mutation check of the lines that enforce Octo's promises (``make mutate``).

Each mutant changes one line of the code (a check that never fires, a step
dropped, an ack moved ahead of what it must follow); the tests that guard that
line run against it, and the mutant is *killed* when they fail. A mutant that
survives is a promise no test holds. The file is restored after each mutant
(also on Ctrl-C); the working tree is the one mutated, so run this on a clean
tree and nothing else at the same time.

    python -m tests.mutation.mutate            # every mutant
    python -m tests.mutation.mutate -k fence   # the mutants whose name holds "fence"

Prints one line per mutant and the kill rate; exits 1 if any mutant survives
or the unmutated tests fail.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
TIMEOUT: Final = 600.0


@dataclass(frozen=True)
class Mutant:
    """In the ``occurrence``-th line of ``path`` holding ``find``, ``find`` replaced
    by ``replace`` (a newline in it adds a line); ``pass`` replaces the whole line."""

    name: str
    path: str
    find: str
    replace: str
    tests: tuple[str, ...]
    occurrence: int = 1


_SESSION = "tests/integration/test_session.py"
_SIM = "tests/sim/test_sim.py::test_every_schedule_of_the_fixed_seeds_keeps_the_invariants"
_JOURNAL = "tests/unit/test_journal.py"
_MATRIX_REPLY = "tests/faults/test_crash_matrix.py::test_sigkill_at_every_point_leaves_every_key_known_and_effects_single[host.after_reply_applied-0]"  # noqa: E501

MUTANTS: Final = (
    # The simulation alone against three of the worker's lines (it does not kill an
    # ack moved after the adapter, nor a compensation of an original that did not
    # succeed, which its host never sends: the session and journal tests do).
    Mutant(
        "sim: journal: a known key is admitted again",
        "octo_worker/journal.py",
        "if existing is not None:",
        "if False:",
        (_SIM,),
    ),
    Mutant(
        "sim: store: a commit under an older fence is taken",
        "octo_worker/storage/changes.py",
        "if head.fence != pending.token:  # step 1",
        "if False:",
        (_SIM,),
    ),
    Mutant(
        "sim: session: a fence rejection does not supersede the session",
        "octo_worker/session/commits.py",
        "self.superseded = True",
        "pass",
        (_SIM,),
    ),
    # The worker: admission, effect once, fences.
    Mutant(
        "journal: a known key is admitted again",
        "octo_worker/journal.py",
        "if existing is not None:",
        "if False:",
        (_JOURNAL,),
    ),
    Mutant(
        "journal: a known compensation is admitted again",
        "octo_worker/journal.py",
        "if existing is not None:",
        "if False:",
        (_JOURNAL,),
        occurrence=2,
    ),
    Mutant(
        "journal: a compensation of an original that did not succeed",
        "octo_worker/journal.py",
        "if original.state.kind is not StateKind.SUCCEEDED:",
        "if False:",
        (_JOURNAL,),
    ),
    Mutant(
        "journal: an observation of another input",
        "octo_worker/journal.py",
        "if current.tool != request.tool or current.input_fingerprint != fingerprint:",
        "if False:",
        (_JOURNAL,),
    ),
    Mutant(
        "journal: an observation outside the transition table",
        "octo_worker/journal.py",
        "self._check_operation_transition(key, current.state, status)",
        "pass",
        (_JOURNAL,),
    ),
    Mutant(
        "store: a commit under an older fence is taken",
        "octo_worker/storage/changes.py",
        "if head.fence != pending.token:  # step 1",
        "if False:",
        ("tests/integration/test_worker_store.py",),
    ),
    Mutant(
        "session: a fence rejection does not supersede the session",
        "octo_worker/session/commits.py",
        "self.superseded = True",
        "pass",
        (_SESSION,),
    ),
    Mutant(
        "session: a superseded session refuses a poisoned frame",
        "octo_worker/session/decisions.py",
        "if self._commits.superseded:",
        "if False:",
        (_SESSION,),
    ),
    Mutant(
        "session: the adapter runs before the delivery is acked",
        "octo_worker/session/session.py",
        "await self._ack_before_adapter(step, run)",
        "pass",
        (_SESSION,),
    ),
    Mutant(
        "session: the admission's kill point is never reached",
        "octo_worker/session/session.py",
        "hooks.after_admission_commit(",
        "pass",
        ("tests/unit/test_hooks.py", "tests/integration/test_adapter_kit.py"),
    ),
    Mutant(
        "session: a reply is published before its commit",
        "octo_worker/session/session.py",
        "hooks.before_reply(",
        "pass",
        ("tests/unit/test_hooks.py", "tests/integration/test_adapter_kit.py"),
    ),
    Mutant(
        "files.publish: a dispatch after a lookup said not performed publishes",
        "octo_worker/adapters/files.py",
        'if record.state == "refused" and not record.name:',
        "if False:",
        ("tests/integration/test_files_adapter.py",),
    ),
    # Frames and budgets.
    Mutant(
        "frames: a replayed frame is accepted",
        "octo_common/frames.py",
        "if self._seen & bit:",
        "if False:",
        ("tests/unit/test_frames.py",),
    ),
    Mutant(
        "frames: a wrong tag is accepted",
        "octo_common/frames.py",
        "if not hmac.compare_digest(expected, bytes.fromhex(tag_hex)):",
        "if False:",
        ("tests/unit/test_frames.py",),
    ),
    Mutant(
        "authorizer: the call budget is not enforced",
        "octo_common/authorizer.py",
        "if spent >= grant.max_calls:",
        "if False:",
        ("tests/unit/test_authorizer.py",),
    ),
    Mutant(
        "authorizer: the compensation budget is not enforced",
        "octo_common/authorizer.py",
        "if is_new and spent >= grant.max_compensations:",
        "if False:",
        ("tests/unit/test_authorizer.py",),
    ),
    # The host: one compensation, durable before sealing and before acking.
    Mutant(
        "ledger: a second compensation is recorded",
        "octo_host/ledger.py",
        "if operation.compensation is not None:",
        "if False:",
        ("tests/unit/test_host_ledger.py",),
    ),
    Mutant(
        "ledger: a compensation of an operation that did not succeed",
        "octo_host/ledger.py",
        "if operation.state != StateKind.SUCCEEDED:",
        "if False:",
        ("tests/unit/test_host_ledger.py",),
    ),
    Mutant(
        "host: a request sealed from a ledger that is not durable",
        "octo_host/client/verbs.py",
        "self._runs.require_durable(run)",
        "pass",
        ("tests/unit/test_host_run_cache.py",),
    ),
    Mutant(
        "host: the durability check never fires",
        "octo_host/client/runs.py",
        "if run._ledger.revision != run._durable_ledger_revision:",
        "if False:",
        ("tests/unit/test_host_run_cache.py",),
    ),
    Mutant(
        "host: a reply acked before the ledger is persisted",
        "octo_host/client/replies.py",
        "        async with run._lock:",
        "        await self._broker.ack(message)\n        async with run._lock:",
        (_MATRIX_REPLY,),
    ),
)


def _apply(mutant: Mutant) -> tuple[Path, str]:
    """Write the mutant; returns the file and its original text."""
    path = ROOT / mutant.path
    original = path.read_text("utf-8")
    lines = original.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if mutant.find in line]
    if len(hits) < mutant.occurrence:
        raise LookupError(f"{mutant.name}: {mutant.find!r} not found in {mutant.path}")
    index = hits[mutant.occurrence - 1]
    line = lines[index]
    if mutant.replace == "pass":
        # The whole statement dropped (its line holds ``find``).
        lines[index] = line[: len(line) - len(line.lstrip())] + "pass\n"
    else:
        lines[index] = line.replace(mutant.find, mutant.replace, 1)
    path.write_text("".join(lines), "utf-8")
    return path, original


def _pytest(tests: tuple[str, ...]) -> tuple[bool, float]:
    started = time.perf_counter()
    done = subprocess.run(  # fixed argv, no shell
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return done.returncode == 0, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the mutants whose name holds this")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.name]
    for mutant in chosen:
        # Every line must still be there (a refactor moves them): checked before any run.
        path, original = _apply(mutant)
        path.write_text(original, "utf-8")
    suites = sorted({t for m in chosen for t in m.tests})
    passed, seconds = _pytest(tuple(suites))
    print(f"unmutated: {'pass' if passed else 'FAIL'} ({len(suites)} test files, {seconds:.0f} s)")
    if not passed:
        return 1
    killed = 0
    for mutant in chosen:
        path, original = _apply(mutant)
        try:
            survived, seconds = _pytest(mutant.tests)
        finally:
            path.write_text(original, "utf-8")
        killed += not survived
        verdict = "SURVIVED" if survived else "killed  "
        print(f"{verdict} {mutant.name} ({seconds:.0f} s)", flush=True)
    print(f"kill rate: {killed}/{len(chosen)} ({100 * killed / max(len(chosen), 1):.0f}%)")
    return 0 if killed == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
