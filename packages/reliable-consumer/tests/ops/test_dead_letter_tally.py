"""The console's dead-letter counts: each refresh reads only what arrived since the last."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.ops import dead_letters
from reliable_consumer.ops.dead_letters import DeadLetterTally
from tests.integration.harness import make_settings, prepare_topics


async def _dead_letter(settings: Any, reason: str) -> None:
    producer = AIOKafkaProducer(**connection_kwargs(settings.kafka))
    await producer.start()
    try:
        topic = settings.dead_letter_topic(settings.topics["payments"])
        headers = [("x-dlq-reason", reason.encode()), ("x-dlq-dedupe-key", b"p")]
        await producer.send_and_wait(topic, key=b"k", value=b"{}", headers=headers)
    finally:
        await producer.stop()


async def test_the_tally_counts_by_reason_and_rereads_nothing(
    kafka_broker: Broker, redis_url: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    await prepare_topics(settings, partitions=1)
    source = settings.topics["payments"]
    read: list[int] = []
    real_read_from = dead_letters.read_from

    async def counting_read_from(*args: Any, **kwargs: Any) -> Any:
        records, ends = await real_read_from(*args, **kwargs)
        read.append(len(records))
        return records, ends

    monkeypatch.setattr(dead_letters, "read_from", counting_read_from)
    tally = DeadLetterTally()
    assert await tally.counts(settings, source) == {}
    await _dead_letter(settings, "permanent")
    await _dead_letter(settings, "permanent")
    assert await tally.counts(settings, source) == {"permanent": 2}
    await _dead_letter(settings, "exhausted")
    assert await tally.counts(settings, source) == {"permanent": 2, "exhausted": 1}
    assert await tally.counts(settings, source) == {"permanent": 2, "exhausted": 1}
    assert read == [0, 2, 1, 0], "each call reads only the dead letters that arrived since"
