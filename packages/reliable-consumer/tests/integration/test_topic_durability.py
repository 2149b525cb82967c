"""The dead-letter, outcome and emitted topics' durability is checked at start."""

from __future__ import annotations

import logging

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.worker import Worker
from tests.integration.harness import (
    emitted_by_bound,
    make_settings,
    prepare_topics,
    running_worker,
)

pytestmark = pytest.mark.timeout(120)


async def test_production_mode_refuses_to_start_on_a_dead_letter_topic_with_one_replica(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """The dev broker has one replica and no min.insync.replicas: an ack is the leader's."""
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, topic_durability="require"
    )
    await prepare_topics(settings, partitions=1)
    worker = Worker(settings)
    with pytest.raises(ConfigurationError) as refused:
        await worker.run()
    message = str(refused.value)
    assert f"dead-letter topic '{unique_name}.dlq'" in message
    assert f"outcomes topic '{unique_name}-g.outcomes'" in message
    for emitted in emitted_by_bound(settings):  # the relay deletes what they acknowledge
        assert f"emitted topic '{emitted}'" in message
    assert "replication factor 1" in message
    assert "WORKER_TOPIC_DURABILITY" in message and "WORKER_TOPIC_MIN_INSYNC_REPLICAS" in message
    assert not worker.health.started


async def test_auto_mode_requires_durable_topics_when_redis_durability_is_not_local(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap,
        redis_server.url,
        unique_name,
        redis={"durability": "wait_aof"},
    )
    await prepare_topics(settings, partitions=1)
    with pytest.raises(ConfigurationError, match=r"WORKER_REDIS__DURABILITY=wait_aof"):
        await Worker(settings).run()


async def test_auto_mode_only_warns_with_local_redis_durability(
    kafka_broker: Broker,
    redis_server: RedisServer,
    unique_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_server.url, unique_name)
    await prepare_topics(settings, partitions=1)
    with caplog.at_level(logging.WARNING, logger="reliable_consumer.engine.worker"):
        async with running_worker(settings) as worker:
            assert worker.health.started
    warned = [r.getMessage() for r in caplog.records if "topic durability" in r.getMessage()]
    assert any(f"'{unique_name}.dlq'" in w for w in warned), warned
    emitted = emitted_by_bound(settings)
    assert emitted and all(any(f"emitted topic '{e}'" in w for w in warned) for e in emitted)


async def test_a_missing_dead_letter_topic_is_reported_and_not_created_by_the_check(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap, redis_server.url, unique_name, topic_durability="require"
    )
    await create_topics(settings.kafka.bootstrap_servers, {unique_name: 1})  # no .dlq
    with pytest.raises(ConfigurationError, match=rf"'{unique_name}.dlq' does not exist"):
        await Worker(settings).run()
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        assert f"{unique_name}.dlq" not in await admin.list_topics()
    finally:
        await admin.close()
