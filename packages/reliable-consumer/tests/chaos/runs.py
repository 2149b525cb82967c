"""Chaos runs: real worker subprocesses, a known record mix, faults at seeded moments.

One harness for the bounded CI suite (tests/chaos) and the soak (scripts/soak.py), so a
soak figure and a CI pass mean the same thing. A run:

1. produces a known mix (ok, transient:k, permanent, malformed, hanging, duplicate
   deliveries, some of them resent far later) to a topic, paced by the ledger and
   gated by the fault plan so every fault fires while records are still in flight and
   more are still to come;
2. runs `python -m reliable_consumer run` workers (1 normally, 3 while scaled up);
3. fires each planned fault once its trigger (ledger length or committed offsets past
   a seeded threshold) is met: SIGKILL, SIGTERM while a worker runs a hanging
   handler (a busy batch), a Redis kill + restart, scaling 1 -> 3 -> 1;
4. after every kill and SIGTERM freezes the surviving workers (SIGSTOP) and checks
   from the outside that everything below the committed offsets has a durable fate;
5. waits for the run to settle and checks every invariant from the outside.

Everything random comes from one seed: the records, the plan (order, triggers,
thresholds, which worker). Timing is the machine's, so a seed reproduces the same
faults at the same progress points, not at the same microsecond.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from redis.exceptions import RedisError
from reliable_consumer.dev.servers.broker import create_topics
from reliable_consumer.dev.servers.redis_cluster import RedisCluster
from reliable_consumer.dev.servers.redis_server import RedisServer
from reliable_consumer.engine.handlers.emissions import event_id
from reliable_consumer.engine.kafka.clients import connection_kwargs
from reliable_consumer.engine.redis.slot_owner import slot_of
from reliable_consumer.engine.settings import Settings
from tests.chaos import claiming
from tests.chaos.emitted import STEPS, Emitted, EmittedCheck, check_emitted, every_step
from tests.chaos.outside import TP, Outside, View, Where, wait_settled
from tests.helpers import await_until, wait_until
from tests.integration.harness import make_settings, prepare_topics
from tests.integration.procs import HangingRecord, HangWatch, WorkerProcess

from service import sample

ROOT = Path(__file__).resolve().parents[4]  # the repository
LIBRARY = ROOT / "packages" / "reliable-consumer"

SEED_ENV = "CHAOS_SEED"
# Each failed Redis try, with its attempt number: DEBUG, which worker_main turns on for it.
REDIS_FAILED = "redis call failed"
# Logged once the worker runs, signal handlers installed. A SIGTERM before that (during the
# interpreter's imports) takes the default action: exit -15, nothing fetched yet to lose.
STARTED = "worker started"
MAX_WORKERS = 3
GRACE_S = 10.0
# A SIGTERMed worker must be gone within its grace; this much more is interpreter exit and
# the group leave on a loaded machine, not a broken promise.
EXIT_SLACK_S = 5.0

FaultKind = Literal["kill", "sigterm", "redis", "scale_up", "scale_down"]
Metric = Literal["ledger", "committed"]
Layout = Literal["shuffled", "crowded"]
Say = Callable[[str], None]
# The run's Redis: one server, or a cluster whose "redis" fault is the failover of the
# service's slot's primary (the old primary back as a replica before the fault ends).
RedisSide = RedisServer | RedisCluster
# On a cluster, a write is acknowledged once a replica holds it too, so it outlives the
# failover; a short socket timeout lets calls to the killed primary give up fast.
CLUSTER_REDIS: dict[str, Any] = {
    "cluster": True,
    "durability": "wait_replicas",
    "wait_replicas": 1,
    "socket_timeout_s": 2.0,
}


def seed_from_env() -> int:
    """`CHAOS_SEED` if set, else a fresh random seed (printed by the caller)."""
    raw = os.environ.get(SEED_ENV, "").strip()
    return int(raw) if raw else random.SystemRandom().randrange(1, 2**31)


# --- configuration ---


@dataclass(frozen=True)
class ChaosMix:
    """Fractions of the source records; the rest are plain valid payments."""

    transient: float = 0.10
    permanent: float = 0.02
    malformed: float = 0.02
    duplicate: float = 0.04  # delivered twice (ok ones via sample.Mix, transient ones resent)
    hang: float = 0.005  # the handler never returns: every attempt times out -> exhausted
    max_transient_failures: int = 2


@dataclass(frozen=True)
class ChaosConfig:
    """The size of a run and its faults; the CI defaults fit a 2-core runner in ~1 minute."""

    records: int
    seed: int
    partitions: int = 6
    # Share of the records that go to the claiming handler's topic (tests/chaos/claiming.py),
    # and that topic's partitions: the claim path and its lease under the same faults.
    claimed_share: float = 0.25
    claimed_partitions: int = 3
    kills: int = 2
    sigterms: int = 1
    redis_restarts: int = 1
    scale_cycles: int = 1  # each is 1 -> 3 -> 1 workers
    layout: Layout = "shuffled"  # "crowded": the other faults while three workers run
    mix: ChaosMix = field(default_factory=ChaosMix)
    ahead: int = 400  # the producer stays at most this many grants in front of the ledger
    chunk: int = 100
    duplicate_spread: int = 1500  # how far (in records) a duplicate may land after its original
    # How many times one Redis call of each worker must have been retried before a killed
    # Redis comes back (seeded in this range): how long an outage lasts, as a condition
    # rather than a timer (the retries back off, so 5 is about a second, 12 several).
    redis_failures: tuple[int, int] = (5, 12)
    # SIGTERM (the fault, scale-down, the final stop) only once every running worker holds
    # its partitions. A worker SIGTERMed mid-rebalance does not start its shutdown until the
    # rebalance ends (tests/chaos/test_shutdown_in_rebalance.py); set True once it does.
    sigterm_mid_rebalance: bool = False
    # Scale down by SIGTERMing the leavers together rather than one by one. Two members
    # leaving at once sometimes leave the dev broker's rebalance hanging (docs/chaos.md).
    scale_down_at_once: bool = False
    # The shortest session Apache Kafka accepts by default (group.min.session.timeout.ms).
    session_timeout_ms: int = 6_000
    step_timeout_s: float = 90.0  # deadline of every single wait of the run
    settle_timeout_s: float = 120.0


# --- records ---

Handler = Literal["payments", "claimed"]
PAYMENTS: Handler = "payments"  # the effects-only example handler (service/handlers/payments.py)
CLAIMED: Handler = "claimed"  # the claiming handler (tests/chaos/claiming.py)
assert claiming.NAME == CLAIMED


@dataclass(frozen=True)
class Routed:
    """A record of the mix and the handler whose topic it goes to."""

    handler: Handler
    record: sample.SampleRecord

    @property
    def kind(self) -> str:
        return self.record.kind

    @property
    def payment_id(self) -> str | None:
        return self.record.payment_id

    @property
    def expect_grant(self) -> bool:
        return self.record.expect_grant

    @property
    def expect_dead_letter(self) -> str | None:
        return self.record.expect_dead_letter

    @property
    def hangs(self) -> bool:
        return isinstance(self.record, HangingRecord)


@dataclass(frozen=True)
class Placed:
    """A produced record and where it landed."""

    routed: Routed
    topic: str
    partition: int
    offset: int

    @property
    def where(self) -> Where:
        return (self.topic, self.partition, self.offset)

    @property
    def record(self) -> Routed:
        return self.routed


def make_mix(cfg: ChaosConfig) -> list[Routed]:
    """The run's records: the payments mix and the claimed mix, merged in a seeded order.

    Each handler gets the same kinds of records (its own payment ids, so no payment is
    granted by both); the order within each stream is kept.
    """
    claimed_n = round(cfg.records * cfg.claimed_share)
    streams: list[list[Routed]] = [
        [
            Routed("payments", r)
            for r in make_records(
                cfg.records - claimed_n, cfg.mix, cfg.seed, cfg.duplicate_spread, prefix="pay"
            )
        ],
        [
            Routed("claimed", r)
            for r in make_records(
                claimed_n, cfg.mix, cfg.seed + 1, cfg.duplicate_spread, prefix="cpay"
            )
        ],
    ]
    rng = random.Random(cfg.seed * 31 + 7)
    merged: list[Routed] = []
    heads = [0, 0]
    while len(merged) < cfg.records:
        left = [len(s) - h for s, h in zip(streams, heads, strict=True)]
        pick = 0 if rng.random() * sum(left) < left[0] else 1
        merged.append(streams[pick][heads[pick]])
        heads[pick] += 1
    return merged


def make_records(
    n: int, mix: ChaosMix, seed: int, spread: int = 1500, prefix: str = "pay"
) -> list[sample.SampleRecord]:
    """`n` records of the mix, duplicates spread out so some arrive batches or faults later.

    Hanging records are made only from payments delivered once: a second, healthy copy
    would grant the payment and turn the hanging one into a duplicate, not a dead letter.
    Permanent failures are never duplicated: which copy reaches the dead-letter topic
    first would depend on timing, and dead letters are checked by source offset.
    """
    base = sample.generate(
        n,
        sample.Mix(
            transient=mix.transient,
            permanent=mix.permanent,
            malformed=mix.malformed,
            duplicate=mix.duplicate,
            max_transient_failures=mix.max_transient_failures,
        ),
        seed=seed,
        prefix=prefix,
    )
    rng = random.Random(seed * 7919 + 1)
    copies = Counter(r.payment_id for r in base)
    ok_share = max(1e-9, 1 - mix.transient - mix.permanent - mix.malformed)
    ranked: list[tuple[float, sample.SampleRecord]] = []
    for i, r in enumerate(base):
        if r.kind == "ok" and copies[r.payment_id] == 1 and rng.random() < mix.hang / ok_share:
            r = HangingRecord("ok", r.payment_id, r.key, r.value, [("x-fault", b"hang")])
        ranked.append((_rank(i, r, rng, spread), r))
        if r.kind == "transient" and rng.random() < mix.duplicate:
            resent = sample.SampleRecord("duplicate", r.payment_id, r.key, r.value, r.headers)
            ranked.append((_rank(i + 0.5, resent, rng, spread), resent))
    return [r for _, r in sorted(ranked, key=lambda pair: pair[0])][:n]


def _rank(position: float, record: sample.SampleRecord, rng: random.Random, spread: int) -> float:
    """Where a record goes: in place, or for half of the duplicates up to `spread` later."""
    if record.kind == "duplicate" and rng.random() < 0.5:
        return position + rng.uniform(0, spread)
    return position


def chaos_settings(
    bootstrap: str, redis_url: str, name: str, cfg: ChaosConfig, *, cluster: bool = False
) -> Settings:
    """Short sessions and leases: a dead worker's partitions, claims and retries move on fast.

    Two topics: the payments example's and the claiming handler's (`{name}-claimed`).
    ``cluster``: the URL is a node of a Redis Cluster (CLUSTER_REDIS).
    """
    extra: dict[str, Any] = {}
    if cluster:
        # The test broker has one node: its topics cannot be what a Redis wait mode asks.
        extra = {"redis": CLUSTER_REDIS, "topic_durability": "warn"}
    return make_settings(
        bootstrap,
        redis_url,
        name,
        **extra,
        topics={CLAIMED: f"{name}-claimed"},
        kafka={"session_timeout_ms": cfg.session_timeout_ms, "heartbeat_interval_ms": 1_000},
        idempotency={"lease_ms": 3_000},
        retry={"lease_ms": 3_000, "max_attempts": 4},
        handler_timeout_s=1.0,
        shutdown_grace_s=GRACE_S,
        revoke_grace_s=5.0,
    )


# --- the plan ---


@dataclass(frozen=True)
class Trigger:
    metric: Metric
    threshold: int
    position: int  # records that must be produced before the threshold can be reached

    def describe(self) -> str:
        what = "ledger entries" if self.metric == "ledger" else "committed offsets (sum)"
        return f"{what} >= {self.threshold}"


@dataclass(frozen=True)
class PlannedFault:
    kind: FaultKind
    trigger: Trigger
    pick: int  # seeded: which worker(s) it hits
    # seeded, kind-specific: failed Redis calls each worker must log while Redis is down,
    # and odd means a worker is also SIGKILLed during the outage; for a kill, odd means
    # "restart only once the survivors took over" (when there are survivors)
    param: int

    @property
    def compound(self) -> bool:
        return self.param % 2 == 1

    def describe(self) -> str:
        extra = ""
        if self.kind == "redis":
            extra = f" ({self.param} failed calls each" + (
                ", a worker SIGKILLed and restarted meanwhile)" if self.compound else ")"
            )
        elif self.kind == "kill" and self.compound:
            extra = " (restart once the others took over, if any)"
        return f"{self.kind:<10} when {self.trigger.describe()}{extra}"


def plan_faults(cfg: ChaosConfig, records: list[Routed], rng: random.Random) -> list[PlannedFault]:
    """The faults in firing order, each with a trigger spread over 8-85 % of the run."""
    kill: list[FaultKind] = ["kill"]
    sigterm: list[FaultKind] = ["sigterm"]
    redis: list[FaultKind] = ["redis"]
    others = kill * cfg.kills + sigterm * cfg.sigterms + redis * cfg.redis_restarts
    kinds: list[FaultKind]
    if cfg.layout == "crowded" and cfg.scale_cycles:
        # Everything but one kill while the group has three members, then a last kill alone.
        tail: list[FaultKind] = ["kill"] if cfg.kills else []
        if tail:
            others.remove("kill")
        rng.shuffle(others)
        kinds = ["scale_up", *others, "scale_down", *tail]
        kinds += ["scale_up", "scale_down"] * (cfg.scale_cycles - 1)
    else:
        kinds = others + ["scale_up"] * (2 * cfg.scale_cycles)
        rng.shuffle(kinds)
        scale_steps = 0
        for i, kind in enumerate(kinds):  # scale steps alternate: up, down, up, down
            if kind in ("scale_up", "scale_down"):
                kinds[i] = "scale_up" if scale_steps % 2 == 0 else "scale_down"
                scale_steps += 1

    granted: list[int] = []  # distinct payments expected in the ledger after i records
    seen: set[str] = set()
    for r in records:
        if r.expect_grant and r.payment_id:
            seen.add(r.payment_id)
        granted.append(len(seen))
    n, count = len(records), len(kinds)
    faults = []
    for i, kind in enumerate(kinds):
        low, high = 0.08 + 0.77 * i / count, 0.08 + 0.77 * (i + 1) / count
        position = max(1, int(n * rng.uniform(low, high)))
        metric: Metric = rng.choice(["ledger", "committed"])
        base = granted[position - 1] if metric == "ledger" else position
        trigger = Trigger(metric, max(1, int(base * 0.95)), position)
        pick, param = rng.randrange(1 << 30), rng.randint(*cfg.redis_failures)
        faults.append(PlannedFault(kind, trigger, pick, param))
    return faults


# --- what happened ---


@dataclass
class FaultRecord:
    index: int
    kind: FaultKind
    trigger: str
    target: str
    fired_at_s: float  # since production started
    took_s: float
    produced: int  # records produced when it fired (< total: it hit a run in progress)
    ledger: int | None
    note: str = ""
    kills_in_outage: int = 0


@dataclass
class Verdict:
    """Every invariant, checked from the outside; `problems` empty means the run held."""

    expected_grants: int
    claimed_grants: int  # of which granted by the claiming handler
    lost: list[str]
    doubled: dict[str, int]
    unexpected_grants: list[str]
    dead_missing: list[Where]
    dead_unexpected: list[Where]
    dead_wrong_reason: list[tuple[str, int, int, str]]
    dead_by_reason: Counter[str]
    dead_extra_copies: int
    offsets_behind: list[str]
    retry_depth: tuple[int, int, int]
    claims_left: list[str]
    markers: Counter[str]
    outcome_missing: list[Where]
    succeeded_twice: list[str]
    overlaps: list[str]  # two runs of one claimed key at once (tests/chaos/claiming.py)
    overlaps_excused: int  # met a marker its holder reported left behind
    emitted_events: int  # distinct events the claiming handler's grants published
    emitted_duplicates: int  # their copies beyond the first (at least once + event-id)
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def lost_count(self) -> int:
        """Records with no fate at all: valid payments never granted, dead letters missing."""
        return len(self.lost) + len(self.dead_missing)


@dataclass
class ChaosReport:
    config: ChaosConfig
    plan: list[PlannedFault]
    faults: list[FaultRecord]
    verdict: Verdict
    produced: int  # every record produced, the probes included
    probes: int  # extra records sent to every partition of both topics by SIGTERM and Redis faults
    duration_s: float  # first produce to settled
    rebalances: int
    assignments: int
    worker_logs: list[Path]

    @property
    def counts(self) -> Counter[str]:
        return Counter(f.kind for f in self.faults)

    @property
    def kills_in_outage(self) -> int:
        return sum(f.kills_in_outage for f in self.faults)

    @property
    def throughput(self) -> float:
        return self.produced / self.duration_s if self.duration_s else 0.0

    def figures(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "seed": self.config.seed,
            "records": self.produced,
            "of which probes": self.probes,
            "partitions": self.config.partitions + self.config.claimed_partitions,
            "kills": self.counts["kill"] + self.kills_in_outage,
            "kills during a Redis outage": self.kills_in_outage,
            "sigterms": self.counts["sigterm"],
            "redis restarts": self.counts["redis"],
            "scaling steps": self.counts["scale_up"] + self.counts["scale_down"],
            "rebalances": self.rebalances,
            "expected grants": v.expected_grants,
            "of which by the claiming handler": v.claimed_grants,
            "lost": v.lost_count,
            "lost payments (never granted)": len(v.lost),
            "lost dead letters (missing)": len(v.dead_missing),
            "doubled": len(v.doubled),
            "dead-lettered": sum(v.dead_by_reason.values()),
            "dead-lettered by reason": dict(sorted(v.dead_by_reason.items())),
            "dead-letter extra copies": v.dead_extra_copies,
            "overlapping runs of a claimed key": len(v.overlaps),
            "emitted events": v.emitted_events,
            "emitted duplicate copies": v.emitted_duplicates,
            "duration s": round(self.duration_s, 1),
            "throughput rec/s": round(self.throughput, 1),
        }

    def failure_text(self, tail_chars: int = 3000) -> str:
        lines = [
            f"chaos run FAILED, seed {self.config.seed} (reproduce with {SEED_ENV}="
            f"{self.config.seed})",
            *[f"  - {p}" for p in self.verdict.problems],
            "faults:",
            *[f"  {_describe_fault(f)}" for f in self.faults],
        ]
        for log in self.worker_logs:
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            lines.append(f"----- {log.name} -----\n{text[-tail_chars:]}")
        return "\n".join(lines)


def _describe_fault(f: FaultRecord) -> str:
    return (
        f"#{f.index} {f.kind:<10} {f.target:<12} at {f.fired_at_s:6.1f}s "
        f"({f.trigger}; produced {f.produced}, ledger {f.ledger}) took {f.took_s:.1f}s"
        + (f"; {f.note}" if f.note else "")
    )


class WorkerDied(AssertionError):
    """A worker exited without being told to: a crash of the service, never expected."""


# --- workers ---


_ASSIGNMENT = re.compile(r"partitions (assigned|revoked) partitions=(\[.*?\])\s*$", re.M)
_ASSIGNED_AT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*partitions assigned partitions=", re.M
)


def current_assignment(proc: WorkerProcess) -> frozenset[str]:
    """The partitions this run of the worker holds, from its own log (assigns minus revokes)."""
    text = proc.log_text().rsplit(f"===== start #{proc.starts} ", 1)[-1]
    held: frozenset[str] = frozenset()
    for match in _ASSIGNMENT.finditer(text):
        parts = frozenset(ast.literal_eval(match.group(2)))
        held = parts if match.group(1) == "assigned" else held - parts
    return held


def held_partitions(proc: WorkerProcess) -> set[TP]:
    """`current_assignment` as (topic, partition) pairs ("topic[3]" -> ("topic", 3))."""
    out = set()
    for name in current_assignment(proc):
        topic, number = name.rsplit("[", 1)
        out.add((topic, int(number.rstrip("]"))))
    return out


def rebalance_rounds(logs: Iterable[Path]) -> tuple[int, int]:
    """(rebalances, assignments): assignment log lines of all workers, grouped into rounds.

    Members of one generation receive their assignments within moments of each other;
    lines more than a second apart belong to different rounds. The first round is the
    initial join, not a rebalance.
    """
    stamps = []
    for log in logs:
        with contextlib.suppress(OSError):
            for match in _ASSIGNED_AT.finditer(log.read_text(errors="replace")):
                stamps.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    stamps.sort()
    rounds = sum(
        1 for i, t in enumerate(stamps) if i == 0 or (t - stamps[i - 1]).total_seconds() > 1.0
    )
    return max(0, rounds - 1), len(stamps)


class ChaosWorkerProcess(WorkerProcess):
    """`python -m tests.chaos.worker_main run`: `service run` with the claiming handler."""

    def __init__(self, settings: Settings, log_path: Path, **overrides: str) -> None:
        path = os.pathsep.join(
            p for p in (str(ROOT), str(LIBRARY), os.environ.get("PYTHONPATH")) if p
        )
        super().__init__(settings, log_path, PYTHONPATH=path, **overrides)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.chaos.worker_main", "run"]


class Pool:
    """Up to three worker subprocesses with distinct client ids, and which should be up."""

    def __init__(self, settings: Settings, work_dir: Path, name: str) -> None:
        self.procs: list[WorkerProcess] = [
            ChaosWorkerProcess(
                settings,
                work_dir / f"w{i}.log",
                WORKER_KAFKA__CLIENT_ID=f"{name}-w{i}",
                CHAOS_EMIT_TOPIC=emit_topic(settings),
            )
            for i in range(MAX_WORKERS)
        ]
        self.expected: set[int] = set()

    def name(self, slot: int) -> str:
        return f"w{slot}"

    def start(self, slot: int) -> None:
        self.procs[slot].start()
        self.expected.add(slot)

    def running_slots(self) -> list[int]:
        return sorted(self.expected)

    def running(self) -> list[WorkerProcess]:
        return [self.procs[s] for s in self.running_slots()]

    def pick(self, seed: int) -> int:
        slots = self.running_slots()
        return slots[seed % len(slots)]

    def check_alive(self) -> None:
        for slot in self.expected:
            proc = self.procs[slot]
            if not proc.running:
                raise WorkerDied(
                    f"worker {self.name(slot)} exited on its own (code {proc.returncode}):\n"
                    f"{proc.tail()}"
                )

    def held_by_all(self, partitions: int) -> bool:
        """The running workers hold disjoint, non-empty sets covering every partition."""
        self.check_alive()
        held = [current_assignment(p) for p in self.running()]
        if not held or not all(held):
            return False
        return len(frozenset().union(*held)) == partitions == sum(len(h) for h in held)

    def started(self, slots: Iterable[int]) -> bool:
        """The given workers logged their start, so SIGTERM reaches their shutdown path."""
        self.check_alive()
        return all(self.procs[s].log_count(STARTED) >= 1 for s in slots)

    def log_sizes(self) -> dict[int, int]:
        return {s: len(self.procs[s].log_text()) for s in self.running_slots()}

    def retries_logged(self, since: dict[int, int]) -> dict[int, int]:
        """The highest attempt of one Redis call each running worker has logged as failed
        since ``since`` (its log's size then, from ``log_sizes``).

        One call retried N times has waited through N backoffs, so "attempt N" measures how
        long an outage lasted; a count of failed calls would not (many calls in flight fail
        together in the first fraction of a second).
        """
        return {
            s: _highest_attempt(self.procs[s], REDIS_FAILED, since.get(s, 0))
            for s in self.running_slots()
        }

    def stop_all(self) -> dict[str, int | None]:
        """SIGTERM every live worker at once, then wait for each; returns exit codes."""
        codes: dict[str, int | None] = {}
        live = [(s, p) for s, p in enumerate(self.procs) if p.running]
        with contextlib.suppress(AssertionError):  # a worker that never starts is killed below
            wait_until(
                lambda: all(p.log_count(STARTED) or not p.running for _, p in live),
                60,
                message="a worker never started",
            )
        for _, proc in live:
            proc.terminate()
        for slot, proc in live:
            try:
                codes[self.name(slot)] = proc.wait(GRACE_S + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[self.name(slot)] = None
        self.expected.clear()
        return codes

    @property
    def logs(self) -> list[Path]:
        return [p.log_path for p in self.procs if p.starts]


@contextlib.asynccontextmanager
async def frozen(procs: list[WorkerProcess]) -> AsyncIterator[None]:
    """SIGSTOP the given workers for a consistent outside view; SIGCONT whatever happens."""
    stopped = []
    try:
        for proc in procs:
            if proc.running:
                os.kill(proc.pid, signal.SIGSTOP)
                stopped.append(proc)
        yield
    finally:
        for proc in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)


# --- progress, read from the outside ---


def make_outside(settings: Settings, cfg: ChaosConfig) -> Outside:
    """The plain-client reader of this run's Redis and topics (tests/chaos/outside.py)."""
    outcomes = settings.outcomes_topic()
    assert outcomes is not None
    return Outside(
        bootstrap=settings.kafka.bootstrap_servers,
        redis_url=settings.redis.url.get_secret_value(),
        prefix=settings.redis.effective_prefix,
        group=settings.kafka.group_id,
        sources=source_partitions(settings, cfg),
        dead_letter_topics={t: f"{t}.dlq" for t in settings.topics.values()},
        outcomes_topic=outcomes,
        cluster=settings.redis.cluster,
    )


EMIT_PARTITIONS = 3


def emit_topic(settings: Settings) -> str:
    """The run's topic the claiming handler announces its grants on (its own per run)."""
    return f"{settings.topics[CLAIMED]}-granted"


def source_partitions(settings: Settings, cfg: ChaosConfig) -> dict[str, int]:
    return {
        settings.topics[PAYMENTS]: cfg.partitions,
        settings.topics[CLAIMED]: cfg.claimed_partitions,
    }


class Progress:
    """Ledger length and committed offsets, polled often by the driver."""

    def __init__(self, outside: Outside) -> None:
        self.outside = outside

    async def ledger(self) -> int | None:
        """None while Redis is down (on purpose, during a restart)."""
        try:
            return await self.outside.ledger_length()
        except (RedisError, OSError):
            return None

    async def committed_offsets(self) -> dict[TP, int]:
        return {tp: c or 0 for tp, c in (await self.outside.committed()).items()}

    async def committed(self) -> int:
        return sum((await self.committed_offsets()).values())

    async def value(self, metric: Metric) -> int | None:
        return await self.ledger() if metric == "ledger" else await self.committed()


def _probe_value(payment_id: str) -> bytes:
    return json.dumps(
        {
            "payment_id": payment_id,
            "user_id": "user_probe",
            "product_id": "sku_probe",
            "amount_minor": 100,
            "currency": "EUR",
            "status": "succeeded",
        }
    ).encode()


class GatedProducer:
    """Produces in chunks, paced by the ledger and never past `allowed` records.

    The driver raises `allowed` fault by fault, so production is still going on when
    each fault fires and the faults land mid-run however fast the workers are.
    """

    def __init__(self, settings: Settings, records: list[Routed], cfg: ChaosConfig) -> None:
        self.settings = settings
        self.records = records
        self.cfg = cfg
        self.placed: list[Placed] = []
        self.probes: list[Routed] = []  # extra records, outside the plan
        self.allowed = 0
        self._granted: set[str] = set()
        self._producer = AIOKafkaProducer(
            linger_ms=5, acks="all", **connection_kwargs(settings.kafka)
        )

    async def start(self) -> None:
        await self._producer.start()

    async def close(self) -> None:
        await self._producer.stop()

    def allow(self, upto: int) -> None:
        self.allowed = max(self.allowed, min(upto, len(self.records)))

    def ends(self) -> dict[TP, int]:
        """One past the last offset produced, per source partition (0 where none was)."""
        out = {tp: 0 for tp in self._all_partitions()}
        for p in self.placed:
            out[(p.topic, p.partition)] = max(out[(p.topic, p.partition)], p.offset + 1)
        return out

    def _all_partitions(self) -> list[TP]:
        return [
            (topic, p)
            for topic, n in source_partitions(self.settings, self.cfg).items()
            for p in range(n)
        ]

    async def probe(self, hang: bool, tag: str) -> list[str]:
        """One extra record to every partition of both topics, so every worker gets one.

        A hanging probe keeps its partition's owner inside a handler for the handler
        timeout (so a busy worker can be caught); a valid one gives every worker something
        to finish and commit. Returns the probes' payment ids.
        """
        made: list[tuple[Routed, str, int]] = []
        for topic, partition in self._all_partitions():
            handler: Handler = CLAIMED if topic == self.settings.topics[CLAIMED] else PAYMENTS
            prefix = "cprobe" if handler == CLAIMED else "probe"
            payment_id = f"{prefix}_{self.cfg.seed}_{tag}_{partition}"
            key, value = payment_id.encode(), _probe_value(payment_id)
            record = (
                HangingRecord("ok", payment_id, key, value, [("x-fault", b"hang")])
                if hang
                else sample.SampleRecord("ok", payment_id, key, value)
            )
            routed = Routed(handler, record)
            self.probes.append(routed)  # before the send: it may be granted before the ack
            made.append((routed, topic, partition))
        futures = [
            await self._producer.send(
                topic,
                key=r.record.key,
                value=r.record.value,
                headers=r.record.headers or None,
                partition=p,
            )
            for r, topic, p in made
        ]
        for (routed, topic, _), fut in zip(made, futures, strict=True):
            meta = await fut
            self.placed.append(Placed(routed, topic, meta.partition, meta.offset))
        return [str(r.payment_id) for r, _, _ in made]

    async def run(self, progress: Progress) -> None:
        # The driver's own waits are bounded; this one only has to outlast all of them.
        stall_timeout = self.cfg.step_timeout_s * 4
        start = 0
        while start < len(self.records):

            async def ready(start: int = start) -> bool:
                if self.allowed <= start:
                    return False
                ledger = await progress.ledger()
                return ledger is not None and ledger >= len(self._granted) - self.cfg.ahead

            await await_until(ready, stall_timeout, interval=0.05, message="production stalled")
            batch = self.records[start : min(start + self.cfg.chunk, self.allowed)]
            topics = [self.settings.topics[r.handler] for r in batch]
            futures = [
                await self._producer.send(
                    topic,
                    key=r.record.key,
                    value=r.record.value,
                    headers=r.record.headers or None,
                )
                for r, topic in zip(batch, topics, strict=True)
            ]
            for record, topic, fut in zip(batch, topics, futures, strict=True):
                meta = await fut
                self.placed.append(Placed(record, topic, meta.partition, meta.offset))
                if record.expect_grant and record.payment_id:
                    self._granted.add(record.payment_id)
            start += len(batch)


# --- checks, from the outside ---


def durable_problems(
    state: View, placed: list[Placed], records: list[Routed], when: str
) -> list[str]:
    """Below the committed offsets, every record has a durable fate; nobody granted twice.

    A duplicate delivery has no home of its own when its payment was granted from the
    other copy, so a record whose payment is in the ledger counts as accounted for.
    """
    problems = []
    doubled = {k: v for k, v in state.grants.items() if v > 1}
    if doubled:
        problems.append(f"{when}: granted more than once: {sorted(doubled.items())[:10]}")
    homes = state.granted_at | state.parked | state.dead_at
    lost = [
        p
        for p in placed
        if p.offset < (state.committed.get((p.topic, p.partition)) or 0)
        and p.where not in homes
        and not (p.record.expect_grant and p.record.payment_id in state.grants)
    ]
    if lost:
        examples = [(*p.where, p.record.kind) for p in lost[:10]]
        problems.append(
            f"{when}: {len(lost)} records below the committed offsets have no durable fate, "
            f"e.g. {examples}; committed={state.committed}"
        )
    # From all records: one may be granted before its produce batch is acknowledged.
    expected = {r.payment_id for r in records if r.expect_grant}
    if unexpected := sorted(set(state.grants) - expected):
        problems.append(f"{when}: granted payments that must not be: {unexpected[:10]}")
    return problems


_OVERLAP = re.compile(re.escape(claiming.OVERLAP) + r" dedupe_key=(\S+) holder=(\S+) me=(\S+)")
_LEFT = re.compile(re.escape(claiming.LEFT) + r" token=(\S+)")


def overlapping_runs(logs: Iterable[Path]) -> tuple[list[str], int]:
    """Runs of one key that overlapped (the claiming handler's own watch), from the logs.

    A run that met a marker its holder logged as left behind (Redis was down when it
    tried to remove it) is not an overlap: the holder had ended. Returns the overlaps
    and how many were excused that way.
    """
    found: list[tuple[str, str, str]] = []
    left: set[str] = set()
    for log in logs:
        with contextlib.suppress(OSError):
            text = log.read_text(errors="replace")
            found.extend(m.groups() for m in _OVERLAP.finditer(text))  # type: ignore[misc]
            left.update(m.group(1) for m in _LEFT.finditer(text))
    overlaps = [
        f"{key}: {me} ran while {holder} ran" for key, holder, me in found if holder not in left
    ]
    return overlaps, len(found) - len(overlaps)


@dataclass
class EndState:
    """What the end check read besides the settled view."""

    high: dict[TP, int]
    markers: Counter[str]
    claims_left: list[str]
    events: list[dict[str, Any]]
    overlaps: list[str]
    overlaps_excused: int
    # The claiming handler's announced grants; None when the run's workers emit nothing
    # (a rolling upgrade from releases without the outbox).
    emitted: list[Emitted] | None = None


async def read_end_state(
    outside: Outside, ends: dict[TP, int], logs: list[Path], emitted_topic: str | None = None
) -> EndState:
    markers, claims = await outside.idempotency_markers()
    overlaps, excused = overlapping_runs(logs)
    return EndState(
        high=await outside.high_watermarks(ends),
        markers=markers,
        claims_left=claims,
        events=await outside.outcome_events(),
        overlaps=overlaps,
        overlaps_excused=excused,
        emitted=(
            None if emitted_topic is None else await outside.emitted(emitted_topic, EMIT_PARTITIONS)
        ),
    )


def final_verdict(state: View, end: EndState, placed: list[Placed], problems: list[str]) -> Verdict:
    """The end state against what the mix says must have become of each record."""
    expected = {str(p.record.payment_id) for p in placed if p.record.expect_grant}
    lost = sorted(expected - set(state.grants))
    doubled = {k: v for k, v in state.grants.items() if v != 1}
    unexpected = sorted(set(state.grants) - expected)
    want_dead = {
        p.where: str(p.record.expect_dead_letter) for p in placed if p.record.expect_dead_letter
    }
    dead_missing = sorted(set(want_dead) - state.dead_at)
    dead_unexpected = sorted(state.dead_at - set(want_dead))
    wrong = sorted(
        (*d.source, d.reason) for d in state.dead if want_dead.get(d.source, d.reason) != d.reason
    )
    no_error = [d for d in state.dead if not d.error]
    by_reason = Counter(d.reason for d in {d.source: d for d in state.dead}.values())
    behind = [
        f"{tp[0]}[{tp[1]}]: committed {state.committed.get(tp)} != high watermark {h}"
        for tp, h in sorted(end.high.items())
        if state.committed.get(tp) != h
    ]
    keyed_dead = {
        p.record.payment_id
        for p in placed
        if p.record.expect_dead_letter and p.record.payment_id is not None
    }
    seen = {(e.get("topic"), e.get("partition"), e.get("offset")) for e in end.events}
    outcome_missing = sorted(p.where for p in placed if p.where not in seen)
    succeeded = Counter(e.get("dedupe_key") for e in end.events if e.get("event") == "succeeded")
    succeeded_twice = sorted(str(k) for k, n in succeeded.items() if n > 1)
    claimed_granted = {
        str(p.record.payment_id)
        for p in placed
        if p.record.handler == CLAIMED and p.record.payment_id in state.grants
    }

    problems = list(problems)
    if lost:
        problems.append(f"lost: {len(lost)} valid payments never granted, e.g. {lost[:10]}")
    if doubled:
        problems.append(f"doubled: {len(doubled)} payments granted more than once: {doubled}")
    if unexpected:
        problems.append(f"granted payments that must not be: {unexpected[:10]}")
    if dead_missing:
        problems.append(f"lost: {len(dead_missing)} dead letters missing at {dead_missing[:10]}")
    if dead_unexpected:
        problems.append(f"unexpected dead letters at {dead_unexpected[:10]}")
    if wrong:
        problems.append(f"dead letters with the wrong reason: {wrong[:10]}")
    if no_error:
        problems.append(f"{len(no_error)} dead letters without x-dlq-error")
    problems.extend(behind)
    if state.retry_depth != (0, 0, 0):
        problems.append(f"retry queue not empty (due, inflight, items): {state.retry_depth}")
    if end.claims_left:
        problems.append(
            f"{len(end.claims_left)} idempotency keys not done/dead, e.g. {end.claims_left[:5]}"
        )
    if end.markers["d"] != len(expected):
        problems.append(f"{end.markers['d']} done-markers for {len(expected)} granted payments")
    if end.markers["x"] != len(keyed_dead):
        problems.append(f"{end.markers['x']} dead-markers for {len(keyed_dead)} keyed dead letters")
    if outcome_missing:
        problems.append(
            f"{len(outcome_missing)} records without an outcome event, e.g. {outcome_missing[:10]}"
        )
    if succeeded_twice:
        problems.append(f"`succeeded` emitted twice for {succeeded_twice[:10]}")
    emitted = EmittedCheck(0, 0, [])
    if end.emitted is not None:
        emitted = check_emitted(end.emitted, every_step(claimed_granted), claimed_event_id)
        problems.extend(emitted.problems)
    if end.overlaps:
        problems.append(
            f"{len(end.overlaps)} runs of a claimed key overlapped another run of it: "
            f"{end.overlaps[:5]}"
        )
    return Verdict(
        expected_grants=len(expected),
        claimed_grants=len(claimed_granted),
        lost=lost,
        doubled=doubled,
        unexpected_grants=unexpected,
        dead_missing=dead_missing,
        dead_unexpected=dead_unexpected,
        dead_wrong_reason=wrong,
        dead_by_reason=by_reason,
        dead_extra_copies=len(state.dead) - len(state.dead_at),
        offsets_behind=behind,
        retry_depth=state.retry_depth,
        claims_left=end.claims_left,
        markers=end.markers,
        outcome_missing=outcome_missing,
        succeeded_twice=succeeded_twice,
        overlaps=end.overlaps,
        overlaps_excused=end.overlaps_excused,
        emitted_events=emitted.events,
        emitted_duplicates=emitted.duplicates,
        problems=problems,
    )


def claimed_event_id(e: Emitted) -> str:
    """The id the claiming handler's grant must give this event, whichever copy it is."""
    return event_id(claiming.NAME, e.payment_id, STEPS.index(e.step))


# --- the run ---


class ChaosRun:
    """One run: the driver that fires the plan, and the state it keeps for the report."""

    def __init__(
        self,
        cfg: ChaosConfig,
        *,
        bootstrap: str,
        redis: RedisSide,
        name: str,
        work_dir: Path,
        say: Say = print,
    ) -> None:
        self.cfg = cfg
        self.redis = redis
        self.say = say
        self.rng = random.Random(cfg.seed)
        if isinstance(redis, RedisCluster):
            # A primary that does not own the service's slot and is never killed: every
            # worker, started at any moment, finds the slot's owner from it.
            owner = redis.node_for_slot(slot_of(name))
            entry = next(node for node in redis.primaries() if node is not owner)
            self.settings = chaos_settings(bootstrap, entry.url, name, cfg, cluster=True)
        else:
            self.settings = chaos_settings(bootstrap, redis.url, name, cfg)
        self.records = make_mix(cfg)
        self.plan = plan_faults(cfg, self.records, self.rng)
        self.pool = Pool(self.settings, work_dir, name)
        self.producer = GatedProducer(self.settings, self.records, cfg)
        self.outside = make_outside(self.settings, cfg)
        self.progress = Progress(self.outside)
        # Every partition of both topics: what a settled group holds between its members.
        self.partitions = cfg.partitions + cfg.claimed_partitions
        self.faults: list[FaultRecord] = []
        self.problems: list[str] = []
        self._producing: asyncio.Task[None] | None = None
        self._t0 = 0.0

    async def execute(self) -> ChaosReport:
        cfg = self.cfg
        for handler in (PAYMENTS, CLAIMED):
            mine = [r for r in self.records if r.handler == handler]
            kinds = Counter(r.kind for r in mine)
            hangs = sum(1 for r in mine if r.hangs)
            self.say(
                f"seed {cfg.seed}, {handler}: {len(mine)} records to "
                f"{self.settings.topics[handler]} ({dict(kinds)}, of which hanging {hangs})"
            )
        self.say(f"plan ({self.partitions} partitions in all):")
        for i, fault in enumerate(self.plan, 1):
            self.say(f"  #{i} {fault.describe()}")
        await prepare_topics(
            self.settings,
            partitions=cfg.partitions,
            partitions_of={CLAIMED: cfg.claimed_partitions},
        )
        await create_topics(
            self.settings.kafka.bootstrap_servers, {emit_topic(self.settings): EMIT_PARTITIONS}
        )
        await self.outside.start()
        await self.producer.start()
        try:
            self.pool.start(0)
            await self._wait(
                lambda: self.pool.held_by_all(self.partitions), "w0 never got every partition"
            )
            self._t0 = time.monotonic()
            self._producing = asyncio.create_task(self.producer.run(self.progress))
            self.producer.allow(self._gate(0))
            for i, fault in enumerate(self.plan):
                await self._wait(
                    functools.partial(self._reached, fault.trigger),
                    f"trigger of #{i + 1} {fault.describe()} never met",
                    interval=0.1,
                )
                self.producer.allow(self._gate(i + 1))
                await self._fire(i + 1, fault)
            self.producer.allow(len(self.records))
            await self._wait(self._produced_all, "production never finished")
            ends = self.producer.ends()
            try:
                final = await wait_settled(self.outside, ends, timeout=cfg.settle_timeout_s)
            except AssertionError as exc:
                self.problems.append(f"the run did not settle: {exc}")
                final = await self.outside.view()
            duration = time.monotonic() - self._t0
            try:  # the relay publishes what FINISH wrote: the outbox empties once settled
                await await_until(lambda: self._outbox_empty(), cfg.settle_timeout_s, interval=0.2)
            except AssertionError:
                self.problems.append(
                    f"the outbox never drained: {await self.outside.outbox_length()} waiting"
                )
            await self._settled_for_sigterm(self.pool.running_slots())
            for name, code in self.pool.stop_all().items():
                if code != 0:
                    self.problems.append(f"{name} exited with {code} on the final SIGTERM")
            end = await read_end_state(
                self.outside, ends, self.pool.logs, emit_topic(self.settings)
            )
            verdict = final_verdict(final, end, self.producer.placed, self.problems)
        finally:
            self.pool.stop_all()
            if self._producing is not None and not self._producing.done():
                self._producing.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._producing
            await self.producer.close()
            await self.outside.close()
        rebalances, assignments = rebalance_rounds(self.pool.logs)
        return ChaosReport(
            config=cfg,
            plan=self.plan,
            faults=self.faults,
            verdict=verdict,
            produced=len(self.producer.placed),
            probes=len(self.producer.probes),
            duration_s=duration,
            rebalances=rebalances,
            assignments=assignments,
            worker_logs=self.pool.logs,
        )

    # -- waiting --

    async def _outbox_empty(self) -> bool:
        return await self.outside.outbox_length() == 0

    async def _wait(
        self,
        predicate: Callable[[], Awaitable[object] | object],
        message: str | Callable[[], str],
        *,
        interval: float = 0.2,
    ) -> None:
        """Wait with the step deadline; fail fast when a worker or the producer died."""

        async def check() -> object:
            self.pool.check_alive()
            if self._producing is not None and self._producing.done():
                self._producing.result()  # raises what killed the producer
            outcome = predicate()
            return await outcome if asyncio.iscoroutine(outcome) else outcome

        await await_until(check, self.cfg.step_timeout_s, interval=interval, message=message)

    async def _reached(self, trigger: Trigger) -> bool:
        value = await self.progress.value(trigger.metric)
        return value is not None and value >= trigger.threshold

    async def _settled_for_sigterm(self, slots: list[int]) -> None:
        """Wait until a SIGTERM to these workers reaches their shutdown path at once."""
        if self.cfg.sigterm_mid_rebalance:
            await self._wait(lambda: self.pool.started(slots), "a worker never started")
        else:
            await self._wait(
                lambda: self.pool.held_by_all(self.partitions),
                "the group never settled before a SIGTERM",
            )

    def _produced_all(self) -> bool:
        return self._producing is not None and self._producing.done()

    def _gate(self, index: int) -> int:
        """How far production may run before fault `index` (0-based) has fired."""
        if index >= len(self.plan):
            return len(self.records)
        position = self.plan[index].trigger.position + self.cfg.ahead
        # Keep records back until the last fault has fired, so it hits a run in progress.
        return min(position, len(self.records) - self.cfg.ahead)

    # -- faults --

    async def _fire(self, index: int, fault: PlannedFault) -> None:
        fired = time.monotonic()
        record = FaultRecord(
            index=index,
            kind=fault.kind,
            trigger=fault.trigger.describe(),
            target="",
            fired_at_s=fired - self._t0,
            took_s=0.0,
            produced=len(self.producer.placed),
            ledger=await self.progress.ledger(),
        )
        if record.produced >= len(self.records):
            self.problems.append(f"fault #{index} fired after everything was produced")
        handler = {
            "kill": self._kill,
            "sigterm": self._sigterm,
            "redis": self._restart_redis,
            "scale_up": self._scale_up,
            "scale_down": self._scale_down,
        }[fault.kind]
        await handler(fault, record)
        record.took_s = time.monotonic() - fired
        self.faults.append(record)
        self.say(_describe_fault(record))

    async def _kill(self, fault: PlannedFault, record: FaultRecord) -> None:
        """SIGKILL; restart at once, or (seeded, when others run) once they took over."""
        slot = self.pool.pick(fault.pick)
        record.target = self.pool.name(slot)
        self.pool.expected.discard(slot)
        self.pool.procs[slot].kill()
        await self._check_durable(f"after SIGKILL of {record.target}")
        if self.pool.expected and fault.compound:
            await self._wait(
                lambda: self.pool.held_by_all(self.partitions),
                f"the survivors never took over the partitions of {record.target}",
            )
            record.note = "restarted after the survivors took over"
        self.pool.start(slot)

    async def _sigterm(self, fault: PlannedFault, record: FaultRecord) -> None:
        """SIGTERM while the worker is inside a batch's handlers (running a hanging probe)."""
        slot = self.pool.pick(fault.pick)
        proc = self.pool.procs[slot]
        record.target = self.pool.name(slot)
        await self._settled_for_sigterm([slot])

        watch = HangWatch(proc, [])
        probes = await self.producer.probe(hang=True, tag=f"f{record.index}")
        watch.ids.update(probes)
        await self._wait(watch, f"{record.target} never ran a hanging probe", interval=0.05)
        assert self.pool.started([slot]), "runs a handler, so it runs"
        self.pool.expected.discard(slot)
        proc.terminate()
        stopped = time.monotonic()
        try:
            code: int | None = await asyncio.to_thread(proc.wait, GRACE_S + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        took = time.monotonic() - stopped
        record.note = f"exit {code} after {took:.1f}s"
        if code != 0:
            self.problems.append(f"{record.target} exited with {code} after SIGTERM")
        if took > GRACE_S + EXIT_SLACK_S:
            self.problems.append(
                f"{record.target} took {took:.1f}s to stop after SIGTERM (grace {GRACE_S}s)"
            )
        await self._check_durable(f"after SIGTERM of {record.target}")
        self.pool.start(slot)

    async def _restart_redis(self, fault: PlannedFault, record: FaultRecord) -> None:
        """Kill Redis, let the workers fail `param` more calls, restart it on the same port.

        Compound (seeded): meanwhile SIGKILL a worker and start it again against the dead
        Redis; it must wait at its start-up check, not give up.

        On a cluster: SIGKILL the primary of the service's slot instead; once the workers
        felt it, wait for its replica to take over and restart the killed node, which
        rejoins as the new primary's replica (until then no write has its replica's
        acknowledgement, so the workers keep retrying). What is committed must then be
        durable on the new primary.
        """
        since = self.pool.log_sizes()
        killed: RedisServer | None = None
        if isinstance(self.redis, RedisCluster):
            slot = slot_of(self.settings.redis.key_prefix)
            killed = self.redis.kill_primary(self.redis.node_for_slot(slot))
            record.target = f"redis:{killed.port}"
        else:
            record.target = "redis"
            self.redis.kill()

        def every_worker_felt_it() -> bool:
            return all(n >= fault.param for n in self.pool.retries_logged(since).values())

        down = time.monotonic()
        try:
            await self._wait(
                every_worker_felt_it,
                f"the workers did not retry a Redis call {fault.param} times each",
            )
            if fault.compound:
                slot = self.pool.pick(fault.pick)
                self.pool.expected.discard(slot)
                self.pool.procs[slot].kill()
                self.pool.start(slot)
                await self._wait(
                    lambda: self.pool.procs[slot].log_count(REDIS_FAILED) >= 1,
                    f"{self.pool.name(slot)}, restarted during the outage, never tried Redis",
                )
                record.kills_in_outage = 1
                record.note = f"{self.pool.name(slot)} SIGKILLed and restarted meanwhile; "
        finally:
            if killed is not None:
                await self._fail_over(killed, record)
            else:
                self.redis.restart()
        outage = time.monotonic() - down
        # Every record needs Redis to finish, so a worker whose partitions commit again has
        # reconnected; each running worker has to show it on a partition it holds.
        base = await self.progress.committed_offsets()
        await self.producer.probe(hang=False, tag=f"f{record.index}")
        waiting: list[str] = []

        async def all_reconnected() -> bool:
            now = await self.progress.committed_offsets()
            waiting[:] = [
                self.pool.name(slot)
                for slot in self.pool.running_slots()
                if not any(now[tp] > base[tp] for tp in held_partitions(self.pool.procs[slot]))
            ]
            return not waiting

        await self._wait(
            all_reconnected,
            lambda: f"no commit after the Redis restart on the partitions of {waiting}",
        )
        record.note += f"Redis down {outage:.1f}s"
        if killed is not None:
            await self._check_durable(f"after the failover of {record.target}")

    async def _fail_over(self, killed: RedisServer, record: FaultRecord) -> None:
        """Wait for a replica of the killed primary to take over; restart it as a replica."""
        assert isinstance(self.redis, RedisCluster)
        promoted = await asyncio.to_thread(self.redis.wait_failed_over, killed)
        await asyncio.to_thread(self.redis.restart, killed)
        record.note += f"failed over to {promoted.port}, {killed.port} back as its replica; "

    async def _scale_up(self, fault: PlannedFault, record: FaultRecord) -> None:
        idle = [s for s in range(MAX_WORKERS) if s not in self.pool.expected]
        record.target = "+" + ",".join(self.pool.name(s) for s in idle)
        for slot in idle:
            self.pool.start(slot)
        await self._wait(
            lambda: self.pool.held_by_all(self.partitions),
            f"{MAX_WORKERS} workers never shared the partitions",
        )

    async def _scale_down(self, fault: PlannedFault, record: FaultRecord) -> None:
        """SIGTERM all but one (seeded choice); the survivor must end up with everything.

        One at a time by default, each leave settled before the next: when two members
        leave at once, the dev broker now and then never completes the rebalance (seen
        with plain aiokafka consumers too, see docs/chaos.md).
        """
        slots = self.pool.running_slots()
        leaving = random.Random(fault.pick).sample(slots, len(slots) - 1)
        record.target = "-" + ",".join(self.pool.name(s) for s in leaving)
        waves = [leaving] if self.cfg.scale_down_at_once else [[s] for s in leaving]
        for wave in waves:
            await self._settled_for_sigterm(wave)
            for slot in wave:
                self.pool.expected.discard(slot)
                self.pool.procs[slot].terminate()
            for slot in wave:
                try:
                    code = await asyncio.to_thread(self.pool.procs[slot].wait, GRACE_S + 30)
                except subprocess.TimeoutExpired:
                    self.pool.procs[slot].kill()
                    code = None
                if code != 0:
                    self.problems.append(f"{self.pool.name(slot)} exited with {code} on scale-down")
            await self._wait(
                lambda: self.pool.held_by_all(self.partitions),
                f"the workers left after {record.target} never took every partition",
            )

    async def _check_durable(self, when: str) -> None:
        """With every worker stopped or frozen, what is committed must be durable.

        A request a worker sent just before SIGSTOP may still land, so the view is read
        until two reads in a row agree.
        """
        async with frozen(self.pool.running()):
            views: list[View] = []

            async def steady() -> bool:
                views.append(await self.outside.view())
                return len(views) > 1 and views[-1].same_as(views[-2])

            await await_until(steady, 30, interval=0.1, message=f"{when}: no steady view")
            placed = list(self.producer.placed)
            records = self.records + self.producer.probes
            self.problems.extend(durable_problems(views[-1], placed, records, when))


async def run_chaos(
    cfg: ChaosConfig,
    *,
    bootstrap: str,
    redis: RedisSide,
    name: str,
    work_dir: Path,
    say: Say = print,
) -> ChaosReport:
    """Run one chaos run against a broker and a Redis that outlive it; see the module doc."""
    run = ChaosRun(cfg, bootstrap=bootstrap, redis=redis, name=name, work_dir=work_dir, say=say)
    return await run.execute()


_ATTEMPT = re.compile(r"""\battempt"?[=:] ?(\d+)""")


def _highest_attempt(proc: WorkerProcess, needle: str, since: int) -> int:
    """The largest ``attempt`` among the log lines containing ``needle`` written past
    offset ``since`` by the process's current run (console ``attempt=N`` or JSON)."""
    run = proc.log_text()[since:].rsplit(f"===== start #{proc.starts} ", 1)[-1]
    found = (_ATTEMPT.search(line) for line in run.splitlines() if needle in line)
    return max((int(m.group(1)) for m in found if m), default=0)
