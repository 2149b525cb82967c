"""The outbox end to end on the session's broker and a real Redis: FINISH writes what a
handler emits with its effects, the worker's relay publishes it.

A handler emits two records per grant, keyed by user. Every grant's events arrive once,
each with its ``event-id`` header, in each user's order; a duplicate record emits nothing.
A relay killed between Kafka's acknowledgement and its mark (held there by a store that
never returns from ``mark_published``, then cancelled: no sleep decides it) leaves the
entries in the outbox, and the next holder of the lease publishes them again with the same
event ids. A handler emitting to a topic that does not exist keeps the worker from starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from pydantic import BaseModel
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.handlers.emissions import (
    EVENT_ID_HEADER,
    Emissions,
    InvalidEmission,
    event_id,
)
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox import producer as producer_module
from reliable_consumer.engine.outbox.producer import relay_producer
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import OutboxRelay
from reliable_consumer.engine.outbox.store import OutboxDepth, PendingEmission
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, Settings
from tests.helpers import await_until
from tests.integration.harness import make_settings, running_worker

from service import Context, handler

WAIT_S = 30.0


class Grant(BaseModel):
    grant_id: str
    user: str


def granting(emitted_topic: str) -> Handler[Grant]:
    @handler("grants", model=Grant, dedupe_key="grant_id", emits=(emitted_topic,))
    def grants(grant: Grant, ctx: Context) -> None:
        ctx.effects.xadd(ctx.redis_key("grants", "ledger"), {"grant": grant.grant_id})
        for step in ("granted", "notified"):
            ctx.emit(
                emitted_topic,
                {"grant": grant.grant_id, "step": step},
                key=grant.user,
                headers={"kind": step},
            )

    return grants


def settings_for(broker: Broker, redis_url: str, name: str) -> Settings:
    return make_settings(
        broker.bootstrap,
        redis_url,
        name,
        only_topics={"grants": name},
        outbox={"poll_interval_ms": 50, "lease_ms": 1000},
    )


async def make_topics(settings: Settings, emitted_topic: str) -> None:
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    source = settings.topics["grants"]
    await create_topics(
        settings.kafka.bootstrap_servers,
        {source: 2, settings.dead_letter_topic(source): 1, outcomes: 1, emitted_topic: 2},
    )


async def produce(settings: Settings, grants: Sequence[Grant]) -> None:
    producer = AIOKafkaProducer(acks="all", **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        for grant in grants:
            await producer.send_and_wait(
                settings.topics["grants"], grant.model_dump_json().encode(), key=grant.user.encode()
            )
    finally:
        await producer.stop()


Published = tuple[bytes | None, dict[str, bytes], dict[str, str]]  # key, headers, value


async def read_topic(settings: Settings, topic: str, count: int) -> list[Published]:
    """The first ``count`` records of ``topic`` (each partition in offset order), then a
    last look for any beyond them."""
    consumer = AIOKafkaConsumer(
        topic, auto_offset_reset="earliest", enable_auto_commit=False,
        **connection_kwargs(settings.kafka),
    )  # fmt: skip
    await consumer.start()
    out: list[Published] = []
    try:
        async with asyncio.timeout(WAIT_S):
            while len(out) < count:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    out.extend((r.key, dict(r.headers), json.loads(r.value)) for r in records)
        for records in (await consumer.getmany(timeout_ms=1000)).values():
            out.extend((r.key, dict(r.headers), json.loads(r.value)) for r in records)
    finally:
        await consumer.stop()
    return out


@pytest.mark.timeout(120)
async def test_every_grant_is_published_once_with_its_event_id_in_each_users_order(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = settings_for(kafka_broker, redis_server.url, unique_name)
    emitted_topic = f"{unique_name}.granted"
    await make_topics(settings, emitted_topic)
    grants = [Grant(grant_id=f"g{n}", user=f"u{n % 3}") for n in range(12)]
    registry = Registry([granting(emitted_topic)], settings.topics)
    async with running_worker(settings, registry=registry) as worker:
        await produce(settings, grants)
        published = await read_topic(settings, emitted_topic, 2 * len(grants))
        # A duplicate of a granted record: its effects are not applied again, nor its events.
        await produce(settings, grants[:1])
        await await_until(
            lambda: worker.metrics.records.labels("grants", "duplicate")._value.get() == 1,
            WAIT_S,
            message="the duplicate never finished",
        )
        assert worker.relay is not None
        # Apache Kafka grants a producer id: the relay's producer is the idempotent one
        # (Tansu, WORKER_TEST_BROKER=tansu, refuses it: plain acks=all).
        producer = worker._relay_producer
        assert producer is not None
        if isinstance(kafka_broker, ApacheKafkaCluster):
            assert producer._txn_manager is not None, (
                "the relay's producer is not idempotent on a broker that grants a producer id"
            )
            assert producer._txn_manager.has_pid()
        else:
            assert producer._txn_manager is None
        await await_until(
            lambda: worker.metrics.outbox_pending.labels("redis")._value.get() == 0, WAIT_S
        )
    again = await read_topic(settings, emitted_topic, 2 * len(grants))
    assert len(again) == 2 * len(grants), "a duplicate record emitted its events again"

    ids = [headers[EVENT_ID_HEADER].decode() for _, headers, _ in published]
    expected = {event_id("grants", g.grant_id, n) for g in grants for n in range(2)}
    assert Counter(ids) == Counter(expected), "an event missing, duplicated, or not a grant's"
    by_user: dict[bytes | None, list[tuple[str, str]]] = defaultdict(list)
    for key, headers, value in published:
        assert headers["kind"].decode() == value["step"]
        by_user[key].append((value["grant"], value["step"]))
    for user in ("u0", "u1", "u2"):
        mine = [g.grant_id for g in grants if g.user == user]
        in_order = [(g, step) for g in mine for step in ("granted", "notified")]
        assert by_user[user.encode()] == in_order, f"{user}'s events out of order"


class HeldAtMark:
    """A store whose ``mark_published`` never returns: the relay is stopped right there,
    after Kafka acknowledged, before anything is marked."""

    def __init__(self, store: RedisOutboxStore) -> None:
        self._store = store
        self.name = store.name
        self.reached = asyncio.Event()

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        return await self._store.pending(limit)

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        self.reached.set()
        await asyncio.Event().wait()

    async def depth(self) -> OutboxDepth:
        return await self._store.depth()


@pytest.mark.timeout(120)
async def test_a_relay_killed_between_ack_and_mark_republishes_the_same_event_ids(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = settings_for(kafka_broker, redis_server.url, unique_name)
    topic = f"{unique_name}.granted"
    await create_topics(settings.kafka.bootstrap_servers, {topic: 1})
    client = aioredis.from_url(redis_server.url)
    keys = RedisKeys(settings.redis.effective_prefix)
    store = RedisOutboxStore(client, keys)
    idem = Idempotency(RedisOps(client, settings.redis), keys, ttl_s=None, lease_ms=5000)
    box = Emissions("grants", frozenset({topic}), "g1")
    ids = [box.emit(topic, json.dumps({"grant": "g1", "step": s}), key="u1") for s in "ab"]
    await idem.finish(
        FinishRequest(idem.key("grants", "g1"), "T", "fp", "", [], emissions=box.emitted,
                      emitted_by="grants")
    )  # fmt: skip
    producer = await relay_producer(settings.kafka, "auto")
    await producer.start()
    stop = asyncio.Event()

    def relay_over(store: RedisOutboxStore | HeldAtMark) -> OutboxRelay:
        return OutboxRelay(
            [store], redis=client, keys=keys, producer=producer, settings=settings.outbox,
            metrics=Metrics(),
        )  # fmt: skip

    try:
        held = HeldAtMark(store)
        killed = asyncio.create_task(relay_over(held).run(stop))
        await asyncio.wait_for(held.reached.wait(), WAIT_S)
        killed.cancel()  # after Kafka's ack, before the mark (a SIGKILL is the chaos suite's)
        await asyncio.gather(killed, return_exceptions=True)
        assert len(await store.pending(10)) == 2, "marked although the relay was killed"
        successor = asyncio.create_task(relay_over(store).run(stop))
        try:
            await await_until(
                lambda: _empty(store), WAIT_S, message="the successor never marked them"
            )
        finally:
            stop.set()
            await asyncio.wait_for(successor, WAIT_S)
        copies = await read_topic(settings, topic, 4)
    finally:
        await producer.stop()
        await client.aclose()
    assert [h[EVENT_ID_HEADER].decode() for _, h, _ in copies] == ids + ids
    assert [v["step"] for _, _, v in copies] == ["a", "b", "a", "b"]


async def _empty(store: RedisOutboxStore) -> bool:
    return (await store.depth()).pending == 0


async def _limited_topic(settings: Settings, topic: str, max_message_bytes: int) -> None:
    """One partition taking record batches of ``max_message_bytes`` at most."""
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        configs = {"max.message.bytes": str(max_message_bytes)}
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
    finally:
        await admin.close()


LIMIT = 150_000  # the topic's max.message.bytes: a batch larger than this is refused


@pytest.mark.timeout(120)
async def test_an_entry_kafka_refuses_lets_no_later_entry_of_its_key_through(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """One key's entries: a small one, one too large for the topic, then one that fits.
    Kafka refuses the batch holding the first two; the third must not reach the topic
    before them, or a consumer would see the key's events out of order. Once the topic
    takes them, the three arrive in order."""
    if not isinstance(kafka_broker, ApacheKafkaCluster):  # never on CI: it requires Kafka
        pytest.skip("Tansu enforces no max.message.bytes (WORKER_TEST_BROKER=tansu)")
    settings = settings_for(kafka_broker, redis_server.url, unique_name)
    topic = f"{unique_name}.granted"
    await _limited_topic(settings, topic, LIMIT)
    client = aioredis.from_url(redis_server.url)
    keys = RedisKeys(settings.redis.effective_prefix)
    store = RedisOutboxStore(client, keys)
    idem = Idempotency(RedisOps(client, settings.redis), keys, ttl_s=None, lease_ms=5000)
    box = Emissions("grants", frozenset({topic}), "g1")
    for step, size in (("a", 0), ("b", LIMIT + 50_000), ("c", LIMIT - 50_000)):
        box.emit(topic, {"step": step, "pad": "x" * size}, key="u1")
    await idem.finish(
        FinishRequest(idem.key("grants", "g1"), "T", "fp", "", [], emissions=box.emitted,
                      emitted_by="grants")
    )  # fmt: skip
    producer = await relay_producer(settings.kafka, "auto")
    await producer.start()
    relay = OutboxRelay(
        [store], redis=client, keys=keys, producer=producer, settings=settings.outbox,
        metrics=Metrics(),
    )  # fmt: skip
    try:
        for _ in range(2):  # the round fails, and so does the one retrying it
            with pytest.raises(KafkaError):
                await relay.publish_round(store)
        await producer.flush()  # whatever the producer still held has been answered
        assert len(await store.pending(10)) == 3, "an entry was marked after a refused one"
        assert await _end_offset(settings, topic) == 0, "a later entry of its key got through"
        await _alter_topic(settings, topic, {"max.message.bytes": str(4 * LIMIT)})
        await await_until(lambda: _published_all(relay, store), WAIT_S)
    finally:
        await producer.stop()
        await client.aclose()
    copies = await read_topic(settings, topic, 3)
    assert [v["step"] for _, _, v in copies] == ["a", "b", "c"]


async def _end_offset(settings: Settings, topic: str) -> int:
    consumer = AIOKafkaConsumer(**connection_kwargs(settings.kafka))
    await consumer.start()
    try:
        return int(
            (await consumer.end_offsets([TopicPartition(topic, 0)]))[TopicPartition(topic, 0)]
        )
    finally:
        await consumer.stop()


async def _alter_topic(settings: Settings, topic: str, configs: dict[str, str]) -> None:
    admin = AIOKafkaAdminClient(**connection_kwargs(settings.kafka))
    await admin.start()
    try:
        await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, topic, configs)])
    finally:
        await admin.close()


async def _published_all(relay: OutboxRelay, store: RedisOutboxStore) -> bool:
    """Rounds until the store is empty or one fails (the topic's new limit not yet in
    force): whether the store is empty."""
    with contextlib.suppress(KafkaError):
        while await relay.publish_round(store):
            pass
    return (await store.depth()).pending == 0


SMALL_LIMIT = 20_000  # far below the relay producer's 256 KiB batches


def _largest_value_emit_allows(topic: str, limit: int) -> int:
    """The longest value ``ctx.emit`` takes for ``topic`` (key 'u1', no headers of its own)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        try:
            Emissions("grants", frozenset({topic}), "probe", {topic: limit}).emit(
                topic, b"x" * middle, key="u1"
            )
            low = middle
        except InvalidEmission:
            high = middle - 1
    return low


@pytest.mark.timeout(120)
async def test_the_relay_publishes_to_a_topic_taking_less_than_its_producers_batch(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    """A topic with max.message.bytes 20,000: the relay's round of 40 small entries of one key
    used to go as one 60 KB batch, refused whole, round after round (the outbox stalled).
    Built to the topic's limit, the batches are taken, in order; and the largest record
    ``ctx.emit`` accepts for the topic is one Kafka takes (one byte more is refused at emit)."""
    if not isinstance(kafka_broker, ApacheKafkaCluster):  # never on CI: it requires Kafka
        pytest.skip("Tansu enforces no max.message.bytes (WORKER_TEST_BROKER=tansu)")
    settings = settings_for(kafka_broker, redis_server.url, unique_name)
    topic = f"{unique_name}.granted"
    await _limited_topic(settings, topic, SMALL_LIMIT)
    largest = _largest_value_emit_allows(topic, SMALL_LIMIT)
    with pytest.raises(InvalidEmission, match=f"max.message.bytes is {SMALL_LIMIT}"):
        Emissions("grants", frozenset({topic}), "probe", {topic: SMALL_LIMIT}).emit(
            topic, b"x" * (largest + 1), key="u1"
        )
    client = aioredis.from_url(redis_server.url)
    keys = RedisKeys(settings.redis.effective_prefix)
    store = RedisOutboxStore(client, keys)
    idem = Idempotency(RedisOps(client, settings.redis), keys, ttl_s=None, lease_ms=5000)
    values = [json.dumps({"n": n, "pad": "x" * 1_500}).encode() for n in range(40)]
    values.append(b'"' + b"x" * (largest - 2) + b'"')  # JSON, as read_topic decodes
    # The small ones from one record, the largest as another record's first event (its
    # event id as long as the probe's).
    boxes = {d: Emissions("grants", frozenset({topic}), d, {topic: SMALL_LIMIT}) for d in "AB"}
    for value in values[:-1]:
        boxes["A"].emit(topic, value, key="u1")
    boxes["B"].emit(topic, values[-1], key="u1")
    for dedupe_key, box in boxes.items():
        await idem.finish(
            FinishRequest(idem.key("grants", dedupe_key), "T", "fp", "", [],
                          emissions=box.emitted, emitted_by="grants")
        )  # fmt: skip
    producer = await relay_producer(settings.kafka, "auto")
    await producer.start()
    relay = OutboxRelay(
        [store], redis=client, keys=keys, producer=producer, settings=settings.outbox,
        metrics=Metrics(), max_message_bytes={topic: SMALL_LIMIT},
    )  # fmt: skip
    try:
        while await relay.publish_round(store):
            pass
        assert (await store.depth()).pending == 0
    finally:
        await producer.stop()
        await client.aclose()
    copies = await read_topic(settings, topic, len(values))
    assert [v for _, _, v in copies] == [json.loads(v) for v in values]


@pytest.mark.timeout(60)
async def test_a_handler_emitting_to_a_missing_topic_keeps_the_worker_from_starting(
    kafka_broker: Broker, redis_server: RedisServer, unique_name: str
) -> None:
    settings = settings_for(kafka_broker, redis_server.url, unique_name)
    missing = f"{unique_name}.nowhere"
    await make_topics(settings, f"{unique_name}.granted")
    registry = Registry([granting(missing)], settings.topics)
    with pytest.raises(ConfigurationError, match=rf"topic '{missing}'.*handler 'grants'"):
        async with running_worker(settings, registry=registry):
            pass


@pytest.mark.timeout(60)
async def test_idempotence_auto_falls_back_on_a_broker_refusing_producer_ids_and_on_refuses(
    tansu_broker: TansuBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Tansu answers InitProducerId with an error: ``auto`` publishes with plain acks=all,
    saying why in one line, and ``on`` refuses to start, naming the setting."""
    kafka = KafkaSettings(bootstrap_servers=tansu_broker.bootstrap)
    with caplog.at_level(logging.WARNING, logger=producer_module.__name__):
        producer = await relay_producer(kafka, "auto")
    try:
        assert producer._txn_manager is None, "idempotent on a broker that refuses it"
        async with asyncio.timeout(WAIT_S):  # the idempotent one would never finish start()
            await producer.start()
    finally:
        await producer.stop()
    lines = [r.getMessage() for r in caplog.records if r.name == producer_module.__name__]
    assert len(lines) == 1 and "InitProducerId" in lines[0], lines
    with pytest.raises(ConfigurationError, match=r"WORKER_OUTBOX__IDEMPOTENCE=on.*InitProducerId"):
        await relay_producer(kafka, "on")
