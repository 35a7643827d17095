"""The PostgreSQL ledger's sealed store head: records deleted or put back are refused.

Without a store head, someone with write access to the ledger schema could
delete a run's record (its row and its head row) or put it back to an older
sealed version, and every host took the ledger as it then was (a run's
routes record gone, the same operation key dispatched to a second scope).
Now every write transaction moves a sealed store head over every record and
every open checks it: such an edit is ``rollback_detected``. A digest set to
NULL is refused unless the migration's sealed record says it is still to be
built (a schema from before the store head gets it built once). Real
PostgreSQL schema; store objects as hosts.
"""

from __future__ import annotations

import pytest

from octo_common.errors import RollbackDetected
from octo_host.store import ledger_record_key
from tests.postgres import PostgresSchema

from .test_ledger_store_postgres import RUN, store_in

OTHER = ledger_record_key("release-43")

pytestmark = pytest.mark.postgres


async def sql(
    place: PostgresSchema, statement: str, *arguments: object
) -> list[tuple[object, ...]]:
    connection = await place.connect()
    try:
        return [tuple(row) for row in await connection.fetch(statement, *arguments)]
    finally:
        await connection.close()


async def written(place: PostgresSchema) -> None:
    """Two runs' records, one of them rewritten."""
    store = store_in(place)
    try:
        await store.create(RUN, b"v1")
        await store.create(OTHER, b"other")
        await store.replace(RUN, 1, b"v2")
    finally:
        await store.close()


async def refused(place: PostgresSchema) -> None:
    store = store_in(place)
    try:
        with pytest.raises(RollbackDetected):
            await store.load(OTHER)
    finally:
        await store.close()


async def delete_run(place: PostgresSchema) -> None:
    for table in ("items", "heads"):
        assert await sql(place, f"DELETE FROM {table} WHERE name = $1 RETURNING name", RUN.name)


async def test_a_record_deleted_with_its_head_row_is_refused(
    postgres_schema: PostgresSchema,
) -> None:
    await written(postgres_schema)
    await delete_run(postgres_schema)
    await refused(postgres_schema)


async def test_a_record_put_back_to_its_older_sealed_version_is_refused(
    postgres_schema: PostgresSchema,
) -> None:
    store = store_in(postgres_schema)
    try:
        await store.create(RUN, b"v1")
        ((old,),) = await sql(
            postgres_schema, "SELECT envelope FROM items WHERE name = $1", RUN.name
        )
        await store.replace(RUN, 1, b"v2")
    finally:
        await store.close()
    await sql(
        postgres_schema,
        "UPDATE items SET revision = 1, envelope = $2 WHERE name = $1",
        RUN.name,
        old,
    )
    await sql(postgres_schema, "UPDATE heads SET revision = 1 WHERE name = $1", RUN.name)
    await refused(postgres_schema)


async def test_a_digest_set_to_null_hides_no_deleted_record(
    postgres_schema: PostgresSchema,
) -> None:
    await written(postgres_schema)
    await delete_run(postgres_schema)
    await sql(postgres_schema, "UPDATE store_head SET digest = NULL")
    await refused(postgres_schema)
    await sql(postgres_schema, "DELETE FROM store_head")
    await refused(postgres_schema)


async def test_a_ledger_from_before_the_store_head_gets_it_built_once(
    postgres_schema: PostgresSchema,
) -> None:
    await written(postgres_schema)
    await sql(postgres_schema, "DROP TABLE store_head")
    await sql(postgres_schema, "UPDATE schema_version SET version = 1")
    store = store_in(postgres_schema)
    try:
        found = await store.load(RUN)
        assert found is not None and found.payload == b"v2"
        await store.replace(RUN, 2, b"v3")
    finally:
        await store.close()
    ((revision, count, built),) = await sql(
        postgres_schema, "SELECT revision, record_count, digest IS NOT NULL FROM store_head"
    )
    assert (revision, count, built) == (1, 2, True)
    # The head built by the migration is the one every open checks.
    await delete_run(postgres_schema)
    await refused(postgres_schema)
