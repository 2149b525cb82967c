"""The outcome events' wire format: how the audit trail is written, and the one way to read it.

Each record the worker finishes has an outcome event (docs/contracts.md, "Outcome event").
Since issue 19 they travel as one Kafka record per finished batch and source partition
(layout 2): the fields every record of the batch shares (source topic and partition, the
time the batch became durable, the worker) are written once, and each record adds one entry
to seven arrays. A Kafka record per event (layout 1, written before) cost the worker and the
broker as much as a quarter of the record's whole path; a document per batch costs a few
array slots (docs/performance.md, "The audit trail's cost").

Every Python reader goes through ``decode``, which gives the per-record documents of either
layout, so a topic written across an upgrade reads as one list of events.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Sequence
from typing import Any, Literal

import orjson

from service.engine.records import Delivery, Outcome

WORKER_ID = f"{socket.gethostname()}-{os.getpid()}"
VERSION = 2
# A batch's document is cut into several below this size: a quarter of Kafka's default
# message.max.bytes (1 MiB), and the worker's producer batch size, so documents pack into
# producer batches whole.
MAX_DOCUMENT_BYTES = 256 * 1024
# The per-record arrays of a layout-2 document, in the order the contract lists them.
ENTRY_FIELDS = ("offset", "event", "handler", "dedupe_key", "attempt", "reason", "record_ts")
# The fields of a per-record document, in the order layout 1 wrote them.
DOCUMENT_FIELDS = (
    "event",
    "handler",
    "dedupe_key",
    "topic",
    "partition",
    "offset",
    "attempt",
    "reason",
    "record_ts",
    "finished_at",
    "worker",
)

Layout = Literal["batch", "record"]
"""``batch``: a document per batch and source partition (layout 2, the default);
``record``: a Kafka record per event (layout 1, as written before issue 19)."""

Event = tuple[Delivery, Outcome, str, str | None, str | None]
"""What became of one record, as the worker hands it over: the record, its outcome, its
handler's name, its dedupe key (None when it could not be decoded) and the reason (None
for a success)."""

Encoded = tuple[bytes | None, bytes]
"""A Kafka record's key and value."""


class UnreadableOutcome(ValueError):
    """An outcomes-topic record that is neither layout: the message says what is wrong."""


def partition_of(key: bytes, partitions: int) -> int:
    """The outcomes partition (an index into the sorted partition ids) a key goes to."""
    return zlib.crc32(key) % partitions


def source_key(topic: str, partition: int) -> bytes:
    """A layout-2 document's Kafka key: its source partition, ``topic/partition``."""
    return f"{topic}/{partition}".encode()


def encode(events: Sequence[Event], at_ms: int, layout: Layout = "batch") -> list[Encoded]:
    """The Kafka records that carry ``events``, which became durable at ``at_ms``."""
    if layout == "record":
        return [encode_record(*event, at_ms) for event in events]
    return encode_batch(events, at_ms)


def encode_batch(
    events: Sequence[Event], at_ms: int, max_bytes: int = MAX_DOCUMENT_BYTES
) -> list[Encoded]:
    """Layout 2: one document per source partition (in the order the partitions first
    appear), its entries in the order given, cut into several documents where one would pass
    ``max_bytes``. A single entry larger than that still goes, alone."""
    groups: dict[tuple[str, int], list[Event]] = {}
    for event in events:
        delivery = event[0]
        where = (delivery.topic, delivery.partition)
        group = groups.get(where)
        if group is None:
            groups[where] = [event]
        else:
            group.append(event)
    out: list[Encoded] = []
    for (topic, partition), group in groups.items():
        key = source_key(topic, partition)
        _documents(key, topic, partition, group, at_ms, max_bytes, out)
    return out


def _documents(
    key: bytes,
    topic: str,
    partition: int,
    group: Sequence[Event],
    at_ms: int,
    max_bytes: int,
    out: list[Encoded],
) -> None:
    """Append the documents of one source partition's events to ``out``, split by size."""
    deliveries, outcomes, handlers, dedupe_keys, reasons = zip(*group, strict=True)
    value = orjson.dumps(
        {
            "v": VERSION,
            "topic": topic,
            "partition": partition,
            "finished_at": at_ms,
            "worker": WORKER_ID,
            "events": {
                "offset": [d.offset for d in deliveries],
                "event": outcomes,
                "handler": handlers,
                "dedupe_key": dedupe_keys,
                "attempt": [d.attempt for d in deliveries],
                "reason": reasons,
                "record_ts": [d.timestamp_ms for d in deliveries],
            },
        }
    )
    if len(value) <= max_bytes or len(group) == 1:
        out.append((key, value))
        return
    pieces = min(len(group), -(-len(value) // max_bytes))
    step = -(-len(group) // pieces)
    for start in range(0, len(group), step):
        _documents(key, topic, partition, group[start : start + step], at_ms, max_bytes, out)


def encode_record(
    delivery: Delivery,
    event: Outcome,
    handler: str,
    dedupe_key: str | None,
    reason: str | None,
    at_ms: int,
) -> Encoded:
    """Layout 1: one record's event as its own Kafka record, keyed by its dedupe key."""
    d = delivery
    document = {
        "event": event,
        "handler": handler,
        "dedupe_key": dedupe_key,
        "topic": d.topic,
        "partition": d.partition,
        "offset": d.offset,
        "attempt": d.attempt,
        "reason": reason,
        "record_ts": d.timestamp_ms,
        "finished_at": at_ms,
        "worker": WORKER_ID,
    }
    key = dedupe_key.encode("utf-8", "replace") if dedupe_key is not None else None
    return key, orjson.dumps(document)


def decode(value: bytes | None) -> list[dict[str, Any]]:
    """The per-record documents an outcomes-topic record carries, in the order written.

    Either layout; each document has the fields of docs/contracts.md (``DOCUMENT_FIELDS``).
    Raises ``UnreadableOutcome`` for anything else: readers decide whether to skip it.
    """
    if value is None:
        raise UnreadableOutcome("the record has no value")
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise UnreadableOutcome(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise UnreadableOutcome(f"not a JSON object but {type(doc).__name__}")
    version = doc.get("v")
    if version is None:
        if not isinstance(doc.get("event"), str):
            raise UnreadableOutcome("a layout-1 event without an 'event' name")
        return [doc]
    if version != VERSION:
        raise UnreadableOutcome(f"unknown layout version {version!r}")
    return _entries(doc)


def _entries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    columns = doc.get("events")
    if not isinstance(columns, dict):
        raise UnreadableOutcome("a layout-2 document without its 'events' arrays")
    arrays = [columns.get(name) for name in ENTRY_FIELDS]
    missing = [n for n, a in zip(ENTRY_FIELDS, arrays, strict=True) if not isinstance(a, list)]
    if missing:
        raise UnreadableOutcome(f"a layout-2 document without the arrays {missing}")
    lengths = {len(a) for a in arrays if isinstance(a, list)}
    if len(lengths) != 1:
        raise UnreadableOutcome(f"a layout-2 document whose arrays differ in length {lengths}")
    shared = [doc.get(name) for name in ("topic", "partition", "finished_at", "worker")]
    topic, partition, finished_at, worker = shared
    return [
        {
            "event": event,
            "handler": handler,
            "dedupe_key": dedupe_key,
            "topic": topic,
            "partition": partition,
            "offset": offset,
            "attempt": attempt,
            "reason": reason,
            "record_ts": record_ts,
            "finished_at": finished_at,
            "worker": worker,
        }
        for offset, event, handler, dedupe_key, attempt, reason, record_ts in zip(
            *arrays, strict=True
        )
    ]


def decode_all(values: Sequence[bytes | None]) -> list[dict[str, Any]]:
    """Every event of these records, in order; raises at the first unreadable one."""
    return [event for value in values for event in decode(value)]


def mentions(value: bytes | None, dedupe_key: str) -> bool:
    """Whether a record may hold an event of ``dedupe_key``: a cheap test before ``decode``.

    The writer encodes keys as orjson does, so a document without the key's JSON text holds
    no event of it.
    """
    return value is not None and orjson.dumps(dedupe_key) in value
