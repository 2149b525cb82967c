"""Bench row 1: how long after a payment notification reaches Kafka its purchase is granted.

The worker runs as users run it (``service run``: default settings, the payments handler,
outcome events on) and is ready before any load. A producer in the bench process offers
payments at a fixed rate for a fixed time, each stamped with its send time as its Kafka
timestamp. A record's latency is the time Redis wrote its ledger entry (the stream id's
milliseconds: the grant itself) minus that timestamp, so it holds the producer, the broker,
the worker's fetch and handler and the FINISH script with its AOF fsync. The first seconds
are a warm-up and are not counted. What comes after the grant (the outcome event, the
offset commit) is not in the figure: the user has the purchase by then.

Beside each worker row, a plain aiokafka consumer built as the worker builds its own
(``kafka.clients.make_consumer``, default settings), in a process of its own, receives the
same load: its latency (timestamp to ``getmany`` returning the record) is what the broker,
the client and the machine give before the worker does anything.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from reliable_consumer.engine.intake import POLL_TIMEOUT_MS
from reliable_consumer.engine.kafka.clients import make_consumer
from reliable_consumer.engine.settings import KafkaSettings

from bench import latency_probe
from bench.load import CpuMeter, Offered, PacedProducer, server_processes
from bench.report import Progress, Row, Target
from bench.service_process import ServiceRun, read_grants
from bench.stack import BenchStack

if TYPE_CHECKING:
    from bench.__main__ import Options

PARTITIONS = 6
RATES = (1_000, 10_000)
P99_TARGET_MS = 50.0
# After the last record is offered, how long the consumer may take to finish the rest.
DRAIN_TIMEOUT_S = 120.0
# How long a consumer may take to join its group and get its partitions.
READY_TIMEOUT_S = 120.0
# Figures in a unit other than the row's milliseconds.
UNITS = {
    "rate": "records/s",
    "cpu_us": "µs/rec",
    "machine_busy": "share",
    **{f"{name}_cores": "cores" for name in ("worker", "consumer", "broker", "redis", "producer")},
}


@dataclass(frozen=True)
class Latencies:
    """One measurement at one offered rate: latency figures (ms), and what ran meanwhile."""

    latencies: dict[str, float]  # p50, p95, p99, max, and any stage split
    rate: float  # the offered rate achieved over the counted records
    # Cores used while offering, by process, and the machine's busy share.
    cores: dict[str, float]
    cpu_us: float | None = None  # the worker's CPU per record, first offered to last granted
    late: int = 0  # records not done by the drain deadline (counted at a lower bound)

    def figures(self) -> dict[str, float]:
        extra = {} if self.cpu_us is None else {"cpu_us": self.cpu_us}
        return {**self.latencies, "rate": self.rate, **extra, **self.cores}


def percentiles(values: list[int], prefix: str = "") -> dict[str, float]:
    """p50, p95, p99 and max of ``values`` (ms), names prefixed (``handler_p99``)."""
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {
        f"{prefix}p50": cuts[49],
        f"{prefix}p95": cuts[94],
        f"{prefix}p99": cuts[98],
        f"{prefix}max": float(max(values)),
    }


def counted(offered: Offered, warmup: int, done_ms: dict[int, int], now_ms: int) -> list[int]:
    """Each counted record's latency in ms; one not done counts as ``now_ms`` - its stamp
    (a lower bound), so a stuck record raises the percentiles rather than vanishing."""
    return [
        done_ms.get(i, now_ms) - offered.stamp_ms(i) for i in range(warmup, len(offered.sent_at))
    ]


def handler_split(
    offered: Offered, warmup: int, written: dict[int, int], called: dict[int, int]
) -> dict[str, float]:
    """Each latency cut at the handler's call: ``handler_*`` from the record's timestamp to
    the call (producer, broker, fetch, intake), ``finish_*`` from the call to the ledger
    entry (the batch's other calls, the FINISH script, its fsync). Empty when the handler
    wrote no clock reading."""
    ids = [i for i in range(warmup, len(offered.sent_at)) if i in called and i in written]
    if len(ids) < 2:
        return {}
    before = percentiles([called[i] - offered.stamp_ms(i) for i in ids], "handler_")
    after = percentiles([written[i] - called[i] for i in ids], "finish_")
    return {
        "handler_p50": before["handler_p50"],
        "handler_p99": before["handler_p99"],
        "finish_p50": after["finish_p50"],
        "finish_p99": after["finish_p99"],
    }


# The stages of a record's latency (bench/latency_probe.py's readings, in path order),
# each from the reading before it: what the record waited for between the two.
STAGE_SPANS = (
    ("fetch", "stamp", "dispatched"),  # producer, broker, the fetch, getmany returning it
    ("queue", "dispatched", "started"),  # its batch waiting to start (earlier batches, loop)
    ("to_handler", "started", "called"),  # decode, prepare, the handler's turn in its batch
    ("mates", "called", "finish_sent"),  # its batch-mates' handler calls after its own
    # FINISH's round trip, its queue in Redis and AOF fsync (``finish_*`` of handler_split
    # is another span: the handler's call to the ledger entry)
    ("finish_call", "finish_sent", "finish_back"),
    ("outcome", "finish_back", "emitted"),  # its batch's outcome documents acknowledged
    ("release", "emitted", "done"),  # counted done: the offset may be committed
)


def stage_split(
    records: list[tuple[int, int | None, int, dict[str, float]]],
) -> dict[str, float]:
    """p50 and p99 (ms) of each stage of ``STAGE_SPANS``, over the records that reached
    both its ends; each record is (timestamp, handler's call, ledger entry, probe
    readings). ``granted``: FINISH sent to the ledger entry (Redis's clock), the part of
    the FINISH round trip before the grant; ``after_grant``: the grant to ``done``."""
    spans: dict[str, list[float]] = {name: [] for name, _, _ in STAGE_SPANS}
    spans["granted"], spans["after_grant"] = [], []
    for stamp, called, written, stages in records:
        at = {**stages, "stamp": float(stamp), "written": float(written)}
        if called is not None:
            at["called"] = float(called)
        for name, start, end in (*STAGE_SPANS, ("granted", "finish_sent", "written"),
                                 ("after_grant", "written", "done")):  # fmt: skip
            if start in at and end in at:
                spans[name].append(at[end] - at[start])
    out: dict[str, float] = {}
    for name, values in spans.items():
        if len(values) >= 2:
            cuts = statistics.quantiles(values, n=100, method="inclusive")
            out[f"{name}_p50"], out[f"{name}_p99"] = cuts[49], cuts[98]
    return out


def log_tail(path: Path, lines: int = 30) -> str:
    """The end of a worker's log, for the error that says why a measurement failed."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_granted(worker: ServiceRun, count: int, timeout_s: float) -> bool:
    """Until the ledger holds ``count`` entries (True), or the timeout passes (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        worker.check_alive()
        if worker.granted() >= count:
            return True
        time.sleep(0.2)
    return worker.granted() >= count


def measure_worker(
    stack: BenchStack,
    rate: int,
    seconds: float,
    warmup_s: float,
    tag: str,
    env: Mapping[str, str] | None = None,
    *,
    stages: bool = False,
) -> Latencies:
    """``service run`` on a fresh topic; offer ``rate``/s for ``warmup_s + seconds``; read
    the ledger. Also splits each latency at the handler's call (the ledger entry's
    ``granted_at``, the handler's clock): before it, broker, fetch and intake; after it,
    the rest of the batch's handler calls and the FINISH script with its fsync. ``env``
    overrides settings (WORKER_*), to find which default a latency comes from, or names
    another revision's engine (bench/baseline.py). ``stages``: run the probed worker
    (bench/latency_probe.py) and split each latency by stage (``stage_split``)."""
    topic, name = f"bench-latency-{tag}", f"lat-{tag}"
    stack.create_topics({topic: PARTITIONS})
    warmup = int(rate * warmup_s)
    count = warmup + int(rate * seconds)
    with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
        log = Path(tmp) / "worker.log"
        probe = Path(tmp) / "stages.json"
        env = {**(env or {}), **({"BENCH_PROBE_FILE": str(probe)} if stages else {})}
        worker = ServiceRun(
            stack.bootstrap,
            stack.redis_url,
            topic,
            group=name,
            prefix=name,
            env=env,
            log_path=log,
            module="bench.latency_probe" if stages else "reliable_consumer",
        )
        with worker:
            try:
                worker.wait_ready(READY_TIMEOUT_S)
                assert worker.process is not None
                meter = CpuMeter(
                    {
                        "worker": worker.process,
                        **server_processes(stack),
                        "producer": psutil.Process(),
                    }
                )
                cpu_started = worker.cpu_seconds()
                producer = PacedProducer(stack.bootstrap, topic, rate)
                offered = asyncio.run(producer.offer(name, count, meter=meter))
                drained = wait_granted(worker, count, DRAIN_TIMEOUT_S)
                cpu = worker.cpu_seconds() - cpu_started
                now_ms = int(time.time() * 1000)
                grants = read_grants(stack.redis_url, name)
            except Exception as exc:
                raise RuntimeError(
                    f"latency: worker at {rate}/s failed; its log:\n{log_tail(log)}"
                ) from exc
        readings = latency_probe.read(str(probe)) if stages and probe.exists() else {}
    written: dict[int, int] = {}
    called: dict[int, int] = {}
    coordinates: dict[int, tuple[int, int]] = {}
    for grant in grants:
        i = offered.index(grant.payment_id)
        if i is not None and i not in written:
            written[i] = grant.written_ms
            coordinates[i] = (grant.partition, grant.offset)
            if grant.granted_at_ms is not None:
                called[i] = grant.granted_at_ms
    figures = percentiles(counted(offered, warmup, written, now_ms))
    figures.update(handler_split(offered, warmup, written, called))
    if readings:
        counted_ids = set(range(warmup, len(offered.sent_at)))
        figures.update(
            stage_split(
                [
                    (offered.stamp_ms(i), called.get(i), written[i], readings.get(at, {}))
                    for i, at in coordinates.items()
                    if i in counted_ids and i in written
                ]
            )
        )
    return Latencies(
        latencies=figures,
        rate=offered.rate(warmup),
        cores=meter.cores(),
        cpu_us=cpu / count * 1e6,
        late=0 if drained else count - len(written),
    )


async def _receive(
    bootstrap: str, topic: str, group: str, count: int, timeout_s: float, ready: Event
) -> dict[int, int]:
    """Record number -> the time ``getmany`` returned it (ms), for up to ``count`` records."""
    consumer = make_consumer(KafkaSettings(bootstrap_servers=bootstrap, group_id=group))
    consumer.subscribe([topic])
    await consumer.start()
    received: dict[int, int] = {}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not consumer.assignment() and time.monotonic() < deadline:
            await consumer.getmany(timeout_ms=100)  # nothing is offered before ready is set
        ready.set()
        deadline = time.monotonic() + timeout_s
        while len(received) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS)
            now_ms = int(time.time() * 1000)
            for records in batches.values():
                for record in records:
                    assert record.key is not None
                    received.setdefault(int(record.key.rsplit(b"-", 1)[1]), now_ms)
    finally:
        await consumer.stop()
    return received


def _raw_consumer(
    bootstrap: str,
    topic: str,
    group: str,
    count: int,
    timeout_s: float,
    ready: Event,
    out: Connection,
) -> None:
    """The raw consumer's process: receive, then send the receipt times back."""
    out.send(asyncio.run(_receive(bootstrap, topic, group, count, timeout_s, ready)))
    out.close()


def measure_raw(
    stack: BenchStack, rate: int, seconds: float, warmup_s: float, tag: str
) -> Latencies:
    """A plain consumer in its own process on a fresh topic, under the same load."""
    topic, name = f"bench-latency-raw-{tag}", f"lat-raw-{tag}"
    stack.create_topics({topic: PARTITIONS})
    warmup = int(rate * warmup_s)
    count = warmup + int(rate * seconds)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    results, sender = context.Pipe(duplex=False)
    timeout_s = warmup_s + seconds + DRAIN_TIMEOUT_S
    consumer = context.Process(
        target=_raw_consumer,
        args=(stack.bootstrap, topic, name, count, timeout_s, ready, sender),
        daemon=True,
    )
    consumer.start()
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.wait(0.2):
            if not consumer.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("latency: the raw consumer exited or got no partitions")
        assert consumer.pid is not None
        meter = CpuMeter(
            {
                "consumer": psutil.Process(consumer.pid),
                **server_processes(stack),
                "producer": psutil.Process(),
            }
        )
        offered = asyncio.run(
            PacedProducer(stack.bootstrap, topic, rate).offer(name, count, meter=meter)
        )
        deadline = time.monotonic() + timeout_s
        while not results.poll(0.2):
            if not consumer.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("latency: the raw consumer exited without its results")
        received: dict[int, int] = results.recv()
        now_ms = int(time.time() * 1000)
    finally:
        consumer.join(10)
        if consumer.is_alive():
            consumer.kill()
            consumer.join()
        results.close()
        sender.close()
    return Latencies(
        latencies=percentiles(counted(offered, warmup, received, now_ms)),
        rate=offered.rate(warmup),
        cores=meter.cores(),
        late=count - len(received),
    )


class LatencyGroup:
    """Row 1 at each offered rate: record timestamp to ledger entry, p50/p95/p99/max, beside
    a plain consumer's timestamp-to-receipt under the same load."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.warmup_s = 1.0 if options.quick else 5.0
        self.seconds = 3.0 if options.quick else 20.0
        self.rates = options.latency_rates or RATES
        self._raw = {
            rate: Row(
                label=f"raw consumer, {rate:,}/s offered",
                unit="ms",
                units=UNITS,
                bound_by=RAW_BOUND_BY,
            )
            for rate in self.rates
        }
        self._worker = {
            rate: Row(
                label=f"end-to-end latency, {rate:,}/s offered",
                unit="ms",
                units=UNITS,
                targets=[Target("p99", P99_TARGET_MS)] if rate == 1_000 else [],
                bound_by=WORKER_BOUND_BY.get(rate, WORKER_BOUND_BY[min(RATES)]),
            )
            for rate in self.rates
        }
        # The same rows on the baseline revision's engine (--baseline), in the same rounds.
        self._baseline: dict[int, Row] = {}
        if options.baseline is not None:
            self._baseline = {
                rate: Row(
                    label=f"end-to-end latency, {rate:,}/s offered, {options.baseline.label}",
                    unit="ms",
                    units=UNITS,
                    bound_by="(the row above, on the baseline revision's engine)",
                )
                for rate in self.rates
            }

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        """Warm the broker up (a JVM compiles its produce and fetch paths in the first
        seconds of load), so the first row measured is not the one that pays for it.
        Nothing else is shared: every measurement makes its own topic, group and prefix."""
        progress(f"latency: warming the broker up, {max(self.rates):,}/s for {self.warmup_s:g} s")
        measure_raw(stack, max(self.rates), self.warmup_s, 0.0, "warm-up")

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        stages = self.options.stages
        baseline = self.options.baseline
        seconds, warmup_s = self.seconds, self.warmup_s

        def raw(rate: int, tag: str) -> Latencies:
            return measure_raw(stack, rate, seconds, warmup_s, tag)

        def worker(rate: int, tag: str) -> Latencies:
            return measure_worker(stack, rate, seconds, warmup_s, tag, stages=stages)

        measures: list[tuple[str, Callable[[int, str], Latencies], dict[int, Row]]] = [
            ("raw consumer", raw, self._raw),
            ("worker", worker, self._worker),
        ]
        if baseline is not None:
            env = baseline.env()

            def before(rate: int, tag: str) -> Latencies:
                return measure_worker(
                    stack, rate, seconds, warmup_s, f"{tag}-base", env, stages=stages
                )

            # Which worker goes first alternates by round: neither always gets the quieter
            # minute.
            measures.insert(1 + n % 2, (f"worker {baseline.label}", before, self._baseline))
        for rate in self.rates:
            for what, measure, rows in measures:
                progress(
                    f"latency: {what} at {rate:,}/s for {self.warmup_s:g} + {self.seconds:g} s"
                )
                result = measure(rate, f"{rate}-r{n}")
                rows[rate].add(**result.figures())
                figures = result.latencies
                progress(
                    f"latency: {what} at {rate:,}/s: p50 {figures['p50']:.0f} ms, "
                    f"p99 {figures['p99']:.0f} ms, max {figures['max']:.0f} ms; offered "
                    f"{result.rate:,.0f}/s; machine {result.cores['machine_busy']:.0%} busy"
                )
                split = [
                    f"{name} {figures[f'{name}_p50']:.0f}/{figures[f'{name}_p99']:.0f}"
                    for name in (*(span[0] for span in STAGE_SPANS), "granted", "after_grant")
                    if f"{name}_p99" in figures
                ]
                if split:
                    progress(
                        f"latency: {what} at {rate:,}/s, stages p50/p99 ms: " + ", ".join(split)
                    )
                if result.late:
                    rows[rate].notes.append(
                        f"round {n + 1}: {result.late} records not done {DRAIN_TIMEOUT_S:.0f} s "
                        "after the load ended, counted at that lower bound"
                    )

    def rows(self) -> list[Row]:
        return [
            row
            for rate in self.rates
            for row in (self._raw[rate], self._worker[rate], *self._baseline_rows(rate))
        ]

    def _baseline_rows(self, rate: int) -> list[Row]:
        return [self._baseline[rate]] if rate in self._baseline else []

    def summary(self) -> list[str]:
        lines = [
            f"latency: {PARTITIONS}-partition topic; a paced producer in the bench process "
            f"(linger 0) offers each rate for {self.warmup_s:g} s (warm-up, not counted) + "
            f"{self.seconds:g} s, each record stamped with its send time. Worker rows: "
            "`service run` with defaults (payments handler, outcome events on); latency = the "
            "ledger entry's stream id (Redis's clock) - the record's timestamp; handler_* = "
            "timestamp to the handler's call (its granted_at), finish_* = the call to the "
            "ledger entry; cpu_us = worker CPU per record. Raw rows: make_consumer's consumer "
            "alone, in its own process, timestamp to getmany returning the record. *_cores: "
            "CPU of each process while offering; machine_busy: share of all cores not idle."
        ]
        if self.options.stages:
            lines.append(
                "  stages (--stages, bench/latency_probe.py; p50 and p99 of each, ms): fetch = "
                "timestamp to the intake's dispatch; queue = dispatch to its batch's start; "
                "to_handler = batch start to the handler's call; mates = the call to its wave "
                "asking for FINISH (the batch-mates' calls); finish_call = FINISH's round trip "
                "(granted = FINISH sent to the ledger entry); outcome = FINISH's answer to "
                "its batch's outcome documents acknowledged; release = then to its offset "
                "counted done; after_grant = ledger entry to done"
            )
        for row in self.rows():
            lines.append(f"  {row.label}: {row.bound_by}")
            lines.extend(f"    note: {note}" for note in row.notes)
        return lines


RAW_BOUND_BY = (
    "the broker's fetch: Apache Kafka answers a waiting fetch as soon as a record is appended, "
    "so this is a produce and a fetch round trip plus the wait for CPU; Tansu answers only "
    "when its fetch wait (aiokafka's fetch_max_wait_ms, 500 ms) runs out, so its p99 is "
    "~270 ms before any worker"
)
WORKER_BOUND_BY = {
    1_000: (
        "the raw row's fetch, then the worker's one event loop: a record waits for getmany to "
        "come back while the loop runs other batches (fetch; the fetcher asks the broker again "
        "only once the last fetch was read), for its batch's turn (queue) and for FINISH with "
        "its AOF fsync (finish), one call for the batches of a fetch. Every stage grows with "
        "the CPU the worker spends per record and the CPU the machine leaves it (--stages)"
    ),
    10_000: (
        "CPU: the worker needs most of a core at this rate, the bench's producer ~0.6, the "
        "broker and Redis the rest of 2 cores. Once the worker falls behind, its in-flight "
        "limit (5,000) fills and records wait in Kafka, so latency grows for as long as the "
        "load lasts (the percentiles say how far behind it was, not a steady latency; the "
        "fetch stage of --stages holds that wait)"
    ),
}
