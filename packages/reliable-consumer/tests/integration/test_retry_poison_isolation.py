"""Issue 12, defect 3: a poison record among due retries is isolated, not looped forever.

The retry scheduler ran claimed retries through ``process_batch`` and only logged a
failure: the batch stayed in flight, the reaper re-queued it at every lease expiry and it
failed again, forever, while its healthy batch-mates were never granted. It now runs them
through ``process_reliably`` like fetched batches: record by record once the batch
breaks, a record that keeps breaking dead-lettered as ``internal``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.batch import processing
from reliable_consumer.engine.batch.decisions import Decisions
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.delay_queue import ParkRequest, RetryQueue
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics

pytestmark = pytest.mark.timeout(120)

BREAKS_BEFORE_WRITING = b"pay_2"  # processing breaks on it before anything is written
BREAKS_AFTER_WRITING = "pay_5"  # ... after its effects and done-marker were written


def payment(n: int) -> bytes:
    return json.dumps(
        {
            "payment_id": f"pay_{n}",
            "user_id": f"u{n}",
            "product_id": "sku_1",
            "amount_minor": 100 + n,
            "currency": "EUR",
        }
    ).encode()


def break_processing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bugs in our own path, triggered by one record each (not by its handler)."""
    prepare, finish_many = Decisions.prepare, Idempotency.finish_many

    def broken_prepare(self: Decisions, delivery: Delivery) -> Any:
        if delivery.key == BREAKS_BEFORE_WRITING:
            raise RuntimeError("simulated bug before the effects")
        return prepare(self, delivery)

    async def broken_finish(self: Idempotency, requests: Sequence[FinishRequest]) -> Any:
        results = await finish_many(self, requests)
        if any(r.key.endswith(f"={BREAKS_AFTER_WRITING}") and r.effects for r in requests):
            raise RuntimeError("simulated bug after the effects")
        return results

    monkeypatch.setattr(Decisions, "prepare", broken_prepare)
    monkeypatch.setattr(Idempotency, "finish_many", broken_finish)
    monkeypatch.setattr(processing, "INTERNAL_BACKOFF_MAX_S", 0.2)  # keep the test short


async def test_poison_retry_is_dead_lettered_and_its_batch_mates_granted(
    kafka_broker: Broker, redis_url: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    topic, prefix = settings.topics["payments"], settings.redis.effective_prefix
    await prepare_topics(settings, partitions=1)
    now = int(time.time() * 1000)
    retries = [
        Delivery(topic, 0, n, f"pay_{n}".encode(), payment(n), (), now, attempt=2) for n in range(8)
    ]
    client = make_client(settings.redis)
    queue = RetryQueue(RedisOps(client, settings.redis), RedisKeys(prefix))
    for d in retries:  # parked after a first failure; due now, claimed as one batch
        await queue.park(ParkRequest(delivery=d, delay_ms=0, idem_key="", token=""))
    break_processing(monkeypatch)

    worker = Worker(settings, consume=False)  # what `service retry-scheduler` runs
    task = asyncio.create_task(worker.run())
    try:

        async def settled() -> bool:
            if task.done():
                task.result()
            return await queue.depth() == (0, 0)

        await await_until(settled, 45, interval=0.2, message="the retries never settled")
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
        await client.aclose()

    grants = await audit.ledger_grants(redis_url, prefix)
    healthy = {f"pay_{n}" for n in range(8)} - {"pay_2"}
    assert dict(grants) == dict.fromkeys(healthy, 1), "each granted once, the poison never"
    dead = await audit.read_all(settings.kafka, settings.dead_letter_topic(topic))
    reasons = {r.key: audit.header(r, "x-dlq-reason") for r in dead}
    assert reasons == {b"pay_2": "internal", b"pay_5": "internal"}
