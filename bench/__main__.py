"""All the bench rows in one run: ``python -m bench`` (see docs/performance.md).

Each group of rows measures once per round and the rounds interleave the groups, so a
slow minute on the shared machine lands in one round of every group rather than in all
rounds of one. Every row reports its figures' medians and ranges in one rich table, and
``--json FILE`` writes the same figures with the command and the machine.

    python -m bench                                  # every group, 3 rounds, Apache Kafka
    python -m bench --rows latency,retries --rounds 5 --json bench.json
    python -m bench --quick                          # small sizes: does everything run?
    python -m bench --rows memory --rounds 1 --memory-records 5000000   # a long drain
    python -m bench --rows latency,throughput --baseline main --stages   # before/after
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, get_args

from bench.baseline import KEY_LAYOUT_MODULE, Baseline
from bench.report import Progress, Row, console, table, write_json
from bench.stack import BenchStack, BrokerKind, RedisDurability, RedisKind


@dataclass(frozen=True)
class Options:
    """What every group is told: how many rounds, and whether to run at small sizes."""

    rounds: int
    quick: bool
    memory_records: int | None = None  # the memory row's backlog, when not its default
    memory_variants: tuple[str, ...] | None = None  # the memory row's variants (default: all)
    retries_parked: int | None = None  # the retries row's parked items, when not its default
    # Another revision's engine, measured beside this one's in the same rounds (the
    # latency and throughput groups' `service run` rows).
    baseline: Baseline | None = None
    stages: bool = False  # the latency row splits each record's time by stage
    throughput_rows: str = "all"  # "payments": only rows 1 and 2 (and 2 at the baseline)
    latency_rates: tuple[int, ...] | None = None  # the latency row's offered rates (default: all)
    retries_variants: tuple[str, ...] | None = None  # the retries row's runs (default: all)


class Group(Protocol):
    """Rows measured together, once per round (each measurement on a fresh event loop)."""

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        """Once per run before the first round: topics, records produced, etc."""

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        """Measure every row of the group once, appending one value per figure."""

    def rows(self) -> list[Row]: ...

    def summary(self) -> list[str]:
        """Lines printed under the table: what each figure is and what bounds it."""
        ...


# Group name -> "module:class"; imported only when run (FastStream is an optional extra).
GROUPS: dict[str, str] = {
    "throughput": "bench.bench_worker:ThroughputGroup",
    "latency": "bench.latency:LatencyGroup",
    "retries": "bench.retry_punctuality:RetryPunctualityGroup",
    "recovery": "bench.recovery:RecoveryGroup",
    "memory": "bench.memory:MemoryGroup",
    "outcomes": "bench.bench_outcomes:OutcomesGroup",
    "outbox": "bench.bench_outbox:OutboxGroup",
    "effects": "bench.bench_effects:EffectsGroup",
}


def load(name: str, options: Options) -> Group:
    module, cls = GROUPS[name].split(":")
    group: Group = getattr(importlib.import_module(module), cls)(options)
    return group


def _names(listed: str | None) -> tuple[str, ...] | None:
    """A comma-separated option's names; None when not given (every one)."""
    if not listed:
        return None
    return tuple(v.strip() for v in listed.split(",") if v.strip())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    choices = ", ".join(GROUPS)
    parser.add_argument(
        "--rows", default=",".join(GROUPS), help=f"groups to run, comma-separated ({choices})"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", choices=get_args(BrokerKind), default="kafka")
    parser.add_argument(
        "--redis",
        choices=get_args(RedisKind),
        default="single",
        help="one redis-server, or a Redis Cluster with WORKER_REDIS__CLUSTER=true (only "
        "with --rows throughput --throughput-rows payments)",
    )
    parser.add_argument(
        "--redis-durability",
        choices=get_args(RedisDurability),
        default="local",
        help="WORKER_REDIS__DURABILITY of the service runs (wait_replicas only with --redis "
        "cluster, which has a replica; not local only with --rows throughput "
        "--throughput-rows payments)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, to check it runs")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument(
        "--memory-records",
        type=int,
        metavar="N",
        help="the backlog the memory row drains (default 1,000,000; 50,000 with --quick)",
    )
    parser.add_argument(
        "--memory-variants",
        metavar="A,B",
        help="the memory row's variants, comma-separated (default: all of bench/memory.py)",
    )
    parser.add_argument(
        "--retries-variants",
        metavar="A,B",
        help="the retries row's runs, comma-separated (default: all of bench/retry_punctuality.py)",
    )
    parser.add_argument(
        "--retries-parked",
        type=int,
        metavar="N",
        help="retries parked for the retries row: its 100,000 (5,000 with --quick) fall due "
        "in the measured minute as always, the rest a day later (default: none more)",
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also measure the engine of git revision REV in the same rounds (the latency "
        "and throughput rows of `service run`; the retries row's run 'before'; the effects "
        "rows' postgres store, in a child process)",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="latency: split each record's time by stage (bench/latency_probe.py)",
    )
    parser.add_argument(
        "--throughput-rows",
        choices=("all", "payments"),
        default="all",
        help="throughput: every row, or only the raw loops and the payments rows",
    )
    parser.add_argument(
        "--latency-rates",
        metavar="R,S",
        help="latency: the offered rates, comma-separated (default 1000,10000)",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(GROUPS)}")
    if args.redis == "cluster" and (names != ["throughput"] or args.throughput_rows != "payments"):
        # The other rows' own clients and in-process workers take one Redis.
        parser.error("--redis cluster: only with --rows throughput --throughput-rows payments")
    if args.redis_durability != "local" and (
        names != ["throughput"] or args.throughput_rows != "payments"
    ):
        # Only `service run` takes the stack's environment; the other rows build their own.
        parser.error("--redis-durability: only with --rows throughput --throughput-rows payments")
    if args.redis_durability == "wait_replicas" and args.redis != "cluster":
        # The single redis-server has no replica: every wait would hold until its timeout.
        parser.error("--redis-durability wait_replicas: only with --redis cluster")
    if args.memory_records is not None and args.memory_records < 1_000:
        parser.error("--memory-records: at least 1,000 (its deciles need records to count)")
    baseline_rev = Baseline(args.baseline) if args.baseline else None
    if baseline_rev is not None and baseline_rev.predates_key_layout():
        parser.error(
            f"--baseline {args.baseline} ({baseline_rev.commit}): that engine writes its Redis "
            "keys as <prefix>:..., from before the {<prefix>}:... layout the bench reads; "
            "its rows would measure nothing comparable. Choose a revision that has "
            f"{KEY_LAYOUT_MODULE}"
        )
    with contextlib.ExitStack() as exits:
        baseline = exits.enter_context(baseline_rev) if baseline_rev is not None else None
        options = Options(
            rounds=args.rounds,
            quick=args.quick,
            memory_records=args.memory_records,
            memory_variants=_names(args.memory_variants),
            retries_parked=args.retries_parked,
            retries_variants=_names(args.retries_variants),
            baseline=baseline,
            stages=args.stages,
            throughput_rows=args.throughput_rows,
            latency_rates=(
                tuple(int(r) for r in args.latency_rates.split(",")) if args.latency_rates else None
            ),
        )
        return run(args, argv, names, options)


def run(args: argparse.Namespace, argv: list[str], names: list[str], options: Options) -> int:
    """Every round of the chosen groups on one stack of servers; the table at the end."""
    out = console()
    groups = {name: load(name, options) for name in names}
    started = time.time()

    def progress(line: str) -> None:
        out.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {line}")

    with BenchStack(args.broker, args.redis, args.redis_durability) as stack:
        progress(f"servers up: {stack.description}")
        for name, group in groups.items():
            progress(f"{name}: preparing")
            group.prepare(stack, progress)
        for n in range(args.rounds):
            for name, group in groups.items():
                progress(f"round {n + 1}/{args.rounds}: {name}")
                group.round(stack, n, progress)
        description = stack.description
    rows = [row for group in groups.values() for row in group.rows()]
    title = f"{description}: medians of {args.rounds} interleaved rounds"
    out.print(table(title, rows))
    for group in groups.values():
        for line in group.summary():
            out.print(line)
    if args.json:
        write_json(args.json, [sys.executable, "-m", "bench", *argv], started, rows)
        out.print(f"figures written to {args.json}")
    missed = [(row.label, t.figure) for row in rows for t, _, met in row.verdicts() if not met]
    if missed:
        out.print(f"targets missed: {missed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
