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

The heavy lifting is Spark DataFrame work (parse, groupBy, full outer joins); the driver only
reads the grant log (a Redis stream or a table) and collects the small summary.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reliable_consumer.engine.declaration.ledger import EntryKey, Ledger
from reliable_consumer.engine.declaration.location import current_app
from reliable_consumer.engine.errors import ConfigurationError
from reliable_consumer.engine.redis import long_keys
from reliable_consumer.engine.redis.keys import RedisKeys

from reliable_consumer_pipeline.kafka_reader import (
    EARLIEST,
    LATEST,
    KafkaConfig,
    OffsetSpec,
    offsets_to_json,
    resolve_ranges,
)
from reliable_consumer_pipeline.postgres_grants import PostgresGrants, read_postgres_grants
from reliable_consumer_pipeline.source import DEFAULT_SOURCE, KAFKA_SCHEMA, read_topic

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from reliable_consumer.engine.handlers.registry import Registry
    from rich.console import Console

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

log = logging.getLogger(__name__)

STATES = ("granted", "dead_lettered", "retrying", "pending", "lost")
RECORDS_TABLE = "records"
"""The per-record Parquet table's folder under the output directory (`summary` beside it)."""
GRANT_STORES = ("redis", "postgres", "both", "none")
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
LEDGER_PAGE = 10_000
BROADCAST_MAX_ROWS = 1_000_000
"""Unkeyed (undecodable) events up to this many are joined to the source by broadcast."""
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class DedupeField:
    """Where a topic's dedupe key is: its JSON field in the source record and in the ledger.

    None for a handler whose `dedupe_key` is a callable: no field holds the key, so reconcile
    takes it from the outcome events and dead letters of the record's coordinates.
    """

    json: str | None
    ledger: str | None


def dedupe_fields(registry: Registry) -> dict[str, DedupeField]:
    """Topic -> DedupeField, from the handler bound to each topic (one truth with the worker).

    The JSON name is the field's alias when the model declares one (that is what producers
    write); the ledger field is the model's field name, as the handler writes it.
    """
    out: dict[str, DedupeField] = {}
    for topic, h in registry.items():
        if callable(h.dedupe_key):
            out[topic] = DedupeField(None, None)
            continue
        info = h.model.model_fields[h.dedupe_key]
        alias = info.validation_alias if info.validation_alias is not None else info.alias
        if alias is not None and not isinstance(alias, str):  # AliasChoices / AliasPath
            log.warning("topic %s: dedupe key %s has a compound alias", topic, h.dedupe_key)
            out[topic] = DedupeField(None, h.dedupe_key)
            continue
        out[topic] = DedupeField(alias or h.dedupe_key, h.dedupe_key)
    return out


def _bound_topics() -> tuple[str, ...]:
    """The worker's topics: WORKER_TOPICS, else the app's topics (via Settings)."""
    from reliable_consumer.engine.settings import load_settings

    return tuple(load_settings().topics.values())


@dataclass(frozen=True)
class ReconcileConfig:
    """What to reconcile and how; defaults match the worker's defaults in contracts.md."""

    bootstrap: str
    out_dir: Path
    topics: tuple[str, ...] = field(default_factory=_bound_topics)
    """Source topics; the default is the worker's own bindings (WORKER_TOPICS or the app's)."""
    fields: Mapping[str, DedupeField] | None = None
    """Topic -> where its dedupe key is; None asks the handler registry the worker builds."""
    outcomes_topic: str = field(default_factory=lambda: f"{current_app().consumer_group}.outcomes")
    dlq_topics: tuple[str, ...] | None = None
    """Dead-letter topics; None means `{topic}.dlq` for every source topic."""
    redis_url: str | None = None
    key_prefix: str = field(default_factory=lambda: current_app().redis_key_prefix)
    ledger: Ledger | None = field(default_factory=lambda: current_app().ledger)
    """Where the service's handlers record their effects and whose each entry is: the app's
    declaration (`App(ledger=...)`); None, or no stream/table in it, means none is read."""
    ledger_key: str | None = None
    """Overrides the ledger's stream (`ledger_stream`). Named explicitly, a missing stream
    reads as empty (every `succeeded` then is a lost grant); the declared one missing means
    "no ledger yet", logged as a warning."""
    ledger_topics: tuple[str, ...] | None = None
    """Topics whose grants the ledger records; None means every topic a store read covers."""
    grants: str = "redis"
    """Where grants are read from: redis (the ledger stream), postgres (`grants_table` and
    the inbox), both (postgres for `postgres_topics`, Redis for the others) or none."""
    postgres_url: str | None = None
    grants_table: str | None = None
    """Overrides the ledger's table (`ledger_table`), the postgres handlers' grants: `id`,
    `source` (topic/partition/offset), `granted_at`."""
    postgres_topics: tuple[str, ...] | None = None
    """Topics whose handlers keep their grants in PostgreSQL; None means all of them."""
    stuck_after: timedelta = timedelta(minutes=15)
    as_of_ms: int | None = None
    """Reference time for `stuck` and `pending`; None = the newest outcome's finished_at."""
    grace_ms: int = 0
    max_listed: int = 1000
    kafka_options: Mapping[str, str] = field(default_factory=dict)
    source: str = DEFAULT_SOURCE
    """Spark source to read Kafka with: `kafka` (Spark's official) or `kafka_py` (ours)."""

    @property
    def dead_letter_topics(self) -> tuple[str, ...]:
        if self.dlq_topics is not None:
            return self.dlq_topics
        return tuple(f"{t}.dlq" for t in self.topics)

    @property
    def ledger_stream(self) -> str | None:
        """The Redis ledger: `ledger_key`, else the declared stream under `key_prefix` (the
        key its handlers' ``ctx.redis_key(*stream)`` names); None when neither says one."""
        if self.ledger_key:
            return self.ledger_key
        if self.ledger is None or self.ledger.stream is None:
            return None
        return RedisKeys(self.key_prefix).effect(*self.ledger.stream)

    @property
    def ledger_table(self) -> str | None:
        """The grants table: `grants_table`, else the declared one; None when neither."""
        return self.grants_table or (self.ledger.table if self.ledger is not None else None)

    @property
    def entry_key(self) -> EntryKey | None:
        """The declared function naming a ledger entry's dedupe key, if any."""
        return self.ledger.entry_key if self.ledger is not None else None

    def check_grants(self) -> None:
        """A clear error for a grants store that cannot be read as configured."""
        if self.grants not in GRANT_STORES:
            raise ConfigurationError(
                f"grants must be one of {', '.join(GRANT_STORES)}, not {self.grants!r}"
            )
        if self.grants in ("postgres", "both") and not self.postgres_url:
            raise ConfigurationError(
                "grants from PostgreSQL need its URL: set WORKER_POSTGRES__URL or pass "
                "--postgres-url (or --grants redis)"
            )

    def key_fields(self) -> dict[str, DedupeField]:
        """Each source topic's DedupeField; a clear error for a topic no handler is bound to."""
        known = dict(self.fields) if self.fields is not None else _registry_fields()
        unbound = [t for t in self.topics if t not in known]
        if unbound:
            raise ConfigurationError(
                f"no handler is bound to topic(s) {', '.join(map(repr, unbound))}, so their "
                "dedupe key is unknown and reconcile cannot join them: bind them in "
                "WORKER_TOPICS (or the app's topics, service/app.py), or name the field with "
                "--dedupe-field TOPIC=FIELD"
            )
        return {t: known[t] for t in self.topics}


def _registry_fields() -> dict[str, DedupeField]:
    """DedupeFields of the registry the worker would build from its settings."""
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.engine.settings import load_settings

    return dedupe_fields(Registry.from_settings(load_settings().topics))


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

    @property
    def ledger_available(self) -> bool:
        return self.ledger_entries is not None

    @property
    def clean(self) -> bool:
        """Nothing lost and nothing granted twice: the two promises of the worker."""
        return self.lost == 0 and self.doubled == 0

    @property
    def exit_code(self) -> int:
        return 0 if self.clean else 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["attempts"] = {str(k): v for k, v in self.attempts.items()}
        data.update(clean=self.clean, ledger_available=self.ledger_available)
        return data


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


LedgerRow = tuple[str | None, int | None, str | None]
"""(dedupe key, granted_at ms, source coordinates) of one ledger entry."""


def read_ledger(
    redis_url: str,
    stream: str,
    fields: Mapping[str, DedupeField],
    *,
    entry_key: EntryKey | None = None,
    must_exist: bool = True,
    page: int = LEDGER_PAGE,
) -> list[LedgerRow] | None:
    """One LedgerRow per ledger entry; None if Redis is unreachable, or if the stream is missing
    and not `must_exist`.

    The key is found as `_EntryKeys` says (a field of the entry's topic, the service's
    `entry_key`, any topic's field); None when none answers (reconcile then maps the `source`
    coordinates to the source record's key), `@ledger/<id>` without a source. Read in XRANGE
    pages so a large ledger never needs one huge reply; the ledger is the grant log, small
    enough to hold on the driver even at millions of entries.
    """
    import redis

    keys = _EntryKeys(fields, entry_key)
    client: Any = redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=30)
    try:
        client.ping()
        exists = bool(client.exists(stream))
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        log.warning("ledger skipped: Redis at %s is unreachable (%s)", redis_url, exc)
        client.close()
        return None
    if not exists and not must_exist:
        log.warning(
            "ledger skipped: stream %s does not exist; grants are taken from `succeeded` "
            "outcomes unchecked (name the stream to make its absence mean no grants)",
            stream,
        )
        client.close()
        return None
    entries: list[LedgerRow] = []
    start = "-"
    try:
        while True:
            chunk: list[tuple[bytes, dict[bytes, bytes]]] = client.xrange(
                stream, min=start, max="+", count=page
            )
            for entry_id, entry in chunk:
                raw_source = entry.get(b"source")
                source = raw_source.decode("utf-8", "replace") if raw_source else None
                key = keys.of(entry_id, entry, source)
                granted = entry.get(b"granted_at")
                entries.append(
                    (
                        key
                        if key is not None
                        else (None if source else f"@ledger/{entry_id.decode()}"),
                        int(granted) if granted is not None and granted.isdigit() else None,
                        source,
                    )
                )
            if len(chunk) < page:
                return entries
            start = "(" + chunk[-1][0].decode()
    finally:
        client.close()
        keys.report()


class _EntryKeys:
    """Which record a Redis ledger entry is for: its dedupe key, from the entry's fields.

    In order: the ledger field of the handler bound to the topic in the entry's `source`
    (`DedupeField.ledger`); for a topic whose key no field holds (a computed `dedupe_key`),
    or an entry naming no reconciled topic, what the service's `entry_key` says (its
    `Ledger` declaration, the one truth of what its entries mean); for the latter, failing
    that, the first of the topics' ledger fields the entry has. None: no answer.
    """

    def __init__(self, fields: Mapping[str, DedupeField], entry_key: EntryKey | None) -> None:
        self._by_topic = {t: f.ledger.encode() if f.ledger else None for t, f in fields.items()}
        self._any = list(dict.fromkeys(f for f in self._by_topic.values() if f is not None))
        self._entry_key = entry_key
        self._failed = 0
        self._first_failure = ""

    def of(self, entry_id: bytes, entry: Mapping[bytes, bytes], source: str | None) -> str | None:
        topic = source.rsplit("/", 2)[0] if source else None
        if topic is not None and topic in self._by_topic:
            own = self._by_topic[topic]
            if own is None:
                return self._declared(entry_id, entry)
            value = entry.get(own)
            return value.decode("utf-8", "replace") if value else None
        declared = self._declared(entry_id, entry)
        if declared is not None:
            return declared
        value = next((entry[f] for f in self._any if entry.get(f)), None)
        return value.decode("utf-8", "replace") if value is not None else None

    def _declared(self, entry_id: bytes, entry: Mapping[bytes, bytes]) -> str | None:
        """The service's `entry_key` of the entry; None if it has none, or fails on it."""
        if self._entry_key is None:
            return None
        fields = {
            name.decode("utf-8", "replace"): value.decode("utf-8", "replace")
            for name, value in entry.items()
        }
        try:
            key = self._entry_key(fields)
            if key is not None and not isinstance(key, str):
                raise TypeError(f"returned {key!r}, not a str")
        except Exception as exc:  # the service's code: one odd entry must not stop the audit
            self._failed += 1
            if self._failed == 1:
                self._first_failure = f"{entry_id.decode()}: {type(exc).__name__}: {exc}"
            return None
        return key or None

    def report(self) -> None:
        """One line for every entry the service's `entry_key` failed on."""
        if self._failed:
            log.warning(
                "ledger: the app's Ledger.entry_key failed on %d entries (first %s); they are "
                "matched to records by their source coordinates",
                self._failed,
                self._first_failure,
            )


def _snapshot(
    config: KafkaConfig, topics: Sequence[str], required: bool
) -> dict[str, dict[str, int]] | None:
    """End offsets (high watermarks) of `topics` now; None if optional topics are missing."""
    if not required:
        topics = [t for t in topics if _exists(config, t)]
    if not topics:
        return None
    ranges = resolve_ranges(config, topics, OffsetSpec(EARLIEST), OffsetSpec(LATEST))
    return offsets_to_json({r.tp: r.end for r in ranges})


def _read(
    spark: SparkSession, rc: ReconcileConfig, ending: dict[str, dict[str, int]] | None
) -> DataFrame:
    """The topics of an `ending` snapshot, from their start up to it (empty if None)."""
    if ending is None:
        return spark.createDataFrame([], KAFKA_SCHEMA)
    import json

    return read_topic(
        spark,
        rc.bootstrap,
        list(ending),
        source=rc.source,
        startingOffsets="earliest",
        endingOffsets=json.dumps(ending),
        **dict(rc.kafka_options),
    )


# --------------------------------------------------------------------------------------------
# The DataFrame work
# --------------------------------------------------------------------------------------------


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
    unkeyed = (
        readable.where(F.col("dedupe_key").isNull())
        .select("coord")
        .unionByName(dlq.where(F.col("dedupe_key").isNull()).select("coord"))
    )
    if ledger is not None:
        unkeyed = unkeyed.unionByName(ledger.where(F.col("dedupe_key").isNull()).select("coord"))
    unkeyed = unkeyed.where(F.col("coord").isNotNull()).distinct()
    coords = src.select("coord", F.col("entity").alias("src_entity"))
    mapping = coords.join(F.broadcast(unkeyed) if broadcast_unkeyed else unkeyed, on="coord")

    stacked = (
        src.select("entity", "dedupe_key", "coord", "record_ts", F.lit("src").alias("kind"))
        .unionByName(
            _attribute(readable, mapping, broadcast_unkeyed).select(
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
            _attribute(dlq, mapping, broadcast_unkeyed).select(
                "entity", "coord", "reason", "at", F.lit("dlq").alias("kind")
            ),
            allowMissingColumns=True,
        )
    )
    if ledger is not None:
        stacked = stacked.unionByName(
            _attribute(ledger, mapping, broadcast_unkeyed).select(
                "entity", "granted_at", F.lit("ledger").alias("kind")
            ),
            allowMissingColumns=True,
        )

    kind, ev = F.col("kind"), F.col("event")
    is_src, is_dlq = kind == "src", kind == "dlq"
    succeeded = ev == "succeeded"
    in_scope = F.lit(True)
    if ledger_topics is not None:
        in_scope = F.substring_index(F.col("coord"), "/", 1).isin(list(ledger_topics))
    agg = stacked.groupBy("entity").agg(
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

    as_of = F.lit(as_of_ms)
    # The ledger is the grant itself, so where it is readable (and covers the entity's topic)
    # only a ledger entry is a grant: a `succeeded` outcome without one is a lost grant.
    ledger_on = F.lit(ledger is not None) & F.col("ledger_scope")
    ledger_entries = F.col("ledger_entries") if ledger is not None else F.lit(0)
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
    return agg.select(
        "entity",
        "dedupe_key",
        (F.col("entity").startswith("@") & in_source).alias("malformed"),
        in_source.alias("in_source"),
        "source_records",
        "records_without_outcome",
        "first_record_ts",
        "source_coord",
        state.alias("state"),
        F.coalesce("dlq_reason", F.col("last_dead_letter_event")["reason"]).alias(
            "dead_letter_reason"
        ),
        F.when(ledger_on, ledger_entries).otherwise(F.col("succeeded_events")).alias("grants"),
        "succeeded_events",
        (ledger_entries if ledger is not None else F.lit(None).cast("long")).alias(
            "ledger_entries"
        ),
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
        (only_duplicate & ~ledger_on).alias("unverified_grant"),
        (ledger_on & (F.col("succeeded_events") != ledger_entries)).alias("ledger_mismatch"),
        lost_grant.alias("lost_grant"),
    ).withColumn(
        "stuck",
        (F.col("state") == "retrying") & (as_of - F.col("first_retry_at") > F.lit(stuck_after_ms)),
    )


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


# --------------------------------------------------------------------------------------------
# The job
# --------------------------------------------------------------------------------------------


def _ledger_frame(spark: SparkSession, rows: Sequence[LedgerRow]) -> DataFrame:
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


def run_reconcile(spark: SparkSession, rc: ReconcileConfig) -> ReconcileReport:
    """Snapshot the topics, reconcile, write Parquet under `rc.out_dir`, return the summary.

    Snapshot order matters: source end offsets first, then outcomes and dead letters, then the
    ledger, so every record in the source snapshot had its chance to reach the later ones.
    The explicit end offsets also keep every Spark action of this run on the same data, and
    the parsed inputs are cached so each topic is read from Kafka once.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    started = time.monotonic()
    timings: dict[str, float] = {}
    lap = started

    def phase(name: str) -> None:
        nonlocal lap
        now = time.monotonic()
        timings[name] = round(now - lap, 3)
        lap = now
        log.info("reconcile: %s took %.1fs", name, timings[name])

    fields = rc.key_fields()
    kafka = KafkaConfig.from_options({**rc.kafka_options, "bootstrap": rc.bootstrap})
    source_end = _snapshot(kafka, rc.topics, required=True)
    outcomes_end = _snapshot(kafka, [rc.outcomes_topic], required=False)
    dlq_end = _snapshot(kafka, rc.dead_letter_topics, required=False)
    phase("snapshot")
    ledger_rows, pg, store, ledger_topics = _read_grants(rc, fields)
    phase("ledger")

    cached = StorageLevel.MEMORY_AND_DISK
    src = parse_source(_read(spark, rc, source_end), fields).persist(cached)
    events = parse_outcomes(_read(spark, rc, outcomes_end)).persist(cached)
    dlq = parse_dead_letters(_read(spark, rc, dlq_end)).persist(cached)
    ledger = _ledger_frame(spark, ledger_rows) if ledger_rows is not None else None
    try:
        counts = events.agg(
            F.count("*").alias("all"),
            F.count("event").alias("readable"),
            F.max("finished_at").alias("newest"),
            F.count_if(F.col("event").isNotNull() & F.col("dedupe_key").isNull()).alias("unkeyed"),
        ).first()
        assert counts is not None
        phase("outcomes")
        # The reference time is data, not wall clock, unless asked: reruns agree.
        as_of_ms = rc.as_of_ms
        if as_of_ms is None:
            newest = counts["newest"]
            as_of_ms = int(newest) if newest is not None else int(time.time() * 1000)

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
        phase("records")
    finally:
        for frame in (src, events, dlq):
            frame.unpersist()
    table = spark.read.parquet(f"{out}/{RECORDS_TABLE}")
    snapshot = {**(source_end or {}), **(outcomes_end or {}), **(dlq_end or {})}
    report = _summarize(
        table,
        rc,
        as_of_ms,
        ledger_rows,
        snapshot,
        outcome_events=int(counts["readable"]),
        unreadable_events=int(counts["all"]) - int(counts["readable"]),
    )
    phase("summary")
    report.grants_store = store
    if pg is not None:
        report.inbox_rows = pg.inbox_rows
        report.grants_without_inbox = pg.grants_without_inbox
        report.inbox_without_grant = pg.inbox_without_grant
        report.grants_without_inbox_ids = pg.grants_without_inbox_ids
        report.inbox_without_grant_keys = pg.inbox_without_grant_keys
    report.timings = timings
    report.elapsed_s = round(time.monotonic() - started, 3)
    _write_summary(spark, report, out)
    return report


def _read_grants(
    rc: ReconcileConfig, fields: Mapping[str, DedupeField]
) -> tuple[list[LedgerRow] | None, PostgresGrants | None, str | None, tuple[str, ...] | None]:
    """The grants of every store `rc.grants` names, as ledger rows; the store(s) read; the
    topics they cover (None: all), so a topic whose store was unreadable is not judged by it.

    After the outcomes snapshot, like the Redis ledger: every grant a snapshotted record led
    to is already committed when it is read.
    """
    rc.check_grants()
    pg_topics = tuple(rc.postgres_topics) if rc.postgres_topics is not None else rc.topics
    redis_topics = tuple(t for t in rc.topics if rc.grants == "redis" or t not in pg_topics)
    redis_rows = pg = None
    if rc.grants in ("redis", "both") and rc.redis_url and redis_topics:
        stream = rc.ledger_stream
        if stream is None:
            log.warning(
                "ledger skipped: the app declares no ledger stream (App(ledger=Ledger(stream="
                "...))); grants of %s are taken from `succeeded` outcomes unchecked (name a "
                "stream with --ledger-stream)",
                ", ".join(redis_topics),
            )
        else:
            redis_rows = read_ledger(
                rc.redis_url,
                stream,
                fields,
                entry_key=rc.entry_key,
                must_exist=bool(rc.ledger_key),
            )
    if rc.grants in ("postgres", "both") and rc.postgres_url and pg_topics:
        table = rc.ledger_table
        if table is None:
            log.warning(
                "grants skipped: the app declares no ledger table (App(ledger=Ledger(table="
                "...))); grants of %s are taken from `succeeded` outcomes unchecked (name a "
                "table with --grants-table)",
                ", ".join(pg_topics),
            )
        else:
            pg = read_postgres_grants(rc.postgres_url, table, pg_topics, max_listed=rc.max_listed)
    if redis_rows is None and pg is None:
        return None, None, None, rc.ledger_topics
    covered: list[str] = []
    if redis_rows is not None:
        covered.extend(redis_topics)
    if pg is not None:
        covered.extend(pg_topics)
    store = (
        "both"
        if redis_rows is not None and pg is not None
        else "redis"
        if pg is None
        else "postgres"
    )
    rows = [*(redis_rows or ()), *(pg.rows if pg is not None else ())]
    if rc.ledger_topics is not None:
        return rows, pg, store, rc.ledger_topics
    return rows, pg, store, None if set(rc.topics) <= set(covered) else tuple(covered)


def _exists(config: KafkaConfig, topic: str) -> bool:
    from reliable_consumer_pipeline.kafka_reader import topic_partitions

    try:
        topic_partitions(config, [topic], timeout_s=1.0)
    except ValueError:
        log.warning("topic %s not found; treating it as empty", topic)
        return False
    return True


def _summarize(
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


def _write_summary(spark: SparkSession, report: ReconcileReport, out: str) -> None:
    """One-row Parquet summary next to the per-record table, for dashboards and diffs."""
    import json

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


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def print_report(report: ReconcileReport, console: Console | None = None, listed: int = 10) -> None:
    """The report as rich tables: states, problems (with example keys), latency, inputs."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    total = max(report.records, 1)
    states = Table(title="Final state per record (dedupe key)", title_justify="left")
    states.add_column("state")
    states.add_column("records", justify="right")
    states.add_column("share", justify="right")
    for state, count in report.states.items():
        style = "red" if state == "lost" and count else ""
        states.add_row(state, f"{count:,}", f"{100 * count / total:.2f}%", style=style)
    states.add_row("total", f"{report.records:,}", "", style="bold")

    checks = Table(title="Checks", title_justify="left")
    checks.add_column("check")
    checks.add_column("count", justify="right")
    checks.add_column("examples")
    rows: list[tuple[str, int, list[str], bool]] = [
        ("lost", report.lost, report.lost_keys, True),
        ("of them: succeeded, but no ledger entry", report.lost_grants, [], True),
        ("doubled (granted more than once)", report.doubled, report.doubled_keys, True),
        ("stuck (retrying too long)", report.stuck, report.stuck_keys, False),
        ("malformed source records", report.malformed, [], False),
        ("grants trusted without a ledger", report.unverified_grants, [], False),
        ("succeeded events != ledger entries", report.ledger_mismatches, [], False),
        ("source records with no outcome", report.records_without_outcome, [], False),
        ("unreadable outcome records", report.unreadable_events, [], False),
    ]
    if report.inbox_rows is not None:  # the PostgreSQL store's own cross-checks
        rows += [
            (
                "grant rows with no inbox row",
                report.grants_without_inbox,
                report.grants_without_inbox_ids,
                False,
            ),
            (
                "inbox rows with no grant row",
                report.inbox_without_grant,
                report.inbox_without_grant_keys,
                False,
            ),
        ]
    for name, count, examples, fatal in rows:
        style = ("red" if fatal else "yellow") if count else "green"
        shown = ", ".join(examples[:listed]) + (" ..." if len(examples) > listed else "")
        checks.add_row(name, f"{count:,}", shown, style=style)

    latency = Table(title="End-to-end latency (record -> granted), ms", title_justify="left")
    for name in ("p50", "p90", "p99", "max", "count"):
        latency.add_column(name, justify="right")
    latency.add_row(
        *(_fmt(report.latency_ms.get(k)) for k in ("p50", "p90", "p99", "max", "count"))
    )

    mix = Table(title="Attempts (terminal) and dead-letter reasons", title_justify="left")
    mix.add_column("attempts", justify="right")
    mix.add_column("records", justify="right")
    mix.add_column("reason")
    mix.add_column("records", justify="right")
    attempts = list(report.attempts.items())
    reasons = list(report.dead_letter_reasons.items())
    for i in range(max(len(attempts), len(reasons))):
        a = attempts[i] if i < len(attempts) else None
        r = reasons[i] if i < len(reasons) else None
        mix.add_row(
            str(a[0]) if a else "",
            f"{a[1]:,}" if a else "",
            r[0] if r else "",
            f"{r[1]:,}" if r else "",
        )

    inputs = Table(title="Inputs", title_justify="left")
    inputs.add_column("source records", justify="right")
    inputs.add_column("outcome events", justify="right")
    inputs.add_column("dead letters", justify="right")
    inputs.add_column("grants", justify="right")
    inputs.add_column("from", justify="right")
    inputs.add_column("as of (ms)", justify="right")
    inputs.add_column("seconds", justify="right")
    inputs.add_row(
        f"{report.source_records:,}",
        f"{report.outcome_events:,}",
        f"{report.dead_letters:,}",
        "not read" if report.ledger_entries is None else f"{report.ledger_entries:,}",
        report.grants_store or "-",
        str(report.as_of_ms),
        f"{report.elapsed_s:.1f}",
    )

    for table in (states, checks, latency, mix, inputs):
        console.print(table)
    if report.clean:
        console.print("[bold green]CLEAN[/]: nothing lost, nothing granted twice.")
    else:
        console.print(
            f"[bold red]NOT CLEAN[/]: {report.lost:,} lost, {report.doubled:,} "
            f"doubled. Per-record table: {report.out_dir}/{RECORDS_TABLE}"
        )


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}"
