"""Synthetic worker output, for tests, benchmarks and demos of the pipeline.

Writes what a worker run would leave behind, byte for byte in the formats of
docs/contracts.md: records on the source topic, outcome events, dead letters and the Redis
ledger, with chosen records lost, doubled, stuck and so on. Knowing the truth up front is
what lets a test say "reconcile found exactly these keys". A record is a small JSON object
keyed by `key_field`; a caller that wants records some service's handler would accept names
that service's key field and handler.

Records are appended through aiokafka's `create_batch`/`send_batch`, which is an order of
magnitude faster than `send()` per record and tells the exact offset of every record (base
offset of its batch + its index), so outcome events can name their source coordinates.

Outcome events are encoded by the worker's own encoder
(`reliable_consumer.engine.kafka.outcome_events`): a document per source partition and batch, a
batch being the records of a partition that arrived in the same `BATCH_MS` and so finished
together. The events of the first `old_layout_below` records are written a Kafka record each
instead, as a worker did before layout 2: a topic written across the upgrade.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from redis.typing import EncodableT, FieldT
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.kafka.outcome_events import (
    Event,
    encode_batch,
    encode_record,
    partition_of,
)
from reliable_consumer.engine.records import Delivery, Outcome

__all__ = ["Dataset", "Scenario", "TopicWriter", "produce_dataset"]

Header = tuple[str, bytes]
MINUTE_MS = 60_000
BATCH_MS = 100  # a partition's records within this window finish in one batch


class TopicWriter:
    """Appends records to explicit partitions in large batches; returns their offsets."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, partitions: int) -> None:
        self.producer = producer
        self.topic = topic
        self.partitions = partitions
        self._batches: dict[int, Any] = {}
        self._counts: dict[int, int] = {}
        self._pending: list[tuple[int, Any, list[int]]] = []
        self._slots: dict[int, list[int]] = {}

    async def append(
        self,
        partition: int,
        key: bytes | None,
        value: bytes | None,
        timestamp_ms: int,
        headers: Sequence[Header] = (),
        ref: int = -1,
    ) -> None:
        """Queue one record; `ref` (any int) is reported back with its offset by `flush`."""
        batch = self._batches.get(partition)
        if batch is None:
            batch = self._batches[partition] = self.producer.create_batch()
            self._slots[partition] = []
        if (
            batch.append(key=key, value=value, timestamp=timestamp_ms, headers=list(headers))
            is None
        ):
            await self._send(partition)
            await self.append(partition, key, value, timestamp_ms, headers, ref)
            return
        self._slots[partition].append(ref)

    async def _send(self, partition: int) -> None:
        batch = self._batches.pop(partition)
        batch.close()
        future = await self.producer.send_batch(batch, self.topic, partition=partition)
        self._pending.append((partition, future, self._slots.pop(partition)))

    async def flush(self) -> dict[int, tuple[int, int]]:
        """Send everything; returns ref -> (partition, offset) for records given a ref >= 0."""
        for partition in list(self._batches):
            await self._send(partition)
        where: dict[int, tuple[int, int]] = {}
        for partition, future, refs in self._pending:
            meta = await future
            for i, ref in enumerate(refs):
                if ref >= 0:
                    where[ref] = (partition, meta.offset + i)
        self._pending.clear()
        return where


@dataclass(frozen=True)
class Scenario:
    """Which record indexes (0..n-1) get which fate; all others are granted once."""

    n: int
    lost: frozenset[int] = frozenset()
    doubled: frozenset[int] = frozenset()
    stuck: frozenset[int] = frozenset()
    """Retrying since an hour before the rest of the data: stuck at the default 15 min."""
    retrying: frozenset[int] = frozenset()
    dead_lettered: frozenset[int] = frozenset()
    exhausted: frozenset[int] = frozenset()
    """Retried twice, then dead-lettered with reason `exhausted` at attempt 3."""
    retried_then_granted: frozenset[int] = frozenset()
    resent: frozenset[int] = frozenset()
    """The producer sent the record twice; the second copy gets a `duplicate`."""
    duplicate_without_grant: frozenset[int] = frozenset()
    """Only a `duplicate` outcome and no grant anywhere (a lost grant behind a done-marker)."""
    malformed: int = 0
    """Extra records whose value is not JSON; each is dead-lettered by coordinates."""
    without_ledger: frozenset[int] = frozenset()
    """Granted per the outcomes topic, but missing from the ledger."""
    ledger_only: frozenset[int] = frozenset()
    """Granted in the ledger, but with no outcome event (the worker's event never written)."""
    event_copies: frozenset[int] = frozenset()
    """Its emitted event published twice (the relay's at-least-once): one copy, no error."""
    without_event: frozenset[int] = frozenset()
    """Granted, but its emitted event never published."""
    event_without_grant: frozenset[int] = frozenset()
    """Not granted (lost, dead-lettered, ...), yet an event was published for it."""


@dataclass
class Dataset:
    """Where a scenario was written and the truth about it."""

    source_topic: str
    outcomes_topic: str
    dlq_topic: str
    ledger_key: str | None
    record_ids: list[str]
    source_records: int = 0
    outcome_events: int = 0
    dead_letters: int = 0
    ledger_entries: int = 0
    malformed_entities: list[str] = field(default_factory=list)
    emitted_events: int = 0

    def ids(self, indexes: Iterable[int]) -> set[str]:
        return {self.record_ids[i] for i in indexes}


def record_id(i: int) -> str:
    return f"rec_{i:08d}"


def _dlq_headers(
    handler: str,
    reason: str,
    pid: str | None,
    topic: str,
    partition: int,
    offset: int,
    attempts: int,
    at_ms: int,
) -> list[Header]:
    return [
        ("x-dlq-reason", reason.encode()),
        ("x-dlq-error", f"synthetic {reason}".encode()),
        ("x-dlq-source-topic", topic.encode()),
        ("x-dlq-source-partition", str(partition).encode()),
        ("x-dlq-source-offset", str(offset).encode()),
        ("x-dlq-attempts", str(attempts).encode()),
        ("x-dlq-handler", handler.encode() if pid else b""),
        ("x-dlq-dedupe-key", (pid or "").encode()),
        ("x-dlq-at", str(at_ms).encode()),
    ]


async def produce_dataset(
    bootstrap: str,
    scenario: Scenario,
    *,
    source_topic: str,
    outcomes_topic: str,
    dlq_topic: str,
    partitions: int,
    outcome_partitions: int,
    base_ts_ms: int,
    redis_url: str | None = None,
    ledger_key: str | None = None,
    latency_ms: int = 40,
    key_field: str = "record_id",
    handler: str = "records",
    old_layout_below: int = 0,
    events_topic: str | None = None,
) -> Dataset:
    """Write `scenario` to existing topics (and the ledger stream, if `redis_url`).

    `key_field` names the dedupe key in the source JSON and the ledger entries, and `handler`
    the handler in outcomes and dead letters (reconcile reads neither name from the data).
    The events of records 0..`old_layout_below`-1 are written in layout 1 (a record each).
    With `events_topic`, each grant's emitted event is published there (one partition), as
    the relay would: an ``event-id`` header per ``emissions.event_id(handler, key, 0)``.
    """
    s = scenario
    ids = [record_id(i) for i in range(s.n)]
    data = Dataset(source_topic, outcomes_topic, dlq_topic, ledger_key, ids)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, max_batch_size=1 << 20, linger_ms=50, request_timeout_ms=60_000
    )
    await producer.start()
    try:
        # 1. Source records. Ref i = first copy of record i; n + i = its resent copy; 2n + j =
        #    malformed record j.
        src = TopicWriter(producer, source_topic, partitions)

        def ts_of(i: int) -> int:
            return base_ts_ms - 60 * MINUTE_MS + i if i in s.stuck else base_ts_ms + i

        for i, pid in enumerate(ids):
            value = json.dumps(
                {
                    key_field: pid,
                    "user_id": f"user_{i % 997}",
                    "product_id": f"prod_{i % 13}",
                    "amount_minor": 100 + i % 900,
                    "currency": "EUR",
                    "status": "succeeded",
                },
                separators=(",", ":"),
            ).encode()
            await src.append(i % partitions, pid.encode(), value, ts_of(i), ref=i)
            if i in s.resent:
                await src.append(
                    (i + 1) % partitions, pid.encode(), value, ts_of(i) + 5, ref=s.n + i
                )
        for j in range(s.malformed):
            await src.append(j % partitions, None, b"{not json", base_ts_ms + j, ref=2 * s.n + j)
        where = await src.flush()
        data.source_records = len(where)

        # 2. Outcomes, dead letters and the ledger, as the worker would have written them.
        out = TopicWriter(producer, outcomes_topic, outcome_partitions)
        dlq = TopicWriter(producer, dlq_topic, 1)
        emitted = TopicWriter(producer, events_topic, 1) if events_topic else None

        async def publish_event(pid: str, at_ms: int, copies: int = 1) -> None:
            if emitted is None:
                return
            headers = [("event-id", event_id(handler, pid, 0).encode())]
            for _ in range(copies):
                await emitted.append(0, pid.encode(), b"{}", at_ms, headers)
                data.emitted_events += 1

        ledger: list[dict[FieldT, EncodableT]] = []
        # (source partition, finished_at) -> its events, in the order they happened.
        batches: dict[tuple[int, int], list[Event]] = {}

        async def emit(
            event: str,
            pid: str | None,
            ref: int,
            attempt: int,
            reason: str | None,
            finished_at: int,
            record_ts: int,
        ) -> None:
            p, o = where[ref]
            delivery = Delivery(source_topic, p, o, None, None, (), record_ts, attempt)
            happened: Event = (delivery, Outcome(event), handler, pid, reason)
            data.outcome_events += 1
            if ref % s.n >= old_layout_below or ref >= 2 * s.n:
                batches.setdefault((p, finished_at), []).append(happened)
                return
            key, value = encode_record(*happened, finished_at)
            part = partition_of(key, outcome_partitions) if key is not None else 0
            await out.append(part, key, value, finished_at)

        async def dead_letter(
            pid: str | None, ref: int, reason: str, attempts: int, at_ms: int
        ) -> None:
            p, o = where[ref]
            await dlq.append(
                0,
                pid.encode() if pid else None,
                b"{}",
                at_ms,
                _dlq_headers(handler, reason, pid, source_topic, p, o, attempts, at_ms),
            )
            data.dead_letters += 1

        def grant(pid: str, ref: int, at_ms: int) -> None:
            p, o = where[ref]
            ledger.append(
                {
                    key_field: pid,
                    "user_id": "u",
                    "product_id": "p",
                    "amount_minor": 100,
                    "currency": "EUR",
                    "source": f"{source_topic}/{p}/{o}",
                    "granted_at": at_ms,
                }
            )

        for i, pid in enumerate(ids):
            ts = ts_of(i)
            done = (ts // BATCH_MS + 1) * BATCH_MS + latency_ms  # when its batch finished
            if i in s.event_without_grant:  # whatever happens to the record below
                await publish_event(pid, done)
            if i in s.lost:
                continue
            if i in s.ledger_only:
                grant(pid, i, done)
                continue
            if i in s.stuck or i in s.retrying:
                await emit("retry_scheduled", pid, i, 1, "TimeoutError", ts + 5, ts)
            elif i in s.dead_lettered:
                await emit("dead_lettered", pid, i, 1, "permanent", done, ts)
                await dead_letter(pid, i, "permanent", 1, done)
            elif i in s.exhausted:
                await emit("retry_scheduled", pid, i, 1, "TimeoutError", ts + 5, ts)
                await emit("retry_scheduled", pid, i, 2, "TimeoutError", ts + 10, ts)
                await emit("dead_lettered", pid, i, 3, "exhausted", done + 20, ts)
                await dead_letter(pid, i, "exhausted", 3, done + 20)
            elif i in s.duplicate_without_grant:
                await emit("duplicate", pid, i, 1, "done", done, ts)
            else:
                attempt = 1
                if i in s.retried_then_granted:
                    await emit("retry_scheduled", pid, i, 1, "TimeoutError", ts + 5, ts)
                    attempt = 2
                await emit("succeeded", pid, i, attempt, None, done, ts)
                if i not in s.without_ledger:
                    grant(pid, i, done)
                    if i not in s.without_event:
                        await publish_event(pid, done, 2 if i in s.event_copies else 1)
                if i in s.doubled:
                    await emit("succeeded", pid, i, attempt + 1, None, done + 30, ts)
                    grant(pid, i, done + 30)
            if i in s.resent:
                await emit("duplicate", pid, s.n + i, 1, "done", done + 40, ts + 5)
        for j in range(s.malformed):
            p, o = where[2 * s.n + j]
            at = base_ts_ms + j + 3
            await emit("dead_lettered", None, 2 * s.n + j, 1, "malformed", at, base_ts_ms + j)
            await dead_letter(None, 2 * s.n + j, "malformed", 1, at)
            data.malformed_entities.append(f"@{source_topic}/{p}/{o}")
        for (_, finished_at), events in batches.items():
            for key, value in encode_batch(events, finished_at):
                assert key is not None  # a document is keyed by its source partition
                await out.append(partition_of(key, outcome_partitions), key, value, finished_at)
        await out.flush()
        await dlq.flush()
        if emitted is not None:
            await emitted.flush()
    finally:
        await producer.stop()

    if redis_url is not None and ledger_key is not None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        try:
            for start in range(0, len(ledger), 10_000):
                pipe = client.pipeline(transaction=False)
                for entry in ledger[start : start + 10_000]:
                    pipe.xadd(ledger_key, entry)
                await pipe.execute()
        finally:
            await client.aclose()
        data.ledger_entries = len(ledger)
    return data
