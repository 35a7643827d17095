"""PostgreSQL for the tests: the role and database of ``deploy/ensure-postgres.sh``.

Every test that needs PostgreSQL works in a schema of its own with a unique
name (``octo_t_<hex>``), dropped afterwards, so parallel runs never meet.
``OCTO_TEST_POSTGRES_URL`` and ``OCTO_TEST_POSTGRES_PASSWORD`` point the tests
at another server; the defaults are the public test values of the script.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

URL = os.environ.get("OCTO_TEST_POSTGRES_URL", "postgresql://octo_test@127.0.0.1:5432/octo_test")
PASSWORD = os.environ.get("OCTO_TEST_POSTGRES_PASSWORD", "octo-test")


def unique_schema() -> str:
    return f"octo_t_{uuid.uuid4().hex[:16]}"


def write_password_file(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / "postgres.password"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, PASSWORD.encode() + b"\n")
    finally:
        os.close(fd)
    os.chmod(path, 0o600)
    return path


async def connect(timeout: float = 5.0) -> asyncpg.Connection[Any]:
    """A raw connection to the test database (for set-up, tampering and clean-up)."""
    connection: asyncpg.Connection[Any] = await asyncpg.connect(
        URL, password=PASSWORD, timeout=timeout
    )
    return connection


@dataclass
class PostgresSchema:
    """One test's place in the test database."""

    url: str
    password_file: Path
    schema: str

    async def connect(self) -> asyncpg.Connection[Any]:
        connection = await connect()
        await connection.execute(f'SET search_path TO "{self.schema}"')
        return connection

    async def drop(self) -> None:
        connection = await connect()
        try:
            await connection.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        finally:
            await connection.close()


def errors_in_another_loop(call: Callable[[], Coroutine[Any, Any, Any]]) -> list[BaseException]:
    """What ``call`` raises when awaited on a new event loop in another thread."""
    caught: list[BaseException] = []

    def elsewhere() -> None:
        try:
            asyncio.run(call())
        except BaseException as error:
            caught.append(error)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(10)
    return caught
