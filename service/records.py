"""A record on its way through the worker, and how its journey ended.

A ``Delivery`` is either a fresh Kafka record or a retry taken from the delay
queue; both travel the same path. Everything a retry needs to run again later (raw
key, value and headers, its source coordinates, the attempt count) is in it, so a
parked retry does not depend on Kafka still holding the record.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


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
        )


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(data: str | None) -> bytes | None:
    return None if data is None else base64.b64decode(data)
