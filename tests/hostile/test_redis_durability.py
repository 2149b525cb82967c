"""Redis durability made explicit (docs/durability.md), against real redis-server processes.

Once a failed record is parked in Redis its offset is committed: Redis is then its only
home. These tests pin the start-up refusal and warnings, the replica and AOF wait modes,
and a Redis crash in the middle of a run with retries parked.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from service import audit, sample
from service.devstack import KafkaBroker, RedisServer
from service.errors import ConfigurationError
from service.redis_client import RedisOps, make_client
from service.settings import RedisSettings, Settings
from service.worker import Worker
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

Factory = Callable[..., RedisServer]


def settings_for(
    kafka: KafkaBroker, server: RedisServer, name: str, **redis_values: Any
) -> Settings:
    return make_settings(
        kafka.bootstrap, server.url, name, redis=redis_values, shutdown_grace_s=1.0
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
    kafka_broker: KafkaBroker, redis_server_factory: Factory, unique_name: str
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
    kafka_broker: KafkaBroker,
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
        warnings = await RedisOps(client, RedisSettings(url=server.url)).check_persistence()
    finally:
        await client.aclose()
    assert len(warnings) == 1 and "appendfsync is 'everysec'" in warnings[0]


async def test_wait_aof_needs_redis_7_2(
    kafka_broker: KafkaBroker, redis_server_factory: Factory, unique_name: str
) -> None:
    server = redis_server_factory()
    settings = settings_for(kafka_broker, server, unique_name, durability="wait_aof")
    if redis_version(server) >= (7, 2):  # a newer dev binary: then WAITAOF must just work
        client = make_client(settings.redis)
        try:
            ops = RedisOps(client, settings.redis)
            await ops.check_persistence()
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
            await RedisOps(client, redis_settings).check_persistence()
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
    kafka_broker: KafkaBroker,
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
    kafka_broker: KafkaBroker, redis_server_factory: Factory, unique_name: str
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
        assert await ops.check_persistence() == []
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
        assert int(await client.get(ops.fence_key) or 0) >= 200
    finally:
        await client.aclose()
        await replica.aclose()
        replica_server.stop()


# --- a Redis crash with retries parked ----------------------------------------------------------


@pytest.mark.timeout(180)
async def test_redis_crash_and_restart_loses_no_parked_retry(
    kafka_broker: KafkaBroker, redis_server: RedisServer, unique_name: str
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
        # committed, retries still waiting in the delay queue.
        async def parked_and_committed() -> bool:
            state = await observe(settings)
            committed = all(p.committed == p.high_watermark for p in state.offsets)
            return committed and state.retry_depth[0] >= 10

        await await_until(parked_and_committed, 60, interval=0.1, message="no parked retries")
        before = await audit.retry_queue_depth(redis_server.url, settings.redis.key_prefix)
        errors = redis_errors(worker)
        await asyncio.to_thread(redis_server.kill)  # a crash: no shutdown, no final fsync
        # Redis stays down until the worker has hit the outage (the loop keeps running).
        await await_until(lambda: redis_errors(worker) >= errors + 3, 30, message="no outage seen")
        redis_server.start()  # same port, same AOF (started from this thread: see devstack)
        after = await audit.retry_queue_depth(redis_server.url, settings.redis.key_prefix)
        # The parked retries came back with Redis (a few may have finished meanwhile).
        assert 0 < after[2] <= before[2], (before, after)
        state = await wait_settled(settings, timeout=90)
    missing = {
        r.payment_id for r in records if r.expect_grant and state.grants.get(r.payment_id) != 1
    }
    # On failure, say what became of each missing payment (its outcome events).
    history = [
        json.loads(r.value)
        for r in await audit.read_all(settings.kafka, settings.outcomes_topic() or "")
    ]
    trail = {
        pid: [(e["event"], e["attempt"], e["reason"]) for e in history if e["dedupe_key"] == pid]
        for pid in sorted(missing)
    }
    assert not missing, f"queue before/after the crash {before}/{after}; outcomes {trail}"
    assert_invariants(state, records)
    for r in transient:
        assert state.grants.get(r.payment_id) == 1, r.payment_id
