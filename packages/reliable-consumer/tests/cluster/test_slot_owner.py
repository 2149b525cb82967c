"""The client of WORKER_REDIS__CLUSTER on a real cluster: found from any node, its calls on the
slot's primary, a manual failover (the old primary demoted while its connections stay open:
MOVED for the slot) ridden by the reconnect policy, a key outside the tag an error at once."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import MovedError
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.durability import server_identity
from reliable_consumer.engine.redis.slot_owner import SlotMoved, slot_of
from reliable_consumer.engine.settings import RedisSettings
from tests.helpers import await_until

pytestmark = pytest.mark.timeout(120)

PREFIX = "slot-owner"


async def test_a_manual_failover_is_followed_and_a_key_outside_the_tag_is_refused(
    redis_cluster: RedisCluster,
) -> None:
    owner = redis_cluster.node_for_slot(slot_of(PREFIX))
    (replica,) = redis_cluster.replicas_of(owner)
    elsewhere = next(node for node in redis_cluster.primaries() if node is not owner)
    settings = RedisSettings(
        url=elsewhere.url, key_prefix=PREFIX, cluster=True, durability="wait_replicas"
    )
    key = f"{settings.effective_prefix}:state"
    client = make_client(settings)
    errors: list[BaseException] = []
    ops = RedisOps(client, settings, on_error=errors.append, max_backoff_s=0.2)
    try:
        assert await ops.call(lambda: client.set(key, "a"), durable=True)
        first = await server_identity(client)
        # A key outside the tag reaches the caller as MOVED, and is not retried.
        with pytest.raises(MovedError):
            await ops.call(lambda: client.set("outside-the-tag", 1))

        direct = aioredis.Redis(port=replica.port)
        try:
            await direct.execute_command("CLUSTER", "FAILOVER")
        finally:
            await direct.aclose()
        await await_until(
            lambda: redis_cluster.node_for_slot(slot_of(PREFIX)) is replica,
            30,
            message="the replica never took the slot",
        )
        # The pooled connection still reaches the demoted node: its MOVED for the service's
        # slot drops it, and the retried call lands on the new primary, waited for there (and
        # re-sent once more when the wait sees another server than the first: the engine's
        # writes are idempotent, as this SET is).
        assert await asyncio.wait_for(ops.call(lambda: client.set(key, "b"), durable=True), 30)
        assert await client.get(key) == b"b"
        assert any(isinstance(e, SlotMoved) for e in errors), errors
        assert await server_identity(client) != first
        assert (await client.info("server"))["tcp_port"] == replica.port
    finally:
        await client.aclose()
