"""The worker on a Redis Cluster, one hash slot per service (WORKER_REDIS__CLUSTER, stage 1 of
docs/redis-cluster.md): exactly once, retries and dead letters as on one Redis, every key in
the slot of the prefix's hash tag, a primary's failover ridden without a lost or doubled grant,
and the start refused when the setting does not match what the URL points at.

The worker is pointed at a node that does not own the service's slot: its connections must
find the owner themselves. A CROSSSLOT or a MOVED that reached the record path would show as
a wrong dead letter or a missing grant, and in the log, which is checked too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.slot_owner import slot_of
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MIX = sample.Mix(transient=0.10, permanent=0.02, malformed=0.02)


def cluster_settings(
    broker: Broker, cluster: RedisCluster, name: str, **overrides: Any
) -> Settings:
    """The service on the cluster, its URL a primary that does not own the service's slot."""
    owner = cluster.node_for_slot(slot_of(name))
    elsewhere = next(node for node in cluster.primaries() if node is not owner)
    redis = {"cluster": True, **overrides.pop("redis", {})}
    # The test broker has one node: its topics cannot be what a Redis wait mode asks of them.
    overrides.setdefault("topic_durability", "warn")
    return make_settings(broker.bootstrap, elsewhere.url, name, redis=redis, **overrides)


async def keys_of_every_primary(cluster: RedisCluster) -> dict[int, list[bytes]]:
    """Every key each running primary holds, by its port."""
    found: dict[int, list[bytes]] = {}
    for primary in cluster.primaries():
        client = aioredis.Redis(port=primary.port)
        try:
            found[primary.port] = [key async for key in client.scan_iter(count=1000)]
        finally:
            await client.aclose()
    return found


def assert_clean_log(caplog: pytest.LogCaptureFixture) -> None:
    for text in ("CROSSSLOT", "MOVED", "ASK "):
        assert text not in caplog.text, f"{text} in the worker's log"


async def test_a_backlog_is_granted_once_retries_and_dead_letters_work_every_key_in_one_slot(
    kafka_broker: Broker,
    redis_cluster: RedisCluster,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    settings = cluster_settings(
        kafka_broker, redis_cluster, unique_name, redis={"durability": "wait_replicas"}
    )
    await prepare_topics(settings, partitions=3)
    records = sample.generate(400, MIX)
    kinds = {r.kind for r in records}
    assert {"transient", "permanent", "malformed"} <= kinds  # parked, then granted or dead
    await produce(settings, records)

    async with running_worker(settings):
        state = await wait_settled(settings, timeout=60)
    assert_invariants(state, records)

    slot = slot_of(unique_name)
    owner = redis_cluster.node_for_slot(slot)
    found = await keys_of_every_primary(redis_cluster)
    mine = [key for keys in found.values() for key in keys]
    assert found[owner.port], "the service wrote nothing on the slot's primary"
    assert all(not keys for port, keys in found.items() if port != owner.port), found
    tag = f"{{{unique_name}}}:".encode()
    assert all(key.startswith(tag) and key_slot(key) == slot for key in mine), mine[:10]
    namespaces = {key[len(tag) :].split(b":", 1)[0] for key in mine}
    assert {b"idem", b"durability", b"ledger", b"entitlements"} <= namespaces, namespaces
    assert f"primary 127.0.0.1:{owner.port}" in caplog.text  # which node the check read
    assert_clean_log(caplog)


async def test_the_slots_primary_killed_mid_run_fails_over_nothing_lost_nothing_doubled(
    kafka_broker: Broker,
    redis_cluster: RedisCluster,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = cluster_settings(
        kafka_broker,
        redis_cluster,
        unique_name,
        redis={"durability": "wait_replicas", "wait_replicas": 1, "socket_timeout_s": 2.0},
    )
    await prepare_topics(settings, partitions=3)
    records = sample.generate(1500, MIX)
    to_grant = sum(1 for r in records if r.expect_grant)
    await produce(settings, records)
    prefix = settings.redis.effective_prefix

    async def granted() -> int:
        return sum((await audit.ledger_grants(settings.redis, prefix)).values())

    async with running_worker(settings) as worker:
        await await_until(lambda: _at_least(granted, 200), 60, message="no grants before kill")
        killed = redis_cluster.kill_primary(redis_cluster.node_for_slot(slot_of(unique_name)))
        # The new primary has no replica until the killed node is back as one: the wait for
        # a replica holds the writes meanwhile, it never lets one through unreplicated.
        promoted = await asyncio.to_thread(redis_cluster.wait_failed_over, killed)
        before_back = await granted()
        assert before_back < to_grant, "the kill came too late to be mid-run"
        await asyncio.to_thread(redis_cluster.restart, killed)
        state = await wait_settled(settings, timeout=60)
        assert worker.health.started
    assert_invariants(state, records)  # every payment sent granted exactly once, or dead
    assert redis_cluster.node_for_slot(slot_of(unique_name)) is promoted
    assert "redis calls failing" in caplog.text  # the worker felt the kill, and rode it
    assert_clean_log(caplog)


async def _at_least(count: Any, threshold: int) -> bool:
    return bool(await count() >= threshold)


async def test_a_cluster_node_without_the_setting_is_refused_naming_it(
    kafka_broker: Broker, redis_cluster: RedisCluster, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_cluster.urls[0], unique_name)
    await prepare_topics(settings, partitions=1)
    worker = Worker(settings)
    with pytest.raises(ConfigurationError) as refused:
        await worker.run()
    message = str(refused.value)
    assert "WORKER_REDIS__CLUSTER" in message and "cluster_enabled:1" in message, message
    assert not worker.health.started


async def test_the_setting_on_a_single_redis_is_refused_naming_both_settings(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, redis={"cluster": True}
    )
    await prepare_topics(settings, partitions=1)
    worker = Worker(settings)
    with pytest.raises(ConfigurationError) as refused:
        await worker.run()
    message = str(refused.value)
    assert "WORKER_REDIS__CLUSTER=true" in message and "WORKER_REDIS__URL" in message, message
    assert f"127.0.0.1:{redis_server.port}" in message  # what it saw there
    assert not worker.health.started
