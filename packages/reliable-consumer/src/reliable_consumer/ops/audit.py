"""Reading the worker's results from the outside, the way an operator would check them.

Used by the demo summary, the tests and the chaos runs: committed offsets against
high watermarks per partition, what the dead-letter topic holds, the ledger, and
what is left in the retry queue. Nothing here trusts the worker's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.kafka_client import connection_kwargs
from reliable_consumer.engine.keys import RedisKeys
from reliable_consumer.engine.outcome_events import decode_all
from reliable_consumer.engine.settings import KafkaSettings


@dataclass(frozen=True)
class PartitionOffsets:
    partition: int
    committed: int | None
    high_watermark: int

    @property
    def lag(self) -> int:
        return self.high_watermark - (self.committed or 0)


async def high_watermarks(kafka: KafkaSettings, topic: str) -> dict[int, int]:
    """Each partition's high watermark, taken from a fetch response.

    The dev broker (Tansu) answers ListOffsets "latest" with the last batch's base
    offset + 1 after batched produce, so ``end_offsets`` under-reports; the high
    watermark carried in fetch responses is right. Seeking to the reported end and
    fetching once returns the true value on any broker.
    """
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **connection_kwargs(kafka))
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            return {}
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(ends[tp] - 1, 0))
        out: dict[int, int] = {}
        deadline = time.monotonic() + 15
        while len(out) < len(tps) and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=200, max_records=1)
            for tp in tps:
                high = consumer.highwater(tp)
                if high is not None:
                    out[tp.partition] = high
        missing = [tp.partition for tp in tps if tp.partition not in out]
        if missing:
            raise TimeoutError(f"no fetch response for partitions {missing} of {topic}")
        return out
    finally:
        await consumer.stop()


async def group_offsets(kafka: KafkaSettings, group: str, topic: str) -> list[PartitionOffsets]:
    """Committed offset and high watermark for every partition of ``topic``.

    Committed offsets are read per partition through a consumer that never joins the
    group (OffsetFetch for named partitions); the dev broker does not answer the
    admin client's "all partitions of the group" form of that request.
    """
    highs = await high_watermarks(kafka, topic)
    consumer = AIOKafkaConsumer(
        group_id=group, enable_auto_commit=False, **connection_kwargs(kafka)
    )
    await consumer.start()
    try:
        committed = {p: await consumer.committed(TopicPartition(topic, p)) for p in highs}
    finally:
        await consumer.stop()
    return [PartitionOffsets(p, committed[p], high) for p, high in sorted(highs.items())]


async def read_all(kafka: KafkaSettings, topic: str, timeout_s: float = 30) -> list[Any]:
    """Every record currently in ``topic`` (up to each partition's high watermark)."""
    records, _ = await read_from(kafka, topic, {}, timeout_s)
    return records


async def read_from(
    kafka: KafkaSettings, topic: str, starts: dict[int, int], timeout_s: float = 30
) -> tuple[list[Any], dict[int, int]]:
    """The records of ``topic`` from ``starts[partition]`` (its beginning where absent or
    no longer kept) up to each partition's high watermark now; and those high watermarks,
    where the next read starts. A partition whose high watermark fell below its start (the
    topic was recreated) is read from its beginning."""
    highs = await high_watermarks(kafka, topic)
    plan: dict[TopicPartition, int] = {}
    for partition, high in highs.items():
        start = starts.get(partition, 0)
        start = 0 if start > high else start
        if start < high:
            plan[TopicPartition(topic, partition)] = start
    if not plan:  # nothing new: no consumer (one stopped before it fetched can raise)
        return [], dict(highs)
    consumer = AIOKafkaConsumer(
        enable_auto_commit=False, auto_offset_reset="earliest", **connection_kwargs(kafka)
    )
    await consumer.start()
    try:
        consumer.assign(list(plan))
        for tp, start in plan.items():
            if start > 0:
                consumer.seek(tp, start)
            else:
                await consumer.seek_to_beginning(tp)
        records: list[Any] = []
        remaining = set(plan)
        deadline = time.monotonic() + timeout_s
        while remaining and time.monotonic() < deadline:
            batch = await consumer.getmany(*remaining, timeout_ms=300, max_records=10_000)
            for tp, recs in batch.items():
                records.extend(r for r in recs if r.offset < highs[tp.partition])
                if recs and recs[-1].offset + 1 >= highs[tp.partition]:
                    remaining.discard(tp)
        if remaining:
            raise TimeoutError(f"could not read {topic} to its end in {timeout_s} s")
        return records, dict(highs)
    finally:
        await consumer.stop()


def header(record: Any, name: str) -> str | None:
    """The header's value; for the worker's ``x-dlq-*`` the last one, which is the worker's.

    The worker drops incoming reserved headers, and appends its own after the record's, so
    even a dead letter written before that (a forged reason first) reads the worker's.
    """
    found = None
    for key, value in record.headers or ():
        if key == name:
            if not name.startswith("x-dlq-"):
                return bytes(value).decode("utf-8", "replace")
            found = value
    return None if found is None else bytes(found).decode("utf-8", "replace")


def ledger_key(fields: dict[bytes, bytes]) -> str:
    """The dedupe key a ledger entry was written under: its payment id, and for an entry of
    another kind (a refund: ``kind: refund``) ``<payment_id>.<kind>``, the refund's own key."""
    payment_id = fields[b"payment_id"].decode()
    kind = fields.get(b"kind")
    return f"{payment_id}.{kind.decode()}" if kind else payment_id


async def ledger_grants(redis_url: str, prefix: str) -> Counter[str]:
    """How many ledger entries each dedupe key has (exactly-once means all are 1)."""
    counts: Counter[str] = Counter()
    async for _entry_id, fields in ledger_entries(redis_url, prefix):
        counts[ledger_key(fields)] += 1
    return counts


async def postgres_grants(postgres_url: str, table: str = "purchases") -> Counter[str]:
    """How many rows each ledger key has in the postgres example's purchases table (the
    payment id; ``<payment_id>.refund`` for a refund): exactly-once means all are 1."""
    import psycopg

    counts: Counter[str] = Counter()
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        cur = await conn.execute(
            f"SELECT payment_id, kind, count(*) FROM {table} GROUP BY payment_id, kind"
        )
        for payment_id, kind, n in await cur.fetchall():
            counts[payment_id if kind == "grant" else f"{payment_id}.{kind}"] += int(n)
    return counts


async def ledger_entries(
    redis_url: str, prefix: str
) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every ledger entry (id, fields), oldest first: the order effects were applied in."""
    client = aioredis.from_url(redis_url)
    try:
        stream = RedisKeys(prefix).effect("ledger", "purchases")
        start = "-"
        while True:
            entries = cast(list[Any], await client.xrange(stream, min=start, count=10_000))
            for entry_id, fields in entries:
                yield entry_id, fields
            if len(entries) < 10_000:
                return
            start = "(" + entries[-1][0].decode()
    finally:
        await client.aclose()


async def ledger_history(redis_url: str, prefix: str, payment_id: str) -> list[str]:
    """The ledger's entries for one payment, in order: "grant", then e.g. "refund"."""
    return [
        (fields.get(b"kind") or b"grant").decode()
        async for _entry_id, fields in ledger_entries(redis_url, prefix)
        if fields.get(b"payment_id") == payment_id.encode()
    ]


async def retry_queue_depth(redis_url: str, prefix: str) -> tuple[int, int, int]:
    """(due, in flight, items) in the delay queue; all zero when every retry finished."""
    keys = RedisKeys(prefix)
    client = aioredis.from_url(redis_url)
    try:
        due, inflight, items = await asyncio.gather(
            client.zcard(keys.retry_due),
            client.zcard(keys.retry_inflight),
            client.hlen(keys.retry_items),
        )
        return int(due), int(inflight), int(items)
    finally:
        await client.aclose()


def outcome_events(records: list[Any]) -> list[dict[str, Any]]:
    """The per-record outcome events in these outcomes-topic records (either layout, see
    ``reliable_consumer.engine.outcome_events``), in order; an unreadable record raises."""
    return decode_all([r.value for r in records])
