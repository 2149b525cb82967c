"""Throughput of the worker against a raw aiokafka loop, measured in one run on one topic.

Prints records/s for:
  1. a raw aiokafka loop: getmany + json.loads + commit per batch (the ceiling here),
     on asyncio's loop and on uvloop, the faster counting;
  2. this worker, trivial handler, the full reliability path (dedupe check, done-marker,
     outcome event, watermark commits) on a real Redis with appendfsync always. The
     handler is declared effects_only, as the payment handler is; 2b is the same handler
     without that declaration, which claims each dedupe key first;
  3. this worker with a handler that awaits 10 ms, against concurrency limit / 10 ms
     (WORKER_MAX_CONCURRENT_HANDLERS: how many handlers run at once).
The worker runs on the event loop `service run` picks (uvloop when installed).

    python -m bench.bench_worker --records 200000 --partitions 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from service import Context, handler, runtime
from service.devstack import KafkaBroker, RedisServer, create_topics
from service.metrics import Metrics
from service.registry import Registry
from service.settings import Settings
from service.worker import Worker


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


async def produce(bootstrap: str, topic: str, n: int) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    rng = random.Random(1)
    try:
        futures = []
        for i in range(n):
            value = json.dumps(
                {
                    "payment_id": f"{topic}-{i:08d}",
                    "user_id": f"u{rng.randrange(10**6)}",
                    "amount_minor": rng.randrange(100, 10**6),
                    "currency": "EUR",
                }
            ).encode()
            futures.append(await producer.send(topic, key=f"k{i}".encode(), value=value))
            if len(futures) >= 20_000:
                await asyncio.gather(*futures)
                futures.clear()
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def raw_loop(bootstrap: str, topic: str, n: int, group: str) -> float:
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
        while seen < n:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            if batch and started is None:
                started = time.perf_counter()
            for records in batch.values():
                for r in records:
                    json.loads(r.value)
                seen += len(records)
            if batch:
                await consumer.commit()
        assert started is not None
        return n / (time.perf_counter() - started)
    finally:
        await consumer.stop()


async def worker_run(
    bootstrap: str,
    redis_url: str,
    topic: str,
    n: int,
    name: str,
    concurrency: int,
) -> tuple[float, dict[str, Any]]:
    settings = Settings(
        kafka={
            "bootstrap_servers": bootstrap,
            "group_id": f"{topic}-{name}",  # type: ignore[arg-type]
            "max_poll_records": 5000,
        },
        redis={"url": redis_url, "key_prefix": f"bench-{topic}-{name}"},  # type: ignore[arg-type]
        topics={name: topic},
        http={"enabled": False},  # type: ignore[arg-type]
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        max_concurrent_handlers=concurrency,
        log_format="console",
        log_level="WARNING",
    )
    await create_topics(
        bootstrap, {settings.outcomes_topic() or "": 6, settings.dead_letter_topic(topic): 1}
    )
    metrics = Metrics()
    registry = Registry([trivial, claiming, sleepy], settings.topics)
    worker = Worker(settings, registry, metrics=metrics)
    task = asyncio.create_task(worker.run())
    started: float | None = None

    def done() -> float:
        return sum(
            metrics.registry.get_sample_value(
                "worker_records_total", {"handler": name, "outcome": o}
            )
            or 0
            for o in ("succeeded", "duplicate", "dead_lettered", "retry_scheduled")
        )

    try:
        while done() < n:
            if task.done():
                task.result()
            if started is None and done() > 0:
                started = time.perf_counter()
            await asyncio.sleep(0.05)
        assert started is not None
        rate = n / (time.perf_counter() - started)
        extras = {
            "succeeded": metrics.registry.get_sample_value(
                "worker_records_total", {"handler": name, "outcome": "succeeded"}
            )
        }
        return rate, extras
    finally:
        worker.request_stop()
        await task


def main(records: int, partitions: int, concurrency: int) -> None:
    """Each phase runs on its own event loop, so the raw loop can be measured on both."""
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        broker = KafkaBroker(Path(tmp) / "kafka").start()
        redis_server = RedisServer(Path(tmp) / "redis").start()
        try:
            topic = "bench"
            asyncio.run(create_topics(broker.bootstrap, {topic: partitions}))
            console.print(f"producing {records} records to {partitions} partitions...")
            asyncio.run(produce(broker.bootstrap, topic, records))
            # The ceiling is the faster of asyncio's loop and the worker's (uvloop, when
            # installed): aiokafka's raw loop is not always faster on uvloop.
            raws = {}
            for choice in ("asyncio", "auto"):
                loop_name = "uvloop" if runtime.loop_factory(choice) else "asyncio"
                if loop_name not in raws:
                    raws[loop_name] = runtime.run(
                        raw_loop(broker.bootstrap, topic, records, f"raw-{loop_name}"), choice
                    )
                    console.print(f"raw loop on {loop_name}: {raws[loop_name]:,.0f} records/s")
            raw = max(raws.values())
            full, extras = runtime.run(
                worker_run(broker.bootstrap, redis_server.url, topic, records, "trivial", 5000)
            )
            console.print(f"worker, trivial handler: {full:,.0f} records/s {extras}")
            claims, extras = runtime.run(
                worker_run(broker.bootstrap, redis_server.url, topic, records, "claiming", 5000)
            )
            console.print(f"worker, trivial handler that claims: {claims:,.0f} records/s {extras}")
            sleepy_n = min(records, 40_000)
            slow, _ = runtime.run(
                worker_run(
                    broker.bootstrap, redis_server.url, topic, sleepy_n, "sleepy", concurrency
                )
            )
        finally:
            redis_server.stop()
            broker.stop()
    ideal = concurrency / 0.010
    table = Table(title=f"{records} records, {partitions} partitions, Tansu + Redis (AOF always)")
    table.add_column("run")
    table.add_column("records/s", justify="right")
    table.add_column("target", justify="right")
    table.add_column("ratio", justify="right")
    for loop_name, rate in raws.items():
        table.add_row(f"   raw loop on {loop_name}", f"{rate:,.0f}", "", f"{rate / raw:.2f}")
    table.add_row("1. raw aiokafka loop (ceiling: the faster)", f"{raw:,.0f}", "", "1.00")
    table.add_row(
        "2. worker, trivial handler",
        f"{full:,.0f}",
        f">= {0.35 * raw:,.0f}",
        f"{full / raw:.2f} of raw",
    )
    table.add_row(
        "2b. the same, not effects_only (claims first)",
        f"{claims:,.0f}",
        "",
        f"{claims / raw:.2f} of raw",
    )
    table.add_row(
        f"3. worker, 10 ms handler, concurrency {concurrency}",
        f"{slow:,.0f}",
        f">= {0.8 * ideal:,.0f}",
        f"{slow / ideal:.2f} of ideal",
    )
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=200)
    args = parser.parse_args()
    main(args.records, args.partitions, args.concurrency)
