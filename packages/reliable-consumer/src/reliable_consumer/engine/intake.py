"""The intake: fetched records into batches, bounded by the in-flight limits, in key order.

``run`` loops on ``getmany``; each fetched record is tracked in ``OffsetTracker`` and a
partition's records go to a task per batch, which waits for an earlier batch of the
partition only when their Kafka keys overlap (per-key order). When an in-flight limit
(records or bytes) is reached the loop waits for room, pauses partitions only when
starved, and keeps polling, so the group never evicts the worker for a missed poll.
While the oldest due retry is late by more than a bound, ``RetryPriority`` holds every
partition paused (polling goes on), so the retries' batches get the event loop and the
core; it lets fresh records in again once the retries are on time, or after a bounded pause.
Meanwhile the fresh records fetched before the pause wait at the handler runner's door
(batch/lane.py follows ``RetryPriority.active``).
The worker (worker.py) owns the lifecycle, commits and rebalances around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from reliable_consumer.engine.kafka.acls import STALL as ACCESS_DENIED
from reliable_consumer.engine.kafka.acls import is_refusal, principal
from reliable_consumer.engine.kafka.group_check import GROUP_JOIN_REFUSED, join_refusal
from reliable_consumer.engine.kafka.offsets import OffsetTracker
from reliable_consumer.engine.observation.http import HealthState
from reliable_consumer.engine.records import Delivery, clean_headers
from reliable_consumer.engine.settings import Settings

log = logging.getLogger(__name__)

POLL_TIMEOUT_MS = 200
PAUSED_POLL_TIMEOUT_MS = 20
CAPACITY_WAIT_S = 1.0

# A batch of deliveries, and when to give up on it: True once every record has a fate.
Process = Callable[[list[Delivery], Callable[[], bool]], Awaitable[bool]]


class RetryPriority:
    """Whether fresh fetches wait so that late retries run first, and for how long.

    A retry was promised a moment (due at 12:00:05); a fresh backlog is late anyway. So
    while the oldest due retry is later than ``after_ms`` the intake fetches nothing new.
    It fetches again once that lateness is down to half the bound (hysteresis: one episode,
    not a flapping pair, per burst), or after ``max_pause_ms`` of one episode; then fresh
    records get at least as long as the episode lasted before the next one may start, so
    retries, however many, hold fresh records back for at most half the time (short
    episodes back to back would otherwise starve them too). An episode starts on a
    reading, or when asked (``active``) while a claimed retry has been running for longer
    than the bound (``running_late``: the scheduler's, no round trip; a reading may be
    slow to come while the fresh records keep the loop busy). With no new reading (the
    scheduler stalled) it ends at the time bound.
    """

    def __init__(
        self,
        after_ms: int | None,
        max_pause_ms: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[bool, str, float], None] | None = None,
    ) -> None:
        """``on_change(active, why, paused_s)`` hears of each start and end of an episode."""
        self._after_ms = after_ms or None  # 0 and None: off
        self._max_pause_s = max_pause_ms / 1000
        self._clock = clock
        self._on_change = on_change
        self._since: float | None = None  # the start of the running episode
        self._fresh_until = 0.0  # no episode starts before this moment
        self._stopped = False  # no episode starts any more
        self._late_ms = 0
        self.paused_s = 0.0  # in all ended episodes
        # How late the claimed retries still running are at least (RetryScheduler's).
        self.running_late: Callable[[], int] = _none_late

    def observe(self, oldest_due_late_ms: int) -> None:
        """A reading of the scheduler: how late the oldest due retry is, by Redis's clock."""
        self._late_ms = oldest_due_late_ms
        now = self._clock()
        self._settle(now)
        if (
            self._since is None
            and self._after_ms is not None
            and not self._stopped
            and oldest_due_late_ms > self._after_ms
            and now >= self._fresh_until
        ):
            self._since = now
            if self._on_change:
                self._on_change(True, f"oldest due retry {oldest_due_late_ms} ms late", 0.0)

    def active(self) -> bool:
        """True while fresh records are held back; ends an episode past its time bound, and
        starts one when a running retry is already later than the bound."""
        if self._since is not None:
            self._settle(self._clock())
        elif self._after_ms is not None and (late := self.running_late()) > self._after_ms:
            self.observe(late)
        return self._since is not None

    def interrupt(self, why: str, *, last: bool = False) -> None:
        """End the running episode now (a rebalance, a shutdown): what it held goes on
        (then, as after any episode, fresh records get as long as it lasted). ``last``: no
        episode starts again (the worker is stopping; its retries still running must not
        hold the fresh waves that are finishing)."""
        if last:
            self._stopped = True
        if self._since is not None:
            self._end(self._clock(), why)

    def _settle(self, now: float) -> None:
        if self._since is None or self._after_ms is None:
            return
        if self._late_ms * 2 <= self._after_ms:
            self._end(now, "retries on time")
        elif now - self._since >= self._max_pause_s:
            self._end(now, "pause limit reached")

    def _end(self, now: float, why: str) -> None:
        assert self._since is not None
        paused = now - self._since
        self.paused_s += paused
        self._since = None
        self._fresh_until = now + paused  # fresh records' turn: as long as they waited
        if self._on_change:
            self._on_change(False, why, paused)


def _none_late() -> int:
    return 0


class Intake:
    """Fetches, dispatches batches and applies backpressure; the worker starts and stops it."""

    def __init__(
        self,
        settings: Settings,
        tracker: OffsetTracker[TopicPartition],
        health: HealthState,
        stop: asyncio.Event,
        on_done: Callable[[int], None],
    ) -> None:
        """``on_done(n)`` hears of n more records done (their offsets may be committed)."""
        self._settings = settings
        self._tracker = tracker
        self._health = health
        self._stop = stop
        self._on_done = on_done
        self._capacity_freed = asyncio.Event()
        self.tasks: dict[TopicPartition, set[asyncio.Task[None]]] = {}
        # Per partition, the running batches and the Kafka keys each holds (for ordering).
        self._batches: dict[TopicPartition, list[tuple[asyncio.Task[None], frozenset[bytes]]]] = {}
        self.revoking: set[TopicPartition] = set()
        self.paused: set[TopicPartition] = set()
        self.in_flight = 0
        # Bytes of those records (key + value + headers), bounded by max_in_flight_bytes, and
        # the largest record of the last fetch: how many more may be asked for.
        self.in_flight_bytes = 0
        self._size_hint = settings.kafka.max_partition_fetch_bytes
        self._starved = False  # no room freed up during a whole capacity wait
        self._consumer: AIOKafkaConsumer | None = None
        self._process: Process | None = None
        # Topics whose handler's circuit is open (the worker sets it once the breakers
        # exist): their partitions stay paused, so nothing more piles up behind the gate.
        self.held_topics: Callable[[], set[str]] = set
        # True while late retries go first (RetryPriority.active): every partition paused.
        self.retries_first: Callable[[], bool] = lambda: False

    async def run(self, consumer: AIOKafkaConsumer, process: Process) -> None:
        """Poll until the stop event; every batch goes to ``process`` (``process_reliably``)."""
        self._consumer, self._process = consumer, process
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await self._poll(consumer, stopping)
        finally:
            stopping.cancel()

    async def _poll(self, consumer: AIOKafkaConsumer, stopping: asyncio.Future[Any]) -> None:
        while not self._stop.is_set():
            capacity = self.room()
            if capacity <= 0:
                # Wait for room rather than pausing: aiokafka drops a paused partition's
                # prefetched records, so pausing at every full moment would refetch them.
                # Only when no room frees up for a while are all partitions paused, and
                # getmany keeps being called so the group never sees a missed poll.
                self._capacity_freed.clear()
                try:
                    await asyncio.wait_for(self._capacity_freed.wait(), CAPACITY_WAIT_S)
                    self._starved = False
                except TimeoutError:
                    self._starved = True
                capacity = self.room()
                if capacity <= 0:
                    self.apply_backpressure()  # paused before the fetch: nothing more comes
            timeout = PAUSED_POLL_TIMEOUT_MS if self.paused else POLL_TIMEOUT_MS
            # WORKER_KAFKA__MAX_POLL_RECORDS at most (asking for the whole room overrode it):
            # a poll's records are decoded and dispatched in one go, holding the loop (late
            # retries' batches too), and after a pause the whole in-flight limit may wait.
            take = max(1, min(capacity, self._settings.kafka.max_poll_records))
            fetch = asyncio.ensure_future(consumer.getmany(timeout_ms=timeout, max_records=take))
            # During a rebalance aiokafka's getmany waits for the new assignment with no
            # timeout; racing it against the stop event lets SIGTERM act at once. Nothing is
            # lost by cancelling: records are only consumed once getmany returns them.
            await asyncio.wait({fetch, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not fetch.done():
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, KafkaError):
                    await fetch
                break
            try:
                batches = fetch.result()
            except KafkaError as exc:
                refused = join_refusal(exc, self._settings.kafka)
                if refused is not None:
                    # aiokafka's coordinator raises the refusal here and joins again once it
                    # is consumed; the stall says it once, the join's success clears it
                    # (worker._on_assigned). The wait below paces the joins.
                    self._health.stalls.report(GROUP_JOIN_REFUSED, refused)
                elif is_refusal(exc):
                    # An ACL taken away while running (the start checked them): a stall
                    # naming it, cleared by the next fetch that is let through.
                    self._health.stalls.report(
                        ACCESS_DENIED,
                        f"Kafka refuses a fetch or commit to {principal(self._settings.kafka)}:"
                        f" {exc!r}; the worker needs Read on its topics and group "
                        "(docs/security.md, `service acls`)",
                    )
                else:
                    self._health.kafka_ok = False
                    log.warning("fetch failed", extra={"error": repr(exc)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)
                continue
            self._health.kafka_ok = True
            self._health.stalls.clear(ACCESS_DENIED)
            self._health.last_poll = self._health.clock()
            if batches:
                self._size_hint = max(_size(r) for records in batches.values() for r in records)
            for tp, records in batches.items():
                epoch = self._tracker.epoch(tp)
                if epoch is None or tp in self.revoking:
                    continue  # fetched before a revoke: the next owner reads it again
                fresh = self._tracker.fetched_many(tp, epoch, records)
                size = self._settings.max_batch_records
                for i in range(0, len(fresh), size):
                    self._dispatch(tp, epoch, fresh[i : i + size])
            self.apply_backpressure()

    def room(self) -> int:
        """How many more records may be fetched: under the count and the byte budget.

        By bytes, as many records as fit if each is as large as the largest of the last
        fetch; none while that would cross the budget, unless nothing is in flight (so a
        record larger than the whole budget still goes through, alone).
        """
        room = self._settings.max_in_flight - self.in_flight
        free = self._settings.max_in_flight_bytes - self.in_flight_bytes
        if self.in_flight_bytes and free < self._size_hint:
            return 0
        return min(room, max(1, free // max(self._size_hint, 1)))

    def _dispatch(
        self, tp: TopicPartition, epoch: int, records: list[ConsumerRecord[Any, Any]]
    ) -> None:
        """Start one batch; it waits for earlier batches of the partition it must follow.

        Headers in the worker's reserved namespace are dropped here, before anything reads
        or copies them (a producer must not set a dead letter's reason or a redrive mark).
        """
        inject = self._settings.fault_injection
        deliveries = [
            Delivery(  # positional: this runs once per record
                r.topic,
                r.partition,
                r.offset,
                r.key,
                r.value,
                clean_headers(r.headers, fault_injection=inject) if r.headers else (),
                r.timestamp,
            )
            for r in records
        ]
        ordering = self._settings.ordering
        running = [(t, k) for t, k in self._batches.get(tp, ()) if not t.done()]
        keys = frozenset(d.key for d in deliveries if d.key is not None)
        if ordering == "partition":
            before = [t for t, _ in running]
        elif ordering == "key":
            before = [t for t, k in running if not keys.isdisjoint(k)]
        else:
            before = []
        nbytes = sum(_size(r) for r in records)
        task = asyncio.create_task(self._handle(tp, epoch, deliveries, before, nbytes))
        running.append((task, keys))
        self._batches[tp] = running
        self.tasks.setdefault(tp, set()).add(task)
        self.in_flight += len(deliveries)
        self.in_flight_bytes += nbytes

    async def _handle(
        self,
        tp: TopicPartition,
        epoch: int,
        deliveries: list[Delivery],
        before: list[asyncio.Task[None]],
        nbytes: int,
    ) -> None:
        def give_up() -> bool:  # shutdown, or the partition moved on to another owner
            return self._stop.is_set() or self._tracker.epoch(tp) != epoch

        assert self._process is not None
        try:
            if before:
                await asyncio.wait(before)
            finished = await self._process(deliveries, give_up)
            if not finished:  # left uncommitted: the next owner or run redelivers them
                return
            if not self._tracker.done_many(tp, epoch, [d.offset for d in deliveries]):
                return  # the partition was revoked meanwhile: nothing to count
            self._on_done(len(deliveries))
        finally:
            self.in_flight -= len(deliveries)
            self.in_flight_bytes -= nbytes
            self._capacity_freed.set()
            tasks = self.tasks.get(tp)
            if tasks is not None:
                tasks.discard(asyncio.current_task())

    def apply_backpressure(self) -> None:
        """Pause what is over its limit, resume what is under; polling never stops."""
        assert self._consumer is not None
        assigned = set(self._consumer.assignment()) - self.revoking
        if (self._starved and self.room() <= 0) or self.retries_first():
            # Full for a whole wait, or late retries go first: pause everything, keep polling
            # (heartbeats and commits go on; a newly assigned partition is paused here too).
            want = assigned
        else:
            limit = self._settings.max_in_flight_per_partition
            want = {tp for tp in assigned if self._tracker.in_flight(tp) >= limit}
        if held := self.held_topics():
            want |= {tp for tp in assigned if tp.topic in held}
        if pause := want - self.paused:
            self._consumer.pause(*pause)
        if resume := (self.paused - want) & assigned:
            self._consumer.resume(*resume)
        self.paused = want

    def running(self, tps: Iterable[TopicPartition] | None = None) -> set[asyncio.Task[None]]:
        """The batch tasks still running, of the given (default: all) partitions."""
        chosen = self.tasks if tps is None else {tp: self.tasks.get(tp, set()) for tp in tps}
        return {t for tasks in chosen.values() for t in tasks}

    def forget(self, revoked: set[TopicPartition]) -> None:
        """Drop what the revoked partitions left: their batches, pauses and revoking mark."""
        for tp in revoked:
            self._batches.pop(tp, None)
            self.tasks.pop(tp, None)
        self.paused -= revoked
        self.revoking -= revoked


def _size(r: ConsumerRecord[Any, Any]) -> int:
    """A record's bytes as the in-flight budget counts them: key, value and headers."""
    size = len(r.key or b"") + len(r.value or b"")
    if r.headers:
        size += sum(len(k) + len(v or b"") for k, v in r.headers)
    return size
