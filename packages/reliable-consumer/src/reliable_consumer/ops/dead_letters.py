"""Dead letters as an operator sees them: one record of a dead-letter topic, and filters.

``DeadLetter`` is read from a record of ``{topic}.dlq`` (its ``x-dlq-*`` headers, see
docs/contracts.md); ``DeadLetterFilter`` is the one set of filters that ``service dlq
list``, ``service dlq redrive`` and the console share, so "what would move" and "what is
shown" can never disagree.
"""

from __future__ import annotations

import base64
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from reliable_consumer.engine.kafka.acls import naming_refusal, needed, operator_acls
from reliable_consumer.engine.records import REDRIVE_HEADER
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.settings import Settings
from reliable_consumer.ops.audit import read_all, read_from

REASON_HEADER = "x-dlq-reason"
BASE64_PREFIX = "base64:"  # how bytes that are not UTF-8 are shown (``_show``)


def header_text(headers: Iterable[tuple[str, bytes]] | None, name: str) -> str | None:
    """The header's last value as text: the worker appends its ``x-dlq-*`` after the record's."""
    found = None
    for key, value in headers or ():
        if key == name:
            found = value
    return None if found is None else bytes(found or b"").decode("utf-8", "replace")


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter: where it lies, where it came from, and why it is there."""

    topic: str  # the dead-letter topic
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    reason: str
    error: str
    handler: str
    dedupe_key: str
    source_topic: str
    source_partition: int | None
    source_offset: int | None
    attempts: int | None
    at_ms: int | None  # when the worker dead-lettered it (x-dlq-at)
    redrive_of: str | None  # set when the record was itself a redrive that failed again

    @property
    def coordinates(self) -> str:
        """The dead letter's own coordinates: what ``x-redrive-of`` names."""
        return f"{self.topic}/{self.partition}/{self.offset}"

    @classmethod
    def from_record(cls, record: Any) -> DeadLetter:
        headers = tuple((str(k), bytes(v or b"")) for k, v in record.headers or ())

        def text(name: str) -> str | None:
            return header_text(headers, name)

        return cls(
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            timestamp_ms=int(record.timestamp or 0),
            key=None if record.key is None else bytes(record.key),
            value=None if record.value is None else bytes(record.value),
            headers=headers,
            reason=text(REASON_HEADER) or "",
            error=text("x-dlq-error") or "",
            handler=text("x-dlq-handler") or "",
            dedupe_key=text("x-dlq-dedupe-key") or "",
            source_topic=text("x-dlq-source-topic") or "",
            source_partition=_int(text("x-dlq-source-partition")),
            source_offset=_int(text("x-dlq-source-offset")),
            attempts=_int(text("x-dlq-attempts")),
            at_ms=_int(text("x-dlq-at")),
            redrive_of=text(REDRIVE_HEADER),
        )

    def to_json(self, *, with_value: bool = False) -> dict[str, Any]:
        """A JSON-ready view; the value (payload, possibly personal data) only when asked."""
        doc: dict[str, Any] = {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "timestamp_ms": self.timestamp_ms,
            "reason": self.reason,
            "error": self.error,
            "handler": self.handler,
            "dedupe_key": self.dedupe_key,
            "source_topic": self.source_topic,
            "source_partition": self.source_partition,
            "source_offset": self.source_offset,
            "attempts": self.attempts,
            "at_ms": self.at_ms,
            "redrive_of": self.redrive_of,
            "key": _show(self.key),
            "value_bytes": None if self.value is None else len(self.value),
        }
        if with_value:
            doc["value"] = _show(self.value)
            doc["headers"] = [[k, _show(v)] for k, v in self.headers]
        return doc


def _show(data: bytes | None) -> str | None:
    """Bytes for a person: the text when it is UTF-8, else ``base64:`` and the bytes."""
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return BASE64_PREFIX + base64.b64encode(data).decode("ascii")


@dataclass(frozen=True)
class DeadLetterFilter:
    """Which dead letters a command means; every field left None matches everything.

    Offsets and times are inclusive ranges: ``source_partition`` with ``from_offset`` /
    ``to_offset`` picks source records, ``since_ms`` / ``until_ms`` the time the worker
    dead-lettered them (``x-dlq-at``, else the dead letter's own timestamp).
    """

    reasons: frozenset[str] | None = None
    dedupe_keys: frozenset[str] | None = None
    source_partition: int | None = None
    from_offset: int | None = None
    to_offset: int | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    redriven: bool | None = None  # True: only failed redrives; False: only first failures
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def is_empty(self) -> bool:
        return all(
            value is None
            for value in (
                self.reasons,
                self.dedupe_keys,
                self.source_partition,
                self.from_offset,
                self.to_offset,
                self.since_ms,
                self.until_ms,
                self.redriven,
            )
        )

    def matches(self, letter: DeadLetter) -> bool:
        if self.reasons is not None and letter.reason not in self.reasons:
            return False
        if self.dedupe_keys is not None and not long_keys.named_by(
            letter.dedupe_key, self.dedupe_keys
        ):
            return False
        if self.source_partition is not None and letter.source_partition != self.source_partition:
            return False
        offset = letter.source_offset
        if self.from_offset is not None and (offset is None or offset < self.from_offset):
            return False
        if self.to_offset is not None and (offset is None or offset > self.to_offset):
            return False
        at = letter.at_ms if letter.at_ms is not None else letter.timestamp_ms
        if self.since_ms is not None and at < self.since_ms:
            return False
        if self.until_ms is not None and at > self.until_ms:
            return False
        return self.redriven is None or (letter.redrive_of is not None) == self.redriven

    def to_json(self) -> dict[str, Any]:
        """The filters that are set, for the audit log and ``--json`` output."""
        doc: dict[str, Any] = {
            "reasons": sorted(self.reasons) if self.reasons is not None else None,
            "dedupe_keys": sorted(self.dedupe_keys) if self.dedupe_keys is not None else None,
            "source_partition": self.source_partition,
            "from_offset": self.from_offset,
            "to_offset": self.to_offset,
            "since_ms": self.since_ms,
            "until_ms": self.until_ms,
            "redriven": self.redriven,
        }
        return {k: v for k, v in doc.items() if v is not None}


async def list_dead_letters(
    settings: Settings,
    source_topic: str,
    selection: DeadLetterFilter | None = None,
    *,
    limit: int | None = None,
) -> list[DeadLetter]:
    """The dead letters of ``source_topic`` that match, oldest first per partition, up to
    ``limit`` (the latest ones when cut). Reads the dead-letter topic up to its end now."""
    selection = selection or DeadLetterFilter()
    dead = settings.dead_letter_topic(source_topic)
    with naming_refusal(settings.kafka, needed(settings, "Topic", dead, "Read", operator_acls)):
        records = await read_all(settings.kafka, dead)
    letters = [DeadLetter.from_record(r) for r in records]
    found = [letter for letter in letters if selection.matches(letter)]
    found.sort(key=lambda d: (d.at_ms or d.timestamp_ms, d.partition, d.offset))
    return found[-limit:] if limit is not None else found


async def find_dead_letter(
    settings: Settings, source_topic: str, partition: int, offset: int
) -> DeadLetter | None:
    """The dead letter at ``partition``/``offset`` of ``source_topic``'s dead-letter topic."""
    for letter in await list_dead_letters(settings, source_topic):
        if letter.partition == partition and letter.offset == offset:
            return letter
    return None


class DeadLetterTally:
    """Dead letters per reason of each source topic, read incrementally.

    A process that asks again and again (the console refreshing its overview) reads each
    dead-letter topic once, then only what arrived since. Counts are of what was read
    since this tally began: a dead letter the topic's retention deleted later is still
    counted; a recreated topic is counted again from its beginning.
    """

    def __init__(self) -> None:
        self._next: dict[str, dict[int, int]] = {}
        self._counts: dict[str, Counter[str]] = {}

    async def counts(self, settings: Settings, source_topic: str) -> Counter[str]:
        """Reason -> count for ``source_topic``'s dead letters, up to their end now."""
        starts = self._next.get(source_topic, {})
        records, ends = await read_from(
            settings.kafka, settings.dead_letter_topic(source_topic), starts
        )
        counts = self._counts.setdefault(source_topic, Counter())
        if any(ends.get(p, 0) < offset for p, offset in starts.items()):
            counts.clear()  # recreated: read_from went back to its beginning
        for record in records:
            counts[DeadLetter.from_record(record).reason] += 1
        self._next[source_topic] = ends
        return Counter(counts)
