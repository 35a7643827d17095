"""Fixtures shared by every test directory: PostgreSQL schemas (``tests/postgres.py``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.postgres import URL, PostgresSchema, connect, unique_schema, write_password_file

T = TypeVar("T")


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that asks for ``postgres_schema`` needs PostgreSQL: mark it ``postgres``.

    Files with a ``slow`` test run first, so that under pytest-xdist (``make
    test``: one file to a worker at a time, in this order) the longest files
    start first. Each file's tests keep their order.
    """
    slow = {_module(item) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: _module(item) not in slow)
    for item in items:
        if "postgres_schema" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


def run_apart(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on a loop of its own in another thread.

    So a synchronous fixture can do async set-up and clean-up, also when an
    async fixture asks for it while the test's loop is running.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        return executor.submit(lambda: asyncio.run(make())).result()


async def _probe() -> str | None:
    try:
        connection = await connect(timeout=3.0)
    except Exception as error:  # refused, timed out, or the role cannot log in
        return type(error).__name__
    await connection.close()
    return None


_probed: list[str | None] = []  # the first probe's failure (None: it answered), once per run


@pytest.fixture
def postgres_schema(tmp_path: Path) -> Iterator[PostgresSchema]:
    """A schema name of this test's own (the store creates it), dropped afterwards.

    Skips when PostgreSQL does not answer with the test role (run
    ``deploy/ensure-postgres.sh``, as ``make test`` does).
    """
    if not _probed:
        _probed.append(run_apart(_probe))
    if _probed[0] is not None:
        pytest.skip(f"PostgreSQL test database unreachable ({_probed[0]})")
    place = PostgresSchema(URL, write_password_file(tmp_path / "pg"), unique_schema())
    try:
        yield place
    finally:
        run_apart(place.drop)
