"""Reconcile: did every record end in exactly one grant or a dead letter?

The worker's own metrics cannot answer that question: a record it never saw, or a grant it
made twice, is by definition invisible to it. This job re-derives the truth from what the
worker wrote (docs/contracts.md): the source topic(s), the outcomes topic, the dead-letter
topic(s) and, where readable, the grants: the Redis ledger stream, or for handlers of the
PostgreSQL effects store the grants table with its inbox (postgres_grants.py). Per record
(its dedupe key: the field that the handler bound to the topic names, read from the source
record's JSON and from the ledger entry; for a handler that computes its key, the key the
outcome events and dead letters carry for the record's coordinates, and the one the app's
`Ledger.entry_key` names for a ledger entry) it decides one final state; copies of a record
(a producer's resend, a redrive) share its key and are one record here:

| state | meaning |
| --- | --- |
| granted | a ledger entry (grant row); without one, a `succeeded` (or only a `duplicate`) outcome |
| dead_lettered | a dead-letter record or `dead_lettered` outcome, and no grant |
| retrying | `retry_scheduled` outcomes and nothing terminal yet (`stuck` when too long) |
| pending | no outcome yet, but younger than the grace period (only with `grace_ms` > 0) |
| lost | in the source topic, yet none of the above |

and flags `doubled` (more than one `succeeded` outcome or ledger entry). When the ledger is
readable it is the source of truth: a `succeeded` outcome with no ledger entry behind it is a
`lost_grant`, and the record is `lost`. Records whose value is not JSON or has no dedupe key
are "malformed" entities named `@topic/partition/offset` and are matched to dead letters and
outcomes by those source coordinates.

Where the grants are (`ReconcileConfig.grants`): `redis`, the ledger stream; `postgres`, the
grants table, keyed by the inbox rows written with it; `both` for a service with handlers of
each store, each store covering its own topics. The stream and the table are the ones the
service's app declares (`App(ledger=Ledger(stream=..., table=...))`,
reliable_consumer/engine/declaration/ledger.py) unless named; a store whose ledger is not declared
is not read. Either way the grants become the same ledger rows, so the report is the same; the
PostgreSQL store adds its inbox cross-checks (grant rows no inbox row vouches for, inbox
rows without a grant).

Where a bound handler emits (`@handler(emits=...)`), the topics it emits to are checked too
(events.py): every grant has its event, matched by the `event-id` header, no event exists
without its grant, and copies of one event (the relay publishes at least once) are counted.

The heavy lifting is Spark DataFrame work (parse, groupBy, full outer joins); the driver only
reads the grant log (a Redis stream or a table) and collects the small summary.

The steps, one module each; each imports only modules above it here, never this package's
`__init__`, so no two import each other:

| module | what it holds |
| --- | --- |
| config.py | `ReconcileConfig`, and where each topic's key is (`DedupeField`) |
| report.py | `ReconcileReport`, `STATES`, `RECORDS_TABLE` |
| inputs.py | the end offsets' snapshot; source, outcomes and dead letters read and parsed |
| ledger_rows.py | `LedgerRow`, the form of every store's grants, and its DataFrame |
| ledger_stream.py | the grants of the Redis ledger stream |
| postgres_grants.py | the grants of the PostgreSQL table, checked against the inbox |
| grants.py | which store to read for which topics |
| records.py | the per-record table: the join and each record's final state |
| events.py | every grant of an emitting handler has its event, no event is without its grant |
| summary.py | the report's figures from the written table, and `summary/` |
| printing.py | `print_report` |
| job.py | `run_reconcile`: the steps in the order that makes the answer true |
"""

from __future__ import annotations

from reliable_consumer_pipeline.reconcile.config import DedupeField, ReconcileConfig, dedupe_fields
from reliable_consumer_pipeline.reconcile.inputs import (
    as_written,
    parse_dead_letters,
    parse_outcomes,
    parse_source,
)
from reliable_consumer_pipeline.reconcile.job import run_reconcile
from reliable_consumer_pipeline.reconcile.ledger_stream import read_ledger
from reliable_consumer_pipeline.reconcile.printing import print_report
from reliable_consumer_pipeline.reconcile.records import reconcile_frames
from reliable_consumer_pipeline.reconcile.report import RECORDS_TABLE, STATES, ReconcileReport

__all__ = [
    "RECORDS_TABLE",
    "STATES",
    "DedupeField",
    "ReconcileConfig",
    "ReconcileReport",
    "as_written",
    "dedupe_fields",
    "parse_dead_letters",
    "parse_outcomes",
    "parse_source",
    "print_report",
    "read_ledger",
    "reconcile_frames",
    "run_reconcile",
]
