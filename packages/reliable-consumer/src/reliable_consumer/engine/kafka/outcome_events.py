"""The outcome events' wire format: how the audit trail is written, and the one way to read it.

Each record the worker finishes has an outcome event (docs/contracts.md, "Outcome event").
They travel as one Kafka record per finished batch and source partition
(layout 2): the fields every record of the batch shares (source topic and partition, the
time the batch became durable, the worker) are written once, and each record adds one entry
to seven arrays. A Kafka record per event (layout 1, written before) cost the worker and the
broker as much as a quarter of the record's whole path; a document per batch costs a few
array slots (docs/performance.md, "The audit trail's cost").

Every document fits the outcomes topic, whatever a record held: a long dedupe key is written
as its digest and flagged (``long_keys``; layout 2 lists the digested entries under
``digested``, layout 1 sets ``dedupe_key_digested``), a reason is cut where it is made
(``redaction``), the rest is the worker's own or bounded by Kafka (a topic name), and a
batch's document is cut by size. One entry is a few KiB at most.

Every Python reader goes through ``decode``, which gives the per-record documents of either
layout, so a topic written across an upgrade reads as one list of events.
"""

from __future__ import annotations

import os
import socket
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from reliable_consumer.engine.handlers.redaction import MAX_ERROR_BYTES, cut_utf8
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys

WORKER_ID = f"{socket.gethostname()}-{os.getpid()}"
VERSION = 2
# A batch's document is cut into several below this size: a quarter of Kafka's default
# message.max.bytes (1 MiB), and the worker's producer batch size, so documents pack into
# producer batches whole. The publisher lowers it for an outcomes topic that takes less.
MAX_DOCUMENT_BYTES = 256 * 1024
# Layout 2's list of the entries whose dedupe_key is a digest (absent when none is).
DIGESTED = "digested"
# A per-record document's flag: its dedupe_key is the digest of a long key (long_keys.py).
KEY_DIGESTED = "dedupe_key_digested"
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
    KEY_DIGESTED,
)

Layout = Literal["batch", "record"]
"""``batch``: a document per batch and source partition (layout 2, the default);
``record``: a Kafka record per event (layout 1, as written before layout 2)."""

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
    ``max_bytes``. A long dedupe key is written as its digest (``long_keys``), so one entry
    stays a few KiB whatever the record held; an entry still larger than ``max_bytes`` (a
    limit that small, or a reason nobody cut) goes alone, its reason cut."""
    groups: dict[tuple[str, int], list[Event]] = {}
    suspects: set[tuple[str, int]] = set()
    short = _SHORT_ASCII_KEY
    for event in events:
        delivery = event[0]
        where = (delivery.topic, delivery.partition)
        group = groups.get(where)
        if group is None:
            groups[where] = [event]
        else:
            group.append(event)
        # Cheap: most keys are short ASCII; only their groups' keys are looked at again.
        key = event[3]
        if key is not None and (len(key) > short or not key.isascii()):
            suspects.add(where)
    out: list[Encoded] = []
    for where, group in groups.items():
        deliveries, outcomes, handlers, keys, reasons = zip(*group, strict=True)
        digested: list[int] = []
        if where in suspects:
            keys, digested = _written_keys(keys)
        columns = _Columns(where[0], where[1], deliveries, outcomes, handlers, keys, reasons)
        columns.documents(digested, at_ms, max_bytes, out)
    return out


_SHORT_ASCII_KEY = long_keys.LONG_KEY_BYTES


def _written_keys(keys: Sequence[str | None]) -> tuple[tuple[str | None, ...], list[int]]:
    """The keys as written (long ones as digests), and the positions of the digests."""
    written: list[str | None] = []
    digested: list[int] = []
    for i, key in enumerate(keys):
        if key is not None and long_keys.is_long(key):
            key = long_keys.digest(key)
            digested.append(i)
        written.append(key)
    return tuple(written), digested


@dataclass(frozen=True, slots=True)
class _Columns:
    """One source partition's events as the arrays of its documents."""

    topic: str
    partition: int
    deliveries: Sequence[Delivery]
    outcomes: Sequence[Outcome]
    handlers: Sequence[str]
    keys: Sequence[str | None]
    reasons: Sequence[str | None]

    def documents(
        self, digested: list[int], at_ms: int, max_bytes: int, out: list[Encoded]
    ) -> None:
        """Append the documents of these events to ``out``, split by size, in order."""
        value = self._value(self.reasons, digested, at_ms)
        n = len(self.deliveries)
        if len(value) > max_bytes and n == 1 and self.reasons[0] is not None:
            # Every reason the worker writes is cut where it is made (redaction.py); this
            # keeps the bound whoever made it.
            value = self._value([cut_utf8(self.reasons[0])], digested, at_ms)
        if len(value) <= max_bytes or n == 1:
            out.append((source_key(self.topic, self.partition), value))
            return
        pieces = min(n, -(-len(value) // max_bytes))
        step = -(-n // pieces)
        for start in range(0, n, step):
            end = start + step
            part = _Columns(
                self.topic,
                self.partition,
                self.deliveries[start:end],
                self.outcomes[start:end],
                self.handlers[start:end],
                self.keys[start:end],
                self.reasons[start:end],
            )
            mine = [i - start for i in digested if start <= i < end]
            part.documents(mine, at_ms, max_bytes, out)

    def _value(self, reasons: Sequence[str | None], digested: list[int], at_ms: int) -> bytes:
        document: dict[str, Any] = {
            "v": VERSION,
            "topic": self.topic,
            "partition": self.partition,
            "finished_at": at_ms,
            "worker": WORKER_ID,
            "events": {
                "offset": [d.offset for d in self.deliveries],
                "event": self.outcomes,
                "handler": self.handlers,
                "dedupe_key": self.keys,
                "attempt": [d.attempt for d in self.deliveries],
                "reason": reasons,
                "record_ts": [d.timestamp_ms for d in self.deliveries],
            },
        }
        if digested:
            document[DIGESTED] = digested
        return orjson.dumps(document)


def encode_record(
    delivery: Delivery,
    event: Outcome,
    handler: str,
    dedupe_key: str | None,
    reason: str | None,
    at_ms: int,
) -> Encoded:
    """Layout 1: one record's event as its own Kafka record, keyed by its dedupe key (a long
    one by its digest, flagged in the document)."""
    d = delivery
    digested = False
    if dedupe_key is not None:
        dedupe_key, digested = long_keys.written(dedupe_key)
    if reason is not None and len(reason) > _REASON_CHARS:
        reason = cut_utf8(reason)
    document: dict[str, Any] = {
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
    if digested:
        document[KEY_DIGESTED] = True
    key = dedupe_key.encode() if dedupe_key is not None else None
    return key, orjson.dumps(document)


# A reason of at most this many characters is at most MAX_ERROR_BYTES of UTF-8: only a
# longer one (none the worker makes) is measured, and cut.
_REASON_CHARS = MAX_ERROR_BYTES // 4


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
        doc[KEY_DIGESTED] = doc.get(KEY_DIGESTED) is True
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
    n = lengths.pop()
    digested = doc.get(DIGESTED, [])
    if not isinstance(digested, list) or not all(type(i) is int and 0 <= i < n for i in digested):
        raise UnreadableOutcome(f"a layout-2 document whose {DIGESTED!r} is not entry positions")
    flagged = frozenset(digested)
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
            KEY_DIGESTED: i in flagged,
        }
        for i, (offset, event, handler, dedupe_key, attempt, reason, record_ts) in enumerate(
            zip(*arrays, strict=True)
        )
    ]


def decode_all(values: Sequence[bytes | None]) -> list[dict[str, Any]]:
    """Every event of these records, in order; raises at the first unreadable one."""
    return [event for value in values for event in decode(value)]


def mentions(value: bytes | None, dedupe_key: str) -> bool:
    """Whether a record may hold an event of ``dedupe_key`` as written (``long_keys.written``):
    a cheap test before ``decode``.

    The writer encodes keys as orjson does, so a document without the key's JSON text holds
    no event of it.
    """
    return value is not None and orjson.dumps(dedupe_key) in value
