"""The PostgreSQL place a benchmark works in: the test database, a schema of its own.

Shared by ``bench/journal.py``, ``bench/e2e.py`` and ``bench/failover.py``.
``OCTO_BENCH_POSTGRES_URL`` and ``OCTO_BENCH_POSTGRES_PASSWORD`` point them
at another server; the defaults are the public test values of
``deploy/ensure-postgres.sh``. The password goes to a private file (the
stores read it from there), never on a command line.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import asyncpg

URL = os.environ.get("OCTO_BENCH_POSTGRES_URL", "postgresql://octo_test@127.0.0.1:5432/octo_test")
PASSWORD = os.environ.get("OCTO_BENCH_POSTGRES_PASSWORD", "octo-test")


class PgPlace:
    """A fresh schema name and the password file beside the benchmark's files."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.url = URL
        self.schema = f"octo_bench_{uuid.uuid4().hex[:12]}"
        self.password_file = directory / "postgres.password"
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, PASSWORD.encode() + b"\n")
        finally:
            os.close(fd)

    def storage_toml(self) -> str:
        """The ``[storage]`` lines of a worker.toml that put the journal here."""
        return (
            f'url = "{self.url}"\npassword_file = "{self.password_file}"\n'
            f'schema = "{self.schema}"\n'
        )

    async def drop(self) -> None:
        connection = await asyncpg.connect(self.url, password=PASSWORD, timeout=5.0)
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        finally:
            await connection.close()
