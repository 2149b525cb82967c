"""The postgres effects store when its server fails, and when two deliveries race past Redis.

A PostgreSQL outage is a dependency outage: every wave fails as a whole, the purchases
handler's circuit opens, its records wait in the worker (not parked past the retry
budget, not dead-lettered, their offsets uncommitted), the worker says so (not ready, the
``circuit_open:purchases`` stall, ``worker_circuit_state``) and everything is granted once
after the server is back. Two deliveries of one payment whose Redis claims both succeed
(Redis forgot the first claim) meet at the inbox's primary key: the second waits for the
first's transaction, finds its row, and ends a duplicate without running the handler.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    purchases_settings,
    running_worker,
    wait_settled,
)

from service import Context, handler, sample

pytestmark = pytest.mark.asyncio

BUDGET = 5  # parks per window the breaker allows: a burnt retry policy would need more


async def _scalar(url: str, sql: str) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await (await conn.execute(sql)).fetchone()
        return row[0] if row else None


@pytest.mark.timeout(120)
async def test_a_postgres_outage_opens_the_circuit_holds_records_and_grants_once_after(
    kafka_broker: Broker,
    redis_url: str,
    postgres_server: PostgresServer,
    postgres_url: str,
    unique_name: str,
) -> None:
    settings = purchases_settings(
        kafka_broker.bootstrap,
        redis_url,
        postgres_url,
        unique_name,
        postgres={"connect_timeout_s": 1},
        # 4 attempts, delays up to 0.5 s: without the breaker, an outage of a few seconds
        # would dead-letter every record exhausted.
        breaker={
            "enabled": True,
            "min_calls": 5,
            "window_s": 10,
            "cool_down_s": 0.3,
            "max_cool_down_s": 1,
            # The budget is exactly BUDGET: with a ratio, the successes before the outage
            # (counted per record as their savepoints release) would raise it past BUDGET.
            "retry_budget_min": BUDGET,
            "retry_budget_ratio": 0.0,
        },
    )
    await prepare_topics(settings, partitions=3)
    mix = sample.Mix(transient=0, permanent=0, malformed=0)
    first = sample.generate(40, mix, seed=3)
    later = sample.generate(40, mix, seed=4, prefix="late")
    await produce(settings, first)
    async with running_worker(settings) as worker:
        breaker = worker.processor.breakers.for_handler("purchases")
        assert breaker is not None

        async def some_granted() -> bool:
            return len(await audit.postgres_grants(postgres_url)) >= 10

        await await_until(some_granted, 30, message="nothing granted before the outage")
        postgres_server.kill()
        await produce(settings, later)
        await await_until(lambda: breaker.state == "open", 30, message="the circuit never opened")

        def opened() -> float:
            value = worker.metrics.registry.get_sample_value(
                "worker_circuit_transitions_total", {"circuit": "purchases", "to": "open"}
            )
            return value or 0.0

        # Down long enough for three failed probes: a burnt policy would be exhausted by now.
        await await_until(lambda: opened() >= 3, 30, message="fewer than three failed probes")
        ready, detail = worker.health.ready()
        assert not ready, detail
        assert "circuit_open:purchases" in detail["stalled"], detail
        assert detail["circuits"]["purchases"]["state"] in ("open", "half_open"), detail
        state_value = worker.metrics.registry.get_sample_value(
            "worker_circuit_state", {"circuit": "purchases"}
        )
        assert state_value in (1.0, 2.0), state_value  # half-open or open, never closed
        client = aioredis.from_url(redis_url)
        try:
            depth = await audit.retry_queue_depth(redis_url, settings.redis.effective_prefix)
        finally:
            await client.aclose()
        assert depth[2] <= BUDGET, f"retry queue grew to {depth} during the outage"
        dlq = settings.dead_letter_topic(unique_name)
        assert await audit.read_all(settings.kafka, dlq) == [], "dead-lettered in an outage"
        postgres_server.start()
        state = await wait_settled(settings, timeout=60, postgres_url=postgres_url)
        assert breaker.state == "closed"
        # Every stall of the outage clears as its own loop next succeeds (the relay's round
        # against the outbox table among them, after its backoff), not with the last commit:
        # readiness is awaited, and a stall that never clears is named.
        await await_until(
            lambda: worker.health.ready()[0],
            30,
            message=lambda: f"not ready after the outage: {worker.health.ready()[1]}",
        )
    assert_invariants(state, first + later, dlq_count=0)
    assert await _scalar(postgres_url, "SELECT count(*) FROM kafka_inbox") == 80
    # Attempts held at the gate count runs, not waiting: nobody came near the policy's 4.
    assert await _scalar(postgres_url, "SELECT max(attempt) FROM kafka_inbox") <= 3


class Race(BaseModel):
    order_id: str


_runs: list[str] = []
_gate: dict[str, asyncio.Event] = {}


@handler("racing_orders", model=Race, dedupe_key="order_id", store="postgres", timeout_s=30)
async def write_and_wait(order: Race, ctx: Context) -> None:
    """Writes its row; the first run then waits for the test, its transaction open."""
    assert ctx.db is not None
    await ctx.db.execute(
        "INSERT INTO purchases (payment_id, kind, user_id, product_id, amount_minor, currency,"
        " source) VALUES (%s, 'grant', 'u', 'p', 1, 'EUR', %s)",
        (order.order_id, f"{ctx.topic}/{ctx.partition}/{ctx.offset}"),
    )
    _runs.append(ctx.topic)
    if len(_runs) == 1:
        await _gate["first"].wait()


@pytest.mark.timeout(120)
async def test_two_deliveries_whose_redis_claims_both_succeed_end_with_one_row(
    kafka_broker: Broker, redis_url: str, postgres_url: str, unique_name: str
) -> None:
    """A zombie race: two owners of one record (here two groups on one topic, one Redis
    prefix); the first is inside its transaction when Redis loses its claim, so the
    second's claim succeeds too. Only the inbox stands between them and a second row."""
    _runs.clear()
    _gate["first"] = asyncio.Event()
    a = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"racing_orders": unique_name},
        postgres={"url": postgres_url},
    )
    b = a.model_copy(
        update={"kafka": a.kafka.model_copy(update={"group_id": f"{unique_name}-zombie"})}
    )
    await prepare_topics(a, partitions=1)
    await prepare_topics(b, partitions=1)  # its own outcomes topic (named by the group)
    producer = AIOKafkaProducer(**connection_kwargs(a.kafka))
    await producer.start()
    try:
        await producer.send_and_wait(unique_name, json.dumps({"order_id": "r-1"}).encode())
    finally:
        await producer.stop()
    async with running_worker(a, registry=Registry([write_and_wait], a.topics)):
        await await_until(lambda: len(_runs) == 1, 30, message="the first delivery never ran")
        client = aioredis.from_url(redis_url)
        try:
            await client.flushall()  # its claim is forgotten: the next claim succeeds
        finally:
            await client.aclose()
        async with running_worker(b, registry=Registry([write_and_wait], b.topics)):

            async def second_waits_on_the_first() -> bool:
                return bool(
                    await _scalar(
                        postgres_url,
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
                    )
                )

            await await_until(
                second_waits_on_the_first, 30, message="the second delivery never reached the inbox"
            )
            _gate["first"].set()

            async def both_committed() -> bool:
                for settings in (a, b):
                    offsets = await audit.group_offsets(
                        settings.kafka, settings.kafka.group_id, unique_name
                    )
                    if any(p.committed != p.high_watermark for p in offsets):
                        return False
                return True

            await await_until(both_committed, 30, message="offsets not committed")
    assert await _scalar(postgres_url, "SELECT count(*) FROM purchases") == 1
    assert await _scalar(postgres_url, "SELECT count(*) FROM kafka_inbox") == 1
    assert _runs == [unique_name], "the second delivery must not run the handler"
    events = {}
    for settings in (a, b):
        outcomes = settings.outcomes_topic()
        assert outcomes is not None
        (event,) = audit.outcome_events(await audit.read_all(settings.kafka, outcomes))
        events[settings.kafka.group_id] = event["event"]
    assert events == {a.kafka.group_id: "succeeded", b.kafka.group_id: "duplicate"}, events
