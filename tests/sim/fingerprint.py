"""A schedule's outcome as one digest, to show that a change to the simulation's
machinery (its loop, its stores' plumbing) leaves what every seed explores alone.

    python -m tests.sim.fingerprint --first 1 --schedules 3000 --out before.txt
    (change the code)
    python -m tests.sim.fingerprint --first 1 --schedules 3000 --compare before.txt

A schedule's fingerprint covers its history (every step, death and restart, in
order), its deaths by place, its verdict (the failure's text, or none), the
external system's counts per key, the host's durable ledger, the journal's schema
and rows, and the state of the seed's random stream at the end (every draw the
schedule made); the journal's wall clock is made a counter (``_Clock``). Two runs
of one seed with the same fingerprint took the same schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sqlite3
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from octo_worker.storage import sqlite_writer
from tests.sim.loop import Stuck, new_loop
from tests.sim.sim import Sim, Violation, quiet_logs

_SCHEMA = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"


def journal_rows(path: Path) -> list[str]:
    """The schema and every row of every table of the journal at ``path``, in a fixed
    order."""
    if not path.exists():
        return ["no journal"]
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [
            name
            for (name,) in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        rows = [f"schema {row!r}" for row in connection.execute(_SCHEMA)]
        for table in tables:
            for row in sorted(connection.execute(f'SELECT * FROM "{table}"'), key=repr):
                rows.append(f"{table} {row!r}")
        return rows
    finally:
        connection.close()


def fingerprint(sim: Sim, verdict: str) -> str:
    """The digest of what ``sim`` did (see the module docstring)."""
    external = sim.external
    parts = [
        f"seed {sim.seed}",
        f"verdict {verdict}",
        *sim.history,
        *(f"death {place} {count}" for place, count in sorted(sim.boundaries.deaths.items())),
        *(
            f"{name} {key} {count}"
            for name, counter in (
                ("calls", external.calls),
                ("effects", external.effects),
                ("ccalls", external.ccalls),
                ("ceffects", external.ceffects),
            )
            for key, count in sorted(counter.items())
        ),
        f"ledger {sim.durable_ledger}",
        *journal_rows(sim.directory / "journal.sqlite3"),
        f"rng {sim.rng.getstate()!r}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class _Clock:
    """The journal writer's wall clock, made a counter: a row's ``written_at`` (and
    the tag sealed over it) then depends on how many commits came before it only."""

    def __init__(self) -> None:
        self.ticks = 0

    def time(self) -> float:
        self.ticks += 1
        return 1_700_000_000 + self.ticks / 1000


def _memory() -> str | None:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() else None


def fingerprints(first: int, count: int) -> Iterator[tuple[int, str]]:
    """``(seed, fingerprint)`` for seeds ``first`` .. ``first + count - 1``, run as
    ``tests.sim.run`` runs them (one loop per process, a new one after a stuck one)."""
    runner = asyncio.Runner(loop_factory=new_loop)
    with (
        quiet_logs(),
        tempfile.TemporaryDirectory(prefix="octo-simfp-", dir=_memory()) as tmp,
    ):
        for seed in range(first, first + count):
            clock = mock.patch.object(sqlite_writer, "time", _Clock())
            directory = Path(tmp) / str(seed)
            directory.mkdir()
            sim = Sim(seed, directory)
            verdict = "kept"
            try:
                with clock:
                    runner.run(sim.run())
            except Violation as exc:
                verdict = str(exc)
            except Exception as exc:
                verdict = sim.report(f"{type(exc).__name__}: {exc}")
                if isinstance(exc, Stuck):
                    runner = asyncio.Runner(loop_factory=new_loop)
            yield seed, fingerprint(sim, verdict)
            shutil.rmtree(directory)
    runner.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=1)
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--out", type=Path, help="write one 'seed fingerprint' line per seed")
    parser.add_argument("--compare", type=Path, help="a file written by --out to compare with")
    args = parser.parse_args(argv)
    lines = [f"{seed} {digest}" for seed, digest in fingerprints(args.first, args.schedules)]
    if args.out is not None:
        args.out.write_text("".join(f"{line}\n" for line in lines))
    print(f"{len(lines)} schedules from seed {args.first}")
    if args.compare is None:
        return 0
    expected = args.compare.read_text().splitlines()
    differing = [line for line, was in zip(lines, expected, strict=False) if line != was]
    if len(expected) != len(lines) or differing:
        print(f"{len(differing)} of {len(lines)} fingerprint(s) differ: {differing[:3]}")
        return 1
    print(f"all {len(lines)} fingerprints identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
