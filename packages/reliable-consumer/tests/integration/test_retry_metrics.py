"""The retry metrics the alert rules read, on a real broker, Redis and worker.

``worker_retry_queue_items{handler,reason}`` and ``worker_retry_oldest_due_age_seconds``
are the scheduler's reading of the shared delay queue (the tally the scripts keep, Redis's
clock); ``worker_end_to_end_seconds`` is observed when a record's fate is durable and done.
One run, the outage the age alert is for: a worker parks retryable failures (``x-fault``)
far in the future; it stops, and the items come due with no scheduler running (their due
times moved 30 s into the past); a scheduler-only worker then reports them overdue,
takes them, and reports the queue empty.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.integration

HANDLER = "payments"
OVERDUE_MS = 30_000
# Parked for a minute: nothing comes due while the first worker runs. The lease sets the
# scheduler's reporting period (lease / 4 = 3 s): each reading stays up that long.
RETRY = {
    "base_delay_ms": 60_000,
    "max_delay_ms": 60_000,
    "jitter": 0.0,
    "max_attempts": 4,
    "lease_ms": 12_000,
}


def records() -> list[sample.SampleRecord]:
    """Three transient failures (one failed run each), one permanent, two that succeed."""
    out = sample.generate(6, sample.Mix(transient=0, permanent=0, malformed=0), prefix="rm")
    for i in range(3):
        out[i] = replace(out[i], kind="transient", headers=[(FAULT_HEADER, b"transient:1")])
    out[3] = replace(out[3], kind="permanent", headers=[(FAULT_HEADER, b"permanent")])
    return out


def items(metrics: Metrics, reason: str = "RetryableError") -> float | None:
    return metrics.registry.get_sample_value(
        "worker_retry_queue_items", {"handler": HANDLER, "reason": reason}
    )


def oldest_due_age(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("worker_retry_oldest_due_age_seconds")


def end_to_end(metrics: Metrics, series: str) -> float:
    value = metrics.registry.get_sample_value(
        f"worker_end_to_end_seconds_{series}", {"handler": HANDLER}
    )
    return value or 0.0


async def make_overdue(settings: Settings, by_ms: int) -> int:
    """Move every due time ``by_ms`` into the past, by Redis's clock: what a queue looks
    like after its schedulers were down that long. Returns how many items moved."""
    keys = RedisKeys(settings.redis.effective_prefix)
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        sec, usec = await client.time()
        past = int(sec) * 1000 + int(usec) // 1000 - by_ms
        ids = await client.zrange(keys.retry_due, 0, -1)
        if ids:
            await client.zadd(keys.retry_due, dict.fromkeys(ids, past), xx=True)
        return len(ids)
    finally:
        await client.aclose()


async def breakdown(settings: Settings) -> dict[tuple[str, str], int]:
    client = aioredis.from_url(settings.redis.url.get_secret_value())
    try:
        queue = RetryQueue(
            RedisOps(client, settings.redis), RedisKeys(settings.redis.effective_prefix)
        )
        return await queue.breakdown()
    finally:
        await client.aclose()


@pytest.mark.timeout(180)
async def test_retry_metrics_follow_parked_overdue_and_finished_retries(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name, retry=RETRY)
    await prepare_topics(settings, partitions=2)
    sent = records()
    await produce(settings, sent)
    produced_by = time.time()

    # 1. Retryable failures parked: counted by handler and reason, none due yet.
    async with running_worker(settings) as first:
        m = first.metrics
        await await_until(
            lambda: items(m) == 3 and end_to_end(m, "count") == 3,
            60,
            message=lambda: f"items {items(m)}, done {end_to_end(m, 'count')}",
        )
        assert oldest_due_age(m) == 0, "parked for a minute: none is due yet"
        assert await breakdown(settings) == {(HANDLER, "RetryableError"): 3}
        # Two succeeded and one was dead-lettered: done, and observed; parking is not done.
        assert end_to_end(m, "count") == 3
        assert m.registry.get_sample_value("worker_retry_queue_depth", {"state": "due"}) == 3

    # 2. No scheduler for 30 s: the next one reports how long they have been due, then
    #    takes them (each succeeds on its second run) and reports the queue empty.
    assert await make_overdue(settings, OVERDUE_MS) == 3
    scheduler = Worker(settings, consume=False)
    # Before it starts: on a busy machine it has finished retries by the time `running`
    # returns (CI once saw the sum 4 ms short of a start taken after).
    started = time.time()
    async with running(scheduler):
        m = scheduler.metrics
        await await_until(
            lambda: (oldest_due_age(m) or 0) >= OVERDUE_MS / 1000,
            30,
            interval=0.02,
            message=lambda: f"oldest due age {oldest_due_age(m)}",
        )
        assert (oldest_due_age(m) or 0) < OVERDUE_MS / 1000 + 30
        assert items(m) == 3, "the same reading: the overdue items, by handler and reason"
        await await_until(
            lambda: end_to_end(m, "count") == 3 and items(m) is None and oldest_due_age(m) == 0,
            60,
            message=lambda: (
                f"done {end_to_end(m, 'count')}, items {items(m)}, age {oldest_due_age(m)}"
            ),
        )
        assert await breakdown(settings) == {}
        # Record timestamp to done, retries included: at least from the produce to this start.
        assert end_to_end(m, "sum") >= 3 * (started - produced_by)
        state = await wait_settled(settings)
    assert_invariants(state, sent, dlq_count=1)
