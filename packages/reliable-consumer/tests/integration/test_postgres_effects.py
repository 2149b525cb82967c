"""The postgres effects store on real servers: broker, Redis and PostgreSQL (pgserver's).

The example handler (service/handlers/purchases.py) grants into the purchases table inside
the transaction that writes the record's inbox row; a wave of records shares one
transaction, a savepoint each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.registry import Registry, discover
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    postgres_rows,
    prepare_topics,
    produce,
    purchases_settings,
    running_worker,
    wait_settled,
)

from service import Context, PermanentError, handler, sample

pytestmark = pytest.mark.asyncio


def pg_settings(
    broker: Broker, redis_url: str, postgres_url: str, name: str, **kw: Any
) -> Settings:
    return purchases_settings(broker.bootstrap, redis_url, postgres_url, name, **kw)


rows = postgres_rows


async def test_payments_are_granted_once_each_with_their_inbox_rows(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    settings = pg_settings(kafka_broker, redis_url, postgres_url, unique_name)
    await prepare_topics(settings)
    records = sample.generate(60, sample.Mix(duplicate=0.1, refund=0.1), seed=11)
    await produce(settings, records)
    async with running_worker(settings):
        state = await wait_settled(settings, postgres_url=postgres_url)
    assert_invariants(state, records)
    inbox = await rows(postgres_url, "SELECT handler, dedupe_key, topic FROM kafka_inbox")
    granted = {str(r.payment_id) for r in records if r.expect_grant}
    assert {key for _, key, _ in inbox} == granted
    assert {(h, t) for h, _, t in inbox} == {("purchases", unique_name)}


class Order(BaseModel):
    order_id: str
    fail: bool = False


@handler("orders", model=Order, dedupe_key="order_id", store="postgres")
async def write_then_maybe_fail(order: Order, ctx: Context) -> None:
    """Writes its row, then fails when told to: its savepoint must take the row back."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', 'test')",
        (order.order_id,),
    )
    if order.fail:
        raise PermanentError("this order is refused after its row was written")


async def test_a_failing_record_rolls_back_alone_and_its_batch_mates_commit(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"orders": unique_name},
        postgres={"url": postgres_url},
    )
    await prepare_topics(settings, partitions=1)
    orders = [Order(order_id=f"o{i}", fail=i % 5 == 2) for i in range(40)]
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for o in orders:  # one partition, produced before the worker starts: one batch
            await producer.send(unique_name, o.model_dump_json().encode(), key=o.order_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    registry = Registry([write_then_maybe_fail], settings.topics)
    async with running_worker(settings, registry=registry) as worker:
        dlq = settings.dead_letter_topic(unique_name)

        async def done() -> bool:
            offsets = await audit.group_offsets(
                settings.kafka, settings.kafka.group_id, unique_name
            )
            return all(p.committed == p.high_watermark for p in offsets)

        from tests.helpers import await_until

        await await_until(done, 60, message="offsets committed")
        assert worker.inbox is not None
        commits = worker.inbox.commits
    written = {pid for (pid,) in await rows(postgres_url, "SELECT payment_id FROM purchases")}
    assert written == {o.order_id for o in orders if not o.fail}
    inboxed = {k for (k,) in await rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox")}
    assert inboxed == written
    dead = await audit.read_all(settings.kafka, dlq)
    assert sorted(audit.header(r, "x-dlq-reason") or "" for r in dead) == ["permanent"] * 8
    # The 32 survivors did not each take a transaction: a wave commits once.
    assert commits < len(written) / 4, f"{commits} commits for {len(written)} records"


async def test_a_conflicting_redelivery_is_dead_lettered_and_the_original_row_untouched(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    settings = pg_settings(kafka_broker, redis_url, postgres_url, unique_name)
    await prepare_topics(settings, partitions=1)
    first = {
        "payment_id": "pay-1",
        "user_id": "u1",
        "product_id": "p1",
        "amount_minor": 500,
        "currency": "EUR",
    }
    other = {**first, "amount_minor": 999_999}
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        await producer.send_and_wait(unique_name, json.dumps(first).encode(), key=b"u1")
        async with running_worker(settings):
            from tests.helpers import await_until

            async def granted() -> bool:
                return bool(await rows(postgres_url, "SELECT 1 FROM purchases"))

            await await_until(granted, 30, message="first payment granted")
            # Redis forgets (as after a restart without AOF): only the inbox can tell now.
            client = aioredis.from_url(redis_url)
            await client.flushall()
            await client.aclose()
            await producer.send_and_wait(unique_name, json.dumps(other).encode(), key=b"u1")
            await producer.send_and_wait(unique_name, json.dumps(first).encode(), key=b"u1")
            dlq = settings.dead_letter_topic(unique_name)

            async def dead_lettered() -> bool:
                return len(await audit.read_all(settings.kafka, dlq)) == 1

            await await_until(dead_lettered, 30, message="conflict dead-lettered")
            state = await wait_settled(settings, postgres_url=postgres_url)
    finally:
        await producer.stop()
    (dead,) = await audit.read_all(settings.kafka, dlq)
    assert audit.header(dead, "x-dlq-reason") == "conflict"
    assert await rows(postgres_url, "SELECT payment_id, amount_minor FROM purchases") == [
        ("pay-1", 500)
    ]
    assert state.grants == {"pay-1": 1}


async def test_the_worker_refuses_a_database_without_the_inbox_migration(
    kafka_broker: Broker, redis_url: str, postgres_server: Any, unique_name: str
) -> None:
    from reliable_consumer.engine.errors import ConfigurationError
    from reliable_consumer.engine.worker import Worker

    settings = pg_settings(kafka_broker, redis_url, postgres_server.url, unique_name)
    await prepare_topics(settings)
    worker = Worker(settings, Registry(discover(), settings.topics))
    with pytest.raises(ConfigurationError, match="service db migrate"):
        await asyncio.wait_for(worker.run(), 60)


class Flaky(BaseModel):
    order_id: str
    failures: int = 0  # how many runs fail before one succeeds


@handler("flaky_orders", model=Flaky, dedupe_key="order_id", store="postgres")
async def write_after_failures(order: Flaky, ctx: Context) -> None:
    """Writes a row each run, then fails while runs remain to fail: only the last may stay."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', %s)",
        (order.order_id, str(ctx.attempt)),
    )
    if ctx.attempt <= order.failures:
        from service import RetryableError

        raise RetryableError(f"run {ctx.attempt} fails on purpose")


async def test_the_handler_test_kit_runs_a_postgres_handler_on_a_real_database(
    postgres_url: str,
) -> None:
    from reliable_consumer.testing import HandlerTestKit

    from service.handlers.purchases import grant_purchase

    payment = {
        "payment_id": "kit-1",
        "user_id": "u",
        "product_id": "p",
        "amount_minor": 100,
        "currency": "EUR",
    }
    async with HandlerTestKit(grant_purchase, postgres_url=postgres_url) as kit:
        assert (await kit.send(payment, key="u")).granted
        assert (await kit.send(payment, key="u")).duplicate
        conflict = await kit.send({**payment, "amount_minor": 7}, key="u")
        assert conflict.reason == "conflict"
    async with HandlerTestKit(
        write_after_failures, postgres_url=postgres_url, retry={"jitter": 0}
    ) as kit:
        parked = await kit.send({"order_id": "f-1", "failures": 2})
        assert parked.parked
        assert (await kit.retry(parked)).parked
        assert (await kit.run_due_retries(advance_s=60))[0].granted
    assert await rows(postgres_url, "SELECT payment_id, source FROM purchases ORDER BY id") == [
        ("kit-1", "purchases/0/0"),
        ("f-1", "3"),
    ]  # the failed runs' rows rolled back


@handler("swallowing", model=Flaky, dedupe_key="order_id", store="postgres")
async def swallow_sql_error(order: Flaky, ctx: Context) -> None:
    """Writes a row, then catches an SQL error and returns as if all went well."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', 'x')",
        (order.order_id,),
    )
    with contextlib.suppress(psycopg.errors.UndefinedColumn):
        await ctx.db.execute("SELECT no_such_column FROM purchases")


async def test_a_handler_that_swallows_an_sql_error_is_rolled_back_not_granted(
    postgres_url: str,
) -> None:
    from reliable_consumer.testing import HandlerTestKit

    async with HandlerTestKit(swallow_sql_error, postgres_url=postgres_url) as kit:
        result = await kit.send({"order_id": "s-1"})
        assert result.parked, result
        assert "SQL error it caught" in (result.reason or "")
        # The next transaction on the pool is clean: another such record ends the same way.
        assert (await kit.send({"order_id": "s-2"})).parked
    assert await rows(postgres_url, "SELECT payment_id FROM purchases") == []
    assert await rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox") == []


class Bumpy(BaseModel):
    order_id: str
    fail_first: bool = False


@handler("bumpy_orders", model=Bumpy, dedupe_key="order_id", store="postgres")
async def fail_first_run(order: Bumpy, ctx: Context) -> None:
    """A quarter of the orders fail their first run: an ordinary transient rate, no outage."""
    assert ctx.db is not None
    if order.fail_first and ctx.attempt == 1:
        from service import RetryableError

        raise RetryableError("first run fails")
    await ctx.db.execute("SELECT 1")


async def test_breaker_sees_a_waves_successes_not_only_its_failures(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    """Successes counted only at COMMIT showed the breaker a wave's failures alone: 10 of 40
    failing once opened the circuit (a ratio of 1.0 over min_calls) instead of 0.25."""
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"bumpy_orders": unique_name},
        postgres={"url": postgres_url},
        breaker={"enabled": True, "min_calls": 10, "failure_ratio": 0.5, "window_s": 60},
    )
    await prepare_topics(settings, partitions=1)
    orders = [Bumpy(order_id=f"b{i}", fail_first=i % 4 == 0) for i in range(40)]
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for o in orders:  # before the worker starts: one batch, one wave
            await producer.send(unique_name, o.model_dump_json().encode(), key=o.order_id.encode())
        await producer.flush()
    finally:
        await producer.stop()
    registry = Registry([fail_first_run], settings.topics)
    async with running_worker(settings, registry=registry) as worker:
        from tests.helpers import await_until

        async def all_inboxed() -> bool:
            return len(await rows(postgres_url, "SELECT 1 FROM kafka_inbox")) == len(orders)

        await await_until(all_inboxed, 60, message="every order committed")
        opened = worker.metrics.registry.get_sample_value(
            "worker_circuit_transitions_total", {"circuit": "bumpy_orders", "to": "open"}
        )
    assert not opened, f"the circuit opened {opened} times for a 25% transient rate"


@handler("committing", model=Flaky, dedupe_key="order_id", store="postgres")
async def commit_midway(order: Flaky, ctx: Context) -> None:
    """Writes a row, commits the worker's transaction, then writes another."""
    assert ctx.db is not None
    insert = (
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', 'x')"
    )
    await ctx.db.execute(insert, (order.order_id,))
    await ctx.db.commit()
    await ctx.db.execute(insert, (order.order_id + "-after",))


async def test_a_handler_cannot_commit_the_waves_transaction(postgres_url: str) -> None:
    """A commit inside the handler would keep the inbox row and the first write without the
    second: its effects split, and every redelivery a duplicate. It is refused instead."""
    from reliable_consumer.testing import HandlerTestKit

    async with HandlerTestKit(commit_midway, postgres_url=postgres_url) as kit:
        result = await kit.send({"order_id": "c-1"})
    assert result.reason == "permanent", result
    assert "ctx.db.commit() is the worker's" in (result.error or "")
    assert await rows(postgres_url, "SELECT payment_id FROM purchases") == []
    assert await rows(postgres_url, "SELECT dedupe_key FROM kafka_inbox") == []
