"""What ordered retries cost the keys that are not blocked.

While a Kafka key has a record waiting in the delay queue, its later records park behind it
(its chain); every other key must keep flowing. Each scenario runs the worker (in this
process, effects-only handler, WORKER_ORDERING=key unless said) over records of many keys,
where X % of the keys have a head that fails on every attempt (``x-fault: transient:<huge>``,
retried every 0.1-1 s for the whole run) with N records of that key behind it:

  1. no failures, WORKER_ORDERING=none: one wave per batch, no chain check (no per-key order);
  2. no failures, WORKER_ORDERING=key, the handler declaring ordering="none": a batch's
     records of one key run in successive waves, as every keyed handler did before chains;
  3. no failures, chains (the default): row 2 plus the chain check in every fresh finish;
  4-6. X % of keys blocked, N behind: the other keys' records are fetched in the same
     batches as the blocked ones, which each cost a PARK into their chain, and the failing
     heads are retried by the scheduler all along.

Two figures per scenario, for the records of the other keys only:

  - records/s: a backlog of every record, produced before the worker starts; the rate is
    from the first to the last effect written (the Redis stream entry ids of the handler's
    effect, so the clock is Redis's and the moment is the one the effect became durable);
  - p50 / p99 latency: the same mix produced live at ``--rate`` records/s; from the
    record's produce timestamp to its effect's stream entry.

Rounds are interleaved (every scenario once, then again), and each figure is a median. The
circuit breaker is off (WORKER_BREAKER__ENABLED=false): a tenth of the keys failing would
open it, which is its job but not what is measured here.

    python -m bench.bench_chains --keys 10000 --per-key 4 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from pydantic import BaseModel
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.dev.servers.tansu import TansuBroker
from reliable_consumer.engine import runtime
from reliable_consumer.engine.handlers.faults import HEADER as FAULT_HEADER
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.observation.metrics import Metrics
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from rich.console import Console
from rich.table import Table

from service import Context, handler

NEVER = b"transient:1000000000"  # fails every attempt of the run
WAIT_S = 300.0  # deadline of one run's drain


class Event(BaseModel):
    event_id: str
    blocked: bool


def _record_done(event: Event, ctx: Context) -> None:
    """One stream entry per record of an unblocked key: its entry id is when it was durable."""
    if not event.blocked:
        ctx.effects.xadd(ctx.redis_key("chained", "done"), {"t": ctx.timestamp_ms})


chained = handler("chained", model=Event, dedupe_key="event_id", effects_only=True)(_record_done)
# The same handler without chains (its records may overtake a parked one of their key):
# with WORKER_ORDERING=key it still runs a batch's records of one key in successive waves,
# which is what every keyed handler did before chains existed.
unchained = handler(
    "chained", model=Event, dedupe_key="event_id", effects_only=True, ordering="none"
)(_record_done)


@dataclass(frozen=True)
class Scenario:
    label: str
    blocked_share: float  # of the keys: a failing head with `behind` records after it
    behind: int
    ordering: Literal["key", "none"] = "key"  # WORKER_ORDERING
    chains: bool = True  # False: the handler declares ordering="none"


BASE = 2  # the row the others are compared with: no failures, chains on (the default)
SCENARIOS = (
    Scenario("1. no failures, WORKER_ORDERING=none", 0.0, 0, "none", chains=False),
    Scenario("2. no failures, key waves, no chains", 0.0, 0, chains=False),
    Scenario("3. no failures, chains (default)", 0.0, 0),
    Scenario("4. 1% of keys blocked, 5 behind", 0.01, 5),
    Scenario("5. 10% of keys blocked, 5 behind", 0.10, 5),
    Scenario("6. 1% of keys blocked, 50 behind", 0.01, 50),
)


@dataclass(frozen=True)
class Record:
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def make_records(
    scenario: Scenario, keys: int, per_key: int, seed: int
) -> tuple[list[Record], int]:
    """The records of one scenario, each key's in order, keys interleaved at random; and how
    many belong to unblocked keys (the ones measured)."""
    rng = random.Random(seed)
    blocked = round(keys * scenario.blocked_share)
    sequences: list[list[Record]] = []
    for k in range(keys):
        key = f"k{k:06d}".encode()
        if k < blocked:
            head = Record(key, _value(f"{k}-0", True), [(FAULT_HEADER, NEVER)])
            rest = [
                Record(key, _value(f"{k}-{i}", True), []) for i in range(1, 1 + scenario.behind)
            ]
            sequences.append([head, *rest])
        else:
            sequences.append([Record(key, _value(f"{k}-{i}", False), []) for i in range(per_key)])
    slots = [i for i, seq in enumerate(sequences) for _ in seq]
    rng.shuffle(slots)
    cursors = [0] * len(sequences)
    out = []
    for i in slots:
        out.append(sequences[i][cursors[i]])
        cursors[i] += 1
    return out, (keys - blocked) * per_key


def _value(event_id: str, blocked: bool) -> bytes:
    return json.dumps({"event_id": event_id, "blocked": blocked}).encode()


async def produce(bootstrap: str, topic: str, records: list[Record], rate: float | None) -> None:
    """All at once (a backlog), or ``rate`` records/s in 20 ms ticks (live traffic)."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        tick = len(records) if rate is None else max(1, int(rate / 50))
        started = time.monotonic()
        for n, start in enumerate(range(0, len(records), tick)):
            if rate is not None:
                await asyncio.sleep(max(0.0, started + n * tick / rate - time.monotonic()))
            futures = [
                await producer.send(topic, r.value, key=r.key, headers=r.headers or None)
                for r in records[start : start + tick]
            ]
            await asyncio.gather(*futures)
    finally:
        await producer.stop()


def settings_for(bootstrap: str, redis_url: str, topic: str, group: str, s: Scenario) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": bootstrap, "group_id": group, "max_poll_records": 5000},
        redis={"url": redis_url, "key_prefix": f"bench-{group}"},
        topics={"chained": topic},
        retry={
            "base_delay_ms": 100,
            "max_delay_ms": 1_000,
            "max_attempts": None,
            "max_age_s": 3600,
            "poll_interval_ms": 50,
        },
        breaker={"enabled": False},
        ordering=s.ordering,
        fault_injection=True,
        http={"enabled": False},
        max_in_flight=10_000,
        max_in_flight_per_partition=10_000,
        log_format="console",
        log_level="ERROR",
    )


@dataclass(frozen=True)
class Measured:
    rate: float  # records/s of the unblocked keys, first to last effect
    p50_ms: float
    p99_ms: float
    parked: int  # delay-queue items at the end: failing heads and the records behind them


async def run_once(
    bootstrap: str,
    redis_url: str,
    topic: str,
    group: str,
    s: Scenario,
    records: list[Record],
    measured: int,
    rate: float | None,
) -> Measured:
    """One worker over one topic with a fresh group and key prefix; produced live if rated."""
    settings = settings_for(bootstrap, redis_url, topic, group, s)
    await create_topics(
        bootstrap, {settings.outcomes_topic() or "": 6, settings.dead_letter_topic(topic): 1}
    )
    registry = Registry([chained if s.chains else unchained], settings.topics)
    worker = Worker(settings, registry, metrics=Metrics())
    task = asyncio.create_task(worker.run())
    prefix = settings.redis.effective_prefix
    stream = f"{prefix}:chained:done"
    client = aioredis.from_url(redis_url)
    try:
        deadline = time.monotonic() + WAIT_S
        producing = None
        if rate:  # live: produce once the worker holds its partitions, not into a join
            while worker.health.assigned_partitions < 6:
                if task.done():
                    task.result()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{s.label}: the worker never held every partition")
                await asyncio.sleep(0.05)
            producing = asyncio.create_task(produce(bootstrap, topic, records, rate))
        while await client.xlen(stream) < measured:
            if task.done():
                task.result()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{s.label}: {await client.xlen(stream)} of {measured} done")
            await asyncio.sleep(0.05)
        if producing is not None:
            await producing
        entries = cast(list[Any], await client.xrange(stream))
        parked = int(await client.hlen(f"{prefix}:retry:items"))
    finally:
        worker.request_stop()
        await task
        await client.aclose()
    stamps = [int(entry_id.split(b"-")[0]) for entry_id, _ in entries]
    latencies = sorted(
        ms - int(fields[b"t"]) for ms, (_, fields) in zip(stamps, entries, strict=True)
    )
    span_s = max(stamps[-1] - stamps[0], 1) / 1000
    return Measured(
        rate=(len(stamps) - 1) / span_s,
        p50_ms=_quantile(latencies, 0.50),
        p99_ms=_quantile(latencies, 0.99),
        parked=parked,
    )


def _quantile(sorted_values: list[int], q: float) -> float:
    return float(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))])


@dataclass
class Row:
    scenario: Scenario
    backlog: list[Measured] = field(default_factory=list)
    live: list[Measured] = field(default_factory=list)

    def rate(self) -> float:
        return statistics.median(m.rate for m in self.backlog)

    def spread(self) -> str:
        rates = [m.rate for m in self.backlog]
        return f"{min(rates):,.0f} to {max(rates):,.0f}"


def main(keys: int, per_key: int, rounds: int, rate: float, live_keys: int) -> None:
    console = Console() if sys.stdout.isatty() else Console(width=140)
    rows = [Row(s) for s in SCENARIOS]
    with tempfile.TemporaryDirectory() as tmp:
        broker = TansuBroker(Path(tmp) / "kafka").start()
        redis_server = RedisServer(Path(tmp) / "redis").start()
        bootstrap, redis_url = broker.bootstrap, redis_server.url
        try:
            backlogs = []
            for i, row in enumerate(rows):
                records, measured = make_records(row.scenario, keys, per_key, seed=i)
                topic = f"chains-{i}"
                asyncio.run(create_topics(bootstrap, {topic: 6}))
                asyncio.run(produce(bootstrap, topic, records, None))
                backlogs.append((topic, records, measured))
                blocked = len(records) - measured
                console.print(
                    f"{row.scenario.label}: {len(records):,} records, {measured:,} of "
                    f"unblocked keys, {blocked:,} of blocked keys"
                )
            for n in range(rounds):
                for i, row in enumerate(rows):
                    topic, records, measured = backlogs[i]
                    group = f"{topic}-r{n}"
                    row.backlog.append(
                        runtime.run(
                            run_once(
                                bootstrap,
                                redis_url,
                                topic,
                                group,
                                row.scenario,
                                records,
                                measured,
                                None,
                            )
                        )
                    )
                    live, live_measured = make_records(row.scenario, live_keys, per_key, seed=i)
                    live_topic = f"chains-{i}-live-{n}"
                    asyncio.run(create_topics(bootstrap, {live_topic: 6}))
                    row.live.append(
                        runtime.run(
                            run_once(
                                bootstrap,
                                redis_url,
                                live_topic,
                                f"{live_topic}-g",
                                row.scenario,
                                live,
                                live_measured,
                                rate,
                            )
                        )
                    )
                done = ", ".join(f"{r.backlog[-1].rate:,.0f}" for r in rows)
                console.print(f"round {n + 1}/{rounds} (records/s of unblocked keys): {done}")
        finally:
            redis_server.stop()
            broker.stop()
    base = rows[BASE].rate()
    table = Table(
        title=f"{keys:,} keys x {per_key} records (blocked keys: a failing head + N), "
        f"6 partitions, Tansu + Redis (AOF always): medians of {rounds} rounds"
    )
    for column in (
        "scenario",
        "records/s, unblocked keys",
        "range",
        "vs row 3",
        f"p50 ms at {rate:,.0f}/s",
        "p99 ms",
        "parked at end",
    ):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for row in rows:
        table.add_row(
            row.scenario.label,
            f"{row.rate():,.0f}",
            row.spread(),
            f"{row.rate() / base:.2f}",
            f"{statistics.median(m.p50_ms for m in row.live):,.0f}",
            f"{statistics.median(m.p99_ms for m in row.live):,.0f}",
            f"{row.backlog[-1].parked:,}",
        )
    console.print(table)
    console.print(
        "records/s: first to last effect of the unblocked keys' records, from a backlog; "
        f"p50/p99: produce timestamp to effect, {live_keys:,} keys produced live at "
        f"{rate:,.0f} records/s; parked at end: the failing heads and the records behind them"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--per-key", type=int, default=4, help="records of an unblocked key")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2000.0, help="records/s, live phase")
    parser.add_argument("--live-keys", type=int, default=1000, help="keys in the live phase")
    args = parser.parse_args()
    main(args.keys, args.per_key, args.rounds, args.rate, args.live_keys)
