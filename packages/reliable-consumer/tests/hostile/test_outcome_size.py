"""A record's outcome document must always fit the outcomes topic, and no record's outcome
may hold another partition's.

The defect, as an outside review saw it on Apache Kafka 4.4: a record whose dedupe key was
about 1 MiB (a handler with an unbounded string key; the engine accepts any length) made an
outcome document the outcomes topic refused (``MessageSizeTooLargeError``), an
``outcomes_unwritable`` stall retried forever; and because the outcome writes of concurrent
batches were merged into one, a second partition's records never committed either
(committed 0/1 and 0/5). Now a long key is written as its digest, flagged, and a refused
document holds its own batch only.

A real worker on the session's broker; the outcomes and dead-letter topics keep the
broker's default limits (1 MiB), the source topic takes the large record.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.publisher import TOPIC_LIMIT_ROOM
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops import audit, trace
from tests.helpers import await_until
from tests.hostile import corpus
from tests.integration.harness import (
    LARGE_RECORDS,
    create_topics_with_configs,
    make_settings,
    prepare_topics,
    running_worker,
)

from service import Context, handler

pytestmark = pytest.mark.integration

MIB = 1 << 20
DEADLINE_S = 60.0


class Note(BaseModel):
    """A notification whose id may be of any length: nothing bounds it."""

    note_id: str


# Named "payments", and granting into the payments example's ledger stream, so the
# harness's observers read it.
@handler("payments", model=Note, dedupe_key="note_id", writes=("ledger",))
def unbounded_key(note: Note, ctx: Context) -> None:
    ctx.effects.xadd(ctx.redis_key("ledger", "purchases"), {"payment_id": note.note_id})


def registry_for(settings: Settings) -> Registry:
    return Registry([unbounded_key], settings.topics)


async def produce(settings: Settings, records: list[tuple[int, str]]) -> dict[str, int]:
    """Each (partition, note id) as one record; the offset of each id."""
    topic = settings.topics["payments"]
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        return {
            note_id: await corpus.produce_exact(
                producer, topic, partition, b"k", json.dumps({"note_id": note_id}).encode()
            )
            for partition, note_id in records
        }
    finally:
        await producer.stop()


async def committed_to_the_end(settings: Settings) -> list[audit.PartitionOffsets]:
    """Wait until every partition of the source topic is committed to its high watermark."""
    topic = settings.topics["payments"]
    seen: list[audit.PartitionOffsets] = []

    async def done() -> bool:
        seen[:] = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
        return bool(seen) and all(p.committed == p.high_watermark for p in seen)

    def stalled() -> str:
        return "not committed: " + ", ".join(
            f"partition {p.partition} {p.committed}/{p.high_watermark}" for p in seen
        )

    await await_until(done, DEADLINE_S, interval=0.2, message=stalled)
    return seen


async def test_a_1_mib_dedupe_key_stalls_no_partition_and_its_event_carries_its_digest(
    kafka_broker: Broker, redis_url: str, unique_name: str
) -> None:
    settings = make_settings(
        kafka_broker.bootstrap, redis_url, unique_name, max_record_bytes=4 * MIB
    )
    await prepare_topics(settings, partitions=2, source_configs=LARGE_RECORDS)
    long_key = "K" * MIB
    ordinary = [f"{unique_name}-{i}" for i in range(7)]
    offsets = await produce(
        settings,
        [(0, long_key), (0, ordinary[0]), (0, ordinary[1])] + [(1, k) for k in ordinary[2:]],
    )
    async with running_worker(settings, registry=registry_for(settings)):
        committed = await committed_to_the_end(settings)
    assert {p.partition: p.high_watermark for p in committed} == {0: 3, 1: 5}

    grants = await audit.ledger_grants(redis_url, settings.redis.effective_prefix)
    assert grants[long_key] == 1 and all(grants[k] == 1 for k in ordinary)
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    records = await audit.read_all(settings.kafka, outcomes)
    events: dict[tuple[int, int], dict[str, Any]] = {
        (e["partition"], e["offset"]): e for e in audit.outcome_events(records)
    }
    mine = events[(0, offsets[long_key])]
    assert mine["event"] == "succeeded"
    assert mine["dedupe_key"] == long_keys.digest(long_key)
    assert mine["dedupe_key_digested"] is True
    for key in ordinary:
        partition = 0 if key in ordinary[:2] else 1
        event = events[(partition, offsets[key])]
        assert (event["event"], event["dedupe_key"], event["dedupe_key_digested"]) == (
            "succeeded",
            key,
            False,
        )
    assert max(len(r.value) for r in records) < 64 * 1024

    # `service trace` finds the key's events by the key, and by the digest events show.
    traced = await trace.trace(settings, registry_for(settings), long_key)
    (handler_trace,) = traced.handlers
    assert handler_trace.state == "done"
    assert [(e["offset"], e["dedupe_key_digested"]) for e in handler_trace.events] == [
        (offsets[long_key], True)
    ]
    by_digest = await trace.outcome_events(settings, long_keys.digest(long_key))
    assert by_digest == list(handler_trace.events)
    # ... and the whole trace by the digest (what an operator copies from an event, the
    # key itself being a megabyte): the marker is found under its hashed Redis name.
    (digest_trace,) = (
        await trace.trace(settings, registry_for(settings), long_keys.digest(long_key))
    ).handlers
    assert (digest_trace.marker.state, digest_trace.state) == ("done", "done")
    assert list(digest_trace.events) == list(handler_trace.events)


async def test_outcome_documents_are_cut_to_the_limit_the_outcomes_topic_has_at_start(
    kafka_broker: Broker, redis_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An outcomes topic that takes 64 KiB: the start-up check reads its max.message.bytes,
    so a batch's ~180 KB of events goes as documents under it, none refused on the way."""
    settings = make_settings(kafka_broker.bootstrap, redis_url, unique_name)
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    limit = 64 * 1024
    await create_topics_with_configs(
        settings.kafka.bootstrap_servers, {outcomes: 1}, {"max.message.bytes": str(limit)}
    )
    await prepare_topics(settings, partitions=1)  # the outcomes topic is left as it is
    keys = [f"{i:03d}-" + "n" * 250 for i in range(500)]  # under the bound: written whole
    producer = AIOKafkaProducer(acks="all", linger_ms=20, **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        sends = [
            await producer.send(settings.topics["payments"], json.dumps({"note_id": k}).encode())
            for k in keys
        ]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()
    async with running_worker(settings, registry=registry_for(settings)) as worker:
        assert worker.processor is not None
        assert worker.processor.parts.publisher.document_bytes == limit - TOPIC_LIMIT_ROOM
        await committed_to_the_end(settings)
    records = await audit.read_all(settings.kafka, outcomes)
    assert sorted(e["dedupe_key"] for e in audit.outcome_events(records)) == keys
    assert all(len(r.value) <= limit - TOPIC_LIMIT_ROOM for r in records)
    assert not [r for r in caplog.records if "too large for the outcomes topic" in r.message]
