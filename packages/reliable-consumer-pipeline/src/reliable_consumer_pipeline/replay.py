"""Replay: run a range of a topic through the worker's own record path again, on Spark.

After a bug is fixed, the records it mishandled are still in Kafka. Replay reads a range
(offsets or timestamps, per topic and partition) and puts every record through
`reliable_consumer.engine.batch.processing.open_processor` on the executors: the same handler
registry, the same claims and done-markers in Redis, the same delay queue, dead letters and
outcome events as the worker. The records are not changed or marked in any way, so a
replayed record is indistinguishable from a redelivery, and idempotency is what makes it
safe: a record whose done-marker exists is a `duplicate` (skipped), only records not
already done take effect.

Per-key order holds as in the worker: each Kafka partition of the range is one Spark task
(never split into sub-ranges), its records sorted by offset within the task and processed
in batches of `max_batch_records`, one batch after the other. Parallelism is therefore the
number of partitions in the range, as for a consumer group.

What a replay cannot deduplicate is what the worker cannot either (docs/architecture.md):
a record that does not decode has no dedupe key, so each replay over it dead-letters it
again (readers deduplicate dead letters by source coordinates). Records parked for retry
are picked up by the worker's retry scheduler, as any parked record is.

`dry_run` only reads: it decodes every record and checks its key against the done-markers
with MGET, so an operator sees how much of a range a replay would actually run. With a
marker TTL configured (WORKER_IDEMPOTENCY__TTL_S), records older than the dedupe window are
refused like the worker refuses them (dead-lettered as `beyond_dedupe_window`; the dry run
counts them so), never run on the strength of a marker that may have expired.

This module is long because the driver's half (planning the ranges, sealing the settings)
and the executors' half (`_PartitionJob`, which opens the seal and runs the worker's path) are
one contract, and the report counts what that job returns; split, the contract would span
modules that must change together.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import traceback
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pydantic import SecretStr, ValidationError
from reliable_consumer.engine.records import (
    Delivery,
    Outcome,
    clean_headers,
    redrive_of,
    redrive_ticket_value,
)
from reliable_consumer.engine.settings import KafkaSettings, Settings, describe_validation_error

from reliable_consumer_pipeline.kafka_reader import (
    EARLIEST,
    LATEST,
    KafkaConfig,
    OffsetRange,
    OffsetSpec,
    offsets_from_json,
    offsets_to_json,
    resolve_ranges,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from reliable_consumer.engine.handlers.registry import Registry
    from reliable_consumer.engine.redis.idempotency import RedriveTicket
    from reliable_consumer.engine.redis.keys import RedisKeys
    from rich.console import Console

__all__ = [
    "PartitionFailure",
    "ReplayReport",
    "SealedSettings",
    "plan_ranges",
    "print_report",
    "run_replay",
    "source_options",
]

log = logging.getLogger(__name__)

RESULT_SCHEMA = "result string"
# Never split a Kafka partition into several Spark tasks: per-key order needs one reader.
UNSPLIT = str(1 << 62)
ERROR_CHARS = 1000


# --------------------------------------------------------------------------------------------
# Settings for the executors
# --------------------------------------------------------------------------------------------


class SealedSettings:
    """The driver's settings as JSON, secrets included, for executors only.

    Executors need the real Redis URL and SASL password, so the secrets travel (inside the
    pickled task, as Spark ships any closure); the wrapper keeps them out of reprs, logs and
    error messages. Executors rebuild exactly the driver's settings: every field is in the
    JSON and it is validated without reading the executor's environment or `.env`.
    """

    __slots__ = ("_json",)

    def __init__(self, settings: Settings) -> None:
        self._json = json.dumps(settings.model_dump(mode="python"), default=_reveal)

    def __repr__(self) -> str:
        return "SealedSettings(<hidden>)"

    __str__ = __repr__

    def open(self) -> Settings:
        """The settings again; a validation error never echoes the (secret) input."""
        try:
            # The core validator, not Settings(...): no environment or .env file on the
            # executor may add to or change what the driver decided.
            settings: Settings = Settings.__pydantic_validator__.validate_json(self._json)
        except ValidationError as exc:
            raise ValueError(describe_validation_error(exc)) from None
        return settings

    def secrets(self) -> list[str]:
        """Secret values (and the Redis password on its own), to scrub from error texts."""
        try:
            return _secret_values(self.open())
        except ValueError:
            return []


def _reveal(value: object) -> object:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    raise TypeError(f"cannot serialize {type(value).__name__} in settings")


def _secret_values(settings: Settings) -> list[str]:
    from urllib.parse import urlsplit

    values = [settings.redis.url.get_secret_value()]
    password = urlsplit(values[0]).password
    if password:
        values.append(password)
    for secret in (settings.kafka.sasl_password, settings.kafka.ssl_keyfile_password):
        if secret is not None and secret.get_secret_value():
            values.append(secret.get_secret_value())
    return sorted(values, key=len, reverse=True)


def _scrub(text: str, secrets: Iterable[str], limit: int | None = ERROR_CHARS) -> str:
    """`text` with every secret value replaced by `***`, cut to `limit` characters."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text if limit is None else text[:limit]


def source_options(kafka: KafkaSettings) -> dict[str, str]:
    """The worker's Kafka settings as options of `read_topic` (either implementation).

    `kafka.isolation.level` follows the worker's `isolation_level` (read_committed by
    default) so records of aborted transactions are not replayed; the official connector
    honours it.
    """
    opts = {
        "kafka.security.protocol": kafka.security_protocol,
        "kafka.isolation.level": kafka.isolation_level,
        "kafka.request.timeout.ms": str(kafka.request_timeout_ms),
    }
    optional = {
        "kafka.sasl.mechanism": kafka.sasl_mechanism,
        "kafka.sasl.username": kafka.sasl_username,
        "kafka.sasl.password": (
            kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
        ),
        "kafka.ssl.cafile": kafka.ssl_cafile,
        "kafka.ssl.certfile": kafka.ssl_certfile,
        "kafka.ssl.keyfile": kafka.ssl_keyfile,
    }
    opts.update({k: v for k, v in optional.items() if v})
    return opts


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionFailure:
    """A Spark partition whose processing raised; records from `at` on were not replayed."""

    at: str  # topic/partition@offset of the first record of the failed batch, or topic/partition
    error: str


@dataclass
class ReplayReport:
    """What a replay (or dry run) found, summed over every partition of the range."""

    dry_run: bool
    ranges: list[OffsetRange]
    records: int = 0
    """Records processed (or checked); less than `offsets` after compaction, transaction
    markers, or a failed partition."""
    applied: int = 0
    """`succeeded`: the handler ran and its effects were written with the done-marker."""
    skipped: int = 0
    """`duplicate`: the key was already done (or dead-lettered); nothing applied."""
    dead_lettered: int = 0
    retry_scheduled: int = 0
    """Parked in the delay queue; the worker's retry scheduler takes them from there."""
    already_done: int = 0
    """Dry run: a done-marker with the same content exists (a replay skips it)."""
    already_dead_lettered: int = 0
    """Dry run: dead-lettered before with the same content (a replay skips it)."""
    would_run: int = 0
    """Dry run: no marker, the handler would run (and succeed, retry or fail as it decides)."""
    in_progress: int = 0
    """Dry run: claimed right now by a worker (a replay parks it briefly, as the worker would)."""
    conflicts: int = 0
    """Dry run: the key was used for other content (a replay dead-letters it as conflict)."""
    undecodable: int = 0
    """Dry run: no dedupe key (malformed, tombstone, ...): a replay dead-letters it again."""
    beyond_dedupe_window: int = 0
    """Dry run: older than the done-markers' TTL allows (WORKER_IDEMPOTENCY__TTL_S): its
    marker may have expired, so a replay dead-letters it as ``beyond_dedupe_window``."""
    effects_partial: int = 0
    """Dry run: an earlier delivery applied the effects in part and its dead letter was never
    acknowledged: a replay dead-letters it as ``effects_partial`` (never applies them)."""
    failures: list[PartitionFailure] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def offsets(self) -> int:
        """Offsets in the selected range (an upper bound of `records`)."""
        return sum(r.size for r in self.ranges)

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ranges"] = [
            {"topic": r.topic, "partition": r.partition, "start": r.start, "end": r.end}
            for r in self.ranges
        ]
        data.update(offsets=self.offsets, ok=self.ok)
        return data

    def add(self, result: Mapping[str, Any]) -> None:
        """Fold one Spark partition's result (the JSON `_PartitionJob` yields) into this."""
        counts: Mapping[str, int] = result.get("counts", {})
        self.records += int(result.get("records", 0))
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + int(value))
        if result.get("error"):
            at = str(result.get("at") or "the start of a partition")
            self.failures.append(PartitionFailure(at, str(result["error"])))


_OUTCOME_FIELD = {
    Outcome.SUCCEEDED: "applied",
    Outcome.DUPLICATE: "skipped",
    Outcome.DEAD_LETTERED: "dead_lettered",
    Outcome.RETRY_SCHEDULED: "retry_scheduled",
}


# --------------------------------------------------------------------------------------------
# On the executors
# --------------------------------------------------------------------------------------------


def _deliveries(batches: Iterable[pa.RecordBatch], *, fault_injection: bool) -> Iterator[Delivery]:
    """Rows of KAFKA_SCHEMA as the worker's `Delivery` (attempt 1, headers as the worker has:
    the reserved ones a producer may not set are dropped, as `Intake._dispatch` does)."""
    for batch in batches:
        ts = batch.column("timestamp")
        millis = ts.cast(pa.timestamp("ms", tz=ts.type.tz), safe=False).cast(pa.int64())
        columns = zip(
            batch.column("topic").to_pylist(),
            batch.column("partition").to_pylist(),
            batch.column("offset").to_pylist(),
            batch.column("key").to_pylist(),
            batch.column("value").to_pylist(),
            batch.column("headers").to_pylist(),
            millis.to_pylist(),
            strict=True,
        )
        for topic, partition, offset, key, value, headers, timestamp_ms in columns:
            yield Delivery(
                topic=topic,
                partition=partition,
                offset=offset,
                key=key,
                value=value,
                headers=clean_headers(
                    ((h["key"], h["value"]) for h in headers or ()),
                    fault_injection=fault_injection,
                ),
                timestamp_ms=timestamp_ms if timestamp_ms is not None else -1,
            )


def _chunks(deliveries: Iterable[Delivery], size: int) -> Iterator[list[Delivery]]:
    """Consecutive records of one Kafka partition, at most `size` each (the worker's batches)."""
    chunk: list[Delivery] = []
    for d in deliveries:
        if chunk and (len(chunk) >= size or (d.topic, d.partition) != _tp(chunk[0])):
            yield chunk
            chunk = []
        chunk.append(d)
    if chunk:
        yield chunk


def _tp(d: Delivery) -> tuple[str, int]:
    return (d.topic, d.partition)


class _PartitionJob:
    """The function `mapInArrow` runs once per Spark partition; yields one JSON result row.

    A failure is reported in the row instead of failing the Spark task, so the driver still
    sums what the other partitions did, and the partition stops at the failed batch (going
    on past it would break per-key order). Re-running the replay is safe.
    """

    def __init__(self, sealed: SealedSettings, batch_size: int, dry_run: bool) -> None:
        self.sealed = sealed
        self.batch_size = batch_size
        self.dry_run = dry_run

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        state: dict[str, Any] = {"records": 0, "counts": Counter(), "at": None, "error": None}
        try:
            settings = self.sealed.open()
            from reliable_consumer.engine.handlers.registry import Registry

            registry = Registry.from_settings(settings.topics)
            deliveries = _deliveries(batches, fault_injection=settings.fault_injection)
            chunks = _chunks(deliveries, self.batch_size)
            work = _check if self.dry_run else _apply
            asyncio.run(work(settings, registry, chunks, state))
        except Exception as exc:
            secrets = self.sealed.secrets()
            state["error"] = _scrub(f"{type(exc).__name__}: {exc}", secrets)
            # The executor's log gets the traceback, scrubbed like the report.
            trace = _scrub(traceback.format_exc(), secrets, limit=None)
            log.error("replay of a partition failed at %s\n%s", state["at"], trace)
        state["counts"] = dict(state["counts"])
        yield pa.RecordBatch.from_pylist(
            [{"result": json.dumps(state)}], schema=pa.schema([("result", pa.string())])
        )


async def _apply(
    settings: Settings, registry: Registry, chunks: Iterator[list[Delivery]], state: dict[str, Any]
) -> None:
    """Each batch through `process_batch`, in order, with one processor for the partition."""
    from reliable_consumer.engine.batch.processing import open_processor

    first = next(chunks, None)
    if first is None:  # an empty partition opens no connections
        return
    state["at"] = first[0].coordinates
    async with open_processor(settings, registry) as processor:
        for chunk in itertools.chain([first], chunks):
            state["at"] = chunk[0].coordinates
            outcomes = await processor.process_batch(chunk, ordered=True)
            state["records"] += len(chunk)
            state["counts"].update(_OUTCOME_FIELD[o] for o in outcomes)


async def _check(
    settings: Settings, registry: Registry, chunks: Iterator[list[Delivery]], state: dict[str, Any]
) -> None:
    """Dry run: classify each record against the idempotency markers (MGET only, no writes).

    Mirrors the decisions of `Decisions.prepare` and the CLAIM script (engine/redis/lua/claims.py).
    """
    from reliable_consumer.engine.batch.decoding import DecodeFailure, decode
    from reliable_consumer.engine.redis.client import make_client
    from reliable_consumer.engine.redis.delay_queue import now_ms
    from reliable_consumer.engine.redis.idempotency import fingerprint
    from reliable_consumer.engine.redis.keys import RedisKeys

    first = next(chunks, None)
    if first is None:
        return
    keys = RedisKeys(settings.redis.effective_prefix)
    client = make_client(settings.redis)
    try:
        for chunk in itertools.chain([first], chunks):
            state["at"] = chunk[0].coordinates
            identities: list[tuple[Delivery, str, str]] = []
            for d in chunk:
                handler = registry.for_topic(d.topic)
                payload = decode(handler, d, settings.max_record_bytes) if handler else None
                if handler is None or payload is None or isinstance(payload, DecodeFailure):
                    state["counts"]["undecodable"] += 1
                    continue
                try:
                    dedupe_key = handler.key_of(payload)
                except Exception:
                    dedupe_key = ""
                if not dedupe_key:
                    state["counts"]["undecodable"] += 1
                    continue
                if settings.idempotency.window_refusal(d.timestamp_ms, now_ms()) is not None:
                    # Not "the handler would run": the worker's path refuses it unread.
                    state["counts"]["beyond_dedupe_window"] += 1
                    continue
                identities.append(
                    (d, keys.idempotency(handler.name, dedupe_key), fingerprint(payload))
                )
            markers = await client.mget([k for _, k, _ in identities]) if identities else []
            tickets = [_ticket_of(keys, d) for d, _, _ in identities]
            held = await client.mget([t.key for t in tickets if t]) if any(tickets) else []
            found = iter(held)
            for (_, _, fp), marker, ticket in zip(identities, markers, tickets, strict=True):
                admitted = ticket is not None and next(found) == ticket.value.encode()
                state["counts"][_classify(marker, fp, admitted)] += 1
            state["records"] += len(chunk)
    finally:
        await client.aclose()


def _ticket_of(keys: RedisKeys, d: Delivery) -> RedriveTicket | None:
    """The redrive ticket the record's ``x-redrive-of`` names, if it carries one."""
    from reliable_consumer.engine.redis.idempotency import RedriveTicket

    of = redrive_of(d.headers) if d.headers else None
    if of is None:
        return None
    return RedriveTicket(keys.redrive_ticket(of), redrive_ticket_value(d.topic, d.value))


def _classify(marker: bytes | str | None, fp: str, redrive_admitted: bool) -> str:
    """What the CLAIM script would answer for this record, as a report field.

    ``redrive_admitted``: the record carries ``x-redrive-of`` and the ticket that the
    worker's redrive wrote for exactly this record is there (CLAIM would consume it).
    """
    if marker is None:
        return "would_run"
    text = marker.decode("utf-8", "replace") if isinstance(marker, bytes) else marker
    kind, _, rest = text.partition("|")
    marker_fp = rest.split("|", 1)[0]
    if kind == "c":
        return "in_progress"
    if kind == "x" and marker_fp == fp and redrive_admitted:
        return "would_run"  # a genuine redrive may take over its own dead marker
    if kind == "d" and marker_fp == fp and text.endswith("|p"):
        return "effects_partial"  # CLAIM answers partial: dead-lettered, not applied
    if kind in ("d", "x") and marker_fp == fp:
        return "already_done" if kind == "d" else "already_dead_lettered"
    return "conflicts"


# --------------------------------------------------------------------------------------------
# On the driver
# --------------------------------------------------------------------------------------------


def _offsets_arg(
    value: str | Mapping[str, Mapping[str, int]] | None, topics: Sequence[str], what: str
) -> str | None:
    """Spark-style offsets (`earliest`, `latest` or per-partition JSON), checked against topics."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("earliest", "latest"):
        return value.strip().lower()
    named = offsets_from_json(value)
    unknown = sorted({t for t, _ in named} - set(topics))
    if unknown:
        raise ValueError(f"{what} names topics that are not replayed: {', '.join(unknown)}")
    return json.dumps(offsets_to_json(named))


def plan_ranges(
    settings: Settings,
    topics: Sequence[str],
    *,
    starting_offsets: str | Mapping[str, Mapping[str, int]] | None = None,
    ending_offsets: str | Mapping[str, Mapping[str, int]] | None = None,
    starting_timestamp: int | None = None,
    ending_timestamp: int | None = None,
    partitions: Collection[int] | None = None,
) -> list[OffsetRange]:
    """Concrete `[start, end)` per partition, resolved once on the driver.

    Offsets and timestamps follow Spark's kafka options: unnamed partitions start at the
    earliest offset and end at the high watermark (taken now, so records produced during
    the replay are not part of it); a timestamp selects the first offset whose record
    timestamp is >= it (start inclusive, end exclusive) and wins over offsets. Partitions
    not in `partitions` get an empty range.
    """
    if starting_offsets is not None and starting_timestamp is not None:
        raise ValueError("give a starting offset or a starting timestamp, not both")
    if ending_offsets is not None and ending_timestamp is not None:
        raise ValueError("give an ending offset or an ending timestamp, not both")
    starting = OffsetSpec.parse(
        _offsets_arg(starting_offsets, topics, "starting offsets"),
        None if starting_timestamp is None else str(starting_timestamp),
        EARLIEST,
    )
    ending = OffsetSpec.parse(
        _offsets_arg(ending_offsets, topics, "ending offsets"),
        None if ending_timestamp is None else str(ending_timestamp),
        LATEST,
    )
    if ending.default == EARLIEST and not ending.per_partition and ending.timestamp_ms is None:
        raise ValueError("ending offsets 'earliest' select nothing")
    config = KafkaConfig.from_options(
        {**source_options(settings.kafka), "bootstrap": settings.kafka.bootstrap_servers}
    )
    ranges = resolve_ranges(config, topics, starting, ending)
    known = {(r.topic, r.partition) for r in ranges}
    for spec, what in ((starting, "starting"), (ending, "ending")):
        missing = sorted(set(spec.per_partition) - known)
        if missing:
            raise ValueError(f"{what} offsets name partitions that do not exist: {missing}")
    if partitions is not None:
        wanted = set(partitions)
        absent = sorted(wanted - {r.partition for r in ranges})
        if absent:
            raise ValueError(f"no topic of {list(topics)} has partitions {absent}")
        ranges = [
            r if r.partition in wanted else OffsetRange(r.topic, r.partition, r.start, r.start)
            for r in ranges
        ]
    return ranges


def run_replay(
    spark: SparkSession,
    settings: Settings,
    *,
    topics: Sequence[str] | None = None,
    starting_offsets: str | Mapping[str, Mapping[str, int]] | None = None,
    ending_offsets: str | Mapping[str, Mapping[str, int]] | None = None,
    starting_timestamp: int | None = None,
    ending_timestamp: int | None = None,
    partitions: Collection[int] | None = None,
    dry_run: bool = False,
    batch_size: int | None = None,
    source: str = "kafka",
) -> ReplayReport:
    """Replay a range through the worker's path on Spark executors; sum their outcomes.

    `topics` default to every topic bound in `settings.topics`; a topic without a handler is
    refused (each of its records would be dead-lettered as unroutable). `batch_size` defaults
    to the worker's `max_batch_records`. See `plan_ranges` for the range arguments. `source`
    is the Spark source that reads the range: `kafka` (Spark's official) or `kafka_py`.
    """
    started = time.monotonic()
    topics = list(topics) if topics else list(settings.topics.values())
    unbound = sorted(set(topics) - set(settings.topics.values()))
    if unbound:
        raise ValueError(
            f"no handler is bound to {', '.join(unbound)} (WORKER_TOPICS binds "
            f"{', '.join(sorted(settings.topics.values()))}): nothing could be replayed"
        )
    ranges = plan_ranges(
        settings,
        topics,
        starting_offsets=starting_offsets,
        ending_offsets=ending_offsets,
        starting_timestamp=starting_timestamp,
        ending_timestamp=ending_timestamp,
        partitions=partitions,
    )
    report = ReplayReport(dry_run=dry_run, ranges=ranges)
    if report.offsets == 0:
        report.elapsed_s = round(time.monotonic() - started, 3)
        return report

    from reliable_consumer_pipeline.source import read_topic

    frame = read_topic(
        spark,
        settings.kafka.bootstrap_servers,
        topics,
        source=source,
        startingOffsets=json.dumps(offsets_to_json({r.tp: r.start for r in ranges})),
        endingOffsets=json.dumps(offsets_to_json({r.tp: r.end for r in ranges})),
        maxRecordsPerPartition=UNSPLIT,
        **source_options(settings.kafka),
    )
    job = _PartitionJob(SealedSettings(settings), batch_size or settings.max_batch_records, dry_run)
    # One task per Kafka partition (UNSPLIT), sorted within it: per-key order, no shuffle.
    rows = (
        frame.sortWithinPartitions("topic", "partition", "offset")
        .mapInArrow(job, RESULT_SCHEMA)
        .collect()
    )
    for row in rows:
        report.add(json.loads(row["result"]))
    report.elapsed_s = round(time.monotonic() - started, 3)
    log.info(
        "replay of %s: %s records, %s failed partitions",
        topics,
        report.records,
        len(report.failures),
    )
    return report


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def print_report(report: ReplayReport, console: Console | None = None, listed: int = 50) -> None:
    """The range and the outcome counts as rich tables; failures in red."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    selected = [r for r in report.ranges if r.size]
    ranges = Table(title="Range replayed (end exclusive)", title_justify="left")
    for name in ("topic", "partition", "from offset", "to offset", "offsets"):
        ranges.add_column(name, justify="left" if name == "topic" else "right")
    for r in selected[:listed]:
        ranges.add_row(r.topic, str(r.partition), f"{r.start:,}", f"{r.end:,}", f"{r.size:,}")
    if len(selected) > listed:
        ranges.add_row(f"... {len(selected) - listed} more", "", "", "", "")
    console.print(ranges)

    title = "Dry run: nothing was written" if report.dry_run else "Outcomes"
    counts = Table(title=title, title_justify="left")
    counts.add_column("records")
    counts.add_column("count", justify="right")
    rows: list[tuple[str, int, str]]
    if report.dry_run:
        rows = [
            ("already done (would be skipped)", report.already_done, "green"),
            ("already dead-lettered (would be skipped)", report.already_dead_lettered, ""),
            ("not done: the handler would run", report.would_run, "bold"),
            ("claimed by a worker right now", report.in_progress, "yellow"),
            ("key used for other content (conflict)", report.conflicts, "yellow"),
            ("undecodable (dead-lettered again)", report.undecodable, "yellow"),
            (
                "beyond the dedupe window (dead-lettered, never run)",
                report.beyond_dedupe_window,
                "yellow",
            ),
            ("effects applied in part earlier (dead-lettered)", report.effects_partial, "yellow"),
        ]
    else:
        rows = [
            ("applied (succeeded)", report.applied, "bold green"),
            ("skipped (duplicate: already done)", report.skipped, ""),
            ("dead-lettered", report.dead_lettered, "yellow"),
            ("retry scheduled", report.retry_scheduled, "yellow"),
        ]
    for name, value, style in rows:
        counts.add_row(name, f"{value:,}", style=style if value else "")
    done = "records checked" if report.dry_run else "records processed"
    counts.add_row(done, f"{report.records:,}", style="bold")
    console.print(counts)
    if report.retry_scheduled:
        console.print(
            "Parked records are retried by the worker's retry scheduler "
            "(`service run` or `service retry-scheduler`)."
        )
    for failure in report.failures:
        console.print(f"[bold red]FAILED[/] at {failure.at}: {failure.error}", highlight=False)
    if report.failures:
        console.print(
            f"[bold red]{len(report.failures)} partition(s) failed[/]; records from the point "
            "shown on were not replayed. Fix the cause and replay again (it is idempotent)."
        )
    console.print(f"{report.elapsed_s:.1f} s")
