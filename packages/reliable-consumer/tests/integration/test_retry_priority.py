"""Due retries run before a fresh backlog drains: late retries hold fresh fetches back.

A retry was promised a moment; a backlog of fresh records is late anyway. Before, the
worker's scheduler and its intake shared the event loop on equal terms: the intake kept its
in-flight limit full of fresh batches while at most a quarter of that many retries ran, so
retries due at start waited for most of the backlog. Now, while the oldest due retry is
later than WORKER_RETRY__PRIORITY_AFTER_MS (default), the intake pauses its partitions
(intake.RetryPriority) and the retries get the loop.

Real broker and redis-server, a worker in this process. 200 retries are parked due at once
before it starts, beside a backlog of 300 fresh records; the scheduler may hold 5 retries
in flight (a quarter of WORKER_MAX_IN_FLIGHT=20) against 20 fresh ones. The handler notes
the order in which it ran them; the last retry must run before the last fresh record.
"""

from __future__ import annotations

import json

import pytest
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, running_worker

from service import Context, handler

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

FRESH = 300
RETRIES = 200
RETRY_OFFSET_BASE = 10**6  # offsets no fresh record of the backlog has

ran: list[str] = []  # "fresh" or "retry", in the order the handler ran them


class Job(BaseModel):
    key: str


@handler("prioritised", model=Job, dedupe_key="key")
def prioritised(job: Job, ctx: Context) -> None:
    ran.append("retry" if ctx.attempt > 1 else "fresh")


async def park_due_retries(redis: RedisSettings, topic: str) -> None:
    """RETRIES retries of records never fetched, parked as the worker parks them, due now."""
    client = make_client(redis)
    try:
        queue = RetryQueue(RedisOps(client, redis), RedisKeys(redis.key_prefix))
        requests = [
            ParkRequest(
                delivery=Delivery(
                    topic,
                    0,
                    RETRY_OFFSET_BASE + i,
                    f"r{i}".encode(),
                    json.dumps({"key": f"r{i}"}).encode(),
                    (),
                    1,
                    attempt=2,
                    last_error="RetryableError: parked by the test",
                ),
                delay_ms=0,
                idem_key="",
                token="",
                handler="prioritised",
            )
            for i in range(RETRIES)
        ]
        assert set(await queue.park_many(requests)) == {ParkStatus.PARKED}
    finally:
        await client.aclose()


async def test_due_retries_run_before_a_fresh_backlog_drains(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"prioritised": unique_name},
        max_in_flight=20,
        max_in_flight_per_partition=20,
        max_batch_records=20,
        outcomes={"enabled": False},
        fault_injection=False,
        # Far beyond this test's length: the episode ends because the retries are on time.
        retry={"priority_max_pause_ms": 60_000},
    )
    assert settings.retry.priority_after_ms == 50  # the default
    registry = Registry([prioritised], {"prioritised": unique_name})
    await prepare_topics(settings)
    producer = AIOKafkaProducer(linger_ms=5, **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for i in range(FRESH):
            value = json.dumps({"key": f"f{i}"}).encode()
            await producer.send(unique_name, value, key=f"f{i}".encode(), partition=i % 3)
        await producer.flush()
    finally:
        await producer.stop()
    await park_due_retries(settings.redis, unique_name)
    ran.clear()
    async with running_worker(settings, registry=registry) as worker:
        await await_until(
            lambda: ran.count("fresh") >= FRESH and ran.count("retry") >= RETRIES,
            60,
            message=lambda: f"ran {ran.count('fresh')} fresh, {ran.count('retry')} retries",
        )
        paused_s = worker.metrics.registry.get_sample_value(
            "worker_retry_priority_paused_seconds_total"
        )
    last_retry = len(ran) - 1 - ran[::-1].index("retry")
    last_fresh = len(ran) - 1 - ran[::-1].index("fresh")
    fresh_before = ran[:last_retry].count("fresh")
    assert last_retry < last_fresh, (
        f"the fresh backlog drained before the due retries ran: {fresh_before} of {FRESH} "
        "fresh records ran before the last retry"
    )
    assert paused_s, "no episode of the retries' priority was counted"
