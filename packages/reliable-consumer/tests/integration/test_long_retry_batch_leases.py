"""A batch of due retries that runs longer than the retry lease keeps every record's lease.

Found by the chaos suite after restarts: a batch of many due retries of a few keys runs in
waves, one after another, and a record of a late wave waited for the earlier ones with only
the lease it was claimed with. Once that ran out, the reaper handed the item to another run
and this run's record was parked unrun ("superseded: retry lease expired before the handler
started"): a wasted pass, and a second run of the same record beside this one.

The batch now keeps the leases of its waiting records alive (engine/batch/leases.py), so
the reaper passing by while the batch runs on finds none of its items expired.
Real redis-server, the worker's record path (``Processor.process_batch``) with strict
partition order (a wave per record); the broker is the producer double.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest
from pydantic import BaseModel
from reliable_consumer.engine.batch.leases import LeaseKeeper
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from tests.integration.recording_producer import RecordingProducer

from service import Context, RetryableError, handler

pytestmark = pytest.mark.timeout(60)
TOPIC = "long-retry-batch"
RETRY_LEASE_MS = 2_000
CALL_S = 0.5  # each handler call's own work: six in a row outlast the lease
RECORDS = 6

ran: list[int] = []
reaped: list[int] = []
queue: RetryQueue | None = None


class Job(BaseModel):
    key: str


@handler("long_batch", model=Job, dedupe_key="key", writes=("ledger",))
async def long_batch(job: Job, ctx: Context) -> None:
    ran.append(ctx.offset)
    await asyncio.sleep(CALL_S)  # the dependency's answer takes this long, then it fails
    if ctx.offset == RECORDS - 2 and queue is not None:
        # The reaper of some worker passes by (every quarter lease, in `service run`): by
        # now the batch has run longer than the lease the last record was claimed with.
        reaped.append(await queue.reap())
    raise RetryableError("dependency down")


@pytest.fixture
async def env(redis_url: str) -> AsyncIterator[tuple[Processor, RetryQueue, Settings]]:
    settings = Settings(
        redis={"url": redis_url, "key_prefix": f"lb{uuid.uuid4().hex[:8]}"},
        topics={"long_batch": TOPIC},
        http={"enabled": False},
        ordering="partition",
        retry={"base_delay_ms": 0, "max_delay_ms": 0, "lease_ms": RETRY_LEASE_MS},
        handler_timeout_s=1.0,
        breaker={"enabled": False},
        outcomes={"enabled": False},
    )
    client = make_client(settings.redis)
    ops = RedisOps(client, settings.redis)
    keys = RedisKeys(settings.redis.effective_prefix)
    registry = Registry([long_batch], {"long_batch": TOPIC})
    producer = RecordingProducer()
    processor = Processor.build(settings, registry, ops=ops, producer=producer, metrics=Metrics())
    ran.clear()
    reaped.clear()
    global queue
    queue = RetryQueue(ops, keys)
    try:
        # Parked by earlier runs, all due now.
        for offset in range(RECORDS):
            key = f"k{offset}"
            d = Delivery(TOPIC, 0, offset, key.encode(), json.dumps({"key": key}).encode(), (), 0)
            await client.hset(keys.retry_items, d.retry_id, d.to_json())
            await client.zadd(keys.retry_due, {d.retry_id: 0})
        yield processor, queue, settings
    finally:
        await processor.aclose()
        await client.aclose()


async def test_a_retry_batch_longer_than_the_retry_lease_runs_every_record_once(
    env: tuple[Processor, RetryQueue, Settings],
) -> None:
    processor, retries, settings = env
    batch = await retries.claim_due(lease_ms=settings.retry.lease_ms, limit=RECORDS)
    assert len(batch) == RECORDS
    outcomes = await processor.process_batch(batch)
    assert outcomes == [Outcome.RETRY_SCHEDULED] * RECORDS
    assert sorted(ran) == list(range(RECORDS)), (
        f"handlers ran for offsets {sorted(ran)}: the others' leases ran out while they waited"
    )
    # Every record parked for its next attempt, none left in flight for the reaper.
    assert reaped == [0], "the reaper took back the lease of a record still in the batch"
    assert await retries.depth() == (RECORDS, 0)
    again = await retries.claim_due(lease_ms=settings.retry.lease_ms, limit=RECORDS)
    assert sorted(d.attempt for d in again) == [2] * RECORDS


async def test_a_dead_letter_whose_claim_ran_out_while_it_waited_still_marks_its_key(
    env: tuple[Processor, RetryQueue, Settings],
) -> None:
    """Found by the chaos suite (seed 624479618: "101 dead-markers for 102 keyed dead letters")
    in the first form of the lease keeper: a record dead-lettered in an early wave waited for
    the batch's end while Redis was down; its claim expired, the keeper's renewal answered
    lost_claim and the keeper noted the claim as not held, so MARK_DEAD left the key unmarked
    (it marks a key whose claim merely expired) and dropped its retry item all the same."""
    processor, _, settings = env
    key = "k-dead"
    delivery = Delivery(TOPIC, 0, 100, key.encode(), json.dumps({"key": key}).encode(), (), 0)
    job = processor.decisions.prepare(delivery)
    job.holds_claim = True  # claimed in its wave; the claim has run out since (no key in Redis)
    job.dead_letter("permanent", "not sold")
    keeper = LeaseKeeper(processor.parts.idempotency, settings, [job])
    assert await keeper.renew(horizon=float("inf")) == 1  # answered lost_claim
    await processor.decisions.dead_letter([job])
    client = make_client(settings.redis)
    try:
        marker = await client.get(job.idem_key)
    finally:
        await client.aclose()
    assert marker is not None and marker.startswith(b"x|"), f"the key ends {marker!r}"
