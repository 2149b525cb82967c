"""A wave's postgres records share their round trips, and one that fails still rolls back alone.

On real servers (broker, Redis, PostgreSQL): sixty records in one wave (one partition,
produced before the worker starts). Their statements go out in psycopg's pipeline mode, so
the wave waits for PostgreSQL a few times, not once or twice per record. Inside the
pipeline, one record's INSERT fails without its handler ever reading a result (the error
aborts every statement queued after it), another's handler raises after writing, and a
third reads a result mid-wave: the failures are dead-lettered with their own errors, their
writes rolled back, and every other record granted exactly once with its inbox row (the
records queued after the failing INSERT run again). What pipeline mode cannot carry (a
parameterless statement, COPY, ``stream()``, a server-side cursor) leaves the pipeline
first and still runs inside the record's savepoint.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import psycopg
import pytest
from aiokafka import AIOKafkaProducer
from psycopg.waiting import Wait
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.postgres import inbox
from reliable_consumer.engine.records import Outcome
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from reliable_consumer.testing import HandlerTestKit
from tests.helpers import await_until
from tests.integration.harness import (
    OBSERVATION_TIMEOUT_S,
    make_settings,
    postgres_rows,
    prepare_topics,
    running_worker,
)

from service import Context, PermanentError, handler

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

RECORDS = 60  # one transaction (at most 64)
GRANT = (
    "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
    " source) VALUES (%s, %s, 'u', 'p', 1, 'EUR', 'pipeline')"
)
FAILS = {4: "sql", 11: "raise"}  # offset -> how its record fails
READS = 7  # the offset whose handler reads a result mid-wave


class Order(BaseModel):
    order_id: str
    does: str = ""  # "sql": its INSERT breaks a constraint; "raise": raises; "read": a SELECT


@handler(
    "pipelined_orders",
    model=Order,
    dedupe_key="order_id",
    store="postgres",
    fail_on=(psycopg.errors.CheckViolation,),
)
async def grant_order(order: Order, ctx: Context) -> None:
    assert ctx.db is not None
    if order.does == "read":
        cur = await ctx.db.execute("SELECT %s::text", (order.order_id,))
        assert await cur.fetchone() == (order.order_id,)
    # kind='bogus' breaks the table's CHECK: an error the handler never reads
    await ctx.db.execute(GRANT, (order.order_id, "bogus" if order.does == "sql" else "grant"))
    if order.does == "raise":
        raise PermanentError("refused after writing")


class RoundTrips:
    """Counts the calls on the worker's connections that waited for PostgreSQL to answer
    (however many reads the answer took): its round trips; and the calls that sent anything
    (waited for the socket to take it): each one a send that wakes the server's backend."""

    def __init__(self) -> None:
        self.count = 0
        self.sends = 0

    def counting(self, gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
        waited = sent = False
        try:
            state = next(gen)
            while True:
                if state == Wait.R and not waited:
                    waited = True
                    self.count += 1
                if state in (Wait.W, Wait.RW) and not sent:
                    sent = True
                    self.sends += 1
                state = gen.send((yield state))
        except StopIteration as stop:
            return stop.value


async def _produce(settings: Settings, orders: list[Order]) -> None:
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for o in orders:
            topic = settings.topics["pipelined_orders"]
            await producer.send(topic, o.model_dump_json().encode(), key=o.order_id.encode())
        await producer.flush()
    finally:
        await producer.stop()


async def _settled(settings: Settings, postgres_url: str) -> tuple[Counter[str], set[str]]:
    """Grants and inbox rows once every offset is committed, the dead letters written and
    no retry waits (and two looks in a row agree)."""
    topic = settings.topics["pipelined_orders"]
    last: list[Any] = []

    async def look() -> bool:
        async with asyncio.timeout(OBSERVATION_TIMEOUT_S):
            depth = await audit.retry_queue_depth(
                settings.redis.url.get_secret_value(), settings.redis.effective_prefix
            )
            offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
            grants = await postgres_rows(postgres_url, "SELECT payment_id FROM purchases")
            inboxed = await postgres_rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox")
        settled = depth == (0, 0, 0) and all(p.committed == p.high_watermark for p in offsets)
        seen = (settled, sorted(grants), sorted(inboxed))
        agreed = settled and last == [seen]
        last[:] = [seen]
        return agreed

    await await_until(look, 90, interval=0.3, message=lambda: f"not settled: {last}")
    _, grants, inboxed = last[0]
    return Counter(str(g) for (g,) in grants), {str(k) for (k,) in inboxed}


async def test_a_wave_costs_no_round_trip_nor_send_per_record_and_a_failing_record_rolls_back_alone(
    kafka_broker: Broker,
    redis_url: str,
    postgres_url: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each record once cost two round trips (its savepoint, then its handler's INSERT),
    each waited for: the worker's thread spent its time in psycopg (docs/performance.md)."""
    trips = RoundTrips()
    connection = inbox._connection_class()
    real_wait = connection.wait

    async def wait(self: Any, gen: Any, *args: Any, **kwargs: Any) -> Any:
        return await real_wait(self, trips.counting(gen), *args, **kwargs)

    monkeypatch.setattr(connection, "wait", wait)
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"pipelined_orders": unique_name},
        postgres={"url": postgres_url},
    )
    await prepare_topics(settings, partitions=1)
    does = {**FAILS, READS: "read"}
    orders = [Order(order_id=f"{unique_name}-{i}", does=does.get(i, "")) for i in range(RECORDS)]
    await _produce(settings, orders)
    async with running_worker(settings, registry=Registry([grant_order], settings.topics)):
        grants, inboxed = await _settled(settings, postgres_url)
        dead = sorted(
            (
                int(audit.header(r, "x-dlq-source-offset") or -1),
                audit.header(r, "x-dlq-reason") or "",
                audit.header(r, "x-dlq-error") or "",
            )
            for r in await audit.read_all(settings.kafka, settings.dead_letter_topic(unique_name))
        )
    assert [(offset, reason) for offset, reason, _ in dead] == [
        (4, "permanent"),
        (11, "permanent"),
    ], dead
    assert "purchases_kind_check" in dead[0][2], dead[0][2]
    assert "refused after writing" in dead[1][2], dead[1][2]
    granted = {o.order_id for i, o in enumerate(orders) if i not in FAILS}
    assert grants == Counter(granted), grants
    assert inboxed == granted
    # The worker's start checks; the wave's begin, inbox rows and COMMIT; the read; a sync
    # and a rollback for the record that raised, and for the failing INSERT (then the
    # records after it again, the read too): about twenty, not two per record.
    assert trips.count < RECORDS // 2, f"{trips.count} round trips for {RECORDS} records"
    # A statement is queued, not sent: the wave's go out together when a result is read or
    # at the sync (each send used to wake the server once or twice per record).
    assert trips.sends < RECORDS // 2, f"{trips.sends} sends for {RECORDS} records"


async def _grant_by_copy(db: Any, order_id: str) -> None:
    async with db.cursor().copy(
        "COPY purchases (payment_id, kind, user_id, product_id, amount_minor, currency, source)"
        " FROM STDIN"
    ) as copy:
        await copy.write_row((order_id, "grant", "u", "p", 1, "EUR", "copy"))


async def _grant_after_a_server_side_cursor(db: Any, order_id: str) -> None:
    async with db.cursor(name="pipeline_test") as cur:
        await cur.execute("SELECT %s::text", (order_id,))
        assert await cur.fetchall() == [(order_id,)]
    await db.execute(GRANT, (order_id, "grant"))


async def _grant_after_a_stream(db: Any, order_id: str) -> None:
    async for row in db.cursor().stream("SELECT %s::text", (order_id,)):
        assert row == (order_id,)
    await db.execute(GRANT, (order_id, "grant"))


async def _grant_by_simple_queries(db: Any, order_id: str) -> None:
    quoted = order_id.replace("'", "''")
    await db.execute(
        "SELECT 1; INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor,"
        f" currency, source) VALUES ('{quoted}', 'grant', 'u', 'p', 1, 'EUR', 'simple')"
    )


async def _grant_unread(db: Any, order_id: str) -> None:
    await db.execute(GRANT, (order_id, "grant"))


async def _copy_then_raise(db: Any, order_id: str) -> None:
    await _grant_by_copy(db, order_id)
    raise PermanentError("refused after its COPY")


async def _break_a_check_unread(db: Any, order_id: str) -> None:
    await db.execute(GRANT, (order_id, "bogus"))  # its error reaches no handler


OUT_OF_PIPELINE: dict[str, Callable[[Any, str], Awaitable[None]]] = {
    "copy": _grant_by_copy,
    "server cursor": _grant_after_a_server_side_cursor,
    "stream": _grant_after_a_stream,
    "simple": _grant_by_simple_queries,
    "": _grant_unread,
    "sql": _break_a_check_unread,
    "raise": _copy_then_raise,
}


@handler(
    "unpipelined_orders",
    model=Order,
    dedupe_key="order_id",
    store="postgres",
    fail_on=(psycopg.errors.CheckViolation,),
)
async def grant_out_of_the_pipeline(order: Order, ctx: Context) -> None:
    assert ctx.db is not None
    await OUT_OF_PIPELINE[order.does](ctx.db, order.order_id)


async def test_what_pipeline_mode_cannot_carry_runs_in_its_records_savepoint_after_the_queue(
    postgres_url: str,
) -> None:
    """Each of these syncs the wave's pipeline first (the queued statements of the records
    before it run, a failure among them found), then runs in its record's savepoint: granted
    once with the wave's COMMIT, undone when an earlier unread error aborted it (it runs
    again), never outside the wave's transaction."""
    does = ["", "sql", "copy", "server cursor", "", "stream", "raise", "simple", "", "copy"]
    orders = [Order(order_id=f"np-{i}", does=d) for i, d in enumerate(does)]
    async with HandlerTestKit(grant_out_of_the_pipeline, postgres_url=postgres_url) as kit:
        results = await kit.send_batch(orders)  # one wave, one transaction
    assert [r.outcome for r in results] == [
        Outcome.DEAD_LETTERED if d in ("sql", "raise") else Outcome.SUCCEEDED for d in does
    ], [(r.outcome, r.reason) for r in results]
    granted = [o.order_id for o in orders if o.does not in ("sql", "raise")]
    grants = await postgres_rows(postgres_url, "SELECT payment_id FROM purchases ORDER BY id")
    assert [str(g) for (g,) in grants] == granted
    inboxed = await postgres_rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox")
    assert sorted(str(k) for (k,) in inboxed) == sorted(granted)
