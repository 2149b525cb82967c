"""`make run`: the worker on the embedded stack, processing sample payment notifications.

Starts (or reuses) the dev broker and Redis, produces a sample with transient,
permanent and malformed records, runs the worker with a live progress view, prints
a summary once everything has settled, then keeps running until Ctrl-C. On the way out
it stops the servers it started (unless `--keep`) and leaves ones that `service dev up`
started, saying which and how to stop them: a newcomer must not find stray servers later.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path

from aiokafka import AIOKafkaProducer
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from service.dev import sample
from service.dev.broker import create_topics
from service.dev.servers import free_port
from service.dev.stack import DEFAULT_BROKER, STOP_HINT, DevStack, DevStackInfo
from service.engine.kafka_client import connection_kwargs
from service.engine.settings import Settings
from service.engine.worker import Worker
from service.ops import audit

OUTCOMES = ("succeeded", "retry_scheduled", "dead_lettered", "duplicate")


def demo_settings(bootstrap: str, redis_url: str, topic: str, http_port: int) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": bootstrap, "group_id": "payments-demo"},
        redis={"url": redis_url, "key_prefix": "demo"},
        topics={"payments": topic},
        retry={"base_delay_ms": 300, "max_delay_ms": 3000, "max_attempts": 5},
        http={"port": http_port, "host": "127.0.0.1"},
        fault_injection=True,
        log_format="console",
        log_level="WARNING",
    )


def _counts(worker: Worker) -> dict[str, int]:
    registry = worker.metrics.registry
    return {
        o: int(
            registry.get_sample_value("worker_records_total", {"handler": "payments", "outcome": o})
            or 0
        )
        for o in OUTCOMES
    }


def _progress(worker: Worker, produced: int, state: _Snapshot | None) -> Panel:
    counts = _counts(worker)
    table = Table.grid(padding=(0, 2))
    table.add_row(*(f"[bold]{o}[/] {counts[o]}" for o in OUTCOMES))
    parts: list[Table | Text] = [table]
    if state is not None:
        offsets = Table("partition", "committed", "high watermark", "lag", box=None)
        for p in state.offsets:
            offsets.add_row(str(p.partition), str(p.committed), str(p.high_watermark), str(p.lag))
        parts.append(offsets)
        parts.append(Text(f"retry queue: waiting {state.depth[0]}, running {state.depth[1]}"))
    return Panel(Group(*parts), title=f"processing {produced} sample notifications")


class _Snapshot:
    def __init__(self, offsets: list[audit.PartitionOffsets], depth: tuple[int, int, int]) -> None:
        self.offsets = offsets
        self.depth = depth

    @property
    def settled(self) -> bool:
        # An empty partition has no committed offset (None) and a high watermark of 0.
        done = all((p.committed or 0) == p.high_watermark for p in self.offsets)
        return done and self.depth == (0, 0, 0)


async def _snapshot(settings: Settings) -> _Snapshot:
    topic = settings.topics["payments"]
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    depth = await audit.retry_queue_depth(
        settings.redis.url.get_secret_value(), settings.redis.key_prefix
    )
    return _Snapshot(offsets, depth)


async def run_demo(
    *,
    records: int,
    state_dir: Path | None,
    exit_when_done: bool,
    console: Console,
    keep: bool = False,
    broker: str = DEFAULT_BROKER,
) -> int:
    name = "Apache Kafka, 1 node" if broker == "kafka" else "the embedded broker, Tansu"
    console.print(f"[bold]1/4[/] starting {name} and Redis (AOF always)...")
    # Not in a thread: a Ctrl-C now cancels at the first await below, inside the `try`.
    info = DevStack.up(state_dir, broker=broker)
    console.print(f"    Kafka {info.bootstrap}   Redis {info.redis_url}   state {info.state_dir}")
    try:
        return await _demo(info, records, exit_when_done, console)
    finally:
        _leave_stack(info, keep, console)


def _leave_stack(info: DevStackInfo, keep: bool, console: Console) -> None:
    """Stop what this demo started (unless asked to keep it); say what keeps running."""
    servers = f"the broker ({info.bootstrap}) and Redis ({info.redis_url})"
    if not info.started:
        console.print(
            f"{servers.capitalize()} were already running (`make dev-up`) and keep running; "
            f"stop them with `{STOP_HINT}`."
        )
    elif keep:
        console.print(
            f"{servers.capitalize()} keep running (--keep); stop them with `{STOP_HINT}`."
        )
    else:
        DevStack.down(info.state_dir)
        console.print(
            f"Stopped {servers}, which this demo started "
            "(`.venv/bin/service demo --keep` leaves them running)."
        )


async def _demo(info: DevStackInfo, records: int, exit_when_done: bool, console: Console) -> int:
    topic = "payments"
    settings = demo_settings(info.bootstrap, info.redis_url, topic, free_port())
    await create_topics(
        info.bootstrap,
        {topic: 6, settings.dead_letter_topic(topic): 1, settings.outcomes_topic() or "": 1},
    )

    run_id = uuid.uuid4().hex[:6]
    mix = sample.Mix(transient=0.10, permanent=0.02, malformed=0.02, duplicate=0.02)
    batch = sample.generate(records, mix, seed=int(run_id, 16), prefix=f"pay_{run_id}")
    kinds = {
        k: sum(1 for r in batch if r.kind == k)
        for k in ("ok", "transient", "permanent", "malformed", "duplicate")
    }
    console.print(f"[bold]2/4[/] producing {len(batch)} notifications to '{topic}': {kinds}")
    producer = AIOKafkaProducer(linger_ms=5, **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        await sample.produce(producer, topic, batch)
    finally:
        await producer.stop()

    console.print(
        f"[bold]3/4[/] running the worker (metrics: http://127.0.0.1:{settings.http.port}/metrics)"
    )
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.request_stop)
    snapshot: _Snapshot | None = None
    with Live(_progress(worker, len(batch), None), console=console, refresh_per_second=4) as live:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if worker.health.started:
                snapshot = await _snapshot(settings)
            live.update(_progress(worker, len(batch), snapshot))
            if snapshot is not None and snapshot.settled and _counts(worker)["succeeded"]:
                break
    if task.done():
        task.result()
        return 1

    console.print("[bold]4/4[/] summary")
    console.print(await _summary(settings, batch, worker))
    if exit_when_done:
        worker.request_stop()
    else:
        console.print("The worker keeps running; produce more to 'payments' or press Ctrl-C.")
    await task
    console.print("stopped gracefully: in-flight records finished, offsets committed.")
    return 0


async def _summary(settings: Settings, batch: list[sample.SampleRecord], worker: Worker) -> Table:
    url = settings.redis.url.get_secret_value()
    grants = await audit.ledger_grants(url, settings.redis.key_prefix)
    ours = {r.payment_id for r in batch if r.payment_id}
    granted = {k: v for k, v in grants.items() if k in ours}
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic("payments"))
    reasons: dict[str, int] = {}
    for record in dlq:
        reason = audit.header(record, "x-dlq-reason") or "?"
        reasons[reason] = reasons.get(reason, 0) + 1
    counts = _counts(worker)
    snapshot = await _snapshot(settings)
    table = Table(title="payments demo", show_header=False)
    table.add_row("granted (ledger entries of this run)", str(sum(granted.values())))
    table.add_row("payments granted more than once", str(sum(1 for v in granted.values() if v > 1)))
    table.add_row("retries scheduled", str(counts["retry_scheduled"]))
    table.add_row("duplicates absorbed", str(counts["duplicate"]))
    table.add_row(
        "dead-lettered (topic total, by reason)",
        ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())),
    )
    for p in snapshot.offsets:
        table.add_row(
            f"partition {p.partition}: committed / high watermark",
            f"{p.committed} / {p.high_watermark}",
        )
    table.add_row("retry queue (due, running, items)", str(snapshot.depth))
    return table
