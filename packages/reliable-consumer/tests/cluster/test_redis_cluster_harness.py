"""The Redis Cluster the suite starts (reliable_consumer.dev.servers.redis_cluster): it forms,
a cluster client reaches every primary, it refuses what the engine's scripts would do today,
and a killed primary fails over without losing an acknowledged write (docs/redis-cluster.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as ClusterClient
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError
from reliable_consumer.dev.servers.process import DevStackError
from reliable_consumer.dev.servers.redis_cluster import SLOTS, RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.settings import RedisSettings
from tests.helpers import await_until

pytestmark = pytest.mark.timeout(120)


def keys_on(cluster: RedisCluster, primary: RedisServer, prefix: str) -> Iterator[str]:
    """Keys (``prefix:0``, ``prefix:1``, …) whose slot ``primary`` owns now."""
    ranges = cluster.slots_of(primary)
    index = 0
    while True:
        key = f"{prefix}:{index}"
        slot = key_slot(key.encode())
        if any(first <= slot <= last for first, last in ranges):
            yield key
        index += 1


def plain(node: RedisServer) -> aioredis.Redis:
    """A client of one node, that follows no redirection."""
    return aioredis.Redis(port=node.port, decode_responses=True)


async def test_the_cluster_forms_every_slot_covered_every_replica_in_sync(
    redis_cluster: RedisCluster,
) -> None:
    primaries, replicas = redis_cluster.primaries(), redis_cluster.replicas()
    assert len(primaries) == 3 and len(replicas) == 3
    # Every slot owned exactly once, by a primary.
    owned = [
        slot
        for primary in primaries
        for first, last in redis_cluster.slots_of(primary)
        for slot in range(first, last + 1)
    ]
    assert sorted(owned) == list(range(SLOTS))
    for primary in primaries:
        [replica] = redis_cluster.replicas_of(primary)
        with redis.Redis(port=replica.port, decode_responses=True) as client:
            info = client.info("replication")
        assert info["role"] == "slave" and info["master_link_status"] == "up", info
    for node in redis_cluster.nodes:
        # The bus port stays below the ephemeral range, where no client socket can hold it.
        assert node.port + 10_000 < 32_768
        with redis.Redis(port=node.port, decode_responses=True) as client:
            state = client.cluster("INFO")
        assert state["cluster_state"] == "ok", state
        assert state["cluster_slots_ok"] == str(SLOTS) and state["cluster_known_nodes"] == "6"
    assert redis_cluster.node_for_slot(0) in primaries
    assert redis_cluster.node_for_slot(SLOTS - 1) in primaries


async def test_a_cluster_client_writes_and_reads_on_every_primary(
    redis_cluster: RedisCluster,
) -> None:
    client = ClusterClient(startup_nodes=redis_cluster.startup_nodes, decode_responses=True)
    try:
        for index, primary in enumerate(redis_cluster.primaries()):
            keys = keys_on(redis_cluster, primary, f"p{index}")
            written = {next(keys): f"v{index}-{n}" for n in range(5)}
            for key, value in written.items():
                assert await client.set(key, value)
            for key, value in written.items():
                assert await client.get(key) == value
            # The harness's slot map is the cluster's: the keys live on that very node.
            direct = plain(primary)
            try:
                assert [await direct.get(key) for key in written] == list(written.values())
            finally:
                await direct.aclose()
    finally:
        await client.aclose()


async def test_a_script_on_keys_of_two_slots_is_refused_with_crossslot(
    redis_cluster: RedisCluster,
) -> None:
    """The refusal the engine's batch scripts meet on a cluster, from the server itself."""
    primary = redis_cluster.primaries()[0]
    keys = keys_on(redis_cluster, primary, "x")
    first = next(keys)
    second = next(k for k in keys if key_slot(k.encode()) != key_slot(first.encode()))
    script = "redis.call('SET', KEYS[1], 'a'); redis.call('SET', KEYS[2], 'b'); return 1"
    client = plain(primary)
    try:
        # The server's error code CROSSSLOT, which redis-py turns into this class.
        with pytest.raises(ClusterCrossSlotError):
            await client.eval(script, 2, first, second)
        # The same script on keys that share a hash tag (one slot) runs.
        tag = next(keys)
        assert await client.eval(script, 2, f"{{{tag}}}:a", f"{{{tag}}}:b") == 1
    finally:
        await client.aclose()


async def test_a_killed_primary_fails_over_losing_no_acknowledged_write_and_rejoins(
    redis_cluster: RedisCluster,
) -> None:
    victim = redis_cluster.node_for_slot(0)
    [successor] = redis_cluster.replicas_of(victim)
    keys = keys_on(redis_cluster, victim, "acked")
    acked: list[str] = []
    # One connection (WAIT covers the writes of its own connection), no retries: the crash
    # ends the writer at once.
    writer = aioredis.Redis(
        port=victim.port, single_connection_client=True, retry=Retry(NoBackoff(), 0)
    )

    async def write_until_the_crash() -> None:
        """SET, then WAIT for the replica: a key counts once a replica acknowledged it."""
        for key in keys:
            try:
                await writer.set(key, key)
                if await writer.wait(1, 2000) >= 1:
                    acked.append(key)
            except (redis.ConnectionError, redis.TimeoutError):
                return

    writing = asyncio.create_task(write_until_the_crash())
    try:
        await await_until(lambda: len(acked) >= 50, 30, message="no writes acknowledged")
        killed = await asyncio.to_thread(redis_cluster.kill_primary, victim)
        await asyncio.wait_for(writing, 10)  # the writer met the crash mid-run
    finally:
        writing.cancel()
        await writer.aclose()
    assert killed is victim and not victim.is_running()

    promoted = await asyncio.to_thread(redis_cluster.wait_failed_over, killed)
    assert promoted is successor
    assert promoted in redis_cluster.primaries()
    assert redis_cluster.node_for_slot(0) is promoted

    client = ClusterClient(startup_nodes=redis_cluster.startup_nodes, decode_responses=True)
    try:
        values = [await client.get(key) for key in acked]
        lost = [key for key, value in zip(acked, values, strict=True) if value != key]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged writes lost: {lost[:5]}"
        assert await client.set("after:failover", "yes")
    finally:
        await client.aclose()

    rejoined = await asyncio.to_thread(redis_cluster.restart, killed)
    assert rejoined not in redis_cluster.primaries()
    assert redis_cluster.replicas_of(promoted) == [rejoined]
    replica = plain(rejoined)
    try:
        await replica.execute_command("READONLY")  # a replica serves reads when asked to
        copies = [await replica.get(key) for key in acked]
    finally:
        await replica.aclose()
    assert copies == acked  # it resynchronised from the node that took its slots


async def test_check_persistence_refuses_a_node_of_the_cluster_naming_the_setting(
    redis_cluster: RedisCluster,
) -> None:
    for url in (redis_cluster.primaries()[0].url, redis_cluster.replicas()[0].url):
        settings = RedisSettings(url=url)
        client = make_client(settings)
        try:
            with pytest.raises(ConfigurationError) as err:
                await check_persistence(client, settings)
        finally:
            await client.aclose()
        message = str(err.value)
        assert "WORKER_REDIS__URL" in message and "Redis Cluster" in message, message
        assert "WORKER_REDIS__CLUSTER" in message, message


def test_a_failover_that_misses_its_deadline_names_the_node_and_quotes_its_log(
    tmp_path: Path,
) -> None:
    """A replica told never to take over: the wait ends in an error a reader can act on."""
    cluster = RedisCluster(
        tmp_path / "no-failover",
        primaries=1,
        extra_config={"cluster-replica-no-failover": "yes"},
    )
    with cluster:
        [replica] = cluster.replicas()
        killed = cluster.kill_primary()
        with pytest.raises(DevStackError) as err:
            cluster.wait_failed_over(killed, timeout=2)
    message = str(err.value)
    assert f"a replica of redis node {killed.port} to take over" in message, message
    # The node still waiting is named, with what it sees and the end of its log.
    assert f"redis node {replica.port}: sees 16384 slot(s) still owned by a node" in message
    assert f"--- {replica.log_path} ---" in message, message
