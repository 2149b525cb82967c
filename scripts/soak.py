"""Soak: the chaos suite's machinery for long runs, with its figures at the end.

Starts its own broker (Tansu, or with `--broker kafka` Apache Kafka: 1 node, or 3 with
`--kafka-nodes 3`) and Redis (AOF, appendfsync always) in a temporary directory, runs
one chaos run (tests/chaos/runs.py) of the size given on the command
line, and prints: records, kills, SIGTERMs, Redis restarts, rebalances, lost, doubled,
dead-lettered by reason, duration and throughput; and each worker process's RSS (every
second, beside the payments ledger's length): first, peak and last, and its growth in MB
per million records over the second half of its life. Exit code 1 when a record was lost
(a valid payment never granted, or an expected dead letter missing) or a payment was
granted twice, 3 when another invariant broke or the run aborted, 2 for a bad option or
a broker that cannot run here (no Java or Maven for `--broker kafka`), 4 when a worker's
RSS grew faster than `--max-rss-growth` (or none lived long enough to tell), 0 when all
held.

    .venv/bin/python scripts/soak.py --broker kafka --records 50000 --kills 10 \\
        --redis-restarts 2 --scale-cycles 1 --seed 42

Same seed, same records and the same fault plan (see docs/chaos.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/soak.py` from anywhere
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import redis as redis_client  # noqa: E402
import typer  # noqa: E402
from reliable_consumer.dev.servers.apache_kafka import ApacheKafkaCluster, available  # noqa: E402
from reliable_consumer.dev.servers.broker import Broker  # noqa: E402
from reliable_consumer.dev.servers.redis_server import RedisServer  # noqa: E402
from reliable_consumer.dev.servers.tansu import TansuBroker  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from tests.chaos.outside import ledger_key  # noqa: E402
from tests.chaos.runs import (  # noqa: E402
    SEED_ENV,
    ChaosConfig,
    ChaosMix,
    ChaosReport,
    chaos_settings,
    run_chaos,
    seed_from_env,
    source_partitions,
)

from bench.rss import MIN_GRANTS_FOR_GROWTH, Incarnation, Point  # noqa: E402

EXIT_LOST_OR_DOUBLED = 1
EXIT_UNUSABLE = 2  # a bad option (typer's own code for those), or the broker cannot run here
EXIT_OTHER_INVARIANT = 3
EXIT_MEMORY_GROWTH = 4
# How often each worker's RSS is sampled, and the command line that marks a chaos worker.
RSS_EVERY_S = 1.0
WORKER_MODULE = "tests.chaos.worker_main"
BROKERS = ("tansu", "kafka")
# Apache Kafka refuses a JoinGroup below group.min.session.timeout.ms (6 s by default).
KAFKA_MIN_SESSION_MS = 6_000

console = Console(highlight=False, soft_wrap=True)
app = typer.Typer(add_completion=False, help=__doc__.split("\n\n")[0] if __doc__ else None)


@app.command()
def main(
    broker: Annotated[
        str,
        typer.Option(
            help="tansu (embedded, in memory) or kafka (Apache Kafka 4.x in KRaft mode; "
            "needs Java 17+, and Maven for the first fetch of its jars)"
        ),
    ] = "tansu",
    kafka_nodes: Annotated[
        int,
        typer.Option(
            help="--broker kafka: 1 node, or 3 (every topic replication factor 3, "
            "min.insync.replicas 2)"
        ),
    ] = 1,
    records: Annotated[int, typer.Option(min=100, help="source records to produce")] = 50_000,
    partitions: Annotated[int, typer.Option(min=1, help="partitions of the payments topic")] = 6,
    kills: Annotated[int, typer.Option(min=0, help="SIGKILLs of a worker")] = 10,
    sigterms: Annotated[int, typer.Option(min=0, help="SIGTERMs during a busy batch")] = 2,
    redis_restarts: Annotated[int, typer.Option(min=0, help="Redis kill + restart")] = 2,
    scale_cycles: Annotated[int, typer.Option(min=0, help="1 -> 3 -> 1 scalings")] = 1,
    layout: Annotated[
        str, typer.Option(help="shuffled, or crowded: faults while three workers run")
    ] = "shuffled",
    seed: Annotated[
        int | None, typer.Option(help=f"default: ${SEED_ENV}, else random (printed)")
    ] = None,
    transient: Annotated[float, typer.Option(min=0, max=1)] = 0.10,
    permanent: Annotated[float, typer.Option(min=0, max=1)] = 0.02,
    malformed: Annotated[float, typer.Option(min=0, max=1)] = 0.02,
    duplicate: Annotated[float, typer.Option(min=0, max=1)] = 0.04,
    hang: Annotated[float, typer.Option(min=0, max=1, help="handler never returns")] = 0.002,
    max_transient_failures: Annotated[int, typer.Option(min=1, max=3)] = 2,
    claimed_share: Annotated[
        float,
        typer.Option(min=0, max=1, help="share of records for the claiming handler's topic"),
    ] = 0.25,
    claimed_partitions: Annotated[int, typer.Option(min=1)] = 3,
    ahead: Annotated[int, typer.Option(min=1, help="producer lead over the ledger")] = 2000,
    chunk: Annotated[int, typer.Option(min=1, help="records per produce batch")] = 500,
    redis_failures: Annotated[
        tuple[int, int],
        typer.Option(
            help="per outage, one Redis call of each worker is retried this often (seeded range)"
        ),
    ] = (8, 16),
    sigterm_mid_rebalance: Annotated[
        bool,
        typer.Option(help="SIGTERM workers even while the group rebalances (see docs/chaos.md)"),
    ] = False,
    scale_down_at_once: Annotated[
        bool, typer.Option(help="SIGTERM the leavers of a scale-down together (docs/chaos.md)")
    ] = False,
    session_timeout_ms: Annotated[
        int, typer.Option(min=1000, help=f"Apache Kafka refuses less than {KAFKA_MIN_SESSION_MS}")
    ] = KAFKA_MIN_SESSION_MS,
    step_timeout_s: Annotated[float, typer.Option(min=10, help="deadline of each wait")] = 180.0,
    settle_timeout_s: Annotated[float, typer.Option(min=10)] = 300.0,
    work_dir: Annotated[
        Path | None, typer.Option(help="default: a temporary directory, removed on success")
    ] = None,
    keep: Annotated[bool, typer.Option(help="keep the work directory (logs) on success")] = False,
    json_out: Annotated[Path | None, typer.Option(help="also write the figures as JSON")] = None,
    max_rss_growth: Annotated[
        float | None,
        typer.Option(
            help="fail (exit 4) when a worker's RSS grew faster than this, in MB per million "
            f"records over the second half of its life (judged for workers that lived through "
            f"{MIN_GRANTS_FOR_GROWTH:,} grants or more)"
        ),
    ] = None,
) -> None:
    """Run one long chaos run and print its figures; non-zero exit when anything broke."""
    if layout not in ("shuffled", "crowded"):
        raise typer.BadParameter("shuffled or crowded", param_hint="--layout")
    if ahead * 10 > records:
        # Production holds `ahead` records back until the last fault fired, whose threshold
        # may be at 85 % of the run: a larger lead can leave it unreachable (the run hangs).
        raise typer.BadParameter(
            f"at most a tenth of --records ({records // 10})", param_hint="--ahead"
        )
    if broker not in BROKERS:
        raise typer.BadParameter(" or ".join(BROKERS), param_hint="--broker")
    if kafka_nodes not in (1, 3):
        raise typer.BadParameter("1 or 3", param_hint="--kafka-nodes")
    if kafka_nodes != 1 and broker != "kafka":
        raise typer.BadParameter("only with --broker kafka", param_hint="--kafka-nodes")
    if broker == "kafka" and session_timeout_ms < KAFKA_MIN_SESSION_MS:
        raise typer.BadParameter(
            f"Apache Kafka refuses a group join below group.min.session.timeout.ms "
            f"({KAFKA_MIN_SESSION_MS})",
            param_hint="--session-timeout-ms",
        )
    if transient + permanent + malformed > 1:
        raise typer.BadParameter("transient + permanent + malformed must be <= 1")
    cfg = ChaosConfig(
        records=records,
        seed=seed if seed is not None else seed_from_env(),
        partitions=partitions,
        claimed_share=claimed_share,
        claimed_partitions=claimed_partitions,
        kills=kills,
        sigterms=sigterms,
        redis_restarts=redis_restarts,
        scale_cycles=scale_cycles,
        layout="crowded" if layout == "crowded" else "shuffled",
        mix=ChaosMix(
            transient=transient,
            permanent=permanent,
            malformed=malformed,
            duplicate=duplicate,
            hang=hang,
            max_transient_failures=max_transient_failures,
        ),
        ahead=ahead,
        chunk=chunk,
        duplicate_spread=max(1500, ahead),
        redis_failures=(min(redis_failures), max(redis_failures)),
        sigterm_mid_rebalance=sigterm_mid_rebalance,
        scale_down_at_once=scale_down_at_once,
        session_timeout_ms=session_timeout_ms,
        step_timeout_s=step_timeout_s,
        settle_timeout_s=settle_timeout_s,
    )
    if broker == "kafka":
        console.print("checking Apache Kafka (the first use fetches its jars with Maven)")
        reason = available()
        if reason is not None:
            console.print("[bold red]--broker kafka cannot run here:[/]", end=" ")
            console.print(reason, markup=False)
            console.print("(or run on the embedded broker: --broker tansu)")
            raise typer.Exit(EXIT_UNUSABLE)
    own_dir = work_dir is None
    base = Path(tempfile.mkdtemp(prefix="soak-")) if work_dir is None else work_dir
    base.mkdir(parents=True, exist_ok=True)
    shape = f"Apache Kafka, {kafka_nodes} node(s)" if broker == "kafka" else "Tansu"
    console.rule(f"soak, seed {cfg.seed}, {shape}")
    console.print(f"work dir {base}  (reproduce: --seed {cfg.seed})")
    started = time.monotonic()
    report: ChaosReport | None = None
    memory = WorkerMemory()
    try:
        report = asyncio.run(_soak(cfg, base, broker, kafka_nodes, memory))
    except Exception as exc:  # the run could not finish: still say what is known, exit non-zero
        console.print(f"[bold red]the soak aborted:[/] {type(exc).__name__}: {exc}")
        # Where: an abort at the end of a long run is not reproduced in minutes.
        console.print_exception(max_frames=12)
        if memory.incarnations():
            _print_memory(memory.incarnations())
        console.print(f"logs kept in {base}")
        raise typer.Exit(EXIT_OTHER_INVARIANT) from None
    finally:
        console.print(f"wall time {time.monotonic() - started:.1f}s")
    assert report is not None
    _print_figures(report)
    lives = memory.incarnations()
    _print_memory(lives)
    if json_out is not None:
        figures = {**report.figures(), "worker memory": [_memory_figures(i) for i in lives]}
        json_out.write_text(json.dumps(figures, indent=2) + "\n")
    verdict = report.verdict
    if not verdict.ok:
        console.print("[bold red]invariants broken:[/]")
        for problem in verdict.problems:
            console.print(f"  - {problem}", markup=False)
        console.print(f"logs kept in {base}")
        lost_or_doubled = verdict.lost_count or verdict.doubled
        raise typer.Exit(EXIT_LOST_OR_DOUBLED if lost_or_doubled else EXIT_OTHER_INVARIANT)
    console.print("[bold green]every invariant held: lost 0, doubled 0[/]")
    if max_rss_growth is not None:
        problem = _memory_problem(lives, max_rss_growth)
        if problem:
            console.print(f"[bold red]worker memory:[/] {problem}", markup=True)
            console.print(f"logs kept in {base}")
            raise typer.Exit(EXIT_MEMORY_GROWTH)
        console.print(f"[bold green]worker RSS grew under {max_rss_growth:g} MB per million[/]")
    if own_dir and not keep:
        shutil.rmtree(base, ignore_errors=True)
    else:
        console.print(f"logs in {base}")


async def _soak(
    cfg: ChaosConfig, base: Path, kind: str, kafka_nodes: int, memory: WorkerMemory
) -> ChaosReport:
    """Own broker and Redis for the run; both stopped whatever happens. ``memory`` samples
    the workers' RSS from the start of the run to its end (or its abort)."""
    cluster = ApacheKafkaCluster(kafka_nodes, base / "kafka") if kind == "kafka" else None
    broker: Broker = cluster if cluster is not None else TansuBroker(base / "tansu", silent=True)
    redis = RedisServer(base / "redis")
    name = f"soak-{cfg.seed}"
    try:
        await asyncio.to_thread(broker.start)  # a Kafka cluster waits on its own event loop
        redis.start()
        console.print(f"broker {broker.bootstrap}, redis {redis.url}")
        if cluster is not None:
            # Apache Kafka creates no topic on first use. The run creates its topics with
            # replication factor 1 and leaves existing ones alone, so create them first with
            # the cluster's (3 on 3 nodes, min.insync.replicas 2 from the broker default).
            await cluster.create_topics(_topics(cfg, broker.bootstrap, redis.url, name))
        memory.start(redis.url, ledger_key(name))
        try:
            return await run_chaos(
                cfg,
                bootstrap=broker.bootstrap,
                redis=redis,
                name=name,
                work_dir=base / "workers",
                say=lambda line: console.print(f"{time.strftime('%X')} {line}", markup=False),
            )
        finally:
            memory.stop()
    finally:
        redis.stop()
        broker.stop()


class WorkerMemory:
    """Every second, the RSS of each chaos worker (this process's children running
    ``tests.chaos.worker_main``) beside the payments ledger's length, from a thread."""

    def __init__(self) -> None:
        self._lives: dict[int, Incarnation] = {}
        self._granted = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, redis_url: str, ledger: str) -> None:
        client = redis_client.Redis.from_url(redis_url, socket_timeout=2)
        self._thread = threading.Thread(
            target=self._run, args=(client, ledger), name="worker-rss", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def incarnations(self) -> list[Incarnation]:
        """Each worker process seen, in the order they started."""
        return [life for life in self._lives.values() if life.points]

    def _run(self, client: redis_client.Redis, ledger: str) -> None:
        try:
            while not self._stop.wait(RSS_EVERY_S):
                self._sample(client, ledger)
        finally:
            client.close()

    def _sample(self, client: redis_client.Redis, ledger: str) -> None:
        # Redis is down on purpose during a restart: the last length stands.
        with contextlib.suppress(redis_client.RedisError):
            self._granted = int(client.xlen(ledger))
        for proc in psutil.Process().children():
            try:
                if WORKER_MODULE not in proc.cmdline():
                    continue
                rss = proc.memory_info().rss
                life = self._lives.get(proc.pid)
                if life is None:
                    worker = proc.environ().get("WORKER_KAFKA__CLIENT_ID", "?")
                    life = self._lives[proc.pid] = Incarnation(worker, proc.pid)
            except psutil.Error:  # it ended meanwhile (a kill, a SIGTERM)
                continue
            life.points.append(Point(self._granted, rss))


def _memory_figures(life: Incarnation) -> dict[str, object]:
    growth = life.growth()
    return {
        "worker": life.worker,
        "pid": life.pid,
        "granted while it lived": life.granted,
        "first MB": round(life.first_mb, 1),
        "peak MB": round(life.peak_mb, 1),
        "last MB": round(life.last_mb, 1),
        "growth MB per million records": None if growth is None else round(growth, 1),
    }


def _print_memory(lives: list[Incarnation]) -> None:
    table = Table(title="worker RSS (each process from its start to its end)")
    for column in ("worker", "pid", "granted", "first MB", "peak MB", "last MB", "MB/M rec"):
        table.add_column(column, justify="left" if column == "worker" else "right")
    for life in lives:
        growth = life.growth()
        table.add_row(
            life.worker,
            str(life.pid),
            f"{life.granted:,}",
            f"{life.first_mb:.0f}",
            f"{life.peak_mb:.0f}",
            f"{life.last_mb:.0f}",
            "too short" if growth is None else f"{growth:+.1f}",
        )
    console.print(table)
    console.print(
        "MB/M rec: least-squares slope of RSS over the payments ledger's grants in the second "
        f"half of the process's life (judged from {MIN_GRANTS_FOR_GROWTH:,} grants)."
    )


def _memory_problem(lives: list[Incarnation], limit: float) -> str:
    """Why the RSS check fails, or '' when every judged worker stayed under ``limit``."""
    judged = [(life, g) for life in lives if (g := life.growth()) is not None]
    if not judged:
        return (
            f"no worker lived through {MIN_GRANTS_FOR_GROWTH:,} grants: nothing to judge "
            "(more --records, fewer --kills)"
        )
    over = [f"{life.worker} (pid {life.pid}) {g:+.1f}" for life, g in judged if g > limit]
    if over:
        return f"RSS grew faster than {limit:g} MB per million records: {', '.join(over)}"
    return ""


def _topics(cfg: ChaosConfig, bootstrap: str, redis_url: str, name: str) -> dict[str, int]:
    """Every topic a chaos run uses (name -> partitions): both source topics, their
    dead-letter topics and the outcomes topic."""
    settings = chaos_settings(bootstrap, redis_url, name, cfg)
    topics = source_partitions(settings, cfg)
    topics.update({settings.dead_letter_topic(t): 1 for t in list(topics)})
    outcomes = settings.outcomes_topic()
    if outcomes:
        topics[outcomes] = 1
    return topics


def _print_figures(report: ChaosReport) -> None:
    table = Table(title=f"soak figures (seed {report.config.seed})", show_header=False)
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in report.figures().items():
        if isinstance(value, dict):
            for reason, count in value.items():
                table.add_row(f"  dead-lettered: {reason}", str(count))
            continue
        style = "bold red" if name.startswith(("lost", "doubled")) and value else None
        table.add_row(name, str(value), style=style)
    console.print(table)


if __name__ == "__main__":
    app()
