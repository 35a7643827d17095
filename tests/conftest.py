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


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that asks for ``postgres_schema`` needs PostgreSQL: mark it ``postgres``.

    Files with a ``slow`` test run first, so the longest work starts first:
    those run by one worker, then the ``spread`` ones (each file's tests keep
    their order). Under ``--dist loadgroup`` (``make test``) every file is one
    group, run in order by one worker with its module fixtures made once,
    except a file marked ``spread``: its tests depend on no other test and go
    to whichever worker is free.
    """
    slow = {_module(item) for item in items if item.get_closest_marker("slow") is not None}
    spread = {_module(item) for item in items if item.get_closest_marker("spread") is not None}

    def rank(item: pytest.Item) -> int:
        module = _module(item)
        return 2 if module not in slow else 1 if module in spread else 0

    items.sort(key=rank)
    grouped = bool(getattr(config.option, "loadgroup", False))
    for item in items:
        if "postgres_schema" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
        if grouped and item.get_closest_marker("spread") is None:
            item.add_marker(pytest.mark.xdist_group(_module(item)))


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
