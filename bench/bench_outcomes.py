"""The audit trail's cost: what outcome events cost per record, in each layout, and without.

Three rows over the same backlog, in interleaved rounds (their order rotating from round to
round), each run a fresh consumer group, key prefix and outcomes topic:

- layout 1: a Kafka record per event, keyed by its dedupe key (as written before issue 19;
  ``WORKER_OUTCOMES__LAYOUT=record``);
- layout 2: a document per finished batch and source partition (the default);
- no outcome events (``WORKER_OUTCOMES__ENABLED=false``), the floor both are measured from.

The worker runs in this process with row 2's settings of ``bench.bench_worker`` (a trivial
``effects_only`` handler, polls of 5,000, 10,000 records in flight, no HTTP server, WARNING
logs), so its CPU time is this process's. The broker's CPU (Tansu's process or the Kafka
JVM) and Redis's are read with psutil over the same window: from the first finished record
to the last. A row's cost of the audit trail is its CPU per record (worker + broker) minus
the row without events, in the same round.

    python -m bench --rows outcomes --broker tansu --rounds 5
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass

import psutil
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.engine import runtime
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka import outcome_events
from reliable_consumer.engine.kafka.outcome_events import Event, Layout
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.records import Delivery, Outcome
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker

from bench.__main__ import Options
from bench.report import Progress, Row, Target
from bench.stack import BenchStack, produce
from service import Context, handler

TOPIC = "audit-bench"
PARTITIONS = 6
FULL_RECORDS = 200_000
QUICK_RECORDS = 20_000
ADOPT_SHARE = 1 / 3  # layout 2 is kept only if it saves this share of layout 1's cost
SAMPLE_EVERY_S = 0.02


class Payment(BaseModel):
    payment_id: str
    user_id: str
    amount_minor: int
    currency: str


@handler("audit_trivial", model=Payment, dedupe_key="payment_id", effects_only=True)
def audit_trivial(payment: Payment, ctx: Context) -> None:
    """Nothing to do: the rows differ only in what the audit trail writes."""
    return None


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    layout: Layout | None  # None: outcome events off


VARIANTS = (
    Variant("record", "audit 1. outcome events, a record per event (layout 1)", "record"),
    Variant("batch", "audit 2. outcome events, a document per batch (layout 2)", "batch"),
    Variant("none", "audit 3. no outcome events", None),
)


@dataclass(frozen=True)
class Run:
    rate: float
    worker_us: float
    broker_us: float
    redis_us: float


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes have spent so far."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _finished(metrics: Metrics) -> float:
    """Records whose fate is durable (outcome events acknowledged), from the one metric."""
    return sum(
        sample.value
        for family in metrics.records.collect()
        for sample in family.samples
        if sample.name == "worker_records_total"
    )


def _settings(stack: BenchStack, variant: Variant, group: str) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": stack.bootstrap, "group_id": group, "max_poll_records": 5000},
        redis={"url": stack.redis_url, "key_prefix": group},
        outcomes={"enabled": variant.layout is not None, "layout": variant.layout or "batch"},
        topics={audit_trivial.name: TOPIC},
        http={"enabled": False},
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        log_format="console",
        log_level="WARNING",
        topic_durability="off",  # one broker: its warning would repeat on every run
    )


async def _measure(stack: BenchStack, variant: Variant, n: int, group: str) -> Run:
    """Drain the backlog with a fresh group; CPU and time from the first record finished."""
    settings = _settings(stack, variant, group)
    topics = {settings.dead_letter_topic(TOPIC): 1}
    if (outcomes := settings.outcomes_topic()) is not None:
        topics[outcomes] = PARTITIONS
    await create_topics(stack.bootstrap, topics)
    metrics = Metrics()
    worker = Worker(settings, Registry([audit_trivial], settings.topics), metrics=metrics)
    task = asyncio.create_task(worker.run())
    broker, redis = stack.broker_pids, [p for p in [stack.redis_pid] if p is not None]
    try:
        before = 0.0
        started: tuple[float, float, float, float] | None = None
        while (done := _finished(metrics)) < n:
            if task.done():
                task.result()
                raise RuntimeError(f"the worker stopped after {done:.0f} of {n} records")
            if started is None and done > 0:
                before = done
                started = (time.perf_counter(), time.process_time(), _cpu_s(broker), _cpu_s(redis))
            await asyncio.sleep(SAMPLE_EVERY_S)
        assert started is not None
        wall, cpu, broker_cpu, redis_cpu = started
        counted = n - before
        return Run(
            rate=counted / (time.perf_counter() - wall),
            worker_us=(time.process_time() - cpu) / counted * 1e6,
            broker_us=(_cpu_s(broker) - broker_cpu) / counted * 1e6,
            redis_us=(_cpu_s(redis) - redis_cpu) / counted * 1e6,
        )
    finally:
        worker.request_stop()
        await task


def encoding_alone(records: int = 500, repeats: int = 200) -> dict[str, tuple[float, float]]:
    """Per layout: CPU µs per record to encode one batch's events, and bytes per record.

    No servers: what the encoding itself costs, apart from writing and the broker. A batch
    of 500, the worker's default ``max_batch_records``.
    """
    deliveries = [
        Delivery(TOPIC, 0, 1_000_000 + i, f"k{i}".encode(), b"{}", (), 1_763_700_000_000 + i)
        for i in range(records)
    ]
    events: list[Event] = [
        (d, Outcome.SUCCEEDED, audit_trivial.name, f"{TOPIC}-{d.offset:08d}", None)
        for d in deliveries
    ]
    out: dict[str, tuple[float, float]] = {}
    layouts: tuple[Layout, ...] = ("record", "batch")
    for layout in layouts:
        times = []
        for _ in range(repeats):
            started = time.process_time()
            encoded = outcome_events.encode(events, 1_763_700_000_123, layout)
            times.append((time.process_time() - started) / records * 1e6)
        size = sum(len(value) + len(key or b"") for key, value in encoded)
        out[layout] = (statistics.median(times), size / records)
    return out


class OutcomesGroup:
    """The audit trail's rows (``--rows outcomes``)."""

    def __init__(self, options: Options) -> None:
        self.records = QUICK_RECORDS if options.quick else FULL_RECORDS
        self._rows = {
            v.key: Row(
                v.label,
                "records/s",
                bound_by="the worker's one Python thread (worker_us x rate near 1e6)",
                units={"worker_us": "µs/rec", "broker_us": "µs/rec", "redis_us": "µs/rec"},
            )
            for v in VARIANTS
        }
        self._cost = Row(
            "audit cost: worker + broker CPU over no events, same round",
            "µs/rec",
            targets=[Target("saved", ADOPT_SHARE, at_least=True, text=">= 1/3 of layout 1's cost")],
            units={"saved": "share"},
        )
        self._encoding: dict[str, tuple[float, float]] = {}
        self._token = uuid.uuid4().hex[:6]

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        stack.create_topics({TOPIC: PARTITIONS})
        progress(f"outcomes: producing {self.records:,} payments to {PARTITIONS} partitions")
        asyncio.run(produce(stack.bootstrap, TOPIC, self.records, prefix=f"audit-{self._token}"))
        self._encoding = encoding_alone()

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        shift = n % len(VARIANTS)
        runs: dict[str, Run] = {}
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            group = f"audit-{self._token}-{variant.key}-{n}"
            run = runtime.run(_measure(stack, variant, self.records, group))
            runs[variant.key] = run
            self._rows[variant.key].add(
                rate=run.rate,
                worker_us=run.worker_us,
                broker_us=run.broker_us,
                redis_us=run.redis_us,
            )
            progress(
                f"  {variant.key}: {run.rate:,.0f}/s, worker {run.worker_us:.1f} µs/rec, "
                f"broker {run.broker_us:.1f}, redis {run.redis_us:.1f}"
            )
        floor = runs["none"].worker_us + runs["none"].broker_us
        old = runs["record"].worker_us + runs["record"].broker_us - floor
        new = runs["batch"].worker_us + runs["batch"].broker_us - floor
        self._cost.add(
            layout1_us=old,
            layout2_us=new,
            layout1_worker_us=runs["record"].worker_us - runs["none"].worker_us,
            layout2_worker_us=runs["batch"].worker_us - runs["none"].worker_us,
            layout1_broker_us=runs["record"].broker_us - runs["none"].broker_us,
            layout2_broker_us=runs["batch"].broker_us - runs["none"].broker_us,
            saved=(old - new) / old if old > 0 else 0.0,
        )

    def rows(self) -> list[Row]:
        return [*self._rows.values(), self._cost]

    def summary(self) -> list[str]:
        lines = [
            "audit rows: the worker in-process (trivial effects_only handler, row 2's settings); "
            "worker_us is this process's CPU per record, broker_us the broker's, redis_us "
            "Redis's, each over the run from the first finished record to the last.",
            "audit cost: each layout's worker + broker CPU per record minus the run without "
            "events in the same round; 'saved' = (layout 1 - layout 2) / layout 1.",
        ]
        for layout, (us, size) in self._encoding.items():
            lines.append(
                f"encoding alone, layout {'1' if layout == 'record' else '2'} ({layout}): "
                f"{us:.2f} µs and {size:.0f} bytes per record (a batch of 500 events, no servers)"
            )
        return lines
