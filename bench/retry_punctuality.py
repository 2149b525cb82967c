"""Retry punctuality: does a retry due at 12:00:05 run at 12:00:05 when 100,000 are waiting?

This process parks 100,000 retries in the delay queue with the worker's own ``RetryQueue``
(the PARK script, as a payment that failed retryably is parked: attempt 2, in its Kafka key's
chain), due evenly over one minute. Then the worker starts as users run it (``service run``,
the payments handler, default settings; ``bench.service_process.ServiceRun``) and drains a
backlog of fresh payments; the first retry falls due some seconds after its first grant. Its
scheduler claims the retries as they fall due and runs them through the fresh records' path.
The same with the late retries' priority turned off (``WORKER_RETRY__PRIORITY_AFTER_MS=0``:
the intake fetches fresh records however late the retries are), and with the scheduler in a
process of its own (``service retry-scheduler``, the worker's turned off with
``WORKER_RUN_RETRY_SCHEDULER=false``): the deployment that gives it an event loop that the
fresh records do not share, and where the worker's intake hears nothing of the retries.
"no-turns" is the default with retries' turns off (``WORKER_RETRY__TURN_AFTER_MS=0``: fresh
waves pass their checkpoints without yielding, batch/lane.py). "no-fresh" is the worker with
no fresh backlog (its group starts at the topic's end): the
retry path's own punctuality, nothing else on the machine's cores but the servers at rest.
``--retries-parked N`` parks N in all: the rest fall due a day after the window, so the
queue is N deep while the same retries fall due in it. "fetched-run-on" is the priority
pausing only the fetches (``WORKER_RETRY__PRIORITY_HOLDS_FETCHED=false``: the records fetched
before the pause run on beside the retries, as before the retry lane); ``--retries-before-src
DIR`` adds a run of the defaults on the library in DIR (another checkout's src: the code
before a change) to every round; ``--retries-variants`` picks the runs.

Lateness is measured from the worker's own output (the oldest due retry's lateness is also
sampled four times a second from the queue itself): each grant's ledger entry carries
``granted_at`` (the host clock when the handler ran) and ``source`` (the retry's id), and the
delay queue holds each item's due time (Redis's clock, the same host's). Lateness = granted_at
- due. The fresh records granted meanwhile are the ledger's length minus the retries that
left the queue, sampled four times a second; the same worker without retries, over the same
window after its first grant, is the baseline of the same round.

A retry's coordinates are those of a record that was never fetched (offsets from 10**9 up in
the topic's partitions), so no fresh record's completion can drop it from the queue. Redis is
flushed (FLUSHALL) before and after each run: a minute of grants is a million keys.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import psutil
import redis.asyncio as aioredis
from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps
from reliable_consumer.engine.redis.delay_queue import ParkRequest, ParkStatus, RetryQueue
from reliable_consumer.engine.redis.keys import RedisKeys, tagged_prefix
from reliable_consumer.engine.settings import RedisSettings

from bench.latency import percentiles
from bench.report import Progress, Row, Target
from bench.service_process import ServiceRun, ledger_key, read_grants
from bench.stack import BenchStack, produce, sample_payment
from service.handlers.payments import EVENTS_TOPIC

if TYPE_CHECKING:
    from bench.__main__ import Options

PARTITIONS = 6
HANDLER = "payments"  # the example handler's name, which ``service run`` binds to the topic
# Parked retries' offsets start here: no fresh record of the backlog has such an offset.
RETRY_OFFSET_BASE = 10**9
PARK_CHUNK = 2_000  # retries per park_many call (RetryQueue sends them 500 per PARK script)
SAMPLE_EVERY_S = 0.25
FINISH_GRACE_S = 120.0  # after the last due time, how long the retries may take to run
LATER_S = 86_400  # the retries parked beyond the measured ones fall due this long after it
OFF = {"WORKER_RETRY__PRIORITY_AFTER_MS": "0"}  # late retries' priority off
# The priority pausing only the fetches: what was fetched runs on beside the retries (as
# before the retry lane, batch/lane.py).
FETCHED_RUN_ON = {"WORKER_RETRY__PRIORITY_HOLDS_FETCHED": "false"}
WINDOW_UNITS = {"window_s": "s", "worker_cpu": "% core", "redis_cpu": "% core"}


@dataclass(frozen=True)
class Sizes:
    retries: int
    spread_s: float  # due times evenly over this span
    # The first is due this long after parking starts: time to park (on an idle Redis), start
    # the worker, join the group and grant fresh records for a while before the window.
    lead_s: float
    fresh: int  # the backlog of fresh payments: enough to last until the span ends


FULL = Sizes(retries=100_000, spread_s=60.0, lead_s=30.0, fresh=1_200_000)
QUICK = Sizes(retries=5_000, spread_s=10.0, lead_s=12.0, fresh=400_000)


@dataclass
class Sample:
    at: float  # host clock, s
    ledger: int  # grants so far, fresh and retries
    parked: int  # retry items still in the queue
    behind: int  # of those, due and not yet claimed by the scheduler
    claimed: int  # of those, claimed and not yet finished (in flight)
    cpu_s: float  # the worker process's CPU time so far
    redis_cpu_s: float  # redis-server's CPU time so far
    oldest_late_ms: int = 0  # how late the oldest due, unclaimed retry is (0: none)


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    first_grant: float = 0.0  # host clock, s
    window: tuple[float, float] = (0.0, 0.0)  # host clock, s
    lateness_ms: list[int] = field(default_factory=list)
    parking_s: float = 0.0  # how long parking the retries took
    warm_s: float = 0.0  # the worker's first grant to the first due time
    later: int = 0  # retries parked a day out (they stay in the queue)


def _between(samples: list[Sample], at: float, pick: str) -> float:
    """A sampled counter (``ledger``, ``parked`` or ``cpu_s``) at ``at``, interpolated."""
    before = [s for s in samples if s.at <= at]
    after = [s for s in samples if s.at >= at]
    if not before:
        return float(getattr(samples[0], pick))
    if not after:
        return float(getattr(samples[-1], pick))
    a, b = before[-1], after[0]
    va, vb = float(getattr(a, pick)), float(getattr(b, pick))
    return va if b.at == a.at else va + (vb - va) * (at - a.at) / (b.at - a.at)


def in_window(result: RunResult, retries: int, backlog: int) -> dict[str, float]:
    """Over the window (cut short if the backlog ran out): fresh grants per second, the
    window's length, the worker's CPU per grant (µs, fresh and retries) and the worker's and
    Redis's CPU use (% of one core)."""
    samples, later = result.samples, result.later
    ran_out = next(
        (s.at for s in samples if s.ledger - (retries - s.parked + later) >= backlog), None
    )
    start, end = result.window[0], min(result.window[1], ran_out or result.window[1])

    def fresh(at: float) -> float:
        left = _between(samples, at, "parked") - later
        return _between(samples, at, "ledger") - (retries - left)

    def spent(pick: str) -> float:
        return _between(samples, end, pick) - _between(samples, start, pick)

    wall = max(end - start, 1e-9)
    return {
        "rate": (fresh(end) - fresh(start)) / wall,
        "window_s": wall,
        "cpu_us": spent("cpu_s") / max(spent("ledger"), 1.0) * 1e6,
        "worker_cpu": spent("cpu_s") / wall * 100,
        "redis_cpu": spent("redis_cpu_s") / wall * 100,
    }


def retry_delivery(topic: str, keys: RedisKeys, i: int, failed_ms: int, value: bytes) -> Delivery:
    """Retry ``i`` as the worker parks a payment that failed retryably: its first retry is
    next (attempt 2), and it waits in its Kafka key's chain (the default key order)."""
    partition, key = i % PARTITIONS, f"r{i}".encode()
    return Delivery(
        topic=topic,
        partition=partition,
        offset=RETRY_OFFSET_BASE + i,
        key=key,
        value=value,
        headers=(),
        timestamp_ms=failed_ms,
        attempt=2,
        first_failed_ms=failed_ms,
        last_error="RetryableError: payment provider timed out (bench)",
        chain=keys.retry_chain(topic, partition, key),
    )


async def redis_ms(client: aioredis.Redis) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1000 + int(micros) // 1000


async def park_later(
    queue: RetryQueue, client: aioredis.Redis, keys: RedisKeys, topic: str, first: int, count: int
) -> None:
    """Park ``count`` retries (numbered from ``first``) due a day from now: they fill the
    queue and stay in it while the measured ones fall due."""
    failed_ms = await redis_ms(client) - 1000
    value = sample_payment(random.Random(8), "later")
    for start in range(first, first + count, PARK_CHUNK):
        requests = [
            ParkRequest(
                delivery=retry_delivery(topic, keys, i, failed_ms, value),
                delay_ms=LATER_S * 1000,
                idem_key="",
                token="",
                handler=HANDLER,
            )
            for i in range(start, min(start + PARK_CHUNK, first + count))
        ]
        statuses = await queue.park_many(requests)
        if any(s is not ParkStatus.PARKED for s in statuses):
            raise RuntimeError(f"not parked: {sorted({str(s) for s in statuses})}")


async def park_retries(
    redis_url: str, prefix: str, topic: str, sizes: Sizes, run: str, *, later: int = 0
) -> dict[str, int]:
    """Park ``later`` retries due a day from now, then the measured ones due evenly over the
    span, the first ``lead_s`` after these start parking; returns each measured retry id's
    due time (ms) as the queue holds it. Raises if parking did not end well before the first
    due time (the row would measure parking, not the scheduler)."""
    settings = RedisSettings(url=redis_url, key_prefix=prefix)
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(settings.effective_prefix)
    queue = RetryQueue(RedisOps(client, settings), keys)
    rng = random.Random(7)
    try:
        if later:
            await park_later(queue, client, keys, topic, sizes.retries, later)
        failed_ms = await redis_ms(client) - 1000
        deliveries = [
            retry_delivery(topic, keys, i, failed_ms, sample_payment(rng, f"{run}-retry-{i:07d}"))
            for i in range(sizes.retries)
        ]
        first_due = await redis_ms(client) + round(sizes.lead_s * 1000)
        step = sizes.spread_s * 1000 / sizes.retries
        due: dict[str, int] = {}
        for start in range(0, sizes.retries, PARK_CHUNK):
            chunk = deliveries[start : start + PARK_CHUNK]
            now = await redis_ms(client)  # PARK adds each delay to its own TIME, a moment later
            requests = [
                ParkRequest(
                    delivery=delivery,
                    delay_ms=first_due + round((start + j) * step) - now,
                    idem_key="",  # effects-only: no claim is held when it fails
                    token="",
                    handler=HANDLER,
                )
                for j, delivery in enumerate(chunk)
            ]
            statuses = await queue.park_many(requests)
            if any(s is not ParkStatus.PARKED for s in statuses):
                raise RuntimeError(f"not parked: {sorted({str(s) for s in statuses})}")
            ids = [d.retry_id for d in chunk]
            scores: list[float | None] = await client.zmscore(keys.retry_due, ids)
            for retry_id, score in zip(ids, scores, strict=True):
                if score is None:  # claimed already: it fell due while parking went on
                    raise RuntimeError(f"retry {retry_id} fell due before parking ended")
                due[retry_id] = int(score)
        left_ms = first_due - await redis_ms(client)
        if left_ms < sizes.lead_s * 1000 / 2:
            raise RuntimeError(
                f"parking left {left_ms} ms of the {sizes.lead_s:.0f} s lead: raise the lead"
            )
        return due
    finally:
        await client.aclose()


def read_lateness(redis_url: str, prefix: str, topic: str, due: dict[str, int]) -> list[int]:
    """granted_at - due (ms) of every retry the ledger shows granted, ascending. Only entries
    from just before the first due time are read (a stream id is Redis's clock at FINISH)."""
    after = f"{min(due.values()) - 1000}-0".encode()
    out: list[int] = []
    for grant in read_grants(redis_url, prefix, after=after):
        retry_due = due.get(f"{topic}/{grant.partition}/{grant.offset}")
        if retry_due is not None and grant.granted_at_ms is not None:
            out.append(grant.granted_at_ms - retry_due)
    return sorted(out)


async def sample_until(
    workers: list[ServiceRun],
    client: aioredis.Redis,
    redis_process: psutil.Process,
    result: RunResult,
    deadline: float,
    *,
    until_unparked: bool,
) -> None:
    """Sample grants, parked items and CPU until the host clock reaches ``deadline`` or,
    with ``until_unparked``, until no retry is left in the queue after the window opened.
    The CPU is the sum over ``workers`` (the consumer, and the scheduler when separate)."""
    keys = RedisKeys(tagged_prefix(workers[0].prefix))
    ledger = ledger_key(workers[0].prefix)
    while True:
        for worker in workers:
            worker.check_alive()
        pipe = client.pipeline(transaction=True)  # the counts of one moment
        pipe.xlen(ledger)
        pipe.hlen(keys.retry_items)
        pipe.zcount(keys.retry_due, "-inf", int(time.time() * 1000))  # same host: same clock
        pipe.zcard(keys.retry_inflight)
        pipe.zrangebyscore(keys.retry_due, "(0", "+inf", start=0, num=1, withscores=True)
        pipe.time()
        grants, parked, behind, claimed, head, server = await pipe.execute()
        redis_now = int(server[0]) * 1000 + int(server[1]) // 1000
        oldest_late = max(0, redis_now - int(head[0][1])) if head else 0
        redis_cpu = redis_process.cpu_times()
        now = time.time()
        result.samples.append(
            Sample(
                at=now,
                ledger=int(grants),
                parked=int(parked),
                behind=int(behind),
                claimed=int(claimed),
                cpu_s=sum(worker.cpu_seconds() for worker in workers),
                redis_cpu_s=redis_cpu.user + redis_cpu.system,
                oldest_late_ms=oldest_late,
            )
        )
        measured = parked - result.later  # the retries parked a day out stay
        if now >= deadline or (until_unparked and measured <= 0 and now > result.window[0]):
            return
        await asyncio.sleep(SAMPLE_EVERY_S)


async def first_grant(worker: ServiceRun, client: aioredis.Redis, timeout_s: float) -> float:
    """The host time of the worker's first grant (polled every 50 ms)."""
    ledger = ledger_key(worker.prefix)
    deadline = time.monotonic() + timeout_s
    while not await client.xlen(ledger):
        worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no grant within {timeout_s:.0f} s of /readyz")
        await asyncio.sleep(0.05)
    return time.time()


async def measure(
    workers: list[ServiceRun],
    stack: BenchStack,
    sizes: Sizes,
    due: dict[str, int] | None,
    window_at: float,
    *,
    later: int = 0,
    fresh: bool = True,
) -> RunResult:
    """One run on started, ready workers (the consumer first). With the retries' ``due``
    times the window is their span, and the run lasts until all ran; without, the window
    opens ``window_at`` s after the first grant and is as long (the baseline). Without a
    ``fresh`` backlog the warm-up is counted from readiness: no grant comes before the
    first retry's."""
    client = aioredis.Redis.from_url(stack.redis_url)
    assert stack.redis.pid is not None
    redis_process = psutil.Process(stack.redis.pid)
    consumer = workers[0]
    result = RunResult(later=later)
    try:
        result.first_grant = (
            await first_grant(consumer, client, 120.0) if fresh or due is None else time.time()
        )
        if due is None:
            opens = result.first_grant + window_at
            result.window = (opens, opens + sizes.spread_s)
            await sample_until(
                workers, client, redis_process, result, result.window[1], until_unparked=False
            )
            return result
        result.window = (min(due.values()) / 1000, max(due.values()) / 1000)
        result.warm_s = result.window[0] - result.first_grant
        if result.warm_s < 1.0:
            raise RuntimeError(
                f"the worker's first grant came {-result.warm_s:.1f} s after the first due "
                "time: raise the lead"
            )
        deadline = result.window[1] + FINISH_GRACE_S
        await sample_until(workers, client, redis_process, result, deadline, until_unparked=True)
        for worker in workers:
            worker.stop()
        result.lateness_ms = read_lateness(stack.redis_url, consumer.prefix, consumer.topic, due)
        return result
    finally:
        await client.aclose()


# The runs of a round: the scheduler in the worker with its late retries' priority on (the
# default), with the priority pausing only the fetches, and off; then in a process of its own.
VARIANTS: dict[str, str] = {
    "priority": "scheduler in `service run`",
    "fetched-run-on": "the same, fetched records not held (PRIORITY_HOLDS_FETCHED=false)",
    "no-priority": "the same, priority off (PRIORITY_AFTER_MS=0)",
    "separate": "`service retry-scheduler`",
    "no-fresh": "scheduler in `service run`, no fresh backlog (the retries alone)",
    "no-turns": "the same as the first, retries' turns off (TURN_AFTER_MS=0)",
}
NO_TURNS = {"WORKER_RETRY__TURN_AFTER_MS": "0"}  # fresh waves neither yield nor wait
# The group starts at the topic's end: the worker fetches nothing, so the retries' lateness
# is the retry path's own, with nothing else on the machine's cores but the servers at rest.
NO_FRESH = {"WORKER_KAFKA__AUTO_OFFSET_RESET": "latest"}


BASELINE = "baseline"  # the worker without retries, for the fresh records' rate
# With --retries-before-src: the defaults' run on the library of another checkout.
BEFORE = "before"


class RetryPunctualityGroup:
    """Rows: lateness of 100,000 parked retries with the scheduler in the worker (as
    ``service run`` runs it) with and without the late retries' priority, and in a process
    of its own (``service retry-scheduler``), and the worker's fresh throughput meanwhile,
    beside a baseline without retries."""

    def __init__(self, options: Options) -> None:
        self.sizes = QUICK if options.quick else FULL
        parked_in_all = options.retries_parked or self.sizes.retries
        if parked_in_all < self.sizes.retries:
            raise ValueError(f"--retries-parked: at least {self.sizes.retries:,}")
        self.later = parked_in_all - self.sizes.retries
        if self.later:  # the worker starts beside a Redis that holds (and rewrites) them all
            self.sizes = replace(self.sizes, lead_s=self.sizes.lead_s * 2)
        self.before = options.baseline  # --baseline REV: that engine, variant "before"
        known = (*VARIANTS, BASELINE)
        if self.before is not None:
            known = (BEFORE, *known)
        chosen_names = options.retries_variants or known
        if unknown := [v for v in chosen_names if v not in known]:
            raise ValueError(f"unknown retries variants {unknown}; choose from {list(known)}")
        self.variants = tuple(v for v in chosen_names if v != BASELINE)
        self.with_baseline = BASELINE in chosen_names
        self.topic = ""
        parked = f"{self.sizes.retries:,} due over {self.sizes.spread_s:.0f} s"
        if self.later:
            parked += f" of {parked_in_all:,} parked"
        chosen = {v: self.label(v) for v in self.variants}
        self.lateness = {
            v: lateness_row(f"retry lateness, {parked}, {label}") for v, label in chosen.items()
        }
        self.oldest = {
            v: oldest_row(f"oldest due retry's lateness (sampled), {label}")
            for v, label in chosen.items()
        }
        self.fresh = {
            v: Row(f"fresh records meanwhile, {label}", "records/s") for v, label in chosen.items()
        }
        self.baseline = Row("fresh records, no retries (baseline)", "records/s")
        for row in (*self.fresh.values(), self.baseline):
            row.units.update(WINDOW_UNITS)

    def label(self, variant: str) -> str:
        if variant == BEFORE:
            assert self.before is not None
            return f"scheduler in `service run`, the engine {self.before.label}"
        return VARIANTS[variant]

    def prepare(self, stack: BenchStack, progress: Progress) -> None:
        self.topic = f"retries-{int(time.time())}"
        # The example's payments handler emits its events to EVENTS_TOPIC: it must exist.
        stack.create_topics({self.topic: PARTITIONS, EVENTS_TOPIC: PARTITIONS})
        progress(f"retries: producing {self.sizes.fresh:,} fresh payments to {self.topic}")
        asyncio.run(produce(stack.bootstrap, self.topic, self.sizes.fresh, prefix=self.topic))

    def _run(
        self, stack: BenchStack, name: str, variant: str, *, window_at: float | None
    ) -> RunResult:
        """Redis flushed; the retries parked (unless ``window_at`` is given: the baseline);
        then one worker (fresh group and prefix), with the priority off for "no-priority",
        and for "separate" a ``service retry-scheduler`` beside it, the worker's own
        scheduler turned off."""
        stack.flush_redis()
        due: dict[str, int] | None = None
        parking_s = 0.0
        if window_at is None:
            started = time.monotonic()
            due = asyncio.run(
                park_retries(stack.redis_url, name, self.topic, self.sizes, name, later=self.later)
            )
            parking_s = time.monotonic() - started

        def worker(command: str, env: dict[str, str]) -> ServiceRun:
            return ServiceRun(
                stack.bootstrap,
                stack.redis_url,
                self.topic,
                group=name,
                prefix=name,
                env=env,
                command=command,
            )

        separate = variant == "separate"
        env = {"WORKER_RUN_RETRY_SCHEDULER": "false"} if separate else {}
        if variant == BEFORE:
            assert self.before is not None
            env = self.before.env()  # ahead of the installed library
        elif variant == "no-priority":
            env = dict(OFF)
        elif variant == "fetched-run-on":
            env = dict(FETCHED_RUN_ON)
        elif variant == "no-fresh":
            env = dict(NO_FRESH)
        elif variant == "no-turns":
            env = dict(NO_TURNS)
        workers = [worker("run", env)]
        if separate:
            workers.append(worker("retry-scheduler", {}))
        try:
            for run in workers:
                run.start()
            for run in workers:
                run.wait_ready()
            later = self.later if due is not None else 0
            result = asyncio.run(
                measure(
                    workers,
                    stack,
                    self.sizes,
                    due,
                    window_at or 0.0,
                    later=later,
                    fresh=variant != "no-fresh",
                )
            )
            result.parking_s = parking_s
            return result
        finally:
            for run in workers:
                run.stop()
            stack.flush_redis()

    def round(self, stack: BenchStack, n: int, progress: Progress) -> None:
        retries = self.sizes.retries
        window_at = 0.0
        for variant in self.variants:
            label = self.label(variant)
            progress(f"retries: {retries:,} due retries ({self.later:,} more parked), {label}")
            name = f"{self.topic}-r{n}-{variant}"
            result = self._run(stack, name, variant, window_at=None)
            window_at = result.warm_s
            late = result.lateness_ms
            cuts = percentiles(late) if len(late) > 1 else {}
            if cuts:
                self.lateness[variant].add(
                    **cuts,
                    run=len(late),
                    behind_max=max(s.behind for s in result.samples),
                    in_flight_max=max(s.claimed for s in result.samples),
                    parking_s=result.parking_s,
                    warm_s=result.warm_s,
                )
            start, end = result.window
            oldest = [s.oldest_late_ms for s in result.samples if start <= s.at <= end]
            if len(oldest) > 1:
                self.oldest[variant].add(**percentiles(oldest))
            fresh = in_window(result, retries, self.sizes.fresh)
            self.fresh[variant].add(**fresh)
            p99 = f"{cuts['p99']:,.0f} ms" if cuts else "n/a"
            progress(
                f"retries: {len(late):,}/{retries:,} ran, p99 late {p99}; "
                f"fresh {fresh['rate']:,.0f}/s"
            )
        if not self.with_baseline:
            return
        progress("retries: baseline, the worker without retries")
        name = f"{self.topic}-r{n}-baseline"
        base = self._run(stack, name, "priority", window_at=window_at)
        values = in_window(base, 0, self.sizes.fresh)
        self.baseline.add(**values)
        progress(f"retries: baseline fresh {values['rate']:,.0f}/s")

    def rows(self) -> list[Row]:
        return [*self.lateness.values(), *self.oldest.values(), *self.fresh.values(), self.baseline]

    def summary(self) -> list[str]:
        return [
            "retries: lateness = the grant's granted_at (the payments handler's clock as it "
            "ran) - the retry's due time in the delay queue; run = retries granted within "
            f"{FINISH_GRACE_S:.0f} s of the last due time; behind_max = the most retries due "
            "and not yet claimed at once, in_flight_max the most claimed and not yet finished "
            "(sampled 4/s); parking_s = parking them, before the "
            "worker starts; warm_s = the worker's first grant to the first due time. "
            "Scheduler settings are the defaults (WORKER_RETRY__POLL_INTERVAL_MS 250, "
            "__CLAIM_BATCH 200, __LEASE_MS 60000; at most WORKER_MAX_IN_FLIGHT/4 retries in "
            "flight). The oldest due retry's lateness: Redis's now minus the earliest due, "
            "unclaimed item's due time, sampled 4/s over the window. Late retries' priority: "
            "WORKER_RETRY__PRIORITY_AFTER_MS (default 50; 0 in the priority-off run), "
            "__PRIORITY_MAX_PAUSE_MS (default 2000), __PRIORITY_HOLDS_FETCHED (default true; "
            "false in the fetched-run-on run).",
            "retries: fresh records/s = ledger growth minus the retries that left the queue, "
            "over the due times' span (window_s; shorter if the backlog ran out); cpu_us = "
            "worker CPU per grant there (fresh and retries; both processes when the scheduler "
            "is separate); worker_cpu, redis_cpu = % of one core. The baseline's window opens "
            "as long after its first grant. Redis is flushed before and after each run.",
        ]


def oldest_row(label: str) -> Row:
    """The oldest due, unclaimed retry's lateness over the window, sampled 4/s."""
    return Row(label, "ms")


def lateness_row(label: str) -> Row:
    return Row(
        label,
        "ms",
        targets=[Target("p99", 100.0)],
        units={
            "run": "retries",
            "behind_max": "retries",
            "in_flight_max": "retries",
            "parking_s": "s",
            "warm_s": "s",
        },
    )
