"""What the relay needs of an outbox store, whichever store holds the emitted records.

The relay is the same for every store: read the oldest unpublished entries in the order
they were written, publish them, and only once Kafka acknowledged them mark them
published. A store answers those three questions and says how deep it is, so one relay,
one set of metrics and one stall serve the Redis and the PostgreSQL outbox alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from reliable_consumer.engine.handlers.emissions import Emission


@dataclass(frozen=True, slots=True)
class PendingEmission:
    """An entry of the outbox not yet known to be published, in the order it was written."""

    position: str  # the store's own id of the entry (a stream id, a row id)
    emission: Emission
    written_ms: int  # when the effects it belongs to were applied (the store's clock)


@dataclass(frozen=True, slots=True)
class OutboxDepth:
    """How far the relay is behind: entries waiting, and the age of the oldest."""

    pending: int
    oldest_age_s: float | None  # None when nothing waits


class OutboxStore(Protocol):
    """An outbox the relay publishes from."""

    name: str  # "redis" or "postgres": the label of its metrics and stall

    async def pending(self, limit: int) -> Sequence[PendingEmission]:
        """The oldest ``limit`` unpublished entries, oldest first."""
        ...

    async def mark_published(self, entries: Sequence[PendingEmission]) -> None:
        """Record that Kafka acknowledged ``entries``: they are never handed out again."""
        ...

    async def depth(self) -> OutboxDepth:
        """What waits, for the metrics and the stall."""
        ...
