"""Issue 12, defect 6: "granted" must outlive every replay and offset reset.

Done-markers expired after 7 days (the old default TTL). A replay of an older range, or a
group whose committed offsets expired restarting from ``earliest``, found no marker and
granted the payment again. Now markers never expire by default; with a TTL configured,
records older than the marker's lifetime are dead-lettered as ``beyond_dedupe_window``
(the worker, and replay both for real and in its dry run), never granted.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from reliable_consumer.engine.batch import decisions
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.settings import IdempotencySettings, Settings
from reliable_consumer_pipeline import replay
from tests.integration.recording_producer import RecordingProducer

pytestmark = pytest.mark.timeout(60)
TOPIC = "payments"
DAY_S = 24 * 3600


@dataclass
class Env:
    settings: Settings
    processor: Processor
    producer: RecordingProducer
    redis: aioredis.Redis

    async def grants(self, payment_id: str) -> int:
        entries = await self.redis.xrange(
            f"{self.settings.redis.effective_prefix}:ledger:purchases"
        )
        return sum(1 for _, fields in entries if fields[b"payment_id"] == payment_id.encode())

    def dead_letter_reasons(self) -> list[str | None]:
        return [s.header("x-dlq-reason") for s in self.producer.to(f"{TOPIC}.dlq")]


def settings_for(redis_url: str, **idempotency: Any) -> Settings:
    return Settings(
        redis={"url": redis_url, "key_prefix": "win"},
        topics={"payments": TOPIC},
        idempotency=idempotency,
        http={"enabled": False},
    )


@pytest.fixture
async def make_env(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[Env]]]:
    """Processors over the real Redis, each with its own recording producer."""
    clients: list[aioredis.Redis] = []

    async def make(**idempotency: Any) -> Env:
        settings = settings_for(redis_url, **idempotency)
        client = make_client(settings.redis)
        clients.append(client)
        producer = RecordingProducer()
        processor = Processor.build(
            settings,
            Registry.from_settings(settings.topics),
            ops=RedisOps(client, settings.redis),
            producer=producer,
            metrics=Metrics(),
        )
        return Env(settings, processor, producer, client)

    try:
        yield make
    finally:
        for client in clients:
            await client.aclose()


def payment(payment_id: str, timestamp_ms: int, offset: int = 0) -> Delivery:
    body = {
        "payment_id": payment_id,
        "user_id": "u1",
        "product_id": "sku_1",
        "amount_minor": 1299,
        "currency": "EUR",
    }
    return Delivery(
        TOPIC, 0, offset, payment_id.encode(), json.dumps(body).encode(), (), timestamp_ms
    )


async def pass_time_in_redis(client: aioredis.Redis, seconds: int) -> int:
    """What ``seconds`` of waiting does to Redis: every key that expires within them is gone."""
    gone = 0
    async for key in client.scan_iter(count=1000):
        ttl = await client.ttl(key)
        if 0 < ttl <= seconds:
            gone += await client.delete(key)
    return gone


async def test_redelivery_after_the_old_7_day_ttl_is_not_granted_twice(
    make_env: Callable[..., Awaitable[Env]],
) -> None:
    """By default a done-marker never expires: an offset reset months later is a duplicate."""
    env = await make_env()
    now = int(time.time() * 1000)
    assert await env.processor.process(payment("pay_1", now)) is Outcome.SUCCEEDED
    await pass_time_in_redis(env.redis, 8 * DAY_S)  # past the old 7-day default
    # The group's offsets expired; it restarts from earliest and meets the record again.
    assert await env.processor.process(payment("pay_1", now)) is Outcome.DUPLICATE
    assert await env.grants("pay_1") == 1


async def test_record_beyond_a_configured_dedupe_window_is_dead_lettered_not_granted(
    make_env: Callable[..., Awaitable[Env]], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = await make_env(ttl_s=2 * DAY_S, window_margin_s=3600)
    start = int(time.time() * 1000)
    assert await env.processor.process(payment("pay_1", start)) is Outcome.SUCCEEDED
    marker_ttl = await env.redis.ttl("{win}:idem:payments:=pay_1")
    assert DAY_S < marker_ttl <= 2 * DAY_S, "with a TTL configured, markers use it"
    # Two days and a second later the marker is gone, and the record is redelivered.
    later = 2 * DAY_S + 1
    await pass_time_in_redis(env.redis, later)
    monkeypatch.setattr(decisions, "now_ms", lambda: start + later * 1000)
    assert await env.processor.process(payment("pay_1", start)) is Outcome.DEAD_LETTERED
    assert await env.grants("pay_1") == 1
    assert env.dead_letter_reasons() == ["beyond_dedupe_window"]
    # A record inside the window is still granted, one far in the future is not.
    now = start + later * 1000
    assert await env.processor.process(payment("pay_2", now - DAY_S * 1000)) is Outcome.SUCCEEDED
    future = payment("pay_3", now + 2 * 3600 * 1000)
    assert await env.processor.process(future) is Outcome.DEAD_LETTERED
    assert env.dead_letter_reasons() == ["beyond_dedupe_window"] * 2
    assert await env.grants("pay_3") == 0


async def test_dry_run_labels_records_beyond_the_dedupe_window(
    make_env: Callable[..., Awaitable[Env]],
) -> None:
    """The dry run used to say "the handler would run" for a record whose marker expired."""
    env = await make_env(ttl_s=2 * DAY_S, window_margin_s=3600)
    now = int(time.time() * 1000)
    old = payment("pay_old", now - 3 * DAY_S * 1000, offset=0)
    fresh = payment("pay_new", now, offset=1)
    state: dict[str, Any] = {"records": 0, "counts": Counter(), "at": None, "error": None}
    registry = Registry.from_settings(env.settings.topics)
    await replay._check(env.settings, registry, iter([[old, fresh]]), state)
    assert dict(state["counts"]) == {"beyond_dedupe_window": 1, "would_run": 1}
    report = replay.ReplayReport(dry_run=True, ranges=[])
    report.add({"records": 2, "counts": dict(state["counts"])})
    assert report.beyond_dedupe_window == 1 and report.would_run == 1


def test_dedupe_window_settings_fail_at_start_naming_the_setting() -> None:
    assert IdempotencySettings().ttl_s is None, "markers never expire by default"
    with pytest.raises(ValueError, match="WORKER_IDEMPOTENCY__TTL_S"):
        IdempotencySettings(ttl_s=7200, window_margin_s=3600)
    assert IdempotencySettings(ttl_s=7201, window_margin_s=3600).ttl_s == 7201
