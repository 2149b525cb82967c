"""One record's state on its way through a batch, and how a batch is cut into waves.

A ``Job`` carries what each stage learns (handler, payload, dedupe key, claim, effects)
and the fate decided so far; the stages (decisions.py, processing.py, runner.py) read and
set it, and only the last stages make the fate durable.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import BaseModel

from reliable_consumer.engine.handlers.context import Effects
from reliable_consumer.engine.handlers.emissions import Emissions
from reliable_consumer.engine.handlers.registry import Handler
from reliable_consumer.engine.observation.tracing import RecordSpan
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.redis import long_keys


class Fate(Enum):
    """Where a record is heading, decided stage by stage, made durable at the end."""

    SUCCEEDED = "succeeded"
    DUPLICATE = "duplicate"
    PARK = "park"
    DEAD_LETTER = "dead_letter"
    # Its handler's circuit is open: run it again once the breaker lets it (a fresh record
    # waits in memory, its offset uncommitted; a retry goes back to the queue, same attempt).
    HOLD = "hold"


@dataclass(slots=True)
class Job:
    """One record's state through the stages of its batch."""

    delivery: Delivery
    handler: Handler[Any] | None = None
    payload: BaseModel | None = None
    dedupe_key: str | None = None
    idem_key: str = ""
    token: str = ""
    fingerprint: str = ""
    optimistic: bool = False  # an effects-only handler's delivery: no claim, checked at finish
    holds_claim: bool = False
    claim_until: float = 0.0  # monotonic time the claim surely lasts to (from its send time)
    effects: Effects | None = None
    # What its handler emitted, written to the outbox with the effects (None: emits nothing).
    emissions: Emissions | None = None
    fate: Fate | None = None
    reason: str | None = None  # dead-letter reason, retry error, or duplicate kind
    detail: str = ""  # dead-letter error text
    next_attempt: int = 0
    delay_ms: int = 0
    outcome: Outcome | None = None
    # Its Kafka key's chain in the delay queue ('' when its retries keep no order), and
    # whether it parks only to wait behind an earlier record there (no attempt used).
    chain: str = ""
    blocked: bool = False
    # Its handler was called in this pass; it was admitted as its breaker's half-open probe.
    ran: bool = False
    probe: bool = False
    # A postgres handler's record: its transaction committed (its inbox row is kept), and
    # whether that row was an earlier delivery's (a duplicate) rather than this one's.
    committed: bool = False
    inbox_duplicate: bool = False
    # Its processing span while tracing is on (observation/tracing.py, batch/traces.py).
    span: RecordSpan | None = None

    @property
    def name(self) -> str:
        return self.handler.name if self.handler else ""

    def dead_letter(self, reason: str, detail: str) -> None:
        self.fate, self.reason, self.detail = Fate.DEAD_LETTER, reason, detail

    def park(self, attempt: int, error: str, delay_ms: int) -> None:
        self.fate, self.reason = Fate.PARK, error
        self.next_attempt, self.delay_ms = attempt, delay_ms

    def park_behind(self) -> None:
        """Wait in the delay queue behind an earlier record of its key, same attempt."""
        self.park(self.delivery.attempt, BLOCKED, 0)
        self.blocked = True


# Why a record waits without having failed: its key's chain holds an earlier record.
BLOCKED = "blocked: an earlier record of its Kafka key waits in the delay queue"


def key_waves(jobs: list[Job]) -> list[list[Job]]:
    """Split so that records sharing a Kafka key land in successive waves, in order."""
    keys = [job.delivery.key for job in jobs]
    if None not in keys and len(set(keys)) == len(keys):
        return [jobs]  # the common case: every key once
    out: list[list[Job]] = []
    seen: Counter[bytes] = Counter()
    for job in jobs:
        key = job.delivery.key
        n = 0
        if key is not None:
            n = seen[key]
            seen[key] += 1
        if n == len(out):
            out.append([])
        out[n].append(job)
    return out


def log_fields(job: Job) -> dict[str, object]:
    """A record's coordinates and key for a log line; a long key as its digest (a megabyte
    key would otherwise be repeated in every line about the record)."""
    d = job.delivery
    fields: dict[str, object] = {
        "topic": d.topic,
        "partition": d.partition,
        "offset": d.offset,
        "attempt": d.attempt,
        "dedupe_key": job.dedupe_key,
    }
    if job.dedupe_key is not None and long_keys.is_long(job.dedupe_key):
        fields["dedupe_key"] = long_keys.digest(job.dedupe_key)
        fields["dedupe_key_digested"] = True
    return fields
