"""A Redis left by the version before the tagged key layout: every key under the bare prefix.

The state is written the way that version wrote it: the engine's own record path with
``RedisSettings.effective_prefix`` as it was on one Redis (the prefix itself) grants the
records (done-markers, the ledger and entitlements, the outbox's emissions), a parked
retry waits in its Kafka key's chain (the item naming the chain by its old name), and an
effect with a TTL stands for every key that expires.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import redis.asyncio as aioredis
from reliable_consumer.engine.batch.processing import Processor
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import RedisSettings, Settings
from tests.integration.recording_producer import RecordingProducer

from service import sample

TTL_MS = 3_600_000


@contextmanager
def previous_version() -> Iterator[None]:
    """The key prefix as the version before named it on one Redis: the prefix itself."""
    bare = property(lambda self: self.key_prefix)
    with mock.patch.object(RedisSettings, "effective_prefix", bare):
        yield


@dataclass(frozen=True)
class OldLayout:
    granted: list[sample.SampleRecord]  # done under the old names
    parked: sample.SampleRecord  # waiting in the delay queue, in its chain
    chain: str  # the chain's old name
    expiring: str  # an effect with a TTL (TTL_MS when written)


def deliveries(topic: str, records: list[sample.SampleRecord]) -> list[Delivery]:
    now = int(time.time() * 1000)
    return [
        Delivery(topic, 0, offset, r.key, r.value, tuple(r.headers), now)
        for offset, r in enumerate(records)
    ]


async def fill_old_layout(
    client: aioredis.Redis, settings: Settings, records: list[sample.SampleRecord]
) -> OldLayout:
    """Grant all records but the last under the old layout; park the last one, chained."""
    topic = settings.topics["payments"]
    *granted, parked = records
    bare = settings.redis.key_prefix
    with previous_version():
        processor = Processor.build(
            settings,
            Registry.from_settings(settings.topics),
            ops=RedisOps(client, settings.redis),
            producer=RecordingProducer(),
            metrics=Metrics(),
        )
        for delivery in deliveries(topic, granted):
            assert await processor.process(delivery) is Outcome.SUCCEEDED
    keys = RedisKeys(bare)
    (retry,) = deliveries(topic, [parked])
    chain = keys.retry_chain(topic, 0, retry.key or b"")
    retry = Delivery(
        topic, 0, 10_000, retry.key, retry.value, retry.headers, retry.timestamp_ms,
        attempt=2, last_error="RetryableError: down", chain=chain,
    )  # fmt: skip
    queue = RetryQueue(RedisOps(client, settings.redis), keys)
    request = ParkRequest(delivery=retry, delay_ms=0, idem_key="", token="", handler="payments")
    assert await queue.park_many([request]) == [ParkStatus.PARKED]
    expiring = keys.effect("entitlements", "expiring")
    await client.set(expiring, "1", px=TTL_MS)
    return OldLayout(granted, parked, chain, expiring)
