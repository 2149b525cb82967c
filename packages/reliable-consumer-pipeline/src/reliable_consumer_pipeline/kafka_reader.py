"""Synchronous Kafka access for the Spark source: partitions, offsets, watermarks, range reads.

Spark calls a Python data source from plain synchronous code (the planner process on the
driver, Python workers on executors), so everything here wraps aiokafka in a private event
loop. Nothing in this module imports pyspark: it is unit-testable against a broker alone and
reused by the reconcile job for its snapshot offsets.

Offsets follow Kafka's convention: an offset range `[start, end)` names the records with
`start <= offset < end`, and `end` of a whole partition is its high watermark.

This module is long because every read it offers (partitions, watermarks, offsets for a
time, range reads, commits) runs on one private event loop with one consumer set-up
(`_run_with_consumer`) and one offset convention; split apart, each part would repeat them.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError


def _app_client_id() -> str:
    """``<app name>-pipeline``. The engine is imported here, on the driver, not with the
    module: Spark's Python workers import this module to run the source, and Spark gives a
    worker 10 s to connect back; the engine was a quarter of that import on a quiet machine."""
    from reliable_consumer.engine.declaration.location import current_app

    return f"{current_app().name}-pipeline"


__all__ = [
    "EARLIEST",
    "LATEST",
    "KafkaConfig",
    "OffsetRange",
    "OffsetSpec",
    "PartitionOffsets",
    "commit_offsets",
    "fetch_high_watermarks",
    "iter_range",
    "offsets_from_json",
    "offsets_to_json",
    "resolve_ranges",
    "split_ranges",
    "topic_partitions",
]

log = logging.getLogger(__name__)

EARLIEST = -2
"""Spark's and Kafka's sentinel for "the log start offset" in offset JSON."""
LATEST = -1
"""Spark's and Kafka's sentinel for "the high watermark" in offset JSON."""

T = TypeVar("T")

PartitionOffsets = dict[tuple[str, int], int]
"""(topic, partition) -> offset; the in-memory form of Spark's `{"topic": {"0": 23}}` JSON."""


@dataclass(frozen=True)
class KafkaConfig:
    """Connection settings shared by the planner and every reader task (picklable on purpose).

    Security options mirror the worker's `WORKER_KAFKA__*` settings; the SSL context is built
    inside each process from file paths because an `ssl.SSLContext` cannot be pickled.
    """

    bootstrap: str
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # The app's name (service/app.py), read where the config is made: the driver.
    client_id: str = field(default_factory=_app_client_id)
    request_timeout_ms: int = 30_000
    # A read that makes no progress for this long fails the task instead of hanging the job.
    poll_timeout_ms: int = 120_000
    fetch_max_bytes: int = 32 * 1024 * 1024
    max_partition_fetch_bytes: int = 8 * 1024 * 1024
    # Tansu answers a Fetch with max_wait 0 with nothing at all, so never go to 0 here.
    fetch_max_wait_ms: int = 50
    # As the worker: records of aborted producer transactions are never read (or replayed).
    isolation_level: str = "read_committed"

    # Option names (Spark-style, case-insensitive) -> field. `kafka.*` names match what the
    # official connector takes where a Java property means the same thing.
    OPTION_NAMES = {
        "bootstrap": "bootstrap",
        "kafka.bootstrap.servers": "bootstrap",
        "kafka.security.protocol": "security_protocol",
        "kafka.sasl.mechanism": "sasl_mechanism",
        "kafka.sasl.username": "sasl_username",
        "kafka.sasl.password": "sasl_password",
        "kafka.ssl.cafile": "ssl_cafile",
        "kafka.ssl.certfile": "ssl_certfile",
        "kafka.ssl.keyfile": "ssl_keyfile",
        "kafka.client.id": "client_id",
        "kafka.request.timeout.ms": "request_timeout_ms",
        "polltimeoutms": "poll_timeout_ms",
        "kafkaconsumer.polltimeoutms": "poll_timeout_ms",
        "kafka.fetch.max.bytes": "fetch_max_bytes",
        "kafka.max.partition.fetch.bytes": "max_partition_fetch_bytes",
        "kafka.fetch.max.wait.ms": "fetch_max_wait_ms",
        "kafka.isolation.level": "isolation_level",
    }

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> KafkaConfig:
        """Build from data source options; unknown options are left for the caller."""
        values: dict[str, Any] = {}
        ints = {
            "request_timeout_ms",
            "poll_timeout_ms",
            "fetch_max_bytes",
            "max_partition_fetch_bytes",
            "fetch_max_wait_ms",
        }
        for name, value in options.items():
            target = cls.OPTION_NAMES.get(name.lower())
            if target is not None and value is not None:
                values[target] = int(value) if target in ints else str(value)
        if not values.get("bootstrap"):
            raise ValueError("option 'bootstrap' (or 'kafka.bootstrap.servers') is required")
        return cls(**values)

    def consumer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for an AIOKafkaConsumer that never joins a group on its own."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "client_id": self.client_id,
            "enable_auto_commit": False,
            "request_timeout_ms": self.request_timeout_ms,
            "fetch_max_bytes": self.fetch_max_bytes,
            "max_partition_fetch_bytes": self.max_partition_fetch_bytes,
            "fetch_max_wait_ms": self.fetch_max_wait_ms,
            "security_protocol": self.security_protocol,
            "isolation_level": self.isolation_level,
            # CRCs were checked by the broker on produce; skipping them is a large share of
            # the per-record cost of a pure-Python fetch path.
            "check_crcs": False,
        }
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            kwargs["sasl_plain_password"] = self.sasl_password
        if "SSL" in self.security_protocol.upper():
            from aiokafka.helpers import create_ssl_context

            kwargs["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        return kwargs


@dataclass(frozen=True, order=True)
class OffsetRange:
    """Records `[start, end)` of one topic-partition: the unit a Spark task reads."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        return max(0, self.end - self.start)

    @property
    def tp(self) -> tuple[str, int]:
        return (self.topic, self.partition)


@dataclass(frozen=True)
class OffsetSpec:
    """Where a read starts or ends, as Spark's kafka format spells it.

    `timestamp_ms` wins over everything else (Spark's precedence for `startingTimestamp`);
    otherwise `per_partition` gives explicit offsets (which may be EARLIEST/LATEST) and
    partitions it does not name use `default`.
    """

    default: int
    per_partition: Mapping[tuple[str, int], int] = field(default_factory=dict)
    timestamp_ms: int | None = None

    @classmethod
    def parse(cls, value: str | None, timestamp: str | None, default: int) -> OffsetSpec:
        """Parse `"earliest"`, `"latest"`, or `{"topic":{"0":23,"1":-2}}` plus a timestamp."""
        ts = int(timestamp) if timestamp not in (None, "") else None
        if value is None or value.strip() == "":
            return cls(default, {}, ts)
        text = value.strip()
        if text.lower() == "earliest":
            return cls(EARLIEST, {}, ts)
        if text.lower() == "latest":
            return cls(LATEST, {}, ts)
        return cls(default, offsets_from_json(text), ts)


def offsets_from_json(text: str | Mapping[str, Mapping[str, int]]) -> PartitionOffsets:
    """`{"t":{"0":5}}` (a string or already-parsed dict) -> {("t", 0): 5}."""
    data = json.loads(text) if isinstance(text, str) else text
    if not isinstance(data, Mapping):
        raise ValueError(f"offsets must be a JSON object of topic -> partition -> offset: {text!r}")
    out: PartitionOffsets = {}
    for topic, parts in data.items():
        if not isinstance(parts, Mapping):
            raise ValueError(f"offsets for topic {topic!r} must be an object: {parts!r}")
        for partition, offset in parts.items():
            out[(str(topic), int(partition))] = int(offset)
    return out


def offsets_to_json(offsets: Mapping[tuple[str, int], int]) -> dict[str, dict[str, int]]:
    """The inverse of offsets_from_json, sorted so equal offsets always serialize equally.

    Spark decides "is there new data" by comparing offset JSON strings, so key order matters.
    """
    out: dict[str, dict[str, int]] = {}
    for topic, partition in sorted(offsets):
        out.setdefault(topic, {})[str(partition)] = int(offsets[(topic, partition)])
    return out


# --------------------------------------------------------------------------------------------
# Event-loop plumbing
# --------------------------------------------------------------------------------------------


# Planning only looks at one batch per partition (watermarks, timestamp probes); Kafka returns
# at least one whole batch whatever the limit, so small limits cost nothing and save copying
# up to max_partition_fetch_bytes per partition.
_PROBE_FETCH = {"max_partition_fetch_bytes": 64 * 1024, "fetch_max_bytes": 1024 * 1024}


def _run_with_consumer(
    config: KafkaConfig, work: Callable[[AIOKafkaConsumer], Awaitable[T]], **overrides: Any
) -> T:
    """Start a group-less consumer in a private loop, run `work(consumer)`, always stop it."""

    async def main() -> T:
        consumer = AIOKafkaConsumer(**{**config.consumer_kwargs(), **_PROBE_FETCH, **overrides})
        try:
            await consumer.start()
            return await work(consumer)
        finally:
            await consumer.stop()

    return asyncio.run(main())


async def _partitions_of(
    consumer: AIOKafkaConsumer, topics: Sequence[str], timeout_s: float
) -> list[TopicPartition]:
    """Every partition of `topics`; waits briefly for metadata of freshly created topics."""
    deadline = time.monotonic() + timeout_s
    while True:
        await consumer._client.force_metadata_update()
        missing = [t for t in topics if not consumer.partitions_for_topic(t)]
        if not missing:
            break
        if time.monotonic() >= deadline:
            raise ValueError(
                f"topics not found on {consumer._client._bootstrap_servers}: {missing}"
            )
        await asyncio.sleep(0.1)
    return [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t))]


def topic_partitions(
    config: KafkaConfig, topics: Sequence[str], timeout_s: float = 10.0
) -> list[tuple[str, int]]:
    """(topic, partition) for every partition of `topics`, in order."""

    async def work(consumer: AIOKafkaConsumer) -> list[tuple[str, int]]:
        tps = await _partitions_of(consumer, topics, timeout_s)
        return [(tp.topic, tp.partition) for tp in tps]

    return _run_with_consumer(config, work)


# --------------------------------------------------------------------------------------------
# High watermarks
# --------------------------------------------------------------------------------------------


async def _high_watermarks(
    consumer: AIOKafkaConsumer, tps: Sequence[TopicPartition], timeout_s: float
) -> dict[TopicPartition, int]:
    """The high watermark of each partition, as carried in Fetch responses.

    Why not ListOffsets ("latest", aiokafka `end_offsets`)? Some Kafka-protocol brokers answer
    it with the base offset of the last *batch* + 1 after batched produce (the dev broker,
    Tansu 0.6, does: NOTES.md quirk 1), which would silently drop the tail of every partition.
    Every Fetch response carries the partition's high watermark, the number Kafka itself uses
    for consumer lag, so we fetch once per partition from a position at or below it and read
    the watermark off the response. ListOffsets still serves as the seek hint: on a correct
    broker it *is* the high watermark and the fetch returns no records, only the watermark.
    """
    if not tps:
        return {}
    consumer.assign(list(tps))
    hint = await consumer.end_offsets(list(tps))
    begin = await consumer.beginning_offsets(list(tps))
    for tp in tps:
        consumer.seek(tp, max(begin[tp], hint[tp]))
    deadline = time.monotonic() + timeout_s
    while True:
        known = {tp: consumer.highwater(tp) for tp in tps}
        if all(v is not None for v in known.values()):
            return {tp: int(v) for tp, v in known.items() if v is not None}
        if time.monotonic() >= deadline:
            missing = [f"{tp.topic}/{tp.partition}" for tp, v in known.items() if v is None]
            raise TimeoutError(f"no fetch response carried a high watermark for {missing}")
        # Returns as soon as any partition has records, else after the fetch wait; either way
        # every answered partition has its watermark recorded by then.
        await consumer.getmany(timeout_ms=100, max_records=1)


def fetch_high_watermarks(config: KafkaConfig, tps: Iterable[tuple[str, int]]) -> PartitionOffsets:
    """High watermark per (topic, partition); see `_high_watermarks` for why not ListOffsets."""
    wanted = [TopicPartition(t, p) for t, p in tps]

    async def work(consumer: AIOKafkaConsumer) -> PartitionOffsets:
        hw = await _high_watermarks(consumer, wanted, config.request_timeout_ms / 1000)
        return {(tp.topic, tp.partition): v for tp, v in hw.items()}

    return _run_with_consumer(config, work)


# --------------------------------------------------------------------------------------------
# Resolving a read's offsets
# --------------------------------------------------------------------------------------------


async def _first_record_at(
    consumer: AIOKafkaConsumer, tp: TopicPartition, offset: int, end: int, timeout_s: float
) -> ConsumerRecord[Any, Any] | None:
    """The first record at or after `offset` (None if none below `end`)."""
    if offset >= end:
        return None
    consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await consumer.getmany(tp, timeout_ms=200, max_records=1)
        records = batch.get(tp, [])
        if records:
            return records[0] if records[0].offset < end else None
        if await consumer.position(tp) >= end:
            return None
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no record at or after {tp.topic}/{tp.partition}@{offset}")


async def _offset_for_time(
    consumer: AIOKafkaConsumer,
    tp: TopicPartition,
    ts_ms: int,
    begin: int,
    end: int,
    candidate: int | None,
    timeout_s: float,
) -> int:
    """The earliest offset whose record timestamp is >= `ts_ms` (`end` if there is none).

    Kafka's ListOffsets-by-time (aiokafka `offsets_for_times`) answers this from the broker's
    time index, but not every broker implements it (Tansu 0.6 returns offset 0 stamped "now"
    for any timestamp). So its answer is checked against the records on either side of it,
    and only if that check fails is the offset found by a binary search over fetches
    (log2(n) single-record probes). Timestamps are assumed non-decreasing within a partition,
    which is what the time index assumes too.
    """

    async def ts_at(offset: int) -> tuple[int, int] | None:
        rec = await _first_record_at(consumer, tp, offset, end, timeout_s)
        return None if rec is None else (rec.offset, rec.timestamp)

    if candidate is not None and begin <= candidate <= end:
        here = await ts_at(candidate)
        before = await ts_at(candidate - 1) if candidate > begin else None
        here_ok = here is None or here[1] >= ts_ms
        before_ok = candidate == begin or (before is not None and before[1] < ts_ms)
        if here_ok and before_ok:
            return candidate
        log.info(
            "offsets_for_times answer %s for %s/%s at %s failed verification; searching",
            candidate,
            tp.topic,
            tp.partition,
            ts_ms,
        )
    lo, hi = begin, end
    while lo < hi:
        mid = (lo + hi) // 2
        found = await ts_at(mid)
        if found is None or found[1] >= ts_ms:
            hi = mid
        else:
            lo = found[0] + 1
    return lo


async def _offsets_for_time(
    consumer: AIOKafkaConsumer,
    tps: Sequence[TopicPartition],
    ts_ms: int,
    begin: Mapping[TopicPartition, int],
    end: Mapping[TopicPartition, int],
    timeout_s: float,
) -> dict[TopicPartition, int]:
    if not tps:
        return {}
    try:
        answers = await consumer.offsets_for_times(dict.fromkeys(tps, ts_ms))
    except KafkaError as exc:  # a broker without ListOffsets v1 support
        log.info("offsets_for_times failed (%s); searching by fetch", exc)
        answers = {}
    out = {}
    for tp in tps:
        answer = answers.get(tp)
        candidate = end[tp] if answer is None else answer.offset
        out[tp] = await _offset_for_time(
            consumer, tp, ts_ms, begin[tp], end[tp], candidate, timeout_s
        )
    return out


def resolve_ranges(
    config: KafkaConfig,
    topics: Sequence[str],
    starting: OffsetSpec,
    ending: OffsetSpec,
    *,
    fail_on_data_loss: bool = True,
) -> list[OffsetRange]:
    """Concrete `[start, end)` per partition of `topics`, all in one broker connection.

    End offsets come from `_high_watermarks` (not ListOffsets, see there). A start below the
    log start offset means records were deleted before we read them: an error unless
    `fail_on_data_loss` is False, when the range is clamped (Spark's `failOnDataLoss`).
    """
    timeout_s = config.request_timeout_ms / 1000

    async def work(consumer: AIOKafkaConsumer) -> list[OffsetRange]:
        tps = await _partitions_of(consumer, topics, timeout_s)
        high = await _high_watermarks(consumer, tps, timeout_s)
        low = await consumer.beginning_offsets(tps)

        async def resolve(spec: OffsetSpec, what: str) -> dict[TopicPartition, int]:
            if spec.timestamp_ms is not None:
                return await _offsets_for_time(
                    consumer, tps, spec.timestamp_ms, low, high, timeout_s
                )
            resolved = {}
            for tp in tps:
                value = spec.per_partition.get((tp.topic, tp.partition), spec.default)
                if value == EARLIEST:
                    value = low[tp]
                elif value == LATEST:
                    value = high[tp]
                elif value < 0:
                    raise ValueError(f"{what} offset {value} for {tp.topic}/{tp.partition}")
                resolved[tp] = value
            return resolved

        starts = await resolve(starting, "starting")
        ends = await resolve(ending, "ending")
        ranges = []
        for tp in tps:
            start, end = starts[tp], min(ends[tp], high[tp])
            if start < low[tp]:
                if fail_on_data_loss:
                    raise ValueError(
                        f"{tp.topic}/{tp.partition}: starting offset {start} is below the log "
                        f"start offset {low[tp]} (records were deleted); set "
                        "failOnDataLoss=false to read from the log start instead"
                    )
                start = low[tp]
            ranges.append(OffsetRange(tp.topic, tp.partition, start, max(start, end)))
        return ranges

    return _run_with_consumer(config, work)


def split_ranges(ranges: Iterable[OffsetRange], max_records: int) -> list[OffsetRange]:
    """Cut ranges into pieces of at most `max_records` offsets; empty ranges are dropped.

    One Spark task per piece is what lets a single hot partition be read by many executors.
    """
    if max_records <= 0:
        raise ValueError(f"max_records must be positive, got {max_records}")
    out = []
    for rng in ranges:
        for start in range(rng.start, rng.end, max_records):
            out.append(
                OffsetRange(rng.topic, rng.partition, start, min(start + max_records, rng.end))
            )
    return out


# --------------------------------------------------------------------------------------------
# Reading a range
# --------------------------------------------------------------------------------------------


def iter_range(
    config: KafkaConfig,
    rng: OffsetRange,
    *,
    max_records: int = 50_000,
    fail_on_data_loss: bool = True,
) -> Iterator[list[ConsumerRecord[bytes, bytes]]]:
    """Yield the records of `rng` in offset order, in lists of at most `max_records`.

    A synchronous generator driving aiokafka on a private loop, so Spark can stream batches
    out of `read()` without holding a whole partition in memory. It stops exactly at
    `rng.end`: records prefetched past it are dropped. Offsets with no record (compaction,
    transaction markers) are skipped by following the consumer's fetch position.
    """
    if rng.size == 0:
        return
    tp = TopicPartition(rng.topic, rng.partition)
    loop = asyncio.new_event_loop()

    async def make() -> AIOKafkaConsumer:
        # aiokafka binds to the running loop in its constructor and in assign(), so both
        # happen inside the loop.
        consumer = AIOKafkaConsumer(
            **config.consumer_kwargs(),
            auto_offset_reset="none" if fail_on_data_loss else "earliest",
        )
        try:
            await consumer.start()
        except BaseException:
            await consumer.stop()
            raise
        consumer.assign([tp])
        consumer.seek(tp, rng.start)
        return consumer

    consumer: AIOKafkaConsumer | None = None
    try:
        consumer = loop.run_until_complete(make())
        position = rng.start
        stalled_since = time.monotonic()
        while position < rng.end:
            batch = loop.run_until_complete(
                consumer.getmany(tp, timeout_ms=500, max_records=max_records)
            )
            records = batch.get(tp, [])
            if records:
                if records[-1].offset >= rng.end:
                    cut = bisect.bisect_left(records, rng.end, key=lambda r: r.offset)
                    records = records[:cut]
                    position = rng.end
                else:
                    position = records[-1].offset + 1
                if records:
                    yield records
                stalled_since = time.monotonic()
                continue
            fetch_position = loop.run_until_complete(consumer.position(tp))
            if fetch_position > position:
                position = fetch_position
                stalled_since = time.monotonic()
            elif time.monotonic() - stalled_since > config.poll_timeout_ms / 1000:
                raise TimeoutError(
                    f"{rng.topic}/{rng.partition}: no records at offset {position} for "
                    f"{config.poll_timeout_ms} ms while reading up to {rng.end} "
                    "(records deleted, or the broker is unreachable)"
                )
    finally:
        if consumer is not None:
            loop.run_until_complete(consumer.stop())
        loop.close()


# --------------------------------------------------------------------------------------------
# Committing progress to a consumer group
# --------------------------------------------------------------------------------------------


def commit_offsets(
    config: KafkaConfig, group_id: str, offsets: Mapping[tuple[str, int], int]
) -> None:
    """Commit `offsets` (next offset to read) to `group_id` without joining the group.

    Lets a streaming query's progress show up as consumer lag in the usual Kafka tools; the
    query itself resumes from its checkpoint, never from these commits.
    """
    if not offsets:
        return
    tps = {TopicPartition(t, p): o for (t, p), o in offsets.items()}

    async def work(consumer: AIOKafkaConsumer) -> None:
        consumer.assign(list(tps))
        await consumer.commit(tps)

    _run_with_consumer(config, work, group_id=group_id)
