"""The PostgreSQL outbox: a handler's emissions in ``kafka_outbox``, written by the wave.

A postgres handler's effects commit in the wave's transaction (postgres/inbox.py), so its
emissions must too: the wave queues their INSERT (``emissions_insert``) inside the record's
savepoint after its handler returned. A record rolled back to its savepoint takes its rows
with it; a duplicate, a conflict or a parked record never runs, so it writes none; and the
wave's COMMIT makes them durable together with the inbox rows. ``PostgresOutboxStore`` is
what the relay reads: the unpublished rows in id order, marked published once Kafka
acknowledged them, then kept ``outbox_retention_h`` for trace and deleted in bounded
batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reliable_consumer.engine.handlers.emissions import Emission, Emissions
from reliable_consumer.engine.outbox.store import OutboxDepth, PendingEmission
from reliable_consumer.engine.settings import PostgresSettings

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

    from reliable_consumer.engine.postgres.inbox import InboxStore

OUTBOX = "kafka_outbox"
_ROW = "(%s, %s, %s::bytea, %s::bytea, %s::text[], %s::bytea[], %s)"
_INSERT = (
    f"INSERT INTO {OUTBOX} (event_id, topic, key, value, header_names, header_values, handler) "
    "VALUES {rows} ON CONFLICT (event_id) DO NOTHING"
)
_COLUMNS = "id, event_id, topic, key, value, header_names, header_values"
_PENDING = (
    f"SELECT {_COLUMNS}, (extract(epoch FROM written_at) * 1000)::bigint "
    f"FROM {OUTBOX} WHERE published_at IS NULL ORDER BY id LIMIT %s"
)
_BY_HANDLER = f"SELECT {_COLUMNS} FROM {OUTBOX} WHERE handler = %s ORDER BY id"
_MARK = (
    f"UPDATE {OUTBOX} SET published_at = now() "
    "WHERE id = ANY(%s::bigint[]) AND published_at IS NULL"
)
_PRUNE = (
    f"DELETE FROM {OUTBOX} WHERE id IN (SELECT id FROM {OUTBOX} "
    "WHERE published_at < now() - make_interval(secs => %s) ORDER BY published_at LIMIT %s)"
)
_DEPTH = (
    "SELECT count(*), extract(epoch FROM now() - min(written_at))::float8 "
    f"FROM {OUTBOX} WHERE published_at IS NULL"
)


def emissions_insert(emissions: Emissions | None) -> tuple[bytes, list[Any]] | None:
    """The INSERT of a record's emissions and its parameters, one statement for all of them;
    None when it emitted nothing.

    The wave queues it in the record's open savepoint after its handler returned
    (``WaveTransaction.queue_in_savepoint``), only while the session is still in a healthy
    transaction: a handler that ended it, turned autocommit on or left it aborted is judged
    by the inbox's checks, and nothing is written outside the wave's transaction. An event
    id already in the table (its record ran again after its inbox row was pruned) is kept as
    it is: every copy of one event carries one id, so the first row stands for it.
    """
    if emissions is None or not emissions.emitted:
        return None
    params: list[Any] = []
    for e in emissions.emitted:
        params += [
            e.event_id,
            e.topic,
            e.key,
            e.value,
            [name for name, _ in e.headers],
            [value for _, value in e.headers],
            emissions.handler,
        ]
    rows = ", ".join([_ROW] * len(emissions.emitted))
    return _INSERT.format(rows=rows).encode(), params


async def emitted_by(pool: AsyncConnectionPool[Any], handler: str) -> list[Emission]:
    """Every row ``handler``'s records wrote, published or not, in id order (trace, tests)."""
    async with pool.connection() as conn:
        cur = await conn.execute(_BY_HANDLER, (handler,))
        found = await cur.fetchall()
    return [_emission(*row[1:7]) for row in found]


def _emission(
    event_id: str, topic: str, key: Any, value: Any, names: list[str], values: list[Any]
) -> Emission:
    return Emission(
        topic,
        None if key is None else bytes(key),
        bytes(value),
        tuple(zip(names, (bytes(v) for v in values), strict=True)),
        event_id,
    )


class PostgresOutboxStore:
    """The relay's view of ``kafka_outbox``, over the inbox's connection pool."""

    name = "postgres"

    def __init__(
        self, pool: AsyncConnectionPool[Any], *, retention_h: float, prune_batch: int
    ) -> None:
        self._pool = pool
        self._retention_s = retention_h * 3600
        self._prune_batch = prune_batch
        self.pruned = 0  # rows retention deleted, since start

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        """The oldest ``limit`` unpublished rows, in id order (the order their records'
        handlers ran in, for the records of one key)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(_PENDING, (limit,))
            found = await cur.fetchall()
        return [
            PendingEmission(str(row[0]), _emission(*row[1:7]), written_ms=int(row[7]))
            for row in found
        ]

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        """Mark ``entries`` published (the relay never hands them out again), then delete
        at most one batch of rows published longer ago than the retention."""
        if not entries:
            return
        async with self._pool.connection() as conn:
            await conn.execute(_MARK, ([int(e.position) for e in entries],))
        await self.prune()

    async def prune(self) -> int:
        """Delete at most ``prune_batch`` of the rows published before the retention window;
        how many it deleted. Bounded, so a long backlog is worked off a batch per round."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(_PRUNE, (self._retention_s, self._prune_batch))
            deleted = int(cur.rowcount)
        self.pruned += deleted
        return deleted

    async def depth(self) -> OutboxDepth:
        """Rows waiting, and the age of the oldest (by the database's clock)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(_DEPTH)
            row = await cur.fetchone()
        count, oldest = row if row is not None else (0, None)
        return OutboxDepth(int(count), None if oldest is None else max(0.0, float(oldest)))


def postgres_outbox_store(
    inbox: InboxStore | None, settings: PostgresSettings
) -> PostgresOutboxStore | None:
    """The relay's postgres store when a bound handler keeps its effects in PostgreSQL
    (the worker has an inbox), else None: the worker's start adds it to the relay's stores."""
    if inbox is None:
        return None
    return PostgresOutboxStore(
        inbox.pool,
        retention_h=settings.outbox_retention_h,
        prune_batch=settings.outbox_prune_batch,
    )
