"""A record that breaks processing itself (not its handler) must not stall its partition."""

from __future__ import annotations

from typing import Any

import pytest
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.ops import audit
from tests.helpers import await_until
from tests.integration.harness import make_settings, prepare_topics, produce, running_worker

from service import sample

pytestmark = pytest.mark.timeout(120)


async def test_a_record_that_breaks_processing_is_isolated_and_dead_lettered(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    await prepare_topics(settings, partitions=1)
    records = sample.generate(60, sample.Mix(transient=0, permanent=0, malformed=0))
    poison = records[17]
    assert poison.payment_id is not None

    async with running_worker(settings) as worker:
        prepare = worker.processor.decisions.prepare

        def broken_prepare(delivery: Any) -> Any:
            # Stands for a bug in our own code path, triggered by one record's content.
            if delivery.key == poison.key:
                raise RuntimeError("simulated bug in the worker")
            return prepare(delivery)

        worker.processor.decisions.prepare = broken_prepare  # type: ignore[method-assign]
        await produce(settings, records)

        async def settled() -> bool:
            offsets = await audit.group_offsets(
                settings.kafka, settings.kafka.group_id, settings.topics["payments"]
            )
            return all(p.committed == p.high_watermark for p in offsets)

        await await_until(settled, 90, interval=0.3, message="the partition stalled")

    grants = await audit.ledger_grants(redis_url, settings.redis.effective_prefix)
    expected = {r.payment_id for r in records if r is not poison}
    assert set(grants) == expected and set(grants.values()) == {1}
    dead = await audit.read_all(settings.kafka, settings.dead_letter_topic(unique_name))
    assert [audit.header(r, "x-dlq-reason") for r in dead] == ["internal"]
    assert dead[0].key == poison.key and dead[0].value == poison.value
    assert "simulated bug" in (audit.header(dead[0], "x-dlq-error") or "")
