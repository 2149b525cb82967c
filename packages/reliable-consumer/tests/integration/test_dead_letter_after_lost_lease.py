"""A retry dead-lettered after its leases ran out leaves its item to the run that took it.

Found by a chaos run (seed 381002875): a retry of the claiming handler failed for good and
was dead-lettered, but the broker's acknowledgement came after the retry's claim and lease
had ended (a loaded machine). The reaper had re-queued the item and another run had taken it
and claimed the key. MARK_DEAD then kept that run's claim, as it must, but dropped the retry
item all the same; the other run's PARK found its lease gone (``lost_lease``) and released the
claim. The key ended with neither a dead-marker nor a retry to settle it: one dead letter
whose key is not marked dead, and a later delivery of the key would run its handler again.

MARK_DEAD now drops a retry's item only while the lease it presents is still the item's (the
fence PARK already keeps); otherwise the item is the other run's, which settles the key.
Real redis-server, the worker's record path (``Processor.process_batch``); the broker is the
producer double, whose acknowledgement of the first dead letter arrives late.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.helpers import await_until
from tests.integration.recording_producer import RecordingProducer

from service import Context, PermanentError, RetryableError, handler

pytestmark = pytest.mark.timeout(60)
TOPIC = "lease-race"
KEY = "pay-1"


class NotSold(PermanentError):
    """The record is wrong: no retry mends it."""


class Job(BaseModel):
    key: str


@dataclass
class Race:
    """The handler's script: its first run fails for good, the run that took the item over
    waits until the first run's batch has ended, then fails for a while; later runs fail
    for good again."""

    runs: int = 0
    second_started: asyncio.Event = field(default_factory=asyncio.Event)
    first_ended: asyncio.Event = field(default_factory=asyncio.Event)


race = Race()


@handler("lease_race", model=Job, dedupe_key="key", writes=("ledger",))
async def lease_race(job: Job, ctx: Context) -> None:
    race.runs += 1
    if race.runs == 2:
        race.second_started.set()
        async with asyncio.timeout(10):
            await race.first_ended.wait()
        raise RetryableError("dependency down")
    raise NotSold(f"{job.key} is not sold")


class LateAck(RecordingProducer):
    """The broker acknowledges the first dead letter only after ``meanwhile`` ran: by then
    the retry's claim and lease have ended and another run holds both."""

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: Any = None

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        acked = await super().send(topic, *args, **kwargs)
        if topic.endswith(".dlq") and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()
        return acked


@dataclass
class Env:
    processor: Processor
    producer: LateAck
    redis: aioredis.Redis
    queue: RetryQueue
    keys: RedisKeys
    settings: Settings

    @property
    def idem_key(self) -> str:
        return self.processor.parts.idempotency.key("lease_race", KEY)

    async def retry(self, offset: int) -> Delivery:
        """The record parked by an earlier run, then claimed as the scheduler does."""
        d = Delivery(TOPIC, 0, offset, KEY.encode(), json.dumps({"key": KEY}).encode(), (), 0)
        await self.redis.hset(self.keys.retry_items, d.retry_id, d.to_json())
        await self.redis.zadd(self.keys.retry_due, {d.retry_id: 0})
        (claimed,) = await self.queue.claim_due(lease_ms=self.settings.retry.lease_ms, limit=1)
        return claimed

    async def end_leases(self, retry_id: str) -> None:
        """Time passes: the claim's PX runs out, and the retry lease's deadline (its score in
        flight) is reached, so the reaper re-queues the item."""
        await self.redis.pexpire(self.idem_key, 1)
        await await_until(self._claim_gone, 5, message="the claim never expired")
        seconds, micros = await self.redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        await self.redis.zadd(self.keys.retry_inflight, {retry_id: now_ms}, xx=True)
        assert await self.queue.reap() == 1

    async def _claim_gone(self) -> bool:
        return not await self.redis.exists(self.idem_key)


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[Env]:
    settings = Settings(
        redis={"url": redis_url, "key_prefix": f"ll{uuid.uuid4().hex[:8]}"},
        topics={"lease_race": TOPIC},
        http={"enabled": False},
        retry={"base_delay_ms": 0, "max_delay_ms": 0, "busy_delay_ms": 0, "max_attempts": 9},
        handler_timeout_s=20.0,
        breaker={"enabled": False},
        outcomes={"enabled": False},
    )
    client = make_client(settings.redis)
    ops = RedisOps(client, settings.redis)
    keys = RedisKeys(settings.redis.effective_prefix)
    producer = LateAck()
    registry = Registry([lease_race], {"lease_race": TOPIC})
    processor = Processor.build(settings, registry, ops=ops, producer=producer, metrics=Metrics())
    global race
    race = Race()
    try:
        yield Env(processor, producer, client, RetryQueue(ops, keys), keys, settings)
    finally:
        await processor.aclose()
        await client.aclose()


async def test_a_retry_dead_lettered_after_its_lease_ran_out_still_ends_with_a_dead_marker(
    env: Env,
) -> None:
    first = await env.retry(offset=3)
    taken_over: list[asyncio.Task[list[Outcome]]] = []

    async def take_over() -> None:
        await env.end_leases(first.retry_id)
        (second,) = await env.queue.claim_due(lease_ms=env.settings.retry.lease_ms, limit=1)
        taken_over.append(asyncio.create_task(env.processor.process_batch([second])))
        async with asyncio.timeout(10):
            await race.second_started.wait()  # it claimed the key and its handler runs

    env.producer.meanwhile = take_over
    assert await env.processor.process_batch([first]) == [Outcome.DEAD_LETTERED]
    race.first_ended.set()
    assert await taken_over[0] == [Outcome.RETRY_SCHEDULED]
    # The run that took the item over parked it again: the item is still in the queue.
    assert await env.redis.hexists(env.keys.retry_items, first.retry_id), (
        "the first run's MARK_DEAD dropped the item another run held"
    )

    async def drained() -> bool:
        batch = await env.queue.claim_due(lease_ms=env.settings.retry.lease_ms, limit=10)
        if batch:
            await env.processor.process_batch(batch)
        return await env.queue.depth() == (0, 0)

    await await_until(drained, 10, message="the retry never settled")
    marker = await env.redis.get(env.idem_key)
    assert marker is not None and marker.startswith(b"x|"), (
        f"the dead-lettered key ends {marker!r}, not dead-marked"
    )
    reasons = [d.header("x-dlq-reason") for d in env.producer.to(f"{TOPIC}.dlq")]
    assert reasons == ["permanent", "permanent"], "dead letters are at least once"
    assert race.runs == 3
