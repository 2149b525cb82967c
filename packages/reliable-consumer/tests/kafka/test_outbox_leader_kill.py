"""The outbox's relay while the leader of the partition it publishes to is killed (3-node Kafka).

A worker (in this event loop) grants records of a test handler that announces each grant with
two events keyed by the grant's user, so one key carries many grants in a known order. The
emitted topic is replicated on the 3 nodes with ``min.insync.replicas=2``, so a leader's
death loses no acknowledged event. A backlog is built first: the test holds the relay's lease
(``{prefix}:outbox:lease:redis``, docs/outbox.md) while the worker grants, so the outbox
fills; once it lets go, the relay publishes in small rounds, and as soon as some events are
on the topic and the outbox is not yet empty, the leader of an emitted partition is killed.
The relay must go on with the new leader; the node is restarted with its data.

Checked from outside by the chaos suite's emit checks (tests/chaos/emitted.py): every
grant's events published, each copy carrying its grant's event id, no event for a record
that was dead-lettered or a duplicate delivery, each user's events in order (first copies).
The copies beyond the first are printed: the relay publishes at least once.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from pydantic import BaseModel
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster
from reliable_consumer.engine.errors import PermanentError
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.settings import Settings
from tests.chaos.emitted import STEPS, Emitted, check_emitted, every_step, read_emitted
from tests.helpers import await_until
from tests.integration.harness import make_settings, running_worker

from service import Context, handler

HANDLER = "grants"
USERS = 12
GRANTS_PER_USER = 40  # 480 records; 420 granted, 840 events
REFUSED_EVERY = 7  # every 7th grant of a user fails for good: dead-lettered, no event
DUPLICATES = 24  # second deliveries of granted records: duplicates, no event
EMITTED_PARTITIONS = 3
WAIT_S = 90.0


class Grant(BaseModel):
    payment_id: str
    user: str
    seq: int  # its position among the user's grants
    refused: bool = False


def announcing(emitted_topic: str) -> Handler[Grant]:
    """Grants into a ledger and announces each grant as two events keyed by its user."""

    @handler(HANDLER, model=Grant, dedupe_key="payment_id", emits=(emitted_topic,))
    def grants(grant: Grant, ctx: Context) -> None:
        ctx.effects.xadd(ctx.redis_key("grants", "ledger"), {"payment_id": grant.payment_id})
        for step in STEPS:
            ctx.emit(
                emitted_topic,
                {"payment_id": grant.payment_id, "step": step, "seq": grant.seq},
                key=grant.user,
            )
        if grant.refused:  # after its emits: a dead-lettered record must publish none
            raise PermanentError(f"grant {grant.payment_id} is refused")

    return grants


def expected_id(e: Emitted) -> str:
    return event_id(HANDLER, e.payment_id, STEPS.index(e.step))


def backlog() -> list[Grant]:
    """Each user's grants in order, users interleaved; some refused, some delivered twice."""
    grants = [
        Grant(
            payment_id=f"p{u}-{n}",
            user=f"u{u}",
            seq=n,
            refused=n % REFUSED_EVERY == REFUSED_EVERY - 1,
        )
        for n in range(GRANTS_PER_USER)
        for u in range(USERS)
    ]
    again = [g for g in grants if not g.refused][:DUPLICATES]
    return grants + again


async def produce(settings: Settings, grants: list[Grant]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=settings.kafka.bootstrap_servers, acks="all", linger_ms=5
    )
    await producer.start()
    try:
        sends = [
            await producer.send(
                settings.topics[HANDLER], g.model_dump_json().encode(), key=g.user.encode()
            )
            for g in grants
        ]
        await asyncio.gather(*sends)
    finally:
        await producer.stop()


async def ledger(client: aioredis.Redis, prefix: str) -> list[str]:
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        await client.xrange(f"{prefix}:grants:ledger", "-", "+"),
    )
    return [fields[b"payment_id"].decode() for _, fields in entries]


@pytest.mark.timeout(240)
async def test_relay_publishes_every_grants_events_in_order_through_a_leader_kill(
    kafka3: ApacheKafkaCluster, redis_url: str, unique_name: str
) -> None:
    emitted_topic = f"{unique_name}.granted"
    settings = make_settings(
        kafka3.bootstrap_servers,
        redis_url,
        unique_name,
        only_topics={HANDLER: unique_name},
        # Small rounds and a quick poll: the relay is mid-backlog for many rounds.
        outbox={"batch_size": 10, "poll_interval_ms": 50, "lease_ms": 5_000},
    )
    source = settings.topics[HANDLER]
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    await kafka3.create_topics({source: 3, settings.dead_letter_topic(source): 1, outcomes: 1})
    await kafka3.create_topics(
        {emitted_topic: EMITTED_PARTITIONS}, configs={"min.insync.replicas": "2"}
    )
    emitted_tps = [(emitted_topic, p) for p in range(EMITTED_PARTITIONS)]

    # Killing a leader loses nothing only while another replica is in sync (see
    # test_broker_faults.py): an earlier test's restarted node may still be catching up.
    async def fully_replicated() -> bool:
        return all([len(await kafka3.isr_of(t, p)) == 3 for t, p in emitted_tps])

    await await_until(fully_replicated, 60, interval=0.2, message="replicas never in sync")

    grants = backlog()
    granted = {g.payment_id for g in grants if not g.refused}
    client = aioredis.from_url(redis_url)
    lease = f"{settings.redis.effective_prefix}:outbox:lease:redis"
    outbox = f"{settings.redis.effective_prefix}:outbox"
    ends = AIOKafkaConsumer(bootstrap_servers=kafka3.bootstrap_servers, request_timeout_ms=10_000)
    await ends.start()
    tps = [TopicPartition(t, p) for t, p in emitted_tps]

    async def published() -> int:
        return sum((await ends.end_offsets(tps)).values())

    leader: int | None = None
    try:
        # Another holder keeps the lease while the worker grants: the outbox fills.
        assert await client.set(lease, "the test", px=120_000, nx=True)
        registry = Registry([announcing(emitted_topic)], settings.topics)
        async with running_worker(settings, registry=registry) as worker:
            await produce(settings, grants)

            async def all_granted() -> bool:
                return len(await ledger(client, settings.redis.effective_prefix)) == len(granted)

            await await_until(
                all_granted,
                WAIT_S,
                interval=0.1,
                message="the worker never granted the backlog",
            )
            backlog_len = await client.xlen(outbox)
            assert backlog_len == len(STEPS) * len(granted), "FINISH wrote every event"
            assert await published() == 0

            await client.delete(lease)  # the relay takes it at its next poll

            async def mid_backlog() -> bool:
                return await published() > 0 and await client.xlen(outbox) > 0

            await await_until(mid_backlog, WAIT_S, interval=0.01, message="no publishing seen")
            leader = await kafka3.leader_of(emitted_topic, 0)
            left = await client.xlen(outbox)
            p0 = TopicPartition(emitted_topic, 0)
            on_p0 = (await ends.end_offsets([p0]))[p0]
            await asyncio.to_thread(kafka3.kill, leader)
            print(f"\nleader {leader} of {emitted_topic}/0 killed with {left} events waiting")

            # The relay goes on with the new leader; the node comes back while it publishes.
            async def new_leader_takes_events() -> bool:
                if await kafka3.leader_of(emitted_topic, 0) in (leader, -1):
                    return False
                try:
                    grew = (await ends.end_offsets([p0]))[p0] > on_p0
                except KafkaError:  # its metadata still names the dead leader: ask again
                    return False
                return grew and await client.xlen(outbox) > 0

            await await_until(
                new_leader_takes_events, WAIT_S, interval=0.01, message="no publishing after"
            )
            restarted_with = await client.xlen(outbox)
            await asyncio.to_thread(kafka3.restart, leader)
            leader = None
            print(f"restarted with {restarted_with} events waiting")

            async def drained() -> bool:
                return await client.xlen(outbox) == 0

            await await_until(drained, WAIT_S, interval=0.1, message="the outbox never drained")
            assert worker.relay is not None
        emitted = await read_emitted(kafka3.bootstrap_servers, emitted_topic, EMITTED_PARTITIONS)
        assert sorted(await ledger(client, settings.redis.effective_prefix)) == sorted(granted)
    finally:
        if leader is not None:
            await asyncio.to_thread(kafka3.restart, leader)
        await ends.stop()
        await client.aclose()

    check = check_emitted(emitted, every_step(granted), expected_id)
    print(
        f"emitted: {check.events} events for {len(granted)} grants, "
        f"{check.duplicates} duplicate copies (at least once + event-id)"
    )
    assert check.problems == [], check.problems
    assert check.events == len(STEPS) * len(granted)
