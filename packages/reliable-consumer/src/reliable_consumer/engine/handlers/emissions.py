"""What a handler emits: downstream records written with its effects, published later.

A handler that tells the rest of the company what it did ("purchase granted") must not
produce from a client of its own: a crash before its effects are durable would publish an
event for a grant that never happened, and a redelivery would publish it twice. It queues
them on ``ctx.emit`` instead. The engine writes them to the outbox in the same atomic unit
as the record's effects (FINISH's script for the Redis store, the wave's transaction for
the PostgreSQL store), and only when those effects are applied: never for a duplicate, a
conflict, a parked or a dead-lettered record. The relay (``engine/outbox/``) publishes
them in order. Each carries an event id derived from its record's dedupe key, the same on
every copy, so a consumer dedupes one the relay had to publish twice.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from pydantic import BaseModel

from reliable_consumer.engine.declaration.naming import TOPIC_NAME
from reliable_consumer.engine.errors import ConfigurationError, PermanentError

# The header every emitted record carries: the same value on every copy of one event.
EVENT_ID_HEADER = "event-id"
MAX_EMISSIONS = 100  # per record: an outbox entry is written atomically with its effects
# Kafka's default message.max.bytes (1 MiB + 12) less room for the key, headers and framing.
# When the start-up check read the topic's own max.message.bytes, the whole record (in a
# batch of its own: key, value, headers, the event id, framing) must also fit that.
MAX_VALUE_BYTES = 1_000_000
MAX_KEY_BYTES = 16_384

EmittedValue = bytes | str | BaseModel | Mapping[str, Any]
HeaderValue = bytes | str


class InvalidEmission(PermanentError, ValueError):
    """An emission that can never be published whatever the data: a bug, never retried.

    Raised when the handler emits it, so it is the handler's own failure (a dead letter
    with reason ``permanent``), never a record whose effects applied without its event.
    """


def event_id(handler: str, dedupe_key: str, index: int) -> str:
    """The event's identity: its handler, its record's dedupe key (hashed), its position.

    A retry that succeeds emits the same ids as the attempt that failed would have, and the
    relay's second copy of a published entry carries the stored one: one id per event.
    """
    digest = hashlib.sha256(dedupe_key.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"{handler}:{digest}:{index}"


def check_emits(handler: str, topics: Iterable[str]) -> frozenset[str]:
    """The topics a handler declares it emits to, each a valid Kafka topic name."""
    declared: set[str] = set()
    for topic in topics:
        if not isinstance(topic, str) or not TOPIC_NAME.fullmatch(topic) or topic in {".", ".."}:
            raise ConfigurationError(
                f"handler {handler!r}: emits={topic!r} is not a Kafka topic name "
                "(1-249 letters, digits, '.', '_' or '-')"
            )
        declared.add(topic)
    return frozenset(declared)


@dataclass(frozen=True, slots=True)
class Emission:
    """One record to publish: where, what, and the id every copy of it carries."""

    topic: str
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    event_id: str

    def kafka_headers(self) -> list[tuple[str, bytes]]:
        """The headers as published: the handler's, then the event id."""
        return [*self.headers, (EVENT_ID_HEADER, self.event_id.encode())]


def _encode_value(value: EmittedValue) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, BaseModel):
        return value.model_dump_json().encode()
    if isinstance(value, Mapping):
        try:
            return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise InvalidEmission(f"an emitted mapping must be JSON: {exc}") from None
    raise InvalidEmission(
        f"an emitted value is bytes, str, a pydantic model or a mapping, not {type(value).__name__}"
    )


def _encode_key(key: bytes | str | None) -> bytes | None:
    if key is None or isinstance(key, bytes):
        encoded = key
    elif isinstance(key, str):
        encoded = key.encode("utf-8")
    else:
        raise InvalidEmission(f"an emitted key is bytes, str or None, not {type(key).__name__}")
    if encoded is not None and len(encoded) > MAX_KEY_BYTES:
        raise InvalidEmission(f"an emitted key is at most {MAX_KEY_BYTES} bytes")
    return encoded


def _encode_headers(
    headers: Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]],
) -> tuple[tuple[str, bytes], ...]:
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    encoded: list[tuple[str, bytes]] = []
    for name, value in pairs:
        if not isinstance(name, str):
            raise InvalidEmission(f"a header name is a str, not {type(name).__name__}")
        if name == EVENT_ID_HEADER:
            raise InvalidEmission(
                f"the header {EVENT_ID_HEADER!r} is the engine's: every emitted record "
                "carries its event id there"
            )
        if isinstance(value, str):
            value = value.encode("utf-8")
        elif not isinstance(value, bytes):
            raise InvalidEmission(
                f"header {name!r}: a value is bytes or str, not {type(value).__name__}"
            )
        encoded.append((name, value))
    return tuple(encoded)


def record_bytes(emission: Emission) -> int:
    """The most a record batch holding only ``emission`` can take on the wire: what a
    topic's max.message.bytes is compared with."""
    headers: list[tuple[str, bytes | None]] = list(emission.kafka_headers())
    return int(
        DefaultRecordBatchBuilder.estimate_size_in_bytes(emission.key, emission.value, headers)
    )


@dataclass(slots=True)
class Emissions:
    """The records a handler emitted for one delivery, checked as they are queued."""

    handler: str
    declared: frozenset[str]
    dedupe_key: str
    # Topic -> its max.message.bytes, where the start-up check read it.
    limits: Mapping[str, int] = field(default_factory=dict)
    emitted: list[Emission] = field(default_factory=list)

    def emit(
        self,
        topic: str,
        value: EmittedValue,
        *,
        key: bytes | str | None = None,
        headers: Mapping[str, HeaderValue] | Iterable[tuple[str, HeaderValue]] = (),
    ) -> str:
        """Queue one record for ``topic``; returns the event id it will carry."""
        if topic not in self.declared:
            declared = ", ".join(sorted(self.declared)) or "none"
            raise InvalidEmission(
                f"handler {self.handler!r} emits to {topic[:250]!r}, which it does not "
                f"declare (emits: {declared}); add it to @handler(..., emits=(...))"
            )
        if len(self.emitted) >= MAX_EMISSIONS:
            raise InvalidEmission(f"a record emits at most {MAX_EMISSIONS} records")
        encoded = _encode_value(value)
        if len(encoded) > MAX_VALUE_BYTES:
            raise InvalidEmission(
                f"an emitted value is at most {MAX_VALUE_BYTES} bytes, got {len(encoded)}"
            )
        identity = event_id(self.handler, self.dedupe_key, len(self.emitted))
        emission = Emission(topic, _encode_key(key), encoded, _encode_headers(headers), identity)
        limit = self.limits.get(topic)
        if limit is not None:
            size = record_bytes(emission)
            if size > limit:
                raise InvalidEmission(
                    f"an emitted record of {size} bytes (key, value, headers and framing) "
                    f"does not fit topic {topic[:250]!r}, whose max.message.bytes is {limit}"
                )
        self.emitted.append(emission)
        return identity

    def __len__(self) -> int:
        return len(self.emitted)
