"""An optional picture of a reconcile run: final states over time and the latency histogram.

Aggregation happens in Spark (a few hundred rows reach the driver); matplotlib only draws.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["write_chart"]

STATE_COLORS = {
    "granted": "#2e7d32",
    "dead_lettered": "#f9a825",
    "retrying": "#1565c0",
    "pending": "#90a4ae",
    "lost": "#c62828",
}


def write_chart(records: DataFrame, path: Path, buckets: int = 60) -> Path:
    """Draw the per-record table (reconcile's `records/` Parquet) into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pyspark.sql import functions as F

    span = records.agg(
        F.min("first_record_ts").alias("lo"),
        F.max("first_record_ts").alias("hi"),
        F.max("latency_ms").alias("lat"),
    ).first()
    assert span is not None
    fig, (ax_time, ax_lat) = plt.subplots(2, 1, figsize=(10, 8))

    if span["lo"] is not None:
        lo, hi = int(span["lo"]), int(span["hi"])
        width = max(1, (hi - lo) // buckets + 1)
        rows = (
            records.where(F.col("first_record_ts").isNotNull())
            .groupBy(F.floor((F.col("first_record_ts") - lo) / width).alias("b"), "state")
            .count()
            .collect()
        )
        xs = sorted({int(r["b"]) for r in rows})
        seconds = [b * width / 1000 for b in xs]
        # One line per state on a symlog axis: a handful of lost records stays visible next
        # to a million granted ones (stacked bars would hide them).
        for state, color in STATE_COLORS.items():
            counts = {int(r["b"]): int(r["count"]) for r in rows if r["state"] == state}
            if counts:
                ax_time.plot(
                    seconds,
                    [counts.get(b, 0) for b in xs],
                    color=color,
                    label=state,
                    drawstyle="steps-post",
                    marker="." if len(xs) < 3 else None,
                )
        ax_time.set_yscale("symlog", linthresh=1)
        ax_time.set_xlabel("seconds since the first source record")
        ax_time.set_ylabel("records")
        ax_time.set_title("Final state by source record time")
        ax_time.legend()

    if span["lat"] is not None:
        top = max(1, int(span["lat"]))
        bins = 50
        rows = (
            records.where(F.col("latency_ms").isNotNull())
            .groupBy(F.least(F.floor(F.col("latency_ms") * bins / top), F.lit(bins - 1)).alias("b"))
            .count()
            .collect()
        )
        edges = [int(r["b"]) * top / bins for r in rows]
        ax_lat.bar(
            edges, [int(r["count"]) for r in rows], width=top / bins, align="edge", color="#2e7d32"
        )
        sizes = [int(r["count"]) for r in rows]
        long_tail = max(sizes) > 100 * min(sizes)
        if long_tail:
            ax_lat.set_yscale("log")
        ax_lat.set_xlabel("record -> granted latency, ms")
        ax_lat.set_ylabel("records (log)" if long_tail else "records")
        ax_lat.set_title("End-to-end latency")

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
