"""The per-record table: every input stacked, tallied per entity (a dedupe key, or `@coord`
for a record without one), and each entity's final state and flags decided.

`reconcile_frames` runs the steps in order: give keyless source records the key their
events carry (`_keys_from_events`), find the source record of every keyless event
(`_unkeyed_to_source`), stack all inputs under their entity (`_stack`), tally each entity
in one aggregation (`_tally`) and judge it (`_verdict`, `_judged`). Each step is a pure
function of DataFrames, so the Spark plan is the one a single function would build.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = ["BROADCAST_MAX_ROWS", "reconcile_frames"]

BROADCAST_MAX_ROWS = 1_000_000
"""Unkeyed (undecodable) events up to this many are joined to the source by broadcast."""


def reconcile_frames(
    src: DataFrame,
    events: DataFrame,
    dlq: DataFrame,
    ledger: DataFrame | None,
    *,
    as_of_ms: int,
    stuck_after_ms: int,
    grace_ms: int = 0,
    broadcast_unkeyed: bool = True,
    keys_from_events: bool = False,
    ledger_topics: Sequence[str] | None = None,
) -> DataFrame:
    """The per-entity table from the parsed inputs (`parse_*`; ledger: dedupe_key, granted_at,
    coord).

    All inputs are stacked into one frame and aggregated with a single `groupBy(entity)`: one
    shuffle, instead of an aggregation per input and full outer joins between them. Only the
    few unkeyed events (and ledger entries) meet the source table in a join, broadcast unless
    told it is large. `keys_from_events` (some topic's key is computed, not a field) gives
    source records without a key the one their outcomes or dead letters carry. With a ledger,
    the ledger decides what is granted, for the entities of `ledger_topics` (None: all).
    """
    from pyspark.sql import functions as F

    readable = events.where(F.col("event").isNotNull())
    if keys_from_events:
        src = _keys_from_events(src, readable, dlq, ledger)
    mapping = _unkeyed_to_source(src, readable, dlq, ledger, broadcast_unkeyed)
    stacked = _stack(src, readable, dlq, ledger, mapping, broadcast_unkeyed)
    tallied = _tally(stacked, ledger_topics)
    verdict = _verdict(ledger is not None, as_of_ms, grace_ms)
    return _judged(tallied, verdict, ledger is not None, as_of_ms, stuck_after_ms)


def _keys_from_events(
    src: DataFrame, readable: DataFrame, dlq: DataFrame, ledger: DataFrame | None
) -> DataFrame:
    """Source records with no key get the dedupe key their outcomes, dead letters or ledger
    entries carry.

    For handlers whose key is computed (no JSON field holds it): the worker wrote the key it
    computed into each outcome event and dead letter, next to the record's coordinates, and
    the service's `Ledger.entry_key` names it for a ledger entry (whose `source` is the
    record's coordinates): a record granted with no event still meets its grant.
    """
    from pyspark.sql import functions as F

    carried = readable.select("coord", "dedupe_key").unionByName(dlq.select("coord", "dedupe_key"))
    if ledger is not None:
        carried = carried.unionByName(ledger.select("coord", "dedupe_key"))
    carried = (
        carried.where(F.col("coord").isNotNull() & F.col("dedupe_key").isNotNull())
        .groupBy("coord")
        .agg(F.min("dedupe_key").alias("carried_key"))
    )
    missing = src.where(F.col("dedupe_key").isNull()).drop("entity")
    found = (
        missing.join(carried, on="coord", how="left")
        .withColumn("dedupe_key", F.col("carried_key"))
        .drop("carried_key")
        .withColumn("entity", F.coalesce("dedupe_key", F.concat(F.lit("@"), "coord")))
    )
    return src.where(F.col("dedupe_key").isNotNull()).unionByName(found)


def _unkeyed_to_source(
    src: DataFrame,
    readable: DataFrame,
    dlq: DataFrame,
    ledger: DataFrame | None,
    broadcast: bool,
) -> DataFrame:
    """coord -> src_entity, for exactly the coordinates that keyless events, dead letters and
    ledger entries name: the few rows that must meet the source table in a join."""
    from pyspark.sql import functions as F

    unkeyed = (
        readable.where(F.col("dedupe_key").isNull())
        .select("coord")
        .unionByName(dlq.where(F.col("dedupe_key").isNull()).select("coord"))
    )
    if ledger is not None:
        unkeyed = unkeyed.unionByName(ledger.where(F.col("dedupe_key").isNull()).select("coord"))
    unkeyed = unkeyed.where(F.col("coord").isNotNull()).distinct()
    coords = src.select("coord", F.col("entity").alias("src_entity"))
    return coords.join(F.broadcast(unkeyed) if broadcast else unkeyed, on="coord")


def _attribute(rows: DataFrame, mapping: DataFrame, broadcast: bool) -> DataFrame:
    """Give each event or dead letter an `entity`: its dedupe key, else its source record's.

    Rows the worker could not key (undecodable records) carry only source coordinates;
    `mapping` (coord -> src_entity, for exactly those coordinates) finds the record even when
    the source JSON had a key the worker never got to (say, beside an invalid field).
    """
    from pyspark.sql import functions as F

    keyed = rows.where(F.col("dedupe_key").isNotNull()).withColumn("entity", F.col("dedupe_key"))
    unkeyed = (
        rows.where(F.col("dedupe_key").isNull())
        .join(F.broadcast(mapping) if broadcast else mapping, on="coord", how="left")
        .withColumn("entity", F.coalesce("src_entity", F.concat(F.lit("@"), "coord")))
        .drop("src_entity")
    )
    return keyed.unionByName(unkeyed).where(F.col("entity").isNotNull())


def _stack(
    src: DataFrame,
    readable: DataFrame,
    dlq: DataFrame,
    ledger: DataFrame | None,
    mapping: DataFrame,
    broadcast: bool,
) -> DataFrame:
    """Every input row under its entity, in one frame, its `kind` saying which input it is
    (src, event, dlq, ledger); the columns an input lacks are null."""
    from pyspark.sql import functions as F

    stacked = (
        src.select("entity", "dedupe_key", "coord", "record_ts", F.lit("src").alias("kind"))
        .unionByName(
            _attribute(readable, mapping, broadcast).select(
                "entity",
                "coord",
                "event",
                "attempt",
                "reason",
                "record_ts",
                "finished_at",
                "event_offset",
                "event_index",
                F.lit("event").alias("kind"),
            ),
            allowMissingColumns=True,
        )
        .unionByName(
            _attribute(dlq, mapping, broadcast).select(
                "entity", "coord", "reason", "at", F.lit("dlq").alias("kind")
            ),
            allowMissingColumns=True,
        )
    )
    if ledger is not None:
        stacked = stacked.unionByName(
            _attribute(ledger, mapping, broadcast).select(
                "entity", "granted_at", F.lit("ledger").alias("kind")
            ),
            allowMissingColumns=True,
        )
    return stacked


def _tally(stacked: DataFrame, ledger_topics: Sequence[str] | None) -> DataFrame:
    """One row per entity: what each input said of it (counts, firsts and lasts), from a
    single `groupBy(entity)`; `ledger_scope` is whether the ledger covers its topic."""
    from pyspark.sql import functions as F

    kind, ev = F.col("kind"), F.col("event")
    is_src, is_dlq = kind == "src", kind == "dlq"
    succeeded = ev == "succeeded"
    in_scope = F.lit(True)
    if ledger_topics is not None:
        in_scope = F.substring_index(F.col("coord"), "/", 1).isin(list(ledger_topics))
    return stacked.groupBy("entity").agg(
        F.first(F.when(is_src, F.col("dedupe_key")), ignorenulls=True).alias("dedupe_key"),
        # Entities with no source record (only events or ledger entries) are checked too.
        F.coalesce(F.max(F.when(is_src, in_scope)), F.lit(True)).alias("ledger_scope"),
        F.count_if(is_src).alias("source_records"),
        F.min(F.when(is_src, F.col("record_ts"))).alias("first_record_ts"),
        F.min(F.when(is_src, F.col("coord"))).alias("source_coord"),
        # Per-record coverage: a source record no outcome names was skipped by the worker,
        # even if its key ended fine through another copy of the record.
        F.size(
            F.array_except(
                F.collect_set(F.when(is_src, F.col("coord"))),
                F.collect_set(F.when(ev.isNotNull(), F.col("coord"))),
            )
        ).alias("records_without_outcome"),
        F.count_if(ev.isNotNull()).alias("outcome_events"),
        F.count_if(succeeded).alias("succeeded_events"),
        F.count_if(ev == "duplicate").alias("duplicate_events"),
        F.count_if(ev == "retry_scheduled").alias("retry_events"),
        F.count_if(ev == "dead_lettered").alias("dead_lettered_events"),
        F.min(F.when(succeeded, F.struct("finished_at", "record_ts", "attempt"))).alias(
            "first_success"
        ),
        F.min(
            F.when(ev.isin("succeeded", "dead_lettered"), F.struct("finished_at", "attempt"))
        ).alias("first_terminal"),
        F.max(F.when(ev == "dead_lettered", F.struct("finished_at", "reason"))).alias(
            "last_dead_letter_event"
        ),
        F.min(F.when(ev == "retry_scheduled", F.col("finished_at"))).alias("first_retry_at"),
        F.max(
            F.when(ev.isNotNull(), F.struct("finished_at", "event_offset", "event_index", "event"))
        ).alias("last"),
        F.max(F.when(ev.isNotNull(), F.col("attempt"))).alias("max_attempt"),
        F.count_if(is_dlq).alias("dlq_records"),
        F.max(F.when(is_dlq, F.struct("at", "reason")))["reason"].alias("dlq_reason"),
        F.count_if(kind == "ledger").alias("ledger_entries"),
    )


class _Verdict(NamedTuple):
    """The columns that judge a tallied entity, each named for the question it answers."""

    ledger_on: Column
    """The ledger was read and covers the entity's topic: only its entries are grants."""
    ledger_entries: Column
    in_source: Column
    lost_grant: Column
    """A `succeeded` outcome with no ledger entry behind it: the grant is gone."""
    only_duplicate: Column
    """No grant and no dead letter, only "already done" answers."""
    state: Column


def _verdict(has_ledger: bool, as_of_ms: int, grace_ms: int) -> _Verdict:
    """Each entity's final state (one of STATES) and the facts it rests on."""
    from pyspark.sql import functions as F

    as_of = F.lit(as_of_ms)
    # The ledger is the grant itself, so where it is readable (and covers the entity's topic)
    # only a ledger entry is a grant: a `succeeded` outcome without one is a lost grant.
    ledger_on = F.lit(has_ledger) & F.col("ledger_scope")
    ledger_entries = F.col("ledger_entries") if has_ledger else F.lit(0)
    in_source = F.col("source_records") > 0
    has_grant = F.when(ledger_on, ledger_entries > 0).otherwise(F.col("succeeded_events") > 0)
    lost_grant = ledger_on & (F.col("succeeded_events") > 0) & (ledger_entries == 0)
    has_dead_letter = (F.col("dlq_records") > 0) | (F.col("dead_lettered_events") > 0)
    only_duplicate = ~has_grant & ~has_dead_letter & (F.col("duplicate_events") > 0)
    state = (
        F.when(has_grant, "granted")
        .when(has_dead_letter, "dead_lettered")
        .when(lost_grant, "lost")
        # "already done" with no grant anywhere: trusted only when there is no ledger to check
        .when(only_duplicate & ~ledger_on, "granted")
        .when(only_duplicate, "lost")
        .when(F.col("retry_events") > 0, "retrying")
        # Only with a grace period: by default a record nobody answered is lost, even a young
        # one (a stalled worker must fail the check, not hide behind "pending").
        .when(
            F.lit(grace_ms > 0) & in_source & (F.col("first_record_ts") > as_of - F.lit(grace_ms)),
            "pending",
        )
        .otherwise("lost")
    )
    return _Verdict(ledger_on, ledger_entries, in_source, lost_grant, only_duplicate, state)


def _judged(
    tallied: DataFrame, verdict: _Verdict, has_ledger: bool, as_of_ms: int, stuck_after_ms: int
) -> DataFrame:
    """The per-record table's columns: the verdict, the figures behind it, and the flags
    (doubled, unverified grant, ledger mismatch, lost grant, stuck)."""
    from pyspark.sql import functions as F

    ledger_on, ledger_entries = verdict.ledger_on, verdict.ledger_entries
    in_source = verdict.in_source
    return tallied.select(
        "entity",
        "dedupe_key",
        (F.col("entity").startswith("@") & in_source).alias("malformed"),
        in_source.alias("in_source"),
        "source_records",
        "records_without_outcome",
        "first_record_ts",
        "source_coord",
        verdict.state.alias("state"),
        F.coalesce("dlq_reason", F.col("last_dead_letter_event")["reason"]).alias(
            "dead_letter_reason"
        ),
        F.when(ledger_on, ledger_entries).otherwise(F.col("succeeded_events")).alias("grants"),
        "succeeded_events",
        (ledger_entries if has_ledger else F.lit(None).cast("long")).alias("ledger_entries"),
        "duplicate_events",
        "retry_events",
        "dead_lettered_events",
        "dlq_records",
        "outcome_events",
        F.col("last")["event"].alias("last_event"),
        "first_retry_at",
        F.col("first_terminal")["attempt"].alias("attempts"),
        "max_attempt",
        (F.col("first_success")["finished_at"] - F.col("first_success")["record_ts"]).alias(
            "latency_ms"
        ),
        F.col("first_success")["finished_at"].alias("granted_at"),
        ((F.col("succeeded_events") > 1) | (ledger_entries > 1)).alias("doubled"),
        (verdict.only_duplicate & ~ledger_on).alias("unverified_grant"),
        (ledger_on & (F.col("succeeded_events") != ledger_entries)).alias("ledger_mismatch"),
        verdict.lost_grant.alias("lost_grant"),
    ).withColumn(
        "stuck",
        (F.col("state") == "retrying")
        & (F.lit(as_of_ms) - F.col("first_retry_at") > F.lit(stuck_after_ms)),
    )
