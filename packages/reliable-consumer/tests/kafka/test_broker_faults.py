"""Broker faults Tansu cannot give, on real Apache Kafka: nothing lost, nothing doubled.

Each test runs the real worker in this event loop (tests/integration/harness.py) and ends
with the same invariants as the integration suite: every valid payment granted once, every
bad record dead-lettered, committed offset = high watermark, retry queue empty.
"""

from __future__ import annotations

import asyncio

from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.redis.keys import tagged_prefix
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    produce,
    running_worker,
    wait_settled,
)
from tests.kafka.support import create_run_topics

from service import sample


async def _grants(settings_url: str, name: str) -> int:
    """Grants so far of the run whose key prefix is ``name``."""
    return sum((await audit.ledger_grants(settings_url, tagged_prefix(name))).values())


async def test_broker_killed_and_restarted_with_its_data_loses_nothing(
    kafka1: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka1.bootstrap_servers, redis_url, unique_name)
    await create_run_topics(kafka1, settings)
    records = sample.generate(400, seed=11, prefix=unique_name)
    first, second = records[:200], records[200:]
    await produce(settings, first)
    async with running_worker(settings):
        await await_until(
            lambda: _grants(redis_url, unique_name), 60, interval=0.05, message="no grant yet"
        )
        await asyncio.to_thread(kafka1.kill, 0)
        await asyncio.to_thread(kafka1.restart, 0)
        await produce(settings, second)
        state = await wait_settled(settings, timeout=90)
    assert_invariants(state, records)


async def test_partition_leader_killed_mid_run_loses_nothing(
    kafka3: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka3.bootstrap_servers, redis_url, unique_name)
    await create_run_topics(kafka3, settings)
    records = sample.generate(600, seed=12, prefix=unique_name)
    await produce(settings, records)
    leader = await kafka3.leader_of(unique_name, 0)
    # Killing a leader loses nothing only while another replica is in sync: on a loaded
    # machine (a broker of this shared cluster restarted by an earlier test still catching
    # up) the ISR can be the leader alone, and its kill takes the partition offline for good.
    written = [
        (unique_name, 0),
        (settings.dead_letter_topic(unique_name), 0),
        *([(outcomes, 0)] if (outcomes := settings.outcomes_topic()) else []),
    ]

    async def fully_replicated() -> bool:
        return all([len(await kafka3.isr_of(t, p)) == 3 for t, p in written])

    await await_until(fully_replicated, 60, interval=0.2, message="replicas never in sync")
    try:
        async with running_worker(settings):
            await await_until(
                lambda: _grants(redis_url, unique_name), 60, interval=0.05, message="no grant"
            )
            await asyncio.to_thread(kafka3.kill, leader)
            state = await wait_settled(settings, timeout=90)
            assert await kafka3.leader_of(unique_name, 0) not in (leader, -1)
        assert_invariants(state, records)
    finally:
        await asyncio.to_thread(kafka3.restart, leader)
