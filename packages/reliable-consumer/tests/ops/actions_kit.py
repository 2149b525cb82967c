"""Records and audit entries for the tests of operator actions: retries parked and dead
letters written by the engine's own code (what a worker writes), the delay queue and the
audit stream read back raw."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from reliable_consumer.engine.kafka.clients import connection_kwargs, make_producer
from reliable_consumer.engine.kafka.publisher import Publisher
from reliable_consumer.engine.records import REDRIVE_HEADER, Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit

HOUR_MS = 3_600_000


async def audit_stream(settings: Settings) -> list[dict[str, str]]:
    """The audit stream's raw entries, oldest first, as text."""
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        entries = await client.xrange(RedisKeys(settings.redis.effective_prefix).ops_audit)
    finally:
        await client.aclose()
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries]


def started_and_ended(
    settings: Settings, action: str, actor: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one action's `started` and end entries (filters and counts parsed), by ``actor``."""
    every = asyncio.run(audit_stream(settings))
    entries = [e for e in every if e.get("action") == action]
    assert entries, f"no audit entry at all for {action}: {every}"
    phases = [e.get("phase") for e in entries]
    assert len(entries) == 2 and phases[0] == "started", phases
    started, ended = ({**e, "counts": json.loads(e["counts"])} for e in entries)
    started["filters"] = json.loads(started["filters"])
    assert started["action_id"] == ended["action_id"] and started["actor"] == actor
    return started, ended


def delivery(settings: Settings, offset: int) -> Delivery:
    body = {
        "payment_id": f"p{offset}",
        "user_id": f"u{offset}",
        "product_id": "sku_1",
        "amount_minor": 100 + offset,
        "currency": "EUR",
        "status": "succeeded",
    }
    return Delivery(
        topic=settings.topics["payments"],
        partition=0,
        offset=offset,
        key=f"k{offset}".encode(),  # a key each: no chain, every item due on its own
        value=json.dumps(body).encode(),
        headers=(),
        timestamp_ms=1_700_000_000_000,
        attempt=2,
        first_failed_ms=1_700_000_000_000,
        last_error="RetryableError: down",
    )


async def park(settings: Settings, n: int) -> list[str]:
    """n retries parked an hour away by the engine's own PARK (what a worker writes)."""
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        queue = RetryQueue(
            RedisOps(client, settings.redis), RedisKeys(settings.redis.effective_prefix)
        )
        requests = [
            ParkRequest(delivery(settings, i), HOUR_MS, "", "", "payments") for i in range(n)
        ]
        await queue.park_many(requests)
    finally:
        await client.aclose()
    return [f"{settings.topics['payments']}/0/{i}" for i in range(n)]


async def queue(settings: Settings) -> dict[str, tuple[float | None, float | None]]:
    """Every item in the delay queue: (due score, lease score)."""
    keys = RedisKeys(settings.redis.effective_prefix)
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        ids = [i.decode() for i in await client.hkeys(keys.retry_items)]
        return {
            i: (await client.zscore(keys.retry_due, i), await client.zscore(keys.retry_inflight, i))
            for i in ids
        }
    finally:
        await client.aclose()


async def redis_now_ms(settings: Settings) -> int:
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        seconds, micros = await client.time()
    finally:
        await client.aclose()
    return int(seconds) * 1000 + int(micros) // 1000


async def dead_letters(settings: Settings, n: int) -> None:
    """n dead letters written by the engine's own Publisher, as a worker writes them."""
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        publisher = Publisher(
            producer,
            dead_letter_topic=settings.dead_letter_topic,
            outcomes_topic=settings.outcomes_topic(),
        )
        for i in range(n):
            await publisher.dead_letter(
                delivery(settings, i),
                reason="permanent",
                error="PermanentError: refused",
                handler="payments",
                dedupe_key=f"p{i}",
                at_ms=1_700_000_000_000 + i,
            )
    finally:
        await producer.stop()


def redriven(settings: Settings) -> list[str]:
    """The `x-redrive-of` of every redriven record in the source topic."""
    records = asyncio.run(audit.read_all(settings.kafka, settings.topics["payments"]))
    return [h for r in records if (h := audit.header(r, REDRIVE_HEADER)) is not None]


async def mark_consumed(settings: Settings) -> None:
    """Commit offset 0 on the payments topic as the settings' group, as a worker that ran
    there would have: the target check (ops/target.py) then takes it for a used one."""
    consumer = AIOKafkaConsumer(
        group_id=settings.kafka.group_id,
        enable_auto_commit=False,
        **connection_kwargs(settings.kafka),
    )
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics["payments"], 0)
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(0, "")})
    finally:
        await consumer.stop()
