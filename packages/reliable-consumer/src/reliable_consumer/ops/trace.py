"""The life of one record, by its dedupe key: where it is now and how it got there.

Read from the outside, like the rest of ``reliable_consumer.ops``: per handler bound to a topic, the
dedupe key's idempotency marker (free / claimed / done / dead), its records waiting in the
delay queue, its dead letters and its outcome events; and the ledger entries written for it.
The outcomes topic holds a document per batch and source partition (``outcome_events``),
keyed by the source partition, which a dedupe key does not name: every partition of it is
read, and only the records that mention the key's JSON text are decoded.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from reliable_consumer.engine.declaration.ledger import Ledger
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.handlers.registry import Handler, Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.kafka.outcome_events import UnreadableOutcome, decode, mentions
from reliable_consumer.engine.outbox.redis_store import emission_of, stream_id_ms
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.redis.client import make_client
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.audit import entry_text, high_watermarks, ledger_entries
from reliable_consumer.ops.dead_letters import DeadLetter, DeadLetterFilter, list_dead_letters
from reliable_consumer.ops.retry_admin import RetryFilter, RetryItem, list_retries

READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Marker:
    """The dedupe key's idempotency marker (redis/lua/claims.py lists the states)."""

    state: str  # free | claimed | done | dead
    partial: bool = False  # done with effects applied in part (|p, or |P once dead-lettered)
    lease_ms: int | None = None  # a claim's remaining lease

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "partial": self.partial, "lease_ms": self.lease_ms}


@dataclass(frozen=True)
class HandlerTrace:
    """What one handler knows of the key."""

    handler: str
    topic: str
    marker: Marker
    retries: tuple[RetryItem, ...]
    dead_letters: tuple[DeadLetter, ...]
    events: tuple[dict[str, Any], ...]  # outcome events, in the order they became durable
    state: str
    # What it emitted for the key (docs/outbox.md): pending in the Redis outbox, and
    # published (topic, partition, offset) as the relay's trail remembers, oldest first.
    emitted: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "handler": self.handler,
            "topic": self.topic,
            "state": self.state,
            "marker": self.marker.to_json(),
            "retries": [r.to_json() for r in self.retries],
            "dead_letters": [d.to_json() for d in self.dead_letters],
            "events": list(self.events),
            "emitted": list(self.emitted),
        }


@dataclass(frozen=True)
class Trace:
    dedupe_key: str
    handlers: tuple[HandlerTrace, ...]
    ledger: tuple[dict[str, str], ...]  # the ledger entries written under this key

    @property
    def state(self) -> str:
        """The first handler's state that says something, else "unknown"."""
        for h in self.handlers:
            if h.state != "unknown":
                return h.state
        return "unknown"

    def to_json(self) -> dict[str, Any]:
        return {
            "dedupe_key": self.dedupe_key,
            "state": self.state,
            "handlers": [h.to_json() for h in self.handlers],
            "ledger": list(self.ledger),
        }


def iso_ms(ms: int) -> str:
    """Unix milliseconds as ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _marker(value: bytes | None, pttl: int) -> Marker:
    if value is None:
        return Marker("free")
    text = value.decode("utf-8", "replace")
    kind = text[:1]
    if kind == "c":
        return Marker("claimed", lease_ms=pttl if pttl >= 0 else None)
    if kind == "d":
        return Marker("done", partial=text.endswith(("|p", "|P")))
    if kind == "x":
        return Marker("dead")
    return Marker(f"unreadable ({kind!r})")


def summarise(marker: Marker, retries: tuple[RetryItem, ...], dead: tuple[DeadLetter, ...]) -> str:
    """done / parked until T / dead (reason) / in flight / unknown: the key's state now."""
    for item in retries:
        if item.state == "in_flight":
            return "in flight"
    for item in retries:
        if item.state == "due" and item.due_at_ms is not None:
            return f"parked until {iso_ms(item.due_at_ms)}"
    if retries:
        return "parked (waiting behind an earlier record of its Kafka key)"
    if marker.state == "done":
        return "done (effects partial)" if marker.partial else "done"
    if marker.state == "dead" or dead:
        latest = max(dead, key=lambda d: d.at_ms or d.timestamp_ms) if dead else None
        return f"dead ({latest.reason})" if latest else "dead"
    if marker.state == "claimed":
        return "in flight"
    return "unknown"


async def outcome_events(settings: Settings, dedupe_key: str) -> list[dict[str, Any]]:
    """The key's outcome events, in the order they became durable (``finished_at``; ties in
    the order written), each with the partition and offset of the record that carries it.

    Either layout: a layout-1 event (a record per event, keyed by the dedupe key) of a
    topic written across the upgrade is found as well. Unreadable records are skipped. A
    long key's events carry its digest (``long_keys``): they are looked for by that, and
    a digest asked for directly (``sha256:...``, as events show it) finds them too.
    """
    written, _ = long_keys.written(dedupe_key)
    topic = settings.outcomes_topic()
    if topic is None:
        return []
    highs = await high_watermarks(settings.kafka, topic)
    ends = {TopicPartition(topic, p): end for p, end in highs.items() if end > 0}
    if not ends:
        return []
    consumer = AIOKafkaConsumer(
        enable_auto_commit=False, auto_offset_reset="earliest", **connection_kwargs(settings.kafka)
    )
    await consumer.start()
    events: list[dict[str, Any]] = []
    try:
        consumer.assign(list(ends))
        await consumer.seek_to_beginning(*ends)
        positions = dict.fromkeys(ends, 0)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while any(positions[tp] < end for tp, end in ends.items()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end")
            batch = await consumer.getmany(timeout_ms=300, max_records=10_000)
            for tp, records in batch.items():
                for record in records:
                    positions[tp] = record.offset + 1
                    if record.offset >= ends[tp] or not mentions(record.value, written):
                        continue
                    try:
                        found = decode(record.value)
                    except UnreadableOutcome:
                        continue
                    events.extend(
                        {**doc, "outcome_partition": tp.partition, "outcome_offset": record.offset}
                        for doc in found
                        if doc.get("dedupe_key") == written
                    )
    finally:
        await consumer.stop()
    events.sort(key=_finished_at)
    return events


def _finished_at(event: dict[str, Any]) -> int:
    at = event.get("finished_at")
    return at if isinstance(at, int) else 0


async def _marker_of(client: aioredis.Redis, key: str) -> Marker:
    pipe = client.pipeline(transaction=False)
    pipe.get(key)
    pipe.pttl(key)
    value, pttl = await pipe.execute()
    return _marker(value, int(pttl))


async def _marker_for(
    client: aioredis.Redis, keys: RedisKeys, handler: str, dedupe_key: str
) -> Marker:
    """The key's marker; given a long key's digest (``sha256:<hex>``), the marker of the
    key it stands for, kept under the same hex (a short key that reads like a digest is
    looked up as itself first)."""
    marker = await _marker_of(client, keys.idempotency(handler, dedupe_key))
    hex_part = long_keys.digested_hex(dedupe_key)
    if marker.state == "free" and hex_part is not None:
        return await _marker_of(client, keys.idempotency_hashed(handler, hex_part))
    return marker


async def ledger_for(
    settings: Settings, dedupe_key: str, ledger: Ledger | None = None
) -> list[dict[str, str]]:
    """The ledger's stream entries written for the key (``App(ledger=...)``, whose
    ``entry_key`` says which key an entry is for); none when the app keeps no stream."""
    declared = ledger if ledger is not None else current_app().ledger
    if declared is None or declared.stream is None:
        return []
    out: list[dict[str, str]] = []
    async for entry_id, fields in ledger_entries(
        settings.redis, settings.redis.effective_prefix, declared
    ):
        doc = entry_text(fields)
        if declared.entry_key(doc) == dedupe_key:
            out.append({"id": entry_id.decode(), **doc})
    return out


SCAN_PAGE = 5000
Entry = tuple[bytes, dict[bytes, bytes]]


async def _scan(
    client: aioredis.Redis, stream: str
) -> AsyncIterator[tuple[str, dict[bytes, bytes]]]:
    """Every entry of ``stream``, oldest first, a page at a time (the outbox holds what
    waits, the trail is capped: both bounded)."""
    start = "-"
    while True:
        page = cast(list[Entry], await client.xrange(stream, start, "+", count=SCAN_PAGE))
        for raw_id, fields in page:
            yield raw_id.decode(), fields
        if len(page) < SCAN_PAGE:
            return
        start = "(" + page[-1][0].decode()


async def emitted_for(
    client: aioredis.Redis, keys: RedisKeys, handler: str, dedupe_key: str
) -> list[dict[str, Any]]:
    """The records ``handler`` emitted for ``dedupe_key``: each event id's pending entry
    in the Redis outbox, and every published copy the trail holds."""
    prefix = event_id(handler, dedupe_key, 0).rpartition(":")[0] + ":"
    out: list[dict[str, Any]] = []
    async for position, fields in _scan(client, keys.outbox):
        if fields.get(b"event", b"").decode().startswith(prefix):
            emission, _ = emission_of(fields)
            out.append(
                {
                    "event_id": emission.event_id,
                    "state": "pending",
                    "topic": emission.topic,
                    "written": iso_ms(stream_id_ms(position)),
                }
            )
    async for position, fields in _scan(client, keys.outbox_published):
        event = fields.get(b"event", b"").decode()
        if event.startswith(prefix):
            out.append(
                {
                    "event_id": event,
                    "state": "published",
                    "store": fields.get(b"store", b"").decode(),
                    "topic": fields.get(b"topic", b"").decode(),
                    "partition": int(fields.get(b"partition", b"-1")),
                    "offset": int(fields.get(b"offset", b"-1")),
                    "published": iso_ms(stream_id_ms(position)),
                }
            )
    return out


async def trace(
    settings: Settings, registry: Registry, dedupe_key: str, *, handler: str | None = None
) -> Trace:
    """Everything the worker's stores say about ``dedupe_key`` (for ``handler``, or all)."""
    bound: list[tuple[str, Handler[Any]]] = [
        (topic, h) for topic, h in registry.items() if handler is None or h.name == handler
    ]
    if handler is not None and not bound:
        raise LookupError(f"no handler named {handler!r} is bound to a topic")
    keys = RedisKeys(settings.redis.effective_prefix)
    client = make_client(settings.redis)
    try:
        markers = {h.name: await _marker_for(client, keys, h.name, dedupe_key) for _, h in bound}
        emitted = {
            h.name: tuple(await emitted_for(client, keys, h.name, dedupe_key))
            for _, h in bound
            if h.emits
        }
    finally:
        await client.aclose()
    retries = await list_retries(
        settings, registry, RetryFilter(dedupe_keys=frozenset({dedupe_key}))
    )
    events = await outcome_events(settings, dedupe_key)
    # A dead letter cut to its last size tier carries a long key as its digest.
    as_written = frozenset({dedupe_key, long_keys.written(dedupe_key)[0]})
    traces = []
    for topic, h in bound:
        letters = await list_dead_letters(settings, topic, DeadLetterFilter(dedupe_keys=as_written))
        own_letters = tuple(d for d in letters if d.handler in ("", h.name))
        own_retries = tuple(r for r in retries if r.handler == h.name)
        own_events = tuple(e for e in events if e.get("handler") == h.name)
        marker = markers[h.name]
        traces.append(
            HandlerTrace(
                handler=h.name,
                topic=topic,
                marker=marker,
                retries=own_retries,
                dead_letters=own_letters,
                events=own_events,
                state=summarise(marker, own_retries, own_letters),
                emitted=emitted.get(h.name, ()),
            )
        )
    ledger = await ledger_for(settings, dedupe_key)
    return Trace(dedupe_key, tuple(traces), tuple(ledger))
