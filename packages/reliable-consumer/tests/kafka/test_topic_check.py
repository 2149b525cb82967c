"""The start-up topic durability check against real DescribeConfigs (Tansu reports none)."""

from __future__ import annotations

import re

import pytest
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.topic_check import check_topic_durability, describe
from tests.integration.harness import make_settings
from tests.kafka.support import create_run_topics


async def test_topic_check_refuses_replication_factor_1_and_min_isr_1_under_require(
    kafka1: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka1.bootstrap_servers, redis_url, unique_name, topic_durability="require"
    )
    await create_run_topics(kafka1, settings)
    facts = await describe(settings, {settings.dead_letter_topic(unique_name): "dead-letter"})
    assert [(f.replication_factor, f.min_insync_replicas, f.error) for f in facts] == [(1, 1, None)]
    with pytest.raises(
        ConfigurationError, match=re.escape("replication factor 1 and min.insync.replicas=1")
    ):
        await check_topic_durability(settings)


async def test_topic_check_accepts_replication_factor_3_and_min_isr_2(
    kafka3: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka3.bootstrap_servers, redis_url, unique_name, topic_durability="require"
    )
    await create_run_topics(kafka3, settings)
    facts = await describe(settings, {settings.dead_letter_topic(unique_name): "dead-letter"})
    assert [(f.replication_factor, f.min_insync_replicas, f.error) for f in facts] == [(3, 2, None)]
    assert (await check_topic_durability(settings)).warnings == []
