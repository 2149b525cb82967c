"""The outbox relay on fakeredis with a producer standing in for Kafka (engine/outbox/relay.py).

What the relay decides on its own: entries are sent oldest first and marked only after
every acknowledgement; one relay per store holds the lease and a relay that loses it stops
publishing; failures are retried and, past the threshold, are the outbox_relay_failing
stall until a round succeeds. The real broker's side is tests/integration/test_outbox.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import fakeredis
import pytest
from aiokafka.errors import KafkaConnectionError
from aiokafka.partitioner import murmur2
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatch
from pydantic import ValidationError
from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER, Emissions
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import STALL, OutboxRelay
from reliable_consumer.engine.outbox.store import OutboxDepth, OutboxStore, PendingEmission
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import OutboxSettings, RedisSettings, Settings
from reliable_consumer.engine.stalls import Stalls
from reliable_consumer.ops.trace import emitted_for
from tests.helpers import await_until

PREFIX = "rl"
TOPIC = "purchase.granted"


@dataclass(frozen=True)
class Placed:
    offset: int  # the batch's first offset, as Kafka answers it


Written = tuple[str, int, bytes, bytes | None, list[tuple[str, bytes]]]


@dataclass
class Producer:
    """Kafka as the relay sees it: ``send_batch`` queues a real record batch for a
    partition, its future is the acknowledgement of the whole batch. A batch for a
    partition in ``refused`` is refused whole, as Kafka refuses a batch."""

    partitions: int = 1
    failing: bool = False
    refused: set[int] = field(default_factory=set)
    sent: list[Written] = field(default_factory=list)  # topic, partition, value, key, headers
    batches: list[int] = field(default_factory=list)  # the record count of each batch sent
    holding: bool = False  # acknowledge nothing until release()
    silent: set[int] = field(default_factory=set)  # partitions whose batches are never answered
    held: list[tuple[asyncio.Future[Placed], Placed]] = field(default_factory=list)

    def release(self) -> None:
        for acked, placed in self.held:
            acked.set_result(placed)
        self.held.clear()

    def create_batch(self) -> BatchBuilder:
        return BatchBuilder(256 * 1024, 0)

    async def partitions_for(self, topic: str) -> set[int]:
        return set(range(self.partitions))

    async def send_batch(
        self, batch: BatchBuilder, topic: str, *, partition: int
    ) -> asyncio.Future[Placed]:
        assert batch.closed(), "a batch left open would take a send() of someone else"
        records = list(DefaultRecordBatch(bytes(batch._build())))
        self.batches.append(len(records))
        acked: asyncio.Future[Placed] = asyncio.get_running_loop().create_future()
        if self.failing or partition in self.refused:
            acked.set_exception(KafkaConnectionError("broker away"))
            return acked
        if partition in self.silent:
            return acked  # the leader is away: neither written nor refused, for now
        if self.holding:
            self.held.append((acked, Placed(len(self.sent))))
        else:
            acked.set_result(Placed(len(self.sent)))
        self.sent.extend(
            (topic, partition, r.value, r.key, [(n, bytes(v)) for n, v in r.headers])
            for r in records
        )
        return acked


@dataclass
class Env:
    redis: fakeredis.FakeAsyncRedis
    keys: RedisKeys
    idem: Idempotency
    store: RedisOutboxStore
    metrics: Metrics
    stalls: Stalls

    def relay(
        self, producer: Producer, store: OutboxStore | None = None, **settings: int
    ) -> OutboxRelay:
        values = {"poll_interval_ms": 20, "lease_ms": 1000, "stall_after_failures": 2}
        return OutboxRelay(
            [store or self.store],
            redis=self.redis,
            keys=self.keys,
            producer=producer,  # type: ignore[arg-type]
            settings=OutboxSettings(**{**values, **settings}),
            metrics=self.metrics,
            stalls=self.stalls,
        )

    async def grant(self, dedupe_key: str, count: int = 2, key: str | None = None) -> list[str]:
        """A record finished ok, emitting ``count`` records: their event ids."""
        box = Emissions("grants", frozenset({TOPIC}), dedupe_key)
        ids = [box.emit(TOPIC, f"{dedupe_key}/{n}", key=key or dedupe_key) for n in range(count)]
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


def partition_of(key: str, partitions: int) -> int:
    """Where Kafka's default partitioner puts ``key`` (what a consumer reads it from)."""
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def first_copies_by_key(producer: Producer) -> dict[bytes | None, list[str]]:
    """What a consumer deduplicating on event id applies, per key, in partition order."""
    seen: set[str] = set()
    out: dict[bytes | None, list[str]] = {}
    for partition in range(producer.partitions):
        for _, p, _, key, headers in producer.sent:
            event = dict(headers)[EVENT_ID_HEADER].decode()
            if p == partition and event not in seen:
                seen.add(event)
                out.setdefault(key, []).append(event)
    return out


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


def test_an_idempotence_setting_other_than_auto_on_off_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORKER_OUTBOX__IDEMPOTENCE", "maybe")
    with pytest.raises(ValidationError, match=r"outbox\.idempotence[\s\S]*'auto', 'on' or 'off'"):
        Settings()
    monkeypatch.setenv("WORKER_OUTBOX__IDEMPOTENCE", "off")
    assert Settings().outbox.idempotence == "off"


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


async def test_a_round_sends_one_batch_per_partition_and_waits_for_no_ack_before_the_next(
    env: Env,
) -> None:
    users = ["u0", "u1", "u2", "u3"]
    for n in range(12):
        await env.grant(f"g{n}", key=users[n % 4])
    producer = Producer(partitions=3, holding=True)
    relay = env.relay(producer)
    used = {partition_of(u, 3) for u in users}
    round_ = asyncio.create_task(relay.publish_round(env.store))
    # Every batch is handed over while none is acknowledged: no ack is awaited between.
    await await_until(lambda: len(producer.batches) == len(used), 5, message="a batch waited")
    assert not round_.done() and len(await env.store.pending(30)) == 24
    producer.release()
    assert await asyncio.wait_for(round_, 5) is False
    assert sum(producer.batches) == 24 and await env.redis.xlen(env.keys.outbox) == 0
    # Each key on the partition Kafka's default partitioner gives it, as a send() would.
    assert {(key, p) for _, p, _, key, _ in producer.sent} == {
        (u.encode(), partition_of(u, 3)) for u in users
    }


def alternating_grants_on_two_partitions() -> tuple[list[str], list[str]]:
    keys = ["a", "d"]
    assert partition_of("a", 2) != partition_of("d", 2)
    return keys, [keys[n % 2] for n in range(7)]


async def test_a_refused_batch_mid_round_marks_every_batch_kafka_acknowledged(env: Env) -> None:
    """Entries alternate between two keys on two partitions; the second key's partition
    refuses its batch. The first key's batch was written whole, so all of it is marked, even
    its entries after the refused one's (they were published again before: duplicates), and
    the republish keeps each key's order as a consumer deduplicating by event id sees it."""
    keys, order = alternating_grants_on_two_partitions()
    ids: dict[str, list[str]] = {k: [] for k in keys}
    for n, key in enumerate(order):
        ids[key] += await env.grant(f"g{n}", count=1, key=key)
    producer = Producer(partitions=2, refused={partition_of("d", 2)})
    relay = env.relay(producer)
    with pytest.raises(KafkaConnectionError):
        await relay.publish_round(env.store)
    assert [p.emission.event_id for p in await env.store.pending(10)] == ids["d"]
    assert event_ids(producer) == ids["a"], "the first key's batch was written whole"
    producer.refused.clear()
    assert await relay.publish_round(env.store) is False
    assert event_ids(producer) == ids["a"] + ids["d"], "an acknowledged entry went twice"
    assert first_copies_by_key(producer) == {b"a": ids["a"], b"d": ids["d"]}
    assert await env.redis.xlen(env.keys.outbox) == 0


async def test_a_round_that_outlives_its_lease_still_marks_the_batches_kafka_acknowledged(
    env: Env,
) -> None:
    """One partition's leader never answers: the round ends with the lease, and the other
    partition's acknowledged batch is marked rather than published again by the next holder."""
    keys, order = alternating_grants_on_two_partitions()
    ids: dict[str, list[str]] = {k: [] for k in keys}
    for n, key in enumerate(order):
        ids[key] += await env.grant(f"g{n}", count=1, key=key)
    producer = Producer(partitions=2, silent={partition_of("d", 2)})
    relay = env.relay(producer, lease_ms=1000, poll_interval_ms=20)
    with pytest.raises(TimeoutError, match="partition"):
        await relay.publish_round(env.store)
    assert [p.emission.event_id for p in await env.store.pending(10)] == ids["d"]
    assert env.metrics.outbox_published.labels("redis")._value.get() == len(ids["a"])


async def test_a_round_ends_before_an_entry_its_partitions_batch_has_no_room_for(
    env: Env,
) -> None:
    box = Emissions("grants", frozenset({TOPIC}), "big")
    ids = [box.emit(TOPIC, b"x" * 100_000, key="k") for _ in range(4)]
    request = FinishRequest(
        env.idem.key("grants", "big"), "T", "fp", "", [], emissions=box.emitted,
        emitted_by="grants",
    )  # fmt: skip
    await env.idem.finish(request)
    producer = Producer()
    relay = env.relay(producer)
    assert await relay.publish_round(env.store) is True, "the rest waits: not an idle relay"
    assert producer.batches == [2] and event_ids(producer) == ids[:2]
    assert [p.emission.event_id for p in await env.store.pending(10)] == ids[2:]
    while await relay.publish_round(env.store):
        pass
    assert producer.batches == [2, 2] and event_ids(producer) == ids


@dataclass
class BlinkingStore:
    """The Redis store whose mark fails ``failures`` times (the store restarting), then works."""

    base: RedisOutboxStore
    failures: int
    name: str = "redis"

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        return await self.base.pending(limit)

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("the store restarts")
        await self.base.mark_published(entries)

    async def depth(self) -> OutboxDepth:
        return await self.base.depth()


async def test_a_mark_that_fails_for_a_moment_is_retried_not_the_whole_round_republished(
    env: Env,
) -> None:
    ids = [*await env.grant("g1"), *await env.grant("g2")]
    store = BlinkingStore(env.store, failures=2)
    producer = Producer()
    relay = env.relay(producer, store, poll_interval_ms=20)
    assert await relay.leases["redis"].hold()
    await relay.publish_round(store)
    assert event_ids(producer) == ids, "the round was published again instead of marked"
    assert await store.pending(10) == []


async def test_a_mark_still_failing_when_the_lease_ends_raises_and_the_round_is_published_again(
    env: Env,
) -> None:
    ids = await env.grant("g1")
    store = BlinkingStore(env.store, failures=1_000)
    producer = Producer()
    relay = env.relay(producer, store, poll_interval_ms=100)
    with pytest.raises(ConnectionError):
        await relay.publish_round(store)
    store.failures = 0
    await relay.publish_round(store)
    assert event_ids(producer) == ids + ids, "at least once: the unmarked round goes again"
