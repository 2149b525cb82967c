"""The relay: publishes every outbox store's entries to Kafka, oldest first, at least once.

Every worker runs it, and per store exactly one relay publishes: the one holding the
store's lease in Redis (SET NX PX with a token of its own, renewed by a script that checks
the token). A relay that cannot renew stops publishing from that store and contends again.

One round: read the oldest entries, queue them as one record batch per partition in that
order (nothing is awaited between them), wait for Kafka's answer for every batch until the
lease ends, note the entries of every acknowledged batch in the published trail, and mark
them published, whatever happened to the other batches (refused, or unanswered when the
lease ended). A batch is written whole or not at all and always starts at its partition's
oldest unmarked entry, so no entry reaches Kafka ahead of an earlier one of its key,
whatever is refused or retried, and an acknowledged batch is never published again because
another partition's failed. The producer is Kafka's idempotent one where the broker grants
it (producer.py).
A relay killed between the acknowledgement and the mark publishes the same entries again
from the store: at least once, every copy carrying its ``event-id`` header, so a consumer
dedupes it. Exactly once would need the mark inside a Kafka transaction, and the store is
not Kafka (docs/outbox.md).

Failures (the store, Redis, the broker) are retried with jittered exponential backoff,
counted, and after ``stall_after_failures`` rounds in a row reported as the
``outbox_relay_failing`` stall until a round succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.structs import RecordMetadata, TopicPartition
from redis.asyncio import Redis

from reliable_consumer.engine.kafka.clients import MAX_BATCH_BYTES
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.outbox.store import OutboxStore, PendingEmission
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import OutboxSettings
from reliable_consumer.engine.stalls import Stalls

log = logging.getLogger(__name__)
NO_COMPRESSION = 0  # the codec attribute of an uncompressed record batch
STALL = "outbox_relay_failing"
CONSEQUENCE = "emitted records wait in the outbox; the relay retries"
MAX_BACKOFF_S = 10.0
# The first wait before writing a published round's trail or mark again.
SETTLE_FIRST_BACKOFF_S = 0.05

# Renew the lease only while it is still this relay's; 0 when another holds it (or none).
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Note a round's published entries in the capped trail: ARGV = cap, store, then per entry
# event, topic, partition, offset, key (the fields ``service trace`` reads).
NOTE = """
local cap, store = ARGV[1], ARGV[2]
for i = 3, #ARGV, 5 do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', cap, '*', 'event', ARGV[i], 'store', store,
    'topic', ARGV[i + 1], 'partition', ARGV[i + 2], 'offset', ARGV[i + 3], 'key', ARGV[i + 4])
end
return 0
"""
# Give the lease up at shutdown, so another worker takes over at once, not after it ends.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _retrieved(acked: asyncio.Future[RecordMetadata]) -> None:
    if not acked.cancelled():
        acked.exception()


class Lease:
    """One relay's hold on one store: taken if free, kept by renewing it in time."""

    def __init__(self, redis: Redis, key: str, lease_ms: int) -> None:
        self._redis = redis
        self.key = key
        self._lease_ms = lease_ms
        self.token = secrets.token_hex(12)
        self.held = False
        self._renew = redis.register_script(RENEW)
        self._release = redis.register_script(RELEASE)

    async def hold(self) -> bool:
        """Renew the lease when held, else try to take it: whether this relay holds it now."""
        if self.held:
            renewed = await self._renew(keys=[self.key], args=[self.token, self._lease_ms])
            self.held = bool(renewed)
            if not self.held:
                log.warning(
                    "outbox relay lost its lease; it stops publishing", extra={"lease": self.key}
                )
        else:
            taken = await self._redis.set(self.key, self.token, nx=True, px=self._lease_ms)
            self.held = bool(taken)
            if self.held:
                log.info("outbox relay took its lease; it publishes", extra={"lease": self.key})
        return self.held

    async def release(self) -> None:
        if self.held:
            self.held = False
            await self._release(keys=[self.key], args=[self.token])


@dataclass(slots=True)
class Batch:
    """One partition's share of a round: its records, built in the store's order."""

    builder: BatchBuilder
    count: int = 0


@dataclass(frozen=True, slots=True)
class Round:
    """What one round sent: each entry in the store's order with its partition and its
    place in that partition's batch, and Kafka's answer for each batch."""

    entries: list[tuple[PendingEmission, TopicPartition, int]]
    acks: dict[TopicPartition, asyncio.Future[RecordMetadata]]


@dataclass(frozen=True, slots=True)
class Published:
    """Where Kafka put one entry: what the published trail keeps for ``service trace``."""

    entry: PendingEmission
    partition: int
    offset: int


class OutboxRelay:
    """Publishes the entries of ``stores`` while this worker holds each one's lease."""

    def __init__(
        self,
        stores: Sequence[OutboxStore],
        *,
        redis: Redis,
        keys: RedisKeys,
        producer: AIOKafkaProducer,
        settings: OutboxSettings,
        metrics: Metrics,
        stalls: Stalls | None = None,
        max_message_bytes: Mapping[str, int] | None = None,
    ) -> None:
        self._stores = list(stores)
        # Each emitted topic's max.message.bytes, where the start-up check read it: a round's
        # batch for that topic is built no larger (the producer's own are 256 KiB).
        self._max_message_bytes = dict(max_message_bytes or {})
        self._redis = redis
        self._keys = keys
        self._producer = producer
        self._settings = settings
        self._metrics = metrics
        self._stalls = stalls
        self._wakes = {store.name: asyncio.Event() for store in self._stores}
        self._failing: set[str] = set()
        self._partitioner = DefaultPartitioner()
        self._note = redis.register_script(NOTE)
        self.leases = {
            s.name: Lease(redis, keys.outbox_lease(s.name), settings.lease_ms) for s in stores
        }

    def wake(self) -> None:
        """Something was written to an outbox in this process: look now, not at the poll."""
        for event in self._wakes.values():
            event.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Relay every store until ``stop``; each store's leases are given up on the way out."""
        async with asyncio.TaskGroup() as group:
            for store in self._stores:
                group.create_task(self._serve(store, stop), name=f"outbox-relay-{store.name}")

    async def _serve(self, store: OutboxStore, stop: asyncio.Event) -> None:
        lease = self.leases[store.name]
        failures = 0
        try:
            while not stop.is_set():
                wait_s = self._settings.poll_interval_ms / 1000
                try:
                    await self._observe(store)
                    full = await lease.hold() and await self.publish_round(store)
                    if failures:
                        self._recovered(store, failures)
                    failures = 0
                    if full:
                        continue  # more may wait: no pause
                except Exception as exc:  # every failure is retried, counted, and may stall
                    failures += 1
                    self._failed(store, exc, failures)
                    wait_s = random.uniform(0, min(MAX_BACKOFF_S, wait_s * 2**failures))
                await self._pause(store, stop, wait_s)
        finally:
            with contextlib.suppress(Exception):
                await lease.release()

    async def publish_round(self, store: OutboxStore) -> bool:
        """Publish the oldest entries, mark what Kafka acknowledged: whether more may wait.

        Raises the round's first failure (a refused batch, or ``TimeoutError`` for batches
        unanswered when the lease ended) after marking the acknowledged batches' entries."""
        batch = self._settings.batch_size
        entries = await store.pending(batch)
        if not entries:
            return False
        # Bounded by the lease: past it another relay may publish the same entries.
        lease_ends = asyncio.get_running_loop().time() + self._settings.lease_ms / 1000
        async with asyncio.timeout_at(lease_ends):
            sent = await self._send(entries)
        published, failure = await self._acknowledged(sent, lease_ends)
        if published:
            await self._settle(lambda: self._trail(store, published), lease_ends)
            marked = [p.entry for p in published]
            await self._settle(lambda: store.mark_published(marked), lease_ends)
            self._metrics.outbox_published.labels(store.name).inc(len(published))
        if failure is not None:
            raise failure
        return len(entries) == batch or len(sent.entries) < len(entries)

    async def _settle(self, write: Callable[[], Awaitable[None]], lease_ends: float) -> None:
        """One write after Kafka acknowledged (the trail, the store's mark), retried while
        the lease surely lasts. Giving up at the first error would publish the whole round
        again (up to a batch of duplicates per blip of Redis or PostgreSQL); past the lease
        the error is raised, and the next holder publishes the round again."""
        loop = asyncio.get_running_loop()
        backoff_s = SETTLE_FIRST_BACKOFF_S
        while True:
            try:
                await write()
                return
            except Exception:
                if loop.time() + backoff_s >= lease_ends:
                    raise
                log.warning("outbox relay could not record a published round; retrying")
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)

    async def _send(self, entries: Sequence[PendingEmission]) -> Round:
        """Queue the entries as ONE batch per partition, in the store's order, without
        waiting for any acknowledgement; the round ends before an entry its partition's
        batch has no room for (the next round starts there).

        One batch per partition per round is what keeps each key's order whatever Kafka
        refuses: a batch is written whole or not at all, and each starts at its partition's
        oldest unmarked entry, so no entry reaches a partition before the ones ahead of it."""
        out = Round([], {})
        batches: dict[TopicPartition, Batch] = {}
        for entry in entries:
            e = entry.emission
            partition = await self._partition_of(e.topic, e.key)
            tp = TopicPartition(e.topic, partition)
            pending = batches.get(tp)
            if pending is None:
                pending = batches[tp] = Batch(self._new_batch(tp.topic))
            if (
                pending.builder.append(
                    key=e.key, value=e.value, timestamp=None, headers=e.kafka_headers()
                )
                is None
            ):
                break  # full: this entry and the rest wait for the next round
            out.entries.append((entry, tp, pending.count))
            pending.count += 1
        for tp, pending in batches.items():
            if pending.count:
                pending.builder.close()  # nothing else joins it: it is the round's alone
                acked = await self._producer.send_batch(
                    pending.builder, tp.topic, partition=tp.partition
                )
                # Its failure is read below, or never if the round ended first: read it here.
                acked.add_done_callback(_retrieved)
                out.acks[tp] = acked
        return out

    def _new_batch(self, topic: str) -> BatchBuilder:
        """The producer's batch, or a smaller one where ``topic`` takes less (the relay's
        producer compresses nothing: make_outbox_producer). A single entry larger than
        that still goes alone; ``ctx.emit`` refused it already when the limit was known."""
        limit = self._max_message_bytes.get(topic)
        if limit is None or limit >= MAX_BATCH_BYTES:
            return self._producer.create_batch()
        return BatchBuilder(limit, NO_COMPRESSION)

    async def _partition_of(self, topic: str, key: bytes | None) -> int:
        """Where the producer's own partitioner puts ``key`` (murmur2, as Java's does)."""
        partitions = sorted(await self._producer.partitions_for(topic))
        return int(self._partitioner(key, partitions, partitions))

    async def _acknowledged(
        self, sent: Round, lease_ends: float
    ) -> tuple[list[Published], BaseException | None]:
        """Wait for every batch until the lease ends: the entries of each batch Kafka
        acknowledged, and the first failure in the store's order (a refusal, or a
        ``TimeoutError`` naming the batches still unanswered).

        Marking an acknowledged batch is safe whatever became of the others: it holds its
        partition's oldest unmarked entries, so no later entry of a key is marked ahead of
        an earlier one. Leaving it unmarked would only publish it again."""
        loop = asyncio.get_running_loop()
        if sent.acks:
            await asyncio.wait(sent.acks.values(), timeout=max(0.0, lease_ends - loop.time()))
        unanswered = sorted(
            f"{tp.topic}[{tp.partition}]" for tp, f in sent.acks.items() if not f.done()
        )
        published: list[Published] = []
        failure: BaseException | None = None
        for entry, tp, index in sent.entries:
            acked = sent.acks[tp]
            if not acked.done():
                failure = failure or TimeoutError(
                    "Kafka acknowledged no batch of partition(s) "
                    f"{', '.join(unanswered)} before the relay's lease ended"
                )
                continue
            if (refused := acked.exception()) is not None:
                failure = failure or refused
                continue
            meta: RecordMetadata = acked.result()
            offset = meta.offset + index if meta.offset >= 0 else -1
            published.append(Published(entry, tp.partition, offset))
        return published, failure

    async def _trail(self, store: OutboxStore, published: Sequence[Published]) -> None:
        """Note what was published in the capped trail (a copy published twice shows twice),
        in one script call per round: a pipelined XADD per entry was half the relay's time
        (redis-py packing each command)."""
        keep = self._settings.published_trail
        if keep == 0:
            return
        args: list[str | bytes | int] = [keep, store.name]
        for p in published:
            e = p.entry.emission
            key = e.key if e.key is not None else b""
            args += [e.event_id, e.topic, p.partition, p.offset, key]
        await self._note(keys=[self._keys.outbox_published], args=args)

    async def _observe(self, store: OutboxStore) -> None:
        depth = await store.depth()
        self._metrics.outbox_pending.labels(store.name).set(depth.pending)
        self._metrics.outbox_oldest_age.labels(store.name).set(depth.oldest_age_s or 0.0)

    async def _pause(self, store: OutboxStore, stop: asyncio.Event, wait_s: float) -> None:
        """Until the poll interval passes, this process writes to an outbox, or a stop."""
        wake = self._wakes[store.name]
        waits = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stop.wait())}
        try:
            await asyncio.wait(waits, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in waits:
                waiting.cancel()
        wake.clear()

    def _failed(self, store: OutboxStore, exc: Exception, failures: int) -> None:
        self._metrics.outbox_failures.labels(store.name).inc()
        log.warning(
            "outbox relay round failed; retrying",
            extra={"store": store.name, "failures": failures, "error": repr(exc)},
        )
        if failures >= self._settings.stall_after_failures and self._stalls is not None:
            self._failing.add(store.name)
            self._stalls.report(STALL, f"store {store.name}: {exc!r}", CONSEQUENCE)

    def _recovered(self, store: OutboxStore, failures: int) -> None:
        log.info("outbox relay recovered", extra={"store": store.name, "failures": failures})
        self._failing.discard(store.name)
        if not self._failing and self._stalls is not None:
            self._stalls.clear(STALL)
