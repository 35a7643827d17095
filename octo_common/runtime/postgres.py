"""PostgreSQL for both stores: where it is, how it is opened and migrated, how it fails.

Owns the checks of the ``[storage]`` values a PostgreSQL store is built
from (a ``postgresql://`` URL that never carries a password, a schema name
safe to quote into SQL, the password read from a private file with the one
private-file rule of :mod:`octo_common.keyfile`, and the URL as it may be
shown), the connection pool both stores open (``synchronous_commit = on``,
a bound on idle transactions, the password read at each new connection),
forward schema migrations under a ``schema_version`` table and an advisory
lock (so processes opening one database together migrate it once), and how
a database failure is told (:func:`postgres_error`: operation, class and
SQLSTATE, never a message or a bound value).

It must never log, return or raise a password or a file's content, accept a
URL with a password in it, or run a statement it did not get from a store.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from octo_common.errors import OctoError, StorageBackendError
from octo_common.keyfile import KeyFileRefused, read_private_file

__all__ = [
    "PostgresMigrationStep",
    "bound_loop",
    "PoolSettings",
    "PostgresError",
    "advisory_lock_key",
    "check_schema",
    "check_url",
    "connect_pool",
    "migrate_schema",
    "postgres_error",
    "read_password_file",
    "redacted_url",
    "schema_version",
    "wait_for_close",
]

PostgresError = asyncpg.PostgresError
Connection: TypeAlias = "asyncpg.Connection[Any] | PoolConnectionProxy[Any]"

_PASSWORD_READ_LIMIT = 4097  # one byte more than the longest password accepted
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def check_url(url: object) -> str:
    if not isinstance(url, str):
        raise TypeError("url must be a str")
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
        query = urllib.parse.parse_qs(parts.query)
    except ValueError:
        raise StorageBackendError("url: not a valid postgresql:// URL") from None
    if parts.scheme not in ("postgresql", "postgres"):
        raise StorageBackendError("url: must start with postgresql://")
    if password is not None or "password" in query:
        raise StorageBackendError("url: must not contain a password (give password_file)")
    return url


def redacted_url(url: str) -> str:
    """``scheme://user@host:port/database``: no query, never a password."""
    parts = urllib.parse.urlsplit(url)
    user = f"{parts.username}@" if parts.username else ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{user}{host}{port}{parts.path}"


def check_schema(schema: object) -> str:
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise StorageBackendError("schema: must match [a-z_][a-z0-9_]{0,62}")
    if schema.startswith("pg_"):
        raise StorageBackendError("schema: names starting with pg_ are reserved")
    return schema


_PASSWORD_REFUSALS: dict[str, str] = {
    "missing": "does not exist",
    "unopenable": "cannot be opened (a link, or no permission)",
    "not_regular": "is not a regular file",
    "permissions": "is open to group or others (chmod 600)",
    "owner": "is not owned by the user this process runs as",
    "directory": "is in a directory someone else may write",
    "unreadable": "cannot be read",
    "format": "must hold one line",
}


def read_password_file(path: str | os.PathLike[str]) -> str:
    """The password in ``path``, under the one private-file rule (``octo_common.keyfile``).

    One line of UTF-8; a trailing newline is not part of it. Failures are
    ``StorageBackendError`` naming the problem, never the content.
    """
    try:
        content = read_private_file(path, _PASSWORD_READ_LIMIT)
    except KeyFileRefused as refused:
        raise StorageBackendError(f"password_file: {_PASSWORD_REFUSALS[refused.reason]}") from None
    try:
        text = content.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise StorageBackendError("password_file: not UTF-8 text") from None
    if len(content) >= _PASSWORD_READ_LIMIT or not text or "\n" in text:
        raise StorageBackendError("password_file: must hold one line")
    return text


# Failures ------------------------------------------------------------------------------


def postgres_error(operation: str, exc: BaseException) -> OctoError:
    """What a caller sees for ``exc``: a protocol error as it is, else a fresh
    ``StorageBackendError`` naming ``operation``, the class and the SQLSTATE,
    never the server's message (it can quote bound values)."""
    if isinstance(exc, OctoError):
        return exc
    if isinstance(exc, asyncpg.PostgresError):
        return StorageBackendError(f"{operation}: {type(exc).__name__} ({exc.sqlstate})")
    if isinstance(exc, TimeoutError):
        return StorageBackendError(f"{operation}: timed out")
    return StorageBackendError(f"{operation}: {type(exc).__name__}")


# Opening -------------------------------------------------------------------------------


async def connect_pool(
    url: str,
    password_file: str | os.PathLike[str] | None,
    *,
    application_name: str,
    max_size: int,
    connect_timeout: float,
    command_timeout: float,
    idle_transaction_timeout: float,
    read_only: bool = False,
) -> asyncpg.Pool:
    """A pool of at most ``max_size`` connections to ``url`` (checked by :func:`check_url`).

    Every session commits with ``synchronous_commit = on`` (a COMMIT returns
    once its WAL is flushed) and is ended by the server when a transaction
    stays idle for ``idle_transaction_timeout`` seconds (a paused process
    cannot hold its locks for long). The password file, if any, is read at
    each new connection, so a rotated password is picked up. With
    ``read_only`` every transaction is read-only (the server refuses a write).

    A connection goes back to the pool without asyncpg's reset query (one
    more round trip per read): the stores keep no session state (statements
    name their schema, advisory locks are transaction-scoped, no cursor
    outlives its transaction, no LISTEN), and a transaction left open is
    still rolled back by the pool before the connection is reused.
    """

    def password() -> str:
        assert password_file is not None
        return read_password_file(password_file)

    settings = {
        "synchronous_commit": "on",
        "idle_in_transaction_session_timeout": str(max(1, int(idle_transaction_timeout * 1000))),
        "application_name": application_name,
    }
    if read_only:
        settings["default_transaction_read_only"] = "on"
    pool: asyncpg.Pool = await asyncpg.create_pool(
        url,
        password=None if password_file is None else password,
        min_size=1,
        max_size=max_size,
        timeout=connect_timeout,
        command_timeout=command_timeout,
        server_settings=settings,
        reset=_keep_session,
    )
    return pool


async def _keep_session(connection: asyncpg.Connection[Any]) -> None:
    """The pool's reset: nothing beyond asyncpg's own rollback (see :func:`connect_pool`)."""


def advisory_lock_key(name: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_xact_lock`` named by ``name``."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


PostgresMigrationStep: TypeAlias = str | Callable[[Any, str], Awaitable[None]]
"""One step of a migration: an SQL statement (``{s}``: the quoted schema), or an
async function called with the connection and the quoted schema inside the
migration's transaction (to build what SQL alone cannot)."""


async def migrate_schema(
    connection: Connection,
    schema: str,
    migrations: Sequence[Sequence[PostgresMigrationStep]],
    lock_name: str,
) -> int:
    """Create ``schema`` when absent and move it forward to ``len(migrations)``.

    ``migrations[i]`` moves version ``i`` to ``i + 1``; each statement names
    its tables through ``{s}``, the quoted schema (a name :func:`check_schema`
    accepted); a function step gets the connection and the quoted schema.
    One transaction under the advisory lock ``lock_name``, so processes
    opening a fresh database together migrate it once. A schema newer than
    ``migrations`` is refused; a current one runs no DDL (a role with only
    table privileges can use the store). Returns the version found.
    """
    quoted = f'"{check_schema(schema)}"'
    target = len(migrations)
    async with connection.transaction():
        await connection.execute("SELECT pg_advisory_xact_lock($1)", advisory_lock_key(lock_name))
        version = 0
        if await connection.fetchval(f"SELECT to_regclass('{quoted}.schema_version') IS NOT NULL"):
            rows = await connection.fetch(f"SELECT version FROM {quoted}.schema_version")  # noqa: S608
            if len(rows) > 1:
                raise StorageBackendError("open: malformed schema_version table")
            version = rows[0][0] if rows else 0
        if version > target:
            raise StorageBackendError(f"open: schema version {version} is newer than supported")
        if version == target:
            return int(version)
        await connection.execute(f"CREATE SCHEMA IF NOT EXISTS {quoted}")
        await connection.execute(
            f"CREATE TABLE IF NOT EXISTS {quoted}.schema_version (version BIGINT NOT NULL)"
        )
        for steps in migrations[version:]:
            for step in steps:
                if isinstance(step, str):
                    await connection.execute(step.format(s=quoted))
                else:
                    await step(connection, quoted)
        await connection.execute(f"DELETE FROM {quoted}.schema_version")  # noqa: S608
        await connection.execute(
            f"INSERT INTO {quoted}.schema_version (version) VALUES ($1)",  # noqa: S608
            target,
        )
        return int(version)


async def schema_version(connection: Connection, schema: str) -> int | None:
    """The version in ``schema``'s ``schema_version`` table; None without the table."""
    quoted = f'"{check_schema(schema)}"'
    if not await connection.fetchval(f"SELECT to_regclass('{quoted}.schema_version') IS NOT NULL"):
        return None
    rows = await connection.fetch(f"SELECT version FROM {quoted}.schema_version")  # noqa: S608
    if len(rows) != 1:
        raise StorageBackendError("open: malformed schema_version table")
    return int(rows[0][0])


async def wait_for_close(pool: asyncpg.Pool, timeout: float) -> None:
    """Close ``pool`` gracefully within ``timeout`` seconds, else terminate it."""
    try:
        await asyncio.wait_for(pool.close(), timeout=timeout)
    except (Exception, asyncio.CancelledError):
        pool.terminate()


class PoolSettings:
    """Where and how a store connects, checked once when the store is built.

    The URL is checked by :func:`check_url` (never a password in it); the
    password, if any, stays in its file and is read at each new connection.
    """

    __slots__ = (
        "command_timeout",
        "connect_timeout",
        "idle_transaction_timeout",
        "max_connections",
        "password_file",
        "url",
    )

    def __init__(
        self,
        url: str,
        password_file: str | os.PathLike[str] | None,
        max_connections: int,
        timeouts: tuple[float, float, float],
        *,
        min_connections: int,
    ) -> None:
        """``timeouts``: connect, command and idle-in-transaction, in seconds."""
        connect_timeout, command_timeout, idle_transaction_timeout = timeouts
        self.url = check_url(url)
        self.password_file = None if password_file is None else os.fspath(password_file)
        if type(max_connections) is not int or not min_connections <= max_connections <= 100:
            raise ValueError(f"max_connections must be in {min_connections}..100")
        for value in (connect_timeout, command_timeout, idle_transaction_timeout):
            if not value > 0:
                raise ValueError("timeouts must be positive")
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.command_timeout = command_timeout
        self.idle_transaction_timeout = idle_transaction_timeout

    def __repr__(self) -> str:
        return f"PoolSettings(url={redacted_url(self.url)!r})"

    async def open(
        self,
        application_name: str,
        prepare: Callable[[Connection], Awaitable[None]],
        *,
        read_only: bool = False,
    ) -> asyncpg.Pool:
        """A new pool whose first connection has run ``prepare`` (the schema's
        migration or check); the pool is terminated if anything fails."""
        pool = await self.connect(application_name, read_only=read_only)
        try:
            async with pool.acquire() as connection:
                await prepare(connection)
        except BaseException:
            pool.terminate()
            raise
        return pool

    async def connect(self, application_name: str, *, read_only: bool = False) -> asyncpg.Pool:
        """A new pool with these settings (see :func:`connect_pool`)."""
        return await connect_pool(
            self.url,
            self.password_file,
            application_name=application_name,
            max_size=self.max_connections,
            connect_timeout=self.connect_timeout,
            command_timeout=self.command_timeout,
            idle_transaction_timeout=self.idle_transaction_timeout,
            read_only=read_only,
        )


def bound_loop(bound: asyncio.AbstractEventLoop | None, what: str) -> asyncio.AbstractEventLoop:
    """The running event loop, which must be ``bound`` once a store is bound to one
    (a pool's connections belong to the loop that opened them)."""
    loop = asyncio.get_running_loop()
    if bound is not None and bound is not loop:
        raise StorageBackendError(f"the {what} is bound to another event loop")
    return loop
