"""What the Apache Kafka tests share: topics for a run's settings, on a given cluster."""

from __future__ import annotations

from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.settings import Settings
from tests.integration.harness import emitted_by_bound


async def create_run_topics(
    cluster: ApacheKafkaCluster, settings: Settings, partitions: int = 3
) -> None:
    """The bound topic, its dead-letter topic, the outcomes topic and the topics its handler
    emits to (the worker refuses to start without them), replicated on every node."""
    topic = settings.topics["payments"]
    topics = {topic: partitions, settings.dead_letter_topic(topic): 1}
    outcomes = settings.outcomes_topic()
    if outcomes:
        topics[outcomes] = 1
    for emitted in emitted_by_bound(settings):
        topics.setdefault(emitted, partitions)
    await cluster.create_topics(topics)
