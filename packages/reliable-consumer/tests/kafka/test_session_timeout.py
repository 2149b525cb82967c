"""A session timeout the broker refuses (outside group.min/max.session.timeout.ms).

Apache Kafka refuses the JoinGroup with INVALID_SESSION_TIMEOUT; aiokafka logs it and
retries every second, so the worker used to run forever, "started", with no partitions
and nothing said. Now the start refuses, naming the setting and the broker's range; and if
the join is still refused at run time (configs unreadable, range changed), it is a stall.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine import worker as worker_module
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.worker import Worker
from tests.helpers import await_until
from tests.integration.harness import make_settings, running_worker
from tests.kafka.support import create_run_topics

GROUP_JOIN_REFUSED = "group_join_refused"


@pytest.fixture
def apache_kafka(
    kafka_broker: Broker, request: pytest.FixtureRequest
) -> Iterator[ApacheKafkaCluster]:
    """The session broker, when it is Apache Kafka (Tansu enforces no session range)."""
    if not isinstance(kafka_broker, ApacheKafkaCluster):
        request.getfixturevalue("kafka_available")  # fails on CI, skips elsewhere, saying why
        pytest.skip("the session broker is not Apache Kafka (WORKER_TEST_BROKER=tansu)")
    yield kafka_broker


async def test_session_timeout_below_broker_minimum_refuses_to_start(
    apache_kafka: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        apache_kafka.bootstrap_servers, redis_url, unique_name, kafka={"session_timeout_ms": 5000}
    )
    await create_run_topics(apache_kafka, settings)
    worker = Worker(settings)
    with pytest.raises(ConfigurationError) as refused:
        # Before the fix this ran forever: started, no partitions, nothing said.
        await asyncio.wait_for(worker.run(), 60)
    message = str(refused.value)
    assert "WORKER_KAFKA__SESSION_TIMEOUT_MS=5000" in message, message
    assert re.search(r"6000\D+1800000", message), message
    assert not worker.health.started


async def test_session_timeout_above_broker_maximum_refuses_to_start(
    apache_kafka: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        apache_kafka.bootstrap_servers,
        redis_url,
        unique_name,
        kafka={"session_timeout_ms": 1_800_001, "max_poll_interval_ms": 1_800_001},
    )
    await create_run_topics(apache_kafka, settings)
    with pytest.raises(ConfigurationError, match="WORKER_KAFKA__SESSION_TIMEOUT_MS=1800001"):
        await asyncio.wait_for(Worker(settings).run(), 60)


async def test_group_join_refused_at_run_time_is_reported_as_a_stall(
    apache_kafka: ApacheKafkaCluster,
    redis_url: str,
    unique_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The start check could not tell (configs unreadable, as on Tansu or without the
    # DescribeConfigs ACL): the broker still refuses the join, and the worker must say so.
    async def unreadable(_settings: object) -> None:
        return None

    monkeypatch.setattr(worker_module, "check_session_timeout", unreadable, raising=False)
    settings = make_settings(
        apache_kafka.bootstrap_servers, redis_url, unique_name, kafka={"session_timeout_ms": 5000}
    )
    await create_run_topics(apache_kafka, settings)
    async with running_worker(settings) as worker:
        stall = await await_until(
            lambda: worker.stalls.active().get(GROUP_JOIN_REFUSED),
            30,
            message=lambda: f"no {GROUP_JOIN_REFUSED} stall: {worker.stalls.active()}",
        )
        detail = stall.detail if stall is not None else ""
        assert "WORKER_KAFKA__SESSION_TIMEOUT_MS=5000" in detail, detail
        assert "InvalidSessionTimeout" in detail, detail
        ready, body = worker.health.ready()
        assert not ready and GROUP_JOIN_REFUSED in body["stalled"], body
        gauge = worker.metrics.registry.get_sample_value(
            "worker_stalled", {"cause": GROUP_JOIN_REFUSED}
        )
        assert gauge == 1, gauge
