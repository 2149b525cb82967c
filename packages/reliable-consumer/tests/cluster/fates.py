"""What the operator tests on the cluster start from: four payments, of which two are
granted, one is dead-lettered (permanent) and one stays parked (its backoff is a minute)."""

from __future__ import annotations

from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit
from tests.cluster.test_worker_on_cluster import cluster_settings
from tests.helpers import await_until
from tests.integration.harness import prepare_topics, produce

from service import sample

# The payment at each index fails so: 1 for good, 2 once (parked, not due in the test).
FAULTS = {1: b"permanent", 2: b"transient:1000"}


async def produce_one_of_each_fate(
    kafka_broker: Broker, cluster: RedisCluster, name: str, *, seed: int
) -> tuple[Settings, list[sample.SampleRecord]]:
    """The service's settings on the cluster and the four payments, produced, in order."""
    settings = cluster_settings(
        kafka_broker,
        cluster,
        name,
        retry={"base_delay_ms": 60_000, "max_delay_ms": 60_000, "max_attempts": 5},
    )
    await prepare_topics(settings, partitions=2)
    ok = sample.generate(4, sample.Mix(transient=0, permanent=0, malformed=0), seed=seed)
    records = [
        sample.SampleRecord(
            "ok", r.payment_id, r.key, r.value, [("x-fault", FAULTS[i])] if i in FAULTS else []
        )
        for i, r in enumerate(ok)
    ]
    await produce(settings, records)
    return settings, ok


async def await_parked_and_dead(settings: Settings) -> None:
    """Until the worker granted two, dead-lettered one and parked one."""
    prefix = settings.redis.effective_prefix
    dlq = settings.dead_letter_topic(settings.topics["payments"])

    async def parked_and_dead() -> bool:
        depth = await audit.retry_queue_depth(settings.redis, prefix)
        dead = await audit.read_all(settings.kafka, dlq)
        grants = await audit.ledger_grants(settings.redis, prefix)
        return depth == (1, 0, 1) and len(dead) == 1 and len(grants) == 2

    await await_until(parked_and_dead, 60, interval=0.3, message="not parked and dead")
