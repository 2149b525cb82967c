"""The sharded gate's tests run on one Redis and on a real cluster (3 primaries), through
the engine's own transports (sharded/nodes.py).

Both refuse a call whose keys span slots before sending it; on the cluster each call runs on
its slot's primary, where a script touching a key of a slot that node does not own fails. So
every test on the cluster also proves each call touches one slot.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.handlers.emissions import Emission
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.keys import effect_key
from reliable_consumer.engine.redis.sharded.calls import SlotCaller
from reliable_consumer.engine.redis.sharded.gate import (
    GateRecord,
    OrderFinish,
    Reservation,
    ShardedGate,
)
from reliable_consumer.engine.redis.sharded.layout import ShardLayout
from reliable_consumer.engine.redis.sharded.nodes import ClusterCaller, SingleNodeCaller
from reliable_consumer.engine.settings import RedisSettings
from tests.helpers import await_until

PREFIX = "pay"
SHARDS = 8
HANDLER = "payments"
TOPIC = "payments.out"


@dataclass
class Env:
    kind: str
    client: Any  # redis.asyncio.Redis or its RedisCluster: the commands the tests read with
    caller: SlotCaller
    layout: ShardLayout

    def gate(self, lease_ms: int = 10_000, late_ms: int | None = None) -> ShardedGate:
        return ShardedGate(self.caller, lease_ms=lease_ms, late_ms=late_ms)

    def record(self, key: str, order: int, token: str, fp: str = "fp1") -> GateRecord:
        """A delivery of dedupe key ``key`` whose Kafka key lives in order shard ``order``."""
        return GateRecord(
            self.layout.gate_key(HANDLER, key), token, fp, self.layout.order_tag_of(order)
        )

    def counter(self, record: GateRecord, key: str) -> str:
        """The effect key a delivery increments: in its own order shard."""
        return effect_key(record.order_tag, "ledger", key)

    def finish(self, record: GateRecord, held: Reservation, key: str) -> OrderFinish:
        """The delivery's effects (one INCR) and one emission, under its reservation."""
        assert held.deadline_ms is not None, held
        emission = Emission(TOPIC, key.encode(), b"granted", (), f"ev-{record.token}")
        return OrderFinish(
            gate_key=record.gate_key,
            token=record.token,
            fingerprint=record.fingerprint,
            order_tag=record.order_tag,
            deadline_ms=held.deadline_ms,
            effects=[("INCR", self.counter(record, key))],
            emissions=[emission],
            emitted_by=HANDLER,
        )

    async def applied(self, key: str) -> int:
        """How many times key's effects applied, over every order shard."""
        total = 0
        for n in range(SHARDS):
            value = await self.client.get(effect_key(self.layout.order_tag_of(n), "ledger", key))
            total += int(value or 0)
        return total

    async def outbox_entries(self) -> int:
        return sum(
            [
                await self.client.xlen(self.layout.order_keys(t).outbox)
                for t in self.layout.order_tags()
            ]
        )

    async def value(self, key: str) -> str | None:
        raw = await self.client.get(key)
        return None if raw is None else raw.decode()


async def wait_past(deadline_ms: int) -> None:
    """Until the deadline (ms, Redis's clock: the suite's servers run on this host) passed."""
    await await_until(
        lambda: time.time() * 1000 > deadline_ms + 2, 10, 0.005, "the deadline never passed"
    )


@pytest.fixture(params=["redis", "cluster"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    layout = ShardLayout(PREFIX, SHARDS)
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")
        plain = aioredis.Redis.from_url(url)
        settings = RedisSettings(url=url, key_prefix=PREFIX)
        try:
            yield Env("redis", plain, SingleNodeCaller(RedisOps(plain, settings)), layout)
        finally:
            await plain.aclose()
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        settings = RedisSettings(url=cluster.urls[0], key_prefix=PREFIX, cluster=True)
        ops = RedisOps(make_client(settings), settings)
        caller = ClusterCaller.from_ops(ops)
        client = ClusterClient(startup_nodes=cluster.startup_nodes)
        # Its slot map read before the tests' tasks use it: redis-py's cluster client, first
        # used by many tasks at once, fails some of them (an AttributeError from a connection
        # torn down while it connected), which no test here is about.
        await client.initialize()
        try:
            yield Env("cluster", client, caller, layout)
        finally:
            await client.aclose()
            await caller.aclose()
            await ops.client.aclose()
