"""Claims and retry leases must cover a handler's whole run, however long it waited for a runner.

Real broker and real Redis, through ``Processor.process_batch`` (the worker's path). A wave
is claimed before its handlers run, but an ``async def`` handler's timeout only starts when
one of the ``max_concurrent_handlers`` runners takes the call. With settings that pass
validation (claim lease 600 ms, handler timeout 500 ms, 2 runners), a record queued behind
two slow calls used to start with 200 ms of lease left: the claim ended mid-run and a second
delivery of the same key ran beside it (issue 12, defect 7). The runner now stretches the
claim and the retry lease as it starts the call, or parks the record when they were lost.

The last tests close a blind spot: a retry and a fresh delivery of the same key, each
beside the other, never run at the same time, and the key is granted once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import pytest
import redis.asyncio as aioredis
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.batch.processing import Processor, open_processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.helpers import await_until
from tests.integration.harness import make_settings

from service import Context, RetryableError, handler

pytestmark = pytest.mark.integration

WORK_S = 0.4  # each slow call; two of them fill both runners for this long


class Job(BaseModel):
    key: str
    work_s: float = WORK_S
    fail: bool = False  # raise RetryableError after the work


@dataclass
class Runs:
    """What the handler saw: every start, and any start while the same key was running."""

    started: list[str]
    active: Counter[str]
    overlaps: list[str]

    def clear(self) -> None:
        self.started.clear()
        self.active.clear()
        self.overlaps.clear()


runs = Runs([], Counter(), [])


@handler("slow_claiming", model=Job, dedupe_key="key", writes=("ledger",))
async def slow_claiming(job: Job, ctx: Context) -> None:
    """A claiming handler whose work leaves Redis: two runs of one key must never overlap."""
    runs.started.append(job.key)
    runs.active[job.key] += 1
    if runs.active[job.key] > 1:
        runs.overlaps.append(job.key)
    try:
        await asyncio.sleep(job.work_s)  # the call to the outside world
    finally:
        runs.active[job.key] -= 1
    if job.fail:
        raise RetryableError("dependency down")
    ctx.effects.xadd(ctx.redis_key("ledger", "slow"), {"key": job.key})


@dataclass
class Env:
    processor: Processor
    redis: aioredis.Redis
    queue: RetryQueue
    settings: Settings
    topic: str

    def delivery(self, key: str, offset: int, *, partition: int = 0, **job: object) -> Delivery:
        return Delivery(
            topic=self.topic,
            partition=partition,
            offset=offset,
            key=f"kafka-{partition}-{offset}".encode(),  # distinct: one wave per batch
            value=json.dumps({"key": key, **job}).encode(),
            headers=(),
            timestamp_ms=1_763_700_000_000,
        )

    async def grants(self, key: str) -> int:
        stream = RedisKeys(self.settings.redis.effective_prefix).effect("ledger", "slow")
        entries = await self.redis.xrange(stream) or []
        return sum(1 for _, fields in entries if fields and fields[b"key"] == key.encode())

    async def retry(self, delivery: Delivery, attempt: int = 2) -> Delivery:
        """Park ``delivery`` as a failed run would have, and claim it as the scheduler does."""
        failed_ms = int(time.time() * 1000)  # just now: within the retry policy's age limit
        raw = replace(
            delivery, attempt=attempt, first_failed_ms=failed_ms, last_error="RetryableError"
        )
        await self.redis.hset(self._keys.retry_items, raw.retry_id, raw.to_json())
        await self.redis.zadd(self._keys.retry_due, {raw.retry_id: 0})
        (claimed,) = await self.queue.claim_due(lease_ms=self.settings.retry.lease_ms, limit=1)
        return claimed

    async def drain(self) -> list[Outcome]:
        """Run due retries until the delay queue is empty; their outcomes, in order."""
        outcomes: list[Outcome] = []

        async def step() -> bool:
            batch = await self.queue.claim_due(lease_ms=self.settings.retry.lease_ms, limit=10)
            if batch:
                outcomes.extend(await self.processor.process_batch(batch))
            return await self.queue.depth() == (0, 0)

        await await_until(step, 10, message=lambda: f"queue not drained: {outcomes}")
        return outcomes

    @property
    def _keys(self) -> RedisKeys:
        return RedisKeys(self.settings.redis.effective_prefix)


@pytest.fixture
async def env(kafka_broker: Broker, redis_url: str, unique_name: str) -> AsyncIterator[Env]:
    # Every value here passes validation: the lease outlasts the timeout by 100 ms.
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        topics={"slow_claiming": f"{unique_name}-slow"},
        idempotency={"lease_ms": 600},
        retry={"lease_ms": 600, "busy_delay_ms": 200, "base_delay_ms": 50},
        handler_timeout_s=0.5,
        max_concurrent_handlers=2,
        outcomes={"enabled": False},
        fault_injection=False,
    )
    topic = settings.topics["slow_claiming"]
    registry = Registry([slow_claiming], {"slow_claiming": topic})
    client = aioredis.from_url(redis_url)
    queue = RetryQueue(RedisOps(client, settings.redis), RedisKeys(settings.redis.effective_prefix))
    runs.clear()
    try:
        async with open_processor(settings, registry) as processor:
            yield Env(processor, client, queue, settings, topic)
    finally:
        await client.aclose()


async def _redeliver_while(
    env: Env, running: asyncio.Task[object], copy: Delivery
) -> list[Outcome]:
    """Deliver ``copy`` again and again (another partition's copy, a rebalance) while
    ``running`` lasts; each try either finds the key claimed or claims it and runs."""
    outcomes: list[Outcome] = []
    while not running.done():
        outcomes += await env.processor.process_batch([copy])
        await asyncio.sleep(0.02)  # pacing between tries, not a wait for a condition
    return outcomes


def _busy_then_done(copies: list[Outcome]) -> bool:
    """Parked as busy while the key ran; a duplicate once it was done (the last try may
    land just after the running batch finished, before its task counts as done)."""
    busy = Outcome.RETRY_SCHEDULED
    return bool(copies) and copies[0] is busy and set(copies) <= {busy, Outcome.DUPLICATE}


@pytest.mark.timeout(60)
async def test_a_claim_outlives_the_wait_for_a_runner_so_one_key_never_runs_twice_at_once(
    env: Env,
) -> None:
    """Defect 7: two slow calls hold both runners; the third record's claim must not burn."""
    batch = [env.delivery("filler-1", 0), env.delivery("filler-2", 1), env.delivery("K", 2)]
    first = asyncio.create_task(env.processor.process_batch(batch))
    # K starts only when a filler ends (about 400 ms in, 200 ms before its first lease ends).
    await await_until(lambda: "K" in runs.started, 10, message="K never started")
    copies = await _redeliver_while(env, first, env.delivery("K", 9, partition=1))

    assert runs.overlaps == [], "a second delivery of K ran while the first still ran"
    assert await first == [Outcome.SUCCEEDED] * 3
    assert _busy_then_done(copies), f"the copy is parked as busy, not run: {copies}"
    assert await env.grants("K") == 1


@pytest.mark.timeout(60)
async def test_a_retry_lease_outlives_the_wait_for_a_runner_and_fences_the_park(
    env: Env,
) -> None:
    """Defect 7, the delay queue's side: a reaper must not re-queue a retry that is running.

    The retry waits behind two slow calls with a 600 ms lease, runs 400 ms and fails again;
    its park must find the lease it now holds (the fencing token moved with the extension).
    """
    retry = await env.retry(env.delivery("K", 2, fail=True))
    batch = [env.delivery("filler-1", 0), env.delivery("filler-2", 1), retry]
    running = asyncio.create_task(env.processor.process_batch(batch))
    reaped = 0
    while not running.done():  # another scheduler's reaper, at work all along
        reaped += await env.queue.reap()
        await asyncio.sleep(0.02)

    assert await running == [Outcome.SUCCEEDED, Outcome.SUCCEEDED, Outcome.RETRY_SCHEDULED]
    assert reaped == 0, "the running retry's lease was reaped"
    assert runs.started.count("K") == 1 and runs.overlaps == []
    # Parked again by the run that held the lease: next attempt, back in the due set.
    assert await env.queue.depth() == (1, 0)
    item = await env.redis.hget(
        RedisKeys(env.settings.redis.effective_prefix).retry_items, retry.retry_id
    )
    assert item is not None and json.loads(item)["attempt"] == 3


@pytest.mark.timeout(60)
async def test_a_lost_claim_is_not_run_but_parked_as_busy(env: Env) -> None:
    """When the claim is gone by the time a runner is free, the handler does not start."""
    batch = [env.delivery("filler-1", 0), env.delivery("filler-2", 1), env.delivery("K", 2)]
    key = RedisKeys(env.settings.redis.effective_prefix).idempotency("slow_claiming", "K")
    first = asyncio.create_task(env.processor.process_batch(batch))
    await await_until(lambda: len(runs.started) == 2, 10, message="fillers never started")
    # Another delivery takes K over while ours waits for a runner (its lease was stolen,
    # as an expiry during a Redis stall would do).
    await env.redis.set(key, "c|rival.1|fp", px=60_000)

    assert await first == [Outcome.SUCCEEDED, Outcome.SUCCEEDED, Outcome.RETRY_SCHEDULED]
    assert "K" not in runs.started
    assert await env.redis.get(key) == b"c|rival.1|fp", "the rival's claim is untouched"
    (parked,) = await env.redis.hvals(RedisKeys(env.settings.redis.effective_prefix).retry_items)
    assert json.loads(parked)["attempt"] == 1, "busy is not a failed attempt"


@pytest.mark.timeout(60)
async def test_a_retry_running_beside_a_fresh_delivery_of_its_key_never_overlaps(
    env: Env,
) -> None:
    """Blind spot: the retry runs first; a fresh copy of the same payment arrives meanwhile."""
    retry = await env.retry(env.delivery("K", 2))
    running = asyncio.create_task(env.processor.process_batch([retry]))
    await await_until(lambda: "K" in runs.started, 10, message="the retry never started")
    copies = await _redeliver_while(env, running, env.delivery("K", 3))

    assert await running == [Outcome.SUCCEEDED]
    assert _busy_then_done(copies), f"the fresh copy finds the key busy: {copies}"
    assert await env.drain() == [Outcome.DUPLICATE], "the parked copy is a duplicate later"
    assert runs.overlaps == [] and runs.started == ["K"]
    assert await env.grants("K") == 1


@pytest.mark.timeout(60)
async def test_a_fresh_delivery_running_beside_a_retry_of_its_key_never_overlaps(
    env: Env,
) -> None:
    """Blind spot, the other order: the fresh delivery runs; the retry comes due meanwhile."""
    fresh = asyncio.create_task(env.processor.process_batch([env.delivery("K", 3)]))
    await await_until(lambda: "K" in runs.started, 10, message="the delivery never started")
    retry = await env.retry(env.delivery("K", 2))
    assert await env.processor.process_batch([retry]) == [Outcome.RETRY_SCHEDULED]
    item = await env.redis.hget(
        RedisKeys(env.settings.redis.effective_prefix).retry_items, retry.retry_id
    )
    assert item is not None and json.loads(item)["attempt"] == 2, "busy: same attempt"

    assert await fresh == [Outcome.SUCCEEDED]
    assert await env.drain() == [Outcome.DUPLICATE]
    assert runs.overlaps == [] and runs.started == ["K"]
    assert await env.grants("K") == 1
