"""A record on its way through the worker, and how its journey ended.

A ``Delivery`` is either a fresh Kafka record or a retry taken from the delay
queue; both travel the same path. Everything a retry needs to run again later (raw
key, value and headers, its source coordinates, the attempt count) is in it, so a
parked retry does not depend on Kafka still holding the record.

Headers in the worker's reserved namespace (``x-dlq-*``, ``x-redrive-*``, the fault
header) mean something to the worker, its tools and its readers, so a producer must not
be able to send them: ``clean_headers`` drops them where a ``Delivery`` is built from a
Kafka record, before anything reads or copies them. The one exception is a single
``x-redrive-of``, kept for the processor to check against the redrive's ticket in Redis
(see ``reliable_consumer.ops.redrive``); without a valid ticket it is dropped too.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Fault injection's header (handlers/faults.py), honoured only while it is on.
FAULT_HEADER = "x-fault"
# Set by ``service dlq redrive`` on what it sends back: the dead letter's coordinates.
REDRIVE_HEADER = "x-redrive-of"
# The worker's namespace in record headers (compared case-insensitively).
RESERVED_PREFIXES = ("x-dlq-", "x-redrive-")


def clean_headers(
    headers: Iterable[tuple[str, bytes | None]], *, fault_injection: bool
) -> tuple[tuple[str, bytes], ...]:
    """A record's headers without the reserved ones a producer may not set; one pass.

    Keeps ``x-redrive-of`` (exact spelling) for the redrive ticket check, and the fault
    header only while fault injection is on.
    """
    out = []
    for key, value in headers:
        low = key.lower()
        if low.startswith(RESERVED_PREFIXES):
            if key != REDRIVE_HEADER:
                continue
        elif low == FAULT_HEADER and not fault_injection:
            continue
        out.append((key, value or b""))
    return tuple(out)


def redrive_of(headers: tuple[tuple[str, bytes], ...]) -> bytes | None:
    """The one ``x-redrive-of`` value; None when absent or repeated (never a redrive's)."""
    found = [v for k, v in headers if k == REDRIVE_HEADER]
    return found[0] if len(found) == 1 else None


def without_redrive(headers: tuple[tuple[str, bytes], ...]) -> tuple[tuple[str, bytes], ...]:
    return tuple((k, v) for k, v in headers if k != REDRIVE_HEADER)


def redrive_ticket_value(topic: str, value: bytes | None) -> str:
    """What a redrive ticket holds: the exact record it admits (topic and value digest).

    A copied ``x-redrive-of`` on any other content finds a ticket that does not match.
    """
    digest = "-" if value is None else hashlib.sha256(value).hexdigest()
    return f"{topic}|{digest}"


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    RETRY_SCHEDULED = "retry_scheduled"
    DEAD_LETTERED = "dead_lettered"
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class Delivery:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int
    attempt: int = 1
    retry_lease: int | None = None  # fencing deadline of the retry claim, when a retry
    first_failed_ms: int | None = None
    last_error: str | None = None
    # The Redis key of its Kafka key's chain when it waits in order behind earlier records
    # of that key (RedisKeys.retry_chain), '' when its retries keep no order.
    chain: str = ""
    # This process's monotonic time the retry lease surely lasts to (from the send time of
    # the call that took or stretched it); 0.0 when unknown. Local only: never stored.
    leased_until: float = 0.0
    # The sharded layout's order shard a retry was claimed from (``{<prefix>:o<n>}``): where
    # its item, lease and chain live, so where its FINISH_ORDER and re-park go. '' on one
    # Redis and for a fresh record. Local only: the shard it is read from says it.
    order_tag: str = ""

    @property
    def retry_id(self) -> str:
        """The delay-queue id: the source coordinates, so re-parking is idempotent."""
        return f"{self.topic}/{self.partition}/{self.offset}"

    @property
    def is_retry(self) -> bool:
        return self.retry_lease is not None

    @property
    def coordinates(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            "topic": self.topic,
            "partition": self.partition,
            "offset": self.offset,
            "key": _b64(self.key),
            "value": _b64(self.value),
            "headers": [[k, _b64(v)] for k, v in self.headers],
            "timestamp_ms": self.timestamp_ms,
            "attempt": self.attempt,
            "first_failed_ms": self.first_failed_ms,
            "last_error": self.last_error,
        }
        if self.chain:
            doc["chain"] = self.chain
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes, *, lease: int) -> Delivery:
        doc = json.loads(raw)
        return cls(
            topic=doc["topic"],
            partition=int(doc["partition"]),
            offset=int(doc["offset"]),
            key=_unb64(doc["key"]),
            value=_unb64(doc["value"]),
            headers=tuple((str(k), _unb64(v) or b"") for k, v in doc["headers"]),
            timestamp_ms=int(doc["timestamp_ms"]),
            attempt=int(doc["attempt"]),
            retry_lease=lease,
            first_failed_ms=doc.get("first_failed_ms"),
            last_error=doc.get("last_error"),
            chain=str(doc.get("chain") or ""),
        )


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(data: str | None) -> bytes | None:
    return None if data is None else base64.b64decode(data)
