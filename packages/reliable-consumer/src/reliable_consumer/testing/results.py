"""What the handler test kit reports of one run of one record, and of a stall."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_consumer.engine.records import Outcome
from reliable_consumer.testing.producer import ProducedRecord


class KitStalled(RuntimeError):
    """The worker would hold the record here until an operator acts (a stall)."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(f"{cause}: {detail}")
        self.cause = cause
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Result:
    """What became of one run of one record, read back from what the path wrote."""

    topic: str
    partition: int
    offset: int
    attempt: int  # the run this result is of (1 for a fresh record)
    # None when the record was held by an open circuit (no fate yet: uncommitted).
    outcome: Outcome | None
    # As the outcome event carries it: a key over 256 bytes as its digest (``sha256:...``,
    # ``event["dedupe_key_digested"]``; docs/contracts.md, "Long dedupe keys").
    dedupe_key: str | None
    # Dead-lettered: the x-dlq-reason ("invalid_payload", "permanent", "exhausted", ...);
    # parked: why (the error text, or "blocked: ..." behind an earlier record of its key);
    # duplicate: "done" or "dead" (the key's marker).
    reason: str | None
    error: str | None = None  # a dead letter's x-dlq-error
    delay_s: float | None = None  # parked: the delay its retry policy chose
    dead_letter: ProducedRecord | None = None
    event: Mapping[str, Any] = field(default_factory=dict)  # the outcome event, decoded

    @property
    def granted(self) -> bool:
        """Succeeded: the handler ran and its effects were written with the done-marker."""
        return self.outcome is Outcome.SUCCEEDED

    @property
    def duplicate(self) -> bool:
        return self.outcome is Outcome.DUPLICATE

    @property
    def parked(self) -> bool:
        return self.outcome is Outcome.RETRY_SCHEDULED

    @property
    def dead_lettered(self) -> bool:
        return self.outcome is Outcome.DEAD_LETTERED

    @property
    def held(self) -> bool:
        return self.outcome is None

    @property
    def retry_id(self) -> str:
        return f"{self.topic}/{self.partition}/{self.offset}"
