"""Per-key order on a real broker: records sharing a Kafka key run one after another, in
offset order, within a batch (jobs.key_waves) and across batches of a partition (the
key-overlap wait in Intake._dispatch), while records and batches of other keys run at
the same time.

The handler below is a claiming `async def` handler that logs when each record starts
and ends (one global sequence), and holds until the test lets it go: so a test sees
which records ran together and can hold one batch open while the next ones arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.batch.processing import open_processor
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.settings import Settings
from tests.helpers import await_until
from tests.integration.harness import make_settings, running_worker

from service import Context, handler

WIDTH = 3  # keys A, B, C: each wave of a batch holds one record of each
MEET_S = 2.0  # how long a record waits for the others of its wave before going on alone
WAIT_S = 10.0  # deadline of each wait for a record to start or end
HOLD_S = 3 * WAIT_S  # the handler timeout: longer than any wait


class Item(BaseModel):
    id: str
    key: str


@dataclass
class Probe:
    """What the handler saw: start/end events in one sequence, and gates to hold records."""

    events: list[tuple[str, str]] = field(default_factory=list)  # ("start"|"end", id)
    running: set[str] = field(default_factory=set)
    most_at_once: int = 0
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    meet: int = 1  # a record without a gate waits (MEET_S at most) until this many run
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def position(self, kind: str, item_id: str) -> int:
        return self.events.index((kind, item_id))

    def started(self, item_id: str) -> bool:
        return ("start", item_id) in self.events

    def ended(self, item_id: str) -> bool:
        return ("end", item_id) in self.events

    async def run(self, item: Item) -> None:
        self.events.append(("start", item.id))
        self.running.add(item.id)
        self.most_at_once = max(self.most_at_once, len(self.running))
        self.changed.set()
        try:
            gate = self.gates.get(item.id)
            if gate is not None:
                await gate.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._met(), MEET_S)
        finally:
            self.running.discard(item.id)
            self.events.append(("end", item.id))
            self.changed.set()

    async def _met(self) -> None:
        while len(self.running) < self.meet:
            self.changed.clear()
            await self.changed.wait()


def ordered_handler(probe: Probe) -> Handler[Item]:
    @handler("ordered", model=Item, dedupe_key="id")
    async def run(item: Item, ctx: Context) -> None:
        await probe.run(item)

    return run


def settings_for(bootstrap: str, redis_url: str, name: str, **overrides: Any) -> Settings:
    # A held record must outlast every wait of a test, not time out and let the next one in.
    settings = make_settings(
        bootstrap,
        redis_url,
        name,
        handler_timeout_s=HOLD_S,
        idempotency={"lease_ms": int(HOLD_S * 1000) + 5_000},
        retry={"lease_ms": int(HOLD_S * 1000) + 5_000},
        **overrides,
    )
    # make_settings merges dicts into its defaults; the test handler is the only binding.
    return settings.model_copy(update={"topics": {"ordered": name}})


async def make_topics(settings: Settings) -> None:
    topic = settings.topics["ordered"]
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await create_topics(
        settings.kafka.bootstrap_servers,
        {topic: 1, settings.dead_letter_topic(topic): 1, outcomes: 1},
    )


def value(item_id: str, key: str) -> bytes:
    return json.dumps({"id": item_id, "key": key}).encode()


async def produce(settings: Settings, items: list[tuple[str, str | None]]) -> None:
    """(id, Kafka key) pairs to partition 0, acknowledged, in this order."""
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        topic = settings.topics["ordered"]
        for item_id, key in items:
            await producer.send_and_wait(
                topic,
                key=key.encode() if key is not None else None,
                value=value(item_id, key or ""),
                partition=0,
            )
    finally:
        await producer.stop()


async def fetch_all(settings: Settings, count: int) -> list[Delivery]:
    """The topic's first `count` records, read back from the broker as deliveries."""
    topic = settings.topics["ordered"]
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **connection_kwargs(settings.kafka))
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        records: list[Any] = []

        async def read() -> bool:
            batch = await consumer.getmany(tp, timeout_ms=200)
            records.extend(batch.get(tp, []))
            return len(records) >= count

        await await_until(read, 20, interval=0.0, message="records never came back")
    finally:
        await consumer.stop()
    return [
        Delivery(r.topic, r.partition, r.offset, r.key, r.value, (), r.timestamp)
        for r in records[:count]
    ]


def assert_key_order(probe: Probe, by_key: dict[str, list[str]]) -> None:
    """Each key's records ran one at a time, in offset order."""
    for key, ids in by_key.items():
        for earlier, later in itertools.pairwise(ids):
            assert probe.position("end", earlier) < probe.position("start", later), (
                f"key {key}: {later} started before {earlier} ended: {probe.events}"
            )


async def test_records_sharing_a_key_run_in_offset_order_within_a_batch(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """One fetched batch with keys A B C A B C A B C: three waves, each one of every key."""
    settings = settings_for(kafka_broker.bootstrap, redis_server.url, unique_name)
    await make_topics(settings)
    items = [(f"{key}{n}", key) for n in range(WIDTH) for key in "ABC"]
    await produce(settings, list(items))
    deliveries = await fetch_all(settings, len(items))
    assert [d.key for d in deliveries] == [k.encode() for _, k in items]

    probe = Probe(meet=WIDTH)
    registry = Registry([ordered_handler(probe)], settings.topics)
    async with open_processor(settings, registry) as processor:
        outcomes = await processor.process_batch(deliveries)

    assert outcomes == [Outcome.SUCCEEDED] * len(items)
    by_key: dict[str, list[str]] = defaultdict(list)
    for item_id, key in items:
        by_key[key].append(item_id)
    assert_key_order(probe, by_key)
    # Records of different keys did run together: a wave is the batch's width, not one.
    assert probe.most_at_once == WIDTH, probe.events


@contextlib.contextmanager
def released(probe: Probe) -> Iterator[None]:
    """Open every gate on the way out, so a failing test leaves no handler waiting."""
    try:
        yield
    finally:
        for gate in probe.gates.values():
            gate.set()


async def test_a_batch_waits_for_an_earlier_batch_of_the_same_key_but_not_for_others(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """Batches of one record: A1 is held; A2 (same key) must wait for it, C3 must not."""
    settings = settings_for(
        kafka_broker.bootstrap, redis_server.url, unique_name, max_batch_records=1
    )
    await make_topics(settings)
    probe = Probe(gates={"A1": asyncio.Event()})
    registry = Registry([ordered_handler(probe)], settings.topics)
    async with running_worker(settings, registry=registry):
        with released(probe):
            await produce(settings, [("A1", "A")])
            await await_until(lambda: probe.started("A1"), 3 * WAIT_S, message="A1 never started")
            # A2 before C3 on the same partition: A2's batch is dispatched first.
            await produce(settings, [("A2", "A"), ("C3", "C")])
            await await_until(
                lambda: probe.ended("C3"),
                WAIT_S,
                message=lambda: f"C3 (another key) waited for A1: {probe.events}",
            )
            assert not probe.ended("A1"), f"A1 was not held: {probe.events}"
            assert not probe.started("A2"), f"A2 ran beside A1 (same key): {probe.events}"
            probe.gates["A1"].set()
            await await_until(lambda: probe.ended("A2"), WAIT_S, message="A2 never ran")
            assert_key_order(probe, {"A": ["A1", "A2"]})

            await await_until(
                functools.partial(committed_is, settings, 3),
                WAIT_S,
                message="the three offsets were never committed",
            )


async def committed_is(settings: Settings, want: int) -> bool:
    """The group's committed offset of partition 0, read by a consumer outside the group."""
    consumer = AIOKafkaConsumer(
        group_id=settings.kafka.group_id,
        enable_auto_commit=False,
        **connection_kwargs(settings.kafka),
    )
    await consumer.start()
    try:
        tp = TopicPartition(settings.topics["ordered"], 0)
        committed: int | None = await consumer.committed(tp)
        return committed == want
    finally:
        await consumer.stop()
