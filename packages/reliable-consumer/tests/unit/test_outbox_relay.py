"""The outbox relay on fakeredis with a producer standing in for Kafka (engine/outbox/relay.py).

What the relay decides on its own: entries are sent oldest first and marked only after
every acknowledgement; one relay per store holds the lease and a relay that loses it stops
publishing; failures are retried and, past the threshold, are the outbox_relay_failing
stall until a round succeeds. The real broker's side is tests/integration/test_outbox.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import fakeredis
import pytest
from aiokafka.errors import KafkaConnectionError
from pydantic import ValidationError
from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER, Emissions
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import STALL, OutboxRelay
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import OutboxSettings, RedisSettings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.ops.trace import emitted_for
from tests.helpers import await_until

PREFIX = "rl"
TOPIC = "purchase.granted"


@dataclass(frozen=True)
class Placed:
    partition: int
    offset: int


@dataclass
class Producer:
    """Kafka as the relay sees it: ``send`` queues, its future is the acknowledgement."""

    sent: list[tuple[str, bytes, bytes | None, list[tuple[str, bytes]]]] = field(
        default_factory=list
    )
    failing: bool = False

    async def send(
        self,
        topic: str,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> asyncio.Future[Placed]:
        acked: asyncio.Future[Placed] = asyncio.get_running_loop().create_future()
        if self.failing:
            acked.set_exception(KafkaConnectionError("broker away"))
        else:
            self.sent.append((topic, value, key, list(headers or [])))
            acked.set_result(Placed(0, len(self.sent) - 1))
        return acked


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    store: RedisOutboxStore
    metrics: Metrics
    stalls: Stalls

    def relay(self, producer: Producer, **settings: int) -> OutboxRelay:
        values = {"poll_interval_ms": 20, "lease_ms": 1000, "stall_after_failures": 2}
        return OutboxRelay(
            [self.store],
            redis=self.redis,
            keys=self.keys,
            producer=producer,  # type: ignore[arg-type]
            settings=OutboxSettings(**{**values, **settings}),
            metrics=self.metrics,
            stalls=self.stalls,
        )

    async def grant(self, dedupe_key: str, count: int = 2) -> list[str]:
        """A record finished ok, emitting ``count`` records: their event ids."""
        box = Emissions("grants", frozenset({TOPIC}), dedupe_key)
        ids = [box.emit(TOPIC, f"{dedupe_key}/{n}", key=dedupe_key) for n in range(count)]
        key = self.idem.key("grants", dedupe_key)
        request = FinishRequest(key, "T", "fp", "", [], emissions=box.emitted, emitted_by="grants")
        await self.idem.finish(request)
        return ids


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    redis = fakeredis.FakeAsyncRedis()
    keys = RedisKeys(PREFIX)
    metrics = Metrics()
    idem = Idempotency(RedisOps(redis, RedisSettings()), keys, ttl_s=None, lease_ms=60_000)
    try:
        yield Env(redis, keys, idem, RedisOutboxStore(redis, keys), metrics, Stalls(metrics))
    finally:
        await redis.aclose()


def event_ids(producer: Producer) -> list[str]:
    return [dict(headers)[EVENT_ID_HEADER].decode() for *_, headers in producer.sent]


async def test_a_round_sends_oldest_first_and_marks_only_what_kafka_acknowledged(
    env: Env,
) -> None:
    ids = [*await env.grant("g1"), *await env.grant("g2")]
    producer = Producer()
    relay = env.relay(producer, batch_size=3)
    assert await relay.leases["redis"].hold()
    assert await relay.publish_round(env.store) is True  # a full batch: more may wait
    assert event_ids(producer) == ids[:3]
    assert [p.emission.event_id for p in await env.store.pending(10)] == ids[3:]
    assert await relay.publish_round(env.store) is False
    assert event_ids(producer) == ids and await env.redis.xlen(env.keys.outbox) == 0
    trail = await env.redis.xrange(env.keys.outbox_published)
    assert [f[b"event"].decode() for _, f in trail] == ids
    assert trail[0][1][b"topic"] == TOPIC.encode() and trail[0][1][b"key"] == b"g1"


async def test_a_failed_send_marks_nothing_and_the_next_round_sends_the_same_ids(
    env: Env,
) -> None:
    ids = await env.grant("g1")
    producer = Producer(failing=True)
    relay = env.relay(producer)
    with pytest.raises(KafkaConnectionError):
        await relay.publish_round(env.store)
    assert len(await env.store.pending(10)) == 2
    producer.failing = False
    await relay.publish_round(env.store)
    assert event_ids(producer) == ids


async def test_one_relay_holds_a_store_and_one_that_loses_its_lease_stops_publishing(
    env: Env,
) -> None:
    first, second = env.relay(Producer()), env.relay(Producer())
    assert await first.leases["redis"].hold()
    assert not await second.leases["redis"].hold()
    # The first one's lease ended (a long pause) and the second took it meanwhile.
    await env.redis.delete(env.keys.outbox_lease("redis"))
    assert await second.leases["redis"].hold()
    assert not await first.leases["redis"].hold(), "renewed a lease another relay holds"
    await env.grant("g1")
    stop = asyncio.Event()
    producer = Producer()
    loser = env.relay(producer)
    task = asyncio.create_task(loser.run(stop))
    try:
        # It sees the entries (its round begins by reading the depth), then asks for the
        # lease; stopped after, the round it was in has ended by the time run() returns.
        await await_until(lambda: env.metrics.outbox_pending.labels("redis")._value.get() == 2, 5)
        loser.wake()
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert producer.sent == [], "published from a store another relay holds"
    assert len(await env.store.pending(10)) == 2


async def test_a_relay_failing_past_the_threshold_stalls_until_a_round_succeeds(
    env: Env,
) -> None:
    ids = await env.grant("g1")
    producer = Producer(failing=True)
    relay = env.relay(producer)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await await_until(lambda: STALL in env.stalls.active(), 10, message="never stalled")
        assert "broker away" in env.stalls.active()[STALL].detail
        producer.failing = False
        await await_until(lambda: STALL not in env.stalls.active(), 10, message="never cleared")
        await await_until(lambda: event_ids(producer) == ids, 10)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    # Stopped: its lease is given up, so another worker takes over at once.
    assert not await env.redis.exists(env.keys.outbox_lease("redis"))


def test_a_lease_shorter_than_two_polls_is_refused_naming_the_settings() -> None:
    with pytest.raises(ValidationError, match="WORKER_OUTBOX__LEASE_MS"):
        OutboxSettings(lease_ms=1000, poll_interval_ms=600)


async def test_trace_shows_a_keys_emitted_records_pending_and_published(env: Env) -> None:
    first, second = await env.grant("g1"), await env.grant("g2")
    relay = env.relay(Producer(), batch_size=3)
    await relay.publish_round(env.store)  # g1's two and g2's first
    g1 = await emitted_for(env.redis, env.keys, "grants", "g1")
    assert [(e["event_id"], e["state"], e["offset"]) for e in g1] == [
        (first[0], "published", 0),
        (first[1], "published", 1),
    ]
    g2 = await emitted_for(env.redis, env.keys, "grants", "g2")
    assert [(e["event_id"], e["state"]) for e in g2] == [
        (second[1], "pending"),
        (second[0], "published"),
    ]
    assert g2[0]["topic"] == TOPIC and g2[1]["partition"] == 0
    assert await emitted_for(env.redis, env.keys, "grants", "g3") == []
