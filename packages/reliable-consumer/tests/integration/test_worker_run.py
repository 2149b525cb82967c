"""A worker run against the real broker and Redis: the core invariants of the service."""

from __future__ import annotations

from reliable_consumer.dev.servers.broker import Broker
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample


async def test_mixed_run_grants_each_payment_once(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    await prepare_topics(settings, partitions=3)
    records = sample.generate(600, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    assert {r.kind for r in records} >= {"ok", "transient", "permanent", "malformed"}
    await produce(settings, records)

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=90)

    assert_invariants(state, records)
