"""Reading the inputs: the source, outcomes and dead-letter topics up to a snapshot of their
end offsets, each parsed into rows named the same way (`dedupe_key`, `coord`).

Every input, the ledger's rows too (ledger_rows.py), meets the others by those two names, so
the key is brought to the form the worker writes it in (`as_written`) here, once per side.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis import long_keys

from reliable_consumer_pipeline.kafka_reader import (
    EARLIEST,
    LATEST,
    KafkaConfig,
    OffsetSpec,
    offsets_to_json,
    resolve_ranges,
    topic_partitions,
)
from reliable_consumer_pipeline.reconcile.config import DedupeField, ReconcileConfig
from reliable_consumer_pipeline.source import KAFKA_SCHEMA, read_topic

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

__all__ = [
    "OUTCOME_SCHEMA",
    "as_written",
    "end_offsets",
    "header_value",
    "parse_dead_letters",
    "parse_outcomes",
    "parse_source",
    "read_up_to",
]

log = logging.getLogger(__name__)

# The outcome fields reconcile reads, of both layouts
# (reliable_consumer/engine/kafka/outcome_events.py; handler and worker are ignored: fewer fields,
# less parsing). Layout 1 is one event per record; layout 2 (`v` = 2) hoists topic, partition and
# finished_at and holds the rest in one array per field under `events`.
OUTCOME_SCHEMA = (
    "event string, dedupe_key string, topic string, partition int, offset long, attempt int, "
    "reason string, record_ts long, finished_at long, v int, "
    "events struct<offset: array<long>, event: array<string>, dedupe_key: array<string>, "
    "attempt: array<int>, reason: array<string>, record_ts: array<long>>"
)
_OUTCOME_ARRAYS = ("offset", "event", "dedupe_key", "attempt", "reason", "record_ts")
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def end_offsets(
    config: KafkaConfig, topics: Sequence[str], required: bool
) -> dict[str, dict[str, int]] | None:
    """End offsets (high watermarks) of `topics` now; None if optional topics are missing."""
    if not required:
        topics = [t for t in topics if _topic_exists(config, t)]
    if not topics:
        return None
    ranges = resolve_ranges(config, topics, OffsetSpec(EARLIEST), OffsetSpec(LATEST))
    return offsets_to_json({r.tp: r.end for r in ranges})


def _topic_exists(config: KafkaConfig, topic: str) -> bool:
    try:
        topic_partitions(config, [topic], timeout_s=1.0)
    except ValueError:
        log.warning("topic %s not found; treating it as empty", topic)
        return False
    return True


def read_up_to(
    spark: SparkSession, rc: ReconcileConfig, ending: dict[str, dict[str, int]] | None
) -> DataFrame:
    """The topics of an `ending` snapshot, from their start up to it (empty if None)."""
    if ending is None:
        return spark.createDataFrame([], KAFKA_SCHEMA)
    return read_topic(
        spark,
        rc.bootstrap,
        list(ending),
        source=rc.source,
        startingOffsets="earliest",
        endingOffsets=json.dumps(ending),
        **dict(rc.kafka_options),
    )


def _coord(topic: Column, partition: Column, offset: Column) -> Column:
    from pyspark.sql import functions as F

    return F.when(
        topic.isNotNull() & partition.isNotNull() & offset.isNotNull(),
        F.concat_ws("/", topic, partition.cast("string"), offset.cast("string")),
    )


def _nonempty(col: Column) -> Column:
    from pyspark.sql import functions as F

    return F.when(F.trim(col) != "", col)


def _header(name: str) -> Column:
    """The last value of header `name` as a string (a redriven record may repeat headers)."""
    from pyspark.sql import functions as F

    matching = F.filter("headers", lambda h: h["key"] == F.lit(name))
    return F.try_element_at(matching, F.lit(-1))["value"].cast("string")


def header_value(name: str) -> Column:
    """The last value of header ``name`` as a string (for the other steps' topics)."""
    return _header(name)


def as_written(key: Column) -> Column:
    """A dedupe key as the worker writes it in outcome events (``long_keys.written``): one of
    more than ``LONG_KEY_BYTES`` UTF-8 bytes as ``sha256:`` and the hex SHA-256 of them.

    Events carry long keys so (events written before did not); source records, dead letters
    and ledger entries carry them whole: every side goes through this before they meet, so
    a long-key record is one entity. A digest is short, so this leaves it as it is.
    """
    from pyspark.sql import functions as F

    digest = F.concat(F.lit(long_keys.DIGEST_PREFIX), F.sha2(key, 256))
    return F.when(F.octet_length(key) > F.lit(long_keys.LONG_KEY_BYTES), digest).otherwise(key)


def _json_path(name: str) -> str:
    """A get_json_object path for the top-level field `name`."""
    if _PLAIN_NAME.match(name):
        return f"$.{name}"
    if "'" in name or "]" in name:
        raise ConfigurationError(f"dedupe field {name!r} cannot be read as a JSON path")
    return f"$['{name}']"


def parse_source(source: DataFrame, fields: Mapping[str, DedupeField]) -> DataFrame:
    """One row per source record: coordinates, record_ts, its dedupe key and entity (the key or
    @coord), the key read from the JSON field of the record's topic (`fields`).

    A topic whose key no field holds (a callable dedupe_key) leaves `dedupe_key` null here;
    `reconcile_frames` takes it from the outcomes and dead letters of the same coordinates.
    """
    from pyspark.sql import functions as F

    value = F.col("value").cast("string")
    key: Column = F.lit(None).cast("string")
    for topic, where in fields.items():
        if where.json is not None:
            read = _nonempty(F.get_json_object(value, _json_path(where.json)))
            key = F.when(F.col("topic") == F.lit(topic), read).otherwise(key)
    coord = _coord(F.col("topic"), F.col("partition"), F.col("offset"))
    return source.select(
        coord.alias("coord"),
        F.unix_millis("timestamp").alias("record_ts"),
        as_written(key).alias("dedupe_key"),
    ).withColumn("entity", F.coalesce("dedupe_key", F.concat(F.lit("@"), "coord")))


def parse_outcomes(outcomes: DataFrame) -> DataFrame:
    """One row per outcome event, from records of either layout; `event` is null (one row per
    record) where the value was not an outcome JSON. `event_offset` is the Kafka offset of the
    record that carries the event and `event_index` its place in that record (0 in layout 1):
    together, the order in which one partition's events were written."""
    from pyspark.sql import functions as F

    o = F.from_json(F.col("value").cast("string"), OUTCOME_SCHEMA)
    sizes = [F.size(F.col(f"o.events.{name}")) for name in _OUTCOME_ARRAYS]
    # A layout-2 document whose arrays are all there, equally long and not empty.
    batch = (F.col("o.v") == 2) & (sizes[0] > 0)
    for size in sizes[1:]:
        batch = batch & (size == sizes[0])
    entries = F.when(batch, F.col("o.events.offset")).otherwise(F.array(F.col("o.offset")))
    exploded = outcomes.select(o.alias("o"), F.col("offset").alias("event_offset")).select(
        "o", "event_offset", F.posexplode(entries).alias("event_index", "entry_offset")
    )

    def pick(name: str) -> Column:
        """The entry's field in layout 2, the record's own in layout 1 (null otherwise)."""
        entry = F.element_at(F.col(f"o.events.{name}"), F.col("event_index") + 1)
        return F.when(batch, entry).otherwise(F.col(f"o.{name}"))

    return exploded.select(
        pick("event").alias("event"),
        pick("attempt").alias("attempt"),
        pick("reason").alias("reason"),
        pick("record_ts").alias("record_ts"),
        F.col("o.finished_at").alias("finished_at"),
        "event_offset",
        "event_index",
        # As written since long keys are digests; one written whole before is made so.
        as_written(_nonempty(pick("dedupe_key"))).alias("dedupe_key"),
        _coord(F.col("o.topic"), F.col("o.partition"), F.col("entry_offset")).alias("coord"),
    )


def parse_dead_letters(dead_letters: DataFrame) -> DataFrame:
    """One row per dead letter, from its x-dlq-* headers; the dedupe key as events carry it
    (the last size tier carries a long one so already)."""
    return dead_letters.select(
        as_written(_nonempty(_header("x-dlq-dedupe-key"))).alias("dedupe_key"),
        _coord(
            _header("x-dlq-source-topic"),
            _header("x-dlq-source-partition"),
            _header("x-dlq-source-offset"),
        ).alias("coord"),
        _header("x-dlq-reason").alias("reason"),
        _header("x-dlq-at").cast("long").alias("at"),
    )
