"""The Redis delay queue: park failed records, hand them out when due, with leases.

A retryable failure is parked in a sorted set scored by its due time; its offset
can then be committed, because the record now lives in Redis. The scheduler claims
due items into an in-flight set with a lease deadline; a reaper returns items whose
lease expired (their worker died) to the queue. An item leaves Redis only in the
same atomic script that makes its outcome durable (done-marker, or the
dead-letter mark after the dead-letter topic acknowledged it). Due times and lease
deadlines are Redis's clock (TIME inside the scripts): hosts' clocks may disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import orjson
from redis.commands.core import AsyncScript

from reliable_consumer.engine.records import Delivery
from reliable_consumer.engine.redis.client import RedisOps, reply_text
from reliable_consumer.engine.redis.keys import RedisKeys
from reliable_consumer.engine.redis.lua import delay_queue as lua_delay_queue
from reliable_consumer.engine.settings import RetrySettings

log = logging.getLogger(__name__)


class ParkStatus(StrEnum):
    PARKED = "parked"
    EXISTS = "exists"  # a fresh redelivery of a record already parked: nothing to do
    LOST_LEASE = "lost_lease"  # our retry lease expired; the item belongs to another run
    BLOCKED = "blocked"  # parked behind an earlier record of its Kafka key (its chain)


@dataclass(slots=True)
class ParkRequest:
    delivery: Delivery  # with attempt, first_failed_ms and last_error of the next run
    delay_ms: int  # due this long after PARK runs, on Redis's clock
    idem_key: str  # '' when no claim is held
    token: str
    handler: str = ""  # the handler's name: the item is counted under it (breakdown())


# A reason class is a metric label: short, from a closed alphabet, so a message's text can
# neither add series without bound nor smuggle characters into the exposition.
_REASON = re.compile(r"[A-Za-z0-9_.-]{1,64}")
UNKNOWN_REASON = "unknown"  # parked with no error (a record whose chain was gone at PARK)
OTHER_REASON = "other"  # an error whose head is not a short name


def reason_class(last_error: str | None) -> str:
    """The bounded label of an item's last error: what precedes its first ':'.

    ``describe_error`` starts with the exception type ("RetryableError: ..."); the engine's
    own waits start with a word ("busy: ...", "held: ...", "superseded: ..."); a head of a
    few words ("effect failed in Redis: ...") has its spaces made '_'. Anything else,
    including text with no ':' that is not a single name, is "other".
    """
    if not last_error:
        return UNKNOWN_REASON
    head, colon, _ = last_error.partition(":")
    head = head.strip()
    if colon:
        head = head.replace(" ", "_")
    return head if _REASON.fullmatch(head) else OTHER_REASON


@dataclass(frozen=True, slots=True)
class QueueGauges:
    """What the scheduler reports of the shared delay queue, read in one round trip."""

    due: int
    inflight: int
    waiting: int  # parked behind an earlier record of their Kafka key
    breakdown: dict[tuple[str, str], int]  # (handler, reason class) -> parked items
    oldest_due_age_s: float  # how long the earliest due item has been due; 0 when none


@dataclass(frozen=True, slots=True)
class Claim:
    """What one CLAIM_DUE call took, and how late the oldest item it left due is."""

    deliveries: list[Delivery]
    oldest_due_late_ms: int  # by Redis's clock, after the claim; 0 when nothing is due


def now_ms() -> int:
    """This host's wall clock: for timestamps people read, never for due times or leases."""
    return int(time.time() * 1000)


class DelayQueue(Protocol):
    """What the scheduler and the record path ask of a delay queue: ``RetryQueue`` on one
    slot, ``sharded.retry_queues.ShardedRetryQueues`` over the order shards."""

    async def park(self, request: ParkRequest) -> ParkStatus: ...

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[ParkStatus]: ...

    async def claim_due(self, *, lease_ms: int, limit: int) -> list[Delivery]: ...

    async def claim(self, *, lease_ms: int, limit: int) -> Claim: ...

    async def reap(self, *, limit: int = 1000) -> int: ...

    async def depth(self) -> tuple[int, int]: ...

    async def sizes(self) -> tuple[int, int, int]: ...

    async def breakdown(self) -> dict[tuple[str, str], int]: ...

    async def gauges(self) -> QueueGauges: ...

    async def next_due_ms(self) -> int | None: ...

    async def due_in_ms(self) -> int | None: ...


class RetryQueue:
    def __init__(self, ops: RedisOps, keys: RedisKeys, *, max_batch: int = 500) -> None:
        self._ops = ops
        self._keys = keys
        client = ops.client
        self._park_script: AsyncScript = client.register_script(lua_delay_queue.PARK)
        self._claim_script: AsyncScript = client.register_script(lua_delay_queue.CLAIM_DUE)
        self._reap_script: AsyncScript = client.register_script(lua_delay_queue.REAP)
        self._max_batch = max_batch

    async def park(self, request: ParkRequest) -> ParkStatus:
        return (await self.park_many([request]))[0]

    async def park_many(self, requests: Sequence[ParkRequest]) -> list[ParkStatus]:
        size = self._max_batch
        out: list[ParkStatus] = []
        for i in range(0, len(requests), size):
            out += await self._park_chunk(requests[i : i + size])
        return out

    async def claim_due(self, *, lease_ms: int, limit: int) -> list[Delivery]:
        """Move what is due by Redis's clock to in flight, leased for ``lease_ms``."""
        return (await self.claim(lease_ms=lease_ms, limit=limit)).deliveries

    async def claim(self, *, lease_ms: int, limit: int) -> Claim:
        """``claim_due``, and how late the oldest item left due is, in the same round trip.

        ``limit`` 0 claims nothing and only measures (a scheduler with no room left).
        """
        keys = [self._keys.retry_due, self._keys.retry_inflight, self._keys.retry_items]
        sent = time.monotonic()
        reply = await self._ops.call(lambda: self._claim_script(keys=keys, args=[lease_ms, limit]))
        flat, late_ms = reply[:-1], max(0, int(reply[-1]))
        leased_until = sent + lease_ms / 1000
        out: list[Delivery] = []
        for i in range(0, len(flat), 3):
            lease = int(flat[i + 1])
            try:
                delivery = Delivery.from_json(flat[i + 2], lease=lease)
                delivery.leased_until = leased_until
                out.append(delivery)
            except (ValueError, KeyError, TypeError):
                # Not ours to drop silently: leave it in flight, the reaper re-queues it
                # and the log says which id cannot be read.
                log.error("unreadable retry item", extra={"retry_id": reply_text(flat[i])})
        return Claim(out, late_ms)

    async def reap(self, *, limit: int = 1000) -> int:
        """Re-queue items whose lease ended by Redis's clock (a host's may be off)."""
        keys = [self._keys.retry_due, self._keys.retry_inflight]
        reaped = await self._ops.call(lambda: self._reap_script(keys=keys, args=[limit]))
        return int(reaped)

    async def depth(self) -> tuple[int, int]:
        """(due, in flight) item counts: ``sizes`` without the records waiting in chains."""
        due, inflight, _ = await self.sizes()
        return due, inflight

    async def sizes(self) -> tuple[int, int, int]:
        """(due, in flight, waiting): waiting are parked records behind an earlier record of
        their Kafka key (in its chain), neither due nor in flight until it leaves."""

        async def three() -> tuple[int, int, int]:
            pipe = self._ops.client.pipeline(transaction=False)
            pipe.zcard(self._keys.retry_due)
            pipe.zcard(self._keys.retry_inflight)
            pipe.hlen(self._keys.retry_items)
            due, inflight, items = await pipe.execute()
            return int(due), int(inflight), max(0, int(items) - int(due) - int(inflight))

        return await self._ops.call(three)

    async def breakdown(self) -> dict[tuple[str, str], int]:
        """Parked items by (handler, reason class): exact, and one HGETALL of a hash with a
        field per class, however many items wait. Items parked before the tally existed are
        not in it."""
        raw = await self._ops.call(lambda: self._ops.client.hgetall(self._keys.retry_counts))
        return _breakdown(raw)

    async def gauges(self) -> QueueGauges:
        """Sizes, breakdown and the oldest due item's age, in one pipeline on Redis's clock.

        Released chain heads are due at Redis's now of their release; heads released at
        score 0 by earlier versions (no moment recorded) are left out of the age.
        """

        async def read() -> list[Any]:
            pipe = self._ops.client.pipeline(transaction=False)
            pipe.zcard(self._keys.retry_due)
            pipe.zcard(self._keys.retry_inflight)
            pipe.hlen(self._keys.retry_items)
            pipe.hgetall(self._keys.retry_counts)
            pipe.zrangebyscore(self._keys.retry_due, "(0", "+inf", start=0, num=1, withscores=True)
            pipe.time()
            return list(await pipe.execute())

        due, inflight, items, counts, head, server = await self._ops.call(read)
        now = int(server[0]) * 1000 + int(server[1]) // 1000
        age_ms = max(0, now - int(head[0][1])) if head else 0
        return QueueGauges(
            due=int(due),
            inflight=int(inflight),
            waiting=max(0, int(items) - int(due) - int(inflight)),
            breakdown=_breakdown(counts),
            oldest_due_age_s=age_ms / 1000,
        )

    async def next_due_ms(self) -> int | None:
        async def first() -> list[Any]:
            return list(await self._ops.client.zrange(self._keys.retry_due, 0, 0, withscores=True))

        head = await self._ops.call(first)
        return int(head[0][1]) if head else None

    async def due_in_ms(self) -> int | None:
        """How long until the earliest item is due, by Redis's clock; None when none waits.

        The due times are Redis's TIME, so comparing them with this host's clock would make
        a host behind wait too long and one ahead poll without pause.
        """

        async def head_and_now() -> tuple[list[Any], list[Any]]:
            pipe = self._ops.client.pipeline(transaction=False)
            pipe.zrange(self._keys.retry_due, 0, 0, withscores=True)
            pipe.time()
            head, server = await pipe.execute()
            return list(head), list(server)

        head, server = await self._ops.call(head_and_now)
        if not head:
            return None
        now = int(server[0]) * 1000 + int(server[1]) // 1000
        return max(0, int(head[0][1]) - now)

    async def _park_chunk(self, batch: Sequence[ParkRequest]) -> list[ParkStatus]:
        records = [
            [
                r.delivery.retry_id,
                r.delivery.to_json(),
                str(r.delay_ms),
                r.idem_key,
                r.token,
                "" if r.delivery.retry_lease is None else str(r.delivery.retry_lease),
                r.delivery.chain,
                r.handler,
                reason_class(r.delivery.last_error),
            ]
            for r in batch
        ]
        args = [orjson.dumps(records)]
        keys = [self._keys.retry_inflight, self._keys.retry_due, self._keys.retry_items]
        replies = await self._ops.call(
            lambda: self._park_script(keys=keys, args=args), durable=True
        )
        return [ParkStatus(reply_text(r)) for r in replies]


def _breakdown(raw: dict[Any, Any]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for field, count in raw.items():
        handler, _, reason = reply_text(field).partition("|")
        if int(count) > 0:
            out[handler, reason] = int(count)
    return out


# Runs a batch of retries to a durable fate, record by record when the batch breaks
# (Processor.process_reliably); the callable says when to give up (the scheduler stops).
ProcessRetries = Callable[[list[Delivery], Callable[[], bool]], Awaitable[object]]


class RetryScheduler:
    """Claims due retries and runs them, a batch at a time, through the fresh records' path.

    Like a fetched batch, a claimed one goes through the isolating path: a record that
    breaks processing itself is retried alone and dead-lettered as ``internal`` after a few
    tries, so it neither holds its batch-mates back nor loops through the reaper forever.
    """

    def __init__(
        self,
        queue: DelayQueue,
        process: ProcessRetries,
        policy: RetrySettings,
        *,
        max_in_flight: int,
        on_depth: Callable[[int, int, int], None] | None = None,
        on_gauges: Callable[[QueueGauges], None] | None = None,
        on_lateness: Callable[[int], None] | None = None,
        on_next_due: Callable[[float | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_lateness(ms)`` hears, after every claim, how late the oldest retry not yet
        run is (RetryPriority.observe: late retries then go before fresh records);
        ``on_next_due(s)``, before each wait, in how long the next retry falls due (None:
        none waits, or the scheduler stopped; RetryLane.expect: fresh records then let it
        go first)."""
        self._queue = queue
        self._process = process
        self._policy = policy
        self._max_in_flight = max_in_flight
        self._in_flight = 0
        self._clock = clock
        # Each running batch, with when it was claimed and how late its items were at least
        # then (the oldest item left due, due after them): a claimed retry is late until it
        # has run, not only until it leaves the queue.
        self._running: dict[asyncio.Task[None], tuple[float, int]] = {}
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()  # stop, or a batch ended: look again now
        self._on_depth = on_depth
        self._on_gauges = on_gauges
        self._on_lateness = on_lateness
        self._on_next_due = on_next_due
        # Set while run() is not running: no batch can start then.
        self._loop_ended = asyncio.Event()
        self._loop_ended.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def run(self) -> None:
        """Loop until stopped: reap expired leases, claim what is due, run it."""
        self._loop_ended.clear()
        try:
            await self._loop()
        finally:
            self._loop_ended.set()
            if self._on_next_due:  # no turn waits for a scheduler that stopped
                self._on_next_due(None)

    async def _loop(self) -> None:
        reap_every_s = max(self._policy.lease_ms / 4000, 0.1)
        next_reap = 0.0
        while not self._stop.is_set():
            loop_now = time.monotonic()
            if loop_now >= next_reap:
                reaped = await self._queue.reap()
                if reaped:
                    log.warning("retry leases expired; items re-queued", extra={"count": reaped})
                if self._on_gauges:
                    gauges = await self._queue.gauges()
                    self._on_gauges(gauges)
                    if self._on_depth:
                        self._on_depth(gauges.due, gauges.inflight, gauges.waiting)
                elif self._on_depth:
                    self._on_depth(*await self._queue.sizes())
                next_reap = loop_now + reap_every_s
            self._wake.clear()  # a batch ending from here on wakes the wait below
            free = self._max_in_flight - self._in_flight
            # With no room the call claims nothing and only measures the lateness.
            claim = await self._queue.claim(
                lease_ms=self._policy.lease_ms, limit=max(0, min(free, self._policy.claim_batch))
            )
            claimed = claim.deliveries
            if claimed:
                self._in_flight += len(claimed)
                task = asyncio.create_task(self._run_batch(claimed))
                self._running[task] = (self._clock(), claim.oldest_due_late_ms)
                task.add_done_callback(self._batch_ended)
            if self._on_lateness:
                self._on_lateness(max(claim.oldest_due_late_ms, self.running_late_ms()))
            if claimed and len(claimed) == min(free, self._policy.claim_batch):
                continue  # more may be due right now
            if self._on_next_due and not claim.oldest_due_late_ms:
                # Nothing left due: the turn is over now, not a round trip later (the batch
                # just started runs before the waves it released); the next due moment
                # comes with the reading below.
                self._on_next_due(None)
            await self._wait_for_next()

    def running_late_ms(self) -> int:
        """How late the running batches' items are at least: claimed that late, and since
        then running (0 when none runs)."""
        now = self._clock()
        return max(
            (late + round((now - at) * 1000) for at, late in self._running.values()), default=0
        )

    def _batch_ended(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._wake.set()  # room to claim more, and a new reading of how late they are

    async def _wait_for_next(self) -> None:
        """Until the next item is due or the poll interval ends, or sooner when a batch
        ends (the room it frees is claimed at once; the priority hears it has run)."""
        wait_s = self._policy.poll_interval_ms / 1000
        due_in = await self._queue.due_in_ms()
        if self._on_next_due:
            self._on_next_due(None if due_in is None else due_in / 1000)
        if due_in is not None:
            wait_s = min(wait_s, due_in / 1000)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=max(wait_s, 0.005))

    async def _run_batch(self, batch: list[Delivery]) -> None:
        try:
            # Gives up only when stopping: the unfinished items stay in flight, and the
            # reaper re-queues them when their leases expire.
            await self._process(batch, self._stop.is_set)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Not even the isolating path finished (it only raises on a bug of its own):
            # the items stay in flight; their leases expire and the reaper re-queues them.
            log.exception(
                "retry batch processing failed",
                extra={"retry_ids": [d.retry_id for d in batch[:10]], "count": len(batch)},
            )
        finally:
            self._in_flight -= len(batch)

    async def drain(self, timeout_s: float, *, cancel_wait_s: float = 0.5) -> None:
        """Wait for running retries, ``timeout_s`` in all, then cancel the rest.

        The loop first: a claim already sent when ``stop`` was called still starts its
        batch, which must be among those waited for (it once ran on after the producer and
        Redis were closed). A cancelled batch gets ``cancel_wait_s`` to end: one whose
        cancel is swallowed must not hold the shutdown (its items stay in flight, and the
        reaper re-queues them when their leases expire).
        """
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._loop_ended.wait()
        if self._running:
            left = max(0.0, deadline - time.monotonic())
            _, pending = await asyncio.wait(set(self._running), timeout=left)
            for task in pending:
                task.cancel()
            if pending:
                _, stuck = await asyncio.wait(pending, timeout=cancel_wait_s)
                if stuck:
                    log.warning(
                        "retry batches did not end when cancelled; left to their leases",
                        extra={"count": len(stuck)},
                    )
