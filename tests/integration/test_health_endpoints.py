"""Liveness, readiness and metrics over HTTP, as an orchestrator and Prometheus see them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from service import sample
from service.devstack import KafkaBroker, RedisServer, free_port
from tests.helpers import await_until
from tests.integration.harness import (
    make_settings,
    prepare_topics,
    produce,
    running_worker,
    wait_settled,
)

pytestmark = pytest.mark.timeout(150)


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def test_readiness_follows_assignment_and_redis_and_metrics_show_partitions(
    kafka_broker: KafkaBroker, redis_server: RedisServer, unique_name: str
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
