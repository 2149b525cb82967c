"""Liveness, readiness and metrics over HTTP, as an orchestrator and Prometheus see them."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.delay_queue import RetryScheduler
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.integration.harness import (
    make_settings,
    prepare_topics,
    produce,
    running,
    running_worker,
    wait_settled,
)

from service import sample

pytestmark = pytest.mark.timeout(150)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except urllib.error.URLError:  # not listening yet (or any more)
        return 0, "{}"


async def test_readiness_follows_assignment_and_redis_and_metrics_show_partitions(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        http={"enabled": True, "host": "127.0.0.1", "port": port},
    )
    await prepare_topics(settings, partitions=2)
    records = sample.generate(40, sample.Mix(transient=0, permanent=0, malformed=0))
    await produce(settings, records)

    async with running_worker(settings):
        assert _get(port, "/healthz")[0] == 200
        await await_until(
            lambda: _get(port, "/readyz")[0] == 200, 60, message="never ready after joining"
        )
        ready = json.loads(_get(port, "/readyz")[1])
        assert ready["assigned_partitions"] == 2 and ready["redis"] and ready["kafka"]
        await wait_settled(settings)

        def metrics_show_the_partitions() -> bool:
            text = _get(port, "/metrics")[1]
            return (
                'worker_records_total{handler="payments",outcome="succeeded"} 40.0' in text
                and f'worker_partition_committed_offset{{partition="0",topic="{unique_name}"}}'
                in text
                and f'worker_partition_lag{{partition="1",topic="{unique_name}"}} 0.0' in text
            )

        await await_until(metrics_show_the_partitions, 30, message="partition gauges missing")

        redis_server.kill()  # readiness must say so; liveness must not (a restart won't help)
        await await_until(
            lambda: _get(port, "/readyz")[0] == 503, 30, message="ready while Redis is down"
        )
        assert json.loads(_get(port, "/readyz")[1])["redis"] is False
        assert _get(port, "/healthz")[0] == 200
        redis_server.restart()
        await await_until(
            lambda: _get(port, "/readyz")[0] == 200, 30, message="not ready after Redis returned"
        )


def _json(port: int, path: str) -> tuple[int, dict[str, Any]]:
    status, body = _get(port, path)
    return status, json.loads(body)


def _http(port: int) -> dict[str, Any]:
    return {"enabled": True, "host": "127.0.0.1", "port": port}


async def test_retry_scheduler_only_process_stays_live_past_the_poll_gap(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Defect 13: `service retry-scheduler` never polls Kafka, so /healthz must not wait for it."""
    port = free_port()
    gap_s = 1.0  # max_poll_interval_ms / 2000: the liveness gap, small so the test is short
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        http=_http(port),
        kafka={"max_poll_interval_ms": int(gap_s * 2000)},
    )
    await prepare_topics(settings, partitions=1)
    async with running(Worker(settings, consume=False)):
        await await_until(lambda: _get(port, "/readyz")[0] == 200, 30, message="never ready")
        end = time.monotonic() + 4 * gap_s
        while time.monotonic() < end:  # probed like an orchestrator would, for 4 gaps
            status, body = _json(port, "/healthz")
            assert status == 200, body
            await asyncio.sleep(0.2)


async def test_healthz_fails_when_a_background_loop_dies(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler whose loop crashed is a process doing nothing: restart it."""

    async def crash(self: RetryScheduler) -> None:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(RetryScheduler, "run", crash)
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, http=_http(port)
    )
    await prepare_topics(settings, partitions=1)
    async with running(Worker(settings, consume=False)):
        await await_until(
            lambda: _get(port, "/healthz")[0] == 503, 30, message="live with a dead scheduler"
        )
        assert any("retries loop died" in p for p in _json(port, "/healthz")[1]["problems"])


async def test_healthz_fails_when_the_poll_loop_stalls_while_the_event_loop_runs(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, http=_http(port)
    )
    await prepare_topics(settings, partitions=1)
    worker = Worker(settings)
    skew = [0.0]
    worker.health.clock = lambda: time.monotonic() + skew[0]
    async with running(worker):
        await await_until(lambda: _get(port, "/readyz")[0] == 200, 60, message="never ready")
        skew[0] = worker.health.max_poll_gap_s + 1  # time passes: a healthy loop polls again
        await await_until(
            lambda: _get(port, "/healthz")[0] == 200, 10, message="the loops never caught up"
        )

        never, entered = asyncio.Event(), asyncio.Event()

        async def stuck(*args: object, **kwargs: object) -> dict[Any, Any]:
            entered.set()
            await never.wait()
            return {}

        assert worker._consumer is not None
        monkeypatch.setattr(worker._consumer, "getmany", stuck)
        await await_until(entered.is_set, 10, message="the poll loop never fetched again")
        skew[0] += worker.health.max_poll_gap_s + 1

        def only_the_poll_loop_is_stale() -> bool:
            status, body = _json(port, "/healthz")
            # The event loop still turns (its heartbeat catches up with the clock); only the
            # poll loop stays behind.
            return status == 503 and body["problems"] == ["poll loop stalled"]

        await await_until(
            only_the_poll_loop_is_stale, 10, message=lambda: _get(port, "/healthz")[1]
        )


async def test_not_ready_before_joining_the_group(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, http=_http(port)
    )
    await prepare_topics(settings, partitions=2)
    worker = Worker(settings)
    gate, reached = asyncio.Event(), asyncio.Event()
    original = worker._on_assigned

    async def held(assigned: set[Any]) -> None:
        reached.set()
        await gate.wait()
        await original(assigned)

    monkeypatch.setattr(worker, "_on_assigned", held)
    async with running(worker):
        await await_until(reached.is_set, 60, message="the group never assigned")
        status, body = _json(port, "/readyz")
        assert status == 503 and body["joined_group"] is False, body
        assert body["kafka"] and body["redis"], body  # connected is not enough
        assert _get(port, "/healthz")[0] == 200
        gate.set()
        await await_until(lambda: _get(port, "/readyz")[0] == 200, 30, message="never ready")


async def test_worker_given_zero_partitions_is_a_live_standby_not_ready(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Defect 13: two workers, one partition; the idle one must not report ready."""
    ports = [free_port(), free_port()]
    workers = [
        Worker(
            make_settings(kafka_broker.bootstrap, redis_server.url, unique_name, http=_http(port))
        )
        for port in ports
    ]
    await prepare_topics(workers[0].settings, partitions=1)
    async with running(workers[0]), running(workers[1]):

        def settled() -> bool:
            counts = sorted(w.health.assigned_partitions for w in workers)
            joined = all(w.health.joined_group for w in workers)
            return joined and counts == [0, 1] and not any(w.intake.revoking for w in workers)

        await await_until(settled, 60, message="no 1 + 0 assignment")
        idle = 0 if workers[0].health.assigned_partitions == 0 else 1
        status, body = _json(ports[idle], "/readyz")
        assert status == 503, body
        assert body["standby"] is True and body["assigned_partitions"] == 0, body
        assert _get(ports[idle], "/healthz")[0] == 200  # idle is fine: never restart it
        assert _get(ports[1 - idle], "/readyz")[0] == 200


async def test_not_ready_while_stopping_but_still_live(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """During the shutdown the pod leaves the endpoints but is not restarted."""
    port = free_port()
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, http=_http(port)
    )
    await prepare_topics(settings, partitions=1)
    worker = Worker(settings)
    # Hold the shutdown at its final commit, so "while stopping" lasts until we look.
    gate, holding = asyncio.Event(), asyncio.Event()
    original = worker.commit

    async def held_commit(tps: Any = None) -> None:
        if worker.health.stopping:
            holding.set()
            await gate.wait()
        await original(tps)

    monkeypatch.setattr(worker, "commit", held_commit)
    task = asyncio.create_task(worker.run())
    try:
        await await_until(lambda: _get(port, "/readyz")[0] == 200, 60, message="never ready")
        worker.request_stop()
        await await_until(holding.is_set, 30, message="the shutdown never reached its commit")
        status, body = _json(port, "/readyz")
        assert status == 503 and body["stopping"] is True, body
        assert _get(port, "/healthz")[0] == 200
        assert not task.done()
    finally:
        gate.set()
        worker.request_stop()
        await asyncio.wait_for(task, 60)
