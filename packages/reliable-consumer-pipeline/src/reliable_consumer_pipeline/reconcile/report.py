"""What a reconcile run answers: `ReconcileReport`, the final `STATES`, and where the
per-record table is written (`RECORDS_TABLE`).

The report is what the CLI prints and exits on, what `--json` writes and what `summary/`
holds: one shape for every reader, apart from the steps that fill it in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["RECORDS_TABLE", "STATES", "ReconcileReport"]

STATES = ("granted", "dead_lettered", "retrying", "pending", "lost")
RECORDS_TABLE = "records"
"""The per-record Parquet table's folder under the output directory (`summary` beside it)."""


@dataclass
class ReconcileReport:
    """The summary of one reconcile run; `exit_code` is what the CLI exits with."""

    records: int
    """Rows of the per-record table: dedupe keys, and malformed records by coordinates (a
    key's copies count once here, each in `source_records`)."""
    states: dict[str, int]
    lost: int
    doubled: int
    stuck: int
    malformed: int
    lost_keys: list[str]
    doubled_keys: list[str]
    stuck_keys: list[str]
    dead_letter_reasons: dict[str, int]
    attempts: dict[int, int]
    latency_ms: dict[str, float | None]
    source_records: int
    outcome_events: int
    dead_letters: int
    ledger_entries: int | None
    unverified_grants: int
    ledger_mismatches: int
    records_without_outcome: int
    unreadable_events: int
    snapshot: dict[str, dict[str, int]]
    as_of_ms: int
    out_dir: str
    elapsed_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (snapshot, ledger, outcomes, records, summary), for tuning."""
    lost_grants: int = 0
    """Records with a `succeeded` outcome but no ledger entry: the grant is gone (lost)."""
    grants_store: str | None = None
    """Which store's grants were read: redis, postgres, both; None when none was readable."""
    inbox_rows: int | None = None
    """PostgreSQL inbox rows of the reconciled topics (None: the inbox was not read)."""
    grants_without_inbox: int = 0
    """Grant rows no inbox row vouches for: written outside the worker's transaction."""
    inbox_without_grant: int = 0
    """Inbox rows (records marked done) whose grant row is missing."""
    grants_without_inbox_ids: list[str] = field(default_factory=list)
    inbox_without_grant_keys: list[str] = field(default_factory=list)
    emitted_events: int | None = None
    """Records read from the topics the handlers emit to (None: no events were checked)."""
    event_copies: int = 0
    """Records repeating an event id: the relay's at-least-once copies, deduped downstream."""
    grants_without_event: int = 0
    """Grants of an emitting handler with no event published for them: the event is lost."""
    events_without_grant: int = 0
    """Events whose id names no grant: published for effects that never applied."""
    grants_without_event_keys: list[str] = field(default_factory=list)
    events_without_grant_ids: list[str] = field(default_factory=list)

    @property
    def ledger_available(self) -> bool:
        return self.ledger_entries is not None

    @property
    def clean(self) -> bool:
        """Nothing lost and nothing granted twice, the two promises of the worker; and,
        where events were checked, every grant's event published and none without its grant."""
        events = self.grants_without_event == 0 and self.events_without_grant == 0
        return self.lost == 0 and self.doubled == 0 and events

    @property
    def exit_code(self) -> int:
        return 0 if self.clean else 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attempts"] = {str(k): v for k, v in self.attempts.items()}
        data.update(clean=self.clean, ledger_available=self.ledger_available)
        return data
