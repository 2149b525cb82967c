"""What a chaos run left behind, read with plain redis-py and aiokafka calls only.

The chaos checker must not look through the code it checks: a bug in
`reliable_consumer.ops.audit` or `reliable_consumer.engine.redis.keys` (a wrong key name, a
misparsed header, a high watermark read wrong) would otherwise hide the very loss it should
show. So the key names and the record layouts are written out here as the contracts say
them (docs/contracts.md, docs/architecture.md), and every read is a redis-py or aiokafka
call:

- the ledger: XRANGE of ``{prefix}:ledger:purchases`` (fields ``payment_id``, ``source``);
- the delay queue: ``{prefix}:retry:due`` / ``:inflight`` (sorted sets), ``:items`` (hash,
  fields ``topic/partition/offset``);
- idempotency markers: ``{prefix}:idem:*`` (``d|`` done, ``x|`` dead, ``c|`` claimed);
- committed offsets: OffsetFetch through a consumer of the group that never subscribes;
- dead letters and outcome events: fetched from the topics, each read to the high
  watermark of a fetch response sent after the read began.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from reliable_consumer.engine.kafka.outcome_events import decode_all
from tests.chaos.emitted import Emitted, read_emitted

Where = tuple[str, int, int]  # source topic, partition, offset
TP = tuple[str, int]
READ_TIMEOUT_S = 60.0


def ledger_key(prefix: str) -> str:
    return f"{prefix}:ledger:purchases"


def _where(text: str) -> Where:
    topic, partition, offset = text.rsplit("/", 2)
    return topic, int(partition), int(offset)


def _header(record: Any, name: str) -> str | None:
    for key, value in record.headers or ():
        if key == name:
            return bytes(value).decode("utf-8", "replace")
    return None


@dataclass(frozen=True)
class DeadLetter:
    source: Where
    reason: str
    error: str


@dataclass
class View:
    """Everything the outside world can see of a run, at one moment."""

    committed: dict[TP, int | None]
    grants: Counter[str]  # payment id -> ledger entries
    granted_at: set[Where]
    parked: set[Where]
    dead: list[DeadLetter]
    retry_depth: tuple[int, int, int]  # due, in flight, items

    @property
    def dead_at(self) -> set[Where]:
        return {d.source for d in self.dead}

    def same_as(self, other: View) -> bool:
        return (
            self.committed == other.committed
            and self.grants == other.grants
            and sorted(self.dead, key=repr) == sorted(other.dead, key=repr)
            and self.retry_depth == other.retry_depth
            and self.parked == other.parked
        )

    def settled(self, ends: dict[TP, int]) -> bool:
        """Every offset produced is committed, and the delay queue is empty."""
        return all(
            self.committed.get(tp) == end for tp, end in ends.items()
        ) and self.retry_depth == (0, 0, 0)


@dataclass
class _Tail:
    """One consumer reading some topics from the beginning, remembering what it read."""

    consumer: AIOKafkaConsumer
    tps: list[TopicPartition]
    records: list[Any] = field(default_factory=list)

    async def catch_up(self) -> list[Any]:
        """Read until the position reaches a high watermark fetched after this call began.

        A fetch response processed after the call began may answer a request sent before
        it, so the high watermark counts only from the second response on.
        """
        first: dict[TopicPartition, int] = {}
        deadline = time.monotonic() + READ_TIMEOUT_S
        started_ms = int(time.time() * 1000)
        while True:
            batch = await self.consumer.getmany(*self.tps, timeout_ms=100, max_records=10_000)
            for recs in batch.values():
                self.records.extend(recs)
            fresh = True
            for tp in self.tps:
                stamp = self.consumer.last_poll_timestamp(tp)
                if stamp is None or stamp < started_ms:
                    fresh = False
                    continue
                first.setdefault(tp, stamp)
                high = self.consumer.highwater(tp)
                if stamp <= first[tp] or high is None or await self.consumer.position(tp) < high:
                    fresh = False
            if fresh:
                return self.records
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {self.tps} to their end")


class Outside:
    """Long-lived plain clients for the run's Redis and Kafka, read from the outside."""

    def __init__(
        self,
        *,
        bootstrap: str,
        redis_url: str,
        prefix: str,
        group: str,
        sources: dict[str, int],  # source topic -> partitions
        dead_letter_topics: dict[str, str],  # source topic -> its dead-letter topic
        outcomes_topic: str,
        cluster: bool = False,
    ) -> None:
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.group = group
        self.tps = [TopicPartition(t, p) for t, n in sorted(sources.items()) for p in range(n)]
        self.dead_letter_topics = dead_letter_topics
        self.outcomes_topic = outcomes_topic
        # The run restarts Redis: a pooled connection opened before is closed by then, and a
        # client without retries fails its next read on it instead of reconnecting. Reads
        # only, so trying one again on a fresh connection changes nothing they see.
        retry = Retry(ExponentialBackoff(0.5, 0.05), 3)
        # On a Redis Cluster (every key under one hash tag, so in one slot) redis-py's own
        # cluster client finds the slot's primary, and finds it again after a failover.
        self._redis: aioredis.Redis | aiocluster.RedisCluster = (
            aiocluster.RedisCluster.from_url(redis_url, retry=retry)
            if cluster
            else aioredis.from_url(redis_url, retry=retry)
        )
        self._group: AIOKafkaConsumer | None = None
        self._dlq: _Tail | None = None
        self._outcomes: _Tail | None = None
        self._ledger_from = "-"
        self._grants: Counter[str] = Counter()
        self._granted_at: set[Where] = set()

    def _consumer(self, **kwargs: Any) -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=100,
            **kwargs,
        )

    async def _tail(self, topics: Iterable[str]) -> _Tail:
        consumer = self._consumer(auto_offset_reset="earliest")
        await consumer.start()
        tps = [TopicPartition(t, 0) for t in topics]  # one partition each (prepare_topics)
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        return _Tail(consumer, tps)

    async def start(self) -> None:
        # Never subscribes, so it never joins the group whose commits it reads.
        self._group = self._consumer(group_id=self.group)
        await self._group.start()
        self._dlq = await self._tail(self.dead_letter_topics.values())
        self._outcomes = await self._tail([self.outcomes_topic])

    async def close(self) -> None:
        for consumer in (
            self._group,
            self._dlq.consumer if self._dlq else None,
            self._outcomes.consumer if self._outcomes else None,
        ):
            if consumer is not None:
                await consumer.stop()
        await self._redis.aclose()

    # -- Redis --

    async def ledger_length(self) -> int:
        return int(await self._redis.xlen(ledger_key(self.prefix)))

    async def _ledger(self) -> tuple[Counter[str], set[Where]]:
        """The ledger, read on from the last entry seen (it only ever grows)."""
        while True:
            entries = cast(
                list[Any],
                await self._redis.xrange(
                    ledger_key(self.prefix), min=self._ledger_from, count=5000
                ),
            )
            for entry_id, fields in entries:
                self._grants[fields[b"payment_id"].decode()] += 1
                self._granted_at.add(_where(fields[b"source"].decode()))
                self._ledger_from = "(" + entry_id.decode()
            if len(entries) < 5000:
                return Counter(self._grants), set(self._granted_at)

    async def _retry_queue(self) -> tuple[tuple[int, int, int], set[Where]]:
        p = self.prefix
        async with self._redis.pipeline(transaction=True) as pipe:  # one consistent read
            pipe.zcard(f"{p}:retry:due")
            pipe.zcard(f"{p}:retry:inflight")
            pipe.hkeys(f"{p}:retry:items")
            due, inflight, items = await pipe.execute()
        return (int(due), int(inflight), len(items)), {_where(i.decode()) for i in items}

    async def idempotency_markers(self) -> tuple[Counter[str], list[str]]:
        """Counts of done (d|) and dead (x|) markers, and every key in another state."""
        markers: Counter[str] = Counter()
        left: list[str] = []
        keys = [k async for k in self._redis.scan_iter(match=f"{self.prefix}:idem:*", count=1000)]
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            for key, value in zip(chunk, await self._redis.mget(chunk), strict=True):
                if not isinstance(value, bytes):  # expired since the scan
                    continue
                state = value[:2].decode(errors="replace")
                if state in ("d|", "x|"):
                    markers[state[0]] += 1
                else:
                    left.append(f"{key.decode(errors='replace')} = {value[:60]!r}")
        return markers, left

    # -- Kafka --

    async def committed(self) -> dict[TP, int | None]:
        assert self._group is not None
        return {(tp.topic, tp.partition): await self._group.committed(tp) for tp in self.tps}

    async def dead_letters(self) -> list[DeadLetter]:
        assert self._dlq is not None
        out = []
        by_dlq = {dlq: source for source, dlq in self.dead_letter_topics.items()}
        for r in await self._dlq.catch_up():
            # A dead letter names its source; the DLQ it sits in must agree.
            source = _header(r, "x-dlq-source-topic") or ""
            if source != by_dlq[r.topic]:
                source = f"{source}(in {r.topic})"
            partition = int(_header(r, "x-dlq-source-partition") or -1)
            offset = int(_header(r, "x-dlq-source-offset") or -1)
            out.append(
                DeadLetter(
                    (source, partition, offset),
                    _header(r, "x-dlq-reason") or "",
                    _header(r, "x-dlq-error") or "",
                )
            )
        return out

    async def outcome_events(self) -> list[dict[str, Any]]:
        assert self._outcomes is not None
        return decode_all([r.value for r in await self._outcomes.catch_up()])

    async def outbox_length(self) -> int:
        """Emitted records the relay has not yet published (the Redis outbox stream)."""
        return int(await self._redis.xlen(f"{self.prefix}:outbox"))

    async def emitted(self, topic: str, partitions: int) -> list[Emitted]:
        """Every record of the topic the claiming handler emits to, per partition in order."""
        return await read_emitted(self.bootstrap, topic, partitions)

    async def high_watermarks(self, ends: dict[TP, int]) -> dict[TP, int]:
        """Each source partition's high watermark, from fetch responses at `ends`.

        The dev broker answers ListOffsets "latest" wrongly after batched produce; the
        high watermark in a fetch response is right on any broker.
        """
        consumer = self._consumer()
        await consumer.start()
        try:
            consumer.assign(self.tps)
            for tp in self.tps:
                consumer.seek(tp, ends.get((tp.topic, tp.partition), 0))
            tail = _Tail(consumer, self.tps)
            await tail.catch_up()
            out = {}
            for tp in self.tps:
                high = consumer.highwater(tp)
                assert high is not None
                out[(tp.topic, tp.partition)] = high
            return out
        finally:
            await consumer.stop()

    # -- one view --

    async def view(self) -> View:
        """The delay queue first: read last, a retry finishing between the reads could look
        settled without its ledger entry or dead letter."""
        retry_depth, parked = await self._retry_queue()
        committed = await self.committed()
        grants, granted_at = await self._ledger()
        dead = await self.dead_letters()
        return View(committed, grants, granted_at, parked, dead, retry_depth)


async def wait_settled(outside: Outside, ends: dict[TP, int], timeout: float) -> View:  # noqa: ASYNC109
    """Two settled views in a row that agree (one view is a sequence of reads)."""
    last: list[View] = []
    deadline = time.monotonic() + timeout
    while True:
        state = await outside.view()
        if state.settled(ends) and last and last[0].same_as(state):
            return state
        last[:] = [state]
        if time.monotonic() > deadline:
            behind = {
                tp: (state.committed.get(tp), end)
                for tp, end in ends.items()
                if state.committed.get(tp) != end
            }
            raise AssertionError(
                f"not settled after {timeout:.0f}s: committed != end at {behind}, "
                f"retry queue {state.retry_depth}, ledger {sum(state.grants.values())}, "
                f"dead letters {len(state.dead)}"
            )
        await asyncio.sleep(0.5)  # the poll interval of a wait with a deadline
