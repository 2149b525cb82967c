"""The job: `run_reconcile` takes one snapshot of every input, reads the grants, builds and
writes the per-record table, and sums it into the report.

Only the order of the steps lives here (it is what makes the answer true: see
`run_reconcile`); what each step computes is in its own module.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from reliable_consumer_pipeline.kafka_reader import KafkaConfig
from reliable_consumer_pipeline.reconcile.config import ReconcileConfig
from reliable_consumer_pipeline.reconcile.events import EventsCheck, check_events, read_event_ids
from reliable_consumer_pipeline.reconcile.grants import read_grants
from reliable_consumer_pipeline.reconcile.inputs import (
    end_offsets,
    parse_dead_letters,
    parse_outcomes,
    parse_source,
    read_up_to,
)
from reliable_consumer_pipeline.reconcile.ledger_rows import ledger_frame
from reliable_consumer_pipeline.reconcile.records import BROADCAST_MAX_ROWS, reconcile_frames
from reliable_consumer_pipeline.reconcile.report import RECORDS_TABLE, ReconcileReport
from reliable_consumer_pipeline.reconcile.summary import summarize, write_summary

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

    from reliable_consumer_pipeline.reconcile.postgres_grants import PostgresGrants

__all__ = ["run_reconcile"]

log = logging.getLogger(__name__)


class _Phases:
    """Seconds per phase of one run (the report's `timings`), each logged as it ends."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.timings: dict[str, float] = {}
        self._lap = self.started

    def done(self, name: str) -> None:
        now = time.monotonic()
        self.timings[name] = round(now - self._lap, 3)
        self._lap = now
        log.info("reconcile: %s took %.1fs", name, self.timings[name])


def run_reconcile(spark: SparkSession, rc: ReconcileConfig) -> ReconcileReport:
    """Snapshot the topics, reconcile, write Parquet under `rc.out_dir`, return the summary.

    Snapshot order matters: source end offsets first, then outcomes and dead letters, then the
    ledger, so every record in the source snapshot had its chance to reach the later ones.
    The explicit end offsets also keep every Spark action of this run on the same data, and
    the parsed inputs are cached so each topic is read from Kafka once.
    """
    from pyspark import StorageLevel

    phases = _Phases()
    fields = rc.key_fields()
    kafka = KafkaConfig.from_options({**rc.kafka_options, "bootstrap": rc.bootstrap})
    source_end = end_offsets(kafka, rc.topics, required=True)
    outcomes_end = end_offsets(kafka, [rc.outcomes_topic], required=False)
    dlq_end = end_offsets(kafka, rc.dead_letter_topics, required=False)
    # Before the grants: an event read was published from an outbox row committed with its
    # grant, so that grant is read too (an event without one is real). A grant whose event
    # the relay has not published yet shows as without one: rerun once its outbox drained.
    events_topics, emitters = rc.emitted()
    events_end = end_offsets(kafka, events_topics, required=False) if emitters else None
    phases.done("snapshot")
    ledger_rows, pg, store, ledger_topics = read_grants(rc, fields)
    phases.done("ledger")

    cached = StorageLevel.MEMORY_AND_DISK
    src = parse_source(read_up_to(spark, rc, source_end), fields).persist(cached)
    events = parse_outcomes(read_up_to(spark, rc, outcomes_end)).persist(cached)
    dlq = parse_dead_letters(read_up_to(spark, rc, dlq_end)).persist(cached)
    ledger = ledger_frame(spark, ledger_rows) if ledger_rows is not None else None
    try:
        counts = _count_events(events)
        phases.done("outcomes")
        as_of_ms = _reference_time(rc, counts)
        records = reconcile_frames(
            src,
            events,
            dlq,
            ledger,
            as_of_ms=as_of_ms,
            stuck_after_ms=int(rc.stuck_after.total_seconds() * 1000),
            grace_ms=rc.grace_ms,
            broadcast_unkeyed=int(counts["unkeyed"]) <= BROADCAST_MAX_ROWS,
            keys_from_events=any(f.json is None for f in fields.values()),
            ledger_topics=ledger_topics,
        )
        out = str(rc.out_dir)
        records.write.mode("overwrite").parquet(f"{out}/{RECORDS_TABLE}")
        phases.done("records")
    finally:
        for frame in (src, events, dlq):
            frame.unpersist()
    table = spark.read.parquet(f"{out}/{RECORDS_TABLE}")
    snapshot = {**(source_end or {}), **(outcomes_end or {}), **(dlq_end or {})}
    report = summarize(
        table,
        rc,
        as_of_ms,
        ledger_rows,
        snapshot,
        outcome_events=int(counts["readable"]),
        unreadable_events=int(counts["all"]) - int(counts["readable"]),
    )
    phases.done("summary")
    report.grants_store = store
    if pg is not None:
        _add_inbox_checks(report, pg)
    if emitters and (events_end is None or ledger_rows is None):
        log.warning(
            "events not checked: %s",
            "no grants were read to match them to"
            if ledger_rows is None
            else f"the emitted topics {', '.join(events_topics)} do not exist",
        )
    elif emitters:
        ids = read_event_ids(spark, rc, events_end)
        _add_events_check(report, check_events(ids, ledger_rows or [], emitters, rc.max_listed))
        phases.done("events")
    report.timings = phases.timings
    report.elapsed_s = round(time.monotonic() - phases.started, 3)
    write_summary(spark, report, out)
    return report


def _count_events(events: DataFrame) -> Row:
    """All outcome rows, the readable ones, the newest `finished_at`, and the readable ones
    with no key (whose join to the source is broadcast when few)."""
    from pyspark.sql import functions as F

    counts = events.agg(
        F.count("*").alias("all"),
        F.count("event").alias("readable"),
        F.max("finished_at").alias("newest"),
        F.count_if(F.col("event").isNotNull() & F.col("dedupe_key").isNull()).alias("unkeyed"),
    ).first()
    assert counts is not None
    return counts


def _reference_time(rc: ReconcileConfig, counts: Row) -> int:
    """The time `stuck` and `pending` are judged at: data, not wall clock, unless asked, so
    reruns agree (the newest outcome's `finished_at`; now when there is none)."""
    if rc.as_of_ms is not None:
        return rc.as_of_ms
    newest = counts["newest"]
    return int(newest) if newest is not None else int(time.time() * 1000)


def _add_events_check(report: ReconcileReport, events: EventsCheck) -> None:
    """Every grant's event and no event without its grant, into the report."""
    report.emitted_events = events.events
    report.event_copies = events.event_copies
    report.grants_without_event = events.grants_without_event
    report.events_without_grant = events.events_without_grant
    report.grants_without_event_keys = events.grants_without_event_keys
    report.events_without_grant_ids = events.events_without_grant_ids


def _add_inbox_checks(report: ReconcileReport, pg: PostgresGrants) -> None:
    """The PostgreSQL store's cross-checks of grants table and inbox, into the report."""
    report.inbox_rows = pg.inbox_rows
    report.grants_without_inbox = pg.grants_without_inbox
    report.inbox_without_grant = pg.inbox_without_grant
    report.grants_without_inbox_ids = pg.grants_without_inbox_ids
    report.inbox_without_grant_keys = pg.inbox_without_grant_keys
