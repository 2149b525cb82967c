"""Benchmark the reconcile job against the floor: counting the source topic through the source.

    python -m bench.bench_reconcile --records 1000000

Starts its own Tansu broker and Redis (reliable_consumer.dev.devstack), writes N payment
notifications with an outcome for each (some retried, some dead-lettered, the rest granted,
with ledger entries), then on one SparkSession (`--master`, default local[2]) measures:

(a) the floor: `read_topic(source).count()`, i.e. how fast the Kafka source alone moves
    records into Spark;
(b) `run_reconcile`: read source + outcomes + dead letters (+ ledger), parse, join, aggregate,
    write Parquet, summarize.

Both run warm (a small read first starts the Python workers) and print records/s with rich.
Figures move between runs on shared machines; compare the two numbers of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer_pipeline.reconcile import (
    RECORDS_TABLE,
    DedupeField,
    ReconcileConfig,
    print_report,
    run_reconcile,
)
from reliable_consumer_pipeline.source import read_topic
from reliable_consumer_pipeline.spark import build_spark, parse_conf
from reliable_consumer_pipeline.synthetic import Scenario, produce_dataset
from rich.console import Console
from rich.table import Table

console = Console()


def _every(n: int, step: int, offset: int) -> frozenset[int]:
    return frozenset(range(offset, n, step)) if step > 0 else frozenset()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--outcome-partitions", type=int, default=6)
    parser.add_argument(
        "--dead-letter-every",
        type=int,
        default=1000,
        help="every Nth payment is dead-lettered (0: none)",
    )
    parser.add_argument(
        "--retry-every",
        type=int,
        default=100,
        help="every Nth payment is retried once before its grant (0: none)",
    )
    parser.add_argument("--no-ledger", action="store_true", help="skip the Redis ledger")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--conf", action="append", default=[], help="Spark key=value")
    parser.add_argument("--max-records-per-partition", type=int, default=200_000)
    parser.add_argument("--chart", type=Path, default=None)
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="reconcile this many times (the first pays JVM JIT warm-up)",
    )
    args = parser.parse_args(argv)

    n = args.records
    work = Path(tempfile.mkdtemp(prefix="bench-reconcile-"))
    broker = TansuBroker(work / "tansu", silent=True)
    redis_server = (
        None
        if args.no_ledger
        else RedisServer(
            work / "redis",
            extra_config={"appendonly": "no"},  # the bench measures Spark, not fsync
        )
    )
    spark = None
    try:
        broker.start()
        if redis_server is not None:
            redis_server.start()
        redis_url = redis_server.url if redis_server is not None else None
        source, outcomes, dlq = "payments", "payments-worker.outcomes", "payments.dlq"
        asyncio.run(
            create_topics(
                broker.bootstrap,
                {
                    source: args.partitions,
                    outcomes: args.outcome_partitions,
                    dlq: 1,
                    "warmup": 2,
                },
            )
        )
        scenario = Scenario(
            n=n,
            dead_lettered=_every(n, args.dead_letter_every, 7),
            retried_then_granted=_every(n, args.retry_every, 3),
            malformed=max(0, n // 100_000),
        )
        console.print(f"writing {n:,} payments with outcomes to {broker.bootstrap} ...")
        started = time.perf_counter()
        data = asyncio.run(
            produce_dataset(
                broker.bootstrap,
                scenario,
                source_topic=source,
                outcomes_topic=outcomes,
                dlq_topic=dlq,
                partitions=args.partitions,
                outcome_partitions=args.outcome_partitions,
                base_ts_ms=1_760_000_000_000,
                redis_url=redis_url,
                ledger_key="{payments-worker}:ledger:purchases",
                key_field="payment_id",  # the example's notifications, as its worker writes them
                handler="payments",
            )
        )
        produce_s = time.perf_counter() - started
        written = data.source_records + data.outcome_events + data.dead_letters
        console.print(
            f"  {written:,} Kafka records and {data.ledger_entries:,} ledger entries "
            f"in {produce_s:.1f}s"
        )

        conf = {"spark.driver.memory": "4g", **parse_conf(args.conf)}
        spark = build_spark(args.master, conf, app_name="bench-reconcile")
        read_topic(spark, broker.bootstrap, "warmup").count()  # start the Python workers

        started = time.perf_counter()
        counted = read_topic(
            spark, broker.bootstrap, source, maxRecordsPerPartition=args.max_records_per_partition
        ).count()
        count_s = time.perf_counter() - started
        assert counted == data.source_records, (counted, data.source_records)

        out = work / "out"
        rc = ReconcileConfig(
            bootstrap=broker.bootstrap,
            out_dir=out,
            topics=(source,),
            fields={source: DedupeField("payment_id", "payment_id")},
            outcomes_topic=outcomes,
            dlq_topics=(dlq,),
            redis_url=redis_url,
            key_prefix="payments-worker",
            kafka_options={"maxRecordsPerPartition": str(args.max_records_per_partition)},
        )
        runs: list[tuple[float, dict[str, float]]] = []
        for _ in range(max(1, args.runs)):
            started = time.perf_counter()
            report = run_reconcile(spark, rc)
            runs.append((time.perf_counter() - started, report.timings))
        if args.chart is not None:
            from reliable_consumer_pipeline.chart import write_chart

            write_chart(spark.read.parquet(str(out / RECORDS_TABLE)), args.chart)

        print_report(report)
        inputs = (
            report.source_records
            + report.outcome_events
            + report.dead_letters
            + (report.ledger_entries or 0)
        )
        table = Table(title=f"bench_reconcile: {n:,} payments, {args.master}")
        for col in ("step", "records", "seconds", "records/s"):
            table.add_column(col, justify="left" if col == "step" else "right")
        table.add_row(
            "produce (Kafka + ledger)",
            f"{written + data.ledger_entries:,}",
            f"{produce_s:.1f}",
            f"{(written + data.ledger_entries) / produce_s:,.0f}",
        )
        table.add_row(
            "(a) count source topic (floor)",
            f"{counted:,}",
            f"{count_s:.1f}",
            f"{counted / count_s:,.0f}",
        )
        for i, (seconds, _) in enumerate(runs, 1):
            label = f"(b) reconcile run {i}" if len(runs) > 1 else "(b) reconcile"
            table.add_row(
                f"{label}, per source record",
                f"{report.source_records:,}",
                f"{seconds:.1f}",
                f"{report.source_records / seconds:,.0f}",
            )
            table.add_row(
                f"{label}, per input record",
                f"{inputs:,}",
                f"{seconds:.1f}",
                f"{inputs / seconds:,.0f}",
            )
        console.print(table)
        for i, (_, timings) in enumerate(runs, 1):
            console.print(
                f"reconcile run {i} phases (s): "
                + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
            )
        expected_clean = report.lost == 0 and report.doubled == 0
        return 0 if expected_clean else 1
    finally:
        if spark is not None:
            spark.stop()
        if redis_server is not None:
            redis_server.stop()
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
