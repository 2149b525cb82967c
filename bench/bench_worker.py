"""Throughput: the worker as users run it, against a raw aiokafka loop and a peer, on one topic.

The ``throughput`` group of ``python -m bench`` (docs/performance.md). One backlog of
payment notifications is produced once (200,000 by default, 6 partitions) and every row
drains it, or a slice of it, from the start with a fresh consumer group, each round:

  1. a raw aiokafka loop: getmany + json.loads + a commit per batch, on asyncio's loop and
     on uvloop; the faster median is "raw", the ceiling here;
  2. **the payments handler with default settings, run as users run it**: ``service run``
     in its own process (``bench.service_process``), only the servers, topic, group, key
     prefix and HTTP port set. Its rate runs from the first grant to the last (the ledger's
     length), its CPU per record is read with psutil over the same span, and so are
     Redis's and the broker's. Targets: >= 0.25 x raw (the aim is 0.35) and >= 25 x
     FastStream's manual-ack subscriber;
  2t. the worker in this process with a trivial ``effects_only`` handler and the settings of
     earlier figures (polls of 5,000, 10,000 records in flight, no HTTP server, WARNING
     logs): what the engine costs without a handler's own work;
  2o. row 2t with OpenTelemetry record spans on (observation/tracing.py): the SDK's provider
     and batch span processor, an exporter that drops what it is given (no collector here;
     a real exporter's encoding and sending come on top, in its own thread). Row 2t itself
     runs with the ``otel`` extra installed and no provider configured: tracing off;
  3. the worker with a handler that awaits 10 ms, against concurrency limit / 10 ms
     (WORKER_MAX_CONCURRENT_HANDLERS: 200 at once, so 20,000 records/s);
  P1, P2. FastStream (``bench.peers``, the ``bench`` extra) with the same trivial handler:
     its default subscriber, and its manual-ack subscriber, on the first records of the
     topic (it runs at 1-2k records/s). Left out, with a note, when the extra is missing.

Rows are measured in interleaved rounds and report medians and ranges (bench/report.py);
the ratios (``x_raw``, ``x_faststream_ack``) are taken round by round against the same
round's raw loop or peer, then their median. ``python -m bench.bench_worker`` is an alias of
``python -m bench --rows throughput``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import redis
from aiokafka import AIOKafkaConsumer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.engine import runtime
from reliable_consumer.engine.batch import processing
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker

from bench.load import CpuMeter, server_processes
from bench.report import Measured, Progress, Row, Target
from bench.service_process import ServiceRun, ledger_key
from bench.stack import BenchStack, produce
from service import Context, handler

if TYPE_CHECKING:
    from bench.__main__ import Options

__all__ = ["Measured", "Payment", "ThroughputGroup", "finished", "trivial"]

TOPIC = "throughput"
PARTITIONS = 6
RECORDS, QUICK_RECORDS = 200_000, 20_000
# Row 3 and the peers run on the first records of the topic: they are slower.
SLEEPY_RECORDS, QUICK_SLEEPY_RECORDS = 40_000, 5_000
PEER_RECORDS, QUICK_PEER_RECORDS = 20_000, 2_000
CONCURRENCY = 200  # row 3: WORKER_MAX_CONCURRENT_HANDLERS, the default
STALL_S = 120.0  # the longest a service run may go without a new grant before the round fails
MB = 1024 * 1024


class Payment(BaseModel):
    payment_id: str
    user_id: str
    amount_minor: int
    currency: str


@handler("trivial", model=Payment, dedupe_key="payment_id", effects_only=True)
def trivial(payment: Payment, ctx: Context) -> None:
    return None


@handler("sleepy", model=Payment, dedupe_key="payment_id")
async def sleepy(payment: Payment, ctx: Context) -> None:
    await asyncio.sleep(0.010)


# --- row 1: the raw loop -------------------------------------------------------------------


async def raw_loop(bootstrap: str, topic: str, n: int, group: str) -> Measured:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=5000,
    )
    await consumer.start()
    try:
        seen = 0
        started = None
        cpu_started = 0.0
        while seen < n:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            if batch and started is None:
                started, cpu_started = time.perf_counter(), time.process_time()
            for records in batch.values():
                for r in records:
                    json.loads(r.value)
                seen += len(records)
            if batch:
                await consumer.commit()
        assert started is not None
        return Measured.since(started, cpu_started, n)
    finally:
        await consumer.stop()


# --- row 2: service run, payments, defaults ------------------------------------------------


def service_run(
    stack: BenchStack,
    topic: str,
    n: int,
    name: str,
    processes: int = 1,
    env: dict[str, str] | None = None,
) -> dict[str, float]:
    """``service run`` drains the topic; its rate and the CPU per record of each process.

    Counted from the first grant to the ``n``-th, so start-up is not in the figures. With
    ``processes`` > 1 it is ``service run --processes N``: the CPU is the supervisor's and
    its workers' together. ``env``: more environment (another revision's engine).
    """
    client = redis.Redis.from_url(stack.redis_url)
    empty_redis(client)
    memory = client.info("memory")
    args = ("--processes", str(processes)) if processes > 1 else ()
    run = ServiceRun(
        stack.bootstrap,
        stack.redis_url,
        topic,
        group=name,
        prefix=name,
        args=args,
        env={**stack.worker_env, **(env or {})},
    )
    ledger = ledger_key(name)
    try:
        with run:
            assert run.process is not None
            first = _wait_for_grants(run, client, ledger, 1)
            workers = run.workers()
            meter = CpuMeter({**workers, **server_processes(stack)})
            meter.start()
            started = time.perf_counter()
            _wait_for_grants(run, client, ledger, n)
            meter.stop()
            wall = time.perf_counter() - started
            rss = run.rss_bytes()
        _check_waited(stack, client, name)
    finally:
        client.close()
    rate = (n - first) / wall
    cores = meter.cores()
    per_record = {
        f"{process}_us": cores[f"{process}_cores"] / rate * 1e6
        for process in ("broker", "redis")
        if f"{process}_cores" in cores
    }
    worker_cores = sum(cores[f"{process}_cores"] for process in workers)
    return {
        "rate": rate,
        "cpu_us": worker_cores / rate * 1e6,
        **per_record,
        "rss_mb": rss / MB,
        "redis_mb": float(memory["used_memory"]) / MB,
    }


def _check_waited(stack: BenchStack, client: redis.Redis, name: str) -> None:
    """With a durability wait asked for, its fence was written (each wait increments it): a
    figure labelled with the wait must not have been measured without it."""
    if stack.durability == "local":
        return
    fence = f"{stack.key_prefix(name)}:durability:fence"
    if not int(client.get(fence) or 0):
        raise RuntimeError(
            f"WORKER_REDIS__DURABILITY={stack.durability} but the run never waited ({fence} "
            "unwritten)"
        )


def empty_redis(client: redis.Redis, timeout_s: float = 120.0) -> None:
    """FLUSHALL, and an AOF rewrite finished before the run, not during it.

    Every round's rows leave their done-markers, ledger entries and entitlements behind
    (200,000 of each per row and round), and Redis grew from round to round: its CPU per
    record rose a few percent, and AOF rewrites (a forked child copying the whole data set,
    once per doubling of the AOF) of ever more data landed inside later rounds' measurements
    on the same 2 cores. So every round's row 2 starts from the same, empty, Redis. The
    flush frees in Redis's background thread: freeing what the latency rows left took longer
    than the client's read timeout on a busy machine.
    """
    deadline = time.monotonic() + timeout_s
    _aof_rewrite_ended(client, deadline)  # one Redis started itself (the AOF grew) refuses ours
    client.flushall(asynchronous=True)
    client.bgrewriteaof()
    _aof_rewrite_ended(client, deadline)


def _aof_rewrite_ended(client: redis.Redis, deadline: float) -> None:
    while time.monotonic() < deadline:
        persistence = client.info("persistence")
        if not (persistence["aof_rewrite_in_progress"] or persistence["aof_rewrite_scheduled"]):
            return
        time.sleep(0.1)
    raise TimeoutError("Redis's AOF rewrite did not end in time")


def _wait_for_grants(run: ServiceRun, client: redis.Redis, ledger: str, n: int) -> int:
    """Until the ledger holds ``n`` entries; returns how many it holds then."""
    last, last_change = -1, time.monotonic()
    while True:
        run.check_alive()
        granted = int(client.xlen(ledger))
        if granted >= n:
            return granted
        if granted != last:
            last, last_change = granted, time.monotonic()
        elif time.monotonic() - last_change > STALL_S:
            raise TimeoutError(f"service run granted {granted} of {n} and none for {STALL_S} s")
        time.sleep(0.02)


# --- rows 2t and 3: the worker in this process ---------------------------------------------


def in_process_settings(stack: BenchStack, topic: str, name: str, group: str) -> Settings:
    """Row 2t's and row 3's settings: one group and one key prefix per run (earlier figures'
    row 2: polls of 5,000, 10,000 records in flight, no HTTP server, WARNING logs)."""
    return Settings(
        kafka={"bootstrap_servers": stack.bootstrap, "group_id": group, "max_poll_records": 5000},
        redis={"url": stack.redis_url, "key_prefix": group},
        topics={name: topic},
        http={"enabled": False},
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        max_concurrent_handlers=CONCURRENCY,
        log_format="console",
        log_level="WARNING",
    )


def finished(metrics: Metrics, name: str) -> float:
    """Records the handler has finished, read from the one metric (not the whole registry)."""
    return sum(
        sample.value
        for family in metrics.records.collect()
        for sample in family.samples
        if sample.name == "worker_records_total" and sample.labels["handler"] == name
    )


async def worker_run(settings: Settings, n: int) -> Measured:
    """The worker in this process until its handler finished ``n`` records."""
    name, topic = next(iter(settings.topics.items()))
    await create_topics(
        settings.kafka.bootstrap_servers,
        {settings.outcomes_topic() or "": 6, settings.dead_letter_topic(topic): 1},
    )
    metrics = Metrics()
    worker = Worker(settings, Registry([trivial, sleepy], settings.topics), metrics=metrics)
    task = asyncio.create_task(worker.run())
    started: float | None = None
    cpu_started = before = 0.0  # records finished before the clocks started: not counted
    try:
        while (done := finished(metrics, name)) < n:
            if task.done():
                task.result()
            if started is None and done > 0:
                started, cpu_started, before = time.perf_counter(), time.process_time(), done
            await asyncio.sleep(0.05)
        assert started is not None
        return Measured.since(started, cpu_started, int(n - before))
    finally:
        worker.request_stop()
        await task


@contextlib.contextmanager
def tracing_on() -> Iterator[None]:
    """Record spans on for the workers built in the block (row 2o), counted in ``SPANS``."""
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from reliable_consumer.engine.observation.tracing import RecordTracer

    class Dropping(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            SPANS[0] += len(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping()))
    original = processing.record_tracer
    processing.record_tracer = lambda group, _=None: RecordTracer(provider, group)
    try:
        yield
    finally:
        processing.record_tracer = original
        provider.shutdown()


SPANS = [0]  # spans the row 2o exporter was given, all rounds


# --- the group -----------------------------------------------------------------------------

PeerRun = Callable[..., Coroutine[Any, Any, Measured]]


def load_peer() -> PeerRun | None:
    """``bench.peers.faststream_run``, or None when the ``bench`` extra is not installed."""
    try:
        from bench.peers import faststream_run
    except ImportError:
        return None
    return faststream_run


class ThroughputGroup:
    """Rows 1, 2, 2t, 3 and the FastStream peers over one backlog, measured every round."""

    def __init__(self, options: Options) -> None:
        self.quick = options.quick
        self.records = QUICK_RECORDS if options.quick else RECORDS
        self.sleepy_records = QUICK_SLEEPY_RECORDS if options.quick else SLEEPY_RECORDS
        self.peer_records = QUICK_PEER_RECORDS if options.quick else PEER_RECORDS
        choices: tuple[runtime.LoopChoice, ...] = ("asyncio", "auto")
        # uvloop when installed; the ceiling is whichever loop is faster for aiokafka.
        self.loops = {"uvloop" if runtime.loop_factory(c) else "asyncio": c for c in choices}
        self.raw = {name: Row(f"1. raw aiokafka loop, {name}", "rec/s") for name in self.loops}
        self.payments = Row(
            "2. payments handler, defaults (service run)",
            "rec/s",
            units={
                "redis_us": "µs/rec",
                "broker_us": "µs/rec",
                "rss_mb": "MB",
                "redis_mb": "MB",
                "x_raw": "x raw",
                "x_faststream_ack": "x peer",
            },
        )
        # Row 2 on the baseline revision's engine (--baseline), in the same rounds.
        self.baseline = options.baseline
        self.payments_before: Row | None = None
        if self.baseline is not None:
            self.payments_before = Row(
                f"2. payments handler, defaults, {self.baseline.label}",
                "rec/s",
                units={**self.payments.units, "x_baseline": "x before"},
            )
        self.only_payments = options.throughput_rows == "payments"
        self.swarm = Row(
            "2p. payments handler, 2 worker processes (service run --processes 2)",
            "rec/s",
            units={"x_one": "x 1 process", "rss_mb": "MB"},
        )
        self.trivial = Row("2t. trivial handler, in-process (polls of 5,000)", "rec/s")
        self.traced = Row(
            "2o. row 2t, OpenTelemetry record spans on", "rec/s", units={"x_off": "x 2t"}
        )
        self.sleepy = Row("3. 10 ms async handler, 200 at once", "rec/s")
        self.peer = load_peer()
        self.peers = {
            False: Row("P1. FastStream, default subscriber", "rec/s"),
            True: Row("P2. FastStream, manual ack() per record", "rec/s"),
        }

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        stack.create_topics({TOPIC: PARTITIONS})
        progress(f"throughput: producing {self.records:,} records to {PARTITIONS} partitions")
        asyncio.run(produce(stack.bootstrap, TOPIC, self.records, prefix=TOPIC))
        if self.peer is None:
            progress("throughput: FastStream not installed (pip install -e '.[bench]'): no peer")

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        bootstrap = stack.bootstrap
        raw_round: dict[str, float] = {}
        for name, choice in self.loops.items():
            group = f"tp-raw-{name}-{n}"
            measured = runtime.run(raw_loop(bootstrap, TOPIC, self.records, group), choice)
            self.raw[name].add_run(measured)
            raw_round[name] = measured.rate
        runs = [("", self.payments, None)]
        if self.baseline is not None and self.payments_before is not None:
            # Which goes first alternates by round: neither always gets the quieter minute.
            before = (f" {self.baseline.label}", self.payments_before, self.baseline.env())
            runs.insert(n % 2, before)
        rates: dict[str, float] = {}
        for label, row, env in runs:
            tag = "-base" if env else ""
            measured = service_run(stack, TOPIC, self.records, f"tp-payments-{n}{tag}", env=env)
            row.add(**measured)
            row.add(x_raw=measured["rate"] / raw_round[self._raw_name()])
            rates[label] = measured["rate"]
            progress(
                f"throughput: payments{label} {measured['rate']:,.0f}/s, worker "
                f"{measured['cpu_us']:.1f} µs/rec, redis {measured.get('redis_us', 0):.1f} µs/rec"
            )
            if row is self.payments:
                figures = measured
        if self.payments_before is not None:
            self.payments_before.add(x_baseline=rates[""] / min(v for k, v in rates.items() if k))
        if self.only_payments:
            return
        pod = service_run(stack, TOPIC, self.records, f"tp-payments-2p-{n}", processes=2)
        self.swarm.add(
            rate=pod["rate"], cpu_us=pod["cpu_us"], rss_mb=pod["rss_mb"],
            x_one=pod["rate"] / figures["rate"],
        )  # fmt: skip
        progress(f"throughput: payments, 2 processes {pod['rate']:,.0f}/s")
        settings = in_process_settings(stack, TOPIC, "trivial", f"tp-trivial-{n}")
        off = runtime.run(worker_run(settings, self.records))
        self.trivial.add_run(off)
        settings = in_process_settings(stack, TOPIC, "trivial", f"tp-traced-{n}")
        with tracing_on():
            on = runtime.run(worker_run(settings, self.records))
        self.traced.add_run(on)
        self.traced.add(x_off=on.rate / off.rate)
        progress(f"throughput: trivial {off.rate:,.0f}/s off, {on.rate:,.0f}/s with spans on")
        settings = in_process_settings(stack, TOPIC, "sleepy", f"tp-sleepy-{n}")
        self.sleepy.add_run(runtime.run(worker_run(settings, self.sleepy_records)))
        if self.peer is not None:
            for manual_ack, row in self.peers.items():
                group = f"tp-faststream-{'ack' if manual_ack else 'default'}-{n}"
                run = self.peer(bootstrap, TOPIC, self.peer_records, group, manual_ack=manual_ack)
                row.add_run(asyncio.run(run))
        # The ratio of this round against this round's peer (x_raw: above).
        if self.peers[True].figures.get("rate"):
            self.payments.add(
                x_faststream_ack=figures["rate"] / self.peers[True].figures["rate"][-1]
            )

    def _raw_name(self) -> str:
        """The raw loop whose median is faster so far: the ceiling."""
        return max(self.raw, key=lambda name: self.raw[name].median("rate"))

    def rows(self) -> list[Row]:
        if not self.payments.figures:
            return []
        raw = self.raw[self._raw_name()].median("rate")
        self.payments.targets = [Target("x_raw", 0.25, at_least=True, text=">= 0.25 (aim 0.35)")]
        if self.payments.figures.get("x_faststream_ack"):
            self.payments.targets.append(Target("x_faststream_ack", 25, at_least=True))
        self.payments.bound_by = (
            "the worker's one Python thread when its CPU x rate nears 1 core; Redis's FINISH "
            "script (redis_us) is the next limit, and both share the machine's 2 cores"
        )
        self.payments.notes = [
            f"x_raw: this round's rate over this round's {self._raw_name()} raw loop "
            f"(median raw {raw:,.0f} rec/s)",
            "figures from the first grant to the last; broker_us, redis_us: those processes' "
            "CPU over the same span, per record",
        ]
        self.trivial.bound_by = "the worker's one thread (this process): CPU x rate near 1 core"
        self.traced.bound_by = self.trivial.bound_by + ", plus a span per record"
        self.traced.notes = [
            "x_off: this round's rate over this round's row 2t (tracing off)",
            f"{SPANS[0]:,} spans given to an exporter that drops them (a real one encodes "
            "and sends them in its own thread, on top)",
        ]
        ideal = CONCURRENCY / 0.010
        self.sleepy.targets = [
            Target("rate", 0.8 * ideal, at_least=True, text=f">= 0.8 x {ideal:,.0f}")
        ]
        self.sleepy.notes = [f"on the first {self.sleepy_records:,} records of the topic"]
        self.sleepy.bound_by = (
            "the worker's thread: ~45-50 µs per record for pool, coroutine, timer"
        )
        self.swarm.bound_by = (
            "the machine's cores: each worker is one thread, and Redis and the broker share "
            "the same 2 cores (x_one: this round's rate over the one-process row's)"
        )
        if self.payments_before is not None:
            self.payments_before.notes = [
                "x_baseline (on this row): this round's rate of the row above (this checkout) "
                "over this round's rate of this row (the baseline revision's engine)"
            ]
            self.payments_before.bound_by = "(row 2, on the baseline revision's engine)"
        if self.only_payments:
            before = [] if self.payments_before is None else [self.payments_before]
            return [*self.raw.values(), self.payments, *before]
        rows = [
            *self.raw.values(),
            self.payments,
            *([] if self.payments_before is None else [self.payments_before]),
            self.swarm,
            self.trivial,
            self.traced,
            self.sleepy,
        ]
        if self.peer is None:
            self.payments.notes.append(
                "no FastStream rows: the bench extra is not installed (pip install -e '.[bench]')"
            )
        else:
            for row in self.peers.values():
                row.notes = [f"on the first {self.peer_records:,} records (FastStream: 1-2k rec/s)"]
                row.bound_by = (
                    "FastStream's per-message work in this process (P2: a commit per record)"
                )
            rows += self.peers.values()
        for row in self.raw.values():
            row.bound_by = "this process's one thread: aiokafka's fetch and record objects"
        return rows

    def summary(self) -> list[str]:
        if not self.payments.figures:
            return []
        raw_name = self._raw_name()
        raw = self.raw[raw_name].median("rate")
        payments = self.payments.median("rate")
        lines = [
            f"throughput: raw = the {raw_name} loop's median, {raw:,.0f} rec/s; payments with "
            f"defaults {payments:,.0f} rec/s = {payments / raw:.2f} x raw (ratio of medians)",
            "throughput: CPU µs/rec is the CPU time per record of the process running the row; "
            "rate x CPU near 1,000,000 µs/s means that process's one thread was the limit",
        ]
        if self.peers[True].figures.get("rate"):
            ack = self.peers[True].median("rate")
            lines.append(
                f"throughput: payments with defaults = {payments / ack:.1f} x FastStream's "
                f"manual-ack subscriber ({ack:,.0f} rec/s) and "
                f"{payments / self.peers[False].median('rate'):.1f} x its default subscriber"
            )
        return lines


def main(argv: list[str]) -> int:
    """``python -m bench.bench_worker [options]``: ``python -m bench --rows throughput``."""
    from bench.__main__ import main as bench_main

    return bench_main(["--rows", "throughput", *argv])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
