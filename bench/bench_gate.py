"""What the sharded gate costs Redis per record, against today's claim and finish.

docs/redis-cluster.md ("Cost"): today a batch is one FINISH call (effects-only handlers) or
CLAIM plus FINISH, on one Redis. With the sharded layout every record takes the gate:
RESERVE, FINISH_ORDER and CLOSE, each one script call per shard the batch touches, sent as
one pipeline per node. The worker does not take the gate yet, so its Redis side is driven
here directly, through the engine's own classes, over N records in batches of B with C
batches under way at once:

  1. today, effects-only: ``Idempotency.finish_many`` alone, one Redis;
  2. today, claimed: ``claim_many`` then ``finish_many``, one Redis;
  3. the sharded gate, S shards, on one Redis (``SingleNodeCaller``): ``reserve_many`` then
     ``finish_many`` (FINISH_ORDER, then CLOSE);
  4. the same on a cluster of 3 primaries without replicas (``ClusterCaller``);
  5. (``--with-replicas``) the same on 3 primaries with a replica each.

Every record has a dedupe key of its own and one effect: an HINCRBY of its id by 1 in a
ledger hash, the service prefix's for today's runs and its order shard's for the gate's.
No chains and no emissions: what is measured is the gate and the marker, not the rest of
FINISH. Figures per scenario, each the median of ``--rounds`` (the scenarios take turns
within a round, so a slow minute of the shared machine lands on all of them):

  - records/s: N over the run's wall time, the client's own work included (one process on
    the same machine drives Redis, as a worker would);
  - Redis CPU µs per record: used_cpu_sys + used_cpu_user of INFO cpu, summed over every
    node of the scenario (replicas too), their change over the run, per record;
  - client CPU µs per record: this process's CPU time over the run, per record (on two
    cores the client's work and Redis's share them, so records/s follows their sum);
  - script calls, pipelines and round trips per batch: counted as they leave the client
    (commands sent alone, pipelines executed, a cluster node's pipelines), and the script
    calls checked against Redis's own count of EVALSHA calls.

A run counts only if its ledger, read back, holds every record's id exactly once, with 1,
in the ledger its record names (and, for the gate, no reservation is left open): a run
that lost or doubled a record stops the bench with the discrepancy and no figure.

Servers: redis-server with AOF ``appendfsync always``, as the suite's. Between runs every
node is flushed and its AOF rewritten; the automatic rewrite is off, so no run pays for
a rewrite that another one escaped.

    python -m bench.bench_gate                          # 100k records, 3 rounds: ~80 s
    python -m bench.bench_gate --quick --json           # 10k records, 1 round: does it run?
    python -m bench.bench_gate --with-replicas --shards 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import redis
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.redis.sharded.layout import ShardLayout
from rich.console import Console
from rich.table import Table

from bench.gate_drivers import PREFIX, Counts, Driver, Gate, Record, Today, Unexpected

QUICK_RECORDS = 10_000
SETTLE_S = 120.0  # deadline of a flush and AOF rewrite between runs
# No automatic AOF rewrite: one started by a run's writes would share the two cores with
# that run and not the others. The bench rewrites between runs instead.
SERVER_CONFIG = {"auto-aof-rewrite-percentage": "0"}

Servers = Literal["redis", "cluster", "replicas"]


class NotExactlyOnce(RuntimeError):
    """A run lost, doubled or misplaced a record's effect: none of its figures stand."""


class MiscountedCalls(RuntimeError):
    """The script calls counted leaving the client are not the calls Redis ran."""


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    kind: Literal["finish", "claim", "gate"]
    servers: Servers


def scenarios(shards: int, with_replicas: bool) -> list[Scenario]:
    out = [
        Scenario("1", "1. today, effects-only: FINISH, 1 Redis", "finish", "redis"),
        Scenario("2", "2. today, claimed: CLAIM + FINISH, 1 Redis", "claim", "redis"),
        Scenario("3", f"3. gate, S={shards}, 1 Redis", "gate", "redis"),
        Scenario("4", f"4. gate, S={shards}, cluster 3 primaries", "gate", "cluster"),
    ]
    if with_replicas:
        out.append(
            Scenario(
                "5", f"5. gate, S={shards}, cluster 3 primaries + 3 replicas", "gate", "replicas"
            )
        )
    return out


# --- the servers of a scenario -----------------------------------------------------------------


def _admin(node: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=30.0)


@dataclass
class Nodes:
    """Every node a scenario writes to: their CPU, their EVALSHA count, and a clean slate."""

    url: str
    members: list[RedisServer]
    cluster: RedisCluster | None = None

    def cpu_s(self) -> float:
        total = 0.0
        for node in self.members:
            with _admin(node) as client:
                cpu = client.info("cpu")
            total += float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
        return total

    def script_calls(self) -> int:
        total = 0
        for node in self.members:
            with _admin(node) as client:
                stats = client.info("commandstats")
            total += sum(
                int(stats.get(f"cmdstat_{name}", {}).get("calls", 0))
                for name in ("evalsha", "eval")
            )
        return total

    def reset(self) -> None:
        """Flush every primary (its replicas with it), then rewrite every node's AOF, so each
        run starts on an empty data set and a short AOF."""
        primaries = self.cluster.primaries() if self.cluster else self.members
        for node in primaries:
            with _admin(node) as client:
                client.flushall()
                replicas = int(client.info("replication")["connected_slaves"])
                if replicas and int(client.execute_command("WAIT", replicas, 30_000)) < replicas:
                    raise RuntimeError(f"redis node {node.port}: its replicas missed the flush")
        for node in self.members:
            with _admin(node) as client:
                client.bgrewriteaof()
        deadline = time.monotonic() + SETTLE_S
        for node in self.members:
            with _admin(node) as client:
                while True:
                    state = client.info("persistence")
                    if not int(state["aof_rewrite_in_progress"]) and not int(
                        state["aof_rewrite_scheduled"]
                    ):
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis node {node.port}: AOF rewrite still running")
                    time.sleep(0.02)


# --- one run ------------------------------------------------------------------------------------


def check_ledger(records: Sequence[Record], found: Mapping[str, Mapping[bytes, bytes]]) -> int:
    """How many records were granted, once it is certain each was granted exactly once: its
    id in the ledger its record names, with 1, and in no other ledger; nothing else there.
    NotExactlyOnce otherwise, saying how many were lost, doubled, misplaced or stray."""
    where = {r.id.encode(): r.ledger for r in records}
    seen: dict[bytes, int] = {}
    doubled = misplaced = stray = 0
    for ledger, entries in found.items():
        for id_, value in entries.items():
            if id_ not in where:
                stray += 1
                continue
            seen[id_] = seen.get(id_, 0) + 1
            if value != b"1":
                doubled += 1
            if where[id_] != ledger:
                misplaced += 1
    doubled += sum(1 for n in seen.values() if n > 1)
    lost = len(where) - len(seen)
    if lost or doubled or misplaced or stray:
        raise NotExactlyOnce(
            f"of {len(where):,} records: {lost:,} lost, {doubled:,} doubled, "
            f"{misplaced:,} in another ledger than their own, {stray:,} ids nobody sent"
        )
    return len(where)


@dataclass(frozen=True)
class Run:
    records: int
    batches: int
    wall_s: float
    cpu_s: float  # Redis's, every node's
    client_cpu_s: float  # this process's, the loops driving Redis
    counts: Counts
    granted: int  # records granted exactly once (check_ledger)

    @property
    def rate(self) -> float:
        return self.records / self.wall_s

    @property
    def cpu_us_per_record(self) -> float:
        return self.cpu_s * 1e6 / self.records

    @property
    def client_cpu_us_per_record(self) -> float:
        return self.client_cpu_s * 1e6 / self.records

    def per_batch(self, what: str) -> float:
        value: int = getattr(self.counts, what)
        return value / self.batches


async def drive(
    records: Sequence[Record],
    batch: int,
    concurrency: int,
    step: Callable[[Sequence[Record]], Awaitable[None]],
) -> float:
    """``concurrency`` loops each taking the next batch until none is left; the wall time."""
    batches: Iterator[Sequence[Record]] = (
        records[at : at + batch] for at in range(0, len(records), batch)
    )

    async def loop() -> None:
        for one in batches:  # one generator shared by the loops: each batch taken once
            await step(one)

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return time.perf_counter() - started


async def run_once(
    driver: Driver, nodes: Nodes, run: str, records: int, batch: int, concurrency: int
) -> Run:
    """One measured run over fresh keys; its ledger checked, then the nodes reset."""
    plan = driver.plan(run, records)
    counted = driver.counts.copy()
    cpu, calls = nodes.cpu_s(), nodes.script_calls()
    client = time.process_time()
    wall = await drive(plan, batch, concurrency, driver.batch)
    client = time.process_time() - client
    cpu, calls = nodes.cpu_s() - cpu, nodes.script_calls() - calls
    counts = driver.counts.since(counted)
    granted = check_ledger(plan, await driver.ledgers({r.ledger for r in plan}))
    left = await driver.left_open()
    if left:
        raise NotExactlyOnce(f"{left:,} reservations left open after every record finished")
    if counts.scripts != calls:
        raise MiscountedCalls(
            f"{counts.scripts:,} script calls counted leaving the client, {calls:,} run by Redis"
        )
    nodes.reset()
    return Run(records, -(-records // batch), wall, cpu, client, counts, granted)


# --- the bench ----------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: Scenario
    runs: list[Run] = field(default_factory=list)

    def median(self, figure: Callable[[Run], float]) -> float:
        return statistics.median(figure(r) for r in self.runs)

    def figures(self) -> dict[str, Any]:
        rates = [r.rate for r in self.runs]
        return {
            "scenario": self.scenario.key,
            "label": self.scenario.label,
            "records_per_s": round(self.median(lambda r: r.rate), 1),
            "records_per_s_range": [round(min(rates), 1), round(max(rates), 1)],
            "redis_cpu_us_per_record": round(self.median(lambda r: r.cpu_us_per_record), 2),
            "client_cpu_us_per_record": round(self.median(lambda r: r.client_cpu_us_per_record), 2),
            "script_calls_per_batch": round(self.median(lambda r: r.per_batch("scripts")), 2),
            "pipelines_per_batch": round(self.median(lambda r: r.per_batch("pipelines")), 2),
            "round_trips_per_batch": round(self.median(lambda r: r.per_batch("round_trips")), 2),
            "granted_exactly_once": [r.granted for r in self.runs],
            "runs": [
                {
                    "wall_s": round(r.wall_s, 3),
                    "redis_cpu_s": round(r.cpu_s, 3),
                    "client_cpu_s": round(r.client_cpu_s, 3),
                    **asdict(r.counts),
                }
                for r in self.runs
            ],
        }


@dataclass(frozen=True)
class Options:
    records: int
    batch: int
    concurrency: int
    shards: int
    rounds: int
    with_replicas: bool


async def measure(
    options: Options, nodes: Mapping[Servers, Nodes], progress: Callable[[str], None]
) -> list[Row]:
    """Every scenario once per round, in turn; a warm-up run of each first (scripts loaded,
    connections open, code paths warm), checked like the others and not counted."""
    rows = [Row(s) for s in scenarios(options.shards, options.with_replicas)]
    drivers: dict[str, Driver] = {}
    try:
        for row in rows:
            s = row.scenario
            if s.kind == "gate":
                gate = Gate(nodes[s.servers].url, s.servers != "redis", options.shards)
                drivers[s.key] = gate
                await gate.start()
            else:
                drivers[s.key] = Today(nodes[s.servers].url, s.kind == "claim", options.batch)
        warm = min(options.records, options.batch * options.concurrency)
        for row in rows:
            s = row.scenario
            await run_once(
                drivers[s.key], nodes[s.servers], "warm", warm, options.batch, options.concurrency
            )
        progress(f"warmed up: {warm:,} records through each scenario")
        for n in range(options.rounds):
            for row in rows:
                s = row.scenario
                row.runs.append(
                    await run_once(
                        drivers[s.key],
                        nodes[s.servers],
                        f"r{n}",
                        options.records,
                        options.batch,
                        options.concurrency,
                    )
                )
            done = ", ".join(f"{r.runs[-1].rate:,.0f}" for r in rows)
            progress(f"round {n + 1}/{options.rounds} (records/s): {done}")
    finally:
        for driver in drivers.values():
            await driver.aclose()
    return rows


def render(options: Options, rows: Sequence[Row]) -> Table:
    table = Table(
        title=f"{options.records:,} records, batches of {options.batch}, {options.concurrency} "
        f"at once, one HINCRBY each; redis-server AOF always: medians of {options.rounds} "
        "interleaved rounds"
    )
    columns = (
        "scenario",
        "records/s",
        "range",
        "Redis CPU µs/record",
        "client CPU µs/record",
        "script calls/batch",
        "pipelines/batch",
        "round trips/batch",
        "granted once",
    )
    for column in columns:
        if column == "scenario":
            table.add_column(column, no_wrap=True)  # the test finds each row by its label
        else:
            table.add_column(column, justify="right")
    for row in rows:
        f = row.figures()
        low, high = f["records_per_s_range"]
        table.add_row(
            row.scenario.label,
            f"{f['records_per_s']:,.0f}",
            f"{low:,.0f} to {high:,.0f}",
            f"{f['redis_cpu_us_per_record']:,.1f}",
            f"{f['client_cpu_us_per_record']:,.1f}",
            f"{f['script_calls_per_batch']:,.1f}",
            f"{f['pipelines_per_batch']:,.1f}",
            f"{f['round_trips_per_batch']:,.1f}",
            f"{min(f['granted_exactly_once']):,}",
        )
    return table


SUMMARY = (
    "records/s: records over the run's wall time, this process's work included; Redis CPU: "
    "used_cpu_sys + used_cpu_user over every node of the scenario (replicas too), per record; "
    "client CPU: this process's over the run, per record; "
    "script calls (checked against Redis's EVALSHA count), pipelines and round trips: counted "
    "leaving the client, per batch (today's calls go alone, not in a pipeline); granted once: "
    "records whose id the ledger read back holds exactly once, in its own ledger (every run)"
)


def parse(argv: Sequence[str]) -> tuple[Options, bool]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_gate", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--records", type=int, default=100_000, help="records per run (N)")
    parser.add_argument("--batch", type=int, default=500, help="records per batch (B)")
    parser.add_argument("--concurrency", type=int, default=4, help="batches under way (C)")
    parser.add_argument("--shards", type=int, default=64, help="the gate's shards (S)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--with-replicas", action="store_true", help="also: the cluster with a replica each"
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_RECORDS:,} records, 1 round: does it run?"
    )
    parser.add_argument("--json", action="store_true", help="also print the figures as a JSON line")
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.rounds = QUICK_RECORDS, 1
    for name in ("records", "batch", "concurrency", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: at least 1")
    try:
        ShardLayout(PREFIX, args.shards)
    except ValueError as exc:
        parser.error(f"--shards: {exc}")
    options = Options(
        args.records, args.batch, args.concurrency, args.shards, args.rounds, args.with_replicas
    )
    return options, args.json


def main(argv: Sequence[str]) -> int:
    options, as_json = parse(argv)
    console = Console() if sys.stdout.isatty() else Console(width=200)

    def progress(line: str) -> None:
        console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {line}")

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        single = RedisServer(Path(tmp) / "redis", extra_config=SERVER_CONFIG).start()
        servers.callback(single.stop)
        nodes: dict[Servers, Nodes] = {"redis": Nodes(single.url, [single])}
        clusters: list[tuple[Servers, int]] = [("cluster", 0)]
        if options.with_replicas:
            clusters.append(("replicas", 1))
        for name, replicas in clusters:
            cluster = RedisCluster(
                Path(tmp) / name, 3, replicas, extra_config=SERVER_CONFIG
            ).start()
            servers.callback(cluster.stop)
            nodes[name] = Nodes(cluster.urls[0], list(cluster.nodes), cluster)
        progress(
            "servers up: " + ", ".join(f"{k} ({len(v.members)} node(s))" for k, v in nodes.items())
        )
        try:
            rows = asyncio.run(measure(options, nodes, progress))
        except (NotExactlyOnce, MiscountedCalls, Unexpected) as exc:
            console.print(f"[red]no figures[/]: {type(exc).__name__}: {exc}")
            return 1
    console.print(render(options, rows))
    console.print(SUMMARY)
    if as_json:
        line = {
            "bench": "gate",
            "options": asdict(options),
            "scenarios": [r.figures() for r in rows],
        }
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
