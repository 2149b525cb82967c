"""Throughput of the worker against a raw aiokafka loop, measured in one run on one topic.

Prints records/s for:
  1. a raw aiokafka loop: getmany + json.loads + commit per batch (the ceiling here),
     on asyncio's loop and on uvloop, the faster counting;
  2. this worker, trivial handler, the full reliability path (dedupe check, done-marker,
     outcome event, watermark commits) on a real Redis with appendfsync always. The
     handler is declared effects_only, as the payment handler is; 2b is the same handler
     without that declaration, which claims each dedupe key first; 2c is row 2 with the
     outcome events turned off (WORKER_OUTCOMES__ENABLED=false), to show what the audit
     trail costs; 2d is row 2 as several worker processes in one consumer group (--processes,
     2 by default), the way one host scales out, counted over all of them;
  3. this worker with a handler that awaits 10 ms, against concurrency limit / 10 ms
     (WORKER_MAX_CONCURRENT_HANDLERS: how many handlers run at once).
The worker runs on the event loop `service run` picks (uvloop when installed).

One measurement of any row moves by a third from run to run on a shared 2-core machine,
so the rows are measured in interleaved rounds (raw loops, then the workers, again and
again) over the same records, and each row reports its median; the ratios are taken
between medians.

    python -m bench.bench_worker --records 200000 --partitions 6 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from service import Context, handler
from service.dev.broker import create_topics
from service.dev.redis_server import RedisServer
from service.dev.tansu import TansuBroker
from service.engine import runtime
from service.engine.metrics import Metrics
from service.engine.registry import Registry
from service.engine.settings import Settings
from service.engine.worker import Worker


class Payment(BaseModel):
    payment_id: str
    user_id: str
    amount_minor: int
    currency: str


@handler("trivial", model=Payment, dedupe_key="payment_id", effects_only=True)
def trivial(payment: Payment, ctx: Context) -> None:
    return None


@handler("claiming", model=Payment, dedupe_key="payment_id")
def claiming(payment: Payment, ctx: Context) -> None:
    return None


@handler("sleepy", model=Payment, dedupe_key="payment_id")
async def sleepy(payment: Payment, ctx: Context) -> None:
    await asyncio.sleep(0.010)


@dataclass(frozen=True)
class Measured:
    """A run's records per second, and the CPU its process spent per record meanwhile."""

    rate: float
    cpu_us: float

    @classmethod
    def since(cls, started: float, cpu_started: float, n: int) -> Measured:
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        return cls(n / wall, cpu / n * 1e6)


def sample_payment(rng: random.Random, payment_id: str) -> bytes:
    """One payment notification as the bench produces it (about 110 bytes of JSON)."""
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": f"u{rng.randrange(10**6)}",
            "amount_minor": rng.randrange(100, 10**6),
            "currency": "EUR",
        }
    ).encode()


async def produce(bootstrap: str, topic: str, n: int) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    rng = random.Random(1)
    try:
        futures = []
        for i in range(n):
            value = sample_payment(rng, f"{topic}-{i:08d}")
            futures.append(await producer.send(topic, key=f"k{i}".encode(), value=value))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def raw_loop(bootstrap: str, topic: str, n: int, group: str) -> Measured:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"{topic}-{group}",
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


def bench_settings(
    bootstrap: str,
    redis_url: str,
    topic: str,
    name: str,
    group: str,
    concurrency: int,
    outcomes: bool = True,
) -> Settings:
    """The worker's settings in rows 2 and 3: one group and one key prefix per run."""
    return Settings(
        kafka={
            "bootstrap_servers": bootstrap,
            "group_id": group,
            "max_poll_records": 5000,
        },
        redis={"url": redis_url, "key_prefix": f"bench-{group}"},
        outcomes={"enabled": outcomes},
        topics={name: topic},
        http={"enabled": False},
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        max_concurrent_handlers=concurrency,
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


async def start_worker(settings: Settings, metrics: Metrics) -> tuple[Worker, asyncio.Task[None]]:
    """The worker running in this process, with its dead-letter and outcome topics made."""
    topic = next(iter(settings.topics.values()))
    await create_topics(
        settings.kafka.bootstrap_servers,
        {settings.outcomes_topic() or "": 6, settings.dead_letter_topic(topic): 1},
    )
    registry = Registry([trivial, claiming, sleepy], settings.topics)
    worker = Worker(settings, registry, metrics=metrics)
    return worker, asyncio.create_task(worker.run())


async def worker_run(
    bootstrap: str,
    redis_url: str,
    topic: str,
    n: int,
    name: str,
    concurrency: int,
    run: int = 0,
    outcomes: bool = True,
) -> Measured:
    """One fresh consumer group and key prefix per run, so every run does all the work."""
    group = f"{topic}-{name}-{run}" + ("" if outcomes else "-no-outcomes")
    settings = bench_settings(bootstrap, redis_url, topic, name, group, concurrency, outcomes)
    metrics = Metrics()
    worker, task = await start_worker(settings, metrics)
    started: float | None = None
    cpu_started = 0.0
    try:
        before = 0.0  # records already finished when the clocks started: not counted
        while (done := finished(metrics, name)) < n:
            if task.done():
                task.result()
            if started is None and done > 0:
                started, cpu_started = time.perf_counter(), time.process_time()
                before = done
            await asyncio.sleep(0.05)
        assert started is not None
        return Measured.since(started, cpu_started, int(n - before))
    finally:
        worker.request_stop()
        await task


def worker_process(
    settings_args: tuple[str, str, str, str, str, int], done: Any, cpu: Any, stop: Any
) -> None:
    """One process of row 2d: publishes its records finished and CPU time until stopped."""
    name = settings_args[3]

    async def main() -> None:
        metrics = Metrics()
        worker, task = await start_worker(bench_settings(*settings_args), metrics)
        try:
            while not stop.is_set():
                if task.done():
                    task.result()
                done.value, cpu.value = finished(metrics, name), time.process_time()
                await asyncio.sleep(0.05)
        finally:
            worker.request_stop()
            await task

    runtime.run(main())


def processes_run(
    bootstrap: str, redis_url: str, topic: str, n: int, processes: int, run: int
) -> Measured:
    """Row 2 as several worker processes in one group: how one host scales out.

    The CPU per record is the processes' sum, so it compares with row 2's one process.
    """
    spawn = multiprocessing.get_context("spawn")
    group = f"{topic}-trivial-{run}-x{processes}"
    stop = spawn.Event()
    dones = [spawn.Value("d", 0.0, lock=False) for _ in range(processes)]
    cpus = [spawn.Value("d", 0.0, lock=False) for _ in range(processes)]
    settings_args = (bootstrap, redis_url, topic, "trivial", group, 5000)
    children = [
        spawn.Process(target=worker_process, args=(settings_args, done, cpu, stop))
        for done, cpu in zip(dones, cpus, strict=True)
    ]
    for child in children:
        child.start()
    try:
        started: float | None = None
        before = cpu_started = 0.0  # records finished and CPU spent before the clocks start
        while (done := sum(d.value for d in dones)) < n:
            if any(child.exitcode is not None for child in children):
                raise RuntimeError(f"a worker process of row 2d exited early ({group})")
            if started is None and done > 0:
                started, before = time.perf_counter(), done
                cpu_started = sum(c.value for c in cpus)
            time.sleep(0.05)
        assert started is not None
        counted = n - before
        cpu_us = (sum(c.value for c in cpus) - cpu_started) / counted * 1e6
        return Measured(counted / (time.perf_counter() - started), cpu_us)
    finally:
        stop.set()
        for child in children:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
                child.join()


@dataclass
class Row:
    """One bench row: its rate in every round."""

    label: str
    runs: list[Measured] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        return [m.rate for m in self.runs]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def cpu_us(self) -> float:
        """Median CPU per record of the process that ran the row (worker or raw loop)."""
        return statistics.median(m.cpu_us for m in self.runs)

    def spread(self) -> str:
        return f"{min(self.rates):,.0f} to {max(self.rates):,.0f}"


def main(records: int, partitions: int, concurrency: int, rounds: int, processes: int) -> None:
    """Each phase runs on its own event loop, so the raw loop can be measured on both."""
    # Wide enough for the table in logs and pipes, where rich would assume 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    # The ceiling is the faster of asyncio's loop and the worker's (uvloop, when
    # installed): aiokafka's raw loop is not always faster on uvloop.
    choices: tuple[runtime.LoopChoice, ...] = ("asyncio", "auto")
    loops = {"uvloop" if runtime.loop_factory(c) else "asyncio": c for c in choices}
    raws = {name: Row(f"1. raw loop, {name}") for name in loops}
    full = Row("2. worker, trivial")
    claims = Row("2b. same, claims first")
    quiet = Row("2c. same, no outcome events")
    scaled = Row(f"2d. row 2 as {processes} worker processes")
    slow = Row("3. worker, 10 ms handler")
    sleepy_n = min(records, 40_000)
    with tempfile.TemporaryDirectory() as tmp:
        broker = TansuBroker(Path(tmp) / "kafka").start()
        redis_server = RedisServer(Path(tmp) / "redis").start()
        bootstrap, redis_url = broker.bootstrap, redis_server.url
        try:
            topic = "bench"
            asyncio.run(create_topics(bootstrap, {topic: partitions}))
            console.print(f"producing {records} records to {partitions} partitions...")
            asyncio.run(produce(bootstrap, topic, records))
            for n in range(rounds):
                for loop_name, choice in loops.items():
                    group = f"raw-{loop_name}-{n}"
                    raws[loop_name].runs.append(
                        runtime.run(raw_loop(bootstrap, topic, records, group), choice)
                    )
                for row, name, count, limit, outcomes in (
                    (full, "trivial", records, 5000, True),
                    (claims, "claiming", records, 5000, True),
                    (quiet, "trivial", records, 5000, False),
                    (slow, "sleepy", sleepy_n, concurrency, True),
                ):
                    worker = worker_run(
                        bootstrap, redis_url, topic, count, name, limit, n, outcomes
                    )
                    row.runs.append(runtime.run(worker))
                if processes > 1:
                    scaled.runs.append(
                        processes_run(bootstrap, redis_url, topic, records, processes, n)
                    )
                done = ", ".join(
                    f"{row.label[row.label.index(' ') + 1 :]} {row.rates[-1]:,.0f}"
                    for row in (*raws.values(), full, claims, quiet, scaled, slow)
                    if row.runs
                )
                console.print(f"round {n + 1}/{rounds} (records/s): {done}")
        finally:
            redis_server.stop()
            broker.stop()
    raw = max(row.median for row in raws.values())
    ideal = concurrency / 0.010
    table = Table(
        title=f"{records:,} records, {partitions} partitions, Tansu + Redis (AOF always): "
        f"medians of {rounds} rounds"
    )
    for column in ("row", "records/s", "range", "CPU µs/rec", "target", "ratio"):
        table.add_column(column, justify="left" if column == "row" else "right")
    for row in raws.values():
        table.add_row(
            row.label,
            f"{row.median:,.0f}",
            row.spread(),
            f"{row.cpu_us:.1f}",
            "",
            f"{row.median / raw:.2f}",
        )
    for row, target, ratio in (
        (full, f">= {0.35 * raw:,.0f}", f"{full.median / raw:.2f} of raw"),
        (claims, "", f"{claims.median / raw:.2f} of raw"),
        (quiet, "", f"{quiet.median / raw:.2f} of raw"),
        *([(scaled, "", f"{scaled.median / raw:.2f} of raw")] if scaled.runs else []),
        (slow, f">= {0.8 * ideal:,.0f}", f"{slow.median / ideal:.2f} of ideal"),
    ):
        cpu = f"{row.cpu_us:.1f}"
        table.add_row(row.label, f"{row.median:,.0f}", row.spread(), cpu, target, ratio)
    console.print(table)
    console.print(f"raw: the faster raw loop's median, {raw:,.0f}/s")
    console.print(f"ideal for 3: {concurrency} handlers at once / 10 ms = {ideal:,.0f}/s")
    console.print(
        "CPU µs/rec: CPU time per record of the process running the row (one Python thread);"
        " records/s x CPU µs near 1,000,000 means that thread was the limit"
        + ("; for 2d, the sum over its processes" if scaled.runs else "")
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--processes", type=int, default=2, help="worker processes in row 2d (1: no row 2d)"
    )
    args = parser.parse_args()
    main(args.records, args.partitions, args.concurrency, args.rounds, args.processes)
