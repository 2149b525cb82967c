"""Memory at a backlog: can a week's backlog after an outage be drained without an OOM kill?

A backlog of 1,000,000 payments (``--memory-records N`` for another size) is produced once;
each round the worker, as users run it (``service run``, the payments handler, default
settings; ``bench.service_process``), drains it from cold with a fresh consumer group and
key prefix. The worker process's RSS is sampled every 0.25 s with psutil from its start to
its last grant, beside the grants so far (the ledger's length), so the table shows the peak,
the RSS at each tenth of the drain, and how fast RSS still grew over its second half (MB per
million records, a least-squares slope): flat, if memory does not grow with the backlog.

Redis is flushed (FLUSHALL) at the start and the end of each round: a drain leaves a million
ledger entries and done-markers in the shared Redis, which would weigh on every later row.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from bench.report import Progress, Row, Target
from bench.rss import MB, Point, growth_mb_per_million
from bench.service_process import ServiceRun, ledger_key
from bench.stack import BenchStack, produce

if TYPE_CHECKING:
    from bench.__main__ import Options

PARTITIONS = 6
FULL_RECORDS = 1_000_000
QUICK_RECORDS = 50_000
SAMPLE_EVERY_S = 0.25
STALL_S = 120.0  # the longest the drain may go without a new grant before the round fails
DECILES = tuple(range(10, 101, 10))  # percent of the backlog granted
QUARTERS = (25, 50, 75, 100)  # the peak so far is shown at each
# RSS growth over the drain's second half that still counts as flat, MB per million records
# (collections and the allocator move RSS by ~10-15 MB either way; the defect grew ~200).
FLAT_MB_PER_M = 20.0
# The slope is held to that only from this backlog on: a shorter second half spans a few of
# the backstop collection's periods (32 MB of growth), and its slope measures their
# sawtooth, not a growth.
FLAT_FROM_RECORDS = 500_000


@dataclass(frozen=True)
class Sample:
    at: float  # monotonic, s
    rss: int  # bytes
    granted: int
    cpu_s: float


def drain(service: ServiceRun, records: int) -> list[Sample]:
    """Sample the worker from its start until the ledger holds ``records`` grants."""
    client = redis.Redis.from_url(service.redis_url)
    ledger = ledger_key(service.prefix)
    samples: list[Sample] = []
    last_progress = time.monotonic()
    try:
        while True:
            service.check_alive()
            granted = int(client.xlen(ledger))
            now = time.monotonic()
            samples.append(Sample(now, service.rss_bytes(), granted, service.cpu_seconds()))
            if granted >= records:
                return samples
            if len(samples) > 1 and granted > samples[-2].granted:
                last_progress = now
            elif now - last_progress > STALL_S:
                raise TimeoutError(f"no grant for {STALL_S:.0f} s at {granted:,}/{records:,}")
            time.sleep(SAMPLE_EVERY_S)
    finally:
        client.close()


TRIGGERS = ("memory", "ceiling", "threshold")


def full_collections(port: int) -> dict[str, float]:
    """How many full collections the worker ran, by trigger, and their mean duration, from
    its /metrics (worker_gc_full_collection_seconds); zero for an engine without it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return collections_in(response.read().decode())


def collections_in(text: str) -> dict[str, float]:
    """full_collections' figures from the text of a /metrics page."""
    counts = dict.fromkeys(TRIGGERS, 0.0)
    total = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("worker_gc_full_collection_seconds_count"):
            for trigger in TRIGGERS:
                if f'trigger="{trigger}"' in name:
                    counts[trigger] += float(value)
        elif name.startswith("worker_gc_full_collection_seconds_sum"):
            total += float(value)
    count = sum(counts.values())
    return {
        "full_gcs": count,
        **{f"full_gcs_{trigger}": n for trigger, n in counts.items()},
        "full_gc_ms": total / count * 1000 if count else 0.0,
    }


def growth(samples: list[Sample]) -> float:
    """RSS growth over the second half of the drain, MB per million records (bench/rss.py):
    the first half holds the start-up and the climb to the in-flight limits, which a flat
    worker reaches once."""
    return growth_mb_per_million([Point(s.granted, s.rss) for s in samples])


def figures(samples: list[Sample], records: int) -> dict[str, float]:
    """Peak RSS, the peak so far at each quarter of the drain, RSS at each tenth, its growth
    over the second half, and rate and CPU per record after the first grant (the start-up,
    group join and first fetch are not the drain)."""
    first = next(s for s in samples if s.granted > 0)
    last = samples[-1]
    out = {"peak_rss": max(s.rss for s in samples) / MB}
    for pct in DECILES:
        at = next(s for s in samples if s.granted * 100 >= pct * records)
        out[f"rss_{pct}pct"] = at.rss / MB
    for pct in QUARTERS:
        upto = next(i for i, s in enumerate(samples) if s.granted * 100 >= pct * records)
        out[f"peak_to_{pct}pct"] = max(s.rss for s in samples[: upto + 1]) / MB
    out["growth"] = growth(samples)
    counted = last.granted - first.granted
    out["rate"] = counted / max(last.at - first.at, 1e-9)
    out["cpu_us"] = (last.cpu_s - first.cpu_s) / max(counted, 1) * 1e6
    return out


@dataclass(frozen=True)
class Variant:
    """One way of running ``service run``: WORKER_* or BENCH_* variables, and what
    ``python -m`` runs (bench/worker_variant.py undoes a mechanism the BENCH_* ones name)."""

    env: dict[str, str]
    module: str = "reliable_consumer"


BEFORE = "bench.worker_variant"
# The rows: the defaults; a smaller growth bound; the backstop as it was, a full collection
# every 5 s; the defaults without the backstop collection (does memory stay flat by reference
# counting alone?); the same two with aiokafka's fetch cycle back (the worker before
# engine/kafka/fetched_records.py: does the memory trigger bound garbage that holds memory?);
# and without the collector tuning at all (what the tuning saves in CPU).
VARIANTS: dict[str, Variant] = {
    "defaults": Variant({}),
    "WORKER_GC_COLLECT_GROWTH_MB=8": Variant({"WORKER_GC_COLLECT_GROWTH_MB": "8"}),
    "before: every 5 s": Variant({"BENCH_GC_EVERY_5S": "1"}, BEFORE),
    "no backstop": Variant({"BENCH_NO_PERIODIC_GC": "1"}, BEFORE),
    "before: fetch cycle": Variant({"BENCH_FETCH_CYCLE": "1"}, BEFORE),
    "before: fetch cycle at 8 MB": Variant(
        {"BENCH_FETCH_CYCLE": "1", "WORKER_GC_COLLECT_GROWTH_MB": "8"}, BEFORE
    ),
    "before: fetch cycle + no backstop": Variant(
        {"BENCH_FETCH_CYCLE": "1", "BENCH_NO_PERIODIC_GC": "1"}, BEFORE
    ),
    "WORKER_TUNE_GC=false": Variant({"WORKER_TUNE_GC": "false"}),
}


class MemoryGroup:
    """Rows: the worker's RSS and rate through a drain of the whole backlog, per variant."""

    def __init__(self, options: Options) -> None:
        default = QUICK_RECORDS if options.quick else FULL_RECORDS
        self.records = options.memory_records or default
        chosen = options.memory_variants or tuple(VARIANTS)
        if unknown := [v for v in chosen if v not in VARIANTS]:
            raise ValueError(f"unknown memory variants {unknown}; choose from {list(VARIANTS)}")
        self.topic = ""
        self.rows_by_variant = {
            variant: Row(
                f"memory, {self.records:,}-record backlog, {variant}",
                "MB",
                targets=[
                    Target("peak_rss", 200.0),
                    *(
                        [Target("growth", FLAT_MB_PER_M)]
                        if self.records >= FLAT_FROM_RECORDS
                        else []
                    ),
                ],
                units={
                    "rate": "records/s",
                    "growth": "MB/M rec",
                    "full_gcs": "collections",
                    **{f"full_gcs_{t}": "collections" for t in TRIGGERS},
                    "full_gc_ms": "ms",
                },
            )
            for variant in chosen
        }

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        self.topic = f"backlog-{int(time.time())}"
        stack.create_topics({self.topic: PARTITIONS})
        progress(f"memory: producing {self.records:,} payments to {self.topic}")
        asyncio.run(produce(stack.bootstrap, self.topic, self.records, prefix=self.topic))

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        for i, (variant, how) in enumerate(VARIANTS.items()):
            if variant not in self.rows_by_variant:
                continue
            name = f"{self.topic}-m{n}-{i}"
            stack.flush_redis()
            try:
                with ServiceRun(
                    stack.bootstrap,
                    stack.redis_url,
                    self.topic,
                    group=name,
                    prefix=name,
                    env=how.env,
                    module=how.module,
                ) as service:
                    samples = drain(service, self.records)
                    collections = full_collections(service.port)
            finally:
                stack.flush_redis()
            values = figures(samples, self.records) | collections
            self.rows_by_variant[variant].add(**values)
            progress(
                f"memory, {variant}: peak RSS {values['peak_rss']:.0f} MB; peak so far at each "
                + "quarter "
                + " / ".join(f"{values[f'peak_to_{pct}pct']:.0f}" for pct in QUARTERS)
                + " MB; at each tenth "
                + ", ".join(f"{pct}% {values[f'rss_{pct}pct']:.0f}" for pct in DECILES)
                + f" MB; second half {values['growth']:+.1f} MB per million records; "
                + f"{values['rate']:,.0f} records/s, {values['cpu_us']:.1f} µs/rec; "
                + f"{values['full_gcs']:.0f} full collections ("
                + ", ".join(f"{t} {values[f'full_gcs_{t}']:.0f}" for t in TRIGGERS)
                + f"), {values['full_gc_ms']:.0f} ms each on average"
            )

    def rows(self) -> list[Row]:
        return list(self.rows_by_variant.values())

    def summary(self) -> list[str]:
        return [
            "memory: RSS of the `service run` process (psutil, every 0.25 s) from its start to "
            "its last grant; rss_Npct = at the first sample with N % of the backlog granted; "
            "growth = slope of RSS over grants in the drain's second half (least squares, MB "
            "per million records; flat: under 20, checked from a 500,000-record backlog); "
            "rate (records/s) and cpu_us (µs/rec) from its first grant to its last. Redis is "
            "flushed before and after each drain; peak_to_Npct = the peak so far at N %. "
            "defaults: a full collection at least every 5 s, sooner when RSS grew 32 MB since "
            "the last; 'before: every 5 s': every 5 s by the clock alone; 'no backstop': "
            "the collector tuning without either (freed by reference counting alone?); "
            "'before: fetch cycle': aiokafka's own PartitionRecords, whose dropped fetches "
            "only a full collection frees (bench/worker_variant.py). WORKER_TUNE_GC=false "
            "turns off the collector tuning (freeze + a young generation of 50,000 objects "
            "+ the backstop collection). full_gcs, full_gc_ms: the worker's full collections "
            "over the run (full_gcs_T: by trigger T) and their mean duration (its /metrics at "
            "the end; the 5 s variant's count as 'ceiling').",
        ]
