"""The one form every store's grants take: a `LedgerRow` per grant, and those rows as a
DataFrame beside the parsed inputs.

The Redis stream (ledger_stream.py) and the PostgreSQL table (postgres_grants.py) each read
into these rows and know nothing of each other or of the job; the rest of reconcile sees
only the rows, so which store they came from changes nothing downstream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from reliable_consumer_pipeline.reconcile.inputs import as_written

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["LedgerRow", "ledger_frame"]

LedgerRow = tuple[str | None, int | None, str | None]
"""(dedupe key, granted_at ms, source coordinates) of one ledger entry."""


def ledger_frame(spark: SparkSession, rows: Sequence[LedgerRow]) -> DataFrame:
    """The ledger as a DataFrame, shipped to the JVM as Arrow (fast for millions of rows);
    its keys as events carry them."""
    import pyarrow as pa
    from pyspark.sql import functions as F

    table = pa.table(
        {
            "dedupe_key": pa.array([r[0] for r in rows], pa.string()),
            "granted_at": pa.array([r[1] for r in rows], pa.int64()),
            "coord": pa.array([r[2] for r in rows], pa.string()),
        }
    )
    return spark.createDataFrame(table).withColumn("dedupe_key", as_written(F.col("dedupe_key")))
