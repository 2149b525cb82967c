"""The summary: the report's small figures, read back from the written per-record table,
and the one-row `summary/` Parquet written beside it.

Summing the table as written, not recomputing the pipeline, makes the report and the
Parquet agree by construction, and costs one small pass over the table.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from reliable_consumer_pipeline.reconcile.config import ReconcileConfig
from reliable_consumer_pipeline.reconcile.ledger_rows import LedgerRow
from reliable_consumer_pipeline.reconcile.report import STATES, ReconcileReport

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["summarize", "write_summary"]


def summarize(
    table: DataFrame,
    rc: ReconcileConfig,
    as_of_ms: int,
    ledger_rows: Sequence[LedgerRow] | None,
    snapshot: dict[str, dict[str, int]],
    *,
    outcome_events: int,
    unreadable_events: int,
) -> ReconcileReport:
    """The small figures, from the written Parquet table (not by recomputing the pipeline)."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    totals = table.agg(
        F.count("*").alias("records"),
        F.count_if(F.col("state") == "lost").alias("lost"),
        F.count_if("doubled").alias("doubled"),
        F.count_if("stuck").alias("stuck"),
        F.count_if("malformed").alias("malformed"),
        F.count_if("unverified_grant").alias("unverified"),
        F.count_if("ledger_mismatch").alias("ledger_mismatch"),
        F.count_if("lost_grant").alias("lost_grants"),
        F.sum("source_records").alias("source_records"),
        F.sum("records_without_outcome").alias("without_outcome"),
        F.sum("dlq_records").alias("dead_letters"),
        F.percentile_approx("latency_ms", [0.5, 0.9, 0.99], 10_000).alias("pcts"),
        F.max("latency_ms").alias("max_latency"),
        F.count("latency_ms").alias("latency_n"),
    ).first()
    assert totals is not None
    # One small grouping answers states, reasons and attempts; one windowed query the keys.
    states = dict.fromkeys(STATES, 0)
    reasons: dict[str, int] = {}
    attempts: dict[int, int] = {}
    for r in table.groupBy("state", "dead_letter_reason", "attempts").count().collect():
        count = int(r["count"])
        states[r["state"]] = states.get(r["state"], 0) + count
        if r["state"] == "dead_lettered":
            reason = str(r["dead_letter_reason"])
            reasons[reason] = reasons.get(reason, 0) + count
        if r["attempts"] is not None:
            attempts[int(r["attempts"])] = attempts.get(int(r["attempts"]), 0) + count
    kinds = F.array(
        F.when(F.col("state") == "lost", F.lit("lost")),
        F.when(F.col("doubled"), F.lit("doubled")),
        F.when(F.col("stuck"), F.lit("stuck")),
    )
    listed = (
        table.where((F.col("state") == "lost") | F.col("doubled") | F.col("stuck"))
        .select("entity", F.explode(kinds).alias("kind"))
        .where(F.col("kind").isNotNull())
        .withColumn("n", F.row_number().over(Window.partitionBy("kind").orderBy("entity")))
        .where(F.col("n") <= rc.max_listed)
        .orderBy("kind", "entity")
        .collect()
    )

    def keys(kind: str) -> list[str]:
        return [r["entity"] for r in listed if r["kind"] == kind]

    pcts = totals["pcts"] or [None, None, None]
    return ReconcileReport(
        records=int(totals["records"]),
        states=states,
        lost=int(totals["lost"]),
        doubled=int(totals["doubled"]),
        stuck=int(totals["stuck"]),
        malformed=int(totals["malformed"]),
        lost_keys=keys("lost"),
        doubled_keys=keys("doubled"),
        stuck_keys=keys("stuck"),
        dead_letter_reasons=dict(sorted(reasons.items())),
        attempts=dict(sorted(attempts.items())),
        latency_ms={
            "p50": _num(pcts[0]),
            "p90": _num(pcts[1]),
            "p99": _num(pcts[2]),
            "max": _num(totals["max_latency"]),
            "count": float(totals["latency_n"]),
        },
        source_records=int(totals["source_records"] or 0),
        outcome_events=outcome_events,
        dead_letters=int(totals["dead_letters"] or 0),
        ledger_entries=None if ledger_rows is None else len(ledger_rows),
        unverified_grants=int(totals["unverified"]),
        ledger_mismatches=int(totals["ledger_mismatch"]),
        lost_grants=int(totals["lost_grants"]),
        records_without_outcome=int(totals["without_outcome"] or 0),
        unreadable_events=unreadable_events,
        snapshot=snapshot,
        as_of_ms=as_of_ms,
        out_dir=str(rc.out_dir),
    )


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def write_summary(spark: SparkSession, report: ReconcileReport, out: str) -> None:
    """One-row Parquet summary next to the per-record table, for dashboards and diffs."""
    row = {
        k: v
        for k, v in report.to_dict().items()
        if k
        not in {
            "lost_keys",
            "doubled_keys",
            "stuck_keys",
            "grants_without_inbox_ids",
            "inbox_without_grant_keys",
        }
    }
    flat = {k: (json.dumps(v) if isinstance(v, dict | list) else v) for k, v in row.items()}
    schema = ", ".join(f"`{k}` {_spark_type(v)}" for k, v in flat.items())
    spark.createDataFrame([tuple(flat.values())], schema).coalesce(1).write.mode(
        "overwrite"
    ).parquet(f"{out}/summary")


def _spark_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "long"
    if isinstance(value, float):
        return "double"
    return "string"
