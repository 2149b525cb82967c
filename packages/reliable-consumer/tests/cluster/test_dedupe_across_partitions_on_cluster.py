"""A dedupe key granted at most once on a Redis Cluster, whatever partition or Kafka key it
arrives under (docs/redis-cluster.md, *Why each invariant holds*).

The gate is the done-marker named by the handler and the dedupe key alone, in the service's
one slot: a second delivery of a payment under another Kafka key lands on another partition,
is fetched by its own batch and may reach FINISH in the same script call as the first, or
as a retry after the first was granted. Either way exactly one grant.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.kafka.clients import connection_kwargs
from tests.cluster.test_worker_on_cluster import assert_clean_log, cluster_settings
from tests.integration.harness import (
    assert_invariants,
    payments_topic,
    prepare_topics,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PARTITIONS = 3


async def test_a_payment_sent_under_two_kafka_keys_to_two_partitions_is_granted_once(
    kafka_broker: Broker,
    redis_cluster: RedisCluster,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    settings = cluster_settings(kafka_broker, redis_cluster, unique_name)
    await prepare_topics(settings, partitions=PARTITIONS)
    # Some fail once first, so that a copy may meet its twin parked, then granted.
    records = sample.generate(240, sample.Mix(transient=0.2))
    twins = [r for r in records[::2] if r.expect_grant]
    copies = [dataclasses.replace(r, key=(r.key or b"") + b"/copy") for r in twins]
    assert len(copies) >= 100
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        topic = payments_topic(settings)
        sent = []
        for i, r in enumerate(records):
            sent.append(
                await producer.send(
                    topic, r.value, key=r.key, partition=i % PARTITIONS, headers=r.headers or None
                )
            )
        for i, r in enumerate(copies):  # each copy on a partition other than its twin's
            twin = records.index(next(o for o in records if o.payment_id == r.payment_id))
            partition = (twin + 1 + i % (PARTITIONS - 1)) % PARTITIONS
            sent.append(
                await producer.send(
                    topic, r.value, key=r.key, partition=partition, headers=r.headers or None
                )
            )
        for future in sent:
            await future
    finally:
        await producer.stop()

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=60)
    assert_invariants(state, records)  # every payment granted exactly once, copies and all
    assert_clean_log(caplog)
