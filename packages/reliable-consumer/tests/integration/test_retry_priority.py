"""Due retries run before a fresh backlog drains: late retries hold fresh fetches back.

A retry was promised a moment; a backlog of fresh records is late anyway. Before, the
worker's scheduler and its intake shared the event loop on equal terms: the intake kept its
in-flight limit full of fresh batches while at most a quarter of that many retries ran, so
retries due at start waited for most of the backlog. Now, while the oldest due retry is
later than WORKER_RETRY__PRIORITY_AFTER_MS (default), the intake pauses its partitions
(intake.RetryPriority) and the retries get the loop.

Pausing the fetches leaves what was already fetched: up to WORKER_MAX_IN_FLIGHT fresh
records whose batches went on sharing the loop (and the handler runners) with the retries
until they ended. Now those wait at the handler runner's door too (batch/lane.py) while the
episode lasts; the batches already past it finish, and commits go on for what is done.

Real broker and redis-server, a worker in this process. First: 200 retries are parked due
at once before it starts, beside a backlog of 300 fresh records; the scheduler may hold 5
retries in flight (a quarter of WORKER_MAX_IN_FLIGHT=20) against 20 fresh ones. The handler
notes the order in which it ran them; the last retry must run before the last fresh record.
Second: the fresh records are fetched and in flight (one of them running, held by the test)
when the retries fall due; the retries must run before those fresh records do.
"""

from __future__ import annotations

import asyncio
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


held_open = asyncio.Event()  # lets the first fresh record of the in-flight test finish
finished: list[str] = []  # the in-flight test's records, in the order their handler ended


@handler("in_flight", model=Job, dedupe_key="key")
async def in_flight(job: Job, ctx: Context) -> None:
    if job.key == "f0":
        await held_open.wait()
    finished.append("retry" if ctx.attempt > 1 else "fresh")


async def park_due_retries(
    redis: RedisSettings, topic: str, handler_name: str = "prioritised", count: int = RETRIES
) -> None:
    """``count`` retries of records never fetched, parked as the worker parks them, due now."""
    client = make_client(redis)
    try:
        queue = RetryQueue(RedisOps(client, redis), RedisKeys(redis.effective_prefix))
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
                handler=handler_name,
            )
            for i in range(count)
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


IN_FLIGHT_FRESH = 40
IN_FLIGHT_RETRIES = 80


async def test_due_retries_run_before_the_fresh_records_already_in_flight(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    """Fresh batches fetched before the retries fell due wait before their handlers.

    One partition, batches of 10 whose first records share a Kafka key, so each batch
    waits for the one before it (key order): all 40 fresh records are fetched and in
    flight, the first batch's first record running (held by the test) and the other three
    batches waiting behind it. Then 80 retries fall due, and once the priority's episode
    has begun the held record is let go. Before, the three batches went on at once beside
    the retries' claims (fetching paused, but they were fetched already); now they wait at
    the runner's door until the retries are on time. The scheduler holds at most 10
    retries in flight (a quarter of WORKER_MAX_IN_FLIGHT=40): its last claim's may run
    beside them.
    """
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_url,
        unique_name,
        only_topics={"in_flight": unique_name},
        max_in_flight=IN_FLIGHT_FRESH,
        max_in_flight_per_partition=IN_FLIGHT_FRESH,
        max_batch_records=10,
        outcomes={"enabled": False},
        fault_injection=False,
        retry={"priority_max_pause_ms": 60_000},  # the episode ends on time, not on a bound
    )
    registry = Registry([in_flight], {"in_flight": unique_name})
    await prepare_topics(settings)
    producer = AIOKafkaProducer(linger_ms=5, **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for i in range(IN_FLIGHT_FRESH):
            value = json.dumps({"key": f"f{i}"}).encode()
            key = b"k" if i % 10 == 0 else f"f{i}".encode()  # a batch follows the one before
            await producer.send(unique_name, value, key=key, partition=0)
        await producer.flush()
    finally:
        await producer.stop()
    held_open.clear()
    finished.clear()
    async with running_worker(settings, registry=registry) as worker:

        def episode() -> float | None:
            return worker.metrics.registry.get_sample_value("worker_retry_priority_active")

        await await_until(
            lambda: worker.intake.in_flight == IN_FLIGHT_FRESH and len(finished) == 9,
            30,
            message=lambda: (
                f"{worker.intake.in_flight} of {IN_FLIGHT_FRESH} fresh in flight, "
                f"{len(finished)} of the first batch's 9 finished"
            ),
        )
        await park_due_retries(settings.redis, unique_name, "in_flight", IN_FLIGHT_RETRIES)
        await await_until(lambda: episode() == 1, 30, message="the priority never began")
        released_at = len(finished)
        held_open.set()
        await await_until(
            lambda: len(finished) >= IN_FLIGHT_FRESH + IN_FLIGHT_RETRIES,
            60,
            message=lambda: (
                f"finished {finished.count('fresh')} fresh, {finished.count('retry')} retries"
            ),
        )
    retries_left = IN_FLIGHT_RETRIES - finished[:released_at].count("retry")
    after = finished[released_at:]
    # The first fresh record to end after the release is the held one; the next is the
    # first of the batches that waited behind it.
    first_waiting = [i for i, ran in enumerate(after) if ran == "fresh"][1]
    retries_before = after[:first_waiting].count("retry")
    may_run_beside = settings.max_in_flight // 4  # the scheduler's last claim
    assert retries_before >= retries_left - may_run_beside, (
        f"the fresh batches already in flight ran before the due retries: of {retries_left} "
        f"retries left when the held record was let go, {retries_before} ran before them "
        f"(after the release: {after})"
    )
