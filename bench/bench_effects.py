"""The payments example with its grants in PostgreSQL against the same in Redis, in one run.

Rows, over the same records on the same broker and Redis (AOF ``appendfsync always``):
  A. handler "payments": effects in Redis (effects-only: no claim; FINISH writes the
     done-marker, the ledger entry and the entitlement in one script);
  B. handler "purchases": effects in the embedded PostgreSQL (fsync and synchronous_commit
     on): Redis CLAIM, then one transaction per wave of a batch, per record a savepoint, the
     inbox row and the handler's INSERT into ``purchases``, one COMMIT, then FINISH;
  C. row B with ``WORKER_ORDERING=partition``: every record is a wave of its own, so a
     transaction (and a WAL flush) per record, the way an inbox is usually hand-written
     (its own records, ``--per-record``; 0 leaves it out).
Every run has a fresh consumer group and Redis key prefix, and starts from empty tables
and a fresh checkpoint; every run checks it granted each record once.

Per row: records/s and the worker's CPU per record (the worker runs in this process) from
the first finished record on; over the whole run, per record: the durable writes (Redis's
``fdatasync`` calls: its AOF fsyncs; PostgreSQL's ``wal_sync`` and ``wal_write`` from
``pg_stat_wal``), the CPU of Redis and of PostgreSQL (every process of the cluster), and
records per PostgreSQL transaction. Syscall and CPU counts come from ``perf stat`` attached
to the servers (left out when perf cannot attach).

    python -m bench.bench_effects --records 100000 --partitions 6 --rounds 5

Rows A and B also run as a group of ``python -m bench`` (``--rows effects``, on the bench's
broker), with the row "postgres store vs redis store": B's rate over A's, round by round.
With ``--baseline REV`` row B also runs with the engine of git revision REV (exported, and
imported first by a child process), in the same rounds: before and after a change, under
the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.postgres_server import PostgresServer
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.engine import runtime
from reliable_consumer.engine.handlers.registry import Registry, discover
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.postgres.schema import all_migrations, migrate
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from rich.console import Console
from rich.table import Table

from bench.__main__ import Options
from bench.bench_worker import Measured, finished
from bench.report import Progress, Target
from bench.report import Row as BenchRow
from bench.stack import BenchStack
from service import sample
from service.handlers.payments import EVENTS_TOPIC

# What each server's perf counters count: CPU time, and the calls that make writes durable.
PERF_EVENTS = ("task-clock", "syscalls:sys_enter_fdatasync", "syscalls:sys_enter_fsync")


@dataclass(frozen=True)
class Run:
    """One run of a row: rate and worker CPU, and the servers' work per record."""

    measured: Measured
    records: int  # every record of the run (the per-record counts divide by this)
    redis: dict[str, float]  # perf counters of the Redis process
    postgres: dict[str, float]  # perf counters of every PostgreSQL process
    wal: dict[str, float]  # pg_stat_wal's change over the run
    transactions: int  # the worker's inbox commits

    def per_record(self, value: float) -> float:
        return value / self.records


@dataclass
class Row:
    label: str
    runs: list[Run] = field(default_factory=list)

    def median(self, value: str) -> float | None:
        """The median over the runs that counted it (None: none did, e.g. no perf)."""
        counted = [v for run in self.runs if (v := _value(run, value)) is not None]
        return statistics.median(counted) if counted else None

    def spread(self) -> str:
        rates = [r.measured.rate for r in self.runs]
        return f"{min(rates):,.0f} to {max(rates):,.0f}"


def _value(run: Run, name: str) -> float | None:
    """One figure of a run, by name (per record unless said otherwise); None: not counted."""
    syncs = "syscalls:sys_enter_fdatasync", "syscalls:sys_enter_fsync"
    if (name.startswith("redis_") and not run.redis) or (
        name.startswith("pg_") and not run.postgres
    ):
        return None
    figures: dict[str, float | None] = {
        "rate": run.measured.rate,
        "worker_us": run.measured.cpu_us,
        "redis_us": run.per_record(run.redis.get("task-clock", 0.0) * 1000),
        "redis_syncs": run.per_record(sum(run.redis.get(s, 0.0) for s in syncs)),
        "pg_us": run.per_record(run.postgres.get("task-clock", 0.0) * 1000),
        "pg_syncs": run.per_record(sum(run.postgres.get(s, 0.0) for s in syncs)),
        "wal_sync": run.per_record(run.wal.get("wal_sync", 0.0)),
        "wal_write": run.per_record(run.wal.get("wal_write", 0.0)),
        "per_tx": run.records / run.transactions if run.transactions else None,
    }
    return figures[name]


class PerfStat:
    """``perf stat`` on some processes (and the children they fork meanwhile), or nothing."""

    def __init__(self, pids: list[int]) -> None:
        self.process: subprocess.Popen[str] | None = None
        perf = shutil.which("perf")
        if perf is None or not pids:
            return
        self.process = subprocess.Popen(
            [perf, "stat", "-x,", "-e", ",".join(PERF_EVENTS), "-p", ",".join(map(str, pids))],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self) -> dict[str, float]:
        """The counters (milliseconds for task-clock); empty when perf could not count."""
        if self.process is None:
            return {}
        self.process.send_signal(signal.SIGINT)
        _, err = self.process.communicate(timeout=30)
        counts: dict[str, float] = {}
        for line in err.splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[2] in PERF_EVENTS:
                with contextlib.suppress(ValueError):
                    counts[parts[2]] = float(parts[0])
        return counts


def cluster_pids(postmaster: int) -> list[int]:
    """The postmaster and its lasting children (the ones it forks later inherit the
    counters); not an autovacuum worker, which may be gone before perf attaches."""
    children = Path(f"/proc/{postmaster}/task/{postmaster}/children")
    pids = [postmaster]
    with contextlib.suppress(OSError):
        for pid in map(int, children.read_text().split()):
            with contextlib.suppress(OSError):
                if b"autovacuum worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
    return pids


def settled(metrics: Metrics, name: str) -> float:
    """Records the handler has finished for good: a record parked for a retry (PostgreSQL
    not answering in time on a crowded machine) is counted when its retry ends."""
    return finished(metrics, name) - sum(
        point.value
        for family in metrics.records.collect()
        for point in family.samples
        if point.name == "worker_records_total"
        and point.labels == {"handler": name, "outcome": "retry_scheduled"}
    )


async def produce(bootstrap: str, topic: str, records: list[sample.SampleRecord]) -> None:
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=512 * 1024
    )
    await producer.start()
    try:
        for start in range(0, len(records), 20_000):
            await sample.produce(producer, topic, records[start : start + 20_000])
    finally:
        await producer.stop()


async def reset_postgres(url: str) -> dict[str, float]:
    """Empty tables and a fresh checkpoint, so every run starts alike; pg_stat_wal now. The
    outbox too: a run's relay would otherwise publish the rows an earlier run left."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("TRUNCATE kafka_inbox, purchases, kafka_outbox")
        await conn.execute("CHECKPOINT")
    return await wal_stats(url)


async def wal_stats(url: str) -> dict[str, float]:
    """pg_stat_wal once the worker's connections are gone (a backend reports at exit)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while True:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND pid <> pg_backend_pid()"
            )
            row = await cur.fetchone()
            if (row and row[0] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        cur = await conn.execute("SELECT wal_records, wal_write, wal_sync FROM pg_stat_wal")
        got = await cur.fetchone()
        assert got is not None
        return dict(zip(("wal_records", "wal_write", "wal_sync"), map(float, got), strict=True))


async def reset_redis(url: str) -> None:
    """An empty Redis and a rewritten AOF, so no automatic rewrite lands inside a run."""
    client = aioredis.Redis.from_url(url)
    try:
        await client.flushall()
        await client.bgrewriteaof()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = await client.info("persistence")
            if not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]:
                break
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def granted(name: str, redis_url: str, postgres_url: str, prefix: str) -> int:
    """Grants the run wrote: ledger entries (Redis) or purchases rows, each payment once."""
    if name == "payments":
        client = aioredis.Redis.from_url(redis_url)
        try:
            return int(await client.xlen(f"{prefix}:ledger:purchases"))
        finally:
            await client.aclose()
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        cur = await conn.execute("SELECT count(DISTINCT payment_id), count(*) FROM purchases")
        row = await cur.fetchone()
        assert row is not None
        if row[0] != row[1]:
            raise AssertionError(f"{row[1] - row[0]} payments granted twice")
        return int(row[1])


def settings_for(
    bootstrap: str,
    redis_url: str,
    postgres_url: str,
    topic: str,
    name: str,
    group: str,
    ordering: str,
) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": bootstrap, "group_id": group, "max_poll_records": 5000},
        redis={"url": redis_url, "key_prefix": f"bench-{group}"},
        postgres={"url": postgres_url},
        topics={name: topic},
        ordering=ordering,
        http={"enabled": False},
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        max_concurrent_handlers=5000,
        log_format="console",
        log_level="WARNING",
        topic_durability="off",  # one broker: its warning would repeat on every run
    )


async def worker_run(
    servers: tuple[str, RedisServer, PostgresServer],
    topic: str,
    n: int,
    name: str,
    group: str,
    ordering: str = "key",
) -> Run:
    """One run of a row: fresh group, fresh key prefix, empty tables, counters around it."""
    bootstrap, redis_server, pg = servers
    settings = settings_for(bootstrap, redis_server.url, pg.url, topic, name, group, ordering)
    await reset_redis(redis_server.url)
    wal_before = await reset_postgres(pg.url)
    await create_topics(  # the example's handlers emit their events (the outbox)
        bootstrap,
        {
            settings.outcomes_topic() or "": 6,
            settings.dead_letter_topic(topic): 1,
            EVENTS_TOPIC: 6,
        },
    )
    metrics = Metrics()
    worker = Worker(settings, Registry(discover(), settings.topics), metrics=metrics)
    assert redis_server.pid is not None and pg.pid is not None
    perf_redis, perf_pg = PerfStat([redis_server.pid]), PerfStat(cluster_pids(pg.pid))
    task = asyncio.create_task(worker.run())
    started: float | None = None
    cpu_started = before = 0.0
    try:
        while (done := settled(metrics, name)) < n:
            if task.done():
                task.result()
            if started is None and done > 0:
                started, cpu_started, before = time.perf_counter(), time.process_time(), done
            await asyncio.sleep(0.05)
        assert started is not None
        measured = Measured.since(started, cpu_started, int(n - before))
    finally:
        worker.request_stop()
        await task
    transactions = worker.inbox.commits if worker.inbox is not None else 0
    wal_after = await wal_stats(pg.url)
    redis_counts, pg_counts = perf_redis.stop(), perf_pg.stop()
    got = await granted(name, redis_server.url, pg.url, settings.redis.effective_prefix)
    if got != n:
        raise AssertionError(f"{name}: {got} grants for {n} payments")
    return Run(
        measured,
        n,
        redis_counts,
        pg_counts,
        {k: wal_after[k] - wal_before[k] for k in wal_after},
        transactions,
    )


async def migrated(url: str) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await migrate(conn, all_migrations())


@contextlib.contextmanager
def servers(tmp: Path) -> Iterator[tuple[str, RedisServer, PostgresServer]]:
    broker = TansuBroker(tmp / "kafka").start()
    redis_server = pg = None
    try:
        redis_server = RedisServer(tmp / "redis").start()
        pg = PostgresServer(tmp / "postgres").start()
        yield broker.bootstrap, redis_server, pg
    finally:
        if pg is not None:
            pg.close()  # and its cluster
        for server in (redis_server, broker):
            if server is not None:
                server.stop()


GROUP_TOPIC = "effects-bench"
GROUP_RECORDS = 20_000
QUICK_GROUP_RECORDS = 2_000
POSTGRES_SHARE = 0.5  # the postgres store's rate against the Redis store's, at least


class EffectsGroup:
    """Rows A and B in ``python -m bench`` (``--rows effects``), and their ratio."""

    def __init__(self, options: Options) -> None:
        self.records = QUICK_GROUP_RECORDS if options.quick else GROUP_RECORDS
        units = {"redis_us": "µs/rec", "pg_us": "µs/rec", "per_tx": "rec/tx"}
        self._rows = {
            "payments": BenchRow(
                "effects A. payments, grants in the Redis store", "rec/s", units=units
            ),
            "purchases": BenchRow(
                "effects B. purchases, grants in the postgres store", "rec/s", units=units
            ),
        }
        self._ratio = BenchRow(
            "postgres store vs redis store",
            "x redis",
            targets=[Target("x_redis", POSTGRES_SHARE, at_least=True, text=">= 0.5 x redis")],
        )
        self._prefix = f"eff-{os.getpid()}"
        self._baseline = options.baseline  # exported by python -m bench for the whole run
        if self._baseline is not None:
            self._rows["baseline"] = BenchRow(
                f"effects B0. row B with the engine {self._baseline.label}", "rec/s", units=units
            )
            self._baseline_ratio = BenchRow(
                f"postgres store vs redis store, engine {self._baseline.label}", "x redis"
            )

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        pg = stack.postgres
        asyncio.run(migrated(pg.url))
        stack.create_topics({GROUP_TOPIC: 6})
        progress(f"effects: producing {self.records:,} payments to 6 partitions")
        payments = sample.generate(
            self.records, sample.Mix(transient=0, permanent=0, malformed=0), prefix=self._prefix
        )
        asyncio.run(produce(stack.bootstrap, GROUP_TOPIC, payments))

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        servers = (stack.bootstrap, stack.redis, stack.postgres)
        names = ["payments", "purchases"] + (["baseline"] if self._baseline else [])
        names = names[n % len(names) :] + names[: n % len(names)]
        rates: dict[str, float] = {}
        for name in names:
            group = f"{self._prefix}-{name}-{n}"
            if name == "baseline":
                assert self._baseline is not None and self._baseline.src is not None
                run = baseline_run(self._baseline.src, servers, self.records, group)
            else:
                run = runtime.run(worker_run(servers, GROUP_TOPIC, self.records, name, group))
            figures = {
                "rate": run.measured.rate,
                "cpu_us": run.measured.cpu_us,
                **{
                    key: value
                    for key in ("redis_us", "pg_us", "per_tx")
                    if (value := _value(run, key)) is not None
                },
            }
            self._rows[name].add(**figures)
            rates[name] = run.measured.rate
            progress(
                f"  effects {name}: {run.measured.rate:,.0f}/s, worker "
                f"{run.measured.cpu_us:.0f} µs/rec"
            )
        self._ratio.add(x_redis=rates["purchases"] / rates["payments"])
        if "baseline" in rates:
            self._baseline_ratio.add(x_redis=rates["baseline"] / rates["payments"])

    def rows(self) -> list[BenchRow]:
        extra = [self._baseline_ratio] if self._baseline is not None else []
        return [*self._rows.values(), self._ratio, *extra]

    def summary(self) -> list[str]:
        return [
            "effects rows: the worker in-process, the example's payments handler (A: effects in "
            "Redis) and purchases handler (B: a transaction per wave of at most 64 records, a "
            "savepoint and an inbox row per record, in the embedded PostgreSQL, fsync on); "
            "cpu_us is the worker's CPU per record, redis_us and pg_us the servers' (perf), "
            "per_tx the records per PostgreSQL commit. 'postgres store vs redis store' is B's "
            "rate over A's in the same round.",
        ]


def baseline_run(
    src: Path, servers: tuple[str, RedisServer, PostgresServer], n: int, group: str
) -> Run:
    """Row B in a child process that imports the exported engine (``src``) before this one."""
    bootstrap, redis_server, pg = servers
    args = {
        "bootstrap": bootstrap,
        "redis": [redis_server.url, redis_server.pid],
        "postgres": [pg.url, pg.pid],
        "records": n,
        "group": group,
    }
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run(
        [sys.executable, "-m", "bench.bench_effects", "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the baseline run failed:\n{child.stderr[-3000:]}")
    doc = json.loads(child.stdout.strip().splitlines()[-1])
    return Run(Measured(**doc["measured"]), n, doc["redis"], doc["postgres"], doc["wal"], doc["tx"])


@dataclass(frozen=True)
class _Server:
    """What ``worker_run`` reads of a server the parent process started."""

    url: str
    pid: int | None


def child(raw: str) -> None:
    """One run of row B for ``baseline_run``, its figures as one JSON line on stdout."""
    args = json.loads(raw)
    servers: Any = (args["bootstrap"], _Server(*args["redis"]), _Server(*args["postgres"]))
    run = runtime.run(worker_run(servers, GROUP_TOPIC, args["records"], "purchases", args["group"]))
    doc = {
        "measured": {"rate": run.measured.rate, "cpu_us": run.measured.cpu_us},
        "redis": run.redis,
        "postgres": run.postgres,
        "wal": run.wal,
        "tx": run.transactions,
    }
    print(json.dumps(doc))


def main(records: int, partitions: int, rounds: int, per_record: int) -> None:
    console = Console() if sys.stdout.isatty() else Console(width=140)
    redis_row = Row("A. payments (Redis)")
    pg_row = Row("B. purchases (PostgreSQL)")
    single = Row("C. B, a tx per record")
    rows = [redis_row, pg_row] + ([single] if per_record else [])
    payments = sample.generate(records, sample.Mix(transient=0, permanent=0, malformed=0))
    with tempfile.TemporaryDirectory() as tmp_dir, servers(Path(tmp_dir)) as stack:
        bootstrap = stack[0]
        asyncio.run(migrated(stack[2].url))
        topic = "bench-effects"
        asyncio.run(create_topics(bootstrap, {topic: partitions}))
        console.print(f"producing {records} payments to {partitions} partitions...")
        asyncio.run(produce(bootstrap, topic, payments))
        short = f"{topic}-short"
        if per_record:
            asyncio.run(create_topics(bootstrap, {short: partitions}))
            asyncio.run(produce(bootstrap, short, payments[:per_record]))
        for n in range(rounds):
            for row, name, source, count, ordering in (
                (redis_row, "payments", topic, records, "key"),
                (pg_row, "purchases", topic, records, "key"),
                (single, "purchases", short, per_record, "partition"),
            ):
                if row not in rows:
                    continue
                group = f"{source}-{name}-{ordering}-{n}"
                run = worker_run(stack, source, count, name, group, ordering)
                row.runs.append(runtime.run(run))
            done = ", ".join(f"{r.label[:2]} {r.runs[-1].measured.rate:,.0f}" for r in rows)
            console.print(f"round {n + 1}/{rounds} (records/s): {done}")
    table = Table(
        title=f"{records:,} payments ({per_record:,} in row C), {partitions} partitions, Tansu"
        f" + Redis (AOF always) + PostgreSQL 16 (fsync on): medians of {rounds} rounds"
    )
    columns = (
        ("row", ""),
        ("records/s", "rate"),
        ("range", ""),
        ("worker µs", "worker_us"),
        ("Redis µs", "redis_us"),
        ("Redis syncs", "redis_syncs"),
        ("PG µs", "pg_us"),
        ("PG syncs", "pg_syncs"),
        ("wal_sync", "wal_sync"),
        ("wal_write", "wal_write"),
        ("rec/tx", "per_tx"),
    )
    for title, _ in columns:
        table.add_column(title, justify="left" if title == "row" else "right")
    formats = {"rate": "{:,.0f}", "per_tx": "{:,.0f}"}
    for row in rows:
        cells = []
        for title, key in columns:
            if title == "row":
                cells.append(row.label)
            elif title == "range":
                cells.append(row.spread())
            elif (value := row.median(key)) is None:
                cells.append("n/a")
            else:
                cells.append(formats.get(key, "{:.3g}").format(value))
        table.add_row(*cells)
    console.print(table)
    console.print(
        "Per record, over the whole run: worker µs, Redis µs, PG µs: CPU time of the worker"
        " (from the first finished record on), of Redis, of every PostgreSQL process; Redis"
        " syncs: its fdatasync calls (the AOF's fsyncs: appendfsync always, one per event-loop"
        " pass that wrote); PG syncs: the cluster's fsync + fdatasync calls (WAL flushes, and"
        " data files at checkpoints); wal_sync: WAL flushes to disk, wal_write: WAL buffer"
        " writes to the kernel (pg_stat_wal); rec/tx: records per PostgreSQL commit."
        + ("" if shutil.which("perf") else " perf not found: no syscall or server CPU counts.")
    )
    console.print(
        f"machine: {os.cpu_count()} cores; rate x worker CPU near 1,000,000: the"
        " worker's thread was the limit"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
        raise SystemExit(0)
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--per-record", type=int, default=5_000, help="records in row C (0: no row C)"
    )
    args = parser.parse_args()
    main(args.records, args.partitions, args.rounds, args.per_record)
