"""Reading the worker's results from the outside, the way an operator would check them.

Used by the demo summary, the tests and the chaos runs: committed offsets against
high watermarks per partition, what the dead-letter topic holds, the ledger, and
what is left in the retry queue. Nothing here trusts the worker's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import TopicAuthorizationFailedError
from aiokafka.protocol.metadata import MetadataRequest
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.kafka.acls import AUTHORIZATION_CODES
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.outcome_events import decode_all
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import KafkaSettings, RedisSettings

# A Redis URL, or the worker's Redis settings: those reach a cluster's slot as the worker does.
RedisTarget = str | RedisSettings


def _client(redis: RedisTarget) -> aioredis.Redis:
    return make_client(redis) if isinstance(redis, RedisSettings) else aioredis.from_url(redis)


@dataclass(frozen=True)
class PartitionOffsets:
    partition: int
    committed: int | None
    high_watermark: int

    @property
    def lag(self) -> int:
        return self.high_watermark - (self.committed or 0)


async def _start(consumer: AIOKafkaConsumer) -> None:
    """Start ``consumer``; one that failed to start is stopped too, else its client stays
    open and asyncio reports an "Unclosed AIOKafkaConsumer" under the command's error."""
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()
        raise


async def high_watermarks(kafka: KafkaSettings, topic: str) -> dict[int, int]:
    """Each partition's high watermark, taken from a fetch response.

    The dev broker (Tansu) answers ListOffsets "latest" with the last batch's base
    offset + 1 after batched produce, so ``end_offsets`` under-reports; the high
    watermark carried in fetch responses is right. Seeking to the reported end and
    fetching once returns the true value on any broker.
    """
    consumer = AIOKafkaConsumer(enable_auto_commit=False, **connection_kwargs(kafka))
    await _start(consumer)
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await consumer._client.force_metadata_update()
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        if not tps:
            await _refuse_if_unauthorized(consumer, topic)
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
    await _start(consumer)
    try:
        committed = {p: await consumer.committed(TopicPartition(topic, p)) for p in highs}
    finally:
        await consumer.stop()
    return [PartitionOffsets(p, committed[p], high) for p, high in sorted(highs.items())]


async def _refuse_if_unauthorized(consumer: AIOKafkaConsumer, topic: str) -> None:
    """Raise TopicAuthorizationFailedError when ``topic`` has no partitions for us because
    the broker hides it from this principal: read as empty, a dead-letter topic the
    operator may not read would look like no dead letters. Asked by name, not created."""
    client = consumer._client  # private: the consumer has no no-create metadata read
    request = MetadataRequest([topic], allow_auto_topic_creation=False)
    answer = await client.send(client.get_random_node(), request)
    for entry in answer.topics:
        if entry[1] == topic and entry[0] in AUTHORIZATION_CODES:
            raise TopicAuthorizationFailedError(topic)


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
    await _start(consumer)
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


def declared_ledger(ledger: Ledger | None = None) -> Ledger:
    """``ledger``, else the app's declaration; a clear error when the service keeps none."""
    found = ledger if ledger is not None else current_app().ledger
    if found is None:
        raise ConfigurationError(
            "the app declares no ledger (App ledger=Ledger(...), service/app.py), so there "
            "are no entries to count"
        )
    return found


def entry_text(fields: dict[bytes, bytes]) -> dict[str, str]:
    """A stream entry's fields as text, the way ``Ledger.entry_key`` reads them."""
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in fields.items()}


def ledger_key(fields: dict[bytes, bytes], ledger: Ledger | None = None) -> str | None:
    """The dedupe key a ledger stream entry was written for (the ledger's ``entry_key``)."""
    return declared_ledger(ledger).entry_key(entry_text(fields))


async def ledger_grants(
    redis_url: RedisTarget, prefix: str, ledger: Ledger | None = None
) -> Counter[str]:
    """How many ledger entries each dedupe key has (exactly-once means all are 1)."""
    declared = declared_ledger(ledger)
    counts: Counter[str] = Counter()
    async for _entry_id, fields in ledger_entries(redis_url, prefix, declared):
        key = declared.entry_key(entry_text(fields))
        if key is not None:
            counts[key] += 1
    return counts


async def table_entries(postgres_url: str, ledger: Ledger | None = None) -> list[dict[str, str]]:
    """Every row of the ledger's table (columns as text), by ``id``: the order they were
    written in."""
    import psycopg
    from psycopg import sql
    from psycopg.rows import dict_row

    declared = declared_ledger(ledger)
    if declared.table is None:
        raise ConfigurationError("the app's ledger names no table (Ledger table=...)")
    table = sql.Identifier(*declared.table.split("."))
    async with await psycopg.AsyncConnection.connect(postgres_url, row_factory=dict_row) as conn:
        cur = await conn.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(table))
        rows = await cur.fetchall()
    return [{k: str(v) for k, v in row.items() if v is not None} for row in rows]


async def postgres_grants(postgres_url: str, ledger: Ledger | None = None) -> Counter[str]:
    """How many rows each dedupe key has in the ledger's table: exactly-once means all are 1."""
    declared = declared_ledger(ledger)
    keys = (declared.entry_key(row) for row in await table_entries(postgres_url, declared))
    return Counter(key for key in keys if key is not None)


async def ledger_entries(
    redis_url: RedisTarget, prefix: str, ledger: Ledger | None = None
) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry of the ledger's stream (id, fields), oldest first: the order effects were
    applied in."""
    declared = declared_ledger(ledger)
    if declared.stream is None:
        raise ConfigurationError("the app's ledger names no Redis stream (Ledger stream=...)")
    client = _client(redis_url)
    try:
        stream = RedisKeys(prefix).effect(*declared.stream)
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


async def ledger_order(
    redis_url: RedisTarget, prefix: str, keys: Collection[str], ledger: Ledger | None = None
) -> list[str]:
    """The stream's entries for ``keys``, as their dedupe keys, in the order they were
    written: whether a record's effect came after the one it must follow."""
    declared = declared_ledger(ledger)
    order = []
    async for _entry_id, fields in ledger_entries(redis_url, prefix, declared):
        key = declared.entry_key(entry_text(fields))
        if key is not None and key in keys:
            order.append(key)
    return order


async def retry_queue_depth(redis_url: RedisTarget, prefix: str) -> tuple[int, int, int]:
    """(due, in flight, items) in the delay queue; all zero when every retry finished."""
    keys = RedisKeys(prefix)
    client = _client(redis_url)
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
    ``reliable_consumer.engine.kafka.outcome_events``), in order; an unreadable record raises."""
    return decode_all([r.value for r in records])
