"""The sharded outbox (engine/outbox/sharded_streams.py): one store per order shard's stream,
and the existing relay publishing from them, on one Redis and on a cluster.

Events are written as the worker will write them, by FINISH_ORDER into their Kafka key's
order shard. The relay's leases and published trail stay in the service's own slot (the
worker's slot-owner client); only the streams are sharded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from reliable_consumer.dev.servers.broker import Broker, create_topics
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.producer import relay_producer
from reliable_consumer.engine.outbox.relay import OutboxRelay
from reliable_consumer.engine.outbox.sharded_streams import ShardedOutboxStores, store_name
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.sharded.gate import OrderFinish, OrderStatus, ReserveStatus
from reliable_consumer.engine.settings import KafkaSettings, OutboxSettings, RedisSettings
from tests.helpers import await_until
from tests.sharded.conftest import PREFIX, SHARDS, TOPIC, Env

WAIT_S = 60.0
SOURCE = "payments"  # the topic whose Kafka keys choose the order shards
USERS = [f"u{i}" for i in range(12)]
STEPS = 3


@pytest.fixture
async def service_redis(env: Env, request: pytest.FixtureRequest) -> AsyncIterator[aioredis.Redis]:
    """The client of the service's own slot, as the worker makes it: the relay's leases and
    its published trail live there."""
    if env.kind == "redis":
        settings = RedisSettings(url=request.getfixturevalue("redis_url"), key_prefix=PREFIX)
    else:
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        settings = RedisSettings(url=cluster.urls[0], key_prefix=PREFIX, cluster=True)
    client = make_client(settings)
    try:
        yield client
    finally:
        await client.aclose()


def order_of(env: Env, user: str) -> int:
    """The order shard of ``user``'s records (partition 0 of the source topic)."""
    shard: int = env.layout.order_index(SOURCE, 0, user.encode())
    return shard


async def emit_waves(env: Env, users: list[str], steps: range, topic: str = TOPIC) -> list[str]:
    """Each user's records ``<user>-<step>`` reserved and finished, a wave per step (as
    successive waves of a Kafka key finish), each emitting one event keyed by its user into
    the user's order shard: the event ids, in the order written."""
    gate = env.gate()
    ids: list[str] = []
    for step in steps:
        records = [env.record(f"{u}-{step}", order_of(env, u), f"{u}-{step}") for u in users]
        held = await gate.reserve_many(records)
        assert {h.status for h in held} == {ReserveStatus.RESERVED}, held
        finishes = [
            to_topic(env.finish(r, h, u), topic)
            for r, h, u in zip(records, held, users, strict=True)
        ]
        done = await gate.finish_many(finishes)
        assert {d.status for d in done} == {OrderStatus.OK}, done
        ids += [f.emissions[0].event_id for f in finishes]
    return ids


def to_topic(finish: OrderFinish, topic: str) -> OrderFinish:
    return replace(finish, emissions=[replace(e, topic=topic) for e in finish.emissions])


async def test_each_order_shards_stream_is_a_store_read_oldest_first_and_emptied_by_marks(
    env: Env,
) -> None:
    stores = ShardedOutboxStores(env.caller, env.layout)
    assert [s.name for s in stores] == [store_name(n) for n in range(SHARDS)]
    assert len({RedisKeys("{x}").outbox_lease(s.name) for s in stores}) == SHARDS
    users = USERS[:6]
    await emit_waves(env, users, range(2))
    by_shard: dict[int, list[str]] = defaultdict(list)
    for step in range(2):
        for u in users:
            by_shard[order_of(env, u)].append(f"ev-{u}-{step}")
    assert len(by_shard) >= 3, "the users all fell in too few order shards to show anything"
    for n, store in enumerate(stores):
        pending = await store.pending(100)
        assert [p.emission.event_id for p in pending] == by_shard.get(n, []), n
        depth = await store.depth()
        assert depth.pending == len(by_shard.get(n, []))
        assert (depth.oldest_age_s is None) == (n not in by_shard)
        for p in pending:
            assert p.emission.key is not None
            assert order_of(env, p.emission.key.decode()) == n
    total = await stores.depth()
    assert total.pending == 12 and total.oldest_age_s is not None
    n, expected = next(iter(by_shard.items()))
    first = (await stores[n].pending(1))[0]
    assert first.emission.event_id == expected[0], "not oldest first"
    await stores[n].mark_published([first])
    assert [p.emission.event_id for p in await stores[n].pending(100)] == expected[1:]
    for store in stores:
        await store.mark_published(await store.pending(100))
    assert await stores.depth() == type(total)(0, None)
    assert await env.outbox_entries() == 0


async def read_events(broker: Broker, topic: str, count: int) -> list[tuple[str, str]]:
    """(key, event id) of ``topic``'s first ``count`` records, each partition in offset order,
    then a last look for any beyond them."""
    consumer = AIOKafkaConsumer(
        topic,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **connection_kwargs(
            KafkaSettings(bootstrap_servers=broker.bootstrap, client_id="t", group_id="t")
        ),
    )
    await consumer.start()
    out: list[tuple[str, str]] = []

    async def take(timeout_ms: int) -> None:
        for records in (await consumer.getmany(timeout_ms=timeout_ms)).values():
            for r in records:
                assert r.key is not None
                out.append((r.key.decode(), dict(r.headers)[EVENT_ID_HEADER].decode()))

    try:
        async with asyncio.timeout(WAIT_S):
            while len(out) < count:
                await take(500)
        await take(1000)  # a last look for any beyond them
    finally:
        await consumer.stop()
    return out


def published(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value("worker_outbox_published_total", {"store": name})
    return value or 0.0


@pytest.mark.timeout(180)
async def test_two_relays_split_the_shards_leases_and_publish_every_event_once_in_key_order(
    env: Env, service_redis: aioredis.Redis, kafka_broker: Broker, unique_name: str
) -> None:
    topic = f"{unique_name}.granted"
    await create_topics(kafka_broker.bootstrap, {topic: 2})
    kafka = KafkaSettings(
        bootstrap_servers=kafka_broker.bootstrap, client_id=unique_name, group_id=unique_name
    )
    settings = OutboxSettings(poll_interval_ms=50, lease_ms=5000)
    keys = RedisKeys(RedisSettings(key_prefix=PREFIX).effective_prefix)
    stores = ShardedOutboxStores(env.caller, env.layout)
    producers = [await relay_producer(kafka, "auto") for _ in range(2)]
    metrics = [Metrics(), Metrics()]
    relays = [
        OutboxRelay(
            stores, redis=service_redis, keys=keys, producer=p, settings=settings, metrics=m
        )
        for p, m in zip(producers, metrics, strict=True)
    ]
    # The two workers split the leases: even shards for the first, odd for the second.
    owner = {s.name: n % 2 for n, s in enumerate(stores)}
    for name, mine in owner.items():
        assert await relays[mine].leases[name].hold()
        assert not await relays[1 - mine].leases[name].hold()
    shards = {order_of(env, u) for u in USERS}
    assert {n % 2 for n in shards} == {0, 1}, "the users' shards are all held by one relay"
    stops = [asyncio.Event(), asyncio.Event()]
    for producer in producers:
        await producer.start()
    running = [asyncio.create_task(r.run(stop)) for r, stop in zip(relays, stops, strict=True)]

    async def all_published(count: int) -> bool:
        done = sum(published(m, s.name) for m in metrics for s in stores)
        return done >= count and (await stores.depth()).pending == 0

    try:
        # Written while both relays publish.
        ids = await emit_waves(env, USERS, range(STEPS), topic)
        await await_until(
            lambda: all_published(len(ids)), WAIT_S, message="the relays never published all"
        )
        # Neither relay lost a lease, nor took the other's: each shard had one publisher.
        for name, mine in owner.items():
            assert relays[mine].leases[name].held
            assert not relays[1 - mine].leases[name].held
            assert await service_redis.get(keys.outbox_lease(name)) == (
                relays[mine].leases[name].token.encode()
            )
        # The second worker stops: it gives its leases up, the first takes its streams.
        stops[1].set()
        await asyncio.wait_for(running[1], WAIT_S)
        last = await emit_waves(env, USERS, range(STEPS, STEPS + 1), topic)
        ids += last
        await await_until(
            lambda: all_published(len(ids)), WAIT_S, message="the odd shards were left behind"
        )
        assert all(lease.held for lease in relays[0].leases.values())
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*running), WAIT_S)
        for producer in producers:
            with contextlib.suppress(Exception):
                await producer.stop()
    events = await read_events(kafka_broker, topic, len(ids))
    counts = Counter(event for _, event in events)
    assert sorted(counts) == sorted(ids) and set(counts.values()) == {1}, counts
    for user in USERS:
        steps = [event for key, event in events if key == user]
        assert steps == [f"ev-{user}-{step}" for step in range(STEPS + 1)], steps
    per_shard = Counter(order_of(env, key) for key, _ in events)
    last_per_shard = Counter(order_of(env, event[3:].rpartition("-")[0]) for event in last)
    for n, store in enumerate(stores):
        if owner[store.name] == 0:
            assert published(metrics[0], store.name) == per_shard[n]
            assert published(metrics[1], store.name) == 0
        else:  # the second's until it stopped, then the first's
            assert published(metrics[1], store.name) == per_shard[n] - last_per_shard[n]
            assert published(metrics[0], store.name) == last_per_shard[n]
    # Stopped, each relay gave its leases up: another worker takes over at once.
    for store in stores:
        assert not await service_redis.exists(keys.outbox_lease(store.name))
