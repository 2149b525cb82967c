"""The PostgreSQL outbox on the embedded PostgreSQL: emissions commit with their wave.

A postgres handler's ``ctx.emit`` rows are inserted in the record's savepoint after its
handler returned (engine/outbox/postgres_store.py), so they share the fate of its effects
and its inbox row: committed with the wave, rolled back with a failing record's savepoint,
never written for a duplicate. ``PostgresOutboxStore`` hands the relay the unpublished rows
in order, marks them, and deletes published rows past the retention in bounded batches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.outbox.postgres_store import PostgresOutboxStore
from reliable_consumer.engine.records import Outcome
from reliable_consumer.testing import HandlerTestKit

from service import Context, PermanentError, handler

pytestmark = pytest.mark.asyncio

EVENTS = "orders.accepted"


class Order(BaseModel):
    order_id: str
    fail: bool = False


@handler("emitting_orders", model=Order, dedupe_key="order_id", store="postgres", emits=(EVENTS,))
async def accept_order(order: Order, ctx: Context) -> None:
    """Writes its row and emits its event, then fails when told to: its savepoint must take
    the event back with the row."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', 'test')",
        (order.order_id,),
    )
    ctx.emit(EVENTS, {"order_id": order.order_id}, key=order.order_id, headers={"type": "x"})
    if order.fail:
        raise PermanentError("this order is refused after its row and event were written")


async def test_emissions_commit_with_their_wave_and_none_for_a_rolled_back_record_or_a_duplicate(
    postgres_url: str,
) -> None:
    orders = [Order(order_id=f"o{i}", fail=i == 2) for i in range(5)]
    async with HandlerTestKit(accept_order, postgres_url=postgres_url) as kit:
        results = await kit.send_batch(orders)  # one wave: one transaction, a savepoint each
        assert [r.outcome for r in results] == [
            *[Outcome.SUCCEEDED] * 2,
            Outcome.DEAD_LETTERED,
            *[Outcome.SUCCEEDED] * 2,
        ]
        again = await kit.send(orders[0])  # redelivered: a duplicate, its handler not run
        assert again.outcome is Outcome.DUPLICATE
        emitted = await kit.emitted()
    applied = [o.order_id for o in orders if not o.fail]
    assert [e.event_id for e in emitted] == [event_id("emitting_orders", key, 0) for key in applied]
    assert [(e.topic, e.key, e.value, e.headers) for e in emitted] == [
        (EVENTS, key.encode(), f'{{"order_id":"{key}"}}'.encode(), (("type", b"x"),))
        for key in applied
    ]


@handler(
    "pipelined_emitting_orders",
    model=Order,
    dedupe_key="order_id",
    store="postgres",
    emits=(EVENTS,),
    fail_on=(psycopg.errors.CheckViolation,),
)
async def accept_order_unread(order: Order, ctx: Context) -> None:
    """Its INSERT breaks the table's CHECK when told to, and it never reads a result: the
    error surfaces only at the wave's sync, and aborts every record queued after it."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, %s, 'u', 'p', 1, 'EUR', 'test')",
        (order.order_id, "bogus" if order.fail else "grant"),
    )
    ctx.emit(EVENTS, {"order_id": order.order_id}, key=order.order_id)


async def test_a_pipelined_wave_writes_each_granted_records_emissions_once_also_those_run_again(
    postgres_url: str,
) -> None:
    """The wave's statements are pipelined: its records' results are not read while they
    run. Their emissions go in the same pipeline, behind their handler's SQL; the records
    after a failing INSERT run again (their first run's statements aborted) and emit once."""
    orders = [Order(order_id=f"q{i}", fail=i == 1) for i in range(5)]
    async with HandlerTestKit(accept_order_unread, postgres_url=postgres_url) as kit:
        results = await kit.send_batch(orders)
        assert [r.outcome for r in results] == [
            Outcome.SUCCEEDED,
            Outcome.DEAD_LETTERED,
            *[Outcome.SUCCEEDED] * 3,
        ]
        emitted = await kit.emitted()
    applied = [o.order_id for o in orders if not o.fail]
    handler_name = "pipelined_emitting_orders"
    assert [e.event_id for e in emitted] == [event_id(handler_name, key, 0) for key in applied]


class Shadowing(BaseModel):
    order_id: str
    shadow: bool = False


@handler(
    "shadowing_orders", model=Shadowing, dedupe_key="order_id", store="postgres", emits=(EVENTS,)
)
async def emit_into_a_shadowed_outbox(order: Shadowing, ctx: Context) -> None:
    """When told to, hides kafka_outbox behind a temporary table without its columns (inside
    its savepoint), so that the worker's INSERT of its emissions fails after it returned."""
    assert ctx.db is not None
    if order.shadow:
        await ctx.db.execute("CREATE TEMP TABLE kafka_outbox (other int) ON COMMIT DROP", ())
    ctx.emit(EVENTS, {"order_id": order.order_id}, key=order.order_id)


async def test_a_failing_emissions_insert_fails_its_record_with_its_own_error_not_its_wave(
    postgres_url: str,
) -> None:
    """The INSERT is queued in the wave's pipeline, its result read only at the sync: the
    record is rolled back with the INSERT's error (not taken for a handler that swallowed
    one), and the wave-mate queued after it runs again and emits once."""
    orders = [Shadowing(order_id="s0"), Shadowing(order_id="s1", shadow=True)]
    orders.append(Shadowing(order_id="s2"))
    async with HandlerTestKit(emit_into_a_shadowed_outbox, postgres_url=postgres_url) as kit:
        results = await kit.send_batch(orders)
        emitted = await kit.emitted()
    assert [r.outcome for r in results] == [
        Outcome.SUCCEEDED,
        Outcome.RETRY_SCHEDULED,
        Outcome.SUCCEEDED,
    ]
    reason = results[1].reason or ""
    assert 'column "event_id" of relation "kafka_outbox" does not exist' in reason, reason
    assert "caught" not in reason, reason
    assert [e.event_id for e in emitted] == [
        event_id("shadowing_orders", key, 0) for key in ("s0", "s2")
    ]


@pytest.fixture
async def pool(postgres_url: str) -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool(postgres_url, min_size=1, max_size=2, open=False) as opened:
        yield opened


async def _write(url: str, count: int) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for i in range(count):
            await conn.execute(
                "INSERT INTO kafka_outbox (event_id, topic, key, value, handler) "
                "VALUES (%s, 't', NULL, %s, 'h')",
                (f"e{i}", f"v{i}".encode()),
            )


async def test_the_store_hands_out_pending_rows_in_order_marks_them_and_prunes_in_batches(
    postgres_url: str, pool: AsyncConnectionPool
) -> None:
    store = PostgresOutboxStore(pool, retention_h=1, prune_batch=2)
    await _write(postgres_url, 5)
    depth = await store.depth()
    assert depth.pending == 5 and depth.oldest_age_s is not None
    first = await store.pending(3)
    assert [p.emission.event_id for p in first] == ["e0", "e1", "e2"]
    assert [p.emission.value for p in first] == [b"v0", b"v1", b"v2"]
    await store.mark_published(first)
    rest = await store.pending(10)
    assert [p.emission.event_id for p in rest] == ["e3", "e4"]
    assert (await store.depth()).pending == 2
    await store.mark_published(rest)
    assert await store.pending(10) == []
    assert await store.depth() == type(depth)(0, None)
    # Published within the retention: kept for trace.
    assert await store.prune() == 0
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as conn:
        await conn.execute("UPDATE kafka_outbox SET published_at = now() - interval '2 hours'")
    # Past it: deleted, at most a batch at a time.
    assert [await store.prune() for _ in range(4)] == [2, 2, 1, 0]
