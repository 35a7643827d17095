"""Fuzz Octo's byte readers with atheris (``make fuzz``; ``tests/fuzz/targets.py``).

    python -m tests.fuzz.run --seconds 60                # every target, 60 s each
    python -m tests.fuzz.run --seconds 10 ledger anchor  # some targets
    python -m tests.fuzz.run --one ledger [libFuzzer arguments...]   # one target, as is

Each target runs in a process of its own (libFuzzer ends the process), its
imports of Octo instrumented for coverage, over its corpus
``tests/fuzz/corpus/<target>/`` (new inputs that reach new code are added
there, unless ``--scratch`` sends them to a temporary directory). An input
that makes a target fail is written to ``tests/fuzz/crashes/`` and the run
fails. Prints each target's executions and executions per second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parents[1]
CORPUS: Final = HERE / "corpus"
CRASHES: Final = HERE / "crashes"
# The modules whose code the targets reach (instrumented for coverage).
_INSTRUMENTED: Final = (
    "octo_common.codec",
    "octo_common.frames",
    "octo_common.inbound",
    "octo_common.keyfile",
    "octo_common.messages",
    "octo_common.payload",
    "octo_common.peek",
    "octo_common.records",
    "octo_host.config",
    "octo_host.ledger",
    "octo_worker.config",
    "octo_worker.journal",
)
# Every target in one process, the input's first byte choosing the target: one
# start-up and one instrumentation for all (make test's smoke).
ALL: Final = "all"
_EXECS = re.compile(r"stat::number_of_executed_units:\s*(\d+)")


@dataclass
class FuzzRun:
    target: str
    returncode: int
    execs: int
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def one(target: str, libfuzzer_args: list[str]) -> None:
    """Fuzz ``target`` in this process (libFuzzer exits it)."""
    import atheris

    with atheris.instrument_imports(include=["octo_common", "octo_worker", "octo_host"]):
        for module in _INSTRUMENTED:
            importlib.import_module(module)
    from tests.fuzz.targets import TARGETS, every_target

    fuzz = every_target if target == ALL else TARGETS[target]
    atheris.Setup([sys.argv[0], *libfuzzer_args], fuzz)
    atheris.Fuzz()


def spawn(
    target: str, seconds: float, *, scratch: Path | None = None, runs: int | None = None
) -> subprocess.Popen[str]:
    """Start one target's fuzzing process."""
    dirs = [] if scratch is None else [str(scratch)]
    if target != ALL:
        corpus = CORPUS / target
        corpus.mkdir(parents=True, exist_ok=True)
        dirs.append(str(corpus))
    CRASHES.mkdir(exist_ok=True)
    args = [
        f"-max_total_time={max(1, int(seconds))}",
        "-print_final_stats=1",
        "-timeout=10",
        "-rss_limit_mb=1024",
        f"-artifact_prefix={CRASHES}/{target}-",
    ]
    if runs is not None:
        args.append(f"-runs={runs}")
    return subprocess.Popen(  # fixed argv, no shell
        [sys.executable, "-m", "tests.fuzz.run", "--one", target, *args, *dirs],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )


def collect(target: str, process: subprocess.Popen[str], started: float) -> FuzzRun:
    output, _ = process.communicate()
    counts = _EXECS.findall(output)
    return FuzzRun(
        target,
        process.returncode,
        int(counts[-1]) if counts else 0,
        time.perf_counter() - started,
        output,
    )


def fuzz(targets: list[str], seconds: float, *, scratch: bool, parallel: int = 1) -> list[FuzzRun]:
    """Run each target for ``seconds``, ``parallel`` at a time."""
    results: list[FuzzRun] = []
    with tempfile.TemporaryDirectory(prefix="octo-fuzz-") as tmp:
        pending = list(targets)
        running: list[tuple[str, subprocess.Popen[str], float]] = []
        while pending or running:
            while pending and len(running) < parallel:
                target = pending.pop(0)
                out = None
                if scratch:
                    out = Path(tmp) / target
                    out.mkdir()
                running.append((target, spawn(target, seconds, scratch=out), time.perf_counter()))
            target, process, started = running.pop(0)
            results.append(collect(target, process, started))
    return results


def main(argv: list[str] | None = None) -> int:
    from tests.fuzz.targets import TARGETS

    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["--one"]:
        one(args_in[1], args_in[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "targets", nargs="*", help=f"default: each of {', '.join(TARGETS)}; or {ALL}, in one"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="per target")
    parser.add_argument("--parallel", type=int, default=1, help="targets at once")
    parser.add_argument("--scratch", action="store_true", help="keep the corpus unchanged")
    args = parser.parse_args(args_in)
    unknown = set(args.targets) - set(TARGETS) - {ALL}
    if unknown:
        parser.error(f"unknown targets: {sorted(unknown)}")
    results = fuzz(
        args.targets or list(TARGETS), args.seconds, scratch=args.scratch, parallel=args.parallel
    )
    for result in results:
        rate = result.execs / result.seconds if result.seconds else 0.0
        status = "ok" if result.ok else f"FAILED ({result.returncode})"
        print(f"{result.target}: {status}: {result.execs:,} execs, {rate:,.0f}/s")
        if not result.ok:
            sys.stdout.write(result.output[-3000:])
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
