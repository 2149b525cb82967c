"""`make run`: the worker on the embedded stack, processing the service's sample records.

Starts (or reuses) the dev broker and Redis, produces sample records for every handler the
settings bind (demo_grants.plan_lanes): the app's own sample (``App(samples=...)``,
reliable_consumer.engine.declaration.samples) for a handler it covers, records made from the
handler's payload model for every other (model_samples.py). Each sample has transient,
permanent and malformed records (and a model's, records delivered twice); the app's may
declare an ordered pair (a record that fails twice, then one on the same key that must
apply after it: the ledger must still read them in that order). It runs the worker with a
live progress view. Then the first handler's dependency goes down for a few seconds: the
circuit breaker opens and holds the records instead of spending their retries or
dead-lettering them, and closes once the dependency is back. Prints a summary once
everything has settled, then keeps running until Ctrl-C. On the way out it stops the
servers it started (unless `--keep`) and leaves ones that `service dev up` started, saying
which and how to stop them: a newcomer must not find stray servers later.

When a handler it runs keeps its effects in PostgreSQL, the stack also runs the embedded
PostgreSQL, the demo migrates it (`service db migrate`) and counts the app's sample's
effects in the ledger's table; a handler's records made from its model are counted from
the engine's outcome events (demo_grants.py).

This module is long because the demo is one live story told from one snapshot of the
run: the plan, the live view, the outage and the summary read the same counts.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaProducer
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from reliable_consumer.dev.demo_grants import (
    OUTAGE_RECORDS,
    EmittedEvents,
    Grants,
    Lane,
    OutcomeGrants,
    emitted_events,
    grants_for,
    migrate,
    uses_postgres,
)
from reliable_consumer.dev.environment import operator_environment
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.process import free_port
from reliable_consumer.dev.stack import DEFAULT_BROKER, DevStack, DevStackInfo, stop_hint
from reliable_consumer.engine.declaration.app import App
from reliable_consumer.engine.declaration.samples import SampleRecord
from reliable_consumer.engine.handlers.registry import Registry
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.settings import Settings
from reliable_consumer.engine.worker import Worker
from reliable_consumer.ops import audit

OUTCOMES = ("succeeded", "retry_scheduled", "dead_lettered", "duplicate")
CIRCUIT_STATES = {0: "closed", 1: "half-open", 2: "open"}
# The simulated outage: this many records, their handler's dependency down this long.
OUTAGE_S = 8.0
# How long the outage may take to settle before the demo says so and moves on.
OUTAGE_DEADLINE_S = 90.0
# How long the summary waits for the relay to publish the events of the records applied.
EVENTS_DEADLINE_S = 30.0


@dataclass(frozen=True)
class DemoPlan:
    """What the demo runs: its lanes, a handler on its topic with its records each; the
    first lane's dependency goes down in the outage. ``skipped`` names the bound handlers
    it cannot make records for."""

    app: App
    lanes: tuple[Lane, ...]
    skipped: tuple[str, ...] = ()

    @property
    def handler(self) -> str:
        return self.lanes[0].handler

    @property
    def topic(self) -> str:
        return self.lanes[0].topic

    @property
    def topics(self) -> dict[str, str]:
        """The demo's bindings: every lane's handler on its topic."""
        return {lane.handler: lane.topic for lane in self.lanes}

    @property
    def group(self) -> str:
        """The demo's own group, so it never shares offsets with the service's workers."""
        return f"{self.app.consumer_group}-demo"

    @property
    def key_prefix(self) -> str:
        """The demo's own Redis key space (an operator command needs it to see the demo)."""
        return "demo"


def demo_environment(settings: Settings, plan: DemoPlan) -> list[str]:
    """``export`` lines that point the operator commands at the demo's broker, Redis,
    group, key prefix and binding."""
    return operator_environment(
        bootstrap=settings.kafka.bootstrap_servers,
        redis_url=settings.redis.url.get_secret_value(),
        group=plan.group,
        key_prefix=plan.key_prefix,
        topics=plan.topics,
    )


def demo_settings(
    bootstrap: str,
    redis_url: str,
    plan: DemoPlan,
    http_port: int,
    *,
    postgres_url: str | None = None,
) -> Settings:
    return Settings(
        kafka={"bootstrap_servers": bootstrap, "group_id": plan.group},
        redis={"url": redis_url, "key_prefix": plan.key_prefix},
        topics=plan.topics,
        postgres={"url": postgres_url},
        # Snappy backoff so the sample settles in seconds; no attempt cap (as in production,
        # an age limit ends retries), so an outage cannot spend them before the breaker opens.
        retry={"base_delay_ms": 300, "max_delay_ms": 3000, "max_attempts": None, "max_age_s": 600},
        # A breaker that opens within a second of an outage on a quiet service and probes
        # every 2 to 4 s. Ten runs at least: with five, the first runs of a ten-record
        # sample (10% transient failures) can fail often enough to open it.
        breaker={"min_calls": 10, "window_s": 10, "cool_down_s": 2, "max_cool_down_s": 4},
        http={"port": http_port, "host": "127.0.0.1"},
        fault_injection=True,
        log_format="console",
        log_level="WARNING",
    )


def _counts(worker: Worker, handler: str) -> dict[str, int]:
    registry = worker.metrics.registry
    labels = {"handler": handler}
    return {
        o: int(registry.get_sample_value("worker_records_total", {**labels, "outcome": o}) or 0)
        for o in OUTCOMES
    }


def _circuit(worker: Worker, topic: str) -> str:
    """The circuit in front of the topic's handler: its dependency's, else its own name."""
    h = worker.registry.for_topic(topic)
    return (h.dependency or h.name) if h is not None else topic


@dataclass
class _Circuit:
    """The breaker as the worker's metrics show it (what /metrics serves)."""

    state: str
    held: int
    opened: int  # transitions to open so far

    @classmethod
    def read(cls, worker: Worker, circuit: str) -> _Circuit:
        registry = worker.metrics.registry
        labels = {"circuit": circuit}
        value = registry.get_sample_value("worker_circuit_state", labels)
        held = registry.get_sample_value("worker_circuit_held_records", labels)
        opened = registry.get_sample_value(
            "worker_circuit_transitions_total", {**labels, "to": "open"}
        )
        state = CIRCUIT_STATES.get(int(value), "?") if value is not None else "not wired"
        return cls(state, int(held or 0), int(opened or 0))


@dataclass
class _OrderWatch:
    """The ordered pair: ``then`` must apply after ``first``, which fails twice first."""

    first: str
    then: str
    history: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.history) >= 2

    async def update(self, grants: Grants) -> None:
        if not self.done:
            self.history = await grants.order({self.first, self.then})

    def line(self) -> Text:
        order = " -> ".join(self.history) or "nothing yet"
        if self.history == [self.first, self.then]:
            return Text(
                f"{self.then} after {self.first} (which failed twice): ledger {order}, in order",
                style="green",
            )
        if self.done:
            return Text(f"{self.then}: ledger {order}: OUT OF ORDER", style="red")
        return Text(f"{self.then} waits behind {self.first}, which is failing: ledger {order}")


def _progress(
    worker: Worker,
    plan: DemoPlan,
    produced: int,
    states: dict[str, _Snapshot],
    watch: _OrderWatch | None,
) -> Panel:
    parts: list[Table | Text] = []
    for lane in plan.lanes:
        counts = _counts(worker, lane.handler)
        table = Table.grid(padding=(0, 2))
        table.add_row(f"[bold]{lane.handler}[/]", *(f"[bold]{o}[/] {counts[o]}" for o in OUTCOMES))
        parts.append(table)
        circuit = _circuit(worker, lane.topic)
        parts.append(Text(f"circuit {circuit}: {_Circuit.read(worker, circuit).state}"))
        state = states.get(lane.topic)
        if state is not None:
            parts.append(_offsets_table(state))
    if states:
        depth = next(iter(states.values())).depth
        parts.append(Text(f"retry queue: waiting {depth[0]}, running {depth[1]}"))
    if watch is not None:
        parts.append(watch.line())
    return Panel(Group(*parts), title=f"processing {produced} sample records")


def _offsets_table(state: _Snapshot) -> Table:
    offsets = Table("partition", "committed", "high watermark", "lag", box=None)
    for p in state.offsets:
        offsets.add_row(str(p.partition), str(p.committed), str(p.high_watermark), str(p.lag))
    return offsets


class _Snapshot:
    def __init__(self, offsets: list[audit.PartitionOffsets], depth: tuple[int, int, int]) -> None:
        self.offsets = offsets
        self.depth = depth

    @property
    def settled(self) -> bool:
        # An empty partition has no committed offset (None) and a high watermark of 0.
        done = all((p.committed or 0) == p.high_watermark for p in self.offsets)
        return done and self.depth == (0, 0, 0)


async def _snapshot(settings: Settings, topic: str) -> _Snapshot:
    offsets = await audit.group_offsets(settings.kafka, settings.kafka.group_id, topic)
    depth = await audit.retry_queue_depth(
        settings.redis.url.get_secret_value(), settings.redis.effective_prefix
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
    plan: DemoPlan,
) -> int:
    """Run ``plan``'s handler on the dev stack (demo_grants.demo_handler chooses it)."""
    name = "Apache Kafka, 1 node" if broker == "kafka" else "the embedded broker, Tansu"
    postgres = any(uses_postgres(lane.handler) for lane in plan.lanes)
    servers = "Redis (AOF always) and PostgreSQL (fsync on)" if postgres else "Redis (AOF always)"
    console.print(f"[bold]1/5[/] starting {name}, {servers}...")
    # Not in a thread: a Ctrl-C now cancels at the first await below, inside the `try`.
    info = DevStack.up(state_dir, broker=broker, postgres=postgres)
    console.print(f"    Kafka {info.bootstrap}   Redis {info.redis_url}   state {info.state_dir}")
    try:
        return await _demo(info, records, exit_when_done, console, plan)
    finally:
        _leave_stack(info, keep, console)


def _leave_stack(info: DevStackInfo, keep: bool, console: Console) -> None:
    """Stop what this demo started (unless asked to keep it); say what keeps running."""
    servers = f"the broker ({info.bootstrap}) and Redis ({info.redis_url})"
    if info.postgres_url:
        servers = (
            f"the broker ({info.bootstrap}), Redis ({info.redis_url}) "
            f"and PostgreSQL ({info.postgres_url})"
        )
    if not info.started:
        joined = " (PostgreSQL joined them for this demo)" if info.postgres_started else ""
        console.print(
            f"{servers.capitalize()} were already running (`make dev-up`){joined} and keep "
            f"running; stop them with `{stop_hint(info.state_dir)}`."
        )
    elif keep:
        console.print(
            f"{servers.capitalize()} keep running (--keep); "
            f"stop them with `{stop_hint(info.state_dir)}`."
        )
    else:
        DevStack.down(info.state_dir)
        console.print(
            f"Stopped {servers}, which this demo started "
            "(`.venv/bin/service demo --keep` leaves them running)."
        )


async def _demo(
    info: DevStackInfo, records: int, exit_when_done: bool, console: Console, plan: DemoPlan
) -> int:
    settings = demo_settings(
        info.bootstrap, info.redis_url, plan, free_port(), postgres_url=info.postgres_url
    )
    grants = {lane.handler: _grants(plan, lane, settings, info) for lane in plan.lanes}
    for lane in plan.lanes:
        made = "the app's samples" if lane.own else "records made from its model"
        console.print(
            f"    handler {lane.handler} on topic {lane.topic} ({made})   group {plan.group}   "
            f"Redis key prefix {plan.key_prefix}",
            highlight=False,
        )
    for line in plan.skipped:
        console.print(f"    skipped: {line}", highlight=False)
    # The operator commands read the app's group and prefix unless told otherwise: this is
    # what points them at the demo instead (service status, trace, dlq, retries, console).
    console.print("    operator commands see this demo with:", highlight=False)
    for line in demo_environment(settings, plan):
        console.print(f"    {line}", highlight=False, soft_wrap=True)
    if info.postgres_url is not None:
        applied = await migrate(settings.postgres)
        done = f"applied {', '.join(applied)}" if applied else "already up to date"
        console.print(f"    PostgreSQL {info.postgres_url}   service db migrate: {done}")
        console.print(f"    export WORKER_POSTGRES__URL={info.postgres_url}", highlight=False)
    topics = {settings.outcomes_topic() or "": 1}
    for lane in plan.lanes:
        topics |= {lane.topic: 6, settings.dead_letter_topic(lane.topic): 1}
    for emitted in Registry.from_settings(plan.topics, plan.app).emitted_topics:
        topics.setdefault(emitted, 6)  # where the relay publishes what the handlers emit
    await create_topics(info.bootstrap, topics)

    run_id = uuid.uuid4().hex[:6]
    # The records shared among the lanes, ten at least each (the mix needs them).
    each = max(10, records // len(plan.lanes))
    batches: dict[str, Sequence[SampleRecord]] = {}
    for lane in plan.lanes:
        batch = lane.samples.mixed(each, seed=int(run_id, 16), prefix=f"demo_{run_id}")
        batches[lane.handler] = batch
        kinds = dict(Counter(r.kind for r in batch))
        console.print(f"[bold]2/5[/] producing {len(batch)} records to '{lane.topic}': {kinds}")
        await _produce(settings, lane.topic, batch)
    produced = sum(len(b) for b in batches.values())

    console.print(
        f"[bold]3/5[/] running the worker (metrics: http://127.0.0.1:{settings.http.port}/metrics)"
    )
    worker = Worker(settings)
    task = asyncio.create_task(worker.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.request_stop)
    # An app's sample that declares an order opens with a record that fails twice, then one
    # that must apply after it; records made from a model declare none.
    watch: _OrderWatch | None = None
    watched: Grants | None = None
    for lane in plan.lanes:
        pair = next(
            ((r.after, r.dedupe_key) for r in batches[lane.handler] if r.after and r.dedupe_key),
            None,
        )
        if pair is not None and watch is None:
            watch, watched = _OrderWatch(*pair), grants[lane.handler]
    snapshots: dict[str, _Snapshot] = {}
    live_view = _progress(worker, plan, produced, snapshots, watch)
    with Live(live_view, console=console, refresh_per_second=4) as live:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if worker.health.started:
                for lane in plan.lanes:
                    snapshots[lane.topic] = await _snapshot(settings, lane.topic)
                if watch is not None and watched is not None:
                    await watch.update(watched)
            live.update(_progress(worker, plan, produced, snapshots, watch))
            if (
                len(snapshots) == len(plan.lanes)
                and all(s.settled for s in snapshots.values())
                and all(_counts(worker, lane.handler)["succeeded"] for lane in plan.lanes)
                and (watch is None or watch.done)
            ):
                break
    if task.done():
        task.result()
        return 1

    console.print(
        f"[bold]4/5[/] the dependency of handler {plan.handler} goes down for {OUTAGE_S:g} s under "
        f"{OUTAGE_RECORDS} more records (x-fault: down-until)"
    )
    outage = await _outage(settings, plan, worker, task, console, run_id, grants[plan.handler])
    if task.done():
        task.result()
        return 1

    console.print("[bold]5/5[/] summary")
    for lane in plan.lanes:
        lane_outage = outage if lane.handler == plan.handler else None
        lane_watch = watch if watched is grants[lane.handler] else None
        console.print(
            await _summary(
                settings,
                plan,
                lane,
                batches[lane.handler],
                worker,
                lane_watch,
                lane_outage,
                grants[lane.handler],
            )
        )
    for line in plan.skipped:
        console.print(f"skipped: {line}", highlight=False)
    console.print(outage.line())
    if exit_when_done:
        worker.request_stop()
    else:
        topics_named = ", ".join(f"'{lane.topic}'" for lane in plan.lanes)
        console.print(f"The worker keeps running; produce more to {topics_named} or press Ctrl-C.")
    await task
    console.print("stopped gracefully: in-flight records finished, offsets committed.")
    return 0


async def _published(
    settings: Settings,
    handler: str,
    topics: list[str],
    expected: set[str],
    ours: set[str],
) -> EmittedEvents:
    """The lane's events read back from the topics it emits to, once the relay published
    one for every expected record or ``EVENTS_DEADLINE_S`` passed (the summary then shows
    how many are still missing)."""
    deadline = time.monotonic() + EVENTS_DEADLINE_S
    while True:
        events = await emitted_events(settings.kafka, topics, handler, expected, ours)
        if events.published == events.expected or time.monotonic() >= deadline:
            return events
        await asyncio.sleep(0.5)


def _grants(plan: DemoPlan, lane: Lane, settings: Settings, info: DevStackInfo) -> Grants:
    """Where a lane's effects are counted: the app's ledger for its own samples, else the
    engine's outcome events (the app's ledger knows nothing of records made from a model)."""
    outcomes = settings.outcomes_topic()
    if lane.own or outcomes is None:
        return grants_for(
            plan.app.ledger,
            postgres_url=info.postgres_url if uses_postgres(lane.handler) else None,
            redis_url=info.redis_url,
            prefix=settings.redis.effective_prefix,
        )
    return OutcomeGrants(settings.kafka, outcomes, lane.handler)


async def _produce(settings: Settings, topic: str, records: Sequence[SampleRecord]) -> None:
    """Produce the records and wait for every acknowledgement."""
    producer = AIOKafkaProducer(linger_ms=5, **connection_kwargs(settings.kafka))
    await producer.start()
    try:
        futures = [
            await producer.send(topic, key=r.key, value=r.value, headers=list(r.headers) or None)
            for r in records
        ]
        for future in futures:
            await future
    finally:
        await producer.stop()


@dataclass
class _Outage:
    """What the outage did, measured from the outside and from the worker's metrics."""

    keys: list[str]  # the outage records' dedupe keys
    started: float = field(default_factory=time.monotonic)
    opened: int = 0  # transitions to open since the outage began
    max_held: int = 0
    dead_lettered: int = 0  # dead letters since the outage began
    parked: int = 0  # retry_scheduled outcomes since the outage began (parks and re-parks)
    granted: int = 0  # outage records with exactly one ledger entry
    circuit: str = "?"
    settled: bool = False

    @property
    def all_granted(self) -> bool:
        return self.granted == len(self.keys)

    def line(self) -> str:
        opened = "circuit opened" if self.opened else "circuit did NOT open"
        end = (
            "all granted after it closed"
            if self.all_granted and self.circuit == "closed"
            else f"{self.granted}/{len(self.keys)} granted, circuit {self.circuit}"
        )
        if not self.settled:
            end += f", not settled after {OUTAGE_DEADLINE_S:g} s"
        return f"outage: {opened}, {self.max_held} held, {self.dead_lettered} dead-lettered, {end}"


async def _outage(
    settings: Settings,
    plan: DemoPlan,
    worker: Worker,
    task: asyncio.Task[None],
    console: Console,
    run_id: str,
    grants: Grants,
) -> _Outage:
    """Records whose dependency is down for a while: the breaker should hold, not give up."""
    topic = plan.topic
    samples = plan.lanes[0].samples
    circuit = _circuit(worker, topic)
    # On a busy service an outage fails every run, so the failure ratio climbs at once; the
    # sample's successes are still in the breaker's window and would outvote the first
    # failures: start once they no longer do (at most one window from now).
    window_s = settings.breaker.window_s
    deadline = time.monotonic() + window_s + 2
    with Live(Text(""), console=console, transient=True) as live:
        while not task.done() and time.monotonic() < deadline:
            runs = worker.health.circuits().get(circuit, {}).get("runs", 0)
            if not isinstance(runs, int):
                break
            if runs <= OUTAGE_RECORDS:
                break
            live.update(
                Text(f"letting the sample's {runs} runs leave the breaker's {window_s:g} s window")
            )
            await asyncio.wait({task}, timeout=0.5)

    down_until_ms = int((time.time() + OUTAGE_S) * 1000)
    records = samples.outage(
        OUTAGE_RECORDS, down_until_ms, seed=int(run_id, 16), prefix=f"out_{run_id}"
    )
    before = _Circuit.read(worker, circuit)
    counts_before = _counts(worker, plan.handler)
    result = _Outage([str(r.dedupe_key) for r in records])
    await _produce(settings, topic, records)
    view = _outage_view(result, None, down_until_ms)
    with Live(view, console=console, refresh_per_second=4) as live:
        while not task.done() and time.monotonic() - result.started < OUTAGE_DEADLINE_S:
            await asyncio.wait({task}, timeout=0.5)
            now = _Circuit.read(worker, circuit)
            result.circuit = now.state
            result.opened = now.opened - before.opened
            result.max_held = max(result.max_held, now.held)
            counts = _counts(worker, plan.handler)
            result.dead_lettered = counts["dead_lettered"] - counts_before["dead_lettered"]
            result.parked = counts["retry_scheduled"] - counts_before["retry_scheduled"]
            entries = await grants.counts()
            result.granted = sum(1 for k in result.keys if entries.get(k) == 1)
            snapshot = await _snapshot(settings, topic)
            live.update(_outage_view(result, snapshot, down_until_ms, now))
            back = time.time() * 1000 >= down_until_ms
            closed = now.state in ("closed", "not wired")
            if back and closed and result.all_granted and snapshot.settled:
                result.settled = True
                break
    return result


def _outage_view(
    result: _Outage, state: _Snapshot | None, down_until_ms: int, circuit: _Circuit | None = None
) -> Panel:
    left_s = down_until_ms / 1000 - time.time()
    parts: list[Table | Text] = [
        Text(
            f"dependency: DOWN, back in {left_s:.1f} s" if left_s > 0 else "dependency: up",
            style="red" if left_s > 0 else "green",
        )
    ]
    if circuit is not None:
        style = {"open": "red", "half-open": "yellow", "closed": "green"}.get(circuit.state, "")
        parts.append(
            Text(
                f"circuit {result.circuit}: {circuit.held} records held "
                f"(opened {result.opened}x since the outage began)",
                style=style,
            )
        )
    parts.append(
        Text(
            f"since the outage began: {result.parked} retry_scheduled (parked, or re-parked "
            "while the circuit is open), "
            f"{result.dead_lettered} dead-lettered"
        )
    )
    parts.append(Text(f"granted: {result.granted}/{len(result.keys)}"))
    if state is not None:
        parts.append(Text(f"retry queue: waiting {state.depth[0]}, running {state.depth[1]}"))
        parts.append(_offsets_table(state))
    return Panel(Group(*parts), title=f"dependency outage: {len(result.keys)} records")


async def _summary(
    settings: Settings,
    plan: DemoPlan,
    lane: Lane,
    batch: Sequence[SampleRecord],
    worker: Worker,
    watch: _OrderWatch | None,
    outage: _Outage | None,
    grants: Grants,
) -> Table:
    """One lane's summary: what the handler applied, retried, absorbed and dead-lettered."""
    entries = await grants.counts()
    outage_keys = set(outage.keys) if outage is not None else set()
    ours = {r.dedupe_key for r in batch if r.dedupe_key} | outage_keys
    granted = {k: v for k, v in entries.items() if k in ours}
    expected = {r.dedupe_key for r in batch if r.expect_grant and r.dedupe_key}
    expected |= outage_keys
    dlq = await audit.read_all(settings.kafka, settings.dead_letter_topic(lane.topic))
    reasons: dict[str, int] = {}
    for record in dlq:
        reason = audit.header(record, "x-dlq-reason") or "?"
        reasons[reason] = reasons.get(reason, 0) + 1
    counts = _counts(worker, lane.handler)
    snapshot = await _snapshot(settings, lane.topic)
    table = Table(title=f"{plan.app.name} demo: handler {lane.handler}", show_header=False)
    table.add_row("effects counted in", Text(grants.where))  # Text: ":ledger:" is no emoji
    applied = "ledger entries of this run" if lane.own else "records applied in this run"
    table.add_row(applied, str(sum(granted.values())))
    table.add_row(
        "records expected to apply, applied exactly once",
        f"{sum(1 for k in expected if granted.get(k) == 1)} of {len(expected)}",
    )
    if not lane.own:
        sent_twice = sum(1 for r in batch if r.kind == "duplicate")
        table.add_row("records delivered twice (a duplicate each)", str(sent_twice))
    table.add_row("keys applied more than once", str(sum(1 for v in granted.values() if v > 1)))
    handler = Registry.from_settings(plan.topics, plan.app).by_name(lane.handler)
    if handler is not None and handler.emits:
        events = await _published(settings, lane.handler, sorted(handler.emits), expected, ours)
        table.add_row("events published for applied records", events.line())
    if watch is not None:
        table.add_row(
            "ordered pair, its first failing twice",
            "ledger: " + (" -> ".join(watch.history) or "nothing"),
        )
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
