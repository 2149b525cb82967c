"""The relay in three producer modes, on the bench's Apache Kafka: what each costs and what
each does about duplicates.

Modes: ``plain`` (acks=all), ``idempotent`` (Kafka's idempotent producer, the product's
default where the broker grants it) and ``transactional`` (a transactional id per store;
begin, send the round, commit, then mark). The transactional relay lives here only: it is
measured to show what transactions would and would not buy the outbox (docs/outbox.md).

Per mode:
  - the relay draining an outbox: µs per event and events per second;
  - killed between Kafka's acknowledgement (or the commit) and its mark: a relay stopped
    in ``mark_published`` and cancelled, then a successor drains the store. The copies a
    read_committed consumer sees beyond one per event id are the duplicates;
  - a relay that lost its lease mid-round (paused after reading a round, while a successor
    drained and marked the store) and then sends that round: the copies it adds. The
    successor's producer starts after the paused one, as a new lease holder's does; with
    one transactional id per store its init fences the paused producer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.engine.handlers.emissions import EVENT_ID_HEADER, Emissions
from reliable_consumer.engine.kafka.clients import make_outbox_producer
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.redis_store import RedisOutboxStore
from reliable_consumer.engine.outbox.relay import OutboxRelay, Published, Round
from reliable_consumer.engine.outbox.store import OutboxDepth, PendingEmission
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.idempotency import FinishRequest, Idempotency
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, OutboxSettings, RedisSettings

from bench.stack import BenchStack

Mode = Literal["plain", "idempotent", "transactional"]
MODES: tuple[Mode, ...] = ("plain", "idempotent", "transactional")
EMITS = 2  # events per record, as the outbox rows
PARTITIONS = 3
WAIT_S = 60.0


class TransactionalRelay(OutboxRelay):
    """The relay with each round in a Kafka transaction: begin, send, commit, then mark."""

    async def _send(self, entries: Sequence[PendingEmission]) -> Round:
        await self._producer.begin_transaction()
        return await super()._send(entries)

    async def _acknowledged(self, sent: Round) -> tuple[list[Published], BaseException | None]:
        published, failure = await super()._acknowledged(sent)
        if failure is None:
            await self._producer.commit_transaction()
            return published, None
        await self._producer.abort_transaction()
        return [], failure


def producer_for(mode: Mode, bootstrap: str, store: str) -> AIOKafkaProducer:
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    if mode == "transactional":
        return AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            transactional_id=f"outbox-relay-{store}",  # one per store: a new holder fences
            linger_ms=kafka.producer_linger_ms,
            max_batch_size=256 * 1024,
        )
    return make_outbox_producer(kafka, idempotent=mode == "idempotent")


class Gated:
    """A store wrapper that stops a relay at one step: after reading a round (``pause``:
    a relay whose lease ended while it was paused) or in ``mark_published`` (``hold``:
    killed between the acknowledgement and the mark)."""

    def __init__(self, store: RedisOutboxStore, *, pause: bool = False) -> None:
        self._store = store
        self.name = store.name
        self._pause = pause
        self.reached = asyncio.Event()
        self.resume = asyncio.Event()

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        entries = await self._store.pending(limit)
        if self._pause:
            self.reached.set()
            await self.resume.wait()
        return entries

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        if self._pause:
            await self._store.mark_published(entries)
            return
        self.reached.set()
        await asyncio.Event().wait()  # cancelled here

    async def depth(self) -> OutboxDepth:
        return await self._store.depth()


@dataclass
class Outbox:
    """A fresh outbox (its own key prefix) and topic, filled with records' emissions."""

    stack: BenchStack
    mode: Mode
    client: aioredis.Redis
    keys: RedisKeys
    store: RedisOutboxStore
    topic: str

    @classmethod
    async def make(cls, stack: BenchStack, mode: Mode, records: int) -> Outbox:
        prefix = f"om{uuid.uuid4().hex[:8]}"
        topic = f"bench.outbox.{mode}.{prefix}"
        await create_topics(stack.bootstrap, {topic: PARTITIONS})
        client = aioredis.from_url(stack.redis_url)
        settings = RedisSettings(url=stack.redis_url, key_prefix=prefix)
        keys = RedisKeys(settings.effective_prefix)
        idem = Idempotency(RedisOps(client, settings), keys, ttl_s=None, lease_ms=60_000)
        requests = []
        for n in range(records):
            box = Emissions("grants", frozenset({topic}), f"p{n}")
            for step in range(EMITS):
                box.emit(topic, {"payment_id": f"p{n}", "step": step}, key=f"u{n % 97}")
            requests.append(
                FinishRequest(idem.key("grants", f"p{n}"), "T", "fp", "", [],
                              emissions=box.emitted, emitted_by="grants")
            )  # fmt: skip
        for i in range(0, records, 500):
            await idem.finish_many(requests[i : i + 500])
        return cls(stack, mode, client, keys, RedisOutboxStore(client, keys), topic)

    def relay(self, producer: AIOKafkaProducer, store: object | None = None) -> OutboxRelay:
        kind = TransactionalRelay if self.mode == "transactional" else OutboxRelay
        return kind(
            [store or self.store],  # type: ignore[list-item]
            redis=self.client,
            keys=self.keys,
            producer=producer,
            settings=OutboxSettings(),
            metrics=Metrics(),
        )

    async def producer(self) -> AIOKafkaProducer:
        producer = producer_for(self.mode, self.stack.bootstrap, self.keys.prefix.strip("{}"))
        await producer.start()
        return producer

    async def drain(self, relay: OutboxRelay) -> None:
        while await relay.publish_round(self.store) or (await self.store.depth()).pending:
            pass

    async def copies(self) -> Counter[str]:
        """Copies per event id a read_committed consumer sees on the topic."""
        consumer = AIOKafkaConsumer(
            self.topic, bootstrap_servers=self.stack.bootstrap, auto_offset_reset="earliest",
            enable_auto_commit=False, isolation_level="read_committed",
        )  # fmt: skip
        await consumer.start()
        seen: Counter[str] = Counter()
        try:
            async with asyncio.timeout(WAIT_S):
                while not consumer.assignment():
                    await consumer.getmany(timeout_ms=100)
                ends = await consumer.end_offsets(list(consumer.assignment()))
                while await _behind(consumer, ends):
                    for records in (await consumer.getmany(timeout_ms=200)).values():
                        for r in records:
                            seen[dict(r.headers)[EVENT_ID_HEADER].decode()] += 1
        finally:
            await consumer.stop()
        return seen

    async def close(self) -> None:
        await self.client.aclose()


async def _behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    """Whether the consumer has not yet reached ``ends`` on some partition."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return True
    return False


def _quiet_when_fenced(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """The fenced producer's own futures fail with ProducerFenced unread: the expected
    outcome here, not a fault worth a traceback; anything else is reported as usual."""
    if not isinstance(context.get("exception"), ProducerFenced):
        loop.default_exception_handler(context)


@dataclass(frozen=True)
class ModeFigures:
    event_us: float  # the relay's wall time per event, draining the outbox
    events_per_s: float
    killed_duplicates: int  # copies beyond one per event id after a kill before the mark
    killed_round: int  # events in the killed round
    zombie_duplicates: int  # copies a relay that lost its lease added afterwards


async def measure(stack: BenchStack, mode: Mode, records: int) -> ModeFigures:
    throughput = await Outbox.make(stack, mode, records)
    try:
        producer = await throughput.producer()
        try:
            started = time.perf_counter()
            await throughput.drain(throughput.relay(producer))
            wall = time.perf_counter() - started
        finally:
            await producer.stop()
    finally:
        await throughput.close()
    events = records * EMITS
    killed, round_size = await _killed_before_mark(stack, mode)
    return ModeFigures(wall * 1e6 / events, events / wall, killed, round_size,
                       await _zombie(stack, mode))  # fmt: skip


async def _killed_before_mark(stack: BenchStack, mode: Mode) -> tuple[int, int]:
    """The duplicates after a relay is killed between the ack (or commit) and its mark."""
    box = await Outbox.make(stack, mode, OutboxSettings().batch_size // EMITS)  # one round
    try:
        first = await box.producer()
        held = Gated(box.store)
        try:
            killed = asyncio.create_task(box.relay(first, held).publish_round(held))  # type: ignore[arg-type]
            await asyncio.wait_for(held.reached.wait(), WAIT_S)
            killed.cancel()
            await asyncio.gather(killed, return_exceptions=True)
        finally:
            await first.stop()
        successor = await box.producer()
        try:
            await box.drain(box.relay(successor))
        finally:
            await successor.stop()
        copies = await box.copies()
        return sum(copies.values()) - len(copies), len(copies)
    finally:
        await box.close()


async def _zombie(stack: BenchStack, mode: Mode) -> int:
    """The copies a relay adds that read a round, lost its lease while paused, and then
    sends the round after its successor drained and marked the store."""
    box = await Outbox.make(stack, mode, OutboxSettings().batch_size // EMITS)  # one round
    asyncio.get_running_loop().set_exception_handler(_quiet_when_fenced)
    try:
        paused = Gated(box.store, pause=True)
        old = await box.producer()
        try:
            zombie = asyncio.create_task(box.relay(old, paused).publish_round(paused))  # type: ignore[arg-type]
            await asyncio.wait_for(paused.reached.wait(), WAIT_S)
            successor = await box.producer()  # the new holder's producer (init fences)
            try:
                await box.drain(box.relay(successor))
            finally:
                await successor.stop()
            before = sum((await box.copies()).values())
            paused.resume.set()
            await asyncio.gather(zombie, return_exceptions=True)  # fenced, or published
        finally:
            await old.stop()
        return sum((await box.copies()).values()) - before
    finally:
        await box.close()
